"""Drains an sm-sharing pod's MPS clients shortly before the kubelet's SIGKILL.

Killing an MPS client in the middle of a kernel can wedge the MPS server for every tenant of
its GPU, and the kubelet kills whatever still runs when a deleted pod's grace period ends. So
when the pod watch shows a pod with `metadata.deletionTimestamp` (when its grace period ends,
by the API server's clock) and an sm-sharing container planned on this node, its clients are
drained (`client terminate`, the Drain call's work) `margin` seconds before that time, not at
SIGTERM: a workload uses its grace period to checkpoint, often with the GPU. A moment already
past (a grace period shorter than the margin, a deletion seen late) drains at once.

Each pod is drained at most once this way (forgotten when it goes away). A drain that fails is
counted, reported once as a Warning event and tried again every `retry` seconds until the pod
goes or its deadline is `overrun` seconds past. Only the worker thread calls in here: the
drain touches NVML and the MPS control daemon. Deadlines are wall-clock times; the schedule is
kept in monotonic time, converted when a deadline is first seen (or changes).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from ...contract import ComputeMode
from ...kube.objects import epoch_seconds, meta
from ..desired import DesiredState
from ..errors import NodeError
from . import events as ev
from .events import EventRecorder, PodRef
from .metrics import AgentMetrics

log = logging.getLogger(__name__)

RETRY_SECONDS = 1.0
OVERRUN_SECONDS = 5.0
"""A failed drain is retried until this long after the deadline (the kubelet's kill lags it)."""
DRAINED, NOTHING, FAILED = "drained", "nothing", "failed"


def deleting_sm_pods(pods: Mapping[str, Mapping[str, Any]], desired: DesiredState | None
                     ) -> dict[str, tuple[PodRef, float]]:
    """uid -> (pod, its deletionTimestamp in wall-clock seconds) of the pods being deleted that
    have an sm-sharing container planned on this node."""
    if desired is None:
        return {}
    sm = {c.key.pod_uid for c in (*desired.containers, *desired.watched)
          if c.plan.compute_mode is ComputeMode.SM_SHARING}
    out = {}
    for uid in sm & pods.keys():
        m = meta(pods[uid])
        deadline = epoch_seconds(m.get("deletionTimestamp"))  # None when not being deleted
        if deadline is not None:
            out[uid] = (PodRef(str(m.get("namespace") or ""), str(m.get("name") or ""), uid),
                        deadline)
    return out


@dataclass(slots=True)
class _Due:
    pod: PodRef
    deadline: float
    """deletionTimestamp, wall clock."""
    at: float
    """Next attempt, monotonic."""
    give_up: float
    """No retry after this, monotonic."""


class DrainBeforeKill:
    def __init__(self, margin: float, drain: Callable[[str], list[int]], events: EventRecorder,
                 metrics: AgentMetrics, *, clock: Callable[[], float],
                 monotonic: Callable[[], float], retry: float = RETRY_SECONDS,
                 overrun: float = OVERRUN_SECONDS):
        self.margin, self.retry, self.overrun = margin, retry, overrun
        self.drain = drain
        self.events = events
        self.metrics = metrics
        self.clock, self.monotonic = clock, monotonic
        self.pending: dict[str, _Due] = {}
        self.done: set[str] = set()

    def update(self, deleting: Mapping[str, tuple[PodRef, float]], present: Collection[str]
               ) -> None:
        """Schedules the pods of `deleting_sm_pods` not drained yet; forgets the pods no longer
        `present` (and cancels the drains of pods no longer being deleted as sm-sharing)."""
        self.done &= set(present)
        for uid in [u for u in self.pending if u not in deleting]:
            del self.pending[uid]
        for uid, (pod, deadline) in deleting.items():
            due = self.pending.get(uid)
            if uid in self.done or (due is not None and due.deadline == deadline):
                continue
            now, left = self.monotonic(), deadline - self.clock()
            self.pending[uid] = _Due(pod, deadline, at=now + max(0.0, left - self.margin),
                                     give_up=now + left + self.overrun)
            log.info("pod %s/%s is being deleted (its grace period ends in %.1f s): its MPS "
                     "clients are drained in %.1f s", pod.namespace, pod.name, left,
                     max(0.0, left - self.margin))

    def next_due(self) -> float | None:
        return min((d.at for d in self.pending.values()), default=None)

    def run_due(self) -> None:
        now = self.monotonic()
        for uid, due in [(u, d) for u, d in self.pending.items() if d.at <= now]:
            self._attempt(uid, due, now)

    def _attempt(self, uid: str, due: _Due, now: float) -> None:
        pod, name = due.pod, f"{due.pod.namespace}/{due.pod.name}"
        try:
            pids = self.drain(uid)
        except Exception as e:  # a bug must not end the worker either
            reason, message = ((e.reason, e.message) if isinstance(e, NodeError)
                               else ("InternalError", f"{type(e).__name__}: {e}"))
            self.metrics.mps_drains.labels(FAILED).inc()
            retry = now + self.retry <= due.give_up
            log.warning("draining the MPS clients of pod %s before its deletion deadline "
                        "failed: %s: %s; %s", name, reason, message,
                        f"retried in {self.retry:g} s" if retry else "given up")
            self.events.emit(pod, ev.WARNING, ev.MPS_DRAIN_FAILED,
                             f"draining the pod's MPS clients before the kubelet stops it "
                             f"failed: {reason}: {message}", key=(ev.MPS_DRAIN_FAILED, uid))
            if retry:
                due.at = now + self.retry
                return
        else:
            self.metrics.mps_drains.labels(DRAINED if pids else NOTHING).inc()
            if pids:
                listed = ", ".join(map(str, pids))
                log.info("drained the MPS clients of pod %s before its deletion deadline: "
                         "pids %s", name, listed)
                self.events.emit(pod, ev.NORMAL, ev.MPS_CLIENTS_DRAINED,
                                 f"MPS clients drained before the kubelet stops the pod "
                                 f"(client terminate; the processes are left to the kubelet): "
                                 f"pids {listed}", key=(ev.MPS_CLIENTS_DRAINED, uid))
            else:
                log.info("pod %s has no MPS client to drain before its deletion deadline", name)
        del self.pending[uid]
        self.done.add(uid)
