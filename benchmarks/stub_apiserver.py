"""A Kubernetes API stand-in for the benchmarks: pods and nodes answered from memory at
near-zero cost, in its own process (`python -m benchmarks.stub_apiserver`).

kmock is far too slow to be a baseline (milliseconds per request); this answers in tens of
microseconds, so what a benchmark measures is the client, not the server. It speaks just
enough HTTP/1.1 (keep-alive, Content-Length request bodies, chunked watch responses) and just
enough of the API for the official `kubernetes` client, the mirror's KubePodStore and its
watch cache of pods:

* ``GET /api/v1/namespaces/{ns}/pods/{name}``: any pod name exists. A pod seen for the first
  time is made from the template (``--pod-template FILE``, a Pod's JSON) with its name,
  namespace, ``uid`` = :func:`pod_uid`, a ``resourceVersion`` of its own (the server-wide
  counter moves on) and ``spec.schedulerName`` "default-scheduler" (seeded pods keep the
  template's), and its creation is an ``ADDED`` event, so every call of a benchmark can use a
  pod of its own without creating it first.
* ``PATCH`` of the same path with a JSON merge patch (RFC 7386): a ``metadata.uid`` or
  ``metadata.resourceVersion`` in the patch that differs from the stored one is a 409 Conflict
  and changes nothing, as on a real API server, and so is a change of ``spec.schedulerName``
  (immutable: 422); otherwise the patch is applied, the resourceVersion moves on, the pod is
  answered and the change is a ``MODIFIED`` event.
* ``GET /api/v1/pods`` (all namespaces), with ``fieldSelector`` absent, empty,
  ``spec.schedulerName=X``, ``status.phase=Pending`` or both, comma-joined (every stub pod is
  Pending: nothing runs here; anything else, or a ``labelSelector``: 400):

  - a LIST: a ``PodList`` of the matching pods, ``metadata.resourceVersion`` = the counter now
    (``resourceVersion`` is ignored: always of now). With ``limit=N``, in pages of N, as a
    real API server answers a list from etcd: the first page takes a snapshot, and its
    ``metadata.continue`` token brings the next page of the same snapshot;
  - with ``watch=true`` (``true``, ``True``, ``1``, ...): a WATCH, answered 200 with
    ``Transfer-Encoding: chunked``, one chunk per event, each one JSON line
    ``{"type": ..., "object": <pod>}``. From ``resourceVersion=R``: every change after R, in
    order, the missed ones replayed from a bounded history (``--history N`` events); an R older
    than that history gets one ``ERROR`` event (a Status, code 410, reason Expired) and the end
    of the stream. Without R (or R "0"): an ``ADDED`` event per matching pod first. The stream
    ends after ``timeoutSeconds`` (default 1800). A real API server sends a client its own
    writes back, so every creation and patch reaches every open watch it matches: that is work
    for the watching client, and part of what a benchmark measures. ``allowWatchBookmarks`` is
    accepted; no bookmark is sent.
* ``GET /api/v1/namespaces/{ns}/pods`` with a ``labelSelector`` of ``key=value`` terms
  (comma-joined; none: every pod of the namespace): a ``PodList`` of that namespace's matching
  pods (no paging, no watch).
* ``GET /api/v1/nodes/{name}``: a node carrying ``nvidia.com/gpu.memory`` = ``--node-memory-mib``.
* ``POST /seed`` with ``{"namespace": ns, "names": [...]}`` and optionally ``"labels"`` and
  ``"annotations"`` (maps merged into each new pod's): creates those pods (the ones not there
  yet) from the template, as a real pod exists before anything allocates for it; answers
  ``{"created": n}``. ``--seed NAMESPACE:COUNT`` does the same at start for ``p0`` ..
  ``p<COUNT-1>``.
* ``POST /expire``: every open watch gets an ``ERROR`` event (410 Expired) and its end, and
  the history is forgotten, as when a real API server's watch cache moved past a client: each
  watching client lists again. Answers ``{"expired": n}`` (the watches ended).
* ``GET /stats``: ``{"requests": N, "pods": M, "watchers": W, "pid": P}`` (API requests so far,
  open watches). Neither /stats nor /seed is counted as a request.

With ``--latency-ms L`` every API answer (not /seed, /stats, /expire, nor a watch's events) is
sent L ms after its request was served, as from an API server that far away; the stub's loop
serves other connections meanwhile.

Binds 127.0.0.1 only. Prints ``PORT <n>`` on stdout when it is listening.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import uuid
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from itertools import dropwhile
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

from kai_fractions.contract import keys as k

_POD = re.compile(r"^/api/v1/namespaces/([^/]+)/pods/([^/?]+)")
_NODE = re.compile(r"^/api/v1/nodes/([^/?]+)")
_NAMESPACED_POD_LIST = re.compile(r"^/api/v1/namespaces/([^/]+)/pods$")
_LABEL_KEY = re.compile(r"^[A-Za-z0-9._/-]+$")
_POD_LIST = "/api/v1/pods"
_UID_NAMESPACE = uuid.UUID("6ba7b811-9dad-11d1-80b4-00c04fd430c8")  # RFC 4122 URL namespace
_SCHEDULER_FIELD = "spec.schedulerName"
_PHASE_FIELD = "status.phase"
UNSEEDED_SCHEDULER = "default-scheduler"
ADMITTED_NAMESPACE_SUFFIX = k.ADMITTED_MPS_NAMESPACE
"""A template annotation with this suffix gets a name of its pod's own (see `Cluster.create`)."""
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
"""A template label or annotation with this key gets its pod's own index, as an Indexed Job's
controller writes both (the number its name ends with; `Cluster.create`)."""
"""The scheduler of a pod made by its first GET or PATCH (seeded pods keep the template's): the
bare-client baselines' pods are not KAI's, so a watch of KAI's pods never carries their
traffic, as in a cluster where most pods belong to another scheduler."""
# What Go's strconv.ParseBool takes, which is how the API server reads `watch`.
_TRUE = frozenset({"1", "t", "T", "true", "TRUE", "True"})
_FALSE = frozenset({"0", "f", "F", "false", "FALSE", "False"})
DEFAULT_HISTORY = 10_000
"""Events kept for watches that start behind: several seconds of a benchmark's writes, so a
client's LIST-then-WATCH never falls out of it, yet a bounded memory (a pod is about 1 KB)."""
DEFAULT_WATCH_TIMEOUT_S = 1800  # the API server's --min-request-timeout
MAX_WATCH_BACKLOG = 64 << 20
"""Bytes a watcher may leave unread before it is cut off, as a real API server closes a watch
that does not keep up rather than buffer without end (room for a whole history replayed)."""
_CHUNKED_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                 b"Transfer-Encoding: chunked\r\n\r\n")
_LAST_CHUNK = b"0\r\n\r\n"
# One encoder for every answer: json.dumps with separators builds a new one per call.
_ENCODER = json.JSONEncoder(separators=(",", ":"))


def _encode(obj: Any) -> bytes:
    return _ENCODER.encode(obj).encode()


def pod_uid(namespace: str, name: str) -> str:
    """The uid the stub gives pod `namespace/name` (a client computes it the same way)."""
    return str(uuid.uuid5(_UID_NAMESPACE, f"{namespace}/{name}"))


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge key by key, null deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def status_response(code: int, reason: str, message: str) -> tuple[int, dict]:
    return code, {"apiVersion": "v1", "kind": "Status", "status": "Failure",
                  "message": message, "reason": reason, "code": code}


def stale_precondition(pod: dict, patch: dict) -> tuple[int, dict] | None:
    """The 409 a real API server answers when a patch's `metadata.uid` or
    `metadata.resourceVersion` is not the stored pod's; None when both hold (or are absent)."""
    meta, want = pod["metadata"], patch.get("metadata") or {}
    if any(field in want and want[field] != meta[field] for field in ("uid", "resourceVersion")):
        return status_response(409, "Conflict", f'Operation cannot be fulfilled on pods '
                               f'"{meta["name"]}": the object has been modified; please apply '
                               "your changes to the latest version and try again")
    return None


def _status(code: int, reason: str, message: str) -> tuple[int, bytes]:
    code, body = status_response(code, reason, message)
    return code, _encode(body)


def _chunk(event_type: str, obj_json: bytes) -> bytes:
    """One watch event as the chunk that carries it (framing included, so it is built once)."""
    line = b'{"type":"%s","object":%s}\n' % (event_type.encode(), obj_json)
    return b"%x\r\n%s\r\n" % (len(line), line)


def _pod_list(meta: dict[str, Any], items: list[bytes]) -> bytes:
    """A PodList of pods kept encoded: a join, not a re-encoding."""
    return b'{"apiVersion":"v1","kind":"PodList","metadata":%s,"items":[%s]}' % (
        _encode(meta), b",".join(items))


def _scheduler(pod: dict) -> str | None:
    return (pod.get("spec") or {}).get("schedulerName")


@dataclass(frozen=True)
class WatchRequest:
    """A parsed watch of pods: `scheduler` None is every pod; `since` None is "from now, with
    the pods there are as ADDED"."""

    scheduler: str | None
    since: int | None
    timeout_s: float


class Cluster:
    def __init__(self, pod_template: dict, node_memory_mib: int,
                 history: int = DEFAULT_HISTORY, latency_s: float = 0.0) -> None:
        if history < 1:
            raise ValueError(f"history {history}: at least one event is kept")
        self.latency_s = latency_s
        self.template = json.dumps(pod_template)  # json.loads copies faster than deepcopy
        self.node_memory_mib = node_memory_mib
        self.pods: dict[tuple[str, str], dict] = {}
        self.revision = 1
        self.requests = 0
        # (revision, the pod's scheduler, the event's chunk): every change, one per revision.
        self.history: deque[tuple[int, str | None, bytes]] = deque(maxlen=history)
        self.compacted = self.revision  # changes up to here are no longer in the history
        self.watchers: list[_Http] = []
        self.snapshots: dict[str, tuple[list[bytes], int]] = {}  # continue token -> the rest
        self.encoded: dict[tuple[str, str], bytes] = {}
        """Each pod's JSON as of its last change: a list is a join of these, as a real API
        server's watch cache keeps its objects serialized."""

    # -- pods and their events --

    def pod(self, namespace: str, name: str) -> tuple[dict, bytes | None]:
        """The pod, and its JSON when this call created it (already encoded for the event)."""
        pod = self.pods.get((namespace, name))
        if pod is not None:
            return pod, None
        return self.create(namespace, name, scheduler=UNSEEDED_SCHEDULER)

    def create(self, namespace: str, name: str, scheduler: str | None = None,
               labels: dict[str, str] | None = None, annotations: dict[str, str] | None = None,
               ) -> tuple[dict, bytes]:
        pod = json.loads(self.template)
        if scheduler is not None:
            pod.setdefault("spec", {})["schedulerName"] = scheduler
        self.revision += 1
        meta = pod.setdefault("metadata", {})
        meta.update(name=name, namespace=namespace, uid=pod_uid(namespace, name),
                    resourceVersion=str(self.revision))
        for key, extra in (("labels", labels), ("annotations", annotations)):
            if extra:
                meta[key] = {**(meta.get(key) or {}), **extra}
        index = re.search(r"[0-9]+$", name)
        for key in ("labels", "annotations"):
            if COMPLETION_INDEX in (meta.get(key) or {}):
                meta[key][COMPLETION_INDEX] = index.group() if index else "0"
        notes = meta.get("annotations") or {}
        for key in [key for key in notes if key.endswith(ADMITTED_NAMESPACE_SUFFIX)]:
            # Each pod its own, as the admission webhook names them: one per pod, so equal
            # annotation maps are no longer equal across a Job's pods.
            notes[key] = "kf_" + hashlib.sha256(meta["uid"].encode()).hexdigest()[:20]
        self.pods[(namespace, name)] = pod
        encoded = self.encoded[(namespace, name)] = _encode(pod)
        self.emit("ADDED", pod, encoded)
        return pod, encoded

    def emit(self, event_type: str, pod: dict, encoded: bytes) -> None:
        """Records the change at `self.revision` and sends it to every watch it matches: the
        same bytes to each, once the request that made the change is answered (a real API
        server answers the write when it is stored and fans the event out after that)."""
        chunk = _chunk(event_type, encoded)
        scheduler = _scheduler(pod)
        if len(self.history) == self.history.maxlen:
            self.compacted = self.history[0][0]
        self.history.append((self.revision, scheduler, chunk))
        # The watches of now: one that starts before the fan-out replays this change itself.
        matching = [w for w in self.watchers if w.scheduler in (None, scheduler)]
        if matching:  # there are none before the loop runs (--seed)
            asyncio.get_running_loop().call_soon(self.fan_out, matching, chunk)

    @staticmethod
    def fan_out(watchers: list[_Http], chunk: bytes) -> None:
        for watcher in watchers:
            if watcher.watching:  # still open
                watcher.send(chunk)

    def seed(self, body: bytes) -> tuple[int, bytes]:
        try:
            request = json.loads(body)
            namespace, names = request["namespace"], request["names"]
            labels, annotations = request.get("labels") or {}, request.get("annotations") or {}
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            return _status(400, "BadRequest", f'want {{"namespace": ..., "names": [...]}}: {e}')
        if not isinstance(namespace, str) or not isinstance(names, list) or not all(
                isinstance(name, str) for name in names):
            return _status(400, "BadRequest", "namespace is a string, names a list of strings")
        if not all(isinstance(m, dict) and all(isinstance(v, str) for v in m.values())
                   for m in (labels, annotations)):
            return _status(400, "BadRequest", "labels and annotations are maps of strings")
        created = 0
        for name in names:
            if (namespace, name) not in self.pods:
                self.create(namespace, name, labels=labels, annotations=annotations)
                created += 1
        return 200, _encode({"created": created})

    # -- requests --

    def answer(self, method: str, target: str, body: bytes
               ) -> tuple[int, bytes] | WatchRequest:
        path, _, query = target.partition("?")
        if path == "/stats":  # not an API request: not counted
            return 200, _encode({"requests": self.requests, "pods": len(self.pods),
                                 "watchers": len(self.watchers), "pid": os.getpid()})
        if path == "/seed" and method == "POST":  # setting the scene, not an API request
            return self.seed(body)
        if path == "/expire" and method == "POST":
            return 200, _encode({"expired": self.expire()})
        self.requests += 1
        if (m := _POD.match(path)) is not None:
            pod, created = self.pod(m.group(1), m.group(2))
            if method == "GET":
                return 200, created if created is not None else _encode(pod)
            if method == "PATCH":
                return self.patch(pod, body)
            return _status(405, "MethodNotAllowed", f"{method} is not served by the stub")
        if path == _POD_LIST and method == "GET":
            return self.list_or_watch(query)
        if (m := _NAMESPACED_POD_LIST.match(path)) is not None and method == "GET":
            return self.list_labelled(m.group(1), query)
        if (m := _NODE.match(path)) is not None and method == "GET":
            return 200, _encode({"apiVersion": "v1", "kind": "Node", "metadata": {
                "name": m.group(1), "uid": pod_uid("", m.group(1)), "resourceVersion": "1",
                "labels": {k.NODE_GPU_MEMORY_LABEL: str(self.node_memory_mib)}}})
        return _status(404, "NotFound", f"{method} {path} is not served by the stub")

    def patch(self, pod: dict, body: bytes) -> tuple[int, bytes]:
        try:
            patch = json.loads(body)
        except ValueError as e:
            return _status(400, "BadRequest", f"not JSON: {e}")
        if not isinstance(patch, dict):
            return _status(400, "BadRequest", "a merge patch of a pod is a JSON object")
        meta = pod["metadata"]
        if (refused := stale_precondition(pod, patch)) is not None:
            return refused[0], _encode(refused[1])
        # The scheduler is what watches select on; a real API server refuses to change it.
        spec = patch.get("spec")
        if isinstance(spec, dict) and "schedulerName" in spec and (
                spec["schedulerName"] != _scheduler(pod)):
            return _status(422, "Invalid", f'Pod "{meta["name"]}" is invalid: '
                           f"spec.schedulerName: field is immutable")
        patched = merge_patch(pod, patch)
        self.revision += 1
        patched["metadata"]["resourceVersion"] = str(self.revision)
        pod.clear()
        pod.update(patched)
        encoded = self.encoded[(meta["namespace"], meta["name"])] = _encode(pod)
        self.emit("MODIFIED", pod, encoded)
        return 200, encoded

    def list_or_watch(self, query: str) -> tuple[int, bytes] | WatchRequest:
        params = dict(parse_qsl(query, keep_blank_values=True))
        if params.get("labelSelector"):
            return _status(400, "BadRequest", "the stub serves no labelSelector on pods")
        scheduler = None
        selector = params.get("fieldSelector", "")
        for term in filter(None, selector.split(",")):
            field, _, value = term.replace("==", "=", 1).partition("=")
            if field == _SCHEDULER_FIELD and value and not value.startswith("="):
                scheduler = value
            elif field == _PHASE_FIELD and value == "Pending":
                pass  # every pod here is Pending: the stub runs nothing
            else:
                return _status(400, "BadRequest", f"fieldSelector {selector!r}: the stub "
                               f"serves {_SCHEDULER_FIELD}=NAME and {_PHASE_FIELD}=Pending only")
        watch = params.get("watch", "false")
        if watch not in _TRUE and watch not in _FALSE:
            return _status(400, "BadRequest", f"watch={watch!r} is not a boolean")
        if watch in _FALSE:
            return self.list_page(scheduler, params)
        try:
            since = int(params.get("resourceVersion") or 0)
            timeout_s = int(params.get("timeoutSeconds") or 0)
        except ValueError as e:
            return _status(400, "BadRequest", f"resourceVersion, timeoutSeconds: {e}")
        if since < 0:
            return _status(400, "BadRequest", f"resourceVersion {since}: negative")
        return WatchRequest(scheduler, since or None,  # "0" is "any": the same as none here
                            timeout_s if timeout_s > 0 else DEFAULT_WATCH_TIMEOUT_S)

    def list_labelled(self, namespace: str, query: str) -> tuple[int, bytes]:
        """One namespace's pods that carry every `key=value` of the labelSelector."""
        selector = dict(parse_qsl(query, keep_blank_values=True)).get("labelSelector", "")
        wanted = {}
        for term in filter(None, selector.split(",")):
            key, sep, value = term.replace("==", "=", 1).partition("=")
            if not sep or not _LABEL_KEY.match(key) or value.startswith("="):
                return _status(400, "BadRequest", f"labelSelector {selector!r}: the stub "
                               "serves key=value terms only")
            wanted[key] = value
        items = [self.encoded[key] for key, pod in self.pods.items() if key[0] == namespace
                 and all((pod["metadata"].get("labels") or {}).get(k) == v
                         for k, v in wanted.items())]
        return 200, _pod_list({"resourceVersion": str(self.revision)}, items)

    def list_page(self, scheduler: str | None, params: dict[str, str]) -> tuple[int, bytes]:
        token = params.get("continue", "")
        if token:
            if token not in self.snapshots:
                return _status(410, "Expired", f"continue token {token!r}: unknown or used")
            items, revision = self.snapshots.pop(token)
        else:
            items = [self.encoded[key] for key, pod in self.pods.items()
                     if scheduler is None or _scheduler(pod) == scheduler]
            revision = self.revision
        try:
            limit = int(params.get("limit") or 0)
        except ValueError as e:
            return _status(400, "BadRequest", f"limit: {e}")
        meta: dict[str, Any] = {"resourceVersion": str(revision)}
        if 0 < limit < len(items):
            rest = items[limit:]
            items = items[:limit]
            meta["continue"] = token = uuid.uuid4().hex
            self.snapshots[token] = rest, revision
        return 200, _pod_list(meta, items)

    def expire(self) -> int:
        """Ends every watch with 410 Expired and forgets the history (POST /expire)."""
        self.compacted = self.revision
        self.history.clear()
        _, gone = status_response(410, "Expired", "too old resource version: expired")
        gone["metadata"] = {}
        ended = list(self.watchers)
        for http in ended:
            if http.watch_timer is not None:
                http.watch_timer.cancel()
            http.send(_chunk("ERROR", _encode(gone)))
            http.end_watch()
        return len(ended)

    def start_watch(self, http: _Http, watch: WatchRequest) -> bool:
        """Sends `http` what `watch` missed; False when it ends right there (410)."""
        if watch.since is not None and watch.since < self.compacted:
            _, gone = status_response(410, "Expired", f"too old resource version: "
                                      f"{watch.since} ({self.compacted + 1})")
            gone["metadata"] = {}
            http.send(_CHUNKED_HEAD + _chunk("ERROR", _encode(gone)) + _LAST_CHUNK)
            return False
        backlog = [_CHUNKED_HEAD]
        if watch.since is None:
            backlog += [_chunk("ADDED", _encode(pod)) for pod in self.pods.values()
                        if watch.scheduler is None or _scheduler(pod) == watch.scheduler]
        else:
            since = watch.since
            backlog += [chunk for _, scheduler, chunk in dropwhile(
                lambda event: event[0] <= since, self.history)
                if watch.scheduler is None or scheduler == watch.scheduler]
        http.send(b"".join(backlog))
        http.scheduler = watch.scheduler
        self.watchers.append(http)
        return True

    def stop_watch(self, http: _Http) -> None:
        with suppress(ValueError):
            self.watchers.remove(http)


_REASON = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
           409: "Conflict", 410: "Gone", 422: "Unprocessable Entity"}


class _Http(asyncio.Protocol):
    """HTTP/1.1 with keep-alive and Content-Length bodies: all the official client sends.
    A Protocol rather than streams: a third of the cost per request. A watch holds its
    connection: what arrives meanwhile waits in the buffer until the watch ends."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.buffer = b""
        self.transport: asyncio.Transport | None = None
        self.watching = False
        self.scheduler: str | None = None  # what the open watch selects
        self.watch_timer: asyncio.TimerHandle | None = None
        self.close_after_watch = False
        self.delayed = False  # an answer waits for --latency-ms: the next request waits for it

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        if self.watching:
            self.watching = False
            self.cluster.stop_watch(self)
            if self.watch_timer is not None:
                self.watch_timer.cancel()

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if not self.watching:
            self.serve()

    def send(self, data: bytes) -> None:
        assert self.transport is not None
        if self.transport.is_closing():  # cut off, not yet dropped: asyncio warns on writes
            return
        self.transport.write(data)
        if self.transport.get_write_buffer_size() > MAX_WATCH_BACKLOG:
            self.transport.abort()  # connection_lost (soon, not here) drops the watch

    def serve(self) -> None:
        while not self.watching and not self.delayed and (
                end := self.buffer.find(b"\r\n\r\n")) >= 0:
            head = self.buffer[:end].decode("latin-1")
            lines = head.split("\r\n")
            length, close = 0, False
            for line in lines[1:]:
                name, _, value = line.partition(":")
                name = name.lower()
                if name == "content-length":
                    length = int(value)
                elif name == "connection" and value.strip().lower() == "close":
                    close = True
            if len(self.buffer) < end + 4 + length:
                return  # the body is still on its way
            body = self.buffer[end + 4:end + 4 + length]
            self.buffer = self.buffer[end + 4 + length:]
            method, target, _ = lines[0].split(" ", 2)
            reply = self.cluster.answer(method, target, body)
            assert self.transport is not None
            if isinstance(reply, WatchRequest):
                if self.cluster.start_watch(self, reply):
                    self.watching = True
                    self.close_after_watch = close
                    self.watch_timer = asyncio.get_running_loop().call_later(
                        reply.timeout_s, self.end_watch)
                    return
            else:
                code, payload = reply
                answer = (b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n%s" % (
                              code, _REASON.get(code, "").encode(), len(payload), payload))
                latency = self.cluster.latency_s if target.startswith("/api") else 0.0
                if latency > 0:
                    self.delayed = True
                    asyncio.get_running_loop().call_later(latency, self.answer_later, answer,
                                                          close)
                    return
                self.transport.write(answer)
            if close:
                self.transport.close()
                return

    def answer_later(self, answer: bytes, close: bool) -> None:
        assert self.transport is not None
        self.delayed = False
        if self.transport.is_closing():
            return
        self.transport.write(answer)
        if close:
            self.transport.close()
        else:
            self.serve()  # what arrived meanwhile

    def end_watch(self) -> None:
        """timeoutSeconds is up: the last chunk, and the connection serves requests again."""
        assert self.transport is not None
        self.watching = False
        self.watch_timer = None
        self.cluster.stop_watch(self)
        self.transport.write(_LAST_CHUNK)
        if self.close_after_watch:
            self.transport.close()
        else:
            self.serve()


async def _main(port: int, cluster: Cluster) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Http(cluster), "127.0.0.1", port, backlog=256)
    print(f"PORT {server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.stub_apiserver",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--pod-template", metavar="FILE", help="a Pod as JSON")
    parser.add_argument("--node-memory-mib", type=int, default=81920)
    parser.add_argument("--history", type=int, default=DEFAULT_HISTORY, metavar="N",
                        help="events kept for watches that start behind (default %(default)s)")
    parser.add_argument("--latency-ms", type=float, default=0.0, metavar="L",
                        help="answer every API request L ms after serving it (default: at once)")
    parser.add_argument("--seed", action="append", default=[], metavar="NAMESPACE:COUNT",
                        help="create pods p0 .. p<COUNT-1> in NAMESPACE at start (repeatable)")
    args = parser.parse_args(argv)
    seeds = []
    for seed in args.seed:
        namespace, _, count = seed.rpartition(":")
        if not namespace or not count.isdigit():
            parser.error(f"--seed {seed!r}: want NAMESPACE:COUNT")
        seeds.append((namespace, int(count)))
    if args.history < 1:
        parser.error(f"--history {args.history}: at least 1")
    if args.latency_ms < 0:
        parser.error(f"--latency-ms {args.latency_ms}: not negative")
    template = {"apiVersion": "v1", "kind": "Pod", "metadata": {},
                "spec": {"containers": [{"name": "main"}]}}
    if args.pod_template:
        with open(args.pod_template) as f:
            template = json.load(f)
    cluster = Cluster(template, args.node_memory_mib, args.history, args.latency_ms / 1000)
    for namespace, count in seeds:
        for i in range(count):
            cluster.create(namespace, f"p{i}")
    with suppress(KeyboardInterrupt):
        asyncio.run(_main(args.port, cluster))
    return 0


REPO = Path(__file__).resolve().parent.parent


def read_port(process: subprocess.Popen, what: str) -> int:
    """The `PORT <n>` line a helper process prints once it listens."""
    assert process.stdout is not None
    line = process.stdout.readline().strip()
    if not line.startswith("PORT "):
        process.kill()
        raise RuntimeError(f"{what} did not start (said {line!r}); see its stderr")
    return int(line.split()[1])


@contextmanager
def running(pod_template: dict, node_memory_mib: int = 81920,
            history: int = DEFAULT_HISTORY, latency_ms: float = 0.0) -> Iterator[str]:
    """Starts the stub in its own process; yields its base URL; stops it."""
    with tempfile.TemporaryDirectory(prefix="kf-stub-") as tmp:
        template = Path(tmp) / "pod.json"
        template.write_text(json.dumps(pod_template))
        process = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.stub_apiserver", "--pod-template", str(template),
             "--node-memory-mib", str(node_memory_mib), "--history", str(history),
             "--latency-ms", str(latency_ms)],
            cwd=REPO, stdout=subprocess.PIPE, text=True)
        try:
            yield f"http://127.0.0.1:{read_port(process, 'the stub API server')}"
        finally:
            process.terminate()
            process.wait(10)


def seed(url: str, namespace: str, names: list[str], *, labels: dict[str, str] | None = None,
         annotations: dict[str, str] | None = None) -> int:
    """Creates pods `namespace/name` for `names` in the stub at `url` (POST /seed), with
    `labels` and `annotations` over the template's; returns how many were new."""
    import urllib.request

    body = {"namespace": namespace, "names": names, "labels": labels or {},
            "annotations": annotations or {}}
    request = urllib.request.Request(
        url + "/seed", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=30) as response:  # the stub, on loopback
        return int(json.loads(response.read())["created"])


def kubeconfig(url: str, path: Path) -> Path:
    """A kubeconfig (JSON is valid YAML) that points the official client at `url`."""
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "stub",
        "clusters": [{"name": "stub", "cluster": {"server": url}}],
        "users": [{"name": "stub", "user": {}}],
        "contexts": [{"name": "stub", "context": {"cluster": "stub", "user": "stub"}}],
    }))
    return path


if __name__ == "__main__":
    sys.exit(main())
