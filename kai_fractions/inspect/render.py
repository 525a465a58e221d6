"""A report as a table per GPU (for people) or as JSON / YAML (for scripts).

The table's columns: POD/CONTAINER, MODE, REQUEST, LIMIT, ATP (active-thread percentage, the
share of the GPU's SMs of an sm-sharing container), USED (GPU memory its processes use now, from
the node agent; n/a where it is not known: the agent not read, or its watchdog unable to read
it on that GPU), STATE (`enforced (gate)`: only the gate's exit says so) and TIER (what holds
the memory cap: cgroup, mps-pinned, or only the watchdog, which never stops an allocation;
none; n/a when the agent's socket was not read; - when neither enforced nor refused). Why a
container is not enforced, and what is wrong with one that is (memory used over its limit, a
refused plan change), is spelled out below its GPU, one line each, so the rows stay short.
JSON and YAML give each row's fields (`Row.to_dict`): an enforced row's `reason` is always "",
and `state_source` says who said its state (agent, metrics, events, gate, pod).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import yaml

from ..contract import MIB
from .model import ENFORCED, FROM_GATE, Gpu, Report, Row

HEADER = ("POD/CONTAINER", "MODE", "REQUEST", "LIMIT", "ATP", "USED", "STATE", "TIER")
OUTPUTS = ("table", "json", "yaml")


def mib(n: int | None) -> str:
    return "-" if n is None else f"{-(-n // MIB)} MiB"


def _request(row: Row) -> str:
    if row.request_bytes is None and row.portion:
        text = f"{row.portion} GPU"
    else:
        text = mib(row.request_bytes)
    if row.device_count > 1 and text != "-":
        text += f" x{row.device_count}"
    return text


def state_text(row: Row) -> str:
    """`refused (REASON)`; `enforced`, or `enforced (gate)` on the gate's word alone."""
    if row.state == ENFORCED and row.state_source == FROM_GATE:
        return f"{row.state} (gate)"
    if row.state == ENFORCED or not row.reason:
        return row.state
    return f"{row.state} ({row.reason})"


def cells(row: Row) -> tuple[str, ...]:
    return (row.ref, row.mode or "-", _request(row), mib(row.limit_bytes),
            "-" if row.active_thread_percentage is None else f"{row.active_thread_percentage}%",
            mib(row.used_bytes) if row.used_bytes is not None else "n/a", state_text(row),
            row.tier)


def aligned(rows: Sequence[tuple[str, ...]], indent: str = "  ") -> list[str]:
    """Rows of cells as lines, each column as wide as its widest cell."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
            for r in rows]


def gpu_heading(gpu: Gpu) -> str:
    parts = [f"GPU {gpu.index}" if gpu.index is not None else "GPU", gpu.uuid]
    if gpu.name:
        parts.append(gpu.name)
    if gpu.memory_bytes:
        parts.append(mib(gpu.memory_bytes))
    parts.append(", ".join(gpu.modes) if gpu.modes else "idle")
    requested = gpu.requested_bytes
    if gpu.memory_bytes:
        parts.append(f"requested {mib(requested)} ({requested * 100 // gpu.memory_bytes}%)")
    else:
        parts.append(f"requested {mib(requested)}")
    return "  ".join(parts)


def reasons(rows: Sequence[Row]) -> list[str]:
    """One `! <ref>: <reason>: <message>` line per row that is not enforced, and one per
    warning of any row (each line once: a container on several GPUs has a row each)."""
    lines: dict[str, None] = {}
    for r in rows:
        if r.state != ENFORCED and r.message:
            lines[f"  ! {r.ref}: {r.reason + ': ' if r.reason else ''}{r.message}"] = None
        for warning in r.warnings:
            lines[f"  ! {r.ref}: {warning}"] = None
    return list(lines)


def heading(report: Report) -> list[str]:
    parts = [report.title]
    if report.node and not report.title.startswith("node "):
        parts.append(f"on node {report.node}")
    if report.gpu_memory_label is not None:
        parts.append(f"nvidia.com/gpu.memory={report.gpu_memory_label}")
    if report.condition is not None:
        parts.append(f"{report.condition[0]}={report.condition[1]}")
    beat = report.heartbeat
    if beat is not None and beat.seconds_ago is not None:
        parts.append(f"agent alive {beat.seconds_ago:.0f} s ago ({beat.source})")
    lines = ["  ".join(parts)]
    agent = report.agent
    if agent is not None and agent.reachable:
        driver = f" (driver {agent.driver_version})" if agent.driver_version else ""
        lines.append(f"agent: {agent.source}{driver}")
    return lines


def table(report: Report) -> str:
    lines = heading(report)
    for note in report.notes:
        lines.append(f"note: {note}")
    for gpu in report.gpus:
        lines += ["", gpu_heading(gpu)]
        if gpu.rows:
            lines += aligned([HEADER, *(cells(r) for r in gpu.rows)])
            lines += reasons(gpu.rows)
        else:
            lines.append("  (no fractional allocations)")
    if report.unplaced:
        lines += ["", "not on a GPU:"]
        lines += aligned([HEADER, *(cells(r) for r in report.unplaced)])
        lines += reasons(report.unplaced)
    if not report.gpus and not report.unplaced:
        lines += ["", "(no fractional allocations)"]
    return "\n".join(lines) + "\n"


def render(report: Report, output: str) -> str:
    if output == "json":
        return json.dumps(report.to_dict(), indent=2, sort_keys=True) + "\n"
    if output == "yaml":
        return yaml.safe_dump(report.to_dict(), sort_keys=True)
    if output == "table":
        return table(report)
    raise ValueError(f"--output must be one of {', '.join(OUTPUTS)}, got {output!r}")
