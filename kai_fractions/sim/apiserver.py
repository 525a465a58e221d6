"""A simulated Kubernetes API server for the demo (and the tests): kmock with uids and
resourceVersions, so the demo runs the real mirror and node agent, with the official client,
without a cluster.

`EmbeddedApiServer` runs kmock's `KubernetesEmulator` (subclassed, see below) with kmock's
`Server` on 127.0.0.1 in a background thread with its own event loop; the official `kubernetes`
client talks to it over plain HTTP (`configuration()`, `write_kubeconfig()`). kmock is the
`demo` extra (`pip install 'kai-fractions[demo]'`): import this module only when it is needed.

What plain kmock 0.8 lacks, and what this module does about it:

* `metadata.uid`, `metadata.resourceVersion`, `metadata.creationTimestamp`: kmock stores
  objects exactly as sent. `VersionedKubernetesEmulator` adds them: every create stamps a
  fresh `uid` (uuid4), `creationTimestamp` and the next `resourceVersion`; every successful
  write (create, patch of the object or of its status, delete) takes the next value of ONE
  server-wide counter, the way etcd revisions do. A list's `metadata.resourceVersion` is the
  current counter. `generateName` is honoured; a missing `metadata.namespace` is filled from
  the URL (a different one is a 400, as in Kubernetes).
* Annotation keys are checked as the API server checks them (kmock checks nothing): a create or
  patch whose resulting object carries a key Kubernetes refuses (apimachinery IsQualifiedName:
  a name part over 63 characters, a prefix that is no DNS subdomain, ...) is refused with
  **422 Invalid**, `Pod "p" is invalid: metadata.annotations: Invalid value: "<key>": name part
  must be no more than 63 characters`, and changes nothing (`annotation_keys`). Objects put
  straight into `emulator.objects` are not checked (a later patch of them is).
* Optimistic concurrency (kmock has none): a merge/strategic patch whose `metadata`
  carries a `resourceVersion` (or `uid`) different from the stored one is refused with
  **409 Conflict** and changes nothing; a JSON patch whose `test` op fails is **422**, and one
  that would write a different `resourceVersion` is 409; `DeleteOptions.preconditions`
  (`resourceVersion`/`uid`) are checked too (409). A create whose body carries a
  `resourceVersion` fails (500, "resourceVersion should not be set on objects to be created",
  like the real apiserver). Objects put straight into `emulator.objects` have no
  `resourceVersion`/`uid`; for them the precondition checks are skipped.
* PUT (replace/update) is not served by kmock (404): code that needs optimistic concurrency must
  use patches carrying `metadata.resourceVersion` (or a JSON patch with a `test` op).
* Label and field selectors are IGNORED by kmock: list/watch return every object of the
  resource (in the namespace). Clients must filter on their side too.
* `watch` ignores `resourceVersion`/`allowWatchBookmarks`/`timeoutSeconds`: it replays
  the current objects as ADDED, then streams changes and never ends by itself (a client with
  `_request_timeout` gets urllib3's `ReadTimeoutError`). The DELETED event that follows the
  removal of the last finalizer carries the resourceVersion of that patch (no extra bump).
* Strategic merge patches are applied as JSON merge patches (lists are replaced, no
  `$patch` directives); server-side apply is not supported.
* Discovery of custom resources, the dynamic client and kubectl do not work against kmock.
* Every request costs more the more objects are stored.
* kmock's own reactions (`emulator[...] << 409`) answer AFTER kmock has already applied the
  create/patch/delete to its store: a raw "409" reaction on a PATCH still changes the object.
  Use `add_fault` for faults that must leave the state untouched (checked before
  anything else, the request is still recorded).
* kmock patches aiohttp's resolver while a server runs; several servers must stop in LIFO order.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import random
import re
import string
import threading
import uuid as uuid_mod
import warnings
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import attrs
import jsonpatch
import jsonpointer
import kmock
import yaml
from kubernetes import client as k8s_client

from . import annotation_keys

PathMatch = str | re.Pattern[str] | None

_REASONS = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    409: "Conflict",
    410: "Expired",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}


def _path_matches(pattern: PathMatch, path: str) -> bool:
    if pattern is None:
        return True
    if isinstance(pattern, re.Pattern):
        return pattern.fullmatch(path) is not None
    return pattern == path


def _method_matches(method: str | None, actual: str) -> bool:
    return method is None or method.upper() == actual.upper()


@dataclass
class Fault:
    """An injected failure answered before the emulator touches its store."""

    method: str | None
    path: PathMatch
    status: int
    times: int | None  # None: forever
    reason: str | None = None
    message: str | None = None
    hits: int = 0

    @property
    def exhausted(self) -> bool:
        return self.times is not None and self.hits >= self.times

    def error(self, request: kmock.Request) -> kmock.KubernetesError:
        reason = self.reason or _REASONS.get(self.status, "InternalError")
        message = (
            self.message
            or f"injected {self.status} {reason} for {request.method.value} {request.url.path}"
        )
        details: dict[str, Any] = {"injected": True}
        if request.name:
            details["name"] = request.name
        if request.resource is not None and request.resource.plural:
            details["kind"] = request.resource.plural
        return kmock.KubernetesError(
            status=self.status, reason=reason, message=message, details=details
        )


def _conflict(request: kmock.Request, why: str) -> kmock.KubernetesError:
    kind = request.resource.plural if request.resource is not None else "object"
    return kmock.KubernetesError(
        status=409,
        reason="Conflict",
        message=f'Operation cannot be fulfilled on {kind} "{request.name}": {why}',
        details={"name": request.name, "kind": kind},
    )


_MODIFIED = (
    "the object has been modified; please apply your changes to the latest version and try again"
)


def _check_annotations(request: kmock.Request, obj: Any) -> None:
    """422 Invalid, as the API server answers, when `obj` (the object a write would store)
    carries an annotation key Kubernetes refuses."""
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    annotations = meta.get("annotations") if isinstance(meta, dict) else None
    if not isinstance(annotations, dict):
        return
    problems = annotation_keys.invalid_annotations(annotations)
    if not problems:
        return
    plural = request.resource.plural if request.resource is not None else "object"
    kind = annotation_keys.qualified_kind(obj, plural or "object")
    name = str(meta.get("name") or request.name or "")
    raise kmock.KubernetesError(
        status=422,
        reason="Invalid",
        message=annotation_keys.invalid_message(kind, name, problems),
        details={"name": name, "kind": str(obj.get("kind") or plural),
                 "causes": annotation_keys.causes(problems)},
    )


def _merged(current: Any, patch: Any) -> Any:
    """A JSON merge patch (RFC 7386) applied to a copy of `current`: what kmock will store."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(current) if isinstance(current, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = _merged(out.get(key), value)
    return out


@attrs.define(kw_only=True)
class VersionedKubernetesEmulator(kmock.KubernetesEmulator):
    """kmock's emulator plus uid/resourceVersion/creationTimestamp, optimistic-concurrency
    checks and pre-store fault injection (see the module docstring)."""

    _revision: int = attrs.field(default=0, init=False)
    _write_lock: asyncio.Lock = attrs.field(factory=asyncio.Lock, init=False)
    _faults: list[Fault] = attrs.field(factory=list, init=False)
    _faults_lock: threading.Lock = attrs.field(factory=threading.Lock, init=False)

    @property
    def revision(self) -> int:
        """The last resourceVersion handed out (server-wide)."""
        return self._revision

    def add_fault(self, fault: Fault) -> Fault:
        with self._faults_lock:
            self._faults.append(fault)
        return fault

    def clear_faults(self) -> None:
        with self._faults_lock:
            self._faults.clear()

    def _take_fault(self, request: kmock.Request) -> Fault | None:
        with self._faults_lock:
            for fault in self._faults:
                if (
                    not fault.exhausted
                    and _method_matches(fault.method, request.method.value)
                    and _path_matches(fault.path, request.url.path)
                ):
                    fault.hits += 1
                    return fault
        return None

    def _next_revision(self) -> str:
        self._revision += 1
        return str(self._revision)

    async def _handle(self, request: kmock.Request) -> Any:
        fault = self._take_fault(request)
        if fault is not None:
            raise fault.error(request)
        writes = (kmock.action.CREATE, kmock.action.UPDATE, kmock.action.DELETE)
        if request.resource is None or request.action not in writes:
            return await super()._handle(request)
        async with self._write_lock:  # one write at a time: check-then-store stays atomic
            original = request.data
            stamped = self._stamp(request)
            object.__setattr__(request, "data", stamped)
            try:
                return await super()._handle(request)
            finally:
                # the recorded request keeps what the client really sent
                object.__setattr__(request, "data", original)

    # -- stamping -----------------------------------------------------------------------------
    def _stored(self, request: kmock.Request) -> Any | None:
        key = (request.resource, request.namespace, request.name)
        if request.name is None or key not in self.objects:
            return None
        obj = self.objects[key]
        return None if obj.deleted else obj

    def _stamp(self, request: kmock.Request) -> Any:
        if request.action == kmock.action.CREATE:
            return self._stamp_create(request)
        if request.action == kmock.action.UPDATE:
            return self._stamp_patch(request)
        return self._stamp_delete(request)

    def _stamp_create(self, request: kmock.Request) -> Any:
        if not isinstance(request.data, dict):
            return request.data
        data = copy.deepcopy(request.data)
        meta = data.setdefault("metadata", {})
        if meta.get("resourceVersion"):
            raise kmock.KubernetesError(
                status=500,
                reason="InternalError",
                message="resourceVersion should not be set on objects to be created",
                details={"name": meta.get("name")},
            )
        if not meta.get("name") and meta.get("generateName"):
            suffix = "".join(random.choices(string.ascii_lowercase + string.digits, k=5))
            meta["name"] = f"{meta['generateName']}{suffix}"
        if request.namespace:
            if meta.get("namespace") and meta["namespace"] != request.namespace:
                raise kmock.KubernetesError(
                    status=400,
                    reason="BadRequest",
                    message=(
                        "the namespace of the provided object does not match the namespace "
                        "sent on the request"
                    ),
                    details={"name": meta.get("name")},
                )
            meta["namespace"] = request.namespace
        _check_annotations(request, data)
        meta["uid"] = str(uuid_mod.uuid4())
        meta["creationTimestamp"] = datetime.datetime.now(datetime.UTC).strftime(
            "%Y-%m-%dT%H:%M:%SZ"
        )
        meta["resourceVersion"] = self._next_revision()
        return data

    def _stamp_patch(self, request: kmock.Request) -> Any:
        obj = self._stored(request)
        if obj is None:
            return request.data  # kmock answers 404
        current = obj.raw
        cur_meta = current.get("metadata") or {}
        cur_rv, cur_uid = cur_meta.get("resourceVersion"), cur_meta.get("uid")
        if isinstance(request.data, dict):
            _check_annotations(request, _merged(current, request.data))
            data = copy.deepcopy(request.data)
            meta = data.get("metadata")
            if isinstance(meta, dict):
                rv, uid = meta.get("resourceVersion"), meta.get("uid")
                if rv is not None and cur_rv is not None and str(rv) != str(cur_rv):
                    raise _conflict(request, _MODIFIED)
                if uid is not None and cur_uid is not None and uid != cur_uid:
                    raise _conflict(
                        request,
                        f"Precondition failed: UID in precondition: {uid}, "
                        f"UID in object meta: {cur_uid}",
                    )
            else:
                meta = data["metadata"] = {}
            meta["resourceVersion"] = self._next_revision()
            if cur_uid is not None:
                meta["uid"] = cur_uid
            if cur_meta.get("creationTimestamp") is not None:
                meta["creationTimestamp"] = cur_meta["creationTimestamp"]
            return data
        if isinstance(request.data, list):  # JSON patch
            try:
                result = jsonpatch.apply_patch(copy.deepcopy(current), request.data)
            except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException, TypeError) as e:
                raise kmock.KubernetesError(
                    status=422,
                    reason="Invalid",
                    message=f"the server rejected our request due to an error in our request: {e}",
                    details={"name": request.name},
                ) from None
            _check_annotations(request, result)
            new_rv = (result.get("metadata") or {}).get("resourceVersion")
            if cur_rv is not None and new_rv != cur_rv:
                raise _conflict(request, _MODIFIED)
            ops = list(request.data)
            if not isinstance(result.get("metadata"), dict):
                ops.append({"op": "add", "path": "/metadata", "value": {}})
            ops.append(
                {"op": "add", "path": "/metadata/resourceVersion", "value": self._next_revision()}
            )
            if cur_uid is not None:
                ops.append({"op": "add", "path": "/metadata/uid", "value": cur_uid})
            return ops
        return request.data

    def _stamp_delete(self, request: kmock.Request) -> Any:
        obj = self._stored(request)
        if obj is None:
            return request.data  # kmock answers 404
        cur_meta = obj.raw.get("metadata") or {}
        pre = request.data.get("preconditions") if isinstance(request.data, dict) else None
        if isinstance(pre, dict):
            rv, uid = pre.get("resourceVersion"), pre.get("uid")
            if (
                rv is not None
                and cur_meta.get("resourceVersion") is not None
                and str(rv) != cur_meta["resourceVersion"]
            ):
                raise _conflict(
                    request,
                    f"Precondition failed: ResourceVersion in precondition: {rv}, "
                    f"ResourceVersion in object meta: {cur_meta['resourceVersion']}",
                )
            if uid is not None and cur_meta.get("uid") is not None and uid != cur_meta["uid"]:
                raise _conflict(
                    request,
                    f"Precondition failed: UID in precondition: {uid}, "
                    f"UID in object meta: {cur_meta['uid']}",
                )
        if cur_meta.get("deletionTimestamp") and cur_meta.get("finalizers"):
            return request.data  # already terminating: nothing changes
        # the MODIFIED (finalizers) or DELETED event carries the next resourceVersion
        obj["metadata"] = {**cur_meta, "resourceVersion": self._next_revision()}
        return request.data

    async def _serve_list(self, request: kmock.Request) -> Any:
        result = await super()._serve_list(request)
        if isinstance(result, dict):
            result["metadata"] = {
                **(result.get("metadata") or {}),
                "resourceVersion": str(self._revision),
            }
        return result


# ----------------------------------------------------------------------------------------------


@dataclass
class EmbeddedApiServer:
    """kmock in a background thread with its own event loop. Use as a context manager or call
    `start()`/`stop()`; `url` is what a client dials."""

    emulator: VersionedKubernetesEmulator = field(init=False)
    server: kmock.Server = field(init=False)
    _loop: asyncio.AbstractEventLoop | None = field(default=None, init=False)
    _thread: threading.Thread | None = field(default=None, init=False)

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self, timeout: float = 10.0) -> EmbeddedApiServer:
        if self._loop is not None:
            raise RuntimeError("already started")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kmock", daemon=True)
        self._thread.start()

        async def _start() -> tuple[VersionedKubernetesEmulator, kmock.Server]:
            emulator = VersionedKubernetesEmulator()
            with warnings.catch_warnings():  # kmock 0.8 uses importlib.resources.read_binary
                warnings.simplefilter("ignore", DeprecationWarning)
                emulator.resources.load_bundled()
            await emulator.__aenter__()
            server = kmock.Server(emulator)
            await server.__aenter__()
            return emulator, server

        try:
            self.emulator, self.server = self.call(_start, timeout=timeout)
        except BaseException:
            self._stop_loop()
            raise
        return self

    def stop(self, timeout: float = 10.0) -> None:
        if self._loop is None:
            return
        try:
            async def _stop() -> None:
                await self.server.__aexit__(None, None, None)
                await self.emulator.__aexit__(None, None, None)

            self.call(_stop, timeout=timeout)
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        loop, thread = self._loop, self._thread
        self._loop = self._thread = None
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)
            if thread is not None:
                thread.join(5)
            loop.close()

    @property
    def running(self) -> bool:
        return self._loop is not None

    def __enter__(self) -> EmbeddedApiServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def call(self, coro_fn: Callable[[], Coroutine[Any, Any, Any]], timeout: float = 10.0) -> Any:
        """Runs `coro_fn()` in the server's event loop and returns its result."""
        if self._loop is None:
            raise RuntimeError("the kmock server is not running")
        return asyncio.run_coroutine_threadsafe(coro_fn(), self._loop).result(timeout)

    # -- client side --------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return str(self.server.url).rstrip("/")

    def configuration(self) -> k8s_client.Configuration:
        """A fresh client configuration pointing at this server (plain HTTP, no auth)."""
        cfg = k8s_client.Configuration(host=self.url)
        cfg.retries = False  # urllib3 must not hide injected 5xx/409 behind its own retries
        return cfg

    def write_kubeconfig(self, path: Path | str, namespace: str = "default") -> Path:
        """A kubeconfig for other processes (`KUBECONFIG=...`, `--kubeconfig`)."""
        path = Path(path)
        doc = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "kmock", "cluster": {"server": self.url}}],
            "users": [{"name": "kmock", "user": {"token": "kmock"}}],
            "contexts": [
                {
                    "name": "kmock",
                    "context": {"cluster": "kmock", "user": "kmock", "namespace": namespace},
                }
            ],
            "current-context": "kmock",
        }
        path.write_text(yaml.safe_dump(doc))
        return path

    # -- the store ----------------------------------------------------------------------------
    @property
    def objects(self) -> Any:
        """kmock's store: `objects["v1/pods", "ns", "name"]` (with `.history`)."""
        return self.emulator.objects

    def get_object(self, resource: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        """The stored object as a plain dict, or None when absent or deleted."""
        try:  # (kmock's `in` does not parse "v1/pods" strings; its `[]` does)
            obj = self.emulator.objects[resource, namespace, name]
        except KeyError:
            return None
        return None if obj.deleted else copy.deepcopy(obj.raw)

    @property
    def revision(self) -> int:
        return self.emulator.revision


__all__ = [
    "EmbeddedApiServer",
    "Fault",
    "PathMatch",
    "VersionedKubernetesEmulator",
]
