"""The one thread that touches the GPUs: reconcile passes, watchdog checks and gRPC calls, one at
a time (the engine, NVML and MPS control are driven from here only).

It sleeps until something is due: the dirty flag (a pod changed; any number of changes make one
pass), a gRPC call, a retry of a pass that did not converge (1 s, then 2 s), the periodic
full resync (`--resync-seconds`: read caches dropped, everything re-read), an MPS health check
(sm-sharing), a watchdog check (`--watchdog-interval`) or the drain of a deleted sm-sharing
pod's MPS clients before the kubelet kills it (`drain_before_kill`). A pass whose marker write
failed asks the marker directory's probe (`marker_probe`, its own thread) to look at once.
`stop()` lets the task in progress finish, so a pass is never cut between its apply and its
markers. A pass that runs the watchdog check itself (before it vouches for a container whose
only memory tier is the watchdog on a GPU no check has judged with it:
`Reconciler._watchdog_blind`) moves the next scheduled check an interval on: one check, on the
same thread, never two in a row.

A pass that raises (an internal error) is retried like one that did not converge; the streak of
such passes (`failing`) feeds the node condition, which a pass that completes clears.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from .drain_before_kill import DrainBeforeKill, deleting_sm_pods
from .marker_probe import MarkerDirProbe
from .markers import MARKER_NOT_WRITTEN
from .options import AgentOptions
from .pass_errors import PassErrorLog
from .reconciler import PassReport, Reconciler

log = logging.getLogger(__name__)
T = TypeVar("T")

INTERNAL_ERROR = "InternalError"
ERROR_TEXT_MAX = 300
"""Characters of an exception's text kept for the node condition's message."""


@dataclass(frozen=True, slots=True)
class Failing:
    """Passes that raised in a row since the last one that completed (read by other threads:
    replaced whole, never changed in place)."""

    passes: int
    since: float
    """Monotonic time the first of them started."""
    error: str
    """The last one's exception, type and text."""


class WorkerStopped(Exception):
    """The agent is shutting down: the call was not run."""


class WorkerBusy(Exception):
    """The call did not get its turn in time."""


class Worker:
    def __init__(self, reconciler: Reconciler, options: AgentOptions, *,
                 watchdog_interval: float, mps_checks: bool,
                 monotonic: Callable[[], float] = time.monotonic):
        self.reconciler = reconciler
        self.options = options
        self.watchdog_interval = watchdog_interval
        self.mps_checks = mps_checks
        self.monotonic = monotonic
        self._cond = threading.Condition()
        self._dirty = True
        self._calls: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        self._stopping = False
        self._busy_since: float | None = None
        now = monotonic()
        self._next_retry: float | None = None
        self._retry_delay = options.retry_seconds
        self._next_resync = now + options.resync_seconds
        self._next_watchdog = now + watchdog_interval
        self._next_mps = now + options.mps_check_seconds
        self.last_pass: PassReport | None = None
        self.error_log = PassErrorLog(monotonic)
        self.failing: Failing | None = None
        margin = options.mps_drain_before_kill_seconds
        self.drains = (DrainBeforeKill(margin, reconciler.drain, reconciler.events,
                                       reconciler.metrics, clock=reconciler.clock,
                                       monotonic=monotonic)
                       if reconciler.mps is not None and margin > 0 else None)
        self.marker_probe = MarkerDirProbe(reconciler.markers.root, monotonic)
        self.thread: threading.Thread | None = None

    # -- from other threads -------------------------------------------------------------------

    def mark_dirty(self) -> None:
        with self._cond:
            self._dirty = True
            self._cond.notify_all()

    def call(self, fn: Callable[[], T], timeout: float | None = None) -> T:
        """Runs `fn` on the worker and returns its result (or raises its exception)."""
        future: Future[Any] = Future()
        with self._cond:
            if self._stopping:
                raise WorkerStopped("the node agent is shutting down")
            self._calls.append((fn, future))
            self._cond.notify_all()
        try:
            return future.result(self.options.rpc_timeout_seconds if timeout is None
                                 else timeout)
        except TimeoutError:
            future.cancel()
            raise WorkerBusy("the node agent's worker did not get to the call in time (a "
                             "reconcile pass is running long); try again") from None

    def busy_for(self) -> float | None:
        since = self._busy_since
        return None if since is None else self.monotonic() - since

    def start(self) -> threading.Thread:
        self.thread = threading.Thread(target=self.run, name="agent-worker", daemon=True)
        self.thread.start()
        return self.thread

    def stop(self, timeout: float | None = None) -> bool:
        """Lets the task in progress finish; True when the thread ended within `timeout`."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self.thread is None:
            return True
        self.thread.join(timeout)
        return not self.thread.is_alive()

    # -- the thread ---------------------------------------------------------------------------

    def _due(self) -> float:
        times = [self._next_resync, self._next_watchdog]
        if self._next_retry is not None:
            times.append(self._next_retry)
        if self.mps_checks:
            times.append(self._next_mps)
        drain = self.drains.next_due() if self.drains is not None else None
        if drain is not None:
            times.append(drain)
        return min(times)

    def run(self) -> None:
        while True:
            with self._cond:
                while not (self._stopping or self._calls or self._dirty
                           or self.monotonic() >= self._due()):
                    self._cond.wait(max(0.0, self._due() - self.monotonic()))
                if self._stopping:
                    calls = list(self._calls)
                    self._calls.clear()
                    break
                calls = list(self._calls)
                self._calls.clear()
                dirty, self._dirty = self._dirty, False
            self._busy_since = self.monotonic()
            try:
                self._step(calls, dirty)
            finally:
                self._busy_since = None
        for _fn, future in calls:
            # A caller that stopped waiting (its timeout) cancelled its future already.
            if future.set_running_or_notify_cancel():
                future.set_exception(WorkerStopped("the node agent is shutting down"))

    def _step(self, calls: list[tuple[Callable[[], Any], Future[Any]]], dirty: bool) -> None:
        checks = self.reconciler.usage.checks
        for fn, future in calls:
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as e:  # handed to the caller's thread
                future.set_exception(e)
        dirty = dirty or bool(calls)  # a call may have changed the desired state
        now = self.monotonic()
        full = now >= self._next_resync
        retry = self._next_retry is not None and now >= self._next_retry
        mps = False
        if self.mps_checks and now >= self._next_mps:
            self._next_mps = now + self.options.mps_check_seconds
            mps = self._mps_needs_pass()
        # A watchdog check that found it turn blind on a GPU, or see again: only a pass reports
        # it (a container whose only memory tier it is, its marker; the condition).
        news = self.reconciler.usage_needs_pass(now)
        passed = dirty or full or retry or mps or news
        if passed:
            self._pass(full)
            if full:
                self._next_resync = now + self.options.resync_seconds
        if self.drains is not None:
            self._drain_before_kill(self.drains, rescan=passed)
        if passed and self.last_pass is not None and MARKER_NOT_WRITTEN in self.last_pass.errors:
            self.marker_probe.soon()
        if self.reconciler.usage.checks != checks:
            # A pass (or a call's) ran the watchdog check before vouching for a container on a
            # GPU no check had judged with it: that was this interval's check.
            self._next_watchdog = self.monotonic() + self.watchdog_interval
        if self.monotonic() >= self._next_watchdog:
            try:
                self.reconciler.check_usage()
            except Exception:
                log.exception("watchdog check failed")
                self.reconciler.metrics.reconcile_errors.labels(INTERNAL_ERROR).inc()
            self._next_watchdog = self.monotonic() + self.watchdog_interval

    def _drain_before_kill(self, drains: DrainBeforeKill, *, rescan: bool) -> None:
        """After a pass (any change of a pod makes one), schedules the deleted sm-sharing pods
        the cache and the pass show; then drains those due. A step without a pass (a watchdog
        check, say) does not read the cache again: nothing in it changed."""
        try:
            if rescan:
                pods = self.reconciler.pods.cache.snapshot()
                drains.update(deleting_sm_pods(pods, self.reconciler.view.desired), pods.keys())
            drains.run_due()
        except Exception:
            log.exception("drain before kill failed")
            self.reconciler.metrics.reconcile_errors.labels(INTERNAL_ERROR).inc()

    def _mps_needs_pass(self) -> bool:
        try:
            return self.reconciler.mps_needs_pass()
        except Exception:
            log.exception("MPS health check failed")
            return True  # let a pass find out and report it

    def _pass(self, full: bool) -> None:
        started = self.monotonic()
        try:
            report = self.reconciler.reconcile(full=full)
            self.failing = None
        except Exception as e:
            # A bug must not end the loop: the pass is retried (nothing was marked ready), and
            # a streak of them makes the node not ready (`condition.evaluate`).
            log.exception("reconcile pass failed")
            self.reconciler.metrics.reconcile_errors.labels(INTERNAL_ERROR).inc()
            report = PassReport(converged=False, errors=frozenset({INTERNAL_ERROR}))
            text = f"{type(e).__name__}: {e}"
            if len(text) > ERROR_TEXT_MAX:
                text = text[:ERROR_TEXT_MAX - 3] + "..."
            previous = self.failing
            self.failing = Failing(passes=1 if previous is None else previous.passes + 1,
                                   since=started if previous is None else previous.since,
                                   error=text)
        self.last_pass = report
        self.error_log.update(report.errors, lambda: self.reconciler.view)
        if report.converged:
            self._next_retry = None
            self._retry_delay = self.options.retry_seconds
        else:
            self._next_retry = self.monotonic() + self._retry_delay
            self._retry_delay = min(self._retry_delay * 2, self.options.retry_max_seconds)
