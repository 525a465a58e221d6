"""The per-GPU report of a node (or one pod): pure, from the pods, the node and the agent's word.

This module assembles it: the pods' rows grouped per GPU, the node's label, condition and
heartbeat made notes (`node_report`, `pod_report`). A row and its state come from
`container_rows`, the gate's status from `pod_status`, the records and state names from
`report_types`; every name importers take from here is re-exported.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from ..contract import MIB, Keys
from ..contract import keys as k
from .agent_state import AgentState
from .container_rows import pod_rows
from .heartbeat import SILENT_AFTER_SECONDS, Heartbeat, heartbeat
from .pod_status import gate_released_at, gate_state
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
    UNSCHEDULED,
    WAITING,
    Gpu,
    Report,
    Row,
)

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


_UNWRITTEN = (": the agent writes a change within seconds; if this stays, it cannot patch the "
              "Node (the API server out of its reach, or its RBAC): its log says why")


def _agent_condition_note(condition: tuple[str, str, str, str] | None,
                          agent: AgentState | None) -> str:
    """What the agent's own condition (its socket's GetNodeState) says when the Node's copy,
    what KAI reads, says otherwise (its status, or its reason); "" when they agree. An agent
    that cannot reach the API server (NotReconciling) cannot write the Node either, so the
    Node keeps the last condition it wrote: inspect run on the node to debug that must not
    show it alone."""
    said = agent.condition if agent is not None and agent.reachable else None
    if said is None:
        return ""
    status = "True" if said.ready else "False"
    own = _said_of((said.type, status, said.reason, said.message))
    if condition is None:
        return (f"the node agent itself says now: {own}; it has not written it to the Node, "
                f"which KAI reads{_UNWRITTEN}")
    if condition[1] == status and (not said.reason or said.reason == condition[2]):
        return ""
    return (f"the node agent itself says now: {own}; the Node's copy, which KAI reads, is "
            f"stale ({_said_of((*condition[:3], ''))}){_UNWRITTEN}")


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
        note = _agent_condition_note(condition, agent)
        if note:
            notes.append(note)
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
