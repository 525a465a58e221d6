"""The pod watch on the event loop: AsyncListWatch (aio_listwatch) against the benchmark's API
stand-in, which honours resourceVersion, keeps a bounded history and filters by fieldSelector,
and against a scripted stand-in on the test's loop for its requests (the official client's
query, compared parameter by parameter) and every refusal; the driver `list_watch_async` with
a scripted source and a fake clock, pinned to the threaded `list_watch` it shares Cycle with;
`pod_feed` against kmock on both of its paths (the loop's connections, or the official client
in a worker thread behind a proxy) and cancelled; and MirrorServer's tasks: run on its loop,
cancelled by `stop()`, an early end logged while the server goes on."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import random
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kubernetes import client as k8s

from benchmarks.stub_apiserver import running, seed
from kai_fractions.mirror import listwatch, pod_cache
from kai_fractions.mirror.aio_api import AsyncKubeApi
from kai_fractions.mirror.aio_listwatch import AsyncListWatch, list_watch_async
from kai_fractions.mirror.errors import ApiRejected
from kai_fractions.mirror.grpc.server import MirrorServer, ServerOptions
from kai_fractions.mirror.http1 import Http1Pool
from kai_fractions.mirror.listwatch import Gone, list_watch
from kai_fractions.mirror.pod_cache import PodCache, pod_feed, pod_list_watch, pod_selector
from kai_fractions.mirror.retry import Backoff, Transient
from kai_fractions.mirror.service import MirrorService
from kai_fractions.mirror.store import PodSnapshot, ThreadedPodStore
from tests.support.clock import FakeClock
from tests.support.fake_store import FakePodStore
from tests.support.kube import pod_manifest

from .test_aio_store import StandIn, answer

integration = pytest.mark.integration

SCHEDULER = "kai-scheduler"
SELECTOR = pod_selector(SCHEDULER)
TEMPLATE = {"apiVersion": "v1", "kind": "Pod", "metadata": {},
            "spec": {"schedulerName": SCHEDULER, "containers": [{"name": "main"}]}}
PODS = "/api/v1/pods"
TIMEOUT = 5.0
"""Of any one wait: only a failing test ever waits that long."""
FAST = Backoff(attempts=3, base=0.01, cap=0.05)


def source_for(api: AsyncKubeApi, params: dict[str, str] | None = None, **options: Any
               ) -> AsyncListWatch:
    """The pod cache's list + watch (of the scheduler's pods unless `params` say otherwise)."""
    return AsyncListWatch(api, PODS, {"fieldSelector": SELECTOR} if params is None else params,
                          what="pod(s)", **{"watch_seconds": 5, "request_timeout": TIMEOUT,
                                            **options})


@pytest.fixture
async def api_for() -> AsyncIterator[Callable[[str], AsyncKubeApi]]:
    """AsyncKubeApis for a server URL, as the mirror configures them; closed after the test."""
    made: list[AsyncKubeApi] = []

    def make(url: str) -> AsyncKubeApi:
        made.append(AsyncKubeApi(k8s.ApiClient(k8s.Configuration(host=url))))
        return made[-1]

    yield make
    for api in made:
        await api.close()
        api.client.close()


def names_in(pods: list[Any], namespace: str) -> list[str]:
    return [p["metadata"]["name"] for p in pods if p["metadata"]["namespace"] == namespace]


def version_of(pods: list[Any], namespace: str, name: str) -> str:
    (pod,) = (p for p in pods if (p["metadata"]["namespace"], p["metadata"]["name"]) == (
        namespace, name))
    return pod["metadata"]["resourceVersion"]


async def first_events(source: AsyncListWatch, since: str, namespace: str, count: int
                       ) -> list[tuple[str, str, str]]:
    """The first `count` events of `namespace` on a watch from `since`, as (type, name,
    resourceVersion); the watch is closed after them."""
    seen: list[tuple[str, str, str]] = []
    events = source.watch(since)
    try:
        async with asyncio.timeout(TIMEOUT):
            async for kind, obj in events:
                meta = obj["metadata"]
                if meta["namespace"] == namespace:
                    seen.append((kind, meta["name"], meta["resourceVersion"]))
                if len(seen) == count:
                    return seen
    finally:
        await events.aclose()
    raise AssertionError(f"the watch ended after {seen}")


async def patched(api: AsyncKubeApi, namespace: str, name: str, annotations: dict[str, str]
                  ) -> str:
    """The resourceVersion a merge patch of the pod's annotations wrote."""
    response = await api.request(
        "PATCH", f"/api/v1/namespaces/{namespace}/pods/{name}",
        body=json.dumps({"metadata": {"annotations": annotations}}).encode(), timeout=TIMEOUT)
    assert response.status == 200, response.body
    return json.loads(response.body)["metadata"]["resourceVersion"]


async def cancelled(task: asyncio.Task) -> None:
    """Cancels `task`, which must end within a second."""
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        async with asyncio.timeout(1.0):
            await task


# -- against the benchmark's API stand-in -----------------------------------------------------

@pytest.fixture(scope="module")
def stub_url() -> Iterator[str]:
    with running(TEMPLATE) as url:
        yield url


@integration
async def test_a_list_in_pages_of_one_returns_every_pod_once_at_the_lists_version(
        stub_url, api_for):
    seed(stub_url, "listed", ["p0", "p1", "p2"])
    items, version = await source_for(api_for(stub_url), page_size=1).list()
    assert sorted(names_in(items, "listed")) == ["p0", "p1", "p2"]
    assert int(version) >= max(int(p["metadata"]["resourceVersion"]) for p in items)


@integration
async def test_a_watch_from_the_listed_version_sees_a_later_patch_and_a_new_pod(
        stub_url, api_for):
    seed(stub_url, "watched", ["p0"])
    api = api_for(stub_url)
    source = source_for(api)
    items, version = await source.list()
    assert names_in(items, "watched") == ["p0"]
    written = await patched(api, "watched", "p0", {"k": "v"})
    seed(stub_url, "watched", ["p1"])
    events = await first_events(source, version, "watched", 2)
    assert events[0] == ("MODIFIED", "p0", written)
    assert events[1][:2] == ("ADDED", "p1")
    assert int(written) > int(version_of(items, "watched", "p0"))


@integration
async def test_a_watch_from_a_version_older_than_the_servers_history_is_gone(api_for):
    with running(TEMPLATE, history=2) as url:
        source = source_for(api_for(url))
        _, version = await source.list()
        seed(url, "old", ["p0", "p1", "p2"])  # three changes: the first one is forgotten
        with pytest.raises(Gone, match="too old resource version"):
            await first_events(source, version, "old", 1)
        # One still in the history is replayed, not gone.
        assert (await first_events(source, str(int(version) + 1), "old", 1))[0][:2] == (
            "ADDED", "p1")


@integration
async def test_the_field_selector_is_sent_so_only_the_schedulers_pods_are_listed_and_watched(
        stub_url, api_for):
    api = api_for(stub_url)
    source = source_for(api)
    _, version = await source.list()
    # A pod the stub makes on its first read belongs to another scheduler.
    other = await api.request("GET", "/api/v1/namespaces/selected/pods/other", timeout=TIMEOUT)
    assert json.loads(other.body)["spec"]["schedulerName"] != SCHEDULER
    seed(stub_url, "selected", ["kais"])
    assert names_in((await source.list())[0], "selected") == ["kais"]
    assert sorted(names_in((await source_for(api, {}).list())[0], "selected")) == [
        "kais", "other"]
    # The other pod changed first: a watch that did not filter would see it first.
    assert (await first_events(source, version, "selected", 1))[0][:2] == ("ADDED", "kais")


@integration
async def test_a_line_the_skip_refuses_is_dropped_without_being_parsed(
        stub_url, api_for, monkeypatch):
    seed(stub_url, "skipped", ["p0"])
    api = api_for(stub_url)
    _, version = await source_for(api).list()
    echo = await patched(api, "skipped", "p0", {"write": "mine"})
    other = await patched(api, "skipped", "p0", {"write": "theirs"})
    offered: list[bytes] = []

    def refuses(line: bytes) -> bool:
        return f'"resourceVersion":"{echo}"'.encode() in line

    def skip(line: bytes) -> bool:
        offered.append(line)
        return refuses(line)

    parsed: list[bytes] = []

    def loads(line: bytes) -> Any:
        parsed.append(line)
        return json.loads(line)

    monkeypatch.setattr(listwatch, "json", SimpleNamespace(loads=loads))  # watch_event parses
    events = await first_events(source_for(api, skip=skip), version, "skipped", 1)
    assert events == [("MODIFIED", "p0", other)]
    refused = [line for line in offered if refuses(line)]
    assert len(refused) == 1 and all(isinstance(line, bytes) for line in offered)
    assert refused[0] not in parsed


@pytest.mark.parametrize("as_type", [str, bytes], ids=["official-clients-str", "loops-bytes"])
def test_the_caches_echo_check_reads_a_line_as_str_or_bytes(as_type):
    cache = PodCache()
    pod = {"metadata": {"name": "p0", "namespace": "ns", "uid": "u", "resourceVersion": "31"},
           "spec": {}}
    cache.remember(PodSnapshot.from_object(pod), written=True)

    def line(version: str) -> str | bytes:
        text = json.dumps({"type": "MODIFIED", "object": {"metadata": {
            **pod["metadata"], "resourceVersion": version}}}, separators=(",", ":"))
        return text if as_type is str else text.encode()

    assert [cache.is_echo(line("30")), cache.is_echo(line("31")), cache.is_echo(line("31"))] == [
        False, True, False]


# -- the requests, and every refusal, against a scripted stand-in -------------------------------

def status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code,
            "reason": reason, "message": message}


def page(names: list[str], version: str, token: str = "") -> bytes:
    meta = {"resourceVersion": version, **({"continue": token} if token else {})}
    return answer(200, {"kind": "PodList", "apiVersion": "v1", "metadata": meta, "items": [
        {"metadata": {"name": name, "namespace": "ns", "resourceVersion": version}}
        for name in names]})


def watch_answer(*events: tuple[str, dict[str, Any]]) -> bytes:
    """A whole watch: each event a chunk of one JSON line, then the end of the stream."""
    body = b"".join(b"%x\r\n%s\r\n" % (len(line), line) for line in (
        json.dumps({"type": kind, "object": obj}).encode() + b"\n" for kind, obj in events))
    return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n" + body + b"0\r\n\r\n")


def queries(api: StandIn) -> list[tuple[str, dict[str, str]]]:
    """Each request's path and query parameters."""
    targets = (urlsplit(seen.line.split(" ")[1]) for seen in api.seen)
    return [(target.path, dict(parse_qsl(target.query))) for target in targets]


ADDED = ("ADDED", {"metadata": {"name": "a", "namespace": "ns", "resourceVersion": "41"}})


@integration
async def test_list_and_watch_send_the_query_of_the_official_clients_list_call(api_for):
    pages = [page(["a"], "40", "t1"), page(["b"], "41")]
    async with StandIn(*pages, watch_answer(ADDED), *pages, watch_answer(ADDED)) as api:
        source = source_for(api_for(api.url), page_size=1, watch_seconds=60)
        items, version = await source.list()
        assert [kind async for kind, _ in source.watch(version)] == ["ADDED"]
        core = k8s.CoreV1Api(source.api.client)
        call = functools.partial(core.list_pod_for_all_namespaces, field_selector=SELECTOR,
                                 _preload_content=False, _request_timeout=TIMEOUT)
        for kwargs in ({"limit": 1}, {"limit": 1, "_continue": "t1"}, {
                "watch": True, "allow_watch_bookmarks": True, "resource_version": version,
                "timeout_seconds": 60}):
            (await asyncio.to_thread(call, **kwargs)).read()
    ours, theirs = queries(api)[:3], queries(api)[3:]
    assert ours == theirs
    assert [query.get("continue") for _, query in ours] == [None, "t1", None]
    assert ([item["metadata"]["name"] for item in items], version) == (["a", "b"], "40")


@integration
async def test_a_list_comes_in_pages_and_the_first_pages_version_is_the_snapshots(api_for):
    async with StandIn(page(["a"], "40", "t1"), page(["b"], "41", "t2"), page(["c"], "42")
                       ) as api:
        items, version = await source_for(api_for(api.url), page_size=1).list()
    assert ([item["metadata"]["name"] for item in items], version) == (["a", "b", "c"], "40")
    assert [(query["limit"], query.get("continue")) for _, query in queries(api)] == [
        ("1", None), ("1", "t1"), ("1", "t2")]


RBAC = r"^list/watch pod\(s\): the API server refused the mirror's identity \(403 .*RBAC$"
REFUSALS = {
    "list-403": ("list", [answer(403, status(403, "Forbidden", "no list"))], ApiRejected, RBAC),
    "list-503": ("list", [answer(503, status(503, "ServiceUnavailable", "busy"))], Transient,
                 "503 ServiceUnavailable: busy"),
    "list-page-410": ("list", [page(["a"], "40", "t1"),
                               answer(410, status(410, "Expired", "continue expired"))],
                      Gone, "410 Expired: continue expired"),
    "list-not-json": ("list", [answer(200, b"<html>gateway</html>")], ApiRejected, "not JSON"),
    "watch-403": ("watch", [answer(403, status(403, "Forbidden", "no watch"))], ApiRejected,
                  RBAC),
    "watch-410": ("watch", [answer(410, status(410, "Expired", "too old"))], Gone,
                  "410 Expired: too old"),
    "error-event-410": ("watch", [watch_answer(ADDED, ("ERROR", status(
        410, "Expired", "too old resource version: 1 (40)")))], Gone,
                        r"^too old resource version: 1 \(40\)$"),
    "error-event-500": ("watch", [watch_answer(ADDED, ("ERROR", status(
        500, "InternalError", "etcd is away")))], Transient, "etcd is away"),
    "error-event-403": ("watch", [watch_answer(ADDED, ("ERROR", status(
        403, "Forbidden", "no watch")))], ApiRejected,
                        r"refused the mirror's identity \(no watch\); check its RBAC$"),
    "error-event-400": ("watch", [watch_answer(ADDED, ("ERROR", status(
        400, "BadRequest", "bad selector")))], ApiRejected,
                        r"^list/watch pod\(s\): bad selector$"),
}


@integration
@pytest.mark.parametrize(("call", "answers", "error", "message"), list(REFUSALS.values()),
                         ids=list(REFUSALS))
async def test_each_refusal_of_the_list_or_watch_means_what_kube_api_says(
        api_for, call, answers, error, message):
    async with StandIn(*answers) as api:
        source = source_for(api_for(api.url))
        handed: list[str] = []
        with pytest.raises(error, match=message):
            if call == "list":
                await source.list()
            else:
                async for kind, _ in source.watch("40"):
                    handed.append(kind)
    # An ERROR event ends the watch after what came before it.
    assert handed == (["ADDED"] if b'"ERROR"' in answers[-1] else [])


# -- list_watch_async with a scripted source -----------------------------------------------------

@dataclass(frozen=True)
class Tick:
    """In a watch's script: this much time passes (a long watch)."""

    seconds: float


def pod(name: str, version: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ns", "resourceVersion": version}}


@dataclass
class Run:
    calls: list[str] = field(default_factory=list)
    """`list`, `watch <resourceVersion>`: each call of the source, in order."""
    handled: list[tuple[str, Any]] = field(default_factory=list)
    """("list", names) and (event type, the object's resourceVersion): each handler call."""
    sleeps: list[float] = field(default_factory=list)

    def on_list(self, items: list[Any]) -> None:
        self.handled.append(("list", [item["metadata"]["name"] for item in items]))

    def on_event(self, kind: str, obj: Any) -> None:
        self.handled.append((kind, obj["metadata"].get("resourceVersion")))


class Scripted:
    """The scripts both sources answer from: each list() the next item of `lists` (raised
    when an exception), each watch() the next events of `watches` (an exception raised where
    it stands, a Tick run on the clock)."""

    what = "pod(s)"

    def __init__(self, lists: list[Any], watches: list[list[Any]], run: Run,
                 clock: FakeClock) -> None:
        self.lists, self.watches = list(lists), [list(events) for events in watches]
        self.run, self.clock = run, clock

    def _listed(self, item: Any) -> Any:
        if isinstance(item, Exception):
            raise item
        return item

    def _events(self, events: list[Any]) -> Iterator[tuple[str, Any]]:
        for event in events:
            if isinstance(event, Tick):
                self.clock.now += event.seconds
            elif isinstance(event, Exception):
                raise event
            else:
                yield event


class AsyncScriptedSource(Scripted):
    """Once its scripts are spent, the next call waits for ever: the loop is cancelled there."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.spent = asyncio.Event()

    async def _next(self, script: list[Any]) -> Any:
        if not script:
            self.spent.set()
            await asyncio.Event().wait()
        return script.pop(0)

    async def list(self) -> Any:
        self.run.calls.append("list")
        return self._listed(await self._next(self.lists))

    async def watch(self, resource_version: str) -> AsyncIterator[tuple[str, Any]]:
        self.run.calls.append(f"watch {resource_version}")
        for event in self._events(await self._next(self.watches)):
            yield event


class ThreadedScriptedSource(Scripted):
    """Once its scripts are spent, the next call sets `stop`: the loop ends there."""

    def __init__(self, *args: Any, stop: threading.Event) -> None:
        super().__init__(*args)
        self.stop = stop

    def list(self) -> Any:
        self.run.calls.append("list")
        if not self.lists:
            self.stop.set()
            raise Gone("the script is spent")  # no wait: the loop sees `stop` at once
        return self._listed(self.lists.pop(0))

    def watch(self, resource_version: str, stop: threading.Event
              ) -> Iterator[tuple[str, Any]]:
        self.run.calls.append(f"watch {resource_version}")
        if not self.watches:
            self.stop.set()
            return
        yield from self._events(self.watches.pop(0))


class ClockedStop(threading.Event):
    """list_watch's `stop`, whose waits run the fake clock forward instead of waiting."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__()
        self.clock = clock

    def wait(self, timeout: float | None = None) -> bool:
        assert timeout is not None
        self.clock.sleep(timeout)
        return self.is_set()


BACKOFF = Backoff(base=1.0, cap=8.0, jitter=0.0)
"""Delays of 1, 2, 4, 8, 8 ... seconds: what a test reads off the clock."""
RESYNC = 100.0


async def run_async(lists: list[Any], watches: list[list[Any]], **options: Any) -> Run:
    """list_watch_async over the scripts, until they are spent; then cancelled."""
    run, clock = Run(), FakeClock()
    source = AsyncScriptedSource(lists, watches, run, clock)
    task = asyncio.create_task(list_watch_async(
        source, run.on_list, run.on_event, monotonic=clock.monotonic, clock=clock,
        **{"backoff": BACKOFF, "resync_seconds": RESYNC, **options}))
    async with asyncio.timeout(TIMEOUT):
        await source.spent.wait()
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    run.sleeps = clock.sleeps
    return run


def run_threaded(lists: list[Any], watches: list[list[Any]], **options: Any) -> Run:
    run, clock = Run(), FakeClock()
    stop = ClockedStop(clock)
    list_watch(ThreadedScriptedSource(lists, watches, run, clock, stop=stop), run.on_list,
               run.on_event, stop, what="pod(s)", monotonic=clock.monotonic,
               **{"backoff": BACKOFF, "resync_seconds": RESYNC, **options})
    run.sleeps = clock.sleeps
    return run


async def test_it_lists_first_hands_every_event_on_and_resumes_after_the_last_one():
    run = await run_async(
        lists=[([pod("a", "5")], "10")],
        watches=[[("ADDED", pod("b", "11")), ("MODIFIED", pod("a", "12"))],
                 [("BOOKMARK", {"metadata": {"resourceVersion": "15"}}),
                  ("MODIFIED", {"metadata": {"name": "c"}})],  # no version: 15 still holds
                 [], []])  # streams the server ended: watched again, from where they were
    assert run.calls == ["list", "watch 10", "watch 12", "watch 15", "watch 15", "watch 15"]
    assert run.handled == [("list", ["a"]), ("ADDED", "11"), ("MODIFIED", "12"),
                           ("BOOKMARK", "15"), ("MODIFIED", None)]
    assert run.sleeps == []


@pytest.mark.parametrize(("lists", "watches", "calls"), [
    ([([], "10"), ([pod("c", "20")], "20")], [[("ADDED", pod("b", "11")), Gone("too old")]],
     ["list", "watch 10", "list", "watch 20"]),
    ([Gone("continue token expired"), ([], "10")], [], ["list", "list", "watch 10"]),
], ids=["watch-gone", "list-page-gone"])
async def test_after_gone_it_lists_again_at_once(lists, watches, calls):
    run = await run_async(lists, watches)
    assert run.calls == calls
    assert run.sleeps == []


async def test_failures_back_off_more_each_time_up_to_the_cap_and_progress_starts_over():
    run = await run_async(
        lists=[ConnectionRefusedError("refused"), Transient("503"), ApiRejected("403"),
               TimeoutError(), ValueError("not JSON"), ([], "10")],
        watches=[[OSError("reset")], [("ADDED", pod("a", "11")), OSError("reset")],
                 [json.JSONDecodeError("bad line", "", 0)], []])
    assert run.sleeps == [1, 2, 4, 8, 8, 1, 1, 2]
    assert run.calls == ["list"] * 6 + ["watch 10", "watch 10", "watch 11", "watch 11",
                                        "watch 11"]


async def test_it_lists_again_once_resync_seconds_have_passed_since_the_last_list():
    run = await run_async(
        lists=[([], "10"), ([pod("a", "20")], "20")],
        watches=[[("ADDED", pod("a", "11")), Tick(60)], [Tick(50), ("ADDED", pod("b", "12"))],
                 []])
    assert run.calls == ["list", "watch 10", "watch 11", "list", "watch 20", "watch 20"]
    assert run.handled == [("list", []), ("ADDED", "11"), ("ADDED", "12"), ("list", ["a"])]


async def test_an_exception_from_a_handler_ends_the_loop_with_it():
    source = AsyncScriptedSource([([], "10")], [[("ADDED", pod("a", "11"))]], Run(),
                                 FakeClock())

    def on_event(kind: str, obj: Any) -> None:
        raise RuntimeError("the handler's own bug")

    with pytest.raises(RuntimeError, match="the handler's own bug"):
        async with asyncio.timeout(TIMEOUT):
            await list_watch_async(source, lambda items: None, on_event, backoff=BACKOFF)


async def test_a_cancelled_loop_ends_at_once_even_while_it_waits_to_try_again():
    source = AsyncScriptedSource([OSError("refused")] * 2, [], Run(), FakeClock())
    task = asyncio.create_task(list_watch_async(source, lambda items: None,
                                                lambda kind, obj: None,
                                                backoff=Backoff(base=60.0, cap=60.0)))
    await asyncio.sleep(0.02)  # the first list failed: a wait of 30 s or more has begun
    assert source.run.calls == ["list"]
    await cancelled(task)


async def test_the_threaded_loop_and_the_event_loops_make_the_same_calls_waits_and_handlings():
    def script() -> tuple[list[Any], list[list[Any]]]:
        return ([OSError("refused"), ([pod("a", "5")], "10"), Gone("continue expired"),
                 ([pod("b", "30")], "30"), ([], "40")],
                [[("ADDED", pod("b", "11")), ValueError("not JSON")],
                 [OSError("reset")], [("MODIFIED", pod("b", "12")), Gone("too old")],
                 [Tick(RESYNC / 2), ("BOOKMARK", pod("", "31")), Tick(RESYNC)],
                 [("DELETED", pod("b", "41"))]])

    options = {"backoff": Backoff(base=0.5, cap=30.0)}  # jittered: the same seed, the same draws
    threaded = run_threaded(*script(), rng=random.Random(7), **options)
    on_the_loop = await run_async(*script(), rng=random.Random(7), **options)
    assert on_the_loop == threaded
    assert len(threaded.calls) == 11 and len(threaded.sleeps) == 3


# -- pod_feed against kmock -----------------------------------------------------------------------

NS = "team-a"


async def until(predicate: Callable[[], bool], what: str) -> None:
    async with asyncio.timeout(TIMEOUT):
        while not predicate():
            await asyncio.sleep(0.01)
    assert predicate(), what


async def create_pod(kube: Any, name: str) -> None:
    await asyncio.to_thread(kube.core.create_namespaced_pod, NS, pod_manifest(name, NS))


@integration
async def test_the_feed_on_the_loop_fills_the_cache_and_when_cancelled_closes_its_connections(
        kube, monkeypatch):
    opened = []
    open_connection = Http1Pool._open

    async def recorded(self: Http1Pool) -> Any:
        opened.append(await open_connection(self))
        return opened[-1]

    monkeypatch.setattr(Http1Pool, "_open", recorded)
    await create_pod(kube, "before")
    cache = PodCache()
    task = asyncio.create_task(pod_feed(kube.api_client, cache, SCHEDULER, backoff=FAST)())
    await until(lambda: cache.synced and cache.lookup(NS, "before") is not None, "listed")
    await create_pod(kube, "after")
    await until(lambda: cache.lookup(NS, "after") is not None, "watched")
    assert {request.params["fieldSelector"] for request in kube.requests("GET", PODS)} == {
        SELECTOR}
    await cancelled(task)
    assert len(opened) >= 2  # the list's, kept in the pool, and the watch's own
    assert all(connection.writer.is_closing() for connection in opened)


@dataclass
class ThreadedFeed:
    """pod_feed as behind a proxy: the official client's list + watch in a worker thread."""

    returned: threading.Event = field(default_factory=threading.Event)
    """Set when the thread's list_watch returned."""
    sources: list[Any] = field(default_factory=list)
    """The KubeListWatch the feed made."""

    async def assert_thread_ends(self) -> None:
        ended = await asyncio.to_thread(self.returned.wait, 1.0)
        if not ended:
            self.sources[0].close()  # ends its stream: the test fails rather than hang
        assert ended, "the watch thread still runs"


@pytest.fixture
def threaded_feed(monkeypatch) -> ThreadedFeed:
    feed = ThreadedFeed()
    monkeypatch.setattr(pod_cache, "behind_proxy", lambda configuration: True)

    def no_loop_connections(*args: Any) -> None:
        raise AssertionError("the loop's own connections do not speak to a proxy")

    def watched(*args: Any, **kwargs: Any) -> None:
        try:
            list_watch(*args, **kwargs)
        finally:
            feed.returned.set()

    def recorded(*args: Any) -> Any:
        feed.sources.append(pod_list_watch(*args))
        return feed.sources[-1]

    monkeypatch.setattr(pod_cache, "AsyncKubeApi", no_loop_connections)
    monkeypatch.setattr(pod_cache, "list_watch", watched)
    monkeypatch.setattr(pod_cache, "pod_list_watch", recorded)
    return feed


@integration
async def test_behind_a_proxy_the_feed_runs_the_official_clients_watch_in_a_thread_it_ends(
        kube, threaded_feed):
    fed_from: set[threading.Thread] = set()

    class Recording(PodCache):
        def event(self, kind: str, obj: Any) -> None:
            fed_from.add(threading.current_thread())
            super().event(kind, obj)

    cache = Recording()
    task = asyncio.create_task(pod_feed(kube.api_client, cache, backoff=FAST)())
    await until(lambda: cache.synced, "listed")
    await create_pod(kube, "watched")
    await until(lambda: cache.lookup(NS, "watched") is not None, "watched")
    assert threading.current_thread() not in fed_from and len(fed_from) == 1
    await cancelled(task)
    await threaded_feed.assert_thread_ends()


@integration
async def test_behind_a_proxy_a_feed_cancelled_while_it_lists_ends_its_thread_too(
        kube, threaded_feed):
    """No pod: kmock's watch then stays silent, as a quiet cluster's does between bookmarks."""
    cache = PodCache()
    feed = pod_feed(kube.api_client, cache, backoff=FAST)
    (source,) = threaded_feed.sources
    listing, answer_now = threading.Event(), threading.Event()
    list_pods = source.list

    def slow_list() -> Any:
        listing.set()
        answer_now.wait(TIMEOUT)
        return list_pods()

    source.list = slow_list
    task = asyncio.create_task(feed())
    assert await asyncio.to_thread(listing.wait, TIMEOUT)
    await cancelled(task)
    answer_now.set()  # the list the thread was in when cancelled comes back now
    await until(lambda: cache.synced, "listed")
    await threaded_feed.assert_thread_ends()


# -- MirrorServer's tasks ------------------------------------------------------------------------

SERVING = health_pb2.HealthCheckResponse.SERVING


def health(server: MirrorServer) -> int:
    with grpc.insecure_channel(server.address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                         timeout=TIMEOUT).status


def new_server(*tasks: Callable[[], Any]) -> MirrorServer:
    return MirrorServer(MirrorService(ThreadedPodStore(FakePodStore())),
                        ServerOptions(listen="127.0.0.1:0"), tasks=tasks)


SERVER_LOG = "kai_fractions.mirror.grpc.server"


def errors(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == SERVER_LOG and r.levelno >= logging.ERROR]


async def listening(port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return False
    writer.close()
    return True


@integration
def test_a_task_runs_on_the_servers_loop_while_it_serves_and_stop_cancels_it_in_order(caplog):
    happened: list[Any] = []
    running_on: list[asyncio.AbstractEventLoop] = []
    started = threading.Event()

    async def feed() -> None:
        running_on.append(asyncio.get_running_loop())
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            happened.append("cancelled")
            raise
        finally:
            happened.append(("gRPC still listening", await listening(server.port)))

    server = new_server(feed)
    close_service = server.service.close

    async def close() -> None:
        happened.append("service closed")
        await close_service()

    server.service.close = close
    server.start()
    try:
        assert started.wait(TIMEOUT)
        assert running_on == [server._loop]
        assert health(server) == SERVING
        assert happened == []
    finally:
        server.stop(grace=0)
    assert happened == ["cancelled", ("gRPC still listening", False), "service closed"]
    assert errors(caplog) == []


@integration
@pytest.mark.parametrize("ending", ["raises", "returns"])
def test_a_task_that_ends_by_itself_is_logged_as_an_error_and_the_server_goes_on(
        caplog, ending):
    async def lost_feed() -> None:
        if ending == "raises":
            raise RuntimeError("the feed is lost")

    others: list[str] = []

    async def healthy_feed() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            others.append("ended by stop")

    caplog.set_level(logging.ERROR, logger=SERVER_LOG)
    with new_server(lost_feed, healthy_feed) as server:
        deadline = time.monotonic() + TIMEOUT
        while not errors(caplog) and time.monotonic() < deadline:
            time.sleep(0.01)
        (record,) = errors(caplog)
        assert record.levelno == logging.ERROR
        assert "lost_feed" in record.getMessage()
        assert record.getMessage().endswith(
            "RuntimeError('the feed is lost')" if ending == "raises" else "None")
        assert health(server) == SERVING
        assert others == []
    assert others == ["ended by stop"]
    assert len(errors(caplog)) == 1  # the cancelled one is not reported

