"""The pod cache's feed (`pod_feed`) on the mirror server's event loop, and MirrorServer's
tasks: what runs on that loop while it serves, and how `stop()` ends it."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kubernetes import client as k8s

from kai_fractions.kube.client import Kube
from kai_fractions.kube.retry import Backoff
from kai_fractions.mirror.grpc.server import MirrorServer, ServerOptions
from kai_fractions.mirror.pod_cache import PodCache
from kai_fractions.mirror.pod_feed import LIST_PAGE_SIZE, pod_feed, pod_selector
from kai_fractions.mirror.service import MirrorService
from tests.support.aio import until
from tests.support.fake_store import FakePodStore
from tests.support.kube import pod_manifest

integration = pytest.mark.integration
NS = "team-a"
SCHEDULER = "kai-scheduler"
PODS = "/api/v1/pods"
TIMEOUT = 5.0
FAST = Backoff(attempts=3, base=0.01, cap=0.05)


async def cancelled(task: asyncio.Task) -> None:
    """Cancels `task`, which must end within a second."""
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        async with asyncio.timeout(1.0):
            await task


async def create_pod(kube: Any, name: str) -> None:
    await asyncio.to_thread(kube.core.create_namespaced_pod, NS, pod_manifest(name, NS))


@integration
async def test_the_feed_lists_in_small_pages_then_watches_the_schedulers_pending_pods(kube):
    for index in range(LIST_PAGE_SIZE + 1):
        await create_pod(kube, f"before-{index}")
    cache = PodCache()
    client = Kube(k8s.ApiClient(kube.configuration()))
    task = asyncio.create_task(pod_feed(client, cache, SCHEDULER, backoff=FAST)())
    try:
        await until(lambda: cache.synced and cache.lookup(NS, "before-0") is not None, "listed")
        await create_pod(kube, "after")
        await until(lambda: cache.lookup(NS, "after") is not None, "watched")
        gets = kube.requests("GET", PODS)
        assert {request.params["fieldSelector"] for request in gets} == {
            pod_selector(SCHEDULER)}
        pages = [request for request in gets if "watch" not in request.params]
        # kmock answers in one page whatever the limit; the paging is tests/kube's.
        assert pages and all(request.params["limit"] == str(LIST_PAGE_SIZE)
                             for request in pages)
        await cancelled(task)
        assert cache._merging is None  # a merge in progress ends with the feed
    finally:
        await client.close()


# -- MirrorServer's tasks ------------------------------------------------------------------------

SERVING = health_pb2.HealthCheckResponse.SERVING
SERVER_LOG = "kai_fractions.mirror.grpc.server"


def health(server: MirrorServer) -> int:
    with grpc.insecure_channel(server.address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                         timeout=TIMEOUT).status


def new_server(*tasks: Callable[[], Any]) -> MirrorServer:
    return MirrorServer(MirrorService(FakePodStore()), ServerOptions(listen="127.0.0.1:0"),
                        tasks=tasks)


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
