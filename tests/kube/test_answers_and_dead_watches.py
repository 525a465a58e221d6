"""What a list + watch must not take for the truth, or be stopped or held by: a 2xx answer to a
list that is no list (a gateway's, an auth proxy's, a wrong path prefix's), a request aiohttp
refuses to send (a token ending in a newline), and a watch whose peer is gone without a word
(TCP keepalive on every connection)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
from kubernetes import client as k8s

from kai_fractions.kube import BadAnswer, Kube
from kai_fractions.kube.errors import NotSent
from kai_fractions.kube.listwatch import list_watch
from kai_fractions.kube.retry import Backoff

from .standin import TIMEOUT, Answer, StandIn, Stream, events, status
from .test_listwatch import PODS, Run, collection, page, pod

pytestmark = pytest.mark.integration


@pytest.fixture
async def kube_for() -> AsyncIterator[Any]:
    made: list[Kube] = []

    def make(target: str | k8s.Configuration) -> Kube:
        configuration = k8s.Configuration(host=target) if isinstance(target, str) else target
        made.append(Kube(k8s.ApiClient(configuration)))
        return made[-1]

    yield make
    for kube in made:
        await kube.close()


async def loop_until(ran: Run, task: asyncio.Task, done: Any) -> None:
    async with asyncio.timeout(TIMEOUT):
        while not done() and not task.done():
            await asyncio.sleep(0.01)
    assert not task.done(), task.exception()


@contextlib.asynccontextmanager
async def following(kube: Kube, ran: Run) -> AsyncIterator[asyncio.Task]:
    """The list + watch loop of `collection(kube)` as a task, told to `ran`, cancelled after."""
    task = asyncio.create_task(list_watch(
        collection(kube), ran.on_list, ran.on_event,
        on_failure=ran.on_failure, backoff=Backoff(base=0.01, cap=0.01)))
    try:
        yield task
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


# -- a list answer that is no list -------------------------------------------------------------

NOT_A_LIST = {
    "gateway-ok": ([Answer(200, {"status": "ok"})],
                   r"not a list: no `items` and no `metadata.resourceVersion` \(kind -, keys: "
                   r"status\)"),
    "no-version": ([Answer(200, {"kind": "PodList", "metadata": {}, "items": []})],
                   r"not a list: no `metadata.resourceVersion` \(kind PodList"),
    "items-not-a-list": ([Answer(200, {"metadata": {"resourceVersion": "5"}, "items": {}})],
                         r"not a list: `items` is a dict \("),
    "empty": ([Answer(200, b"")], r"not a list \(empty\)"),
    "json-list": ([Answer(200, [])], r"not a list \(a JSON list\)"),
    "second-page-no-version": ([page(["a"], "40", "t1"), Answer(200, {"items": []})],
                               r"not a list: no `metadata.resourceVersion`"),
}


@pytest.mark.parametrize(("script", "message"), list(NOT_A_LIST.values()), ids=list(NOT_A_LIST))
async def test_a_list_answer_that_is_no_list_is_a_bad_answer_naming_what_is_wrong(
        kube_for, script, message):
    async with StandIn(*script) as api:
        with pytest.raises(BadAnswer, match=r"^list pod\(s\): the API server's answer is " +
                           message) as raised:
            await collection(kube_for(api.url)).list()
    assert "path prefix" in str(raised.value) and raised.value.status == 200


async def test_items_null_is_an_empty_list_as_the_api_server_sends_it(kube_for):
    async with StandIn(Answer(200, {"kind": "PodList", "metadata": {"resourceVersion": "7"},
                                    "items": None})) as api:
        assert await collection(kube_for(api.url)).list() == ([], "7")


async def test_a_gateways_answer_to_a_relist_is_a_failure_never_an_empty_list(kube_for):
    ran = Run()
    expired = Stream(events(("ERROR", status(410, "Expired", "too old"))))
    async with (StandIn(page(["a"], "40"), expired, Answer(200, {"status": "ok"})) as api,
                following(kube_for(api.url), ran) as task):
        await loop_until(ran, task, lambda: len(ran.failures) >= 2)
    assert ran.handled == [("list", ["a"])]  # no empty list handed on
    assert ran.failures[0].startswith("list pod(s): the API server's answer is not a list: ")


# -- a request aiohttp refuses to send ---------------------------------------------------------

def token_file(content: list[str]) -> k8s.Configuration:
    """A configuration whose token is read, as the in-cluster loader does, unstripped from
    `content[0]` (a token file) before each request."""
    configuration = k8s.Configuration(host="")

    def refresh(c: k8s.Configuration) -> None:
        c.api_key = {"BearerToken": "Bearer " + content[0]}

    configuration.refresh_api_key_hook = refresh
    refresh(configuration)
    return configuration


async def test_a_token_ending_in_a_newline_is_not_sent_and_the_error_names_its_header(kube_for):
    configuration = token_file(["s3cret\n"])
    async with StandIn(page([], "1")) as api:
        configuration.host = api.url
        kube = kube_for(configuration)
        with pytest.raises(NotSent) as request:
            await kube.request("GET", PODS, what="list pods")
        with pytest.raises(NotSent) as stream:
            async with kube.stream(PODS, what="watch pods"):
                pytest.fail("a stream opened with a header aiohttp refuses")
    for raised in (request.value, stream.value):
        assert "not sent: header authorization holds a control character" in str(raised)
        assert "s3cret" not in str(raised)  # a credential is never told
    assert str(request.value).startswith("list pods: ")
    assert str(stream.value).startswith("watch pods: ")
    assert api.seen == []


async def test_the_loop_outlives_a_header_it_cannot_send_and_takes_up_the_fixed_token(kube_for):
    # The ValueError of aiohttp's header check escaped the loop and ended it for good.
    content = ["tok\n"]
    configuration = token_file(content)
    ran = Run()
    async with StandIn(page(["a"], "40"), Stream(events(("ADDED", pod("b", "41"))),
                                                 then="silent")) as api:
        configuration.host = api.url
        async with following(kube_for(configuration), ran) as task:
            await loop_until(ran, task, lambda: ran.failures)
            content[0] = "tok"  # the token file written again, without the newline
            await loop_until(ran, task, lambda: len(ran.handled) >= 2)
    assert ran.failures[0].startswith("list pod(s): not sent: header authorization ")
    assert ran.handled == [("list", ["a"]), ("ADDED", "41")]
    assert {seen.headers["authorization"] for seen in api.seen} == {"Bearer tok"}


# -- a dead connection ---------------------------------------------------------------------------

def client_socket(port: int, server_port: int) -> socket.socket:
    """This process's end of the connection from local `port` to `server_port` (a copy of its
    file descriptor: its options are the connection's)."""
    for fd in map(int, os.listdir("/proc/self/fd")):
        try:
            copy = os.dup(fd)
        except OSError:
            continue  # the listing's own descriptor, closed since
        try:
            sock = socket.socket(fileno=copy)
        except OSError:  # not a socket
            os.close(copy)
            continue
        try:
            if (sock.family in (socket.AF_INET, socket.AF_INET6)
                    and sock.type == socket.SOCK_STREAM and sock.getsockname()[1] == port
                    and sock.getpeername()[1] == server_port):
                return sock
        except OSError:
            pass
        sock.close()
    raise AssertionError(f"no socket of this process is connected from port {port}")


async def test_the_clients_connections_carry_tcp_keepalive_so_a_dead_watch_fails(kube_for):
    """A watch whose peer is gone without a FIN or RST held the agent's cache stale for its
    read timeout (330 s): keepalive probes end it in about a minute."""
    async with StandIn(Stream(events(("ADDED", pod("a", "41"))), then="silent")) as api, \
            kube_for(api.url).stream(PODS, what="watch pods") as lines:
        await anext(lines)
        with client_socket(api.seen[0].port, api.port) as sock:
            options = {name: sock.getsockopt(level, getattr(socket, name))
                       for level, name in [(socket.SOL_SOCKET, "SO_KEEPALIVE"),
                                           (socket.IPPROTO_TCP, "TCP_KEEPIDLE"),
                                           (socket.IPPROTO_TCP, "TCP_KEEPINTVL"),
                                           (socket.IPPROTO_TCP, "TCP_KEEPCNT")]}
    assert options == {"SO_KEEPALIVE": 1, "TCP_KEEPIDLE": 30, "TCP_KEEPINTVL": 10,
                       "TCP_KEEPCNT": 3}


async def test_a_watch_whose_connection_failed_is_resumed_from_its_last_version(kube_for):
    """What a dead connection's keepalive ends it with, a read that fails (here a reset), is
    followed by a watch from the last version seen, not by a list."""
    ran = Run()
    async with (StandIn(page(["a"], "40"),
                        Stream(events(("ADDED", pod("b", "41"))), then="reset"),
                        Stream(events(("ADDED", pod("c", "42"))), then="silent")) as api,
                following(kube_for(api.url), ran) as task):
        await loop_until(ran, task, lambda: len(ran.handled) >= 3)
    assert ran.handled == [("list", ["a"]), ("ADDED", "41"), ("ADDED", "42")]
    assert [(seen.query.get("watch"), seen.query.get("resourceVersion")) for seen in api.seen
            ] == [(None, None), ("true", "40"), ("true", "41")]
    assert len(ran.failures) == 1 and ran.failures[0].startswith("watch pod(s): ")
