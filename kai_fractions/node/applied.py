"""The plan a running container was started with, read back from durable facts (pure).

A container's applied plan is what the agent wrote when it applied it: the derived annotations
(`kai-fractions.io/container.<c>.*`, which only the agent and the mirror may write; the
container's env reads them) plus the binder-owned `.gpus.devices` (only the binder writes it).
It counts as applied only when the node's own readiness marker (written by the agent alone,
on the host) names the same plan digest, as `applied`, or as `refused` by a node rule while it
ran (the marker may also be one the agent set aside: an earlier boot's, or one a pass could not
keep): the plan is rebuilt from those annotations and its digest must equal both the
`plan-digest` annotation and the marker's. A
tenant cannot forge that: it would need a plan whose SHA-256 equals the one the agent wrote.

So the applied plan survives an agent restart, and edits of the user-owned keys of a running
pod (`.gpu-memory.limit`, `.gpu-memory.request`, `.gpu-compute.mode`, the legacy keys) never
change what is enforced: `plan_node` keeps the applied plan and refuses the new one
(`PlanChangeRefused`) until the pod is recreated.
"""

from __future__ import annotations

from ..contract import (
    MAX_PIPE_DIRECTORY,
    ComputeMode,
    ContainerPlan,
    Keys,
    PodView,
    is_mps_namespace_name,
    mps_namespace_name,
)
from ..contract import keys as k
from ..marker import Marker, MarkerState

MAX_DEVICES_VALUE = 64 * 128
"""At most 64 GPUs (the contract's bound), each item well under 128 characters."""
_MAX_DIGITS = 12


def _number(value: str | None) -> int | None:
    if value is None or not value.isascii() or not value.isdigit() \
            or len(value) > _MAX_DIGITS:
        return None
    return int(value)


def recorded_plan(view: PodView, container: str, keys: Keys) -> ContainerPlan | None:
    """The plan the derived annotations of `container` describe, when they are complete and
    their `plan-digest` matches what they describe; None otherwise."""
    notes = view.annotations
    digest = notes.get(keys.derived(container, k.DERIVED_PLAN_DIGEST))
    devices = notes.get(keys.container(container, k.DEVICES))
    request = _number(notes.get(keys.derived(container, k.DERIVED_MEMORY_REQUEST_MIB)))
    limit = _number(notes.get(keys.derived(container, k.DERIVED_MEMORY_LIMIT_MIB)))
    if not digest or not devices or len(devices) > MAX_DEVICES_VALUE or request is None \
            or limit is None or not view.uid:
        return None
    items = tuple(item.strip() for item in devices.split(","))
    atp_value = notes.get(keys.derived(container, k.DERIVED_ACTIVE_THREAD_PERCENTAGE))
    pipe = notes.get(keys.derived(container, k.DERIVED_PIPE_DIRECTORY))
    atp = namespace = None
    mode = ComputeMode.TIME_SLICING
    if atp_value is not None or pipe is not None:
        atp = _number(atp_value)
        if atp is None or not 1 <= atp <= 100 or not pipe \
                or len(pipe.encode()) > MAX_PIPE_DIRECTORY:
            return None
        mode = ComputeMode.SM_SHARING
        namespace = admitted_namespace(view, container, keys) or mps_namespace_name(
            view.uid, container)
    plan = ContainerPlan(
        pod_identity=view.uid, container=container, devices_value=devices,
        device_uuids=tuple(i.removeprefix(k.CDI_DEVICE_PREFIX) for i in items),
        compute_mode=mode, request_mib=request, limit_mib=limit,
        active_thread_percentage=atp, mps_namespace=namespace,
        mps_pipe_directory=pipe if mode is ComputeMode.SM_SHARING else None)
    return plan if plan.digest == digest else None


def admitted_namespace(view: PodView, container: str, keys: Keys) -> str | None:
    """The MPS namespace the admission webhook named for `container`, when well-formed (the
    plan digest then decides whether it is the one applied)."""
    name = view.annotations.get(keys.derived(container, k.ADMITTED_MPS_NAMESPACE))
    return name if name is not None and is_mps_namespace_name(name) else None


def has_recorded_plans(view: PodView, keys: Keys) -> bool:
    """Whether any container of the pod carries a plan digest (only then is its marker read)."""
    prefix = keys.project_prefix
    return any(key.startswith(prefix) and key.endswith(k.DERIVED_PLAN_DIGEST)
               for key in view.annotations)


def applied_plans(view: PodView, marker: Marker | None, keys: Keys) -> dict[str, ContainerPlan]:
    """Container name -> the plan it is held to, for each container the marker says is applied,
    or refused while it ran (a node rule refusing its applied plan keeps that plan's digest in
    the refused entry), and whose derived annotations rebuild a plan with exactly that
    digest."""
    if marker is None or marker.pod_uid != view.uid:
        return {}
    out = {}
    for name, entry in marker.containers.items():
        if entry.state not in (MarkerState.APPLIED, MarkerState.REFUSED) or not entry.plan_digest:
            continue
        plan = recorded_plan(view, name, keys)
        if plan is not None and plan.digest == entry.plan_digest:
            out[name] = plan
    return out


def summary(plan: ContainerPlan) -> str:
    """`memory request 10240 MiB, limit 20480 MiB, time-slicing on GPU-...`."""
    compute = plan.compute_mode.value
    if plan.active_thread_percentage is not None:
        compute += f" at {plan.active_thread_percentage}% of the SMs"
    return (f"memory request {plan.request_mib} MiB, limit {plan.limit_mib} MiB, {compute} on "
            f"{', '.join(plan.device_uuids)}")


def differences(old: ContainerPlan, new: ContainerPlan) -> list[str]:
    """What changed between two plans of one container, in words."""
    out = []
    if old.devices_value != new.devices_value:
        out.append(f"devices {old.devices_value} -> {new.devices_value}")
    if old.request_mib != new.request_mib:
        out.append(f"memory request {old.request_mib} MiB -> {new.request_mib} MiB")
    if old.limit_mib != new.limit_mib:
        out.append(f"memory limit {old.limit_mib} MiB -> {new.limit_mib} MiB")
    if old.compute_mode is not new.compute_mode:
        out.append(f"compute mode {old.compute_mode.value} -> {new.compute_mode.value}")
    elif old.active_thread_percentage != new.active_thread_percentage:
        out.append(f"share of the SMs {old.active_thread_percentage}% -> "
                   f"{new.active_thread_percentage}%")
    if not out:
        out.append("MPS pipe directory "
                   f"{old.mps_pipe_directory} -> {new.mps_pipe_directory}")
    return out


def change_refused(old: ContainerPlan, why: str) -> str:
    """The message of a `PlanChangeRefused`: why the new plan is refused, and that the applied
    plan stays."""
    return (f"{why}: the change is refused and the applied plan ({summary(old)}) stays in "
            "force until the pod is recreated (delete it to have it planned again)")


def edited(old: ContainerPlan, new: ContainerPlan) -> str:
    return ("the pod's GPU annotations changed after this container's limits were applied ("
            + "; ".join(differences(old, new)) + ")")


def refused_now(reason: str, message: str) -> str:
    return f"its plan is refused now ({reason}: {message})"


GONE = "the pod's GPU annotations no longer ask for a GPU share for this container"
