"""The node plan's data types: the pod it reads (`NodePod`) and the state it returns.

`DesiredState` holds the compute mode per GPU (`GpuDesired`), each fractional container to serve
(`ContainerDesired`) with its cgroup memory limits (`LimitTarget`), and each container refused
(`Refusal`, with a `RefusalReason` a user can act on). They are what the planner
(`kai_fractions.node.desired`), the engine, the node agent and the tests share, so they live
apart from the planning itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Any, NamedTuple

from ..contract import ComputeMode, ContainerPlan, PodView, view_from_pod_spec
from .cgroups import QosClass, qos_class_of
from .config import Mechanism
from .nvml import GpuComputeMode
from .watchdog_types import ManagedContainer


class RefusalReason(StrEnum):
    CONTRACT_INVALID = "ContractInvalid"
    NOT_BOUND = "NotBound"
    DEVICE_NOT_ON_NODE = "DeviceNotOnNode"
    COMPUTE_MODE_MIX = "ComputeModeMix"
    MEMORY_OVERCOMMITTED = "MemoryOvercommitted"
    SM_SHARING_DISABLED = "SmSharingDisabled"
    MEMORY_LIMITS_UNSUPPORTED = "MemoryLimitsUnsupported"
    MIG_NOT_SUPPORTED = "MigNotSupported"
    MPS_NAMESPACE_TAKEN = "MpsNamespaceTaken"
    MPS_MOUNT_MISMATCH = "MpsMountMismatch"
    PLAN_CHANGE_REFUSED = "PlanChangeRefused"
    """The only refusal of a container that stays applied: its new plan is refused, the plan
    it runs with stays in force."""


class ComputeEnforcement(StrEnum):
    TIME_SLICING = "time-slicing"
    """No MPS: the GPU time-slices between processes (DEFAULT compute mode)."""
    MPS_NAMESPACE = "mps-namespace"
    """An MPS v3 namespace per container caps its share of SMs (authoritative)."""
    MPS_CLIENT_ENV = "mps-client-env"
    """Drivers without MPS namespaces: only the client's CUDA_MPS_ACTIVE_THREAD_PERCENTAGE."""


class ContainerKey(NamedTuple):
    pod_uid: str
    container: str


@dataclass(frozen=True, slots=True)
class NodePod:
    """A pod bound to this node: the contract's view plus the status bits the node needs."""

    view: PodView
    qos: QosClass = QosClass.BURSTABLE
    container_ids: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    """Container name -> `containerd://<id>` from the pod's (init)containerStatuses."""
    created: str = ""
    """metadata.creationTimestamp (RFC 3339, UTC): orders pods, oldest first."""
    phase: str = ""
    mounts: Mapping[str, tuple[tuple[str, str], ...]] = field(
        default_factory=lambda: MappingProxyType({}))
    """Container name -> (mountPath, subPath or subPathExpr) of each of its volume mounts: where
    an sm-sharing container's MPS pipes really are."""

    @property
    def uid(self) -> str:
        return self.view.uid

    @property
    def terminal(self) -> bool:
        """Succeeded or Failed: its containers are gone and it holds nothing."""
        return self.phase in ("Succeeded", "Failed")

    @classmethod
    def from_manifest(cls, pod: Mapping[str, Any]) -> NodePod:
        """From a Pod object as a dict (e.g. `ApiClient().sanitize_for_serialization(pod)`)."""
        metadata = pod.get("metadata") or {}
        status = pod.get("status") or {}
        ids: dict[str, str] = {}
        for key in ("initContainerStatuses", "containerStatuses"):
            for cs in status.get(key) or []:
                if isinstance(cs, Mapping) and cs.get("name") and cs.get("containerID"):
                    ids[str(cs["name"])] = str(cs["containerID"])
        spec = pod.get("spec") or {}
        return cls(
            view=view_from_pod_spec(metadata, spec),
            qos=qos_class_of(pod),
            container_ids=MappingProxyType(ids),
            created=str(metadata.get("creationTimestamp") or ""),
            phase=str(status.get("phase") or ""),
            mounts=MappingProxyType(_mounts(spec)),
        )


def _mounts(spec: Mapping[str, Any]) -> dict[str, tuple[tuple[str, str], ...]]:
    out = {}
    for field_name in ("initContainers", "containers"):
        for c in spec.get(field_name) or []:
            if isinstance(c, Mapping) and c.get("volumeMounts"):
                out[str(c.get("name"))] = tuple(
                    (str(m.get("mountPath") or ""), str(m.get("subPath") or m.get("subPathExpr")
                                                        or ""))
                    for m in c["volumeMounts"] if isinstance(m, Mapping))
    return out


@dataclass(frozen=True, slots=True)
class LimitTarget:
    """One cgroup memory limit to have in force: NVML namespace `path` on GPU `gpu_uuid`."""

    gpu_uuid: str
    path: str
    soft: int
    hard: int
    pod_uid: str
    container: str | None
    """None: the pod's slice (shared by the pod's containers); else the container's cgroup."""


@dataclass(frozen=True, slots=True)
class ContainerDesired:
    key: ContainerKey
    pod_namespace: str
    pod_name: str
    plan: ContainerPlan
    qos: QosClass
    pod_cgroup: str
    container_cgroup: str | None
    """None until the runtime reports the container's ID (the pod slice is limited before)."""
    mechanisms: frozenset[Mechanism]
    compute: ComputeEnforcement
    mps_namespace: str | None
    """The MPS v3 namespace to create (sm-sharing on drivers that have namespaces)."""
    device_indexes: tuple[int, ...]
    """NVML index of each of the plan's devices, in the plan's order."""
    container_id: str | None = None
    """The runtime's ID (`containerd://<id>`) from the pod status; None until reported."""

    @property
    def ref(self) -> str:
        return f"{self.pod_namespace}/{self.pod_name}/{self.key.container}"

    @property
    def active_thread_percentage(self) -> int | None:
        return self.plan.active_thread_percentage

    @property
    def limits(self) -> tuple[LimitTarget, ...]:
        """The container's own cgroup limits (empty without the cgroup mechanism or its ID)."""
        if Mechanism.CGROUP not in self.mechanisms or self.container_cgroup is None:
            return ()
        return tuple(
            LimitTarget(gpu_uuid=uuid, path=self.container_cgroup, soft=self.plan.request_bytes,
                        hard=self.plan.limit_bytes, pod_uid=self.key.pod_uid,
                        container=self.key.container)
            for uuid in self.plan.device_uuids
        )


@dataclass(frozen=True, slots=True)
class Refusal:
    key: ContainerKey
    pod_namespace: str
    pod_name: str
    reason: RefusalReason
    message: str
    final: bool = True
    """False: not yet servable but may become so (NotBound); the gate keeps waiting."""
    plan_digest: str = ""
    """The applied plan of a running container that a node rule now refuses (its GPU gone,
    sm-sharing off): its refused marker keeps the digest, so the pod stays held to that plan
    (`applied.applied_plans`) and an edit made meanwhile is never applied."""
    watched: ContainerDesired | None = None
    """A running container refused MemoryLimitsUnsupported because only a watchdog with
    --watchdog-policy=report would watch it (applied under the rule before such a watchdog was
    no memory tier, and the agent upgraded since): the container as it runs, for the watchdog.
    Nothing caps it either way, but it is not left unwatched: its usage is measured and its use
    over the plan's cap reported (LimitViolation), nothing is stopped (report), as before the
    upgrade. None for every other refusal."""

    @property
    def ref(self) -> str:
        return f"{self.pod_namespace}/{self.pod_name}/{self.key.container}"


@dataclass(frozen=True, slots=True)
class GpuDesired:
    uuid: str
    index: int
    compute_mode: GpuComputeMode | None
    """None: leave the GPU's compute mode as it is."""
    containers: tuple[ContainerKey, ...]
    requested_bytes: int
    mps_pinned_mib: int | None
    """The MPS default pinned device-memory limit for this GPU (the largest cap of its
    mps-pinned containers: a client that drops its own env is still bounded); None: leave.
    mps-pinned stays the tier only of the containers whose own cap it is (`_shared_pinned`)."""


@dataclass(frozen=True, slots=True)
class DesiredState:
    gpus: tuple[GpuDesired, ...] = ()
    containers: tuple[ContainerDesired, ...] = ()
    refusals: tuple[Refusal, ...] = ()
    owned_pods: frozenset[str] = frozenset()
    """Pods whose cgroups' GPU memory limits are this agent's to clear when no target names
    them: every live pod with a fractional container (planned, refused or applied), and the
    pods `plan_node` was told are `marked` (a readiness marker of this boot says the agent
    applied limits there, e.g. for a pod that went while no agent ran). A limit on any other
    pod's cgroup is someone else's: NVIDIA's container toolkit sets the same limits from a
    pod's env, and a sweep must not undo them."""
    limits: tuple[LimitTarget, ...] = ()
    """Every cgroup limit to have in force: pod slices first, then container cgroups."""
    unread: frozenset[tuple[str, str]] = frozenset()
    """(GPU UUID, cgroup path) whose limit is kept as the kernel holds it but could not be read
    this pass: the engine neither writes nor sweeps them (a limit that may be in force is
    never cleared on a guess)."""

    def container(self, key: tuple[str, str]) -> ContainerDesired | None:
        return next((c for c in self.containers if c.key == key), None)

    def refusal(self, key: tuple[str, str]) -> Refusal | None:
        return next((r for r in self.refusals if r.key == key), None)

    def gpu(self, uuid: str) -> GpuDesired | None:
        return next((g for g in self.gpus if g.uuid == uuid), None)

    @property
    def mps_namespaces(self) -> frozenset[str]:
        return frozenset(c.mps_namespace for c in self.containers if c.mps_namespace)

    @property
    def watched(self) -> tuple[ContainerDesired, ...]:
        """The refused containers the watchdog still watches (`Refusal.watched`)."""
        return tuple(r.watched for r in self.refusals if r.watched is not None)

    def watchdog_containers(self) -> tuple[ManagedContainer, ...]:
        """A `ManagedContainer` for each container, as the watchdog
        sees it: capped (the plan's limit on each of its GPUs) where the watchdog guards it,
        observed only (usage, no cap) where it does not; then each refused container it still
        watches (`watched`), with the plan's cap, whose use over it a report-mode watchdog
        reports."""
        return tuple(
            ManagedContainer.uniform(
                c.key.pod_uid, c.key.container, c.container_id, c.plan.limit_bytes,
                c.plan.device_uuids if Mechanism.WATCHDOG in c.mechanisms else (),
                mps_client=c.plan.compute_mode is ComputeMode.SM_SHARING)
            for c in (*self.containers, *self.watched)
        )
