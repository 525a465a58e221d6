"""The agent's heartbeat in a coordination.k8s.io Lease of its own, not on its Node.

The follower's silent-node check (`mirror/node_liveness.py`) must know that a node's agent is
alive. A heartbeat on the node condition (its `lastHeartbeatTime`) makes etcd store the whole
Node again every minute and sends the Node to every client that watches Nodes: five times the
kubelet's own Node writes at rest (docs/scale.md). As the kubelet did for its own heartbeat
(KEP-0009), the agent renews a small Lease instead, `kai-fractions-agent.<node>` in the release's
namespace, every `heartbeat_seconds`; the publisher then writes the condition when it changes and
otherwise every `status_report_seconds`.

The Lease is renewed only while the condition's last patch went through: a live Lease beside a
condition the agent cannot write would hide a stale True. While renewals fail (a chart of an
older release, an API server that refuses Leases) the publisher beats on the Node as before, so
a live agent never looks silent. A renewal that goes through after a failure, or after a gap of
two intervals (a hung process, a paused machine), asks for the condition until it is published:
the follower may have set it Unknown meanwhile. A mark the agent cannot see coming (a follower
of an older release, which reads no Lease, or a hand) stands until the next report, at most
`status_report_seconds`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ...kube.errors import KubeError
from ...kube.objects import micro_time
from .kube import ClusterWriter

log = logging.getLogger(__name__)

LEASE_DURATION_INTERVALS = 3
"""The Lease's `leaseDurationSeconds`, in renewal intervals (the follower's own threshold,
`--mark-silent-nodes-after`, decides; this tells a reader of the Lease)."""


class HeartbeatLease:
    """Renews one Lease from the publisher's thread; `beat` is called every tick."""

    def __init__(self, cluster: ClusterWriter, namespace: str, name: str, holder: str,
                 every_seconds: float, *, clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.cluster = cluster
        self.namespace, self.name, self.holder = namespace, name, holder
        self.every = every_seconds
        self.clock = clock
        self.monotonic = monotonic
        self._renewed_at: float | None = None
        """When the last renewal that went through was sent (monotonic)."""
        self._renewed_wall = 0.0
        """The same by the wall clock, which also counts a suspended or paused machine."""
        self._failed_at: float | None = None
        """When the last renewal failed, while none has gone through since."""
        self._retry = 1.0
        self._last_failure = ""

    @property
    def current(self) -> bool:
        """Whether the Lease carries the heartbeat: the last renewal went through, within two
        intervals."""
        return (self._failed_at is None and self._renewed_at is not None
                and self.monotonic() - self._renewed_at < 2 * self.every)

    def beat(self) -> bool:
        """Renews the Lease when due. True when a renewal went through after a failure or a
        gap of two intervals: the condition is to be published again at once."""
        now = self.monotonic()
        if self._failed_at is not None:
            if now - self._failed_at < self._retry:
                return False
        elif self._renewed_at is not None and now - self._renewed_at < self.every:
            return False
        spec = {"holderIdentity": self.holder, "renewTime": micro_time(self.clock()),
                "leaseDurationSeconds": round(LEASE_DURATION_INTERVALS * self.every)}
        try:
            self.cluster.renew_lease(self.namespace, self.name, spec)
        except KubeError as e:
            # Retried sooner than the interval, but backing off: thousands of agents retry
            # together while the API server is down.
            self._retry = min(self.every, 1.0 if self._failed_at is None else 2 * self._retry)
            self._failed_at = now
            if e.message != self._last_failure:
                log.warning("heartbeat lease %s/%s not renewed (%s); the node condition "
                            "carries the heartbeat until it is", self.namespace, self.name,
                            e.message)
            self._last_failure = e.message
            return False
        wall = self.clock()
        back = self._failed_at is not None or (self._renewed_at is not None and (
            now - self._renewed_at >= 2 * self.every
            or wall - self._renewed_wall >= 2 * self.every))
        if self._failed_at is not None:
            log.info("heartbeat lease %s/%s renewed again", self.namespace, self.name)
        self._renewed_at, self._renewed_wall = now, wall
        self._failed_at, self._last_failure = None, ""
        return back
