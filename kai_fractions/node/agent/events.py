"""Pod events (core/v1 Event), each emitted once.

Reasons: `Applied` (limits in force, marker written), `Refused` (a final refusal, marker
written), `SignatureMissing` (waiting for the allocation's signature, no marker yet),
`LimitViolation` (the watchdog in report mode saw a container above its cap; once per
episode: again only after the usage went back under the cap) and `LimitEnforced` (kill mode:
the watchdog drained and stopped a process). The de-duplication key says what "the same event"
is; an event the API did not take is kept and sent again by `flush()` (every pass), at most
`MAX_BACKLOG` of them (events are information, not state: the oldest are dropped first).
"""

from __future__ import annotations

import logging
import time
import uuid as uuid_mod
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from ...signing import Reason
from .kube import ClusterWriter, KubeError
from .options import COMPONENT

log = logging.getLogger(__name__)

APPLIED = "Applied"
REFUSED = "Refused"
LIMIT_VIOLATION = "LimitViolation"
SIGNATURE_MISSING = Reason.MISSING.value
LIMIT_ENFORCED = "LimitEnforced"
NORMAL = "Normal"
WARNING = "Warning"
MAX_MESSAGE = 1024
MAX_BACKLOG = 200


@dataclass(frozen=True, slots=True)
class PodRef:
    namespace: str
    name: str
    uid: str


def event_body(pod: PodRef, kind: str, reason: str, message: str, *, node: str,
               now: float) -> dict[str, Any]:
    stamp = datetime.fromtimestamp(int(now), UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{pod.name}.{uuid_mod.uuid4().hex[:16]}",
                     "namespace": pod.namespace},
        "involvedObject": {"apiVersion": "v1", "kind": "Pod", "namespace": pod.namespace,
                           "name": pod.name, "uid": pod.uid},
        "reason": reason,
        "message": message[:MAX_MESSAGE],
        "type": kind,
        "source": {"component": COMPONENT, "host": node},
        "reportingComponent": COMPONENT,
        "reportingInstance": node,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }


class EventRecorder:
    def __init__(self, cluster: ClusterWriter | None, node: str,
                 clock: Callable[[], float] = time.time):
        self.cluster = cluster
        self.node = node
        self.clock = clock
        self._sent: dict[Hashable, str] = {}
        """dedup key -> pod uid, for the keys already emitted."""
        self.emitted: list[tuple[str, str, str]] = []
        """(pod uid, reason, message) of every event handed to the API (for tests, logs)."""
        self._backlog: dict[Hashable, tuple[PodRef, str, str, str]] = {}

    def emit(self, pod: PodRef, kind: str, reason: str, message: str,
             key: Hashable) -> bool:
        """Emits unless `key` was emitted before; True when it was sent now."""
        if key in self._sent:
            return False
        if self.cluster is not None and pod.name:
            try:
                self.cluster.create_event(pod.namespace, event_body(
                    pod, kind, reason, message, node=self.node, now=self.clock()))
            except KubeError as e:
                log.warning("event %s on pod %s/%s not recorded (%s); retried later", reason,
                            pod.namespace, pod.name, e.message)
                self._backlog[key] = (pod, kind, reason, message)
                while len(self._backlog) > MAX_BACKLOG:
                    del self._backlog[next(iter(self._backlog))]
                return False
        self._backlog.pop(key, None)
        self._sent[key] = pod.uid
        self.emitted.append((pod.uid, reason, message))
        log.info("pod %s/%s: %s: %s", pod.namespace, pod.name, reason, message)
        return True

    def flush(self) -> None:
        """Sends again the events the API did not take before."""
        for key, (pod, kind, reason, message) in list(self._backlog.items()):
            if key in self._backlog and not self.emit(pod, kind, reason, message, key):
                return  # the API still refuses: the rest waits for the next pass

    def seen(self, key: Hashable) -> bool:
        return key in self._sent

    def forget(self, key: Hashable) -> None:
        self._sent.pop(key, None)

    def forget_matching(self, predicate: Callable[[Hashable], bool]) -> None:
        for key in [k for k in self._sent if predicate(k)]:
            del self._sent[key]

    def forget_pod(self, uid: str) -> None:
        for key in [k for k, owner in self._sent.items() if owner == uid]:
            del self._sent[key]
        for key in [k for k, v in self._backlog.items() if v[0].uid == uid]:
            del self._backlog[key]
