"""The Kubernetes seam of the mirror: read a pod, patch its annotations in one guarded write,
read a node's labels, find reservation pods, record events.

`PodStore` is the blocking seam (the BindRequest follower's): `KubePodStore` is the real one,
`FakePodStore` the in-memory one for unit tests. `AsyncPodStore` is the part MirrorService uses,
on the gRPC server's event loop: `AsyncKubePodStore` (aio_store) is the real one, and
`ThreadedPodStore` runs any PodStore's calls in worker threads (a fake's, or the official
client's where the event loop's own transport cannot go)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..clock import Clock, SystemClock
from ..contract import PodView, view_from_pod_spec
from .errors import MirrorError


@dataclass(frozen=True, slots=True)
class PodSnapshot:
    """One pod as read from the API (raw metadata and spec, as the contract's PodView wants)."""

    metadata: Mapping[str, Any]
    spec: Mapping[str, Any] = field(default_factory=dict)
    _view: PodView | None = field(default=None, init=False, repr=False, compare=False)
    derived: dict[Any, Any] = field(default_factory=dict, init=False, repr=False,
                                    compare=False)
    """What its readers compute from it, kept because a snapshot never changes (the pod as
    its user wrote it, parsed: compute.user_request)."""

    @property
    def namespace(self) -> str:
        return str(self.metadata.get("namespace") or "default")

    @property
    def name(self) -> str:
        return str(self.metadata.get("name") or "")

    @property
    def uid(self) -> str:
        return str(self.metadata.get("uid") or "")

    @property
    def resource_version(self) -> str:
        """"" when the server supplies none (then writes are not version-guarded)."""
        return str(self.metadata.get("resourceVersion") or "")

    @property
    def annotations(self) -> Mapping[str, str]:
        return self.view.annotations

    @property
    def labels(self) -> Mapping[str, str]:
        return self.view.labels

    @property
    def view(self) -> PodView:
        """Built once: a call reads it several times, and a snapshot never changes."""
        if self._view is None:
            object.__setattr__(self, "_view", view_from_pod_spec(self.metadata, self.spec))
        return self._view  # type: ignore[return-value]

    @classmethod
    def from_object(cls, obj: Mapping[str, Any]) -> PodSnapshot:
        return cls(metadata=dict(obj.get("metadata") or {}), spec=dict(obj.get("spec") or {}))


class WriteConflict(MirrorError):
    """409: the pod changed since it was read (resourceVersion) or is another pod (uid).
    The caller re-reads and recomputes; it is never passed on to a scheduler as is."""


class WriteInvalid(MirrorError):
    """422: the server refused the patch as invalid (for instance a uid that does not match the
    stored object's: the immutable-field check). The caller re-reads to tell which."""


class NodeNotFound(MirrorError):
    def __init__(self, node: str):
        self.node = node
        super().__init__(f"node {node} not found")




@dataclass(frozen=True, slots=True)
class Deadline:
    """When the caller stops waiting (the gRPC deadline); `expires_at` None = no deadline."""

    expires_at: float | None = None
    clock: Clock = field(default_factory=SystemClock)

    @classmethod
    def after(cls, seconds: float | None, clock: Clock | None = None) -> Deadline:
        clock = clock or SystemClock()
        return cls(None if seconds is None else clock.monotonic() + seconds, clock)

    def remaining(self) -> float | None:
        if self.expires_at is None:
            return None
        return max(0.0, self.expires_at - self.clock.monotonic())

    @property
    def expired(self) -> bool:
        remaining = self.remaining()
        return remaining is not None and remaining <= 0

    def timeout(self, cap: float) -> float:
        """A per-request timeout: `cap`, or less when the deadline is nearer."""
        remaining = self.remaining()
        return cap if remaining is None else max(0.001, min(cap, remaining))


NO_DEADLINE = Deadline()


class PodStore(Protocol):
    """Every call raises PodNotFound, ApiUnavailable, DeadlineExceeded or ApiRejected (errors.py)
    on failure after its own bounded retries of transient errors."""

    def get_pod(self, namespace: str, name: str, deadline: Deadline = NO_DEADLINE
                ) -> PodSnapshot: ...

    def patch_annotations(
        self, namespace: str, name: str, changes: Mapping[str, str | None], *, uid: str,
        resource_version: str, deadline: Deadline = NO_DEADLINE,
    ) -> PodSnapshot:
        """ONE merge patch of metadata.annotations (None deletes a key), guarded by the pod's
        uid and, when not "", its resourceVersion: raises WriteConflict / WriteInvalid when the
        server refuses the precondition. Returns the pod as written."""
        ...

    def node_labels(self, node: str, deadline: Deadline = NO_DEADLINE) -> Mapping[str, str]:
        """Raises NodeNotFound."""
        ...

    def list_pods(self, namespace: str, labels: Mapping[str, str],
                  deadline: Deadline = NO_DEADLINE) -> list[PodSnapshot]:
        """Pods of `namespace` carrying every label in `labels` (equality selector)."""
        ...

    def emit_event(self, pod: PodSnapshot, event_type: str, reason: str, message: str,
                   deadline: Deadline = NO_DEADLINE) -> None: ...


class AsyncPodStore(Protocol):
    """PodStore's reads and its write, as coroutines (the same errors), and `close()`, which
    the event loop that used the store awaits when it stops."""

    async def get_pod(self, namespace: str, name: str, deadline: Deadline = NO_DEADLINE
                      ) -> PodSnapshot: ...

    async def patch_annotations(
        self, namespace: str, name: str, changes: Mapping[str, str | None], *, uid: str,
        resource_version: str, deadline: Deadline = NO_DEADLINE,
    ) -> PodSnapshot: ...

    async def node_labels(self, node: str, deadline: Deadline = NO_DEADLINE
                          ) -> Mapping[str, str]: ...

    async def close(self) -> None: ...


class ThreadedPodStore:
    """An AsyncPodStore over a blocking PodStore: each call runs in a worker thread, so the
    event loop goes on serving while it waits. `store` stays the caller's to close."""

    def __init__(self, store: PodStore) -> None:
        self.store = store

    async def get_pod(self, namespace: str, name: str, deadline: Deadline = NO_DEADLINE
                      ) -> PodSnapshot:
        return await asyncio.to_thread(self.store.get_pod, namespace, name, deadline)

    async def patch_annotations(
        self, namespace: str, name: str, changes: Mapping[str, str | None], *, uid: str,
        resource_version: str, deadline: Deadline = NO_DEADLINE,
    ) -> PodSnapshot:
        return await asyncio.to_thread(
            self.store.patch_annotations, namespace, name, changes, uid=uid,
            resource_version=resource_version, deadline=deadline)

    async def node_labels(self, node: str, deadline: Deadline = NO_DEADLINE
                          ) -> Mapping[str, str]:
        return await asyncio.to_thread(self.store.node_labels, node, deadline)

    async def close(self) -> None:
        return None


def matches_labels(labels: Mapping[str, str], selector: Mapping[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def label_selector(selector: Mapping[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(selector.items()))

