"""A node whose agent went silent is not left Ready for KAI.

KAI's scheduler places fractional pods only on nodes whose condition (`gpu-fractioning.nvidia.com/
Ready`) is True, and reads the status alone, never its heartbeat (upstream KAI-Scheduler
gpusharingnodevalidation). The agent sets it False when it stops cleanly; killed without that
(SIGKILL, out of memory, a hung process), it leaves it True, and KAI goes on binding pods that
then wait in their gate. So the follower tells `NodeLiveness` the node of every bind it checks;
at most once per `recheck_seconds` per node, the node is read, and each of its conditions still
True whose agent has not said it is alive for `stale_after_seconds` is set Unknown, reason
`NodeAgentSilent`. The agent says so every minute: in its heartbeat Lease
(`kai-fractions-agent.<node>` in `lease_namespace`, read only when the condition's own
`lastHeartbeatTime` is old: with the Lease, the agent writes its Node every 5 min), or, an agent
without one, in the condition's `lastHeartbeatTime`. The patch carries the node's
resourceVersion, so a heartbeat that lands in between wins; the agent publishes its condition
again as soon as it can renew its Lease. Nothing here ever holds up a check: failures (a Lease
that cannot be read among them) are logged, mark nothing, and are tried again at the node's next
bind.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..kube.client import STRATEGIC_MERGE_PATCH, Kube
from ..kube.errors import Conflict, KubeError, NotFound
from ..kube.objects import (
    condition_time,
    epoch_seconds,
    heartbeat_lease_name,
    lease_path,
    node_path,
)

log = logging.getLogger(__name__)

SILENT_REASON = "NodeAgentSilent"
NODES_KEPT = 20_000
"""Nodes whose last check is remembered (more than any cluster has GPU nodes)."""
READS_AT_ONCE = 4
"""Nodes read at once: a wave of binds over thousands of nodes is read a few at a time."""


def silent_conditions(node: Mapping[str, Any], types: Sequence[str], now: float,
                      stale_after: float, alive_at: float | None = None
                      ) -> list[dict[str, Any]]:
    """The conditions of `types` that say True but whose agent last said it was alive (its
    heartbeat Lease renewed at `alive_at`, or the condition's `lastHeartbeatTime`, whichever is
    later) more than `stale_after` seconds before `now`, or never; as their Unknown
    replacements."""
    out = []
    for c in (node.get("status") or {}).get("conditions") or []:
        if not isinstance(c, dict) or c.get("type") not in types or c.get("status") != "True":
            continue
        beat = epoch_seconds(c.get("lastHeartbeatTime"))
        last = max((t for t in (beat, alive_at) if t is not None), default=None)
        if last is not None and now - last <= stale_after:
            continue
        if last is None:
            since = "with no heartbeat time"
        else:
            when = c.get("lastHeartbeatTime") if last == beat else condition_time(last)
            since = f"since {when} ({max(0.0, now - last):.0f} s)"
        out.append({
            "type": c["type"], "status": "Unknown", "reason": SILENT_REASON,
            "message": f"the kai-fractions node agent has not reported {since}: KAI places "
                       "no fractional pod here until it reports again",
            "lastHeartbeatTime": c.get("lastHeartbeatTime"),
            "lastTransitionTime": condition_time(now)})
    return out


class NodeLiveness:
    """Reads the nodes binds go to, a few at a time, and sets their silent conditions Unknown
    (see the module's docstring); runs on the follower's event loop."""

    def __init__(self, kube: Kube, condition_types: Sequence[str], *,
                 stale_after_seconds: float, recheck_seconds: float = 60.0,
                 lease_namespace: str = "",
                 on_marked: Callable[[str], None] | None = None,
                 on_failed: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.kube = kube
        self.types = tuple(condition_types)
        self.stale_after = stale_after_seconds
        self.recheck = recheck_seconds
        self.lease_namespace = lease_namespace
        """Where the agents' heartbeat Leases are; "" reads none."""
        self.on_marked = on_marked
        """Told the node's name each time its conditions are set Unknown (the metrics)."""
        self.on_failed = on_failed
        """Told the node's name each time a check fails (the metrics)."""
        self.clock = clock
        self.monotonic = monotonic
        self._checked: dict[str, float] = {}
        self._tasks: set[asyncio.Task] = set()
        self._reads: asyncio.Semaphore | None = None  # made on the loop that runs the checks
        self._last_failure = ""

    def saw(self, node: str) -> None:
        """A bind to `node` is being checked: its conditions are read soon, unless they were
        within `recheck_seconds`. Called on the event loop; returns at once."""
        now = self.monotonic()
        if not node or now - self._checked.get(node, -self.recheck) < self.recheck:
            return
        if len(self._checked) >= NODES_KEPT:
            self._checked.clear()
        self._checked[node] = now
        task = asyncio.get_running_loop().create_task(self._check_quietly(node),
                                                      name=f"node-liveness-{node}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _check_quietly(self, node: str) -> None:
        if self._reads is None:
            self._reads = asyncio.Semaphore(READS_AT_ONCE)
        try:
            async with self._reads:
                await self.check(node)
        except KubeError as e:
            if self.on_failed is not None:
                self.on_failed(node)
            if e.message != self._last_failure:  # once per distinct failure
                log.warning("node %s: its readiness not checked (%s); checked again at a "
                            "later bind", node, e.message)
            self._last_failure = e.message

    async def check(self, node: str) -> bool:
        """Sets `node`'s silent conditions Unknown; True when it did. Raises KubeError."""
        try:
            obj = await self.kube.request("GET", node_path(node), what=f"read node {node}")
        except NotFound:
            return False
        now = self.clock()
        silent = silent_conditions(obj, self.types, now, self.stale_after)
        if silent and self.lease_namespace:
            renewed = await self._lease_renewed(node)
            if renewed is not None:
                silent = silent_conditions(obj, self.types, now, self.stale_after, renewed)
        if not silent:
            return False
        version = (obj.get("metadata") or {}).get("resourceVersion")
        # Strategic merge: the API server merges conditions by type, so the others stay.
        body = {"metadata": {"resourceVersion": version}, "status": {"conditions": silent}}
        try:
            await self.kube.request("PATCH", node_path(node) + "/status", body=body,
                                    what=f"mark the conditions of node {node} Unknown",
                                    content_type=STRATEGIC_MERGE_PATCH)
        except Conflict:
            return False  # the node changed since it was read: perhaps the agent is back
        log.warning("node %s: %s set Unknown: %s", node, ", ".join(c["type"] for c in silent),
                    silent[0]["message"])
        if self.on_marked is not None:
            self.on_marked(node)
        return True

    async def _lease_renewed(self, node: str) -> float | None:
        """When the node agent last renewed its heartbeat Lease (seconds since the epoch); None
        when it has none (an agent without `--heartbeat-lease-namespace`, or of an older
        release). Raises KubeError: a Lease that cannot be read proves nothing either way."""
        name = heartbeat_lease_name(node)
        if name is None:
            return None
        try:
            lease = await self.kube.request("GET", lease_path(self.lease_namespace, name),
                                            what=f"read lease {self.lease_namespace}/{name}")
        except NotFound:
            return None
        return epoch_seconds((lease.get("spec") or {}).get("renewTime"))
