"""The report's vocabulary: the states a row can be in, who said so, the tiers that hold a
memory cap, and the Row / Gpu / Report records the renderer and the JSON output read.

Apart from the logic that fills them (`container_rows`, `model`) so that a reader of the report
(`render`, the demo) depends on its shape alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .agent_state import AgentState
from .heartbeat import Heartbeat

ENFORCED = "enforced"
REFUSED = "refused"
PENDING = "pending"
WAITING = "waiting"
UNSCHEDULED = "unscheduled"
UNGATED = "ungated"
INVALID = "invalid"

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
                "driver_version": agent.driver_version,
                # its own condition (socket only): the Node's copy above may be stale
                "condition": None if agent.condition is None else {
                    "type": agent.condition.type,
                    "status": "True" if agent.condition.ready else "False",
                    "reason": agent.condition.reason, "message": agent.condition.message}},
            "gpus": [g.to_dict() for g in self.gpus],
            "unplaced": [r.to_dict() for r in self.unplaced],
            "notes": list(self.notes),
        }
