"""The checks that refuse a container's plan on this node, each with a reason a user can act on.

One check per rule: the pod's contract annotations (`_contract_refusals`), its GPUs on this node
and not in MIG mode (`_device_refusal`), a memory tier that caps it (`_mechanisms`, `_no_cap`;
which tiers cap, the one rule: `hard_tiers_of`),
its cgroup paths (`_cgroup_paths`), one compute mode and no memory overcommit per GPU
(`_sharing_refusal`), its own MPS namespace (`_namespace_refusal`) and MPS mount
(`_mount_refusal`). Each returns a `Refusal` or None; `kai_fractions.node.desired.plan_node`
runs them in order and places what passes; once all are placed, `_shared_pinned` takes
mps-pinned from a container whose cap is below its GPU's one default pinned limit. They are
kept apart from the placing so that each rule and its message reads on its own.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping
from typing import NamedTuple

from ..contract import (
    MIB,
    MPS_SERVER,
    ComputeMode,
    ContainerPlan,
    ContainerShare,
    ContractViolation,
    parse_pod,
    plan_container,
)
from ..contract import keys as k
from .cgroups import ContainerId
from .config import HARD_TIERS, Mechanism, NodeConfig, WatchdogPolicy
from .desired_state import (
    ComputeEnforcement,
    ContainerDesired,
    ContainerKey,
    NodePod,
    Refusal,
    RefusalReason,
)
from .inventory import Inventory

# The planner's logger: its records keep the name they had before the checks moved here.
log = logging.getLogger("kai_fractions.node.desired")


def _mib(n: int) -> str:
    return f"{-(-n // MIB)} MiB"


class _Candidate(NamedTuple):
    pod: NodePod
    share: ContainerShare | None
    """None for an applied plan kept in force (`_hold`)."""
    plan: ContainerPlan


def _refuse(pod: NodePod, container: str, reason: RefusalReason, message: str,
            final: bool = True) -> Refusal:
    return Refusal(key=ContainerKey(pod.uid, container), pod_namespace=pod.view.namespace,
                   pod_name=pod.view.name, reason=reason, message=message, final=final)


def _contract_refusals(pod: NodePod, config: NodeConfig
                       ) -> tuple[list[_Candidate], list[Refusal], bool]:
    """The pod's containers that can be planned, the refusals of the others, and whether those
    refusals are the whole pod's (its annotations are invalid) rather than each container's
    own (not bound yet, cannot be planned)."""
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
        return [], refusals, True
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
    return candidates, refusals, False


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


def hard_tiers_of(mechanisms: Iterable[Mechanism | str],
                  compute: ComputeEnforcement | str | None) -> frozenset[Mechanism]:
    """The tiers among a container's `mechanisms` (Mechanism values, or their names as a marker
    records them) that cap its GPU memory without the watchdog, its compute being `compute`:
    the cgroup limit, and the MPS default pinned limit only in an MPS namespace of its own
    (`mps-namespace`: a v3 daemon, where each container reaches only its namespace's pipe
    directory). On a daemon without namespaces (drivers before r615, `mps-client-env`) every
    sm-sharing container mounts the daemon's own pipe directory, control pipe included, and
    any of its processes, root or not, can change the GPU's default pinned limit there (or a
    server's, or end another tenant's clients): like its client env, a limit the tenant can
    lift. The agent still sets it there (it bounds a well-behaved tenant), but vouches for it
    nowhere. The one rule: the planner (`hard_tiers`, `_mechanisms`), the watchdog's blindness
    and the readiness marker read it."""
    names = {m.value for m in HARD_TIERS}
    hard = {Mechanism(m) for m in mechanisms if m in names}
    if compute != ComputeEnforcement.MPS_NAMESPACE:
        hard.discard(Mechanism.MPS_PINNED)
    return frozenset(hard)


def hard_tiers(config: NodeConfig, inventory: Inventory, *, sm: bool) -> frozenset[Mechanism]:
    """The enabled memory tiers that cap a container without the watchdog on this node
    (`hard_tiers_of`): the cgroup limit where the driver has it (r615), the MPS pinned limit
    for sm-sharing where the daemon has namespaces."""
    wanted = config.memory_enforcement
    available = {m for m in wanted if m is not Mechanism.CGROUP
                 or inventory.capabilities.memory_limits}
    return hard_tiers_of(available, _compute(inventory, sm))


def _compute(inventory: Inventory, sm: bool) -> ComputeEnforcement:
    """How a container's share of the SMs is enforced on this node (as the planner sets it)."""
    if not sm:
        return ComputeEnforcement.TIME_SLICING
    return (ComputeEnforcement.MPS_NAMESPACE if inventory.capabilities.mps_namespaces
            else ComputeEnforcement.MPS_CLIENT_ENV)


def watchdog_stops(config: NodeConfig) -> bool:
    """Whether the watchdog is enabled and stops what exceeds a cap (kill policy): one that
    only reports caps nothing."""
    return (Mechanism.WATCHDOG in config.memory_enforcement
            and config.watchdog_policy is WatchdogPolicy.KILL)


UNTIL_RESTART = "until its pod's sandbox restarts (a node reboot restarts it)"
THEN_FAILS = "then its gate fails on this refusal"
"""How the refusal of a container applied before (`running`) says what holds: `running` holds
after a reboot too (the plan is held from the boot before), when the container no longer runs,
so its words hold before and after its sandbox restarts."""


def _mechanisms(c: _Candidate, inventory: Inventory, config: NodeConfig, running: bool = False
                ) -> frozenset[Mechanism] | Refusal:
    pod, plan = c.pod, c.plan
    wanted = config.memory_enforcement
    sm = plan.compute_mode is ComputeMode.SM_SHARING
    if sm and not config.sm_sharing:
        return _refuse(pod, plan.container, RefusalReason.SM_SHARING_DISABLED,
                       "the container asks for compute mode sm-sharing but this node runs "
                       "without MPS (--no-sm-sharing): " + (
                           # Applied while the node ran sm-sharing (turned off since, a chart
                           # rolled back).
                           f"this container was started while the node ran sm-sharing: "
                           f"{UNTIL_RESTART} it runs on, its GPU memory limits kept as the "
                           "kernel holds them but without its compute share (no MPS daemon of "
                           f"the agent's holds it any more), and {THEN_FAILS}; turn sm-sharing "
                           "back on for this node (--sm-sharing, the chart's smSharing.enabled), "
                           "or recreate the pod with time-slicing" if running else
                           "use time-slicing, or schedule it to a node with sm-sharing enabled"))
    hard = hard_tiers(config, inventory, sm=sm)
    watchdog = Mechanism.WATCHDOG in wanted
    # The pinned limit is set for every sm-sharing container, and a tier only where it caps
    # (`hard_tiers_of`): on a daemon without namespaces its tenants can change it.
    pinned = sm and Mechanism.MPS_PINNED in wanted
    # A watchdog in report mode stops nothing: it is a second line beside a tier that caps (it
    # reports the violations there), never the only one. A container it alone would watch runs
    # without a cap, so it is refused rather than reported applied. One that runs already (applied
    # before this rule) is refused too, and stays watched (`_report_only`, `Refusal.watched`).
    if hard or watchdog_stops(config):
        return frozenset(hard | ({Mechanism.MPS_PINNED} if pinned else set())
                         | ({Mechanism.WATCHDOG} if watchdog else set()))
    return _refuse(pod, plan.container, RefusalReason.MEMORY_LIMITS_UNSUPPORTED,
                   _no_cap(inventory, config, sm, running))


def _report_only(refusal: Refusal, config: NodeConfig) -> bool:
    """Whether `_mechanisms` refused the container because only a watchdog in report mode
    would watch it (the watchdog is enabled, and nothing else would cap it)."""
    return (refusal.reason is RefusalReason.MEMORY_LIMITS_UNSUPPORTED
            and _report_only_policy(config))


def _report_only_policy(config: NodeConfig) -> bool:
    """Whether the watchdog is enabled and only reports (it watches, and caps nothing)."""
    return (Mechanism.WATCHDOG in config.memory_enforcement
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
    namespaces = inventory.capabilities.mps_namespaces
    legacy = sm and Mechanism.MPS_PINNED in wanted and not namespaces  # set, caps nothing
    if sm and Mechanism.MPS_PINNED not in wanted and namespaces:
        fixes.append("add mps-pinned to --memory-enforcement")
    if Mechanism.WATCHDOG in wanted:  # in report mode: a kill watchdog would have capped it
        also = (", mps-pinned applies to sm-sharing containers only"
                if not sm and Mechanism.MPS_PINNED in wanted
                else f", {PINNED_NOT_A_TIER}" if legacy else "")
        if running:  # applied before this rule: it runs, and nothing stops it
            # Here every earlier release counted mps-pinned as its tier: that is why it runs.
            since = ("while mps-pinned still counted as a tier on this daemon (an earlier "
                     "release of the agent)" if legacy else "before such a watchdog was refused")
            now = (f"; this container was started {since}: {UNTIL_RESTART} it runs without a "
                   "cap, its processes left running and their use over the cap only reported "
                   f"(LimitViolation events), and {THEN_FAILS}")
            cap = "to cap it (the watchdog then stops what exceeds the cap)"
        else:
            now = " (the container would run without a cap)"
            cap = "so that the watchdog caps the memory by stopping what exceeds it"
        return (f"cannot cap this container's GPU memory: {why}{also}, and a watchdog with "
                f"--watchdog-policy=report only reports use over the cap, it stops nothing{now}; "
                f"set --watchdog-policy=kill (the chart's watchdog.policy: kill) {cap}, or "
                f"{', or '.join(fixes)}")
    pinned = (" (mps-pinned applies to sm-sharing containers only)" if not sm
              else f" ({PINNED_NOT_A_TIER})" if legacy else "")
    kill = config.watchdog_policy is WatchdogPolicy.KILL
    fixes.append("add watchdog to --memory-enforcement"
                 + ("" if kill else " with --watchdog-policy=kill (a watchdog that only "
                    "reports caps nothing)"))
    return (f"cannot cap this container's GPU memory: {why} and --memory-enforcement={enabled} "
            f"allows no fallback{pinned}; {', or '.join(fixes)}")


PINNED_NOT_A_TIER = (
    "mps-pinned caps nothing on an MPS daemon without namespaces like this one (driver before "
    "r615): every sm-sharing container reaches its control pipe, and any of its processes can "
    "change the GPU's default pinned limit there")
"""Why mps-pinned is no tier of an sm-sharing container here (`hard_tiers_of`)."""


def _pinned_maxima(accepted: Iterable[ContainerDesired]) -> dict[str, int]:
    """GPU UUID -> the MPS daemon's default pinned device memory limit for it: the largest cap
    (MiB) of its mps-pinned containers. The daemon holds one such limit per GPU, and a lower one
    would cut a larger tenant below its own cap."""
    pinned: dict[str, int] = {}
    for c in accepted:
        if Mechanism.MPS_PINNED in c.mechanisms:
            for uuid in c.plan.device_uuids:
                pinned[uuid] = max(pinned.get(uuid, 0), c.plan.limit_mib)
    return pinned


def _shared_pinned(c: ContainerDesired, pinned: Mapping[str, int], inventory: Inventory,
                   config: NodeConfig, running: bool) -> ContainerDesired | Refusal:
    """`c` as its GPUs' one default pinned limit (`pinned`) leaves it. mps-pinned caps `c` only
    where that limit is `c`'s own cap on every GPU it uses; below it, the daemon bounds `c` at
    the larger cap only, and `c`'s own rests on its client env (CUDA_MPS_PINNED_DEVICE_MEM_LIMIT),
    which its processes can change. Such a container loses mps-pinned and is judged by the
    rule of `_mechanisms` on what it has left: applied with the cgroup tier or a kill watchdog,
    else refused MemoryLimitsUnsupported. Taking it never lowers a maximum: it is not one."""
    above = [(u, pinned[u]) for u in c.plan.device_uuids if pinned.get(u, 0) > c.plan.limit_mib]
    if Mechanism.MPS_PINNED not in c.mechanisms or not above:
        return c
    left = c.mechanisms - {Mechanism.MPS_PINNED}
    if hard_tiers_of(left, c.compute) or (Mechanism.WATCHDOG in left and watchdog_stops(config)):
        return dataclasses.replace(c, mechanisms=left)
    gpu, limit = above[0]
    return Refusal(key=c.key, pod_namespace=c.pod_namespace, pod_name=c.pod_name,
                   reason=RefusalReason.MEMORY_LIMITS_UNSUPPORTED,
                   message=_below_pinned(c, gpu, limit, inventory, config, running))


def _below_pinned(c: ContainerDesired, gpu: str, limit: int, inventory: Inventory,
                  config: NodeConfig, running: bool) -> str:
    """Why mps-pinned does not cap `c` (its cap is below GPU `gpu`'s default pinned limit,
    `limit` MiB), and what would."""
    wanted = config.memory_enforcement
    if Mechanism.WATCHDOG in wanted:
        fixes = ["set --watchdog-policy=kill (the chart's watchdog.policy: kill)"]
    else:
        fixes = ["add watchdog to --memory-enforcement with --watchdog-policy=kill (the "
                 "chart's watchdog.policy: kill)"]
    if not inventory.capabilities.memory_limits:
        fixes.append("upgrade the driver to r615 or newer for the cgroup tier"
                     + ("" if Mechanism.CGROUP in wanted else
                        " and add cgroup to --memory-enforcement"))
    else:
        fixes.append("add cgroup to --memory-enforcement")
    fixes.append("place sm-sharing containers of equal caps together on a GPU")
    report = _report_only_policy(config)
    stops = " (a watchdog with --watchdog-policy=report stops nothing)" if report else ""
    if running:
        watched = ", their use over its cap only reported (LimitViolation events)" if report else ""
        now = (f"; {UNTIL_RESTART} this container runs without its own cap, its processes "
               f"left running{watched}, and {THEN_FAILS}")
    else:
        now = " (the container would run without its own cap)"
    return ("cannot cap this container's GPU memory: the MPS daemon holds one default pinned "
            f"device memory limit per GPU, and GPU {gpu}'s is {limit} MiB, the largest cap of "
            f"the sm-sharing containers on it; this container's cap of {c.plan.limit_mib} MiB "
            "would rest on its own environment (CUDA_MPS_PINNED_DEVICE_MEM_LIMIT), which its "
            f"processes can change, and no other enabled tier caps it{stops}{now}; "
            f"{', or '.join(fixes)}")


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
                   f"MPS namespace {name} ({key}) is held by another container on this node, "
                   "placed first: two pods name the same namespace, a name copied from one pod "
                   "to another of the same Kubernetes namespace (the admission webhook names a "
                   "fresh one per pod, tagged with its Kubernetes namespace); recreate this "
                   "pod without the annotation so the webhook names one of its own, and find "
                   "who copied it (the node agent's log names the holder)")


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
