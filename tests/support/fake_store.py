"""An in-memory PodStore for the mirror's tests, as coroutines like the real one: uid and
resourceVersion preconditions like a real API server, a log of every write, injectable faults."""

from __future__ import annotations

import copy
import itertools
import threading
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kai_fractions.kube.retry import NO_DEADLINE, Deadline
from kai_fractions.mirror.errors import PodNotFound
from kai_fractions.mirror.store import (
    NodeNotFound,
    PodSnapshot,
    WriteConflict,
    WriteInvalid,
    matches_labels,
)


@dataclass(frozen=True, slots=True)
class RecordedEvent:
    namespace: str
    pod: str
    pod_uid: str
    event_type: str
    reason: str
    message: str


@dataclass
class FakePodStore:
    pods: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    nodes: dict[str, dict[str, str]] = field(default_factory=dict)
    patches: list[tuple[str, str, dict[str, str | None]]] = field(default_factory=list)
    """Every patch that reached the store, written or refused: (namespace, name, changes)."""
    events: list[RecordedEvent] = field(default_factory=list)
    lists: list[bool] = field(default_factory=list)
    """One entry per list_pods call: whether it asked for the watch cache."""
    faults: list[Callable[[str, str, str], None]] = field(default_factory=list)
    """Called as fault(operation, namespace, name) before each call; pop themselves when spent.
    Raise ApiUnavailable / DeadlineExceeded / WriteConflict... to simulate a failing API."""
    _versions: Any = field(default_factory=lambda: itertools.count(1), repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    # -- test helpers -------------------------------------------------------------------------

    def add_pod(self, obj: Mapping[str, Any]) -> PodSnapshot:
        obj = copy.deepcopy(dict(obj))
        meta = obj.setdefault("metadata", {})
        meta.setdefault("namespace", "default")
        meta.setdefault("uid", str(uuid.uuid4()))
        meta["resourceVersion"] = str(next(self._versions))
        self.pods[(meta["namespace"], meta["name"])] = obj
        return PodSnapshot.from_object(obj)

    def delete_pod(self, namespace: str, name: str) -> None:
        self.pods.pop((namespace, name), None)

    def annotations(self, namespace: str, name: str) -> dict[str, str]:
        return dict(self.pods[(namespace, name)]["metadata"].get("annotations") or {})

    def _fault(self, operation: str, namespace: str, name: str) -> None:
        for fault in list(self.faults):
            fault(operation, namespace, name)

    # -- PodStore -----------------------------------------------------------------------------

    async def get_pod(self, namespace: str, name: str, deadline: Deadline = NO_DEADLINE
                      ) -> PodSnapshot:
        self._fault("get", namespace, name)
        with self._lock:
            obj = self.pods.get((namespace, name))
            if obj is None:
                raise PodNotFound(namespace, name)
            return PodSnapshot.from_object(copy.deepcopy(obj))

    async def patch_annotations(
        self, namespace: str, name: str, changes: Mapping[str, str | None], *, uid: str,
        resource_version: str, deadline: Deadline = NO_DEADLINE,
    ) -> PodSnapshot:
        self._fault("patch", namespace, name)
        with self._lock:
            self.patches.append((namespace, name, dict(changes)))
            obj = self.pods.get((namespace, name))
            if obj is None:
                raise PodNotFound(namespace, name)
            meta = obj["metadata"]
            if uid and meta.get("uid") != uid:
                raise WriteInvalid(f"metadata.uid: field is immutable ({uid} != {meta['uid']})")
            if resource_version and meta.get("resourceVersion") != resource_version:
                raise WriteConflict("the object has been modified; please apply your changes "
                                    "to the latest version and try again")
            annotations = meta.setdefault("annotations", {})
            for key, value in changes.items():
                if value is None:
                    annotations.pop(key, None)
                else:
                    annotations[key] = value
            meta["resourceVersion"] = str(next(self._versions))
            return PodSnapshot.from_object(copy.deepcopy(obj))

    async def node_labels(self, node: str, deadline: Deadline = NO_DEADLINE
                          ) -> Mapping[str, str]:
        self._fault("node", "", node)
        if node not in self.nodes:
            raise NodeNotFound(node)
        return dict(self.nodes[node])

    async def list_pods(self, namespace: str, labels: Mapping[str, str],
                        deadline: Deadline = NO_DEADLINE, *, cached: bool = False
                        ) -> list[PodSnapshot]:
        self.lists.append(cached)
        self._fault("list", namespace, "")
        with self._lock:
            return [PodSnapshot.from_object(copy.deepcopy(obj))
                    for (ns, _), obj in sorted(self.pods.items())
                    if ns == namespace
                    and matches_labels(obj["metadata"].get("labels") or {}, labels)]

    async def emit_event(self, pod: PodSnapshot, event_type: str, reason: str, message: str,
                         deadline: Deadline = NO_DEADLINE) -> None:
        self._fault("event", pod.namespace, pod.name)
        self.events.append(RecordedEvent(pod.namespace, pod.name, pod.uid, event_type, reason,
                                         message))

    async def close(self) -> None:
        pass  # nothing to close: a test reads the store after the server stopped
