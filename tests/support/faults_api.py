"""A Kubernetes API stand-in that fails on purpose, at the transport level too.

kmock answers every request with an HTTP status; it cannot time out, reset a connection, or
apply a write and then lose the answer. Those are the faults that test a client's retries for
real, so this small server has them, per request:

* ``CONFLICT`` (409), ``THROTTLE`` (429 with ``Retry-After: 0``), ``ERROR`` (500),
  ``UNAVAILABLE`` (503): answered before anything is applied;
* ``TIMEOUT``: the request is held unanswered (longer than the client waits), never applied;
* ``RESET``: the connection is reset (TCP RST) without an answer, nothing applied;
* ``TIMEOUT_AFTER_WRITE`` / ``RESET_AFTER_WRITE``: a write is applied, then its answer is held
  / the connection reset: the client cannot know its write landed.

It serves what the mirror's KubePodStore uses: ``GET``/``PATCH`` (JSON merge patch, with
``metadata.uid`` and ``metadata.resourceVersion`` preconditions -> 409 like a real API server)
of ``/api/v1/namespaces/{ns}/pods/{name}``, ``GET /api/v1/nodes/{name}`` and event creation.
Per pod it counts the PATCH requests received and the writes applied, which is what "0
duplicates, 0 lost" is measured on. It answers in tens of microseconds (an asyncio Protocol
in a background thread), so 10,000 pods stay cheap, unlike kmock.

Fixture: ``faulty_api`` (started and stopped around one test).
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import socket
import struct
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import pytest
from kubernetes import client as k8s

from benchmarks.stub_apiserver import merge_patch, stale_precondition, status_response

_POD = re.compile(r"^/api/v1/namespaces/([^/]+)/pods/([^/?]+)$")
_NODE = re.compile(r"^/api/v1/nodes/([^/?]+)$")
_EVENTS = re.compile(r"^/api/v1/namespaces/([^/]+)/events$")
_REASONS = {200: "OK", 201: "Created", 400: "Bad Request", 404: "Not Found",
            405: "Method Not Allowed", 409: "Conflict", 429: "Too Many Requests",
            500: "Internal Server Error", 503: "Service Unavailable"}


class Fault(StrEnum):
    CONFLICT = "409"
    THROTTLE = "429"
    ERROR = "500"
    UNAVAILABLE = "503"
    TIMEOUT = "timeout"
    RESET = "reset"
    TIMEOUT_AFTER_WRITE = "timeout-after-write"
    RESET_AFTER_WRITE = "reset-after-write"

    @property
    def status(self) -> int | None:
        return int(self.value) if self.value.isdigit() else None

    @property
    def after_write(self) -> bool:
        return self in (Fault.TIMEOUT_AFTER_WRITE, Fault.RESET_AFTER_WRITE)


ALL_FAULTS = tuple(Fault)


@dataclass
class Rule:
    """The next `times` requests matching `method` and `path` (a regex, full match) get
    `fault`; `times=None`: every one."""

    method: str
    path: str
    fault: Fault
    times: int | None = 1
    hits: int = 0

    def matches(self, method: str, path: str) -> bool:
        return (self.times is None or self.hits < self.times) and method == self.method \
            and re.fullmatch(self.path, path) is not None


READ_FAULTS = (Fault.THROTTLE, Fault.ERROR, Fault.UNAVAILABLE, Fault.TIMEOUT, Fault.RESET)
"""What a read can meet (an API server answers 409 to writes only; a read changes nothing)."""


class RandomFaults:
    """Each GET or PATCH fails with probability `rate`, the fault drawn (seeded) from
    READ_FAULTS for a read and from every fault for a write."""

    def __init__(self, rate: float, seed: int = 0) -> None:
        self.rate = rate
        self.rng = random.Random(seed)
        self.kinds = {"GET": READ_FAULTS, "PATCH": ALL_FAULTS}

    def __call__(self, method: str, path: str) -> Fault | None:
        kinds = self.kinds.get(method)
        if kinds is None or self.rng.random() >= self.rate:
            return None
        return self.rng.choice(kinds)


@dataclass
class PodStats:
    gets: int = 0
    patch_requests: int = 0
    """PATCH requests that reached the server (faulted ones included)."""
    writes: int = 0
    """Patches applied to the stored pod."""


@dataclass
class Cluster:
    pods: dict[tuple[str, str], dict] = field(default_factory=dict)
    nodes: dict[str, dict[str, str]] = field(default_factory=lambda: {"gpu-node-1": {}})
    """Node name -> labels; gpu-node-1 is the node the tests' allocations name."""
    stats: dict[tuple[str, str], PodStats] = field(default_factory=dict)
    events: list[dict] = field(default_factory=list)
    faults_served: Counter = field(default_factory=Counter)
    requests: int = 0
    revision: int = 0

    def add_pod(self, obj: dict) -> dict:
        meta = obj.setdefault("metadata", {})
        meta.setdefault("namespace", "default")
        meta.setdefault("uid", str(uuid.uuid4()))
        self.revision += 1
        meta["resourceVersion"] = str(self.revision)
        key = (meta["namespace"], meta["name"])
        self.pods[key] = obj
        self.stats.setdefault(key, PodStats())
        return obj

    def answer(self, method: str, path: str, body: bytes, fault: Fault | None
               ) -> tuple[int, dict]:
        """The answer; when `fault` is an after-write fault the write is applied first."""
        self.requests += 1
        if (m := _POD.match(path)) is not None:
            key = (m.group(1), m.group(2))
            stats = self.stats.setdefault(key, PodStats())
            if method == "GET":
                stats.gets += 1
            elif method == "PATCH":
                stats.patch_requests += 1
            if fault is not None and not fault.after_write:
                return 0, {}  # the caller serves the fault instead
            pod = self.pods.get(key)
            if pod is None:
                return status_response(404, "NotFound", f'pods "{key[1]}" not found')
            if method == "GET":
                return 200, pod
            if method == "PATCH":
                return self._patch(pod, body, stats)
            return status_response(405, "MethodNotAllowed", method)
        if fault is not None and not fault.after_write:
            return 0, {}
        if (m := _NODE.match(path)) is not None and method == "GET":
            labels = self.nodes.get(m.group(1))
            if labels is None:
                return status_response(404, "NotFound", f'nodes "{m.group(1)}" not found')
            return 200, {"apiVersion": "v1", "kind": "Node",
                         "metadata": {"name": m.group(1), "labels": dict(labels)}}
        if _EVENTS.match(path) is not None and method == "POST":
            event = json.loads(body or b"{}")
            self.events.append(event)
            return 201, event
        return status_response(404, "NotFound", f"{method} {path} is not served")

    def _patch(self, pod: dict, body: bytes, stats: PodStats) -> tuple[int, dict]:
        try:
            patch = json.loads(body)
        except ValueError as e:
            return status_response(400, "BadRequest", f"not JSON: {e}")
        meta = pod["metadata"]
        if (refused := stale_precondition(pod, patch)) is not None:
            return refused
        patched = merge_patch(pod, patch)
        self.revision += 1
        patched["metadata"]["resourceVersion"] = str(self.revision)
        patched["metadata"]["uid"] = meta["uid"]
        pod.clear()
        pod.update(patched)
        stats.writes += 1
        return 200, pod


def _response(code: int, obj: dict, extra: bytes = b"") -> bytes:
    payload = json.dumps(obj, separators=(",", ":")).encode()
    return (b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\n%sContent-Length: %d\r\n\r\n"
            % (code, _REASONS.get(code, "").encode(), extra, len(payload)) + payload)


class _Http(asyncio.Protocol):
    def __init__(self, api: FaultyApi) -> None:
        self.api = api
        self.buffer = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while (end := self.buffer.find(b"\r\n\r\n")) >= 0:
            head = self.buffer[:end].decode("latin-1")
            lines = head.split("\r\n")
            length = 0
            for line in lines[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            if len(self.buffer) < end + 4 + length:
                return
            body = self.buffer[end + 4:end + 4 + length]
            self.buffer = self.buffer[end + 4 + length:]
            method, target, _ = lines[0].split(" ", 2)
            if not self._serve(method, target.split("?", 1)[0], body):
                return  # the connection is gone (reset) or held (timeout)

    def _serve(self, method: str, path: str, body: bytes) -> bool:
        assert self.transport is not None
        fault = self.api.fault_for(method, path)
        cluster = self.api.cluster
        code, obj = cluster.answer(method, path, body, fault)
        if fault is not None:
            cluster.faults_served[fault] += 1
        if fault is None:
            self.transport.write(_response(code, obj))
            return True
        if fault.status is not None:
            extra = b"Retry-After: 0\r\n" if fault is Fault.THROTTLE else b""
            reason = {409: "Conflict", 429: "TooManyRequests", 500: "InternalError",
                      503: "ServiceUnavailable"}[fault.status]
            self.transport.write(_response(*status_response(fault.status, reason,
                                                    f"injected {fault.value}"), extra))
            return True
        if fault in (Fault.RESET, Fault.RESET_AFTER_WRITE):
            sock = self.transport.get_extra_info("socket")
            if sock is not None:  # RST instead of FIN: the client sees ECONNRESET
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.transport.abort()
            return False
        # TIMEOUT / TIMEOUT_AFTER_WRITE: never answer; close once the client has given up.
        self.transport.pause_reading()
        asyncio.get_running_loop().call_later(self.api.hold_seconds, self.transport.close)
        return False


class FaultyApi:
    """Start with `start()` (or as a context manager); `url`, `api_client()`, `cluster`."""

    def __init__(self, *, hold_seconds: float = 1.0) -> None:
        self.cluster = Cluster()
        self.rules: list[Rule] = []
        self.random: Callable[[str, str], Fault | None] | None = None
        self.hold_seconds = hold_seconds
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.base_events.Server | None = None
        self.port = 0

    # -- faults -------------------------------------------------------------------------------
    def fail(self, method: str, path: str, fault: Fault, times: int | None = 1) -> Rule:
        rule = Rule(method, path, fault, times)
        self.rules.append(rule)
        return rule

    def fault_for(self, method: str, path: str) -> Fault | None:
        for rule in self.rules:
            if rule.matches(method, path):
                rule.hits += 1
                return rule.fault
        return self.random(method, path) if self.random is not None else None

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> FaultyApi:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="faulty-api",
                                        daemon=True)
        self._thread.start()

        async def listen() -> asyncio.base_events.Server:
            loop = asyncio.get_running_loop()
            return await loop.create_server(lambda: _Http(self), "127.0.0.1", 0, backlog=512)

        self._server = asyncio.run_coroutine_threadsafe(listen(), self._loop).result(10)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        loop, server = self._loop, self._server
        if loop is None:
            return

        async def close() -> None:
            if server is not None:
                server.close()

        asyncio.run_coroutine_threadsafe(close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(10)
        loop.close()
        self._loop = None

    def __enter__(self) -> FaultyApi:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` in the server's thread (to read or change the cluster consistently)."""
        assert self._loop is not None

        async def run() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(10)

    # -- client side --------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def api_client(self, pool: int = 16) -> k8s.ApiClient:
        configuration = k8s.Configuration(host=self.url)
        configuration.retries = False  # the mirror's own retries only
        configuration.connection_pool_maxsize = pool
        return k8s.ApiClient(configuration)

    def add_pod(self, name: str, annotations: dict[str, str], *, namespace: str = "team-a",
                containers: tuple[str, ...] = ("trainer",)) -> dict:
        obj = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": name, "namespace": namespace,
                            "annotations": dict(annotations)},
               "spec": {"containers": [{"name": c, "image": "registry.invalid/app:1"}
                                       for c in containers]}}
        return self.call(lambda: json.loads(json.dumps(self.cluster.add_pod(obj))))

    def pod(self, namespace: str, name: str) -> dict:
        return self.call(lambda: json.loads(json.dumps(self.cluster.pods[(namespace, name)])))

    def stats(self, namespace: str, name: str) -> PodStats:
        return self.call(lambda: PodStats(**vars(self.cluster.stats[(namespace, name)])))


@pytest.fixture
def faulty_api() -> Iterator[FaultyApi]:
    api = FaultyApi(hold_seconds=1.0).start()
    try:
        yield api
    finally:
        api.stop()


__all__ = ["ALL_FAULTS", "READ_FAULTS", "Fault", "FaultyApi", "PodStats", "RandomFaults", "Rule",
           "faulty_api"]
