"""Prometheus metrics of the admission server, in a registry of its own (served on
`--metrics-listen`): the reviews it answered and how long they took, the requests it refused
instead of a review and why, its connections, and the process (CPU, RSS). No series names a
pod or a user: any pod that reaches the Service can send requests.

Each replica has its own series, so Prometheus scrapes every replica. What the server keeps
anyway (its connections, the body budget, whether it drains) is read at scrape time; what
happens per request costs a counter increment in the request's thread.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from .server import WebhookServer

WEBHOOKS = ("validate", "mutate")
OUTCOMES = ("allowed", "denied", "error")
"""A review's outcome: `error` is the denial of a review that raised (an internal error)."""
REFUSALS = ("body_too_large", "body_timeout", "body_short", "length_required", "malformed",
            "too_many_openings", "no_room", "not_found", "protocol")
"""Why a request got an answer other than a review (see AdmissionMetrics.refused)."""
REVIEW_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""Real reviews fall in the lowest buckets; the costliest bodies the server's bounds let
through, and a wait for the review before one of them, reach seconds."""


class AdmissionMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=r)
        reviews = Counter(
            "kai_fractions_admission_reviews", "AdmissionReviews reviewed, by webhook and "
            "outcome: allowed, denied, or error (denied for an internal error; the log has the "
            "details). Each is answered with HTTP 200, unless its answer finds no room: then "
            "503, counted in kai_fractions_admission_requests_refused_total{reason=\"no_room\"} "
            "as well.", ("webhook", "outcome"), registry=r)
        seconds = Histogram(
            "kai_fractions_admission_review_seconds", "Time from a review's body being whole to "
            "its answer decided (the wait for the review before it, the parse and the review), "
            "by webhook.", ("webhook",), buckets=REVIEW_BUCKETS, registry=r)
        refused = Counter(
            "kai_fractions_admission_requests_refused", "Requests answered with a refusal "
            "instead of a review, by reason: body_too_large (413), body_timeout (408), "
            "body_short (400: the body ended early), length_required (411), malformed (400: not "
            "JSON, not an AdmissionReview, too deep), too_many_openings (400: too many arrays "
            "and objects), no_room (503: no room within the queue wait for its body or its "
            "review, or none at once for its answer: a review that ran is counted in "
            "kai_fractions_admission_reviews_total too), not_found (404: an "
            "unknown path), protocol (the HTTP itself: a bad request line or headers, an "
            "unsupported method).", ("reason",), registry=r)
        self._families = {"reviews": reviews, "seconds": seconds, "refused": refused}
        # Every series from the start (an alert sees a 0 before the first one); labels() takes
        # a lock and hashes its arguments, so a request's path looks its child up here.
        self._children: dict[tuple[str, ...], Any] = {}
        for webhook in WEBHOOKS:
            self._child("seconds", webhook)
            for outcome in OUTCOMES:
                self._child("reviews", webhook, outcome)
        for reason in REFUSALS:
            self._child("refused", reason)

    def _child(self, family: str, *labels: str) -> Any:
        child = self._children.get((family, *labels))
        if child is None:
            child = self._children[(family, *labels)] = self._families[family].labels(*labels)
        return child

    def reviewed(self, webhook: str, outcome: str, seconds: float) -> None:
        """A review answered by `webhook` (WEBHOOKS) with `outcome` (OUTCOMES), decided
        `seconds` after its body was whole."""
        self._child("reviews", webhook, outcome).inc()
        self._child("seconds", webhook).observe(seconds)

    def refused(self, reason: str) -> None:
        """A request answered with a refusal (REFUSALS) instead of a review."""
        self._child("refused", reason).inc()

    def watch(self, server: WebhookServer) -> None:
        """Reads `server`'s connections, body budget and drain at each scrape (one server a
        registry)."""
        self.registry.register(_ServerCollector(server))


class _ServerCollector:
    def __init__(self, server: WebhookServer) -> None:
        self.server = server

    def describe(self) -> Iterator[Any]:
        return self.collect()

    def collect(self) -> Iterator[Any]:
        server = self.server
        connections = server.connections
        yield GaugeMetricFamily("kai_fractions_admission_connections_open",
                                "Connections open now (each has its thread).",
                                value=len(connections))
        yield GaugeMetricFamily("kai_fractions_admission_connections_limit",
                                "The most connections open at once; past it a new one takes "
                                "the place of one waiting on its peer, or waits in the listen "
                                "backlog.", value=connections.limit)
        yield CounterMetricFamily("kai_fractions_admission_connections_evicted",
                                  "Connections closed to make room for a new one, every place "
                                  "taken (an idle keep-alive, or one stuck on its peer).",
                                  value=connections.evicted)
        yield CounterMetricFamily("kai_fractions_admission_connections_backlogged",
                                  "New connections left waiting in the listen backlog, every "
                                  "place taken by one that may keep it: each counted once, "
                                  "when the server first finds it at the head of the backlog "
                                  "with no place for it, however long it then waits.",
                                  value=connections.waited)
        bodies = server.bodies
        yield GaugeMetricFamily("kai_fractions_admission_body_bytes_held",
                                "Bytes of request bodies and answers held now, of the body "
                                "budget (kai_fractions_admission_body_bytes_budget).",
                                value=bodies.size - bodies.free)
        yield GaugeMetricFamily("kai_fractions_admission_body_bytes_budget",
                                "The bytes of bodies and answers the server holds at once at "
                                "most; a request that finds no room is answered 503.",
                                value=bodies.size)
        yield GaugeMetricFamily("kai_fractions_admission_draining",
                                "1 once the server is shutting down (/healthz answers 503, "
                                "every answer closes its connection), else 0.",
                                value=1.0 if server.draining else 0.0)
