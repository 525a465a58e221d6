"""The Kubernetes seam of the mirror: read a pod, patch its annotations in one guarded write,
read a node's labels, find reservation pods, record events.

`PodStore` is the seam, as coroutines on the mirror's event loop (MirrorService and the
BindRequest follower use it): `kube_store.KubePodStore` is the real one, tests have an in-memory
one. `PodSnapshot` is a pod as read."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..contract import PodView, view_from_pod_spec
from ..contract.errors import shown
from ..kube.retry import NO_DEADLINE, Deadline
from .errors import MirrorError


@dataclass(frozen=True, slots=True)
class PodSnapshot:
    """One pod as read from the API (raw metadata and spec, as the contract's PodView wants)."""

    metadata: Mapping[str, Any]
    spec: Mapping[str, Any] = field(default_factory=dict)
    phase: str = ""
    """status.phase ("" when not read): the BindRequest follower skips a pod that has run to
    its end (Succeeded, Failed)."""
    _view: PodView | None = field(default=None, init=False, repr=False, compare=False)
    parsed: tuple[Any, Any] | None = field(default=None, init=False, repr=False,
                                           compare=False)
    """(Keys, the pod as its user wrote it parsed under them: a PodRequest, whose `pod` is that
    view; compute.user_request), kept because a snapshot never changes. One slot, not a map per
    Keys: a mirror reads every pod with one set of keys, and a slot costs nothing on the pods
    never parsed."""

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
        status = obj.get("status")
        phase = status.get("phase") if isinstance(status, Mapping) else None
        return cls(metadata=dict(obj.get("metadata") or {}), spec=dict(obj.get("spec") or {}),
                   phase=phase if isinstance(phase, str) else "")


def stored_otherwise(written: PodSnapshot, changes: Mapping[str, str | None]) -> str | None:
    """What the API server stored other than `changes` (None: removed) on the pod it answered a
    patch with, said for a log and a caller (values cut); None when it stored them. Something on
    the pod's UPDATE path (a mutating admission webhook) may rewrite a write: a caller told it
    succeeded would leave the pod waiting in its gate without what was written."""
    stored = written.annotations
    differ = [key for key, value in changes.items() if stored.get(key) != value]
    if not differ:
        return None

    def said(value: str | None) -> str:
        return "absent" if value is None else shown(value)

    listed = ", ".join(f"{key} is {said(stored.get(key))}, not {said(changes[key])}"
                       for key in differ[:3])
    more = f" and {len(differ) - 3} more" if len(differ) > 3 else ""
    return (f"the API server stored pod {written.namespace}/{written.name} with annotations "
            f"other than written ({listed}{more}): something on the pod's UPDATE path (a "
            "mutating admission webhook?) changed them; exempt these annotations from it")


class WriteConflict(MirrorError):
    """409: the pod changed since it was read (resourceVersion) or is another pod (uid).
    The caller re-reads and recomputes; it is never passed on to a scheduler as is.

    `may_have_landed`: an earlier try of this same write failed in a way the API server may
    have applied it (a timeout or a reset loses the answer to a PATCH it applied; a 5xx may
    follow one), so the change of version that refused the retry may be this write's own. The
    caller's re-read tells: a pod that carries every change the write held. False after tries
    that cannot have landed (throttled: 429; never sent: no connection), and from a store that
    sends a write once."""

    def __init__(self, message: str, *, may_have_landed: bool = False) -> None:
        super().__init__(message)
        self.may_have_landed = may_have_landed


class WriteInvalid(MirrorError):
    """422: the server refused the patch as invalid (for instance a uid that does not match the
    stored object's: the immutable-field check). The caller re-reads to tell which."""


class NodeLabels(dict[str, str]):
    """A node's labels as read, with the node's uid ("" where a store knows none): a node
    deleted and recreated under the same name is another node, whose labels may differ."""

    __slots__ = ("uid",)

    def __init__(self, labels: Mapping[str, str], uid: str = "") -> None:
        super().__init__(labels)
        self.uid = uid


class NodeNotFound(MirrorError):
    def __init__(self, node: str):
        self.node = node
        super().__init__(f"node {node} not found")






class PodStore(Protocol):
    """The mirror's way to the pods it writes, as coroutines on the serving event loop. Every
    call raises PodNotFound, ApiUnavailable, DeadlineExceeded or ApiRejected (errors.py) on
    failure after its own bounded retries of transient errors."""

    async def get_pod(self, namespace: str, name: str, deadline: Deadline = NO_DEADLINE
                      ) -> PodSnapshot: ...

    async def patch_annotations(
        self, namespace: str, name: str, changes: Mapping[str, str | None], *, uid: str,
        resource_version: str, deadline: Deadline = NO_DEADLINE,
    ) -> PodSnapshot:
        """ONE merge patch of metadata.annotations (None deletes a key), guarded by the pod's
        uid and, when not "", its resourceVersion: raises WriteConflict / WriteInvalid when the
        server refuses the precondition (WriteConflict.may_have_landed when a retry of the
        write was refused after a try that failed and may have been applied). Returns the pod
        as written."""
        ...

    async def node_labels(self, node: str, deadline: Deadline = NO_DEADLINE
                          ) -> Mapping[str, str]:
        """Raises NodeNotFound. A NodeLabels where the store knows the node's uid."""
        ...

    async def list_pods(self, namespace: str, labels: Mapping[str, str],
                        deadline: Deadline = NO_DEADLINE, *, cached: bool = False
                        ) -> list[PodSnapshot]:
        """Pods of `namespace` carrying every label in `labels` (equality selector). `cached`:
        as the API server's watch cache has them (resourceVersion 0), which may be a moment
        old; else a consistent read (from etcd before Kubernetes 1.31)."""
        ...

    async def emit_event(self, pod: PodSnapshot, event_type: str, reason: str, message: str,
                         deadline: Deadline = NO_DEADLINE) -> None: ...

    async def close(self) -> None:
        """Awaited by the event loop that used the store when it stops."""
        ...


def matches_labels(labels: Mapping[str, str], selector: Mapping[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def label_selector(selector: Mapping[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(selector.items()))

