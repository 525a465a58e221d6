"""The mirror's watch-fed cache of pods: the usual MirrorAllocation costs one API request (the
guarded PATCH) instead of two (GET, then PATCH).

The cache only ever saves a read; correctness never rests on it being fresh (MirrorService):
* a write carries the cached uid and resourceVersion as its precondition, so a stale entry makes
  the API server refuse it (409) and the service reads the pod from the API and recomputes;
* an answer that writes nothing ("the pod already carries this allocation") is confirmed by a
  read from the API first, so a stale entry never turns into a success nobody checked;
* a pod the cache lacks, or holds with another uid than the caller names, is read from the API.

Entries keep only what the contract reads (names, uid, resourceVersion, annotations, labels,
container names and resources, nodeName): a few hundred bytes per pod, whatever the pod's size.
They are fed by a list + watch of pods (`listwatch`), by every pod the mirror reads, and by every
pod a PATCH returns (write-through), newest resourceVersion first.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Mapping
from typing import Any

from kubernetes import client as k8s

from .listwatch import KubeListWatch
from .store import PodSnapshot

_METADATA = ("name", "namespace", "uid", "resourceVersion", "annotations", "labels")
_CONTAINER = ("name", "resources")


def _containers(value: Any) -> Any:
    if not isinstance(value, list):
        return value  # a wrong shape stays as it is: the contract names the field
    return [{k: c[k] for k in _CONTAINER if k in c} if isinstance(c, dict) else c
            for c in value]


def trimmed(obj: Mapping[str, Any]) -> PodSnapshot:
    """The part of a pod the mirror reads, as a PodSnapshot."""
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


class PodCache:
    """(namespace, name) -> trimmed PodSnapshot; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pods: dict[tuple[str, str], PodSnapshot] = {}
        self.synced = False
        """True once a list arrived; before that every lookup misses."""
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

    def remember(self, pod: PodSnapshot) -> None:
        """Keeps `pod` (as read or as written) unless the cache holds a newer version."""
        self._store(trimmed({"metadata": pod.metadata, "spec": pod.spec}))

    def replace(self, items: list[Mapping[str, Any]]) -> None:
        """A full list: pods that are gone disappear, writes newer than the list are kept."""
        fresh = {(p.namespace, p.name): p for p in map(trimmed, items) if p.name}
        with self._lock:
            for key, pod in fresh.items():
                old = self._pods.get(key)
                if old is not None and old.uid == pod.uid and _newer(old, pod):
                    fresh[key] = old
            self._pods = fresh
            self.synced = True

    def event(self, kind: str, obj: Mapping[str, Any]) -> None:
        """One watch event (ADDED, MODIFIED, DELETED; BOOKMARK and others change nothing)."""
        if kind not in ("ADDED", "MODIFIED", "DELETED"):
            return
        pod = trimmed(obj)
        if not pod.name:
            return
        if kind != "DELETED":
            self._store(pod)
            return
        key = (pod.namespace, pod.name)
        with self._lock:
            old = self._pods.get(key)
            # A recreated pod of the same name may already be here: drop only this one.
            if old is not None and old.uid == pod.uid:
                del self._pods[key]

    def _store(self, pod: PodSnapshot) -> None:
        key = (pod.namespace, pod.name)
        with self._lock:
            old = self._pods.get(key)
            if old is not None and old.uid == pod.uid and _newer(old, pod):
                return
            self._pods[key] = pod


def pod_list_watch(api_client: k8s.ApiClient, scheduler_name: str = "") -> KubeListWatch:
    """Every pod of the cluster, or only those of `scheduler_name` (a field selector, so the API
    server filters and the mirror never sees the others)."""
    core = k8s.CoreV1Api(api_client)
    selector = f"spec.schedulerName={scheduler_name}" if scheduler_name else None
    return KubeListWatch(functools.partial(core.list_pod_for_all_namespaces,
                                           field_selector=selector))
