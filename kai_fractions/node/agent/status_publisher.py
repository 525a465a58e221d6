"""Publishes the node condition (`condition.evaluate`) on the Node, and the GPU memory label.

Apart from `condition`, which decides what the condition says from what the agent saw: here is
what writes it, from a thread of its own so that a stuck worker is still reported. The publisher
patches `nodes/status` when the condition changes, and otherwise every heartbeat interval
(`lastHeartbeatTime`), or with a heartbeat Lease (`heartbeat.py`) only every status report
interval while the Lease is renewed; `lastTransitionTime` moves only when the status does
(across agent restarts too: it is read back from the node).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ...contract import MIB
from ...contract import keys as k
from ...kube.errors import KubeError
from ...kube.objects import condition_time, heartbeat_lease_name
from ..inventory import Inventory
from .condition import Condition
from .heartbeat import HeartbeatLease
from .kube import ClusterWriter
from .options import AgentOptions

# The condition module's logger, as before this code moved here: what operators filter on.
log = logging.getLogger(f"{__package__}.condition")


class StatusPublisher:
    """Publishes the condition (and the GPU memory label) from its own thread, so that a stuck
    worker is still reported."""

    def __init__(self, cluster: ClusterWriter, node: str, options: AgentOptions,
                 condition: Callable[[], Condition | None],
                 smallest_gpu_mib: Callable[[], int | None] = lambda: None, *,
                 clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic):
        self.cluster = cluster
        self.node = node
        self.options = options
        self.condition = condition
        self.smallest_gpu_mib = smallest_gpu_mib
        self.clock = clock
        self.monotonic = monotonic
        self.published: Condition | None = None
        self._published_at = float("-inf")
        self._transitions: dict[str, str] | None = None
        """condition type -> lastTransitionTime, as read from the node once."""
        self._label_done = not options.publish_gpu_memory_label
        self._last_failure: str | None = None
        self.wake = threading.Event()
        self._current = False
        """The last condition patch went through: only then does the Lease say "alive" (a
        fresh Lease beside a condition the agent cannot write would hide a stale True)."""
        self._republish = False
        """A renewal came back after a failure or a gap: publish before the next report."""
        lease = heartbeat_lease_name(node)
        self.lease = (HeartbeatLease(cluster, options.heartbeat_lease_namespace, lease, node,
                                     options.heartbeat_seconds, clock=clock, monotonic=monotonic)
                      if options.heartbeat_lease_namespace and lease else None)
        if options.heartbeat_lease_namespace and lease is None:
            log.warning("node name %s too long for a heartbeat Lease name: the node condition "
                        "carries the heartbeat", node)

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self.tick()
            self.wake.wait(self.options.status_tick_seconds)
            self.wake.clear()

    def tick(self, *, force: bool = False) -> bool:
        """Renews the heartbeat Lease and publishes the condition when due; True when a
        condition patch went through."""
        self._label()
        published = False
        cond = self.condition()  # None: nothing known yet, publishing "not ready" would flap
        if cond is not None:
            every = (self.options.status_report_seconds
                     if self.lease is not None and self.lease.current
                     else self.options.heartbeat_seconds)
            due = self.monotonic() - self._published_at >= every
            if force or self._republish or due or cond != self.published:
                published = self.publish(cond)
        # After the condition: a renewal says the condition on the Node is current.
        if self.lease is not None and self._current and self.lease.beat():
            self._republish = True  # the follower may have set it Unknown meanwhile
        return published

    def _previous_transitions(self) -> dict[str, tuple[str, str]]:
        node = self.cluster.get_node(self.node)
        out = {}
        for c in (node.get("status") or {}).get("conditions") or []:
            if isinstance(c, dict) and c.get("type") in self.options.condition_types:
                out[str(c["type"])] = (str(c.get("status")), str(c.get("lastTransitionTime")))
        return out

    def publish(self, cond: Condition) -> bool:
        now = self.clock()
        status = "True" if cond.ready else "False"
        try:
            if self._transitions is None:
                previous = self._previous_transitions()
                self._transitions = {t: when for t, (s, when) in previous.items()
                                     if s == status and when not in ("", "None")}
            changed = self.published is None or self.published.ready != cond.ready
            conditions = []
            for kind in self.options.condition_types:
                if changed and (self.published is not None or kind not in self._transitions):
                    self._transitions[kind] = condition_time(now)
                conditions.append({
                    "type": kind, "status": status, "reason": cond.reason,
                    "message": cond.message, "lastHeartbeatTime": condition_time(now),
                    "lastTransitionTime": self._transitions.get(kind, condition_time(now))})
            self.cluster.patch_node_status(self.node, conditions)
        except KubeError as e:
            self._current = False
            if e.message != self._last_failure:  # once per distinct failure, not every tick
                log.warning("node condition not published (%s); retried every %gs", e.message,
                            self.options.status_tick_seconds)
            self._last_failure = e.message
            return False
        self._last_failure = None
        self._current, self._republish = True, False
        if cond != self.published:
            log.info("node condition %s=%s (%s): %s", self.options.condition_name, status,
                     cond.reason, cond.message)
        self.published = cond
        self._published_at = self.monotonic()
        return True

    def _label(self) -> None:
        if self._label_done:
            return
        mib = self.smallest_gpu_mib()
        if mib is None:
            return
        try:
            node = self.cluster.get_node(self.node)
            labels = (node.get("metadata") or {}).get("labels") or {}
            if k.NODE_GPU_MEMORY_LABEL not in labels:
                self.cluster.patch_node_labels(self.node, {k.NODE_GPU_MEMORY_LABEL: str(mib)})
                log.info("labelled node %s %s=%d", self.node, k.NODE_GPU_MEMORY_LABEL, mib)
            self._label_done = True
        except KubeError as e:
            if e.message != self._last_failure:
                log.warning("node label %s not published (%s); retried",
                            k.NODE_GPU_MEMORY_LABEL, e.message)
            self._last_failure = e.message


def smallest_gpu_mib(inventory: Inventory | None) -> int | None:
    if inventory is None or not inventory.devices:
        return None
    return min(d.memory_total for d in inventory.devices) // MIB

