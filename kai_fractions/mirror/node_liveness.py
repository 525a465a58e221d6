"""A node whose agent went silent is not left Ready for KAI.

KAI's scheduler places fractional pods only on nodes whose condition (`gpu-fractioning.nvidia.com/
Ready`) is True, and reads the status alone, never its heartbeat (upstream KAI-Scheduler
gpusharingnodevalidation). The agent sets it False when it stops cleanly; killed without that
(SIGKILL, out of memory, a hung process), it leaves it True, and KAI goes on binding pods that
then wait in their gate. So the follower tells `NodeLiveness` the node of every bind it checks;
at most once per `recheck_seconds` per node, the node is read, and each of its conditions still
True whose `lastHeartbeatTime` (the agent renews it every minute) is older than
`stale_after_seconds` is set Unknown, reason `NodeAgentSilent`. The patch carries the node's
resourceVersion, so a heartbeat that lands in between wins; the agent's next heartbeat sets the
condition True again. Nothing here ever holds up a check: failures are logged, and tried again
at the node's next bind.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..kube.client import STRATEGIC_MERGE_PATCH, Kube
from ..kube.errors import Conflict, KubeError, NotFound
from ..kube.objects import condition_time, node_path, seconds_since

log = logging.getLogger(__name__)

SILENT_REASON = "NodeAgentSilent"
NODES_KEPT = 20_000
"""Nodes whose last check is remembered (more than any cluster has GPU nodes)."""
READS_AT_ONCE = 4
"""Nodes read at once: a wave of binds over thousands of nodes is read a few at a time."""


def silent_conditions(node: Mapping[str, Any], types: Sequence[str], now: float,
                      stale_after: float) -> list[dict[str, Any]]:
    """The conditions of `types` that say True but were last renewed more than `stale_after`
    seconds before `now` (or carry no renewal time at all), as their Unknown replacements."""
    out = []
    for c in (node.get("status") or {}).get("conditions") or []:
        if not isinstance(c, dict) or c.get("type") not in types or c.get("status") != "True":
            continue
        age = seconds_since(c.get("lastHeartbeatTime"), now)
        if age is not None and age <= stale_after:
            continue
        since = (f"since {c.get('lastHeartbeatTime')} ({age:.0f} s)"
                 if age is not None else "with no heartbeat time")
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
                 on_marked: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.kube = kube
        self.types = tuple(condition_types)
        self.stale_after = stale_after_seconds
        self.recheck = recheck_seconds
        self.on_marked = on_marked
        """Told the node's name each time its conditions are set Unknown (the metrics)."""
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
        silent = silent_conditions(obj, self.types, self.clock(), self.stale_after)
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
