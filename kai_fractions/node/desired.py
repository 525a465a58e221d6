"""The node plan (pure): what every GPU and every fractional container on this node should have.

`plan_node(pods, inventory, config)` reads the pods bound to the node (their contract
annotations through `kai_fractions.contract`), the GPU inventory and the node configuration, and
returns a `DesiredState`: compute mode per GPU, cgroup memory limits per pod slice and container
cgroup, MPS namespaces and pinned limits, and for every container it cannot serve a `Refusal`
with a reason a user can act on. A refused container gets nothing applied.

A container that is already running keeps its applied plan (`applied`, read back from durable
facts by `kai_fractions.node.applied`) whatever its pod's annotations say now: a different or
invalid new plan, or a signature refusal (`vetoes`), is reported as a `PlanChangeRefused`
refusal next to the container, which keeps its limits, its place in the GPU's accounting
(requested memory, compute mode, MPS namespace and pinned limit) and the watchdog's attention.
A running container refused because only a report-mode watchdog would watch it (an agent
upgraded past the rule that made such a watchdog no memory tier) keeps the watchdog's attention
too (`Refusal.watched`): its usage is measured and its use over the cap reported, as before.

Containers already applied are judged first, then the others oldest pod first (creation time,
then namespace/name/uid), so a newcomer can never take a GPU's compute mode or memory away from
a pod that was there before it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Any, NamedTuple

from ..contract import (
    MIB,
    MPS_SERVER,
    ComputeMode,
    ContainerPlan,
    ContainerShare,
    ContractViolation,
    PodView,
    parse_pod,
    plan_container,
    view_from_pod_spec,
)
from ..contract import keys as k
from . import applied as ap
from .cgroups import ContainerId, QosClass, qos_class_of
from .config import Mechanism, NodeConfig, WatchdogPolicy
from .inventory import Inventory
from .nvml import DeviceInfo, GpuComputeMode


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



log = logging.getLogger(__name__)

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
    mps-pinned containers: a client that drops its own env is still bounded); None: leave."""


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

    def watchdog_containers(self) -> tuple[Any, ...]:
        """`kai_fractions.node.watchdog.ManagedContainer` for each container, as the watchdog
        sees it: capped (the plan's limit on each of its GPUs) where the watchdog guards it,
        observed only (usage, no cap) where it does not; then each refused container it still
        watches (`watched`), with the plan's cap, whose use over it a report-mode watchdog
        reports."""
        from .watchdog import ManagedContainer  # the watchdog pulls in /proc and MPS plumbing

        return tuple(
            ManagedContainer.uniform(
                c.key.pod_uid, c.key.container, c.container_id, c.plan.limit_bytes,
                c.plan.device_uuids if Mechanism.WATCHDOG in c.mechanisms else (),
                mps_client=c.plan.compute_mode is ComputeMode.SM_SHARING)
            for c in (*self.containers, *self.watched)
        )


# -- planning ---------------------------------------------------------------------------------


def _mib(n: int) -> str:
    return f"{-(-n // MIB)} MiB"


class _Candidate(NamedTuple):
    pod: NodePod
    share: ContainerShare | None
    """None for an applied plan kept in force (`_hold`)."""
    plan: ContainerPlan


def _order(pod: NodePod) -> tuple:
    v = pod.view
    return (pod.created == "", pod.created, v.namespace, v.name, v.uid)


def _refuse(pod: NodePod, container: str, reason: RefusalReason, message: str,
            final: bool = True) -> Refusal:
    return Refusal(key=ContainerKey(pod.uid, container), pod_namespace=pod.view.namespace,
                   pod_name=pod.view.name, reason=reason, message=message, final=final)


def _contract_refusals(pod: NodePod, config: NodeConfig) -> tuple[list[_Candidate],
                                                                  list[Refusal]]:
    request = parse_pod(pod.view, config.keys)
    refusals: list[Refusal] = []
    if request.errors:
        named = [s.container for s in request.shares]
        named += [e.container for e in request.errors if e.container and e.container not in named]
        if not named:
            named = [e.container or "" for e in request.errors[:1]]
        for name in dict.fromkeys(named):
            mine = [e for e in request.errors if e.container in (name, None)]
            text = "; ".join(str(e) for e in mine or request.errors)
            refusals.append(_refuse(pod, name, RefusalReason.CONTRACT_INVALID,
                                    f"the pod's GPU annotations are invalid: {text}; fix them "
                                    "and recreate the pod"))
        return [], refusals
    candidates = []
    for share in request.shares:
        if not share.devices:
            refusals.append(_refuse(
                pod, share.container, RefusalReason.NOT_BOUND,
                f"no GPU assigned yet: {config.keys.container(share.container, k.DEVICES)} "
                "is missing; it is written by the scheduler's binder (KAI) or the "
                "kai-fractions mirror when the pod is bound", final=False))
            continue
        try:
            plan = plan_container(share, pod.uid, keys=config.keys,
                                  mps_pipe_root=config.container_mps_pipe_root)
        except ContractViolation as e:
            refusals.append(_refuse(
                pod, share.container, RefusalReason.CONTRACT_INVALID,
                "the pod's GPU annotations cannot be planned: "
                + "; ".join(str(x) for x in e.errors)))
            continue
        candidates.append(_Candidate(pod, share, plan))
    return candidates, refusals


def _device_refusal(c: _Candidate, inventory: Inventory, config: NodeConfig) -> Refusal | None:
    pod, plan = c.pod, c.plan
    missing = [u for u in plan.device_uuids if inventory.device(u) is None]
    if missing:
        here = ", ".join(inventory.uuids) or "none"
        return _refuse(pod, plan.container, RefusalReason.DEVICE_NOT_ON_NODE,
                       f"GPU {', '.join(missing)} assigned to this container is not on node "
                       f"{config.node_name or '(this node)'} (GPUs here: {here}); the pod was "
                       "bound with a stale or wrong device list: delete it so it is scheduled "
                       "again")
    mig = [u for u in plan.device_uuids if (d := inventory.device(u)) and d.mig_enabled]
    if mig:
        return _refuse(pod, plan.container, RefusalReason.MIG_NOT_SUPPORTED,
                       f"GPU {', '.join(mig)} is in MIG mode: GPU memory limits and MPS sharing "
                       "do not work on MIG; request a MIG slice instead of a fraction, or "
                       "disable MIG on that GPU")
    return None


def _mechanisms(c: _Candidate, inventory: Inventory, config: NodeConfig, running: bool = False
                ) -> frozenset[Mechanism] | Refusal:
    pod, plan = c.pod, c.plan
    wanted = config.memory_enforcement
    sm = plan.compute_mode is ComputeMode.SM_SHARING
    if sm and not config.sm_sharing:
        return _refuse(pod, plan.container, RefusalReason.SM_SHARING_DISABLED,
                       "the container asks for compute mode sm-sharing but this node runs "
                       "without MPS (--no-sm-sharing): use time-slicing, or schedule it to a "
                       "node with sm-sharing enabled")
    hard = set()
    if Mechanism.CGROUP in wanted and inventory.capabilities.memory_limits:
        hard.add(Mechanism.CGROUP)
    if Mechanism.MPS_PINNED in wanted and sm:
        hard.add(Mechanism.MPS_PINNED)
    watchdog = Mechanism.WATCHDOG in wanted
    # A watchdog in report mode stops nothing: it is a second line beside a tier that caps (it
    # reports the violations there), never the only one. A container it alone would watch runs
    # without a cap, so it is refused rather than reported applied. One that runs already (applied
    # before this rule) is refused too, and stays watched (`_report_only`, `Refusal.watched`).
    if hard or (watchdog and config.watchdog_policy is WatchdogPolicy.KILL):
        return frozenset(hard | ({Mechanism.WATCHDOG} if watchdog else set()))
    return _refuse(pod, plan.container, RefusalReason.MEMORY_LIMITS_UNSUPPORTED,
                   _no_cap(inventory, config, sm, running))


def _report_only(refusal: Refusal, config: NodeConfig) -> bool:
    """Whether `_mechanisms` refused the container because only a watchdog in report mode
    would watch it (the watchdog is enabled, and nothing else would cap it)."""
    return (refusal.reason is RefusalReason.MEMORY_LIMITS_UNSUPPORTED
            and Mechanism.WATCHDOG in config.memory_enforcement
            and config.watchdog_policy is WatchdogPolicy.REPORT)


def _no_cap(inventory: Inventory, config: NodeConfig, sm: bool, running: bool = False) -> str:
    """Why no enabled tier caps a container's GPU memory, and what would. `running`: the
    container runs already, with this plan (applied before a report-mode watchdog was no tier):
    nothing stops it now, and its next sandbox will not start."""
    wanted = config.memory_enforcement
    enabled = ",".join(sorted(m.value for m in wanted))
    if not inventory.capabilities.memory_limits:
        why = (f"NVIDIA driver {inventory.driver_version} has no cgroup GPU memory limits "
               "(they need r615 or newer)")
        fixes = ["upgrade the driver to r615 or newer"
                 + ("" if Mechanism.CGROUP in wanted else " and add cgroup to "
                    "--memory-enforcement")]
    else:
        why = "the cgroup tier is not enabled"
        fixes = ["add cgroup to --memory-enforcement"]
    if sm and Mechanism.MPS_PINNED not in wanted:
        fixes.append("add mps-pinned to --memory-enforcement")
    if Mechanism.WATCHDOG in wanted:  # in report mode: a kill watchdog would have capped it
        also = (", mps-pinned applies to sm-sharing containers only"
                if not sm and Mechanism.MPS_PINNED in wanted else "")
        if running:  # applied before this rule: it runs, and nothing stops it
            now = ("; this container was started before such a watchdog was refused and runs "
                   "without a cap now: its processes are left running and their use over the "
                   "cap is only reported (LimitViolation events), and it will not start again "
                   "after its pod's sandbox restarts")
            cap = "to cap it (the watchdog then stops what exceeds the cap)"
        else:
            now = " (the container would run without a cap)"
            cap = "so that the watchdog caps the memory by stopping what exceeds it"
        return (f"cannot cap this container's GPU memory: {why}{also}, and a watchdog with "
                f"--watchdog-policy=report only reports use over the cap, it stops nothing{now}; "
                f"set --watchdog-policy=kill (the chart's watchdog.policy: kill) {cap}, or "
                f"{', or '.join(fixes)}")
    pinned = " (mps-pinned applies to sm-sharing containers only)" if not sm else ""
    kill = config.watchdog_policy is WatchdogPolicy.KILL
    fixes.append("add watchdog to --memory-enforcement"
                 + ("" if kill else " with --watchdog-policy=kill (a watchdog that only "
                    "reports caps nothing)"))
    return (f"cannot cap this container's GPU memory: {why} and --memory-enforcement={enabled} "
            f"allows no fallback{pinned}; {', or '.join(fixes)}")


def _cgroup_paths(c: _Candidate, config: NodeConfig) -> tuple[str, str | None] | Refusal:
    pod, plan = c.pod, c.plan
    layout = config.layout
    try:
        pod_path = layout.pod_path(pod.uid, pod.qos)
    except ValueError as e:
        return _refuse(pod, plan.container, RefusalReason.CONTRACT_INVALID,
                       f"cannot name the pod's cgroup: {e}")
    raw = pod.container_ids.get(plan.container)
    if not raw:
        return pod_path, None
    try:
        return pod_path, layout.container_path(pod.uid, pod.qos, ContainerId.parse(raw))
    except ValueError:
        # A runtime whose cgroup naming is unknown: the pod slice still carries the cap (only
        # cudaMemGetInfo inside will report the physical total).
        return pod_path, None


def _hold(pod: NodePod, ok: list[_Candidate], refused: list[Refusal],
          applied: Mapping[str, ContainerPlan], changes: dict[ContainerKey, Refusal]
          ) -> tuple[list[_Candidate], list[Refusal]]:
    """The pod's candidates and refusals with every applied plan kept: a container whose new
    plan differs, is refused or is gone keeps its applied plan, and the change is refused."""
    if not applied:
        return ok, refused
    kept, out, seen = [], [], set()

    def hold(old: ContainerPlan, why: str) -> None:
        kept.append(_Candidate(pod, None, old))
        changes[ContainerKey(pod.uid, old.container)] = _refuse(
            pod, old.container, RefusalReason.PLAN_CHANGE_REFUSED, ap.change_refused(old, why))

    for c in ok:
        old = applied.get(c.plan.container)
        seen.add(c.plan.container)
        if old is None or old.digest == c.plan.digest:
            kept.append(c)
        else:
            hold(old, ap.edited(old, c.plan))
    for r in refused:
        old = applied.get(r.key.container)
        if old is None:
            out.append(r)
        elif r.key.container not in seen:  # one hold per container, however many refusals
            seen.add(r.key.container)
            hold(old, ap.refused_now(r.reason, r.message))
    pod_level = next((r for r in refused if r.key.container not in applied), None)
    for name, old in applied.items():
        if name not in seen:
            hold(old, ap.GONE if pod_level is None
                 else ap.refused_now(pod_level.reason, pod_level.message))
    return kept, out


def plan_node(pods: Iterable[NodePod], inventory: Inventory, config: NodeConfig, *,
              applied: Mapping[ContainerKey, ContainerPlan] | None = None,
              vetoes: Iterable[Refusal] = (), marked: Iterable[str] = ()) -> DesiredState:
    """`applied`: the plan in force for each running container (`kai_fractions.node.applied`);
    `vetoes`: refusals decided before planning (a signature check), by pod: such a pod is
    not planned from its annotations, only its applied plans are kept; `marked`: pods with
    a readiness marker of this boot (`DesiredState.owned_pods`)."""
    live = sorted((p for p in pods if not p.terminal), key=_order)
    applied = applied or {}
    vetoed: dict[str, list[Refusal]] = {}
    for r in vetoes:
        vetoed.setdefault(r.key.pod_uid, []).append(r)
    held: dict[str, dict[str, ContainerPlan]] = {}
    for key, plan in applied.items():
        held.setdefault(key.pod_uid, {})[key.container] = plan
    changes: dict[ContainerKey, Refusal] = {}
    refusals: list[Refusal] = []
    candidates: list[_Candidate] = []
    for pod in live:
        try:
            ok, refused = ([], vetoed[pod.uid]) if pod.uid in vetoed else \
                _contract_refusals(pod, config)
        except Exception as e:  # one pod's annotations must not stop the node
            log.exception("pod %s/%s: its GPU annotations could not be read",
                          pod.view.namespace, pod.view.name)
            ok, refused = [], [_refuse(pod, "", RefusalReason.CONTRACT_INVALID,
                                       "the pod's GPU annotations could not be read "
                                       f"({type(e).__name__}); fix them and recreate the pod")]
        ok, refused = _hold(pod, ok, refused, held.get(pod.uid, {}), changes)
        candidates.extend(ok)
        refusals.extend(refused)
    # What runs already is placed first: a newcomer never takes its memory or compute mode.
    candidates.sort(key=lambda c: ContainerKey(c.pod.uid, c.plan.container) not in applied)

    accepted: list[ContainerDesired] = []
    modes: dict[str, tuple[ComputeMode, str]] = {}  # gpu -> (mode, first container's ref)
    requested: dict[str, int] = {}
    members: dict[str, list[ContainerKey]] = {}
    # MPS namespace -> the container it is for. What runs holds its namespace even when it is
    # refused below for another reason: its processes still use that directory.
    namespaces = {plan.mps_namespace: key for key, plan in applied.items() if plan.mps_namespace}
    for c in candidates:
        pod, plan = c.pod, c.plan
        ref = f"{pod.view.namespace}/{pod.view.name}/{plan.container}"
        held_plan = applied.get(ContainerKey(pod.uid, plan.container))
        running = held_plan is not None and held_plan.digest == plan.digest
        refusal = _device_refusal(c, inventory, config)
        mechanisms = _mechanisms(c, inventory, config, running) if refusal is None else None
        if isinstance(mechanisms, Refusal):
            refusal = mechanisms
        paths = _cgroup_paths(c, config) if refusal is None else None
        if isinstance(paths, Refusal):
            refusal = paths
        if refusal is None:
            refusal = _sharing_refusal(c, inventory, modes, requested)
        if refusal is None:
            refusal = _namespace_refusal(c, namespaces, config.keys)
        if refusal is None:
            refusal = _mount_refusal(c, config)
        if refusal is not None:
            changes.pop(refusal.key, None)  # an applied plan that cannot be kept: this says why
            if running:
                report_only = refusal is mechanisms and _report_only(refusal, config)
                refusal = dataclasses.replace(refusal, plan_digest=plan.digest)
                # It still runs, with the kernel's limits kept: its memory is taken, and a
                # newcomer placed on it would overcommit the GPU.
                for uuid in plan.device_uuids:
                    requested[uuid] = requested.get(uuid, 0) + plan.request_bytes
                if report_only:
                    refusal = _watched(c, refusal, inventory, config, modes, ref)
            refusals.append(refusal)
            continue
        assert isinstance(mechanisms, frozenset) and isinstance(paths, tuple)
        key = ContainerKey(pod.uid, plan.container)
        for uuid in plan.device_uuids:
            modes.setdefault(uuid, (plan.compute_mode, ref))
            requested[uuid] = requested.get(uuid, 0) + plan.request_bytes
            members.setdefault(uuid, []).append(key)
        if plan.mps_namespace:
            namespaces.setdefault(plan.mps_namespace, key)
        sm = plan.compute_mode is ComputeMode.SM_SHARING
        if not sm:
            compute = ComputeEnforcement.TIME_SLICING
        elif inventory.capabilities.mps_namespaces:
            compute = ComputeEnforcement.MPS_NAMESPACE
        else:
            compute = ComputeEnforcement.MPS_CLIENT_ENV
        devices = [inventory.device(u) for u in plan.device_uuids]
        accepted.append(ContainerDesired(
            key=key, pod_namespace=pod.view.namespace, pod_name=pod.view.name, plan=plan,
            qos=pod.qos, pod_cgroup=paths[0], container_cgroup=paths[1],
            mechanisms=mechanisms, compute=compute,
            mps_namespace=plan.mps_namespace if compute is ComputeEnforcement.MPS_NAMESPACE
            else None,
            device_indexes=tuple(d.index for d in devices if d is not None),
            container_id=pod.container_ids.get(plan.container),
        ))

    refusals += changes.values()
    owned = {*marked, *held, *(c.key.pod_uid for c in accepted),
             *(r.key.pod_uid for r in refusals)}
    return DesiredState(
        gpus=tuple(_gpu(d, accepted, modes, requested, members, config)
                   for d in inventory.devices),
        containers=tuple(accepted),
        refusals=tuple(refusals),
        owned_pods=frozenset(owned),
        limits=_within_devices(_pod_limits(accepted) + tuple(t for c in accepted for t in c.limits),
                               inventory),
    )


def _watched(c: _Candidate, refusal: Refusal, inventory: Inventory, config: NodeConfig,
             modes: dict[str, tuple[ComputeMode, str]], ref: str) -> Refusal:
    """A running container refused because only a report-mode watchdog would watch it, as it
    was before the upgrade that refused it, minus the claim of a cap: the watchdog keeps
    measuring its usage and reporting its use over the plan's cap (`Refusal.watched`), and its
    GPUs keep its compute mode, so no newcomer turns a GPU it runs on to another."""
    pod, plan = c.pod, c.plan
    paths = _cgroup_paths(c, config)
    pod_cgroup, container_cgroup = paths if isinstance(paths, tuple) else ("", None)
    for uuid in plan.device_uuids:
        modes.setdefault(uuid, (plan.compute_mode, ref))
    devices = [inventory.device(u) for u in plan.device_uuids]
    sm = plan.compute_mode is ComputeMode.SM_SHARING
    watched = ContainerDesired(
        key=refusal.key, pod_namespace=pod.view.namespace, pod_name=pod.view.name, plan=plan,
        qos=pod.qos, pod_cgroup=pod_cgroup, container_cgroup=container_cgroup,
        mechanisms=frozenset({Mechanism.WATCHDOG}),
        compute=(ComputeEnforcement.TIME_SLICING if not sm
                 else ComputeEnforcement.MPS_NAMESPACE if inventory.capabilities.mps_namespaces
                 else ComputeEnforcement.MPS_CLIENT_ENV),
        mps_namespace=None,
        device_indexes=tuple(d.index for d in devices if d is not None),
        container_id=pod.container_ids.get(plan.container))
    return dataclasses.replace(refusal, watched=watched)


def _namespace_refusal(c: _Candidate, namespaces: Mapping[str, ContainerKey],
                       keys: k.Keys) -> Refusal | None:
    """A second container naming an MPS namespace already planned for another: the webhook
    names a fresh one per pod, so this is a copied annotation, and sharing it would hand the
    newcomer the first one's pipe directory and compute cap. What runs keeps it. The message
    does not name the holder (another tenant's pod); the agent's log does."""
    name = c.plan.mps_namespace
    holder = namespaces.get(name) if name else None
    if holder is None or holder == ContainerKey(c.pod.uid, c.plan.container):
        return None
    log.warning("pod %s/%s: MPS namespace %s is already container %s of pod %s's: refused",
                c.pod.view.namespace, c.pod.view.name, name, holder.container, holder.pod_uid)
    key = keys.derived(c.plan.container, k.ADMITTED_MPS_NAMESPACE)
    return _refuse(c.pod, c.plan.container, RefusalReason.MPS_NAMESPACE_TAKEN,
                   f"MPS namespace {name} belongs to another container on this node; a pod may "
                   f"not name another's namespace ({key}): recreate the pod so the admission "
                   "webhook names one of its own")


def _mount_refusal(c: _Candidate, config: NodeConfig) -> Refusal | None:
    """A new sm-sharing container whose MPS mount is not where its plan's pipe directory is:
    the pod was wired for another namespace than every plan now names (a component of another
    release in between, say), and its clients would find no server there. Fail closed, with
    the reason, rather than start it. The mounts of pods wired before per-pod namespaces (the
    whole server directory, or the pipe root) still reach their directory; what runs is not
    judged again."""
    plan = c.plan
    if c.share is None or not plan.mps_pipe_directory:
        return None
    root = config.container_mps_pipe_root.rstrip("/")
    wider = (root, f"{root}/{MPS_SERVER}")
    for path, sub in c.pod.mounts.get(plan.container, ()):
        path = path.rstrip("/")
        if path == plan.mps_pipe_directory and sub == plan.mps_namespace:
            continue
        if (path in wider and not sub) or not (path == root or path.startswith(root + "/")):
            continue
        return _refuse(c.pod, plan.container, RefusalReason.MPS_MOUNT_MISMATCH,
                       f"the container mounts {path}" + (f" (subPath {sub})" if sub else "")
                       + f" but its MPS pipe directory is {plan.mps_pipe_directory} (namespace "
                       f"{plan.mps_namespace}): it was wired for another MPS namespace; "
                       "recreate the pod once the admission webhook, the mirror and the node "
                       "agents run the same release")
    return None


def _sharing_refusal(c: _Candidate, inventory: Inventory,
                     modes: Mapping[str, tuple[ComputeMode, str]],
                     requested: Mapping[str, int]) -> Refusal | None:
    pod, plan = c.pod, c.plan
    for uuid in plan.device_uuids:
        held = modes.get(uuid)
        if held is not None and held[0] is not plan.compute_mode:
            return _refuse(
                pod, plan.container, RefusalReason.COMPUTE_MODE_MIX,
                f"GPU {uuid} already runs {held[0].value} ({held[1]}); one GPU runs one compute "
                f"mode at a time, so this {plan.compute_mode.value} container cannot share it: "
                "use the same compute mode as the GPU's other tenants or let the scheduler pick "
                "another GPU")
    for uuid in plan.device_uuids:
        device = inventory.device(uuid)
        assert device is not None
        before = requested.get(uuid, 0)
        if before + plan.request_bytes > device.memory_total:
            return _refuse(
                pod, plan.container, RefusalReason.MEMORY_OVERCOMMITTED,
                f"GPU {uuid} has {_mib(device.memory_total)}; containers placed there before "
                f"this one already request {_mib(before)}, and this one requests "
                f"{_mib(plan.request_bytes)} more: the guarantees cannot all be kept; lower the "
                "request or let the scheduler pick another GPU")
    return None


def _gpu(device: DeviceInfo, accepted: list[ContainerDesired],
         modes: Mapping[str, tuple[ComputeMode, str]], requested: Mapping[str, int],
         members: Mapping[str, list[ContainerKey]], config: NodeConfig) -> GpuDesired:
    mode: GpuComputeMode | None = None
    held = modes.get(device.uuid)
    # Without sm-sharing the agent never touches compute modes: nothing on the node needs MPS.
    if held is not None and config.sm_sharing:
        mode = (GpuComputeMode.EXCLUSIVE_PROCESS if held[0] is ComputeMode.SM_SHARING
                else GpuComputeMode.DEFAULT)
    pinned = [c.plan.limit_mib for c in accepted
              if Mechanism.MPS_PINNED in c.mechanisms and device.uuid in c.plan.device_uuids]
    return GpuDesired(uuid=device.uuid, index=device.index, compute_mode=mode,
                      containers=tuple(members.get(device.uuid, ())),
                      requested_bytes=requested.get(device.uuid, 0),
                      mps_pinned_mib=max(pinned) if pinned else None)


def _within_devices(targets: tuple[LimitTarget, ...], inventory: Inventory
                    ) -> tuple[LimitTarget, ...]:
    """Each limit as the GPU can hold it. A cap above the GPU's memory (`80Gi` on an H100's
    81,559 MiB, say) caps nothing, and NVML refuses to write it (nvml.h, SetMemoryLimits:
    INVALID_ARGUMENT "if a limit exceeds total device memory"): it is written as the GPU's
    memory, the same cap. A request above it was refused before (MemoryOvercommitted)."""
    fitted = []
    for t in targets:
        device = inventory.device(t.gpu_uuid)
        total = device.memory_total if device is not None else t.hard
        fitted.append(t if t.hard <= total else
                      dataclasses.replace(t, soft=min(t.soft, total), hard=total))
    return tuple(fitted)


def _pod_limits(accepted: list[ContainerDesired]) -> tuple[LimitTarget, ...]:
    """One limit per (pod slice, GPU): the sum of the pod's fractional containers on that GPU.

    The slice exists before the pod's first init container starts, so this cap is in force
    before any workload process can allocate (KAI allows one fractional container per pod, so
    the sum is that container's own request and limit).
    """
    sums: dict[tuple[str, str], list[int]] = {}
    owner: dict[tuple[str, str], str] = {}
    for c in accepted:
        if Mechanism.CGROUP not in c.mechanisms:
            continue
        for uuid in c.plan.device_uuids:
            s = sums.setdefault((c.pod_cgroup, uuid), [0, 0])
            s[0] += c.plan.request_bytes
            s[1] += c.plan.limit_bytes
            owner[(c.pod_cgroup, uuid)] = c.key.pod_uid
    return tuple(
        LimitTarget(gpu_uuid=uuid, path=path, soft=s[0], hard=s[1], pod_uid=owner[(path, uuid)],
                    container=None)
        for (path, uuid), s in sums.items()
    )
