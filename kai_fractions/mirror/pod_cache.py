"""The mirror's watch-fed cache of pods: the usual MirrorAllocation costs one API request (the
guarded PATCH) instead of two (GET, then PATCH).

The cache only ever saves a read; correctness never rests on it being fresh (MirrorService):
* a write carries the cached uid and resourceVersion as its precondition, so a stale entry makes
  the API server refuse it (409) and the service reads the pod from the API and recomputes;
* an answer that writes nothing ("the pod already carries this allocation") and a refusal
  (an invalid annotation, another allocation on the pod) are confirmed by a read from the API
  first, so a stale entry never turns into a success nobody checked, nor into a wrong refusal;
* a pod the cache lacks, or holds with another uid than the caller names, is read from the API.

Entries keep only what the contract reads (names, uid, resourceVersion, annotations, labels,
container names and resources, nodeName), about 4 KB per pod as Python objects with a dozen
annotations, and only for Pending pods (`pod_selector`). They are fed by a list + watch of pods
on the mirror server's event loop (`pod_feed`), by every pod the mirror reads, and by every pod
a PATCH returns (write-through), newest resourceVersion first. What the list and the watch
bring is also prepared for an allocation (`prepare`: the mirror parses it as its user wrote it),
about 2 KB more per pod, while the pod waits for the scheduler.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import threading
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from kubernetes import client as k8s

from .aio_api import AsyncKubeApi, behind_proxy
from .aio_listwatch import AsyncListWatch, list_watch_async
from .listwatch import KubeListWatch, list_watch
from .store import PodSnapshot

log = logging.getLogger(__name__)

_METADATA = ("name", "namespace", "uid", "resourceVersion", "annotations", "labels")
_CONTAINER = ("name", "resources")


def _containers(value: Any) -> Any:
    if not isinstance(value, list):
        return value  # a wrong shape stays as it is: the contract names the field
    return [{k: c[k] for k in _CONTAINER if k in c} if isinstance(c, dict) else c
            for c in value]


def trimmed(obj: Mapping[str, Any]) -> PodSnapshot:
    """The part of a pod the mirror reads, as a PodSnapshot (a nameless one, never cached, for
    what is not a pod: the watch thread must outlive a bad event)."""
    if not isinstance(obj, Mapping):
        return PodSnapshot({}, {})
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    if not isinstance(meta, Mapping) or not isinstance(spec, Mapping):
        return PodSnapshot({}, {})  # no API server sends this; a nameless entry is not kept
    kept: dict[str, Any] = {key: _containers(spec[key])
                            for key in ("containers", "initContainers") if key in spec}
    if "nodeName" in spec:
        kept["nodeName"] = spec["nodeName"]
    return PodSnapshot({k: meta[k] for k in _METADATA if k in meta}, kept)


def _newer(a: PodSnapshot, b: PodSnapshot) -> bool:
    """Whether `a` is a later version of the pod than `b`. resourceVersions are opaque in
    general but integers on every API server in practice; anything else counts as "not newer",
    which at worst costs one refused write and a re-read."""
    try:
        return int(a.resource_version) > int(b.resource_version)
    except ValueError:
        return False


_RESOURCE_VERSION = re.compile(r'"resourceVersion":"([^"]*)"')
_RESOURCE_VERSION_BYTES = re.compile(rb'"resourceVersion":"([^"]*)"')
ECHOES_KEPT = 4096
"""resourceVersions of the mirror's own writes kept until their watch event arrives (more are
only in flight when the watch lags far behind; a forgotten one just costs a parse)."""


class PodCache:
    """(namespace, name) -> trimmed PodSnapshot; thread-safe."""

    def __init__(self, prepare: Callable[[PodSnapshot], object] | None = None) -> None:
        self.prepare = prepare
        """Run on every pod the list and the watch bring in (not on those the mirror reads or
        writes itself): the work an allocation for the pod would otherwise start with, done
        while the pod waits to be scheduled (the mirror's is compute.user_request)."""
        self._lock = threading.Lock()
        self._pods: dict[tuple[str, str], PodSnapshot] = {}
        self._echoes: dict[str, None] = {}  # an ordered set: the oldest is forgotten first
        self.synced = False
        """True once a list arrived. Lookups do not wait for it: until then only the pods read
        or written so far are here, and every other pod is read from the API."""
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._pods)

    def lookup(self, namespace: str, name: str) -> PodSnapshot | None:
        pod = self._pods.get((namespace, name))  # one dict read: atomic under the GIL
        if pod is None:
            self.misses += 1
        else:
            self.hits += 1
        return pod

    def remember(self, pod: PodSnapshot, *, written: bool = False) -> None:
        """Keeps `pod` (as read, or as a PATCH returned it: `written`) unless the cache holds a
        newer version."""
        kept = trimmed({"metadata": pod.metadata, "spec": pod.spec})
        # When the watch brought this version first, there is no echo left to expect.
        if self._store(kept) and written and kept.resource_version:
            with self._lock:
                self._echoes[kept.resource_version] = None
                if len(self._echoes) > ECHOES_KEPT:
                    del self._echoes[next(iter(self._echoes))]

    def is_echo(self, line: str | bytes) -> bool:
        """Whether a raw watch event (as the event loop's watch reads it, bytes, or the
        official client's, str) is the mirror's own write coming back, which the cache
        already holds: it is then skipped unparsed (the parse cost about 0.1 ms of CPU per
        allocation, measured in-process against the benchmark stub). resourceVersions are
        unique across a cluster's writes, and the object's own is the first in the event
        (metadata comes first). Should the pattern ever catch another field, the event is
        skipped wrongly at worst, and an entry that is stale only ever costs a refused write or
        a confirming read."""
        if not self._echoes:
            return False
        if isinstance(line, bytes):
            found = _RESOURCE_VERSION_BYTES.search(line)
            version = found.group(1).decode("latin-1") if found is not None else None
        else:
            found = _RESOURCE_VERSION.search(line)
            version = found.group(1) if found is not None else None
        if version is None:
            return False
        with self._lock:
            return self._echoes.pop(version, False) is None

    def replace(self, items: list[Mapping[str, Any]]) -> None:
        """A full list: pods that are gone disappear, writes newer than the list are kept."""
        fresh = {(p.namespace, p.name): p for p in map(trimmed, items) if p.name}
        with self._lock:
            for key, pod in fresh.items():
                old = self._pods.get(key)
                # The same version stays the same object: what was prepared for it is kept.
                if old is not None and old.uid == pod.uid and (
                        old.resource_version == pod.resource_version or _newer(old, pod)):
                    fresh[key] = old
            new = [pod for key, pod in fresh.items() if self._pods.get(key) is not pod]
            self._pods = fresh
            self.synced = True
        for pod in new:
            self._prepare(pod)

    def event(self, kind: str, obj: Mapping[str, Any]) -> None:
        """One watch event (ADDED, MODIFIED, DELETED; BOOKMARK and others change nothing)."""
        if kind not in ("ADDED", "MODIFIED", "DELETED"):
            return
        pod = trimmed(obj)
        if not pod.name:
            return
        if kind != "DELETED":
            if self._store(pod):
                self._prepare(pod)
            return
        key = (pod.namespace, pod.name)
        with self._lock:
            old = self._pods.get(key)
            # A recreated pod of the same name may already be here: drop only this one.
            if old is not None and old.uid == pod.uid:
                del self._pods[key]

    def _prepare(self, pod: PodSnapshot) -> None:
        if self.prepare is None:
            return
        try:
            self.prepare(pod)
        except Exception:  # the feed outlives it; an allocation for the pod redoes the work
            log.exception("preparing pod %s/%s for allocations failed", pod.namespace, pod.name)

    def _store(self, pod: PodSnapshot) -> bool:
        """Whether `pod` was news: False when the cache held this version or a newer one."""
        key = (pod.namespace, pod.name)
        with self._lock:
            old = self._pods.get(key)
            if old is not None and old.uid == pod.uid and (
                    old.resource_version == pod.resource_version or _newer(old, pod)):
                return False
            self._pods[key] = pod
            return True


def pod_selector(scheduler_name: str = "") -> str:
    """The pods worth caching: Pending ones (a scheduler binds a pod before it runs; a pod that
    starts leaves the watch as a DELETED event), of `scheduler_name` when given. A field
    selector, so the API server filters and the mirror never holds the others: the cache stays
    as large as the queue of pods waiting to start, not as the cluster."""
    terms = [f"spec.schedulerName={scheduler_name}"] if scheduler_name else []
    return ",".join([*terms, "status.phase=Pending"])


def pod_list_watch(api_client: k8s.ApiClient, cache: PodCache, scheduler_name: str = ""
                   ) -> KubeListWatch:
    """The official client's list + watch that feeds `cache` (pod_selector), in a thread; the
    cache's own writes coming back are skipped unparsed."""
    core = k8s.CoreV1Api(api_client)
    return KubeListWatch(functools.partial(core.list_pod_for_all_namespaces,
                                           field_selector=pod_selector(scheduler_name)),
                         skip=cache.is_echo)


Feed = Callable[[], Coroutine[Any, Any, None]]
"""Work for the mirror server's event loop for as long as it serves: what MirrorServer's
`tasks` are (the pod cache's feed is one)."""


def pod_feed(api_client: k8s.ApiClient, cache: PodCache, scheduler_name: str = "",
             **options: Any) -> Feed:
    """What keeps `cache` fed, run on the mirror server's loop until it stops: the list +
    watch on that loop (aio_listwatch), or, where the API is behind a proxy (which the loop's
    own connections do not speak), the official client's in a worker thread. `options` go to
    the list + watch loop (backoff, resync_seconds)."""
    what = f"pod(s) of {scheduler_name}" if scheduler_name else "pod(s)"
    if behind_proxy(api_client.configuration):
        source = pod_list_watch(api_client, cache, scheduler_name)

        async def threaded() -> None:
            stop = threading.Event()
            try:
                await asyncio.to_thread(list_watch, source, cache.replace, cache.event, stop,
                                        what=what, **options)
            finally:  # cancelled: end the thread's loop and its open stream
                stop.set()
                source.close()

        return threaded

    async def on_loop() -> None:
        api = AsyncKubeApi(api_client)
        try:
            await list_watch_async(
                AsyncListWatch(api, "/api/v1/pods", {"fieldSelector": pod_selector(
                    scheduler_name)}, what=what, skip=cache.is_echo),
                cache.replace, cache.event, **options)
        finally:
            await api.close()

    return on_loop
