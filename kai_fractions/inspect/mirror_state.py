"""What `inspect mirror` says of the mirror's replicas, pure: each replica's Prometheus text
(`mirror/metrics.py`'s series) read into a `Replica`, and what is wrong across them
(`problems`): for a cluster without Prometheus, the same questions the chart's alerts ask.

The counters are totals since the replica started; failing calls and API requests are judged
on what a replica did between two reads a short window apart (`windowed`), as the chart's alerts
judge a rate, not on its whole history. The signature delay's quantiles are read from its
histogram's buckets the way PromQL's histogram_quantile reads them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from types import MappingProxyType
from typing import Any

CALLS = "kai_fractions_mirror_calls_total"
CALL_SECONDS = "kai_fractions_mirror_call_duration_seconds"
API_REQUESTS = "kai_fractions_mirror_api_requests_total"
CACHE_PODS = "kai_fractions_mirror_pod_cache_pods"
CACHE_SYNCED = "kai_fractions_mirror_pod_cache_synced"
CACHE_LOOKUPS = "kai_fractions_mirror_pod_cache_lookups_total"
CACHE_LISTS = "kai_fractions_mirror_pod_cache_lists_total"
LEADING = "kai_fractions_follower_leading"
CHECKS = "kai_fractions_follower_checks_total"
IN_PROGRESS = "kai_fractions_follower_checks_in_progress"
SIGNATURE_DELAY = "kai_fractions_follower_signature_delay_seconds"
RSS = "process_resident_memory_bytes"
CPU = "process_cpu_seconds_total"
STARTED = "process_start_time_seconds"

_EMPTY: Mapping[str, int] = MappingProxyType({})

FAILING_SHARE = 0.05
"""The share of failed calls, or of failed requests to the API server, in the window that is a
problem: the chart's `prometheusRule.failingCallsPercent` (5) by default."""
MIN_JUDGED = 10
"""The fewest calls (or API requests) in the window for their failures to be judged: one
failure among a handful is not a failing share."""
SERVER_FAILURES = ("INTERNAL", "UNAVAILABLE", "DEADLINE_EXCEEDED")
"""The call codes that are the mirror's failures (KaiFractionsMirrorCallsFailing's); the others
(INVALID_ARGUMENT, FAILED_PRECONDITION, ...) answer a caller's mistake."""


@dataclass(frozen=True, slots=True)
class Replica:
    """One mirror replica as its /metrics says, or why it could not be read."""

    name: str
    """The pod's name, or the URL when given one."""
    source: str
    """Where its metrics came from: a URL, or `pod NS/NAME:PORT via the API server`."""
    error: str = ""
    """Why it could not be read (one line); "" when it was."""
    leading: bool | None = None
    """Whether it follows BindRequests now; None when its follower is off."""
    uptime_s: float | None = None
    cache_pods: int | None = None
    """None when it runs without a pod cache."""
    cache_synced: bool | None = None
    cache_hits: int = 0
    cache_misses: int = 0
    cache_lists: int = 0
    calls: Mapping[str, int] = field(default_factory=lambda: _EMPTY)
    """gRPC status code -> calls answered with it, every method together."""
    call_seconds_mean: float | None = None
    api_requests: Mapping[str, int] = field(default_factory=lambda: _EMPTY)
    """HTTP status (or `unreachable`) -> requests to the API server, every verb together."""
    checks: Mapping[str, int] = field(default_factory=lambda: _EMPTY)
    """The follower's results (complete, unchanged, mismatch, ...) -> BindRequests."""
    checks_in_progress: int = 0
    signatures: int = 0
    """Pods signed for the first time, whose delay the quantiles below describe."""
    signature_p50_s: float | None = None
    signature_p99_s: float | None = None
    rss_bytes: int | None = None
    cpu_seconds: float | None = None
    window_s: float | None = None
    """Seconds between the two reads `recent_calls` and `recent_api_requests` come from; None
    when read once: its totals since it started are judged."""
    recent_calls: Mapping[str, int] = field(default_factory=lambda: _EMPTY)
    recent_api_requests: Mapping[str, int] = field(default_factory=lambda: _EMPTY)

    @property
    def reachable(self) -> bool:
        return not self.error

    @property
    def calls_total(self) -> int:
        return sum(self.calls.values())

    @property
    def calls_failed(self) -> int:
        return self.calls_total - self.calls.get("OK", 0)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        for key in ("calls", "api_requests", "checks", "recent_calls", "recent_api_requests"):
            out[key] = dict(out[key])
        out["reachable"] = self.reachable
        return out


def unreadable(name: str, source: str, error: str) -> Replica:
    return Replica(name=name, source=source, error=" ".join(error.split()))


def bucket_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """The q-quantile of a cumulative histogram, (upper bound, count) sorted by bound and
    ending with +Inf, interpolated linearly within its bucket as histogram_quantile does (a
    quantile in the +Inf bucket is the largest finite bound); None with no observation."""
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower
            if count == below:
                return bound
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


def _by(samples: Iterable[Any], label: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in samples:
        key = s.labels.get(label, "")
        out[key] = out.get(key, 0) + int(s.value)
    return dict(sorted(out.items()))


def replica_from_metrics(name: str, source: str, text: str, now: float) -> Replica:
    """A Replica from a mirror's Prometheus text; `now` (Unix seconds) gives its uptime.
    Raises ValueError for text that is not Prometheus' exposition format, or not a mirror's."""
    from prometheus_client.parser import text_string_to_metric_families

    samples: dict[str, list[Any]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append(s)
    if CALLS not in samples and CACHE_PODS not in samples and LEADING not in samples and (
            f"{CALL_SECONDS}_count" not in samples):
        raise ValueError("no kai_fractions_mirror_* series: not a mirror's metrics")

    def one(metric: str) -> float | None:
        found = samples.get(metric)
        return found[0].value if found else None

    def count(metric: str, **labels: str) -> int:
        return int(sum(s.value for s in samples.get(metric, ())
                       if all(s.labels.get(k) == v for k, v in labels.items())))

    leading, synced, pods = one(LEADING), one(CACHE_SYNCED), one(CACHE_PODS)
    started, rss, in_progress = one(STARTED), one(RSS), one(IN_PROGRESS)
    call_count = sum(s.value for s in samples.get(f"{CALL_SECONDS}_count", ()))
    call_sum = sum(s.value for s in samples.get(f"{CALL_SECONDS}_sum", ()))
    buckets = sorted((float(s.labels["le"]), s.value)
                     for s in samples.get(f"{SIGNATURE_DELAY}_bucket", ()))
    return Replica(
        name=name, source=source,
        leading=None if leading is None else leading >= 1,
        uptime_s=None if started is None else max(0.0, now - started),
        cache_pods=None if pods is None else int(pods),
        cache_synced=None if synced is None else synced >= 1,
        cache_hits=count(CACHE_LOOKUPS, result="hit"),
        cache_misses=count(CACHE_LOOKUPS, result="miss"),
        cache_lists=count(CACHE_LISTS),
        calls=MappingProxyType(_by(samples.get(CALLS, ()), "code")),
        call_seconds_mean=call_sum / call_count if call_count else None,
        api_requests=MappingProxyType(_by(samples.get(API_REQUESTS, ()), "code")),
        checks=MappingProxyType(_by(samples.get(CHECKS, ()), "result")),
        checks_in_progress=int(in_progress or 0),
        signatures=count(f"{SIGNATURE_DELAY}_count"),
        signature_p50_s=bucket_quantile(0.5, buckets),
        signature_p99_s=bucket_quantile(0.99, buckets),
        rss_bytes=None if rss is None else int(rss),
        cpu_seconds=one(CPU))


def _since(before: Mapping[str, int], after: Mapping[str, int]) -> dict[str, int] | None:
    """`after` - `before` per code; None when a count went down (the replica restarted)."""
    out = {code: n - before.get(code, 0) for code, n in after.items()}
    if set(before) - set(after) or any(n < 0 for n in out.values()):
        return None
    return {code: n for code, n in out.items() if n}


def _window(before: Replica | None, after: Replica, seconds: float) -> Replica:
    if before is None or not before.reachable or not after.reachable:
        return after  # read once: judged on its totals (or not read now)
    calls = _since(before.calls, after.calls)
    api = _since(before.api_requests, after.api_requests)
    if calls is None or api is None:  # restarted in between: all it did is in the window
        calls, api = dict(after.calls), dict(after.api_requests)
    return replace(after, window_s=seconds, recent_calls=MappingProxyType(calls),
                   recent_api_requests=MappingProxyType(api))


def windowed(before: Sequence[Replica], after: Sequence[Replica],
             seconds: float) -> list[Replica]:
    """The replicas of the second read, each with the calls and API requests it answered
    since the first, `seconds` earlier (by name; one not read the first time keeps its
    totals)."""
    first = {r.name: r for r in before}
    return [_window(first.get(r.name), r, seconds) for r in after]


def _judged(r: Replica, totals: Mapping[str, int], recent: Mapping[str, int]
            ) -> tuple[Mapping[str, int], str]:
    """The counts to judge, and over what span they were counted."""
    if r.window_s is None:
        return totals, "since it started"
    return recent, f"in the last {r.window_s:g} s"


def _failing(counts: Mapping[str, int], bad: Iterable[str]) -> tuple[int, int, str]:
    """(failed, total, `CODE n, ...` of the failed ones) when there are MIN_JUDGED at least
    and the failed are over FAILING_SHARE of them; (0, total, "") otherwise."""
    total = sum(counts.values())
    failed = {code: n for code, n in counts.items() if code in set(bad) and n}
    if total < MIN_JUDGED or sum(failed.values()) <= FAILING_SHARE * total:
        return 0, total, ""
    return sum(failed.values()), total, ", ".join(f"{c} {n}" for c, n in failed.items())


def _api_failing(r: Replica) -> list[str]:
    """Its requests to the API server end unreachable or 5xx (KaiFractionsMirrorApiUnreachable)."""
    counts, span = _judged(r, r.api_requests, r.recent_api_requests)
    bad = [c for c in counts if c == "unreachable" or c.startswith("5")]
    failed, total, codes = _failing(counts, bad)
    if not failed:
        return []
    return [f"{r.name}: {failed} of its {total} requests to the API server failed {span} "
            f"({codes}): its calls answer UNAVAILABLE, its pod cache goes stale and, if "
            "it leads, its follower neither checks nor signs BindRequests; check its log "
            "(kubectl logs) and its way to the API server: DNS, egress NetworkPolicies, the "
            "API server's health"]


def _calls_failing(r: Replica) -> list[str]:
    """Its calls fail (KaiFractionsMirrorCallsFailing)."""
    counts, span = _judged(r, r.calls, r.recent_calls)
    failed, total, codes = _failing(counts, SERVER_FAILURES)
    if not failed:
        return []
    return [f"{r.name}: {failed} of its {total} calls failed {span} ({codes}): the "
            "scheduler's binds that call it fail or retry. UNAVAILABLE: the API server failed "
            "or was unreachable (see its API requests); INTERNAL: the API server refused a "
            "write (RBAC, validation: its log says which); DEADLINE_EXCEEDED: the caller's "
            "deadline ran out"]


def leaders(replicas: Sequence[Replica]) -> list[Replica]:
    return [r for r in replicas if r.leading]


def problems(replicas: Sequence[Replica]) -> list[str]:
    """What an operator must look at, one line each; [] when all is well."""
    if not replicas:
        return ["no mirror replica found: no pod matched the selector in that namespace (-n "
                "names the release's namespace; or pass the replicas' metrics URLs)"]
    out = [f"{r.name}: not read: {r.error}" for r in replicas if not r.reachable]
    read = [r for r in replicas if r.reachable]
    following = [r for r in read if r.leading is not None]
    leading = leaders(read)
    partial = " (among the replicas read)" if len(read) < len(replicas) else ""
    if following and not leading:
        out.append("no replica follows BindRequests" + partial + ": the fractional pods of an "
                   "unmodified KAI wait for their checks and signatures (a replica takes the "
                   "Lease over within its duration; if this lasts, read the replicas' logs)")
    elif len(leading) > 1:
        out.append(f"{len(leading)} replicas follow BindRequests at once "
                   f"({', '.join(r.name for r in leading)}): every check and signature is "
                   "made that many times; their Lease settings or clocks disagree")
    out += [f"{r.name}: pod cache not synced: every call reads its pod from the API server"
            for r in read if r.cache_synced is False]
    for r in read:
        out += _api_failing(r) + _calls_failing(r)
    return out
