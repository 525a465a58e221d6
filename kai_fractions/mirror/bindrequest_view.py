"""The follower's view of a KAI BindRequest: the fields it reads, decoded without ever raising,
and whether a pod is the one the BindRequest was made for.

Apart from the follower because the view is what the list/watch loop (`bindrequests`) holds for
every fractional BindRequest of the cluster (`fractional_view`), and the metrics and the CLI
name it too.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..contract import keys as k
from ..kube.objects import epoch_seconds
from .store import PodSnapshot


@dataclass(frozen=True, slots=True)
class BindRequestView:
    """The fields of a BindRequest the follower reads (contract doc, section 4)."""

    namespace: str
    name: str
    uid: str
    pod_name: str
    selected_node: str
    resource_type: str
    gpu_count: int
    portion: str
    group_ids: tuple[str, ...]
    group_modes: tuple[str, ...]
    phase: str
    resource_version: str = ""
    created: str = ""
    """metadata.creationTimestamp (RFC 3339): when KAI's scheduler decided the bind."""
    owner_uid: str = ""
    """The uid of the pod KAI's scheduler made it for: it names that pod as the BindRequest's
    owner (KAI-Scheduler pkg/scheduler/cache/cache.go, createBindRequest). "" when none."""
    backoff_limit: int | None = None
    """spec.backoffLimit: the failed bind attempts after which KAI's binder gives up; None
    when absent (KAI's API: a nil `*int32`), and then it does not try again after a failure."""
    failed_attempts: int = 0
    """status.failedAttempts: the bind attempts that failed so far (absent: 0)."""

    @classmethod
    def from_object(cls, obj: Mapping[str, Any]) -> BindRequestView:
        """Never raises: a part of the wrong type (which KAI's CRD schema should refuse) reads
        as absent, so the check reports the BindRequest (not fractional, not Succeeded, no
        decision to rebuild) and one malformed object cannot stop the follower."""
        meta, spec, status = (_mapping(obj, part) for part in ("metadata", "spec", "status"))
        received = _mapping(spec, "receivedGPU")
        groups = _list(spec, "selectedFractionalGpuGroups")
        if groups:
            ids = tuple(str(g.get("id") or "") for g in groups if isinstance(g, Mapping))
            modes = tuple(str(g.get("computeSharingMode") or "")
                          for g in groups if isinstance(g, Mapping))
        else:  # older BindRequests: plain group ids, time-slicing
            ids = tuple(str(g) for g in _list(spec, "selectedGPUGroups"))
            modes = ("",) * len(ids)
        return cls(
            namespace=str(meta.get("namespace") or "default"),
            name=str(meta.get("name") or ""),
            uid=str(meta.get("uid") or ""),
            pod_name=str(spec.get("podName") or ""),
            selected_node=str(spec.get("selectedNode") or ""),
            resource_type=str(spec.get("receivedResourceType") or ""),
            gpu_count=_int(received.get("count")) or 0,
            portion=str(received.get("portion") or ""),
            group_ids=ids,
            group_modes=modes,  # KAI spells them as the contract does; "" = time-slicing
            phase=str(status.get("phase") or ""),
            resource_version=str(meta.get("resourceVersion") or ""),
            created=str(meta.get("creationTimestamp") or ""),
            owner_uid=_owner_pod_uid(meta.get("ownerReferences"), spec.get("podName")),
            backoff_limit=_int(spec.get("backoffLimit")),
            failed_attempts=_int(status.get("failedAttempts")) or 0,
        )

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def retrying(self) -> bool:
        """Failed with attempts left: KAI's binder binds it again after a backoff
        (KAI-Scheduler pkg/binder/controllers/bindrequest_controller.go,
        isActionableBindRequest: a backoffLimit, and failedAttempts below it), and KAI's
        scheduler keeps it (pkg/scheduler/api/bindrequest_info, IsFailed is false; only those
        it deems failed does cleanStaleBindRequest delete). A retry that binds the pod sets it
        Succeeded with a status update that, as a Pending one's, may be lost."""
        return (self.phase == "Failed" and self.backoff_limit is not None
                and self.failed_attempts < self.backoff_limit)


def fractional_view(obj: Mapping[str, Any]) -> BindRequestView | None:
    """The view of a fractional BindRequest (`receivedResourceType: Fraction`); None for any
    other, before a view is built. KAI's scheduler creates a BindRequest for EVERY pod it binds
    (KAI-Scheduler pkg/scheduler/cache/cache.go, Bind -> createBindRequest), `Regular` for
    CPU-only and whole-GPU pods (pkg/scheduler/api/node_info/node_info.go,
    setAcceptedResources), and keeps it for the pod's life: the follower has nothing to check
    on those, so they are dropped as their list page or event is decoded, and what it holds
    grows with the fractional pods alone."""
    if _mapping(obj, "spec").get("receivedResourceType") != k.RESOURCE_TYPE_FRACTION:
        return None
    return BindRequestView.from_object(obj)


def _mapping(parent: Any, key: str) -> Mapping[str, Any]:
    value = parent.get(key) if isinstance(parent, Mapping) else None
    return value if isinstance(value, Mapping) else {}


def _int(value: Any) -> int | None:
    """`value` when it is an integer (not a bool), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _list(parent: Mapping[str, Any], key: str) -> list[Any]:
    value = parent.get(key)
    return value if isinstance(value, list) else []


def _owner_pod_uid(owners: Any, pod_name: Any) -> str:
    """The uid of the owner reference that is the BindRequest's pod; "" when none is."""
    if not isinstance(owners, list):
        return ""
    for owner in owners:
        if (isinstance(owner, Mapping) and owner.get("kind") == "Pod"
                and owner.get("name") in (None, pod_name)):
            return str(owner.get("uid") or "")
    return ""


def not_its_pod(br: BindRequestView, pod: PodSnapshot) -> str:
    """Why `pod` is not the pod `br` was made for ("" when it may be): KAI decided for one pod,
    and another one of the same name (the first deleted and a new one created, by a user or a
    controller) must not carry that decision's signature. By the owner's uid; without one, by
    age: a pod created after the BindRequest cannot be the one it was made for."""
    ref = f"pod {pod.namespace}/{pod.name}"
    if br.owner_uid:
        if pod.uid != br.owner_uid:
            return (f"{ref} (uid {pod.uid or 'none'}) is not the pod BindRequest {br.ref} was "
                    f"made for (uid {br.owner_uid}): it was created again under that name")
        return ""
    pod_created = epoch_seconds(pod.metadata.get("creationTimestamp"))
    br_created = epoch_seconds(br.created)
    if pod_created is not None and br_created is not None and pod_created > br_created:
        return (f"{ref} was created after BindRequest {br.ref}, so it is not the pod that "
                "BindRequest was made for")
    return ""
