"""Prometheus metrics of the mirror, in a registry of its own (served on `--metrics-listen`):
its calls, its requests to the API server, its pod cache, its BindRequest follower, and the
process (CPU, RSS). No series names a pod: a scheduler's whole queue passes through the mirror.

Each replica has its own series (only one follows BindRequests while several serve), so
Prometheus scrapes every replica. What is cheap to read at scrape time (the cache's size, the
Lease) is read then; what happens per call costs a counter increment on the serving loop.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..kube.objects import seconds_since

if TYPE_CHECKING:
    from .bindrequest_view import BindRequestView
    from .pod_cache import PodCache
    from .verification import Verification

CALL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
SIGNATURE_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
"""A wave of thousands of binds is signed over minutes (docs/scale.md)."""


class MirrorMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=r)
        self._calls = Counter(
            "kai_fractions_mirror_calls", "Calls answered, by method and gRPC status code "
            "(UNAUTHENTICATED: refused for their bearer token before they ran).",
            ("method", "code"), registry=r)
        self._call_seconds = Histogram(
            "kai_fractions_mirror_call_duration_seconds", "Time from a call's start in the "
            "mirror to its answer, by method.", ("method",), buckets=CALL_BUCKETS, registry=r)
        self._api = Counter(
            "kai_fractions_mirror_api_requests", "Requests to the Kubernetes API server, by "
            "verb (the HTTP method; WATCH for a watch) and code (the HTTP status, or "
            "unreachable).", ("verb", "code"), registry=r)
        self._checks = Counter(
            "kai_fractions_follower_checks", "BindRequests the follower handled, by result: "
            "complete (matching, and signed where signing is on), unchanged (that version was "
            "complete already), mismatch, invalid, unsigned, waiting (not Succeeded yet and "
            "within its grace: every bind for a moment, nothing read), skipped (not checked: "
            "not bound yet past the grace, reserved GPU not known yet, pod gone or another of "
            "that name, failed for good), error.", ("result",), registry=r)
        self._in_progress = Gauge(
            "kai_fractions_follower_checks_in_progress", "BindRequests being checked now "
            "(at most --follow-concurrency).", registry=r)
        self._signature_delay = Histogram(
            "kai_fractions_follower_signature_delay_seconds", "Seconds from a BindRequest's "
            "creation (whole seconds) to the signature of its pod: how long a fractional pod "
            "of an unmodified KAI waited for the follower.", buckets=SIGNATURE_BUCKETS,
            registry=r)
        self._silent_nodes = Counter(
            "kai_fractions_follower_silent_nodes", "Times a node's readiness condition was set "
            "Unknown because its node agent stopped reporting (--mark-silent-nodes-after): "
            "KAI places no fractional pod there until the agent reports again.", registry=r)
        self._silent_node = Gauge(
            "kai_fractions_follower_node_silent", "1 for each node whose readiness condition "
            "this replica set Unknown (its agent stopped reporting) and still finds so; the "
            "series goes once the agent writes it again, the node is deleted or this replica "
            "stops following (a standby has none).", ("node",), registry=r)
        self._node_checks_failed = Counter(
            "kai_fractions_follower_node_checks_failed", "Silent-node checks that could not "
            "read a node or its agent's heartbeat Lease (RBAC, the API server): such a node is "
            "never marked, however long its agent is gone.", registry=r)
        # labels() takes a lock and hashes its arguments; a call's path keeps its children.
        self._children: dict[tuple[str, ...], Any] = {}

    # -- the serving loop: calls and API requests ----------------------------------------------

    def call(self, method: str, code: str, seconds: float | None) -> None:
        """One call answered with `code` (a grpc.StatusCode name); `seconds` None for one
        refused before it ran (no bearer token), which is counted, not timed."""
        child = self._children.get((method, code))
        if child is None:
            child = self._children[(method, code)] = self._calls.labels(method, code)
        child.inc()
        if seconds is None:
            return
        timer = self._children.get((method,))
        if timer is None:
            timer = self._children[(method,)] = self._call_seconds.labels(method)
        timer.observe(seconds)

    def api_request(self, verb: str, code: str) -> None:
        """kube.client's Observer."""
        child = self._children.get(("api", verb, code))
        if child is None:
            child = self._children[("api", verb, code)] = self._api.labels(verb, code)
        child.inc()

    # -- read at scrape time ------------------------------------------------------------------

    def watch_pod_cache(self, cache: PodCache) -> None:
        self.registry.register(_PodCacheCollector(cache))

    def watch_leading(self, leading: Callable[[], bool]) -> None:
        """Whether this replica follows BindRequests now (holds the Lease; always, without
        leader election)."""
        self.registry.register(_Leading(leading))

    # -- the follower --------------------------------------------------------------------------

    async def check(self, follow_one: Callable[[BindRequestView], Awaitable[Verification | None]],
                    br: BindRequestView) -> Verification | None:
        """`follow_one(br)`, counted by its result and timed to its signature."""
        self._in_progress.inc()
        try:
            result = await follow_one(br)
        except Exception:
            self._checks.labels("error").inc()
            raise
        finally:
            self._in_progress.dec()
        self._checks.labels(check_result(result)).inc()
        if result is not None and result.signed and not result.resigned:
            waited = seconds_since(br.created)
            if waited is not None:
                self._signature_delay.observe(waited)
        return result

    def node_marked_silent(self, node: str) -> None:
        """NodeLiveness's `on_marked`: the counter has no node label (thousands of nodes); the
        gauge has a series per node held silent now, a few."""
        self._silent_nodes.inc()
        self._silent_node.labels(node).set(1)

    def node_no_longer_silent(self, node: str) -> None:
        """NodeLiveness's `on_cleared`."""
        with contextlib.suppress(KeyError):  # not held (told twice)
            self._silent_node.remove(node)

    def node_check_failed(self, _node: str) -> None:
        """NodeLiveness's `on_failed`."""
        self._node_checks_failed.inc()


def check_result(v: Verification | None) -> str:
    if v is None:
        return "unchanged"
    if v.mismatches:
        return "mismatch"
    if v.errors:
        return "invalid"
    if v.waiting:
        return "waiting"
    if v.skipped:
        return "skipped"
    return "unsigned" if v.unsigned else "complete"


class _PodCacheCollector:
    def __init__(self, cache: PodCache) -> None:
        self.cache = cache

    def describe(self) -> Iterator[Any]:
        return self.collect()

    def collect(self) -> Iterator[Any]:
        cache = self.cache
        yield GaugeMetricFamily("kai_fractions_mirror_pod_cache_pods",
                                "Pods in the mirror's pod cache (its scheduler's Pending pods).",
                                value=len(cache))
        yield GaugeMetricFamily("kai_fractions_mirror_pod_cache_synced",
                                "1 once the pod cache's first list arrived, else 0 (until then "
                                "every call reads its pod from the API server).",
                                value=1.0 if cache.synced else 0.0)
        lookups = CounterMetricFamily("kai_fractions_mirror_pod_cache_lookups",
                                      "Pods looked up in the cache by calls, by result (a miss "
                                      "reads the pod from the API server).", labels=("result",))
        lookups.add_metric(("hit",), cache.hits)
        lookups.add_metric(("miss",), cache.misses)
        yield lookups
        yield CounterMetricFamily("kai_fractions_mirror_pod_cache_lists",
                                  "Full lists of pods merged into the cache (the first, then one "
                                  "per expired watch or resync).", value=cache.lists)


class _Leading:
    def __init__(self, leading: Callable[[], bool]) -> None:
        self.leading = leading

    def describe(self) -> Iterator[Any]:
        return self.collect()

    def collect(self) -> Iterator[Any]:
        yield GaugeMetricFamily("kai_fractions_follower_leading",
                                "1 while this replica follows BindRequests (holds the "
                                "follower's Lease, or runs without leader election), else 0.",
                                value=1.0 if self.leading() else 0.0)
