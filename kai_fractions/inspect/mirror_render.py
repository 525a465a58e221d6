"""`inspect mirror`'s report as a table (one row a replica, then what each row sums up and what
it did in the window judged, then the problems) or as JSON / YAML for scripts.

Columns: REPLICA, FOLLOWER (leading, standby, or off), UP, POD CACHE (pods held; "syncing"
before its first list), CALLS and FAILED (answered with another code than OK), MEAN (call
duration), API (requests to the API server), CHECKS (BindRequests the follower handled), SIGNED
p50/p99 (from a BindRequest's creation to its pod's signature), RSS and CPU.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from ..contract import MIB
from .mirror_state import Replica, leaders, problems
from .render import OUTPUTS, aligned

HEADER = ("REPLICA", "FOLLOWER", "UP", "POD CACHE", "CALLS", "FAILED", "MEAN", "API", "CHECKS",
          "SIGNED p50/p99", "RSS", "CPU")


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    for unit, size, smaller, small_size in (("d", 86400, "h", 3600), ("h", 3600, "m", 60),
                                             ("m", 60, "s", 1)):
        if s >= size:
            return f"{s // size}{unit}{(s % size) // small_size}{smaller}"
    return f"{s}s"


def short_time(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.1f} s"


def _follower(r: Replica) -> str:
    return "off" if r.leading is None else "leading" if r.leading else "standby"


def _cache(r: Replica) -> str:
    if r.cache_pods is None:
        return "off"
    return f"{r.cache_pods} pods" + ("" if r.cache_synced else " syncing")


def _failed(r: Replica) -> str:
    failed = r.calls_failed
    return f"{failed} ({failed * 100 / r.calls_total:.1f}%)" if failed else "0"


def cells(r: Replica) -> tuple[str, ...]:
    if not r.reachable:
        return (r.name, "not read", *("-",) * (len(HEADER) - 2))
    signed = ("-" if not r.signatures else
              f"{short_time(r.signature_p50_s)} / {short_time(r.signature_p99_s)}")
    return (r.name, _follower(r), duration(r.uptime_s), _cache(r), str(r.calls_total),
            _failed(r), short_time(r.call_seconds_mean), str(sum(r.api_requests.values())),
            str(sum(r.checks.values())), signed,
            "-" if r.rss_bytes is None else f"{-(-r.rss_bytes // MIB)} MiB",
            "-" if r.cpu_seconds is None else f"{r.cpu_seconds:.1f} s")


def _counts(title: str, counts: Mapping[str, int]) -> str:
    return f"{title} " + ", ".join(f"{k} {v}" for k, v in counts.items()) if counts else ""


def details(r: Replica) -> str:
    """The counts the row sums up, on one line."""
    parts = [_counts("calls", r.calls), _counts("API", r.api_requests),
             _counts("checks", r.checks)]
    if r.window_s is not None:
        recent = [_counts("calls", r.recent_calls), _counts("API", r.recent_api_requests)]
        parts.append(f"in the last {r.window_s:g} s: "
                     + (" and ".join(p for p in recent if p) or "no calls, no API requests"))
    if r.checks_in_progress:
        parts.append(f"{r.checks_in_progress} being checked now")
    if r.cache_pods is not None:
        parts.append(f"cache hits {r.cache_hits}, misses {r.cache_misses}, lists "
                     f"{r.cache_lists}")
    return f"  {r.name}: " + "; ".join(p for p in parts if p)


def heading(replicas: Sequence[Replica], where: str) -> str:
    read = [r for r in replicas if r.reachable]
    lead = leaders(read)
    if not any(r.leading is not None for r in read):
        follower = "follower off" if read else "follower unknown"
    elif len(lead) == 1:
        follower = f"follower led by {lead[0].name}"
    else:
        follower = f"follower leaders: {len(lead)}"
    return f"mirror: {len(read)} of {len(replicas)} replicas read{where}, {follower}"


def table(replicas: Sequence[Replica], where: str = "") -> str:
    lines = [heading(replicas, where)]
    if replicas:
        lines += aligned([HEADER, *(cells(r) for r in replicas)])
        lines += [details(r) for r in replicas if r.reachable]
    lines += [f"! {p}" for p in problems(replicas)]
    return "\n".join(lines) + "\n"


def to_dict(replicas: Sequence[Replica]) -> dict[str, Any]:
    lead = leaders([r for r in replicas if r.reachable])
    return {"replicas": [r.to_dict() for r in replicas],
            "leader": lead[0].name if len(lead) == 1 else None,
            "problems": problems(replicas)}


def render(replicas: Sequence[Replica], output: str, where: str = "") -> str:
    if output == "json":
        return json.dumps(to_dict(replicas), indent=2, sort_keys=True) + "\n"
    if output == "yaml":
        return yaml.safe_dump(to_dict(replicas), sort_keys=True)
    if output == "table":
        return table(replicas, where)
    raise ValueError(f"--output must be one of {', '.join(OUTPUTS)}, got {output!r}")
