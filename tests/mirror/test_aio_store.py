"""AsyncKubePodStore, the mirror's event-loop store, against kmock, FaultyApi and a stand-in
server on the test's own loop.

The store sends its requests without the official client (its own HTTP/1.1 connections), yet it
replaces KubePodStore on the mirror's hot path: so each test pins it to what the official client
or the blocking store does for the same call. Same method, path, credentials and body as the
generated `CoreV1Api` methods; the same errors and messages for every refusal; the same retries
of throttling, 5xx, resets and timeouts; the same deadline. kmock serves the requests; FaultyApi
resets, times out and loses answers; the stand-in does what neither can (a path prefix, a
Retry-After header, an answer that is not JSON, TLS with a client certificate).
"""

from __future__ import annotations

import asyncio
import functools
import json
import socket
import ssl
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import pytest
import urllib3
from kubernetes import client as k8s

from kai_fractions.kubeconfig import ConfigError
from kai_fractions.mirror.aio_api import tls_context
from kai_fractions.mirror.aio_store import AsyncKubePodStore, async_pod_store
from kai_fractions.mirror.errors import ApiRejected, ApiUnavailable, DeadlineExceeded, PodNotFound
from kai_fractions.mirror.kube_store import KubePodStore
from kai_fractions.mirror.retry import Backoff
from kai_fractions.mirror.store import (
    NO_DEADLINE,
    Deadline,
    NodeNotFound,
    ThreadedPodStore,
    WriteConflict,
    WriteInvalid,
)
from tests.support.clock import FakeClock
from tests.support.faults_api import Fault, FaultyApi
from tests.support.kube import KubeServer, pod_manifest

from .certs import CertificateAuthority

pytestmark = pytest.mark.integration

NS, NAME, NODE = "team-a", "train-0", "node-1"
POD_PATH = f"/api/v1/namespaces/{NS}/pods/{NAME}"
NODE_PATH = f"/api/v1/nodes/{NODE}"
NODE_LABELS = {"gpu": "h100", "zone": "a"}
CHANGES = {"kai": "1"}
MERGE_PATCH = "application/merge-patch+json"
FAST = Backoff(attempts=3, base=0.001, cap=0.005)

CALLS = {
    "get": ("GET", POD_PATH, "read pod team-a/train-0"),
    "patch": ("PATCH", POD_PATH, "patch pod team-a/train-0"),
    "node": ("GET", NODE_PATH, "read node node-1"),
}
"""Each store call: its request's method and path, and how its errors name it."""


def call(store: Any, which: str, deadline: Deadline = NO_DEADLINE) -> Any:
    """The call `which` of CALLS on either store: a coroutine for the async one, the answer
    itself for the blocking one."""
    if which == "get":
        return store.get_pod(NS, NAME, deadline)
    if which == "patch":
        return store.patch_annotations(NS, NAME, CHANGES, uid="", resource_version="",
                                       deadline=deadline)
    return store.node_labels(NODE, deadline)


def seed(kube: KubeServer, annotations: dict[str, str] | None = None) -> k8s.V1Pod:
    """The module's node and pod in kmock; the pod as created."""
    kube.core.create_node({"metadata": {"name": NODE, "labels": NODE_LABELS}})
    return kube.core.create_namespaced_pod(NS, pod_manifest(NAME, NS,
                                                            annotations=annotations or {}))


def with_token(configuration: k8s.Configuration, token: str = "tok") -> k8s.Configuration:
    configuration.api_key = {"authorization": token}
    configuration.api_key_prefix = {"authorization": "Bearer"}
    return configuration


def configured(host: str, **settings: Any) -> k8s.Configuration:
    """A client configuration as `kubeconfig.load_api_client` makes it (urllib3's own retries
    off: the stores retry), with `settings`."""
    configuration = k8s.Configuration(host=host)
    configuration.retries = False
    for name, value in settings.items():
        setattr(configuration, name, value)
    return configuration


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the stand-in API server -------------------------------------------------------------------

POD = {"apiVersion": "v1", "kind": "Pod",
       "metadata": {"name": NAME, "namespace": NS, "uid": "u-1", "resourceVersion": "7"},
       "spec": {"containers": [{"name": "main"}]}}


def answer(status: int, body: object, *headers: str) -> bytes:
    """A whole HTTP/1.1 answer; `body` is sent as JSON unless it is bytes already."""
    payload = body if isinstance(body, bytes) else json.dumps(body).encode()
    head = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}", "Content-Type: application/json",
            *headers, f"Content-Length: {len(payload)}"]
    return "\r\n".join([*head, "", ""]).encode("latin-1") + payload


@dataclass(frozen=True)
class Seen:
    line: str
    """The request line: `GET /path HTTP/1.1`."""
    headers: dict[str, str]
    body: bytes


@dataclass(frozen=True)
class Handshake:
    server_name: str | None
    alpn: str | None
    client: str
    """The client certificate's common name."""


class StandIn:
    """An API server on the test's own loop for what kmock cannot do: it records each request
    and answers the n-th with `answers[n]` (the last one from then on)."""

    def __init__(self, *answers: bytes, tls: ssl.SSLContext | None = None) -> None:
        self.answers = answers
        self.tls = tls
        self.seen: list[Seen] = []
        self.handshakes: list[Handshake] = []
        self._names: list[str | None] = []
        self._writers: list[asyncio.StreamWriter] = []
        if tls is not None:
            tls.sni_callback = lambda _ssl, name, _context: self._names.append(name)

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    async def __aenter__(self) -> StandIn:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self.tls)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._server.close()
        for writer in self._writers:
            writer.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.append(writer)
        if (tls := writer.get_extra_info("ssl_object")) is not None:
            subject = dict(pair for rdn in tls.getpeercert()["subject"] for pair in rdn)
            self.handshakes.append(Handshake(self._names[-1], tls.selected_alpn_protocol(),
                                             subject["commonName"]))
        try:
            while True:
                line, *fields = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1") \
                    .split("\r\n")[:-2]
                headers = {name.strip().lower(): value.strip()
                           for name, _, value in (f.partition(":") for f in fields)}
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                self.seen.append(Seen(line, headers, body))
                writer.write(self.answers[min(len(self.seen), len(self.answers)) - 1])
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client closed the connection
        finally:
            writer.close()


# -- fixtures ----------------------------------------------------------------------------------

@pytest.fixture
def client_for() -> Iterator[Callable[[k8s.Configuration | str], k8s.ApiClient]]:
    """ApiClients for a configuration (or a server URL: `configured`), closed after the test."""
    clients: list[k8s.ApiClient] = []

    def make(target: k8s.Configuration | str) -> k8s.ApiClient:
        configuration = configured(target) if isinstance(target, str) else target
        clients.append(k8s.ApiClient(configuration))
        return clients[-1]

    yield make
    for client in clients:
        client.close()


@pytest.fixture
async def open_store(client_for) -> AsyncIterator[Callable[..., AsyncKubePodStore]]:
    """AsyncKubePodStores opened on the test's loop (fast retries unless told otherwise) over
    an ApiClient, a configuration or a server URL; closed after the test."""
    stores: list[AsyncKubePodStore] = []

    def open_(target: k8s.ApiClient | k8s.Configuration | str, **options: Any
              ) -> AsyncKubePodStore:
        api_client = target if isinstance(target, k8s.ApiClient) else client_for(target)
        stores.append(AsyncKubePodStore(api_client, **{"backoff": FAST, **options}))
        return stores[-1]

    yield open_
    for store in stores:
        await store.close()


# -- the requests are the official client's -------------------------------------------------

FRAMING = frozenset({"accept-encoding", "content-length"})
"""Headers that only frame the request: urllib3 adds `Accept-Encoding: identity`, and the two
bodies are the same JSON spaced differently."""


def sent(request: Any) -> tuple[Any, ...]:
    headers = {k.lower(): v for k, v in request.headers.items() if k.lower() not in FRAMING}
    return request.method.value, request.url.path, dict(request.params), headers, request.data


@pytest.mark.parametrize("which", CALLS)
async def test_each_request_is_the_one_the_generated_client_sends(kube, open_store, which):
    seed(kube)
    store = open_store(with_token(kube.configuration()))
    store.api.cookie = "session=abc"
    store.api.set_default_header("X-Tenant", "team-a")
    core = k8s.CoreV1Api(store.api)
    generated = {
        "get": lambda: core.read_namespaced_pod(NAME, NS),
        "patch": lambda: core.patch_namespaced_pod(
            NAME, NS, {"metadata": {"annotations": CHANGES}}, _content_type=MERGE_PATCH),
        "node": lambda: core.read_node(NODE),
    }[which]
    await call(store, which)
    generated()
    method, path, _ = CALLS[which]
    ours, theirs = kube.requests(method, path)
    assert sent(ours) == sent(theirs)
    assert ours.headers["Authorization"] == "Bearer tok"
    assert ours.headers["Accept"] == "application/json"
    assert ours.headers["User-Agent"] == store.api.user_agent
    assert (ours.headers["Cookie"], ours.headers["X-Tenant"]) == ("session=abc", "team-a")


async def test_the_patch_is_a_merge_patch_of_the_annotations(kube, open_store):
    seed(kube)
    await open_store(kube.api_client).patch_annotations(NS, NAME, CHANGES, uid="",
                                                        resource_version="")
    (patch,) = kube.requests("PATCH", POD_PATH)
    assert patch.headers["Content-Type"] == MERGE_PATCH
    assert patch.data == {"metadata": {"annotations": CHANGES}}  # no precondition when none given


async def test_the_patch_carries_its_preconditions_deletes_none_keys_and_returns_the_pod_written(
        kube, open_store):
    created = seed(kube, {"old": "1", "keep": "2"}).metadata
    written = await open_store(kube.api_client).patch_annotations(
        NS, NAME, {"old": None, "new": "3"}, uid=created.uid,
        resource_version=created.resource_version)
    assert kube.requests("PATCH", POD_PATH)[-1].data == {"metadata": {
        "annotations": {"old": None, "new": "3"}, "uid": created.uid,
        "resourceVersion": created.resource_version}}
    stored = kube.core.read_namespaced_pod(NAME, NS).metadata
    assert stored.annotations == {"keep": "2", "new": "3"}
    assert dict(written.annotations) == stored.annotations
    assert (written.namespace, written.name, written.uid) == (NS, NAME, created.uid)
    assert written.resource_version == stored.resource_version != created.resource_version


async def test_reads_return_the_pod_and_the_node_labels_as_stored(kube, open_store):
    created = seed(kube, {"a": "1"}).metadata
    store = open_store(kube.api_client)
    pod = await store.get_pod(NS, NAME)
    assert (pod.namespace, pod.name, pod.uid, pod.resource_version) == (
        NS, NAME, created.uid, created.resource_version)
    assert dict(pod.annotations) == {"a": "1"}
    assert pod.spec["containers"][0]["name"] == "main"
    assert await store.node_labels(NODE) == NODE_LABELS


async def test_a_stale_resource_version_is_a_write_conflict_and_changes_nothing(kube, open_store):
    created = seed(kube).metadata
    kube.core.patch_namespaced_pod(NAME, NS, {"metadata": {"labels": {"touched": "yes"}}})
    with pytest.raises(WriteConflict) as e:
        await open_store(kube.api_client).patch_annotations(
            NS, NAME, CHANGES, uid=created.uid, resource_version=created.resource_version)
    assert str(e.value) == (
        '409 Conflict: Operation cannot be fulfilled on pods "train-0": the object has been '
        "modified; please apply your changes to the latest version and try again")
    assert kube.core.read_namespaced_pod(NAME, NS).metadata.annotations == {}
    assert kube.count("PATCH", POD_PATH) == 2  # the other writer's and ours, not retried


async def test_a_token_refreshed_by_the_configurations_hook_is_sent_on_the_next_request(
        kube, open_store):
    seed(kube)
    configuration = with_token(kube.configuration(), "expired")
    current = {"token": "first"}
    configuration.refresh_api_key_hook = lambda c: c.api_key.update(authorization=current["token"])
    store = open_store(configuration)
    await store.get_pod(NS, NAME)
    current["token"] = "second"
    await store.patch_annotations(NS, NAME, CHANGES, uid="", resource_version="")
    current["token"] = "third"
    await store.node_labels(NODE)
    requests = [*kube.requests("GET", POD_PATH), *kube.requests("PATCH", POD_PATH),
                *kube.requests("GET", NODE_PATH)]
    assert [r.headers["Authorization"] for r in requests] == [
        "Bearer first", "Bearer second", "Bearer third"]


async def test_a_server_url_with_a_path_prefix_is_reached_under_it_as_by_the_blocking_store(
        open_store):
    async with StandIn(answer(200, POD)) as api:
        store = open_store(f"{api.url}/prefix")
        await store.get_pod(NS, NAME)
        await store.patch_annotations(NS, NAME, CHANGES, uid="", resource_version="")
        blocking = KubePodStore(store.api, backoff=FAST)
        await asyncio.to_thread(blocking.get_pod, NS, NAME)
        await asyncio.to_thread(functools.partial(
            blocking.patch_annotations, NS, NAME, CHANGES, uid="", resource_version=""))
    assert [seen.line for seen in api.seen] == [
        f"GET /prefix{POD_PATH} HTTP/1.1", f"PATCH /prefix{POD_PATH} HTTP/1.1"] * 2
    assert api.seen[0].headers["host"] == f"127.0.0.1:{api.port}"


# -- refusals and retries -----------------------------------------------------------------------

def _rbac(which: str, status: int) -> str:
    method, path, what = CALLS[which]
    reason = {401: "Unauthorized", 403: "Forbidden"}[status]
    return (f"{what}: the API server refused the mirror's identity ({status} {reason}: injected "
            f"{status} {reason} for {method} {path}); check its RBAC")


def _unavailable(which: str, status: int, reason: str) -> str:
    method, path, what = CALLS[which]
    return (f"{what}: the Kubernetes API failed 3 time(s), last: {status} {reason}: injected "
            f"{status} {reason} for {method} {path}; retry later")


REFUSALS = [
    ("get", 404, PodNotFound, "pod team-a/train-0 not found"),
    ("patch", 404, PodNotFound, "pod team-a/train-0 not found"),
    ("node", 404, NodeNotFound, "node node-1 not found"),
    ("patch", 409, WriteConflict, f"409 Conflict: injected 409 Conflict for PATCH {POD_PATH}"),
    ("patch", 422, WriteInvalid, f"422 Invalid: injected 422 Invalid for PATCH {POD_PATH}"),
    ("patch", 403, ApiRejected, _rbac("patch", 403)),
    ("get", 401, ApiRejected, _rbac("get", 401)),
    ("node", 403, ApiRejected, _rbac("node", 403)),
    ("patch", 400, ApiRejected,
     f"patch pod team-a/train-0: 400 BadRequest: injected 400 BadRequest for PATCH {POD_PATH}"),
    ("patch", 503, ApiUnavailable, _unavailable("patch", 503, "ServiceUnavailable")),
    ("get", 500, ApiUnavailable, _unavailable("get", 500, "InternalError")),
    ("node", 429, ApiUnavailable, _unavailable("node", 429, "TooManyRequests")),
]


@pytest.mark.parametrize(("which", "status", "error", "message"), REFUSALS,
                         ids=[f"{which}-{status}" for which, status, *_ in REFUSALS])
async def test_each_refusal_means_what_it_means_to_the_blocking_store(
        kube, open_store, which, status, error, message):
    """Only throttling and 5xx are tried again; the blocking store, over the official client,
    raises the same error with the same message after as many requests."""
    method, path, _ = CALLS[which]
    kube.fail(method, path, status, times=None)
    tries = FAST.attempts if error is ApiUnavailable else 1
    with pytest.raises(error) as ours:
        await call(open_store(kube.api_client), which)
    assert (type(ours.value), str(ours.value)) == (error, message)
    assert kube.count(method, path) == tries
    with pytest.raises(error) as blocking:
        call(KubePodStore(kube.api_client, backoff=FAST), which)
    assert (type(blocking.value), str(blocking.value)) == (error, message)
    assert kube.count(method, path) == 2 * tries


@pytest.mark.parametrize(("which", "error"), [
    ("get", PodNotFound), ("patch", PodNotFound), ("node", NodeNotFound)])
async def test_a_pod_or_node_that_does_not_exist_is_not_found(kube, open_store, which, error):
    with pytest.raises(error):
        await call(open_store(kube.api_client), which)


@pytest.mark.parametrize("status", [429, 500, 503])
async def test_a_write_throttled_or_failed_once_is_retried_and_lands(kube, open_store, status):
    seed(kube)
    kube.fail("PATCH", POD_PATH, status, times=1)
    written = await open_store(kube.api_client).patch_annotations(NS, NAME, CHANGES, uid="",
                                                                  resource_version="")
    assert dict(written.annotations) == CHANGES
    assert kube.count("PATCH", POD_PATH) == 2


@pytest.mark.parametrize(("retry_after", "delay"), [("2", 2.0), ("30", 10.0)],
                         ids=["honoured", "capped-by-the-backoff"])
async def test_retry_after_of_a_429_is_the_least_wait_before_the_next_try_as_for_the_blocking_store(
        open_store, retry_after, delay):
    throttled = answer(429, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                             "reason": "TooManyRequests", "message": "slow down", "code": 429},
                       f"Retry-After: {retry_after}")
    ok = answer(200, POD)
    backoff = Backoff(attempts=3, base=0.001, cap=10.0)
    clock, blocking_clock = FakeClock(), FakeClock()
    async with StandIn(throttled, ok, throttled, ok) as api:
        store = open_store(api.url, backoff=backoff, clock=clock)
        pod = await store.get_pod(NS, NAME)
        blocking = KubePodStore(store.api, backoff=backoff, clock=blocking_clock)
        await asyncio.to_thread(blocking.get_pod, NS, NAME)
    assert pod.uid == "u-1"
    assert clock.sleeps == blocking_clock.sleeps == [delay]
    assert len(api.seen) == 4


async def test_a_gateways_answer_that_is_not_a_status_is_reported_as_by_the_blocking_store(
        open_store):
    async with StandIn(answer(502, b"<html>bad gateway</html>")) as api:
        store = open_store(api.url)
        with pytest.raises(ApiUnavailable) as ours:
            await store.get_pod(NS, NAME)
        with pytest.raises(ApiUnavailable) as blocking:
            await asyncio.to_thread(KubePodStore(store.api, backoff=FAST).get_pod, NS, NAME)
    assert str(ours.value) == str(blocking.value) == (
        "read pod team-a/train-0: the Kubernetes API failed 3 time(s), last: 502 Bad Gateway; "
        "retry later")
    assert len(api.seen) == 2 * FAST.attempts


@pytest.mark.parametrize("which", CALLS)
async def test_an_answer_that_is_not_json_is_rejected_naming_the_request_and_not_retried(
        open_store, which):
    async with StandIn(answer(200, b"<html>gateway</html>")) as api:
        with pytest.raises(ApiRejected) as e:
            await call(open_store(api.url), which)
    assert str(e.value) == (f"{CALLS[which][2]}: the API server's answer is not JSON "
                            "(b'<html>gateway</html>')")
    assert len(api.seen) == 1


async def test_the_blocking_store_rejects_an_answer_that_is_not_json_the_same_way(open_store):
    """PodStore's calls raise MirrorErrors only; the async twin's ApiRejected is the meaning."""
    async with StandIn(answer(200, b"<html>gateway</html>")) as api:
        blocking = KubePodStore(open_store(api.url).api,
                                backoff=FAST)
        with pytest.raises(ApiRejected) as e:
            await asyncio.to_thread(blocking.get_pod, NS, NAME)
    assert str(e.value) == ("read pod team-a/train-0: the API server's answer is not JSON "
                            "(b'<html>gateway</html>')")
    assert len(api.seen) == 1


# -- deadlines -------------------------------------------------------------------------------

@pytest.mark.parametrize("which", CALLS)
async def test_an_expired_deadline_sends_nothing(kube, open_store, which):
    with pytest.raises(DeadlineExceeded) as e:
        await call(open_store(kube.api_client), which, Deadline.after(-1))
    assert str(e.value) == f"{CALLS[which][2]}: the caller's deadline ran out"
    assert kube.count() == 0


@pytest.mark.parametrize("which", ["get", "patch"])
async def test_the_deadline_bounds_the_wait_for_an_answer(faulty_api, open_store, which):
    faulty_api.add_pod(NAME, {}, namespace=NS)
    method, path, _ = CALLS[which]
    faulty_api.fail(method, path, Fault.TIMEOUT, times=None)
    store = open_store(faulty_api.url, request_timeout=5.0)
    started = time.monotonic()
    with pytest.raises((DeadlineExceeded, ApiUnavailable)):
        await call(store, which, Deadline.after(0.2))
    assert time.monotonic() - started < 1.0


# -- transport faults ----------------------------------------------------------------------------

@pytest.mark.parametrize("fault", [Fault.RESET, Fault.TIMEOUT])
@pytest.mark.parametrize("method", ["GET", "PATCH"])
async def test_a_reset_or_unanswered_request_is_tried_again_and_succeeds(
        faulty_api: FaultyApi, open_store, method, fault):
    meta = faulty_api.add_pod(NAME, {}, namespace=NS)["metadata"]
    faulty_api.fail(method, POD_PATH, fault)
    store = open_store(faulty_api.url, request_timeout=0.2)  # FaultyApi holds it for 1 s
    calls = {"GET": lambda: store.get_pod(NS, NAME),
             "PATCH": lambda: store.patch_annotations(NS, NAME, CHANGES, uid=meta["uid"],
                                                      resource_version=meta["resourceVersion"])}
    pod = await calls[method]()
    assert pod.uid == meta["uid"]
    stats = faulty_api.stats(NS, NAME)
    assert (stats.gets, stats.patch_requests, stats.writes) == {
        "GET": (2, 0, 0), "PATCH": (0, 2, 1)}[method]
    assert faulty_api.call(lambda: faulty_api.cluster.faults_served[fault]) == 1


@pytest.mark.parametrize("fault", [Fault.RESET_AFTER_WRITE, Fault.TIMEOUT_AFTER_WRITE])
async def test_a_guarded_write_whose_answer_was_lost_is_never_applied_twice(
        faulty_api: FaultyApi, open_store, fault):
    """The retry carries the resourceVersion the lost write already moved past: refused."""
    meta = faulty_api.add_pod(NAME, {}, namespace=NS)["metadata"]
    faulty_api.fail("PATCH", POD_PATH, fault)
    store = open_store(faulty_api.url, request_timeout=0.2)
    with pytest.raises(WriteConflict):
        await store.patch_annotations(NS, NAME, CHANGES, uid=meta["uid"],
                                      resource_version=meta["resourceVersion"])
    stats = faulty_api.stats(NS, NAME)
    assert (stats.patch_requests, stats.writes) == (2, 1)
    assert faulty_api.pod(NS, NAME)["metadata"]["annotations"] == CHANGES


async def test_an_api_that_refuses_connections_is_unavailable_after_the_configured_tries(
        open_store):
    clock = FakeClock()
    store = open_store(f"http://127.0.0.1:{closed_port()}", clock=clock)
    with pytest.raises(ApiUnavailable) as e:
        await store.get_pod(NS, NAME)
    assert str(e.value).startswith("read pod team-a/train-0: the Kubernetes API failed 3 time(s), "
                                   "last: ConnectionRefusedError")
    assert len(clock.sleeps) == FAST.attempts - 1
    assert store.transport.pool.opened == 0


async def test_sequential_calls_share_one_kept_connection(kube, open_store):
    seed(kube)
    store = open_store(kube.api_client)
    for _ in range(5):
        pod = await store.get_pod(NS, NAME)
        await store.patch_annotations(NS, NAME, CHANGES, uid=pod.uid,
                                      resource_version=pod.resource_version)
        await store.node_labels(NODE)
        with pytest.raises(PodNotFound):
            await store.get_pod(NS, "gone")
    assert kube.count() == 2 + 5 * 4
    assert store.transport.pool.opened == 1


# -- configuration: proxies, URLs, TLS -------------------------------------------------------

async def test_a_configuration_behind_a_proxy_gets_the_official_client_in_threads(client_for):
    api_client = client_for(configured("http://127.0.0.1:6443",
                                           proxy="http://proxy.invalid:3128", no_proxy=""))
    store = async_pod_store(api_client, backoff=FAST, request_timeout=3.0)
    assert isinstance(api_client.rest_client.pool_manager, urllib3.ProxyManager)
    assert isinstance(store, ThreadedPodStore)
    assert isinstance(store.store, KubePodStore)
    assert store.store.core.api_client is api_client
    assert (store.store.backoff, store.store.request_timeout) == (FAST, 3.0)
    await store.close()


@pytest.mark.parametrize(("proxy", "no_proxy"), [
    ("http://proxy.invalid:3128", "127.0.0.1"),
    ("http://proxy.invalid:3128", "10.0.0.0/8,127.0.0.0/8"),
    ("http://proxy.invalid:3128", "*"),
    (None, ""),
], ids=["no-proxy-host", "no-proxy-network", "no-proxy-all", "no-proxy"])
async def test_a_configuration_that_reaches_the_api_directly_gets_the_event_loop_store(
        client_for, proxy, no_proxy):
    api_client = client_for(configured("http://127.0.0.1:6443", proxy=proxy,
                                           no_proxy=no_proxy))
    store = async_pod_store(api_client, backoff=FAST)
    # The official client's own decision, for the same configuration.
    assert not isinstance(api_client.rest_client.pool_manager, urllib3.ProxyManager)
    assert isinstance(store, AsyncKubePodStore)
    assert (store.api, store.backoff) == (api_client, FAST)
    await store.close()


@pytest.mark.parametrize("settings", [
    {"ssl_ca_cert": "missing-ca.crt"},
    {"ssl_ca_cert": "garbage.crt"},
    {"cert_file": "missing.crt", "key_file": "missing.key"},
], ids=["missing-ca", "ca-that-is-not-a-certificate", "missing-client-certificate"])
def test_tls_settings_that_cannot_load_are_a_config_error_naming_tls(client_for, tmp_path,
                                                                     settings):
    (tmp_path / "garbage.crt").write_text("not a certificate\n")
    configuration = configured("https://127.0.0.1:6443", **{
        name: str(tmp_path / file) for name, file in settings.items()})
    with pytest.raises(ConfigError, match=r"^cannot load the TLS settings for the Kubernetes "
                                          r"API server: "):
        async_pod_store(client_for(configuration))


@pytest.mark.parametrize("host", [
    "ftp://127.0.0.1:21",
    "127.0.0.1:6443",
    "https://",
    "http://127.0.0.1:99999",
    "https://127.0.0.1:port",
], ids=["ftp", "no-scheme", "no-host", "port-out-of-range", "port-not-a-number"])
def test_a_server_url_that_is_not_http_s_host_port_path_is_a_config_error(client_for, host):
    """A ConfigError is what the mirror's command reports (exit 2) instead of a traceback."""
    with pytest.raises(ConfigError, match=r"is not http\(s\)://host\[:port\]\[/path\]$"):
        async_pod_store(client_for(host))


@pytest.mark.parametrize(("settings", "verify_mode", "check_hostname"), [
    ({}, ssl.CERT_REQUIRED, True),
    ({"verify_ssl": False}, ssl.CERT_NONE, False),
    ({"assert_hostname": False}, ssl.CERT_REQUIRED, False),
], ids=["default", "verify-ssl-false", "assert-hostname-false"])
def test_tls_checks_the_certificate_and_the_host_name_unless_told_not_to(
        settings, verify_mode, check_hostname):
    context = tls_context(configured("https://api.example.test:6443", **settings))
    assert (context.verify_mode, context.check_hostname) == (verify_mode, check_hostname)


@pytest.mark.parametrize("given_as", ["ssl_ca_cert", "ca_cert_data"])
def test_the_configured_ca_is_the_one_trusted(tmp_path, given_as):
    ca = CertificateAuthority()
    (tmp_path / "ca.crt").write_bytes(ca.pem)
    value = {"ssl_ca_cert": str(tmp_path / "ca.crt"), "ca_cert_data": ca.pem.decode()}[given_as]
    context = tls_context(configured("https://api.example.test:6443", **{given_as: value}))
    assert [cert["subject"] for cert in context.get_ca_certs()] == [
        ((("commonName", "kai-fractions test CA"),),)]


@pytest.mark.parametrize(("settings", "server_hostname"), [
    ({}, "api.example.test"),
    ({"tls_server_name": "kube.internal"}, "kube.internal"),
    ({"assert_hostname": "kube.internal"}, "kube.internal"),
    ({"assert_hostname": False}, "api.example.test"),
    ({"tls_server_name": "sni.internal", "assert_hostname": "kube.internal"}, "sni.internal"),
], ids=["host", "tls-server-name", "assert-hostname", "no-hostname-check", "both"])
async def test_the_tls_server_name_is_the_name_the_pool_dials(open_store, settings,
                                                              server_hostname):
    pool = open_store(configured("https://api.example.test:6443", **settings)).transport.pool
    assert (pool.host, pool.port, pool.server_hostname) == ("api.example.test", 6443,
                                                            server_hostname)


@pytest.fixture
def pki(tmp_path) -> dict[str, Any]:
    ca, rogue = CertificateAuthority(), CertificateAuthority("someone else's CA")
    (tmp_path / "ca.crt").write_bytes(ca.pem)
    (tmp_path / "rogue.crt").write_bytes(rogue.pem)
    server = ca.issue("localhost", server=True).write(tmp_path, "server")
    client = ca.issue("kai-mirror", server=False).write(tmp_path, "client")
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cadata=ca.pem.decode())
    tls.load_cert_chain(*server)
    tls.verify_mode = ssl.CERT_REQUIRED
    tls.set_alpn_protocols(["h2", "http/1.1"])
    return {"server_tls": tls, "ca": str(tmp_path / "ca.crt"),
            "rogue": str(tmp_path / "rogue.crt"), "client": tuple(map(str, client))}


@pytest.mark.parametrize("server_name", ["localhost", None], ids=["tls-server-name", "ip-address"])
async def test_over_tls_the_store_trusts_its_ca_shows_its_certificate_and_speaks_http_1_1(
        open_store, pki, server_name):
    """The server certificate names both localhost and 127.0.0.1; no SNI for an address."""
    cert_file, key_file = pki["client"]
    async with StandIn(answer(200, POD), tls=pki["server_tls"]) as api:
        store = open_store(configured(api.url, ssl_ca_cert=pki["ca"], cert_file=cert_file,
                                          key_file=key_file, tls_server_name=server_name))
        pod = await store.get_pod(NS, NAME)
        await store.get_pod(NS, NAME)  # on the kept connection: one handshake
    assert pod.uid == "u-1"
    assert api.handshakes == [Handshake(server_name, "http/1.1", "kai-mirror")]


async def test_over_tls_a_server_certificate_from_another_ca_is_refused(open_store, pki):
    cert_file, key_file = pki["client"]
    async with StandIn(answer(200, POD), tls=pki["server_tls"]) as api:
        store = open_store(configured(api.url, ssl_ca_cert=pki["rogue"], cert_file=cert_file,
                                          key_file=key_file))
        with pytest.raises(ApiUnavailable, match="SSLCertVerificationError"):
            await store.get_pod(NS, NAME)
    assert api.seen == []
