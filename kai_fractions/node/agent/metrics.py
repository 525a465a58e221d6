"""Prometheus metrics of the agent, in a registry of its own (served on `--metrics-listen`).

Two families of names:
- `gpu_fractioning_*`: exactly what the upstream gpu-fractioning operator's metricsd exports
  (names, help, gauge type, labels `namespace, pod, pod_uuid, gpu_uuid, gpu`), one series per
  pod and GPU, so dashboards and queries written for it work unchanged. No extra label: a
  `container` label would split a pod's series, and the normalized value does not add up.
- `kai_fractions_*`: what upstream has no word for, per container (the labels above plus
  `node` and `container`) and per node (`node`): requested, capped and used memory, SM use and
  share, limit violations, refusals, caps not in force, GPU memory, node readiness and the
  agent's own health (passes, MPS daemon restarts and drains, GPUs whose usage it cannot read,
  API requests).

Every series of a container (and of its pod) goes when it leaves the node's desired state, so
a deleted pod leaves no stale series behind; a known container with no usage reads 0. So the
refusals and limit violations are also counted per node, from 0 when the agent starts: a pod
that fails and goes within seconds (a Job's) takes its own series with it, often before any
scrape saw them, and only a series that outlives it lets an alert see that it happened.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

from ...metrics_http import MetricsEndpoint
from ...signing import Reason as SignatureReason
from ..desired import ContainerKey, DesiredState, RefusalReason
from ..engine import ContainerResult, ContainerState
from ..inventory import Inventory

FINAL_REASONS = (
    *(r.value for r in RefusalReason if r is not RefusalReason.NOT_BOUND),
    *(r.value for r in SignatureReason if r is not SignatureReason.MISSING),
)
"""Every reason a refusal can be final with, each counted from 0 when the agent starts (an
alert's increase() misses the first of a series that does not exist yet). NotBound (a wait for
the binder) and SignatureMissing (a wait for the mirror's signature) never are."""

STOP_STEPS = ("drain", "terminate")
"""The watchdog's steps in stopping a process (`watchdog.DRAIN`, `watchdog.TERMINATE`)."""
UPSTREAM_LABELS = ("namespace", "pod", "pod_uuid", "gpu_uuid", "gpu")
CONTAINER_LABELS = ("node", "namespace", "pod", "pod_uuid", "container", "gpu_uuid", "gpu")
REASON_LABELS = ("node", "namespace", "pod", "pod_uuid", "container", "reason")
"""A container's series that says why (kai_fractions_container_refused, ..._cap_not_in_force)."""
CAP_NOT_IN_FORCE = "kai_fractions_container_cap_not_in_force"
USAGE_UNKNOWN = "kai_fractions_agent_gpu_usage_unknown"

# Help strings as upstream metricsd registers them (its dashboards show them).
UPSTREAM_HELP = {
    "gpu_fractioning_gpu_memory_used_bytes":
        "GPU memory used by processes attributed to a Kubernetes pod.",
    "gpu_fractioning_gpu_sm_utilization_percent":
        "GPU SM utilization attributed to a Kubernetes pod: the sum of per-process NVML SM-active "
        "time fractions, clamped to [0,100]. Approximate under MPS where a pod's processes "
        "execute concurrently.",
    "gpu_fractioning_gpu_sm_utilization_percent_normalized":
        "GPU SM utilization normalized by the pod's requested GPU fraction (SM utilization ÷ "
        "requested fraction), clamped to [0,100]. A pod using as much of the GPU as it requested "
        "reports 100. Falls back to the raw SM utilization when the requested fraction is "
        "unknown.",
}


@dataclass(frozen=True, slots=True)
class Usage:
    """One container on one GPU, as the last watchdog check saw it."""

    used_bytes: int
    sm_percent: int | None


class _Family:
    """One labelled metric and its children: `set` skips unchanged values (the watchdog sets
    every series every second and `labels()` is a locked lookup); `sweep` removes the series
    not touched since the last sweep."""

    def __init__(self, metric: Any):
        self.metric = metric
        self._children: dict[tuple[str, ...], list[Any]] = {}  # labels -> [child, value]
        self._touched: set[tuple[str, ...]] = set()

    def child(self, labels: tuple[str, ...]) -> Any:
        self._touched.add(labels)
        entry = self._children.get(labels)
        if entry is None:
            entry = self._children[labels] = [self.metric.labels(*labels), None]
        return entry[0]

    def set(self, labels: tuple[str, ...], value: float) -> None:
        child = self.child(labels)
        entry = self._children[labels]
        if entry[1] != value:
            child.set(value)
            entry[1] = value

    def sweep(self) -> None:
        for labels in self._children.keys() - self._touched:
            del self._children[labels]
            with contextlib.suppress(KeyError):
                self.metric.remove(*labels)
        self._touched = set()


class _NodeReady:
    """`kai_fractions_node_ready{node, reason}`: the node condition as the agent would publish
    it now, read at scrape time (absent before the first pass, like the condition)."""

    NAME = "kai_fractions_node_ready"
    HELP = ("1 when the agent reports the node ready for fractional pods (the node condition "
            "KAI reads), else 0; reason as in the condition.")

    def __init__(self, node: str, condition: Callable[[], Any]):
        self.node = node
        self.condition = condition

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(self.NAME, self.HELP, labels=("node", "reason"))

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(self.NAME, self.HELP, labels=("node", "reason"))
        cond = self.condition()
        if cond is not None:
            family.add_metric((self.node, cond.reason), 1.0 if cond.ready else 0.0)
        yield family


def _clamp(value: float) -> float:
    return min(100.0, max(0.0, value))


class AgentMetrics:
    def __init__(self, node: str = "", condition: Callable[[], Any] | None = None) -> None:
        self.node = node
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry

        def gauge(name: str, help_: str, labels: tuple[str, ...]) -> _Family:
            return _Family(Gauge(name, help_, labels, registry=r))

        up = {name: gauge(name, text, UPSTREAM_LABELS) for name, text in UPSTREAM_HELP.items()}
        self._pod_used = up["gpu_fractioning_gpu_memory_used_bytes"]
        self._pod_sm = up["gpu_fractioning_gpu_sm_utilization_percent"]
        self._pod_normalized = up["gpu_fractioning_gpu_sm_utilization_percent_normalized"]
        c = CONTAINER_LABELS
        self._requested = gauge("kai_fractions_container_gpu_memory_requested_bytes",
                                "GPU memory the container requested on the GPU (soft limit).", c)
        self._limit = gauge("kai_fractions_container_gpu_memory_limit_bytes",
                            "The container's GPU memory cap on the GPU.", c)
        self._used = gauge("kai_fractions_container_gpu_memory_used_bytes",
                           "GPU memory used by the container's processes on the GPU.", c)
        self._sm = gauge("kai_fractions_container_gpu_sm_utilization_percent",
                         "Summed SM utilization of the container's processes (percent of the "
                         "whole GPU).", c)
        self._share = gauge("kai_fractions_container_gpu_sm_share_percent",
                            "The container's active-thread share of the GPU's SMs (sm-sharing "
                            "containers only).", c)
        self._violations = _Family(Counter(
            "kai_fractions_container_gpu_memory_limit_violations",
            "Episodes of the container's GPU memory use above its cap, seen by the watchdog.",
            c, registry=r))
        self._refused = gauge("kai_fractions_container_refused",
                              "1 for each container the agent refuses, by reason.",
                              REASON_LABELS)
        self._cap_not_in_force = gauge(
            CAP_NOT_IN_FORCE, "1 for each container a cap it relies on is known not to be in "
            "force for (its MPS namespace's active-thread percentage, its GPU's default pinned "
            "device memory limit, its pod cgroup's GPU memory limit, the watchdog where it is "
            "its only memory tier and cannot see the GPU), by the reason it is pending: its "
            "readiness marker is set aside, and what runs of it meanwhile may run uncapped.",
            REASON_LABELS)
        self.refusals = Counter(
            "kai_fractions_node_container_refusals", "Containers the agent began to refuse, "
            "by reason (counted when the refusal starts; it outlives the pod's own series).",
            ("node", "reason"), registry=r)
        for reason in FINAL_REASONS:
            self.refusals.labels(node, reason)
        self.violation_episodes = Counter(
            "kai_fractions_node_gpu_memory_limit_violations", "Episodes of a container's GPU "
            "memory use above its cap on the node, seen by the watchdog (as the per-container "
            "counter, but it outlives the pod's own series).", ("node",), registry=r)
        self._violation_episodes = self.violation_episodes.labels(node)
        self.stop_failures = Counter(
            "kai_fractions_node_gpu_memory_limit_stops_failed", "Episodes of a container's GPU "
            "memory use above its cap in which the kill-mode watchdog could not stop a process "
            "(as the LimitViolation event that says why), by the step that failed first: "
            "drain (MPS could not drain it, or say whether it is a client) or terminate (it "
            "could not be signalled). Retried at every check; counted once per episode.",
            ("node", "step"), registry=r)
        for step in STOP_STEPS:
            self.stop_failures.labels(node, step)
        self._gpu_total = gauge("kai_fractions_gpu_memory_total_bytes",
                                "Total memory of each GPU of the node.",
                                ("node", "gpu_uuid", "gpu"))
        self.reconcile_duration = Histogram(
            "kai_fractions_reconcile_duration_seconds", "Duration of one reconcile pass.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r)
        self.reconcile_errors = Counter(
            "kai_fractions_reconcile_errors", "Reconcile passes that hit an error, by reason "
            "(each reason counted once per pass).", ("reason",), registry=r)
        self.mps_restarts = Counter("kai_fractions_mps_daemon_restarts",
                                    "Restarts of the MPS control daemon by the agent.",
                                    registry=r)
        self.mps_drains = Counter(
            "kai_fractions_agent_mps_drains", "Drains of a deleted sm-sharing pod's MPS clients "
            "before the kubelet's SIGKILL, by result: drained (pids terminated), nothing (no "
            "client of the pod found), failed (an attempt that raised; retried).", ("result",),
            registry=r)
        for result in ("drained", "nothing", "failed"):
            self.mps_drains.labels(result)
        self.usage_blind = Counter(
            "kai_fractions_agent_gpu_usage_unreadable", "Usage checks (the watchdog's, every "
            "--watchdog-interval) in which NVML could not list a GPU's processes, listed a "
            "managed container's process without its memory (reason ProcessMemoryUnknown), or "
            "listed no process of a GPU's managed containers while memory the listed ones do "
            "not account for is in use (reason NoProcessesVisible: the agent without the "
            "host's pid namespace), by GPU and reason: the watchdog saw nothing there (or "
            "counted that process as 0), so it could neither report nor stop a container over "
            "its cap.",
            ("node", "gpu_uuid", "reason"), registry=r)
        self._usage_unknown = gauge(
            USAGE_UNKNOWN, "1 for each GPU whose usage the watchdog's last check could not "
            "read, by reason (as kai_fractions_agent_gpu_usage_unreadable counts the checks): "
            "the used-memory series of its containers read 0 there, which is not what they use, "
            "and a container whose only memory tier is the watchdog has no cap in force there "
            "(kai_fractions_container_cap_not_in_force, reason WatchdogBlind).",
            ("node", "gpu_uuid", "reason"))
        self._api = Counter(
            "kai_fractions_agent_api_requests", "The agent's requests to the Kubernetes API "
            "server, by verb (the HTTP method; WATCH for a watch) and code (the HTTP status, "
            "or unreachable).", ("node", "verb", "code"), registry=r)
        self._api_children: dict[tuple[str, str], Any] = {}
        self.containers = Gauge("kai_fractions_containers",
                                "Fractional containers on the node by state.", ("node", "state"),
                                registry=r)
        for state in ContainerState:
            self.containers.labels(node, state.value).set(0)
        if condition is not None:
            r.register(_NodeReady(node, condition))
        self._families = (self._pod_used, self._pod_sm, self._pod_normalized, self._requested,
                          self._limit, self._used, self._sm, self._share, self._violations,
                          self._refused, self._gpu_total)
        self._labels_of: dict[tuple[str, str, str], tuple[str, ...]] = {}
        self._violating: set[tuple[str, str, str]] = set()
        self._stop_failed: set[tuple[str, str, str]] = set()
        self._refusing: set[tuple[str, ...]] = set()
        self._lock = threading.Lock()
        self._last: tuple[object, object] | None = None
        self._last_usage: dict = {}
        self._endpoint = MetricsEndpoint(self.registry)

    # -- per container ------------------------------------------------------------------------

    def update(self, desired: DesiredState, usage: Mapping[tuple[ContainerKey, str], Usage],
               inventory: Inventory) -> None:
        """Sets every series of the desired state (its containers, their pods, its refusals)
        and of the GPUs, and removes every other."""
        with self._lock:
            # The watchdog calls this every second; between reconcile passes the desired state
            # and inventory are the same objects and usage often the same values: nothing to do.
            seen = (desired, inventory)
            if (self._last is not None and self._last[0] is desired
                    and self._last[1] is inventory and self._last_usage == usage):
                return
            self._update(desired, usage, inventory)
            self._last, self._last_usage = seen, dict(usage)

    def _update(self, desired: DesiredState, usage: Mapping[tuple[ContainerKey, str], Usage],
                inventory: Inventory) -> None:
        node = self.node
        totals = {}
        for d in inventory.devices:
            totals[d.uuid] = d.memory_total
            self._gpu_total.set((node, d.uuid, str(d.index)), d.memory_total)
        pods: dict[tuple[str, ...], list[int]] = {}  # upstream labels -> [used, sm, limit]
        labels_of = {}
        # The refused containers the watchdog still watches (running before a rule refused
        # them) are measured as the others are.
        for c in (*desired.containers, *desired.watched):
            atp = c.active_thread_percentage
            for uuid, index in zip(c.plan.device_uuids, c.device_indexes, strict=True):
                labels = (node, c.pod_namespace, c.pod_name, c.key.pod_uid, c.key.container,
                          uuid, str(index))
                labels_of[(c.key.pod_uid, c.key.container, uuid)] = labels
                u = usage.get((c.key, uuid))
                used, sm = (u.used_bytes, u.sm_percent or 0) if u else (0, 0)
                self._requested.set(labels, c.plan.request_bytes)
                self._limit.set(labels, c.plan.limit_bytes)
                self._used.set(labels, used)
                self._sm.set(labels, sm)
                if atp:
                    self._share.set(labels, atp)
                self._violations.child(labels)  # from 0, so that the first episode counts
                pod = pods.setdefault(labels[1:4] + labels[5:], [0, 0, 0])
                pod[0] += used
                pod[1] += sm
                pod[2] += c.plan.limit_bytes
        for labels, (used, sm_sum, limit) in pods.items():
            sm = _clamp(sm_sum)
            total = totals.get(labels[3])
            # upstream: requested fraction = the pod's memory limit / the GPU's memory
            fraction = limit / total if total and limit else None
            self._pod_used.set(labels, used)
            self._pod_sm.set(labels, sm)
            self._pod_normalized.set(labels, round(_clamp(sm / fraction), 3) if fraction else sm)
        refusing = set()
        for r in desired.refusals:
            if r.final:  # a refusal that may still clear (NotBound) is pending, not refused
                labels = (node, r.pod_namespace, r.pod_name, r.key.pod_uid, r.key.container,
                          str(r.reason))
                self._refused.set(labels, 1)
                refusing.add(labels)
        for labels in refusing - self._refusing:
            self.refusals.labels(node, labels[-1]).inc()
        self._refusing = refusing
        for family in self._families:
            family.sweep()
        self._labels_of = labels_of
        self._violating &= set(labels_of)

    def count_violations(self, violations: Iterable[Any],
                         checked: Collection[str] | None = None) -> None:
        """One watchdog check's `Violation`s: each container and GPU that went over its cap
        since the last check counts one episode (as the LimitViolation event). `checked`: the
        GPUs the check could list (None: all); the episodes of the others go on as they were,
        neither ended nor started (their usage is unknown)."""
        with self._lock:
            now = {(v.pod_uid, v.container_name, v.device_uuid) for v in violations}
            if checked is not None:
                now |= {k for k in self._violating if k[2] not in checked}
            for key in now - self._violating:
                self._violation_episodes.inc()
                labels = self._labels_of.get(key)
                if labels is not None:
                    self._violations.child(labels).inc()
            self._violating = now
            self._stop_failed &= now

    def count_stop_failures(self, failed: Iterable[tuple[str, str, str, str]]) -> None:
        """(pod uid, container, GPU uuid, step) of the kill-mode watchdog's steps that failed:
        the first of a violation episode counts (`count_violations` ends the episode)."""
        with self._lock:
            for pod_uid, container, device, step in failed:
                key = (pod_uid, container, device)
                if key not in self._stop_failed:
                    self._stop_failed.add(key)
                    self.stop_failures.labels(self.node, step).inc()

    def count_caps(self, results: Iterable[ContainerResult]) -> None:
        """`kai_fractions_container_cap_not_in_force`: 1 for each container pending with a cap
        known not in force (`ContainerResult.not_in_force`: an MPS cap, its pod cgroup's GPU
        memory limit, a blind watchdog that is its only memory tier), by reason; every other
        series goes (its container applied again, or another reason now, or its pod gone)."""
        with self._lock:
            for r in results:
                if r.state is ContainerState.PENDING and r.not_in_force:
                    namespace, pod, _container = r.ref.split("/", 2)
                    self._cap_not_in_force.set((self.node, namespace, pod, r.key.pod_uid,
                                                r.key.container, r.reason or ""), 1)
            self._cap_not_in_force.sweep()

    def set_usage_unknown(self, gpus: Mapping[str, str]) -> None:
        """`kai_fractions_agent_gpu_usage_unknown`: 1 for each GPU (uuid -> reason) whose usage
        the last watchdog check could not read; every other series goes."""
        with self._lock:
            for uuid, reason in gpus.items():
                self._usage_unknown.set((self.node, uuid, reason), 1)
            self._usage_unknown.sweep()

    def count_states(self, states: Iterable[ContainerState]) -> None:
        counts = dict.fromkeys(ContainerState, 0)
        for s in states:
            counts[s] += 1
        for state, n in counts.items():
            self.containers.labels(self.node, state.value).set(n)

    def api_request(self, verb: str, code: str) -> None:
        """kube.client's Observer (docs/scale.md counts these per node)."""
        child = self._api_children.get((verb, code))
        if child is None:
            child = self._api_children[(verb, code)] = self._api.labels(self.node, verb, code)
        child.inc()

    # -- serving -------------------------------------------------------------------------------

    def serve(self, listen: str) -> tuple[str, int]:
        return self._endpoint.serve(listen)

    def close(self) -> None:
        self._endpoint.close()

