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
Once all are placed, a container whose cap is below its GPU's one MPS default pinned limit
(the largest cap there) loses mps-pinned, which holds it at that larger cap only
(`_one_pinned_limit`).

The types it reads and returns live in `kai_fractions.node.desired_state` (re-exported here), the
checks that refuse a container in `kai_fractions.node.plan_refusals`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping

from ..contract import ComputeMode, ContainerPlan
from . import applied as ap
from .config import Mechanism, NodeConfig
from .desired_state import (
    ComputeEnforcement,
    ContainerDesired,
    ContainerKey,
    DesiredState,
    GpuDesired,
    LimitTarget,
    NodePod,
    Refusal,
    RefusalReason,
)
from .inventory import Inventory
from .nvml import DeviceInfo, GpuComputeMode
from .plan_refusals import (
    _Candidate,
    _cgroup_paths,
    _contract_refusals,
    _device_refusal,
    _mechanisms,
    _mount_refusal,
    _namespace_refusal,
    _pinned_maxima,
    _refuse,
    _report_only,
    _shared_pinned,
    _sharing_refusal,
)

# The types are re-exported: the engine, the node agent and the tests import them from here.
__all__ = [
    "ComputeEnforcement",
    "ContainerDesired",
    "ContainerKey",
    "DesiredState",
    "GpuDesired",
    "LimitTarget",
    "NodePod",
    "Refusal",
    "RefusalReason",
    "plan_node",
]

log = logging.getLogger(__name__)


def _order(pod: NodePod) -> tuple:
    v = pod.view
    return (pod.created == "", pod.created, v.namespace, v.name, v.uid)


def _hold(pod: NodePod, ok: list[_Candidate], refused: list[Refusal],
          applied: Mapping[str, ContainerPlan], changes: dict[ContainerKey, Refusal],
          whole: bool = False) -> tuple[list[_Candidate], list[Refusal]]:
    """The pod's candidates and refusals with every applied plan kept: a container whose new
    plan differs, is refused or is gone keeps its applied plan, and the change is refused.
    `whole`: the refusals are the whole pod's (its annotations cannot be read, or a veto):
    an applied container they do not name is refused for that too; otherwise its share is
    gone, whatever another container of the pod is refused for (not bound yet, say)."""
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
    pod_level = next((r for r in refused if r.key.container not in applied),
                     None) if whole else None
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
        # `whole`: the refusals are the whole pod's (a veto, annotations that are invalid or
        # cannot be read), not one container's (not bound, cannot be planned).
        whole = pod.uid in vetoed
        try:
            ok, refused, whole = (([], vetoed[pod.uid], True) if whole
                                  else _contract_refusals(pod, config))
        except Exception as e:  # one pod's annotations must not stop the node
            log.exception("pod %s/%s: its GPU annotations could not be read",
                          pod.view.namespace, pod.view.name)
            whole = True
            ok, refused = [], [_refuse(pod, "", RefusalReason.CONTRACT_INVALID,
                                       "the pod's GPU annotations could not be read "
                                       f"({type(e).__name__}); fix them and recreate the pod")]
        ok, refused = _hold(pod, ok, refused, held.get(pod.uid, {}), changes, whole)
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

    accepted, pinned = _one_pinned_limit(accepted, applied, changes, requested, members,
                                         refusals, inventory, config)
    refusals += changes.values()
    owned = {*marked, *held, *(c.key.pod_uid for c in accepted),
             *(r.key.pod_uid for r in refusals)}
    return DesiredState(
        gpus=tuple(_gpu(d, modes, requested, members, pinned, config)
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


def _one_pinned_limit(accepted: list[ContainerDesired],
                      applied: Mapping[ContainerKey, ContainerPlan],
                      changes: dict[ContainerKey, Refusal], requested: dict[str, int],
                      members: dict[str, list[ContainerKey]], refusals: list[Refusal],
                      inventory: Inventory, config: NodeConfig
                      ) -> tuple[list[ContainerDesired], dict[str, int]]:
    """Each placed container as its GPUs' one MPS default pinned limit leaves it
    (`_shared_pinned`), and those limits by GPU. Judged once all are placed: a larger cap placed
    later lowers what an earlier one's mps-pinned holds. One refused here leaves its GPUs'
    members and, unless it runs, its requested memory; one that runs keeps that memory, as in
    `plan_node`, and a report-mode watchdog's attention (`Refusal.watched`)."""
    pinned = _pinned_maxima(accepted)
    kept = []
    for c in accepted:
        held = applied.get(c.key)
        running = held is not None and held.digest == c.plan.digest
        judged = _shared_pinned(c, pinned, inventory, config, running)
        if isinstance(judged, ContainerDesired):
            kept.append(judged)
            continue
        changes.pop(c.key, None)  # an applied plan that cannot be kept: this says why
        for uuid in c.plan.device_uuids:
            members[uuid].remove(c.key)
            if not running:
                requested[uuid] -= c.plan.request_bytes
        if running:
            judged = dataclasses.replace(judged, plan_digest=c.plan.digest)
            if _report_only(judged, config):
                judged = dataclasses.replace(judged, watched=dataclasses.replace(
                    c, mechanisms=frozenset({Mechanism.WATCHDOG}), mps_namespace=None))
        refusals.append(judged)
    return kept, pinned


def _gpu(device: DeviceInfo, modes: Mapping[str, tuple[ComputeMode, str]],
         requested: Mapping[str, int], members: Mapping[str, list[ContainerKey]],
         pinned: Mapping[str, int], config: NodeConfig) -> GpuDesired:
    mode: GpuComputeMode | None = None
    held = modes.get(device.uuid)
    # Without sm-sharing the agent never touches compute modes: nothing on the node needs MPS.
    if held is not None and config.sm_sharing:
        mode = (GpuComputeMode.EXCLUSIVE_PROCESS if held[0] is ComputeMode.SM_SHARING
                else GpuComputeMode.DEFAULT)
    return GpuDesired(uuid=device.uuid, index=device.index, compute_mode=mode,
                      containers=tuple(members.get(device.uuid, ())),
                      requested_bytes=requested.get(device.uuid, 0),
                      mps_pinned_mib=pinned.get(device.uuid))


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
