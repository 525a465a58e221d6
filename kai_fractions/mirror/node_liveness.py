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
`lastHeartbeatTime` has not changed for `stale_after_seconds`: with the Lease, the agent writes
its Node every 5 min), or, an agent without one, in the condition's `lastHeartbeatTime`.

Those times are written by the agent's clock, and no clock of another machine is trusted (as in
leader.py): an agent whose clock runs minutes behind would look silent however often it reports,
one that runs ahead would look alive long after it died. So they are judged as Kubernetes' node
lifecycle controller judges the kubelets' Leases, by observation: per node, the heartbeat values
last read (the conditions' `lastHeartbeatTime` and the Lease's `renewTime`, compared as written,
never parsed) and when each was first read, by the mirror's monotonic clock; a heartbeat is old
when the same value has been read for `stale_after_seconds`. The trade-off: a value read for the
first time (the mirror started, a new leader, a node not checked before) counts from then, like
the controller's probeTimestamp, so after a restart an agent that is already dead is found only
at a bind at least `stale_after_seconds` after the first one (with a Lease, read only once the
condition has stood still that long, one `stale_after_seconds` more). A True condition with no
heartbeat time, and no Lease, is silent at once: nothing there can change.

The patch (`kube/node_conditions.py`, shared with `kai-fractions retire-nodes`) carries the
node's resourceVersion, so a heartbeat that lands in between wins; the agent publishes its
condition again as soon as it can renew its Lease. Nothing here ever holds up a check: failures
(a Lease that cannot be read among them) are logged, mark nothing, and the node is read again at
a bind `RETRY_AFTER_FAILURE_SECONDS` later. Under leader election the
patch is sent only while the follower's term still runs by the clock (`in_term`, the
elector's); a mark dropped for that leaves the node to be read again at its next bind.

The nodes it marked are held silent (`silent_nodes`; told to `on_marked`, and to `on_cleared`
when they are no more) until they are seen otherwise: KAI binds nothing more there, so no bind
would ever read them again. Every `recheck_seconds` each one is read: once none of its
conditions says Unknown with reason NodeAgentSilent (its agent wrote the condition again, or
anyone else did) or the node is gone, it is let go; a read that fails keeps it. A bind that
reads it (its agent back, KAI placing there again) lets it go too. A mark whose answer was lost
(a timeout, a server error, an answer that is not JSON: the patch may have landed) is held all
the same, unconfirmed: the next read that finds the mark confirms it (`on_marked`, a mark
counted), one that does not lets it go without telling anyone; a refusal (409 among them)
proves nothing was written. `close()` (the follower
stops: its term ended, or the process) lets every one go: a standby holds none, and a new
leader knows only the nodes it marks itself (finding the earlier leader's would need a list
of every node).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..kube.client import Kube
from ..kube.errors import BadAnswer, Conflict, KubeError, NotFound, Transient
from ..kube.node_conditions import patch_conditions, true_conditions, unknown_condition
from ..kube.objects import heartbeat_lease_name, lease_path, node_path

log = logging.getLogger(__name__)

SILENT_REASON = "NodeAgentSilent"
NODES_KEPT = 20_000
"""Nodes remembered (when each was last checked, and the heartbeats last read there): more than
any cluster has GPU nodes; past it all are forgotten at once, and each then counts as first
seen."""
READS_AT_ONCE = 4
"""Nodes read at once: a wave of binds over thousands of nodes is read a few at a time."""
RETRY_AFTER_FAILURE_SECONDS = 5.0
"""After a failed check (the API server down or refusing), the node is read again at a bind this
much later, not at the next `recheck_seconds`: soon, without hammering an API server that is
down at every bind KAI makes."""


@dataclass(frozen=True, slots=True)
class Sighting:
    """A heartbeat as the mirror read it: the value as the agent wrote it, and when, by the
    mirror's monotonic clock, that value was first read."""

    value: str
    since: float


def sighted(last: Sighting | None, value: str | None, now: float) -> Sighting | None:
    """The sighting of `value` read at `now`: `last` when it is the same value, else a new one
    from `now` (a value that changed, or one read for the first time); None for no value."""
    if not value:
        return None
    if last is not None and last.value == value:
        return last
    return Sighting(value, now)


def heartbeats(node: Mapping[str, Any], types: Sequence[str]) -> dict[str, str]:
    """The `lastHeartbeatTime` of each condition of `types` that has one, by type, as written."""
    out = {}
    for c in (node.get("status") or {}).get("conditions") or []:
        if isinstance(c, dict) and c.get("type") in types:
            beat = c.get("lastHeartbeatTime")
            if isinstance(beat, str) and beat:
                out[c["type"]] = beat
    return out


def silent_conditions(node: Mapping[str, Any], types: Sequence[str], seen: Mapping[str, Sighting],
                      now: float, stale_after: float, lease: Sighting | None = None, *,
                      at: float) -> list[dict[str, Any]]:
    """The conditions of `types` that say True but whose agent has not said it is alive for
    `stale_after` seconds of the mirror's monotonic clock (`now`): neither their own
    `lastHeartbeatTime` (its sighting in `seen`, by type) nor the heartbeat Lease's renewTime
    (`lease`) changed in that time, or they have none; as their Unknown replacements, changed at
    `at` (the mirror's wall clock)."""
    out = []
    for c in true_conditions(node, types):
        own = seen.get(c["type"])
        beats = [s for s in (own, lease) if s is not None]
        if any(now - s.since < stale_after for s in beats):
            continue
        if not beats:
            since = "with no heartbeat time"
        else:
            last = max(beats, key=lambda s: s.since)  # the one that changed last
            what = "lastHeartbeatTime" if last is own else "heartbeat Lease's renewTime"
            since = (f"for {max(0.0, now - last.since):.0f} s by the mirror's clock (its {what} "
                     f"still {last.value})")
        out.append(unknown_condition(
            c, reason=SILENT_REASON, at=at,
            message=f"the kai-fractions node agent has not reported {since}: KAI places no "
                    "fractional pod here until it reports again"))
    return out


def marked_silent(node: Mapping[str, Any], types: Sequence[str]) -> bool:
    """Whether a condition of `types` still says Unknown with reason NodeAgentSilent (the
    mark, not yet overwritten by the agent or anyone else)."""
    return any(isinstance(c, dict) and c.get("type") in types and c.get("status") == "Unknown"
               and c.get("reason") == SILENT_REASON
               for c in (node.get("status") or {}).get("conditions") or [])


@dataclass(slots=True)
class _Node:
    """What is remembered of a node: when a bind may read it again (monotonic), and the
    heartbeats last read there."""

    due: float = -math.inf
    beats: dict[str, Sighting] = field(default_factory=dict)
    lease: Sighting | None = None


class NodeLiveness:
    """Reads the nodes binds go to, a few at a time, and sets their silent conditions Unknown
    (see the module's docstring); runs on the follower's event loop."""

    def __init__(self, kube: Kube, condition_types: Sequence[str], *,
                 stale_after_seconds: float, recheck_seconds: float = 60.0,
                 lease_namespace: str = "",
                 on_marked: Callable[[str], None] | None = None,
                 on_failed: Callable[[str], None] | None = None,
                 on_cleared: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic,
                 in_term: Callable[[], bool] | None = None) -> None:
        self.kube = kube
        self.in_term = in_term
        """Under leader election, the elector's `in_term`: tested just before the patch, which
        is dropped when it says False (None: no election)."""
        self.types = tuple(condition_types)
        self.stale_after = stale_after_seconds
        self.recheck = recheck_seconds
        self.lease_namespace = lease_namespace
        """Where the agents' heartbeat Leases are; "" reads none."""
        self.on_marked = on_marked
        """Told the node's name each time its conditions are set Unknown (the metrics)."""
        self.on_failed = on_failed
        """Told the node's name each time a check fails (the metrics)."""
        self.on_cleared = on_cleared
        """Told the name of a node it marked once it holds it silent no more (the metrics)."""
        self.clock = clock
        """The wall clock: only for the lastTransitionTime the mark writes."""
        self.monotonic = monotonic
        """What every decision is timed by."""
        self._nodes: dict[str, _Node] = {}
        self._tasks: set[asyncio.Task] = set()
        self._reads: asyncio.Semaphore | None = None  # made on the loop that runs the checks
        self._last_failure = ""
        self._silent: set[str] = set()
        self._unconfirmed: set[str] = set()
        """Of `_silent`, the nodes whose mark's answer was lost: not told to `on_marked` yet."""
        self._watching: asyncio.Task | None = None

    @property
    def silent_nodes(self) -> frozenset[str]:
        """The nodes this replica marked and holds silent now (a mark whose answer was lost,
        once a read has found it)."""
        return frozenset(self._silent - self._unconfirmed)

    def _node(self, node: str) -> _Node:
        known = self._nodes.get(node)
        if known is None:
            if len(self._nodes) >= NODES_KEPT:
                self._nodes.clear()
            known = self._nodes[node] = _Node()
        return known

    def saw(self, node: str) -> None:
        """A bind to `node` is being checked: its conditions are read soon, unless they were
        within `recheck_seconds` (or a check failed within RETRY_AFTER_FAILURE_SECONDS). Called
        on the event loop; returns at once."""
        now = self.monotonic()
        known = self._nodes.get(node)
        if not node or (known is not None and now < known.due):
            return
        self._node(node).due = now + self.recheck
        task = asyncio.get_running_loop().create_task(self._check_quietly(node),
                                                      name=f"node-liveness-{node}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Stops the checks and lets every silent node go (the follower stopped)."""
        tasks = [*self._tasks, *([self._watching] if self._watching is not None else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for node in sorted(self._silent):
            self._let_go(node)

    async def _check_quietly(self, node: str) -> None:
        if self._reads is None:
            self._reads = asyncio.Semaphore(READS_AT_ONCE)
        try:
            async with self._reads:
                await self.check(node)
        except KubeError as e:
            self._node(node).due = self.monotonic() + RETRY_AFTER_FAILURE_SECONDS
            if self.on_failed is not None:
                self.on_failed(node)
            if e.message != self._last_failure:  # once per distinct failure
                log.warning("node %s: its readiness not checked (%s); checked again at a "
                            "bind %g s or more later", node, e.message,
                            RETRY_AFTER_FAILURE_SECONDS)
            self._last_failure = e.message

    async def check(self, node: str) -> bool:
        """Sets `node`'s silent conditions Unknown; True when it did. Raises KubeError."""
        try:
            obj = await self.kube.request("GET", node_path(node), what=f"read node {node}")
        except NotFound:
            self._let_go(node)
            return False
        self._seen(node, obj)
        now = self.monotonic()
        known = self._node(node)
        beats = known.beats = {
            kind: s for kind, beat in heartbeats(obj, self.types).items()
            if (s := sighted(known.beats.get(kind), beat, now)) is not None}
        silent = silent_conditions(obj, self.types, beats, now, self.stale_after, known.lease,
                                   at=self.clock())
        if silent and self.lease_namespace:
            # Read only now: the Lease as last read (if ever) is no proof of life any more.
            renewed = await self._lease_renewed(node)
            now = self.monotonic()
            known = self._node(node)  # the same, unless NODES_KEPT made room meanwhile
            known.beats = beats
            known.lease = sighted(known.lease, renewed, now)
            silent = silent_conditions(obj, self.types, beats, now, self.stale_after,
                                       known.lease, at=self.clock())
        if not silent:
            return False
        if self.in_term is not None and not self.in_term():
            log.info("node %s: %s not set Unknown: this replica's term as the follower has "
                     "ended", node, ", ".join(c["type"] for c in silent))
            self._node(node).due = -math.inf  # nothing done: read again at its next bind
            return False
        try:
            await patch_conditions(self.kube, node, obj, silent,
                                   what=f"mark the conditions of node {node} Unknown")
        except Conflict:
            return False  # the node changed since it was read: perhaps the agent is back
        except (Transient, BadAnswer):
            # No answer that says whether it landed: held, and the next read tells.
            self._hold(node, confirmed=False)
            raise
        log.warning("node %s: %s set Unknown: %s", node, ", ".join(c["type"] for c in silent),
                    silent[0]["message"])
        if self.on_marked is not None:
            self.on_marked(node)
        self._hold(node)
        return True

    # -- the nodes held silent -----------------------------------------------------------------

    def _hold(self, node: str, *, confirmed: bool = True) -> None:
        if confirmed:
            self._unconfirmed.discard(node)
        elif node not in self._silent:
            self._unconfirmed.add(node)
        self._silent.add(node)
        if self._watching is None or self._watching.done():
            self._watching = asyncio.get_running_loop().create_task(
                self._watch_silent(), name="node-liveness-silent")

    def _let_go(self, node: str) -> None:
        if node in self._silent:
            self._silent.discard(node)
            if node in self._unconfirmed:
                self._unconfirmed.discard(node)  # never told: nothing to take back
            elif self.on_cleared is not None:
                self.on_cleared(node)

    def _seen(self, node: str, obj: Mapping[str, Any]) -> None:
        """`node` as read now: a node held lets go once its mark is gone; one held unconfirmed
        is confirmed once its mark is found."""
        if node not in self._silent:
            return
        if not marked_silent(obj, self.types):
            if node in self._unconfirmed:
                log.info("node %s: its condition does not say %s (the patch whose answer was "
                         "lost did not land, or was overwritten); not held", node, SILENT_REASON)
            else:
                log.info("node %s: its condition no longer says %s; no longer held silent",
                         node, SILENT_REASON)
            self._let_go(node)
        elif node in self._unconfirmed:
            self._unconfirmed.discard(node)
            log.warning("node %s: set Unknown (read back: the answer to its patch was lost)",
                        node)
            if self.on_marked is not None:
                self.on_marked(node)

    async def _watch_silent(self) -> None:
        """Every `recheck_seconds`, reads the nodes held silent, until none is."""
        while self._silent:
            await asyncio.sleep(self.recheck)
            nodes = sorted(self._silent)
            results = await asyncio.gather(*(self._still_silent(n) for n in nodes),
                                           return_exceptions=True)
            for node, result in zip(nodes, results, strict=True):
                if isinstance(result, Exception):  # not the API server's: keep it, go on
                    log.error("node %s: whether it is still silent not read", node,
                              exc_info=result)

    async def _still_silent(self, node: str) -> None:
        if self._reads is None:
            self._reads = asyncio.Semaphore(READS_AT_ONCE)
        try:
            async with self._reads:
                obj = await self.kube.request("GET", node_path(node), what=f"read node {node}")
        except NotFound:
            log.info("node %s: gone; no longer held silent", node)
            self._let_go(node)
            return
        except KubeError as e:  # proves nothing either way: read again next time
            if e.message != self._last_failure:
                log.warning("node %s: whether it is still silent not read (%s)", node,
                            e.message)
            self._last_failure = e.message
            return
        self._seen(node, obj)

    async def _lease_renewed(self, node: str) -> str | None:
        """The renewTime of the node agent's heartbeat Lease, as written (by the agent's clock:
        compared, never read as a time); None when it has none (an agent without
        `--heartbeat-lease-namespace`, or of an older release). Raises KubeError: a Lease that
        cannot be read proves nothing either way."""
        name = heartbeat_lease_name(node)
        if name is None:
            return None
        try:
            lease = await self.kube.request("GET", lease_path(self.lease_namespace, name),
                                            what=f"read lease {self.lease_namespace}/{name}")
        except NotFound:
            return None
        renewed = (lease.get("spec") or {}).get("renewTime")
        return renewed if isinstance(renewed, str) and renewed else None
