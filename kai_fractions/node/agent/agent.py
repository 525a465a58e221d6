"""The node agent assembled: watcher, worker, status publisher, metrics and gRPC servers, and the
shutdown order.

Shutdown (SIGTERM): stop watching, let the worker finish the task in progress (a pass is never cut
between its apply and its markers, and markers are written only after an apply), publish the
condition one last time (False, NotReconciling: the agent is stopping; after a start that failed,
why it could not start), close the socket, stop the MPS control daemon only if this agent started
it (the readiness markers that rely on it set aside first: `Reconciler.close`), close the
Kubernetes connections (`PodSource.close`). Nothing is drained or released: the workloads keep
running with their limits in force, and the next agent adopts them. A worker that does not finish
within the bound leaves the MPS daemon and NVML as they are (it may still be in them), but the
markers that rely on a daemon this agent started are set aside all the same, the marker store
closed first so that the late pass writes none back (`Reconciler.abandon`): that daemon runs in the
agent's container and dies with it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from ...signing import KeyringSource
from ..cgroups import CgroupFs
from ..config import NodeConfig
from ..nvml import Nvml
from ..procfs import Procfs
from ..watchdog import Killer
from .condition import (
    NOT_RECONCILING,
    Condition,
    Liveness,
    evaluate,
    passes_failing,
)
from .events import EventRecorder
from .grpc_service import NodeEnforcerServicer, close_unix, serve_unix
from .kube import ClusterWriter, PodSource
from .metrics import AgentMetrics
from .mps_supervisor import MpsSupervisor
from .options import AgentOptions
from .reconciler import Reconciler
from .signatures import SignatureCheck
from .status_publisher import StatusPublisher, smallest_gpu_mib
from .watch import PodCache, PodWatcher
from .worker import Worker

log = logging.getLogger(__name__)


class StartError(Exception):
    """A server the agent needs could not start (the message names the flag and why)."""


class NodeAgent:
    def __init__(
        self,
        *,
        config: NodeConfig,
        options: AgentOptions,
        nvml: Nvml,
        cgroup_fs: CgroupFs,
        source: PodSource | None,
        cluster: ClusterWriter | None,
        mps: MpsSupervisor | None = None,
        procfs: Procfs | None = None,
        killer: Killer | None = None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ):
        self.config = config
        self.options = options
        self.monotonic = monotonic
        self.source = source
        self.cluster = cluster
        self.cache = PodCache(monotonic)
        self.metrics = AgentMetrics(config.node_name, condition=self.condition)
        self.events = EventRecorder(cluster, config.node_name, clock)
        signatures = None
        if options.signing:  # raises SigningConfigError for unusable key files
            signatures = SignatureCheck(
                KeyringSource(options.signing_key_files, verify_only=True,
                              hmac_paths=options.signing_hmac_key_files), config.keys,
                config.node_name,
                key_wait_seconds=options.signature_key_wait_seconds, monotonic=monotonic)
        self.reconciler = Reconciler(
            config=config, options=options, nvml=nvml, cgroup_fs=cgroup_fs, pods=self.cache,
            mps=mps, cluster=cluster, events=self.events, metrics=self.metrics, procfs=procfs,
            killer=killer, clock=clock, signatures=signatures,
            confirm_absent=self._confirm_absent)
        self.worker = Worker(self.reconciler, options,
                             watchdog_interval=config.watchdog_interval,
                             mps_checks=self.reconciler.mps is not None, monotonic=monotonic)
        self.watcher = (PodWatcher(source, config.node_name, self.cache, self.worker.mark_dirty,
                                   resync_seconds=options.resync_seconds, monotonic=monotonic,
                                   first_list_jitter=options.first_list_jitter_seconds,
                                   cached_lists=options.list_from_watch_cache)
                        if source is not None else None)
        self.status = (StatusPublisher(cluster, config.node_name, options, self.condition,
                                       lambda: smallest_gpu_mib(self.reconciler.view.inventory),
                                       clock=clock, monotonic=monotonic)
                       if cluster is not None else None)
        self.servicer = NodeEnforcerServicer(self.reconciler, self.worker, config.node_name,
                                             self.condition, options.condition_name)
        self._stop = threading.Event()
        self._stopping = False
        self._started = monotonic()
        self._threads: list[threading.Thread] = []
        self._grpc: Any = None
        self._running = False
        """Set once `start` completed: only an agent that ran has a condition to publish."""
        self.metrics_address: tuple[str, int] | None = None

    def _confirm_absent(self, uids: set[str], generation: int) -> bool:
        return self.watcher is not None and self.watcher.confirm_absent(uids, generation)

    # -- health -----------------------------------------------------------------------------

    def liveness(self) -> Liveness:
        down = self.cache.api_down_since
        failing = self.worker.failing
        return Liveness(synced=self.cache.synced,
                        api_down_for=None if down is None else self.monotonic() - down,
                        api_error=self.cache.last_error, busy_for=self.worker.busy_for(),
                        stopping=self._stopping,
                        failed_passes=0 if failing is None else failing.passes,
                        failing_for=None if failing is None else self.monotonic() - failing.since,
                        pass_error=None if failing is None else failing.error,
                        markers_unwritable=self.worker.marker_probe.error)

    def condition(self) -> Condition | None:
        """The node condition now; None while the first pass is still to come (publishing
        "not ready" for the few seconds of a start would only flap the node)."""
        health = self.reconciler.view.health
        live = self.liveness()
        if (health.passes == 0 and not live.stopping and not passes_failing(self.options, live)
                and self.monotonic() - self._started < self.options.stale_after_seconds):
            return None
        return evaluate(self.config, self.options, health, live)

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> NodeAgent:
        """Servers first (the socket's umask must not race other threads), then threads."""
        if self.options.metrics_listen:
            try:
                self.metrics_address = self.metrics.serve(self.options.metrics_listen)
            except OSError as e:
                raise StartError(f"--metrics-listen {self.options.metrics_listen}: "
                                 f"{e.strerror or e}") from None
            log.info("metrics on http://%s:%d/metrics", *self.metrics_address)
        if self.options.socket:
            self._grpc = serve_unix(self.servicer, self.options.socket)
        self._threads.append(self.worker.start())
        self._spawn("marker-probe", self.worker.marker_probe.run)
        if self.watcher is not None:
            self._spawn("pod-watcher", self.watcher.run)
        else:
            self.cache.replace([])  # no API: only provisioned pods exist
        if self.status is not None:
            self._spawn("node-status", self.status.run)
        self._running = True
        log.info("node agent for %s started", self.config.node_name)
        return self

    def _spawn(self, name: str, target: Callable[[threading.Event], None]) -> None:
        thread = threading.Thread(target=target, args=(self._stop,), name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def stop(self, timeout: float = 20.0, *, start_error: str | None = None) -> None:
        """`start_error`: why `start` failed (the caller's words), said in the condition."""
        self._stopping = True
        self._stop.set()  # the watcher cancels its list + watch at once
        if self.status is not None:
            self.status.wake.set()
        self.worker.marker_probe.soon()  # its thread sees the stop
        finished = self.worker.stop(timeout)
        for thread in self._threads:
            if thread is not self.worker.thread:
                thread.join(2.0)
        if self.status is not None:
            # An agent whose start failed checked nothing, but the condition an agent before it
            # left (True, if it was killed) must not go on saying the node is ready: it says
            # why no agent runs.
            cond = (self.condition() if self._running else None if start_error is None else
                    Condition(False, NOT_RECONCILING, f"the node agent could not start "
                              f"({start_error}); fractional pods placed here wait in their "
                              "gates until one does"))
            if cond is not None:
                self.status.publish(cond)
        if self._grpc is not None and self.options.socket:
            close_unix(self._grpc, self.options.socket)
            self._grpc = None
        if finished:
            self.reconciler.close()
        else:
            log.error("the worker did not finish within %gs; the MPS daemon and NVML are left "
                      "as they are, and the markers that rely on a daemon this agent started "
                      "are set aside (it dies with the agent's container)", timeout)
            self.reconciler.abandon()
        self.metrics.close()
        if self.source is not None:  # last: the condition above went through its connections
            self.source.close()
        log.info("node agent for %s stopped", self.config.node_name)

    def wait(self, timeout: float | None = None) -> bool:
        return self._stop.wait(timeout)

    def request_stop(self) -> None:
        self._stop.set()
