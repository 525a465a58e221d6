"""The per-GPU report of a node (or one pod): pure, from the pods, the node and the agent's word.

Every number comes from the pods' annotations through the contract package (the same plan the
node agent applies: request, limit, compute mode, active-thread percentage, devices), except for
a container the agent reports applied: its numbers are the agent's plan, what is in force (a
running pod's edited annotations change nothing, even invalid ones; the agent's
`PlanChangeRefused`, or else the contract error, is a warning of the row). The state of each
container comes from, in this order:

0. the annotations' contract errors -> invalid, unless the node agent reports it applied;
1. the node agent's refusal, when it answered (the cause, with its reason: its socket, or its
   metrics' `kai_fractions_container_refused`); when it was not read, the pod's newest agent
   event about the container (`agent_events`) saying Refused;
2. a gate that exited non-zero: refused with its termination message (the workload did not
   start, whatever the agent says now);
3. the node agent's `applied` -> enforced, `pending` with its reason; off the node, its metrics
   saying a cap of the container is not in force -> pending with that reason (its marker is set
   aside: a gate that released before says nothing of what is in force now); when the agent
   was not read, its newest event saying pending (a cap not in force, a signature awaited),
   unless the gate released after it;
4. the gate init container's other states: exited 0 -> enforced (confirmed when the agent's
   newest event is Applied, else the gate's word alone: `enforced (gate)`), running -> waiting,
   stuck before it runs (an image it cannot pull, ...) -> waiting with the kubelet's reason;
5. otherwise what the pod says: not bound yet -> unscheduled; bound without a gate -> ungated
   (the admission webhook did not wire it: its limits are not guaranteed before it starts).
An enforced row has no reason, whatever said so; `Row.state_source` names who did.
Used memory comes from the agent only; when it is not reachable the report says why, and where
the agent cannot read a container's usage on a GPU (its watchdog is blind there) its row's
used memory is not known either (a `UsageUnknown` warning says why).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..admission.config import GATE_CONTAINER
from ..contract import (
    MIB,
    ContainerShare,
    ContractViolation,
    Keys,
    ManifestError,
    format_plain,
    parse_pod,
    plan_container,
    pod_identity,
    view_from_pod_spec,
)
from ..contract import keys as k
from ..kube.objects import epoch_seconds
from .agent_events import UNPLANNED_REASONS, AgentEvent, agent_events, newest
from .agent_metrics import WATCHDOG_BLIND
from .agent_state import AgentAllocation, AgentState
from .heartbeat import SILENT_AFTER_SECONDS, Heartbeat, heartbeat

ENFORCED = "enforced"
REFUSED = "refused"
PENDING = "pending"
WAITING = "waiting"
UNSCHEDULED = "unscheduled"
UNGATED = "ungated"
INVALID = "invalid"

_AGENT_STATES = {"applied": ENFORCED, "refused": REFUSED, "pending": PENDING}

FROM_AGENT, FROM_METRICS, FROM_EVENTS, FROM_GATE, FROM_POD = (
    "agent", "metrics", "events", "gate", "pod")
"""Who said a row's state (`Row.state_source`): the agent's socket, its metrics, its events on
the pod, the gate init container's status alone, or the pod itself (its annotations, its
binding, no gate)."""

TIERS = ("cgroup", "mps-pinned", "watchdog")
"""How a memory cap is in force, strongest first: the driver refuses an allocation over it, the
MPS client refuses it, or usage is polled and reported (or stopped) afterwards."""
NO_TIER = "none"
"""The agent has no memory cap in force for an enforced or refused container."""
UNKNOWN_TIER = "n/a"
"""Enforced, but the agent's socket was not read: which tier holds it is not known."""


@dataclass(frozen=True, slots=True)
class Row:
    """One fractional container on one GPU."""

    namespace: str
    pod: str
    container: str
    gpu_uuid: str
    """"" when no GPU is assigned yet."""
    mode: str
    request_bytes: int | None
    limit_bytes: int | None
    active_thread_percentage: int | None
    devices: tuple[str, ...]
    state: str
    reason: str = ""
    message: str = ""
    used_bytes: int | None = None
    portion: str = ""
    """The fraction of a GPU asked for (`gpu-fraction`), when no memory is planned yet."""
    device_count: int = 1
    mps_namespace: str = ""
    """An sm-sharing container's MPS namespace (what `nvidia-cuda-mps-control` lists), once
    planned."""
    warnings: tuple[str, ...] = ()
    """What is wrong even when enforced (a refused plan change: the annotations are not what is
    in force; memory used over the limit), one `!` line each."""
    accounted: bool = True
    """Whether the node agent counts its request in the GPU's memory (not when refused,
    invalid, or held back before planning, e.g. waiting for its signature)."""
    tier: str = "-"
    """The strongest tier holding the memory cap on this GPU (TIERS), NO_TIER, UNKNOWN_TIER;
    `-` on no GPU, or when neither enforced nor refused (no cap is meant to hold yet)."""
    state_source: str = FROM_POD
    """Who said `state` (FROM_AGENT, FROM_METRICS, FROM_EVENTS, FROM_GATE, FROM_POD)."""

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.pod}/{self.container}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "namespace": self.namespace, "pod": self.pod, "container": self.container,
            "gpu_uuid": self.gpu_uuid, "mode": self.mode,
            "request_bytes": self.request_bytes, "limit_bytes": self.limit_bytes,
            "active_thread_percentage": self.active_thread_percentage,
            "devices": list(self.devices), "state": self.state, "reason": self.reason,
            "message": self.message, "used_bytes": self.used_bytes, "portion": self.portion,
            "device_count": self.device_count, "mps_namespace": self.mps_namespace,
            "warnings": list(self.warnings), "tier": self.tier, "accounted": self.accounted,
            "state_source": self.state_source,
        }


@dataclass(frozen=True, slots=True)
class Gpu:
    uuid: str
    index: int | None = None
    name: str = ""
    memory_bytes: int | None = None
    rows: tuple[Row, ...] = ()

    @property
    def modes(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(r.mode for r in self.rows))

    @property
    def requested_bytes(self) -> int:
        """What the node agent accounts on this GPU: its plans, not refused or invalid ones."""
        return sum(r.request_bytes or 0 for r in self.rows if r.accounted)

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "uuid": self.uuid, "name": self.name,
                "memory_bytes": self.memory_bytes, "modes": list(self.modes),
                "requested_bytes": self.requested_bytes,
                "allocations": [r.to_dict() for r in self.rows]}


@dataclass(frozen=True, slots=True)
class Report:
    title: str
    """`node demo-node` or `pod default/memory-request`."""
    node: str = ""
    gpu_memory_label: str | None = None
    """The node's `nvidia.com/gpu.memory` label verbatim (None: missing or no node)."""
    condition: tuple[str, str, str, str] | None = None
    """(type, status, reason, message) of the agent's node condition on the Node object."""
    gpus: tuple[Gpu, ...] = ()
    unplaced: tuple[Row, ...] = ()
    """Fractional containers with no GPU yet (not scheduled, or invalid)."""
    agent: AgentState | None = None
    heartbeat: Heartbeat | None = None
    notes: tuple[str, ...] = ()
    """Problems worth a line of their own (missing label, condition False, ...)."""

    @property
    def rows(self) -> tuple[Row, ...]:
        return tuple(r for g in self.gpus for r in g.rows) + self.unplaced

    def to_dict(self) -> dict[str, Any]:
        agent = self.agent
        return {
            "title": self.title,
            "node": self.node,
            "gpu_memory_label": self.gpu_memory_label,
            "condition": None if self.condition is None else dict(zip(
                ("type", "status", "reason", "message"), self.condition, strict=True)),
            "heartbeat": None if self.heartbeat is None else self.heartbeat.to_dict(),
            "agent": None if agent is None else {
                "source": agent.source, "reachable": agent.reachable, "error": agent.error,
                "driver_version": agent.driver_version},
            "gpus": [g.to_dict() for g in self.gpus],
            "unplaced": [r.to_dict() for r in self.unplaced],
            "notes": list(self.notes),
        }


# -- the pod side -----------------------------------------------------------------------------


def _statuses(pod: Mapping[str, Any], field_name: str) -> dict[str, Mapping[str, Any]]:
    status = pod.get("status") or {}
    return {str(s.get("name")): s for s in status.get(field_name) or []
            if isinstance(s, Mapping)}


STUCK = frozenset({"ErrImagePull", "ImagePullBackOff", "CreateContainerConfigError",
                   "CreateContainerError", "InvalidImageName", "RunContainerError"})
"""The kubelet's reasons for a container it cannot start: the gate never gets to wait for
the agent, and this is what to fix."""


def _gate_status(pod: Mapping[str, Any]) -> Mapping[str, Any] | None:
    return _statuses(pod, "initContainerStatuses").get(GATE_CONTAINER)


def gate_released_at(pod: Mapping[str, Any]) -> float | None:
    """When the gate exited 0 (its current state), in seconds since the epoch; else None."""
    terminated = ((_gate_status(pod) or {}).get("state") or {}).get("terminated") or {}
    if not terminated or int(terminated.get("exitCode") or 0) != 0:
        return None
    return epoch_seconds(terminated.get("finishedAt"))


def gate_state(pod: Mapping[str, Any]) -> tuple[str, str, str] | None:
    """(state, reason, message) from the gate init container's status; None when the pod has
    no gate status yet (or no gate at all)."""
    status = _gate_status(pod)
    if status is None:
        return None
    st = status.get("state") or {}
    waiting = st.get("waiting") or {}
    if waiting.get("reason") in STUCK:
        return WAITING, str(waiting["reason"]), " ".join(
            str(waiting.get("message") or "the kubelet cannot start the gate container").split())
    # The current state decides: a gate that runs again (a node reboot, a new sandbox) waits
    # again, whatever its last run said; lastState only tells why it is being retried.
    if "running" in st:
        return WAITING, "GateWaiting", "the gate waits for the node agent to apply the limits"
    terminated = st.get("terminated") or (
        (status.get("lastState") or {}).get("terminated") if "waiting" in st or not st else None)
    if terminated:
        message = " ".join(str(terminated.get("message") or "").split())
        if int(terminated.get("exitCode") or 0) == 0 and "terminated" in st:
            return ENFORCED, "", message
        if int(terminated.get("exitCode") or 0) == 0:
            return WAITING, "GateWaiting", "the gate is about to run again (it released the " \
                "pod before; a new sandbox runs it anew)"
        return REFUSED, "GateFailed", message or str(terminated.get("reason") or "")
    return None


def _has_gate(pod: Mapping[str, Any]) -> bool:
    spec = pod.get("spec") or {}
    return any(isinstance(c, Mapping) and c.get("name") == GATE_CONTAINER
               for c in spec.get("initContainers") or [])


@dataclass(frozen=True, slots=True)
class _Planned:
    container: str
    mode: str
    request_bytes: int | None
    limit_bytes: int | None
    atp: int | None
    devices: tuple[str, ...]
    mps_namespace: str = ""
    portion: str = ""
    """The `gpu-fraction` asked for, as written."""
    num_devices: int = 1


def _plan(share: ContainerShare, identity: str, keys: Keys) -> _Planned:
    portion = format_plain(share.fraction) if share.fraction else ""
    try:
        plan = plan_container(share, identity, keys=keys)
    except ContractViolation:
        # Not bound yet (or the binder's keys are missing): show what the user asked for.
        return _Planned(share.container, share.compute_mode.value, share.node_request_bytes,
                        share.node_limit_bytes, None, share.device_uuids, portion=portion,
                        num_devices=share.num_devices)
    return _Planned(share.container, plan.compute_mode.value, plan.request_bytes,
                    plan.limit_bytes, plan.active_thread_percentage, plan.device_uuids,
                    plan.mps_namespace or "", portion, share.num_devices)


def _in_force(planned: _Planned, found: AgentAllocation | None) -> _Planned:
    """The agent's plan of a container it reports applied: what is in force, which differs
    from the annotations when it refused their new plan (`PlanChangeRefused`)."""
    if found is None or found.state != "applied" or found.plan is None:
        return planned
    p = found.plan
    return _Planned(planned.container, p.mode or planned.mode, p.request_bytes,
                    p.limit_bytes, p.active_thread_percentage, p.devices, p.mps_namespace,
                    planned.portion, planned.num_devices)


def _tier(state: str, uuid: str, found: AgentAllocation | None, agent: AgentState | None) -> str:
    """Which tier holds the cap on GPU `uuid`, as the agent's applied limits say; `-` when no
    cap is meant to be in force yet (pending, waiting, ungated, invalid, no GPU)."""
    if not uuid or state not in (ENFORCED, REFUSED):
        return "-"
    if agent is not None and agent.knows_limits:
        held = found.mechanisms.get(uuid, frozenset()) if found is not None else frozenset()
        return next((t for t in TIERS if t in held), NO_TIER)
    return NO_TIER if state == REFUSED else UNKNOWN_TIER


_OVER = {
    "watchdog": ": only the watchdog holds this cap, which never stops an allocation (it records "
                "LimitViolation events, and stops the processes only with --watchdog-policy "
                "kill)",
    NO_TIER: ": the node agent has no memory cap in force for it",
    UNKNOWN_TIER: " (which tier holds the cap is not known: give --agent-socket on the node)",
}


def _over_limit(used: int | None, limit: int | None, uuid: str, tier: str) -> tuple[str, ...]:
    """A warning when the container uses more memory on `uuid` than its limit."""
    if used is None or limit is None or used <= limit:
        return ()
    return (f"OverLimit: uses {-(-used // MIB)} MiB on {uuid}, above its limit of "
            f"{-(-limit // MIB)} MiB{_OVER.get(tier, '')}",)


def _unknown(found: AgentAllocation | None, uuid: str, reason: str) -> tuple[str, ...]:
    """A note when the agent cannot read the container's usage on GPU `uuid` (its USED is not
    0 but unknown); none on a row pending WatchdogBlind, whose message says it."""
    why = found.usage_unknown.get(uuid) if found is not None and uuid else None
    if why is None or reason == WATCHDOG_BLIND:
        return ()
    return (f"UsageUnknown: the node agent cannot read its GPU memory use on {uuid} ({why}), "
            "so USED is not known: its watchdog sees no usage there (the agent's log says why; "
            "docs/node-agent.md, \"What the watchdog sees and stops\")",)


def _warnings(found: AgentAllocation | None, contract: str) -> tuple[str, ...]:
    """The agent's refusal of a plan change; else the contract error of annotations edited on
    a container it applied (`contract`), which its plan outlives."""
    if found is not None and found.change_reason:
        return (f"{found.change_reason}: {found.change_message}",)
    return (f"ContractInvalid: {contract}",) if contract else ()


def _accounted(state: str, found: AgentAllocation | None, said: AgentEvent | None) -> bool:
    """As the agent accounts a GPU's memory: plans it holds, never a refused or invalid one,
    nor one it reports pending without a plan (held back before planning: a signature it
    waits for, as its socket or its event says)."""
    if state in (REFUSED, INVALID):
        return False
    if state == PENDING and said is not None and said.reason in UNPLANNED_REASONS:
        return False
    return not (found is not None and found.state == "pending" and found.plan is None)


def _rows(view: Any, planned: _Planned, status: tuple[str, str, str, str],
          found: AgentAllocation | None, agent: AgentState | None,
          said: AgentEvent | None = None, contract: str = "") -> list[Row]:
    """The rows of one container: one per GPU of its plan, or one without a GPU."""
    state, reason, message, source = status
    out = []
    for uuid in planned.devices or ("",):
        used = found.used_on(uuid, len(planned.devices)) if found is not None else None
        tier = _tier(state, uuid, found, agent)
        out.append(Row(view.namespace, view.name, planned.container, uuid, planned.mode,
                       planned.request_bytes, planned.limit_bytes, planned.atp,
                       planned.devices, state, "" if state == ENFORCED else reason, message,
                       used, portion=planned.portion,
                       device_count=max(len(planned.devices), planned.num_devices),
                       mps_namespace=planned.mps_namespace, tier=tier, state_source=source,
                       accounted=_accounted(state, found, said),
                       warnings=_warnings(found, contract) + _over_limit(
                           used, planned.limit_bytes, uuid, tier)
                       + _unknown(found, uuid, "" if state == ENFORCED else reason)))
    return out


def _found(view: Any, container: str, agent: AgentState | None) -> AgentAllocation | None:
    if agent is None or not agent.reachable:
        return None
    return agent.allocation(view.namespace, view.name, container, view.uid)


def _applied(found: AgentAllocation | None) -> bool:
    return found is not None and found.state == "applied"


def _errors(request: Any, container: str | None = None) -> str:
    """The contract errors of the pod, or those of `container` (and the pod's own)."""
    return "; ".join(str(e) for e in request.errors
                     if container is None or e.container in (container, None, ""))


def _said(pod: Mapping[str, Any], container: str, events: tuple[AgentEvent, ...] | None,
          agent: AgentState | None) -> AgentEvent | None:
    """The agent's newest event about the container, when the agent itself was not read; a
    pending or refused one the gate released after is over (its Applied may have been lost)."""
    if events is None or (agent is not None and agent.reachable):
        return None
    said = newest(events, container)
    released = gate_released_at(pod)
    if said is None or (said.state != "applied" and released is not None
                        and released > said.at):
        return None
    return said


def _container_rows(pod: Mapping[str, Any], view: Any, request: Any, planned: _Planned,
                    gate: tuple[str, str, str] | None, agent: AgentState | None,
                    events: tuple[AgentEvent, ...] | None) -> list[Row]:
    """One container's rows: its state, and the agent's plan once it is in force (whatever
    its annotations say now, even invalid: the contract error is then a warning)."""
    said = _said(pod, planned.container, events, agent)
    status = _state(pod, view.node_name, planned.container, gate, agent,
                    bool(request.errors), request, said)
    found = _found(view, planned.container, agent)
    contract = ""
    if status[0] == ENFORCED:
        planned = _in_force(planned, found)
        contract = _errors(request, planned.container) if request.errors else ""
    return _rows(view, planned, status, found, agent, said, contract)


def _unparsed(view: Any, request: Any, agent: AgentState | None) -> list[str]:
    """Containers whose annotations no longer make a share (an edit broke them) but that the
    agent reports applied: its plan holds them still."""
    shared = {s.container for s in request.shares}
    names = dict.fromkeys(e.container for e in request.errors
                          if e.container and e.container not in shared)
    return [c for c in names if _applied(_found(view, c, agent))]


def pod_rows(pod: Mapping[str, Any], agent: AgentState | None, keys: Keys,
             events: Iterable[Mapping[str, Any]] | None = None) -> list[Row]:
    """One row per fractional container and GPU (one row without a GPU when none is assigned).
    `events`: the pod's Events, read when the agent was not (None: not read)."""
    metadata = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    try:
        view = view_from_pod_spec(metadata, spec)
    except ManifestError as e:
        return [Row(str(metadata.get("namespace") or ""), str(metadata.get("name") or ""), "",
                    "", "", None, None, None, (), INVALID, "ManifestError", str(e),
                    accounted=False)]
    request = parse_pod(view, keys)
    gate = gate_state(pod)
    said = None if events is None else agent_events(events, view.uid)
    rows: list[Row] = []
    for share in request.shares:
        rows += _container_rows(pod, view, request, _plan(share, pod_identity(request), keys),
                                gate, agent, said)
    unparsed = _unparsed(view, request, agent) if view.node_name else []
    for container in unparsed:
        rows += _container_rows(pod, view, request, _Planned(container, "", None, None, None,
                                                             ()), gate, agent, said)
    if not request.shares:
        # Not planned, so not accounted anywhere: the agent counts no request of it.
        rows += [Row(view.namespace, view.name, e.container or "", "", "", None, None, None,
                     (), INVALID, "ContractInvalid", str(e), accounted=False)
                 for e in request.errors if e.container not in unparsed][:1]
    return rows


def _state(pod: Mapping[str, Any], node: str, container: str, gate: tuple[str, str, str] | None,
           agent: AgentState | None, invalid: bool, request: Any, said: AgentEvent | None
           ) -> tuple[str, str, str, str]:
    """(state, reason, message, state_source) of one container, in the module's order."""
    found = None
    if agent is not None and agent.reachable and node:
        meta = pod.get("metadata") or {}
        found = agent.allocation(str(meta.get("namespace") or "default"),
                                 str(meta.get("name") or ""), container,
                                 str(meta.get("uid") or ""))
    by = FROM_AGENT if agent is not None and agent.knows_limits else FROM_METRICS
    if invalid and not _applied(found):
        # Annotations edited invalid on an applied container change nothing: its plan holds.
        return INVALID, "ContractInvalid", _errors(request), FROM_POD
    if found is not None and found.state == "refused":
        return REFUSED, found.reason, found.message, by  # the cause, not only the gate's echo
    if said is not None and said.state == "refused":
        return REFUSED, said.reason, said.message, FROM_EVENTS
    if gate is not None and gate[0] == REFUSED:
        return (*gate, FROM_GATE)
    if found is not None and found.state in _AGENT_STATES:
        return _AGENT_STATES[found.state], found.reason, found.message, by
    if found is not None and found.cap_not_in_force:
        return PENDING, found.reason, found.message, FROM_METRICS
    if said is not None and said.state == "pending":
        return PENDING, said.reason, said.message, FROM_EVENTS
    if gate is not None:
        if gate[0] == ENFORCED and said is not None:  # an Applied newer than any set-aside
            return ENFORCED, "", said.message, FROM_EVENTS
        return (*gate, FROM_GATE)
    if not node:
        return (*_unscheduled(pod), FROM_POD)
    if not _has_gate(pod):
        return UNGATED, "NoGate", ("the pod has no kai-fractions-gate init container: the "
                                   "admission webhook did not wire it, so nothing holds it "
                                   "back until its limits are in force"), FROM_POD
    return PENDING, "", "waiting for the node agent", FROM_POD


def _unscheduled(pod: Mapping[str, Any]) -> tuple[str, str, str]:
    for c in (pod.get("status") or {}).get("conditions") or []:
        if isinstance(c, Mapping) and c.get("type") == "PodScheduled" and c.get(
                "status") == "False":
            return UNSCHEDULED, str(c.get("reason") or "Unschedulable"), str(
                c.get("message") or "")
    return UNSCHEDULED, "NotBound", "not bound to a node yet"


# -- assembling ---------------------------------------------------------------------------------


def _condition(node: Mapping[str, Any] | None, condition_type: str
               ) -> tuple[str, str, str, str] | None:
    if not node:
        return None
    for c in (node.get("status") or {}).get("conditions") or []:
        if isinstance(c, Mapping) and c.get("type") == condition_type:
            return (condition_type, str(c.get("status") or "Unknown"),
                    str(c.get("reason") or ""), str(c.get("message") or ""))
    return None


def _said_of(condition: tuple[str, str, str, str]) -> str:
    """`TYPE is STATUS: REASON: MESSAGE`, without the parts it lacks."""
    return ": ".join([f"{condition[0]} is {condition[1]}", *filter(None, condition[2:])])


GATE_ONLY = (
    "enforced (gate): only the gate's exit says so; the node agent's own view was not read and "
    "may be newer (a limit it set aside since: give --agent-socket on the node, or "
    "--agent-metrics)")


def _notes(node_name: str, node: Mapping[str, Any] | None, label: str | None,
           condition: tuple[str, str, str, str] | None, condition_type: str,
           agent: AgentState | None, beat: Heartbeat | None, node_error: str = "") -> list[str]:
    notes = []
    if node_name and node_error:
        notes.append(f"node {node_name} not readable: {node_error}")
    elif node_name and node is None:
        notes.append(f"node {node_name} was not found")
    elif node is not None:
        if label is None:
            notes.append(f"node {node_name} has no {k.NODE_GPU_MEMORY_LABEL} label: the "
                         "mirror and KAI's binder cannot turn portions into memory for it "
                         "(GPU feature discovery publishes it; the node agent does with "
                         "--publish-gpu-memory-label)")
        if condition is None:
            notes.append(f"node {node_name} has no {condition_type} condition: no node agent "
                         "has reported from it")
        elif condition[1] != "True":
            notes.append(_said_of(condition))
        elif beat is not None and (beat.seconds_ago or 0) > SILENT_AFTER_SECONDS:
            notes.append(f"the node agent last said it is alive {beat.seconds_ago:.0f} s ago "
                         f"({beat.source}): the mirror's follower sets {condition_type} "
                         "Unknown at KAI's next bind here (mirror.markSilentNodesAfterSeconds, "
                         f"{SILENT_AFTER_SECONDS} s by default)")
        if beat is not None and beat.error:
            notes.append(f"heartbeat Lease not read ({beat.error}): the condition's "
                         "lastHeartbeatTime alone is shown")
    if agent is not None and not agent.reachable:
        notes.append(f"used: n/a (agent not reachable: {agent.error})")
    if agent is not None:
        notes += agent.notes
    return notes


def _gpus(rows: Sequence[Row], agent: AgentState | None, label: str | None) -> tuple[Gpu, ...]:
    devices = {d.uuid: d for d in agent.devices} if agent is not None else {}
    label_bytes = int(label) * MIB if label is not None and label.isdigit() else None
    order: list[str] = [d.uuid for d in sorted(devices.values(), key=lambda d: d.index)]
    for r in rows:
        if r.gpu_uuid and r.gpu_uuid not in order:
            order.append(r.gpu_uuid)
    out = []
    for uuid in order:
        d = devices.get(uuid)
        mine = tuple(sorted((r for r in rows if r.gpu_uuid == uuid),
                            key=lambda r: (r.namespace, r.pod, r.container)))
        out.append(Gpu(uuid=uuid, index=d.index if d else None, name=d.name if d else "",
                       memory_bytes=d.memory_total_bytes if d else label_bytes, rows=mine))
    return tuple(out)


def finished(pod: Mapping[str, Any]) -> str:
    """The phase of a pod that has finished (Succeeded, Failed), else "": the agent drops such
    pods (their containers are gone), so they hold no GPU memory."""
    phase = str((pod.get("status") or {}).get("phase") or "")
    return phase if phase in ("Succeeded", "Failed") else ""


def node_report(node_name: str, node: Mapping[str, Any] | None,
                pods: Iterable[Mapping[str, Any]], agent: AgentState | None, *,
                keys: Keys = k.DEFAULT_KEYS, condition_type: str = k.NODE_CONDITION,
                title: str | None = None, all_gpus: bool = True,
                beat: Heartbeat | None = None, events: Sequence[Mapping[str, Any]] | None = None,
                node_error: str = "", notes: Sequence[str] = ()) -> Report:
    """Every GPU of the node (the agent's devices, else those the pods name) and its
    allocations; pods bound elsewhere and finished pods are ignored, unbound ones listed as
    unplaced. `events`: the pods' Events (`pod_rows`); `node_error`: why `node` is None other
    than not found; `notes`: the caller's own."""
    rows: list[Row] = []
    unplaced: list[Row] = []
    for pod in (p for p in pods if not finished(p)):
        for row in pod_rows(pod, agent, keys, events):
            (rows if row.gpu_uuid else unplaced).append(row)
    labels = ((node or {}).get("metadata") or {}).get("labels") or {}
    label = labels.get(k.NODE_GPU_MEMORY_LABEL) if node is not None else None
    condition = _condition(node, condition_type)
    gpus = _gpus(rows, agent, label)
    if not all_gpus:
        gpus = tuple(g for g in gpus if g.rows)
    return Report(
        title=title or f"node {node_name}", node=node_name,
        gpu_memory_label=None if label is None else str(label), condition=condition,
        gpus=gpus, unplaced=tuple(sorted(unplaced, key=lambda r: (r.namespace, r.pod))),
        agent=agent, heartbeat=beat,
        notes=(*_notes(node_name, node, None if label is None else str(label), condition,
                       condition_type, agent, beat, node_error), *notes,
               *_gate_only(rows + unplaced, agent)),
    )


def _gate_only(rows: Sequence[Row], agent: AgentState | None) -> tuple[str, ...]:
    """GATE_ONLY when a row is enforced on the gate's word alone, the agent not read."""
    unread = agent is None or not agent.reachable
    return (GATE_ONLY,) if unread and any(
        r.state == ENFORCED and r.state_source == FROM_GATE for r in rows) else ()


def pod_report(pod: Mapping[str, Any], node: Mapping[str, Any] | None,
               agent: AgentState | None, *, keys: Keys = k.DEFAULT_KEYS,
               condition_type: str = k.NODE_CONDITION, beat: Heartbeat | None = None,
               events: Sequence[Mapping[str, Any]] | None = None, node_error: str = "",
               notes: Sequence[str] = ()) -> Report:
    """The pod's rows, on its node's GPUs; `events`, `node_error`, `notes` as node_report's."""
    meta = pod.get("metadata") or {}
    node_name = str((pod.get("spec") or {}).get("nodeName") or "")
    report = node_report(node_name, node if node_name else None, [pod], agent, keys=keys,
                         condition_type=condition_type, all_gpus=False, beat=beat,
                         events=events, node_error=node_error, notes=notes,
                         title=f"pod {meta.get('namespace') or 'default'}/{meta.get('name')}")
    phase = finished(pod)
    if phase:  # the node's label, condition and heartbeat still tell of the node
        return replace(report, gpus=(), unplaced=(), notes=(
            *report.notes, f"the pod has finished (phase {phase}): it holds no GPU memory "
            "(the node agent drops finished pods)"))
    if not report.rows:
        return replace(report, gpus=(),
                       notes=(*report.notes, "the pod requests no GPU fraction"))
    return report


__all__ = [
    "ENFORCED", "FROM_AGENT", "FROM_EVENTS", "FROM_GATE", "FROM_METRICS", "FROM_POD",
    "INVALID", "NO_TIER", "PENDING", "REFUSED", "TIERS", "UNGATED", "UNKNOWN_TIER",
    "UNSCHEDULED", "WAITING",
    "Gpu", "Heartbeat", "Report", "Row", "gate_released_at", "gate_state", "heartbeat",
    "node_report", "pod_report", "pod_rows",
]
