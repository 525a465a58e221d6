"""kube.listwatch: Collection's requests and answers against the scripted stand-in and kmock;
the list_watch loop with a scripted source and a fake clock."""

from __future__ import annotations

import asyncio
import gc
import json
import random
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from kubernetes import client as k8s
from kubernetes.config import ConfigException

from kai_fractions.kube import BadAnswer, Forbidden, Gone, Kube, KubeError, Transient, listwatch
from kai_fractions.kube.listwatch import Collection, list_watch, watch_event
from kai_fractions.kube.retry import Backoff
from tests.support.clock import FakeClock
from tests.support.kube import pod_manifest

from .standin import TIMEOUT, Answer, StandIn, Stream, events, status

PODS = "/api/v1/pods"
SELECTOR = "spec.schedulerName=kai-scheduler"


def pod(name: str, version: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ns", "resourceVersion": version}}


def page(names: list[str], version: str, token: str = "") -> Answer:
    meta = {"resourceVersion": version, **({"continue": token} if token else {})}
    return Answer(200, {"kind": "PodList", "apiVersion": "v1", "metadata": meta,
                        "items": [pod(name, version) for name in names]})


@pytest.fixture
async def kube_for() -> AsyncIterator[Any]:
    made: list[Kube] = []

    def make(url: str) -> Kube:
        made.append(Kube(k8s.ApiClient(k8s.Configuration(host=url))))
        return made[-1]

    yield make
    for kube in made:
        await kube.close()


def collection(kube: Kube, **options: Any) -> Collection:
    return Collection(kube, PODS, {"fieldSelector": SELECTOR}, what="pod(s)",
                      **{"watch_seconds": 60, "request_timeout": TIMEOUT, **options})


async def all_events(source: Collection, version: str) -> list[tuple[str, Any]]:
    async with asyncio.timeout(TIMEOUT):
        return [event async for event in source.watch(version)]


# -- Collection ---------------------------------------------------------------------------------

@pytest.mark.integration
async def test_a_list_comes_in_pages_and_the_first_pages_version_is_the_snapshots(kube_for):
    async with StandIn(page(["a"], "40", "t1"), page(["b"], "41", "t2"), page(["c"], "42")
                       ) as api:
        items, version = await collection(kube_for(api.url), page_size=1).list()
    assert ([item["metadata"]["name"] for item in items], version) == (["a", "b", "c"], "40")
    assert [(seen.path, seen.query) for seen in api.seen] == [
        (PODS, {"fieldSelector": SELECTOR, "limit": "1"}),
        (PODS, {"fieldSelector": SELECTOR, "limit": "1", "continue": "t1"}),
        (PODS, {"fieldSelector": SELECTOR, "limit": "1", "continue": "t2"})]


@pytest.mark.integration
async def test_a_lists_resource_version_is_sent_on_its_first_page_only(kube_for):
    async with StandIn(page(["a"], "40", "t1"), page(["b"], "40")) as api:
        await collection(kube_for(api.url), page_size=1).list("0")
    assert [(seen.query.get("resourceVersion"), seen.query.get("continue"))
            for seen in api.seen] == [("0", None), (None, "t1")]


@pytest.mark.integration
async def test_keep_is_applied_to_each_listed_object_as_its_page_arrives(kube_for):
    kept: list[str] = []

    def keep(obj: Any) -> str:
        kept.append(obj["metadata"]["name"])
        return obj["metadata"]["name"].upper()

    async with StandIn(page(["a", "b"], "40", "t1"), page(["c"], "41")) as api:
        items, _ = await collection(kube_for(api.url), keep=keep).list()
    assert (items, kept) == (["A", "B", "C"], ["a", "b", "c"])


class _Page(dict):
    """A decoded page a weak reference can follow (a plain dict cannot be)."""


@pytest.mark.integration
async def test_a_page_is_let_go_before_the_next_one_is_read(kube_for, monkeypatch):
    # Held until its successor was decoded, each page doubled what a list's pages take at a
    # time: about 0.3 MB of a mirror's RSS at 25 pods a page (benchmarks/README.md, P6).
    pages: list[weakref.ref] = []
    alive_at_read: list[bool] = []

    def decoded(raw: bytes, what: str) -> _Page:
        body = _Page(json.loads(raw))
        pages.append(weakref.ref(body))
        return body

    async def pace() -> None:  # the page has arrived: is the one before it still held?
        gc.collect()
        alive_at_read.append(any(ref() is not None for ref in pages))

    monkeypatch.setattr(listwatch, "decoded", decoded)
    async with StandIn(page(["a", "b"], "40", "t1"), page(["c"], "41", "t2"),
                       page(["d"], "42")) as api:
        items, _ = await collection(kube_for(api.url), keep=lambda obj: 1,
                                    pace=pace).list()
    assert items == [1, 1, 1, 1]
    assert alive_at_read == [False, False, False]


@pytest.mark.integration
async def test_pace_is_awaited_once_each_page_has_arrived_and_before_it_is_decoded(kube_for):
    order: list[tuple[str, Any]] = []

    async def pace() -> None:  # the mirror's: a gap between the calls it serves
        order.append(("pace", len(api.seen)))

    def keep(obj: Any) -> Any:
        order.append(("keep", obj["metadata"]["name"]))
        return obj

    async with StandIn(page(["a"], "40", "t1"), Answer(200, b"<html>gateway</html>")) as api:
        with pytest.raises(BadAnswer, match=r"^list pod\(s\): the API server's answer is not "):
            await collection(kube_for(api.url), page_size=1, keep=keep, pace=pace).list()
    # The second page was paced once it came, then found not to be JSON when decoded.
    assert order == [("pace", 1), ("keep", "a"), ("pace", 2)]


@pytest.mark.integration
async def test_a_watch_sends_its_query_and_yields_each_event_until_the_stream_ends(kube_for):
    script = [("ADDED", pod("a", "41")), ("BOOKMARK", {"metadata": {"resourceVersion": "45"}}),
              ("DELETED", pod("a", "46"))]
    async with StandIn(Stream([b"\n", *events(*script)])) as api:
        seen = await all_events(collection(kube_for(api.url), watch_seconds=77), "40")
    assert seen == script
    (request,) = api.seen
    assert (request.method, request.path, request.query) == ("GET", PODS, {
        "fieldSelector": SELECTOR, "watch": "true", "allowWatchBookmarks": "true",
        "timeoutSeconds": "77", "resourceVersion": "40"})


@pytest.mark.integration
async def test_a_watch_from_no_version_sends_none(kube_for):
    async with StandIn(Stream(events(("ADDED", pod("a", "1"))))) as api:
        await all_events(collection(kube_for(api.url)), "")
    assert "resourceVersion" not in api.seen[0].query


@pytest.mark.integration
async def test_a_line_the_skip_refuses_is_dropped_without_being_parsed(kube_for):
    offered: list[Any] = []

    def skip(line: bytes) -> bool:
        offered.append(line)
        return b'"echo"' in line

    async with StandIn(Stream([*events(("MODIFIED", pod("echo", "41"))), b'{"echo" not json\n',
                               *events(("MODIFIED", pod("other", "42")))])) as api:
        seen = await all_events(collection(kube_for(api.url), skip=skip), "40")
    assert seen == [("MODIFIED", pod("other", "42"))]  # the broken line was never parsed
    assert len(offered) == 3 and all(isinstance(line, bytes) for line in offered)


REFUSALS = {
    "list-403": ("list", [Answer(403, status(403, "Forbidden", "no list"))], Forbidden,
                 r"^list pod\(s\): .*no list.*RBAC"),
    "list-503": ("list", [Answer(503, status(503, "ServiceUnavailable", "busy"))], Transient,
                 r"^list pod\(s\): 503 ServiceUnavailable: busy$"),
    "list-page-410": ("list", [page(["a"], "40", "t1"),
                               Answer(410, status(410, "Expired", "continue expired"))],
                      Gone, "410 Expired: continue expired"),
    "list-not-json": ("list", [Answer(200, b"<html>gateway</html>")], BadAnswer, "not JSON"),
    "watch-403": ("watch", [Answer(403, status(403, "Forbidden", "no watch"))], Forbidden,
                  "RBAC"),
    "watch-410": ("watch", [Answer(410, status(410, "Expired", "too old"))], Gone,
                  r"^watch pod\(s\): 410 Expired: too old$"),
    "error-event-410": ("watch", [Stream(events(("ADDED", pod("a", "41")), ("ERROR", status(
        410, "Expired", "too old resource version: 1 (40)"))))], Gone,
                        r"^watch pod\(s\): 410 Expired: too old resource version: 1 \(40\)$"),
    "error-event-500": ("watch", [Stream(events(("ADDED", pod("a", "41")), ("ERROR", status(
        500, "InternalError", "etcd is away"))))], Transient, "500 InternalError: etcd is away"),
    "error-event-403": ("watch", [Stream(events(("ADDED", pod("a", "41")), ("ERROR", status(
        403, "Forbidden", "no watch"))))], Forbidden, "no watch.*RBAC"),
    "error-event-400": ("watch", [Stream(events(("ADDED", pod("a", "41")), ("ERROR", status(
        400, "BadRequest", "bad selector"))))], KubeError,
                        r"^watch pod\(s\): 400 BadRequest: bad selector$"),
    "event-not-json": ("watch", [Stream([*events(("ADDED", pod("a", "41"))), b"<html>\n"])],
                       BadAnswer, r"^watch pod\(s\): an event that is not JSON \(b'<html>'\)$"),
}


@pytest.mark.integration
@pytest.mark.parametrize(("call", "script", "error", "message"), list(REFUSALS.values()),
                         ids=list(REFUSALS))
async def test_each_refusal_of_the_list_or_the_watch_is_its_error(
        kube_for, call, script, error, message):
    async with StandIn(*script) as api:
        source = collection(kube_for(api.url))
        handed: list[str] = []
        with pytest.raises(error, match=message) as raised:
            if call == "list":
                await source.list()
            else:
                async for kind, _ in source.watch("40"):
                    handed.append(kind)
    assert type(raised.value) is error
    # An ERROR event ends the watch after what came before it.
    assert handed == (["ADDED"] if isinstance(script[-1], Stream) else [])


def test_watch_event_reads_str_or_bytes_and_passes_blank_lines():
    line = json.dumps({"type": "ADDED", "object": pod("a", "1")})
    assert watch_event(line, "w") == watch_event(line.encode(), "w") == ("ADDED", pod("a", "1"))
    assert watch_event(b"  ", "w") is None
    assert watch_event(line, "w", skip=lambda raw: True) is None


@pytest.mark.integration
async def test_against_kmock_the_list_and_a_watch_from_its_version_see_the_pods(kube):
    kube.core.create_namespaced_pod("ns", pod_manifest("before", "ns"))
    client = Kube(kube.api_client)
    source = Collection(client, PODS, what="pod(s)", watch_seconds=5)
    try:
        items, version = await source.list()
        assert [item["metadata"]["name"] for item in items] == ["before"]
        assert version == str(kube.emulator.revision)
        watch = source.watch(version)
        async with asyncio.timeout(TIMEOUT):
            assert (await anext(watch))[0] == "ADDED"  # kmock replays what it has
            await asyncio.to_thread(kube.core.create_namespaced_pod, "ns",
                                    pod_manifest("after", "ns"))
            kind, obj = await anext(watch)
        await watch.aclose()
    finally:
        await client.close()
    assert (kind, obj["metadata"]["name"]) == ("ADDED", "after")
    (request,) = [r for r in kube.requests("GET", PODS) if r.params.get("watch")]
    assert dict(request.params) == {"watch": "true", "allowWatchBookmarks": "true",
                                    "timeoutSeconds": "5", "resourceVersion": version}


# -- list_watch with a scripted source ----------------------------------------------------------

@dataclass(frozen=True)
class Tick:
    """In a watch's script: this much time passes (a long watch)."""

    seconds: float


@dataclass
class Run:
    calls: list[str] = field(default_factory=list)
    """`list <version>`, `watch <version>`: each call of the source, in order."""
    handled: list[tuple[str, Any]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def on_list(self, items: list[Any]) -> None:
        self.handled.append(("list", [item["metadata"]["name"] for item in items]))

    def on_event(self, kind: str, obj: Any) -> None:
        self.handled.append((kind, obj["metadata"].get("resourceVersion")))

    def on_failure(self, error: KubeError) -> None:
        self.failures.append(str(error))


class Scripted:
    """Each list() answers the next item of `lists` (raised when an exception), each watch()
    the next events of `watches` (an exception raised where it stands, a Tick run on the
    clock). Once a script is spent, the next call waits for ever: the loop is cancelled there."""

    what = "pod(s)"

    def __init__(self, lists: list[Any], watches: list[list[Any]], clock: FakeClock) -> None:
        self.lists, self.watches = list(lists), [list(events) for events in watches]
        self.run, self.clock = Run(), clock
        self.spent = asyncio.Event()

    async def _next(self, script: list[Any]) -> Any:
        if not script:
            self.spent.set()
            await asyncio.Event().wait()
        return script.pop(0)

    async def list(self, resource_version: str = "") -> Any:
        self.run.calls.append(f"list {resource_version!r}")
        item = await self._next(self.lists)
        if isinstance(item, Exception):
            raise item
        return item

    async def watch(self, resource_version: str) -> AsyncIterator[tuple[str, Any]]:
        self.run.calls.append(f"watch {resource_version}")
        for event in await self._next(self.watches):
            if isinstance(event, Tick):
                self.clock.now += event.seconds
            elif isinstance(event, Exception):
                raise event
            else:
                yield event


BACKOFF = Backoff(base=1.0, cap=8.0, jitter=0.0)
"""Delays of 1, 2, 4, 8, 8 ... seconds: what a test reads off the clock."""
RESYNC = 100.0


async def run(lists: list[Any], watches: list[list[Any]], **options: Any
              ) -> tuple[Run, list[float]]:
    """list_watch over the scripts until they are spent; then cancelled."""
    clock = FakeClock()
    source = Scripted(lists, watches, clock)
    task = asyncio.create_task(list_watch(
        source, source.run.on_list, source.run.on_event, on_failure=source.run.on_failure,
        monotonic=clock.monotonic, clock=clock,
        **{"backoff": BACKOFF, "resync_seconds": RESYNC, **options}))
    async with asyncio.timeout(TIMEOUT):
        await source.spent.wait()
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    return source.run, clock.sleeps


async def test_it_lists_first_hands_every_event_on_and_resumes_after_the_last_one():
    ran, sleeps = await run(
        lists=[([pod("a", "5")], "10")],
        watches=[[("ADDED", pod("b", "11")), ("MODIFIED", pod("a", "12"))],
                 [("BOOKMARK", {"metadata": {"resourceVersion": "15"}}),
                  ("MODIFIED", {"metadata": {"name": "c"}})],  # no version: 15 still holds
                 [Tick(5)], [Tick(5)]])  # streams the server ended: watched again, from there
    assert ran.calls == ["list ''", "watch 10", "watch 12", "watch 15", "watch 15", "watch 15"]
    assert ran.handled == [("list", ["a"]), ("ADDED", "11"), ("MODIFIED", "12"),
                           ("BOOKMARK", "15"), ("MODIFIED", None)]
    assert (sleeps, ran.failures) == ([], [])


class Listed(list):
    """A list a weak reference can follow: whether anything still holds it."""


async def test_once_handed_on_a_list_is_not_held_by_the_loop_while_it_watches():
    # A cache merges a list and drops it; the loop must not keep it (and every object in it
    # that a newer write since replaced) alive until the next list (benchmarks P6).
    clock = FakeClock()
    source = Scripted([(Listed([pod("a", "5")]), "10")], [], clock)
    seen: list[weakref.ref] = []
    task = asyncio.create_task(list_watch(source, lambda items: seen.append(weakref.ref(items)),
                                          lambda kind, obj: None, clock=clock))
    async with asyncio.timeout(TIMEOUT):
        await source.spent.wait()  # watching now, for ever
    source.lists.clear()
    gc.collect()
    assert len(seen) == 1 and seen[0]() is None
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest.mark.parametrize(("lists", "watches", "calls"), [
    ([([], "10"), ([pod("c", "20")], "20")], [[("ADDED", pod("b", "11")), Gone("too old")]],
     ["list ''", "watch 10", "list ''", "watch 20"]),
    ([Gone("continue token expired"), ([], "10")], [], ["list ''", "list ''", "watch 10"]),
], ids=["watch-gone", "list-page-gone"])
async def test_after_gone_it_lists_again_at_once(lists, watches, calls):
    ran, sleeps = await run(lists, watches)
    assert ran.calls == calls
    assert (sleeps, ran.failures) == ([], [])


async def test_a_server_that_answers_lists_but_fails_every_watch_is_backed_off():
    """Each failure lists again (the node agent's way), and each list works: the loop used to
    count that as progress, and listed twice a second for ever (RBAC without watch, a proxy
    that breaks streaming, throttled watches)."""
    ran, sleeps = await run(
        lists=[([], str(v)) for v in range(10, 17)],
        watches=[[Transient("500")], [Transient("403")], [], [Transient("429")],
                 [Transient("500")], [Transient("500")], [("ADDED", pod("a", "30")), Tick(5)]],
        relist_after_failure=True)
    assert sleeps == [1, 2, 4, 8, 8, 8]  # doubling to the cap (BACKOFF here: 1 s to 8 s)
    assert ran.calls[-3:] == ["list ''", "watch 16", "watch 30"]


async def test_a_retry_after_is_waited_up_to_the_cap():
    _ran, sleeps = await run(
        lists=[Transient("429", 429, retry_after=5.0), Transient("503", 503, retry_after=600.0),
               ([], "10")], watches=[[Tick(5)]])
    assert sleeps == [5, 8]  # the first would have been 1 s; the second is capped (8 s here)


async def test_a_server_that_keeps_answering_gone_is_listed_again_with_a_backoff():
    """The first 410 since the watch last worked lists again at once (its version expired
    while it was away); more in a row are a misbehaving server or proxy, not a hot loop."""
    ran, sleeps = await run(
        lists=[([], "10"), ([], "20"), Gone("continue token expired"), ([], "30"), ([], "40"),
               ([], "50")],
        watches=[[Gone("too old")], [Gone("too old")], [Gone("too old")],
                 [("ADDED", pod("a", "41")), Gone("too old")], [Tick(5)]])
    assert sleeps == [1, 2, 4]  # none after the first 410, nor after the one past an event
    assert ran.failures == []  # an expiry is not a failure
    assert ran.calls[:11] == ["list ''", "watch 10", "list ''", "watch 20", "list ''",
                              "list ''", "watch 30", "list ''", "watch 40", "list ''", "watch 50"]


@pytest.mark.parametrize("line", [b"null", b'"x"', b"[1]", b'{"type": "ADDED", "object": 3}',
                                  b'{"type": "ERROR", "object": {"code": "Gone"}}'])
def test_a_watch_line_that_is_not_a_watch_event_is_a_bad_answer(line):
    with pytest.raises((BadAnswer, Transient)):
        watch_event(line, "watch pods")


async def test_with_cached_lists_it_lists_from_the_cache_but_consistently_after_gone():
    ran, _ = await run(
        lists=[([], "10"), ([], "20"), Transient("503"), ([], "30")],
        watches=[[Gone("too old")], [Tick(RESYNC)], [Transient("reset")]],
        cached_lists=True, relist_after_failure=True)
    assert ran.calls == ["list '0'", "watch 10", "list ''", "watch 20", "list '0'",
                         "list '0'", "watch 30", "list '0'"]


async def test_failures_back_off_more_each_time_up_to_the_cap_and_progress_starts_over():
    ran, sleeps = await run(
        lists=[Transient("refused"), Transient("503"), Forbidden("403"), Transient("timeout"),
               BadAnswer("not JSON"), ([], "10")],
        watches=[[Transient("reset")], [("ADDED", pod("a", "11")), Transient("reset")],
                 [BadAnswer("bad line")], [Tick(5)]])
    # a list that works after failed lists is a server back: the watch failing after it waits
    # the shortest backoff again (so does one after a watch's event)
    assert sleeps == [1, 2, 4, 8, 8, 1, 1, 2]
    assert ran.calls == ["list ''"] * 6 + ["watch 10", "watch 10", "watch 11", "watch 11",
                                            "watch 11"]
    assert ran.failures == ["refused", "503", "403", "timeout", "not JSON", "reset", "reset",
                            "bad line"]


async def test_a_watch_ended_at_once_with_no_events_fails_and_is_backed_off():
    # A server or proxy answering each watch with an empty 200 had the loop ask again at once,
    # tens of thousands of times a second; client-go's reflector counts it a failure.
    ran, sleeps = await run(
        lists=[([], "10")],
        watches=[[], [], [Tick(0.9)], [("ADDED", pod("a", "11"))], [], [Tick(1)], []])
    assert ran.calls == ["list ''"] + ["watch 10"] * 4 + ["watch 11"] * 4
    assert sleeps == [1, 2, 4, 1, 1]  # an event, or a watch a second long, is progress
    assert ran.failures == [
        "watch pod(s): the API server ended the watch at once, with no events"] * 5


async def test_after_a_failure_it_resumes_the_watch_or_lists_again_when_told():
    resumed, _ = await run([([], "10")], [[("ADDED", pod("a", "11")), Transient("reset")], []])
    relisted, _ = await run([([], "10"), ([], "20")],
                            [[("ADDED", pod("a", "11")), Transient("reset")], []],
                            relist_after_failure=True)
    assert resumed.calls[:3] == ["list ''", "watch 10", "watch 11"]
    assert relisted.calls[:4] == ["list ''", "watch 10", "list ''", "watch 20"]


async def test_jittered_waits_are_drawn_from_the_rng_given():
    script = ([Transient("x")] * 3 + [([], "1")], [])
    first = await run(*script, backoff=Backoff(base=1.0, cap=30.0), rng=random.Random(7))
    second = await run(*script, backoff=Backoff(base=1.0, cap=30.0), rng=random.Random(7))
    assert first[1] == second[1] and len(first[1]) == 3
    assert all(0.5 * top <= wait <= top for wait, top in zip(first[1], [1, 2, 4], strict=True))


async def test_it_lists_again_once_resync_seconds_have_passed_since_the_last_list():
    ran, _ = await run(
        lists=[([], "10"), ([pod("a", "20")], "20")],
        watches=[[("ADDED", pod("a", "11")), Tick(60)], [Tick(50), ("ADDED", pod("b", "12"))],
                 []])
    assert ran.calls == ["list ''", "watch 10", "watch 11", "list ''", "watch 20", "watch 20"]
    assert ran.handled == [("list", []), ("ADDED", "11"), ("ADDED", "12"), ("list", ["a"])]


@pytest.mark.parametrize("handler", ["on_list", "on_event"])
async def test_an_exception_from_a_handler_ends_the_loop_with_it(handler):
    source = Scripted([([], "10")], [[("ADDED", pod("a", "11"))]], FakeClock())

    def broken(*args: Any) -> None:
        raise RuntimeError("the handler's own bug")

    handlers = {"on_list": lambda items: None, "on_event": lambda kind, obj: None,
                handler: broken}
    with pytest.raises(RuntimeError, match="the handler's own bug"):
        async with asyncio.timeout(TIMEOUT):
            await list_watch(source, handlers["on_list"], handlers["on_event"], backoff=BACKOFF)


async def test_a_cancelled_loop_ends_at_once_even_while_it_waits_to_try_again():
    source = Scripted([Transient("refused")] * 2, [], FakeClock())
    task = asyncio.create_task(list_watch(source, lambda items: None, lambda kind, obj: None,
                                          backoff=Backoff(base=60.0, cap=60.0)))
    await asyncio.sleep(0.02)  # the first list failed: a wait of 30 s or more has begun
    assert source.run.calls == ["list ''"]
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        async with asyncio.timeout(1.0):
            await task


@pytest.mark.integration
async def test_credentials_that_cannot_be_had_are_a_failure_the_loop_outlives():
    # A token refresh that raised (the in-cluster token file unreadable for a moment) ended
    # the loop: the mirror's follower stopped for good.
    spoiled = [ConfigException("Token file exists but empty.")]

    def refresh(configuration: k8s.Configuration) -> None:
        if spoiled:
            raise spoiled.pop()

    configuration = k8s.Configuration(host="")
    configuration.api_key = {"BearerToken": "Bearer tok"}
    configuration.refresh_api_key_hook = refresh
    ran = Run()
    async with StandIn(page(["a"], "40"), Stream(events(("ADDED", pod("b", "41"))),
                                                 then="silent")) as api:
        configuration.host = api.url
        client = Kube(k8s.ApiClient(configuration))
        task = asyncio.create_task(list_watch(
            collection(client), ran.on_list, ran.on_event, on_failure=ran.on_failure,
            backoff=Backoff(base=0.01, cap=0.01)))
        try:
            async with asyncio.timeout(TIMEOUT):
                while len(ran.handled) < 2 and not task.done():
                    await asyncio.sleep(0.01)
            assert not task.done(), task.exception()
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await client.close()
    assert ran.failures == ["list pod(s): cannot get credentials from the configuration's "
                            "refresh_api_key_hook: ConfigException: Token file exists but "
                            "empty."]
    assert ran.handled == [("list", ["a"]), ("ADDED", "41")]
    assert [seen.headers["authorization"] for seen in api.seen] == ["Bearer tok"] * 2


@pytest.mark.integration
async def test_the_loop_over_kmock_fills_and_follows_and_ends_when_cancelled(kube):
    kube.core.create_namespaced_pod("ns", pod_manifest("before", "ns"))
    client = Kube(kube.api_client)
    names: set[str] = set()
    listed = asyncio.Event()

    def on_list(items: list[Any]) -> None:
        names.update(item["metadata"]["name"] for item in items)
        listed.set()

    task = asyncio.create_task(list_watch(
        Collection(client, PODS, what="pod(s)", watch_seconds=5), on_list,
        lambda kind, obj: names.add(obj["metadata"]["name"])))
    try:
        async with asyncio.timeout(TIMEOUT):
            await listed.wait()
            await asyncio.to_thread(kube.core.create_namespaced_pod, "ns",
                                    pod_manifest("after", "ns"))
            while "after" not in names:
                await asyncio.sleep(0.01)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            async with asyncio.timeout(1.0):
                await task
        await client.close()
    assert names == {"before", "after"}
