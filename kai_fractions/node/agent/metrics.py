"""Prometheus metrics of the agent, in a registry of its own (served on `--metrics-listen`).

Per container and GPU (labels namespace, pod, container, gpu_uuid):
- `gpu_fractioning_gpu_memory_used_bytes`: what its processes use (NVML, mapped through /proc);
- `gpu_fractioning_gpu_sm_utilization_percent`: summed SM utilisation of its processes;
- `gpu_fractioning_gpu_sm_utilization_percent_normalized`: the same divided by the container's
  active-thread share (40% of the GPU on a 50% share reads 80); sm-sharing containers only, a
  time-slicing container has no share to divide by;
- `gpu_fractioning_memory_limit_bytes`: its cap.
The agent itself: `gpu_fractioning_reconcile_duration_seconds` (histogram),
`gpu_fractioning_reconcile_errors_total{reason}`, `gpu_fractioning_mps_daemon_restarts_total`,
`gpu_fractioning_containers{state}` (applied, pending, refused).

Every label set of a container is removed when the container leaves the node's desired state,
so a deleted pod leaves no stale series behind.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from ..desired import ContainerDesired, ContainerKey
from ..engine import ContainerState

log = logging.getLogger(__name__)

LABELS = ("namespace", "pod", "container", "gpu_uuid")


@dataclass(frozen=True, slots=True)
class Usage:
    """One container on one GPU, as the last watchdog check saw it."""

    used_bytes: int
    sm_percent: int | None


class AgentMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.memory_used = Gauge("gpu_fractioning_gpu_memory_used_bytes",
                                 "GPU memory used by the container's processes on the GPU.",
                                 LABELS, registry=r)
        self.sm = Gauge("gpu_fractioning_gpu_sm_utilization_percent",
                        "SM utilisation of the container's processes on the GPU (percent of "
                        "the whole GPU).", LABELS, registry=r)
        self.sm_normalized = Gauge(
            "gpu_fractioning_gpu_sm_utilization_percent_normalized",
            "SM utilisation divided by the container's active-thread share (percent of its "
            "share; sm-sharing containers only).", LABELS, registry=r)
        self.memory_limit = Gauge("gpu_fractioning_memory_limit_bytes",
                                  "The container's GPU memory cap on the GPU.", LABELS,
                                  registry=r)
        self.reconcile_duration = Histogram(
            "gpu_fractioning_reconcile_duration_seconds", "Duration of one reconcile pass.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r)
        self.reconcile_errors = Counter(
            "gpu_fractioning_reconcile_errors", "Reconcile passes that hit an error, by reason "
            "(each reason counted once per pass).", ("reason",), registry=r)
        self.mps_restarts = Counter("gpu_fractioning_mps_daemon_restarts",
                                    "Restarts of the MPS control daemon by the agent.",
                                    registry=r)
        self.containers = Gauge("gpu_fractioning_containers",
                                "Fractional containers on the node by state.", ("state",),
                                registry=r)
        for state in ContainerState:
            self.containers.labels(state.value).set(0)
        self._series: dict[ContainerKey, set[tuple[str, ...]]] = {}
        # label values -> (limit, used, sm, sm_normalized) children: `labels()` is a locked
        # lookup, and the watchdog updates every series every second.
        self._children: dict[tuple[str, ...], tuple[Any, Any, Any, Any]] = {}
        self._values: dict[tuple[str, ...], tuple[Any, ...]] = {}  # what each series holds
        self._server: Any = None

    # -- per container ------------------------------------------------------------------------

    @staticmethod
    def _labels(c: ContainerDesired, uuid: str) -> tuple[str, ...]:
        return (c.pod_namespace, c.pod_name, c.key.container, uuid)

    def update(self, containers: Iterable[ContainerDesired],
               usage: Mapping[tuple[ContainerKey, str], Usage]) -> None:
        """Sets every series of the containers in the desired state and removes the series of
        the containers that left it."""
        seen: dict[ContainerKey, set[tuple[str, ...]]] = {}
        for c in containers:
            atp = c.active_thread_percentage
            for uuid in c.plan.device_uuids:
                labels = self._labels(c, uuid)
                seen.setdefault(c.key, set()).add(labels)
                u = usage.get((c.key, uuid))
                sm = (u.sm_percent or 0) if u else 0
                values = (c.plan.limit_bytes, u.used_bytes if u else 0, sm,
                          round(sm * 100 / atp, 3) if atp else None)
                if self._values.get(labels) == values:
                    continue  # usage is mostly steady: skip four locked sets per series
                self._values[labels] = values
                limit, used, sm_gauge, normalized = self._series_of(labels, bool(atp))
                limit.set(values[0])
                used.set(values[1])
                sm_gauge.set(values[2])
                if normalized is not None:
                    normalized.set(values[3])
        for key, old in self._series.items():
            for labels in old - seen.get(key, set()):
                self._remove(labels)
        self._series = seen

    def _series_of(self, labels: tuple[str, ...], normalized: bool) -> tuple[Any, Any, Any, Any]:
        children = self._children.get(labels)
        if children is None or (normalized and children[3] is None):
            children = (self.memory_limit.labels(*labels), self.memory_used.labels(*labels),
                        self.sm.labels(*labels),
                        self.sm_normalized.labels(*labels) if normalized else None)
            self._children[labels] = children
        return children

    def _remove(self, labels: tuple[str, ...]) -> None:
        self._children.pop(labels, None)
        self._values.pop(labels, None)
        for gauge in (self.memory_used, self.sm, self.sm_normalized, self.memory_limit):
            with contextlib.suppress(KeyError):
                gauge.remove(*labels)

    def count_states(self, states: Iterable[ContainerState]) -> None:
        counts = dict.fromkeys(ContainerState, 0)
        for s in states:
            counts[s] += 1
        for state, n in counts.items():
            self.containers.labels(state.value).set(n)

    # -- serving -------------------------------------------------------------------------------

    def serve(self, listen: str) -> tuple[str, int]:
        host, port = parse_listen(listen)
        self._server, _thread = start_http_server(port, host, registry=self.registry)
        bound = self._server.server_address
        return str(bound[0]), int(bound[1])

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def parse_listen(listen: str) -> tuple[str, int]:
    """`HOST:PORT`, `[v6]:PORT` or `:PORT` -> (host, port); raises ValueError."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"--metrics-listen: expected HOST:PORT, got {listen!r}")
    host = host.strip("[]") or "0.0.0.0"
    return host, int(port)
