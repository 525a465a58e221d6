"""Pod events (core/v1 Event), each emitted once.

Reasons: `Applied` (limits in force, marker written), `Refused` (a final refusal, marker
written), `SignatureMissing` (waiting for the allocation's signature, no marker yet),
`SignatureKeyUnknown` (waiting for the key of its signature: a rotation on its way),
`LimitViolation` (the watchdog in report mode saw a container above its cap; once per
episode: again only after the usage went back under the cap; in kill mode, once per episode
too, only when a stop could not proceed, its drain or signal failed, saying why),
`LimitEnforced` (kill mode: the watchdog drained and stopped a process), the Warning
`ProcessNotStopped` (kill mode: a process over its cap still runs some time after SIGKILL,
stuck in the kernel),
`PlanChangeRefused` (a running container's annotations changed: the new plan is refused, the
applied one stays in force), the Warning `MpsCapNotInForce` (an MPS cap a container relies on
is known not in force, so its readiness marker is set aside; once per episode, again only
after the container was applied in between, whose `Applied` is then sent again), the Warning
`MemoryLimitNotInForce` (likewise, the GPU memory limit on the container's pod cgroup), the
Warning `WatchdogBlind` (likewise, the watchdog where it is the container's only memory tier and
cannot see the GPU's usage), and
`MpsClientsDrained` / the Warning `MpsDrainFailed` (an sm-sharing pod being deleted was
drained from MPS before the kubelet's SIGKILL, or could not be: `drain_before_kill`). The
de-duplication key says what "the same event" is; an event the API did not take is kept and
sent again by `flush()` (every pass), at most `MAX_BACKLOG` of them (events are information,
not state: the oldest are dropped first), unless what it told is over first (`forget`'s
`withdraw`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from ...kube.errors import KubeError
from ...kube.objects import pod_event
from ...signing import Reason
from .kube import ClusterWriter
from .options import COMPONENT

log = logging.getLogger(__name__)

APPLIED = "Applied"
REFUSED = "Refused"
LIMIT_VIOLATION = "LimitViolation"
SIGNATURE_MISSING = Reason.MISSING.value
SIGNATURE_KEY_UNKNOWN = Reason.KEY_UNKNOWN.value
LIMIT_ENFORCED = "LimitEnforced"
PROCESS_NOT_STOPPED = "ProcessNotStopped"
PLAN_CHANGE_REFUSED = "PlanChangeRefused"
MPS_CLIENTS_DRAINED = "MpsClientsDrained"
MPS_DRAIN_FAILED = "MpsDrainFailed"
MPS_CAP_NOT_IN_FORCE = "MpsCapNotInForce"
NORMAL = "Normal"
WARNING = "Warning"
MAX_BACKLOG = 200
EVENT_BURST = 50
EVENT_RATE = 1.0
"""Events per second an agent creates once its burst is spent; the others wait in the
backlog. A restarted agent does not announce again the pods it adopts: `Applied` and `Refused`
go with a marker write, and a marker that already says what the plan says is left as it is
(`MarkerWriter.settle`). Its memory of what it sent is gone, though, so what is still in force
is reported again (a `PlanChangeRefused`, a `SignatureMissing` still waited for, a container
still over its cap): the limit bounds that, and what a node with many pods sends in a burst
of new pods (docs/scale.md)."""
AGGREGATE_AFTER = 10
AGGREGATE_SECONDS = 600.0
"""After this many events of one pod and reason within the window, the rest of the window's
are counted and sent as one event when it ends (client-go's EventCorrelator keeps the same
ten in ten minutes)."""


@dataclass(slots=True)
class _Group:
    """The events of one pod and reason in the current window."""

    start: float
    created: int = 0
    folded: int = 0
    last: tuple[PodRef, str, str] | None = None  # (pod, kind, message) of the latest folded
    last_at: float = 0.0
    """When the latest folded event happened: the summary carries that time, not the window's
    end, or it would read as newer than an event of another reason sent since (`inspect pod`
    takes a container's newest agent event as its state)."""


@dataclass(frozen=True, slots=True)
class PodRef:
    namespace: str
    name: str
    uid: str


def event_body(pod: PodRef, kind: str, reason: str, message: str, *, node: str,
               now: float) -> dict[str, Any]:
    return pod_event(pod.namespace, pod.name, pod.uid, event_type=kind, reason=reason,
                     message=message, component=COMPONENT, host=node,
                     now=datetime.fromtimestamp(int(now), UTC))


class EventRecorder:
    """Creates events at most `rate` per second after a burst of `burst` (the others wait in
    the backlog), and folds the events of one pod and reason beyond `aggregate_after` in a
    window of `aggregate_seconds` into one, sent when the window ends."""

    def __init__(self, cluster: ClusterWriter | None, node: str,
                 clock: Callable[[], float] = time.time, *, burst: int = EVENT_BURST,
                 rate: float = EVENT_RATE, aggregate_after: int = AGGREGATE_AFTER,
                 aggregate_seconds: float = AGGREGATE_SECONDS):
        self.cluster = cluster
        self.node = node
        self.clock = clock
        self.burst, self.rate = burst, rate
        self.aggregate_after, self.aggregate_seconds = aggregate_after, aggregate_seconds
        self._tokens = float(burst)
        self._refilled = clock()
        self._groups: dict[tuple[str, str], _Group] = {}
        self._sent: dict[Hashable, str] = {}
        """dedup key -> pod uid, for the keys already emitted (`forget_pod` drops a pod's)."""
        self._backlog: dict[Hashable, tuple[PodRef, str, str, str]] = {}

    def emit(self, pod: PodRef, kind: str, reason: str, message: str,
             key: Hashable) -> bool:
        """Emits unless `key` was emitted before; True when it was sent now, or folded into
        its pod and reason's summary (sent when the window ends)."""
        if key in self._sent:
            return False
        now = self.clock()
        group = self._group(pod.uid, reason, now)
        if group.created >= self.aggregate_after:
            group.folded += 1
            group.last, group.last_at = (pod, kind, message), now
            self._backlog.pop(key, None)
            self._sent[key] = pod.uid
            log.info("pod %s/%s: %s (folded into the window's summary): %s", pod.namespace,
                     pod.name, reason, message)
            return True
        if not self._create(pod, kind, reason, message, now, key):
            return False
        group.created += 1
        self._backlog.pop(key, None)
        self._sent[key] = pod.uid
        log.info("pod %s/%s: %s: %s", pod.namespace, pod.name, reason, message)
        return True

    def flush(self) -> None:
        """Sends the summaries of the windows that ended, then again the events the API did
        not take before or the rate held back."""
        now = self.clock()
        for (uid, reason), group in list(self._groups.items()):
            if now - group.start >= self.aggregate_seconds and not self._summarise(
                    uid, reason, group, now):
                return
        for key, (pod, kind, reason, message) in list(self._backlog.items()):
            if key in self._backlog and not self.emit(pod, kind, reason, message, key):
                return  # the API still refuses: the rest waits for the next pass

    def _group(self, uid: str, reason: str, now: float) -> _Group:
        group = self._groups.get((uid, reason))
        if group is not None and now - group.start >= self.aggregate_seconds:
            if not self._summarise(uid, reason, group, now):
                return group  # its summary waits: the window goes on until it is sent
            group = None
        if group is None:
            group = self._groups[(uid, reason)] = _Group(start=now)
        return group

    def _summarise(self, uid: str, reason: str, group: _Group, now: float) -> bool:
        """Sends the ended window's summary (when events were folded) and forgets the window;
        False when the rate or the API held it back."""
        if group.folded and group.last is not None:
            pod, kind, message = group.last
            summary = (f"{message} (and {group.folded - 1} more {reason} event(s) of this pod "
                       f"in {self.aggregate_seconds:.0f} s, not sent one by one)"
                       if group.folded > 1 else message)
            if not self._create(pod, kind, reason, summary, now, None, count=group.folded,
                                at=group.last_at):
                return False
        del self._groups[(uid, reason)]
        return True

    def _create(self, pod: PodRef, kind: str, reason: str, message: str, now: float,
                key: Hashable | None, count: int = 1, at: float | None = None) -> bool:
        """One Event to the API, within the rate, stamped `at` (default `now`); an event with
        a `key` that could not go now waits in the backlog."""
        if self.cluster is None or not pod.name:
            return True
        self._tokens = min(float(self.burst),
                           self._tokens + (now - self._refilled) * self.rate)
        self._refilled = now
        problem = None
        if self._tokens < 1:
            problem = "over the agent's event rate"
        else:
            body = event_body(pod, kind, reason, message, node=self.node,
                              now=now if at is None else at)
            body["count"] = count
            try:
                self.cluster.create_event(pod.namespace, body)
                self._tokens -= 1
                return True
            except KubeError as e:
                problem = e.message
        # Held back by the rate limit is the design working (debug); an API failure is not.
        log.log(logging.DEBUG if self._tokens < 1 else logging.WARNING,
                "event %s on pod %s/%s not recorded (%s); retried later", reason,
                pod.namespace, pod.name, problem)
        if key is not None:
            self._backlog[key] = (pod, kind, reason, message)
            while len(self._backlog) > MAX_BACKLOG:
                del self._backlog[next(iter(self._backlog))]
        return False

    def seen(self, key: Hashable) -> bool:
        return key in self._sent

    def forget(self, key: Hashable, *, withdraw: bool = False) -> None:
        """`key` may be emitted again. `withdraw`: one still in the backlog is not sent
        either: its news is over, and sent late, after what ended it (an Applied after the
        Warning of an episode that followed, or the other way round), it would say the
        opposite of what is so."""
        self.forget_matching(lambda k: k == key, withdraw=withdraw)

    def forget_matching(self, predicate: Callable[[Hashable], bool], *,
                        withdraw: bool = False) -> None:
        for key in [k for k in self._sent if predicate(k)]:
            del self._sent[key]
        if withdraw:
            for key in [k for k in self._backlog if predicate(k)]:
                del self._backlog[key]

    def forget_pod(self, uid: str) -> None:
        for key in [k for k, owner in self._sent.items() if owner == uid]:
            del self._sent[key]
        for group in [g for g in self._groups if g[0] == uid]:
            del self._groups[group]
        for key in [k for k, v in self._backlog.items() if v[0].uid == uid]:
            del self._backlog[key]
