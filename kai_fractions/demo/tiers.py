"""Which memory tier enforces each container's cap, and the demo's table with that column.

The node agent lists, per container and GPU, the limits it has in force and by which mechanism
(NodeEnforcer GetNodeState, `applied_limits`). A row's TIER is the strongest of them: `cgroup`
(the driver refuses an allocation over the cap), then `mps-pinned` (the MPS client refuses it),
then `watchdog` (the allocation succeeds and is reported or stopped afterwards); `none` for a
container the agent refused, `-` for one on no GPU of the node.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from ..inspect.model import ENFORCED, REFUSED, Report, Row
from ..inspect.render import HEADER, cells, gpu_heading, heading, reasons

TIERS = ("cgroup", "mps-pinned", "watchdog")
"""Strongest first."""
NONE = "none"
TierKey = tuple[str, str, str, str]
"""(namespace, pod, container, GPU UUID)."""


def agent_mechanisms(socket: str, timeout: float = 5.0) -> dict[TierKey, frozenset[str]]:
    """The mechanisms in force per container and GPU, from the agent's socket: what the TIER
    column and the over-the-cap step both go by."""
    import grpc

    from ..api.v1 import node_pb2, node_pb2_grpc

    with grpc.insecure_channel(f"unix://{socket}") as channel:
        reply = node_pb2_grpc.NodeEnforcerStub(channel).GetNodeState(
            node_pb2.GetNodeStateRequest(), timeout=timeout)
    found: dict[TierKey, set[str]] = {}
    for a in reply.allocations:
        for limit in a.applied_limits:
            key = (a.pod.namespace, a.pod.name, a.container, limit.gpu_uuid)
            found.setdefault(key, set()).add(limit.mechanism)
    return {key: frozenset(names) for key, names in found.items()}


def strongest(mechanisms: Collection[str]) -> str:
    """The tier that holds a cap first (TIERS, strongest first); NONE without any."""
    return next((t for t in TIERS if t in mechanisms), NONE)


def row_tier(row: Row, tiers: Mapping[TierKey, str]) -> str:
    if not row.gpu_uuid:
        return "-"
    if row.state == REFUSED:
        return NONE
    found = tiers.get((row.namespace, row.pod, row.container, row.gpu_uuid))
    if found is not None:
        return found
    return NONE if row.state == ENFORCED else "-"


def _columns(rows: Sequence[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
            for r in rows]


def table(report: Report, tiers: Mapping[TierKey, str]) -> str:
    """`kai-fractions inspect`'s table (kai_fractions.inspect.render) with a TIER column."""
    header = (*HEADER, "TIER")

    def rows(of: Sequence[Row]) -> list[str]:
        return _columns([header, *((*cells(r), row_tier(r, tiers)) for r in of)]) + reasons(of)

    lines = heading(report)
    lines += [f"note: {note}" for note in report.notes]
    for gpu in report.gpus:
        lines += ["", gpu_heading(gpu)]
        lines += rows(gpu.rows) if gpu.rows else ["  (no fractional allocations)"]
    if report.unplaced:
        lines += ["", "not on a GPU:", *rows(report.unplaced)]
    return "\n".join(lines) + "\n"
