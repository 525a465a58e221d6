"""What the mirror's pod cache keeps of a pod (`trimmed`), and the sharing of it between pods:
the part of the cache that decides a cached pod's memory (measured as P6 in benchmarks/), apart
from the cache's bookkeeping of which pods it holds (`pod_cache`).

Entries keep only what the contract reads (names, uid, resourceVersion, annotations, labels,
container names and resources, nodeName), with equal annotation maps, label maps, container
lists and trimmed specs shared between pods, read-only (`_one_of`), every map a CompactMap (a
tuple of values beside a key index shared by the maps of the same keys).
A pod that carries the mirror's record (it was allocated, and waits for its bind or its start)
is kept as its name, uid and resourceVersion alone (`ALLOCATED`): its annotations, the largest
and least shared part of a pod, would save next to no read (`pod_cache`).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from ..contract.keys import ADMITTED_MPS_NAMESPACE
from .compact_map import CompactMap
from .record import MIRRORED_ANNOTATION
from .store import PodSnapshot

_METADATA = ("name", "namespace", "uid", "resourceVersion", "annotations", "labels",
             "deletionTimestamp")
_CONTAINER = ("name", "resources")


def _containers(value: Any) -> Any:
    if not isinstance(value, list):
        return value  # a wrong shape stays as it is: the contract names the field
    return [{k: c[k] for k in _CONTAINER if k in c} if isinstance(c, dict) else c
            for c in value]


def _per_pod(key: Any) -> bool:
    """Whether an annotation's value is one pod's alone: the MPS namespace our admission
    webhook names for each sm-sharing container (`contract.keys`)."""
    return type(key) is str and key.endswith(ADMITTED_MPS_NAMESPACE)


def _interned(value: Mapping[Any, Any]) -> dict[Any, Any]:
    """A string map with its keys and values interned: pods of one job repeat them, and each
    JSON decoding makes copies of its own (about 50 bytes a string per pod). A value that is
    one pod's alone is not: interning it would only add it to the interpreter's table."""
    return {sys.intern(k) if type(k) is str else k:
            sys.intern(v) if type(v) is str and not _per_pod(k) else v
            for k, v in value.items()}


SHARED_KEPT = 4096
"""Distinct annotation maps, label maps, container lists and specs shared at most (then
forgotten, which only ends the sharing of the older ones)."""
_shared: dict[Any, Any] = {}


def _one_of(value: Any) -> Any:
    """One object for equal values: the pods of one job carry the same annotations, labels,
    containers and trimmed spec, a copy per pod as JSON decoding makes them. Safe because a
    snapshot's parts are never changed: a map comes back read-only (a CompactMap; the
    contract's view reads a dict copy of it). A string map is found by its items'
    hash and kept only when equal, so a map seen once costs a number and a place in the table
    (until the table is cleared), not a copy of its text, and a map that names a pod's own MPS
    namespace, equal to no other pod's, is neither looked up nor kept; a list, or a map of
    lists, is found by its repr, equal exactly when the value is."""
    if not value:
        return value
    is_map = isinstance(value, Mapping)
    if is_map and any(map(_per_pod, value)):
        return CompactMap(_interned(value))
    key: Any
    try:
        key = hash(tuple(value.items())) if is_map else repr(value)
    except TypeError:
        key = repr(value)  # a map of lists (a trimmed spec): equal exactly when its repr is
    found = _shared.get(key)
    if found is not None and found == value:
        return found
    shared = CompactMap(_interned(value)) if is_map else value
    if found is None:  # an unequal value under the same hash is just not shared
        if len(_shared) >= SHARED_KEPT:
            _shared.clear()
        _shared[key] = shared
    return shared


ALLOCATED: Mapping[str, Any] = CompactMap({})
"""The spec of an entry for a pod the mirror allocated: compared by identity (`is`), never
read. Such an entry holds the pod's identity and version only; `lookup` misses it."""
_IDENTITY = ("name", "namespace", "uid", "resourceVersion")


def _picked(meta: Mapping[str, Any], fields: tuple[str, ...]) -> dict[str, Any]:
    """Those of `fields` that `meta` has, its namespace interned (a cluster has few)."""
    picked = {k: meta[k] for k in fields if k in meta}
    if type(picked.get("namespace")) is str:
        picked["namespace"] = sys.intern(picked["namespace"])
    return picked


def trimmed(obj: Mapping[str, Any] | PodSnapshot) -> PodSnapshot:
    """The part of a pod the mirror reads, as a PodSnapshot (a nameless one, never cached, for
    what is not a pod: the watch thread must outlive a bad event). A snapshot is kept as is:
    it was trimmed as its list page arrived."""
    if isinstance(obj, PodSnapshot):
        return obj
    if not isinstance(obj, Mapping):
        return PodSnapshot({}, {})
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    if not isinstance(meta, Mapping) or not isinstance(spec, Mapping):
        return PodSnapshot({}, {})  # no API server sends this; a nameless entry is not kept
    annotations = meta.get("annotations")
    if isinstance(annotations, Mapping) and MIRRORED_ANNOTATION in annotations:
        return PodSnapshot(CompactMap(_picked(meta, _IDENTITY)), ALLOCATED)
    kept: dict[str, Any] = {key: _one_of(_containers(spec[key]))
                            for key in ("containers", "initContainers") if key in spec}
    if "nodeName" in spec:
        kept["nodeName"] = spec["nodeName"]
    metadata = _picked(meta, _METADATA)
    for key in ("annotations", "labels"):
        if key in metadata:
            metadata[key] = _one_of(metadata[key])
    return PodSnapshot(CompactMap(metadata), _one_of(kept))  # a job's pods: one trimmed spec
