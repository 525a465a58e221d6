"""One pod's rows: each fractional container's plan, per GPU, its state and who said it.

Apart from the report's assembly (`model`) because deciding a container's state is a concern of
its own; `_state` follows the order below.

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

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

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
from .agent_events import UNPLANNED_REASONS, AgentEvent, agent_events, newest
from .agent_metrics import WATCHDOG_BLIND
from .agent_state import AgentAllocation, AgentState
from .pod_status import _has_gate, _unscheduled, gate_released_at, gate_state
from .report_types import (
    ENFORCED,
    FROM_AGENT,
    FROM_EVENTS,
    FROM_GATE,
    FROM_METRICS,
    FROM_POD,
    INVALID,
    NO_TIER,
    PENDING,
    REFUSED,
    TIERS,
    UNGATED,
    UNKNOWN_TIER,
    Row,
)

_AGENT_STATES = {"applied": ENFORCED, "refused": REFUSED, "pending": PENDING}


# -- the pod side -----------------------------------------------------------------------------


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
