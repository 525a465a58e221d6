"""The labels of the nodes the mirror's calls name, read from the API at most every
NODE_LABELS_TTL seconds per node.

Apart from the service because how long a node's labels may be reused, and when a node must be
asked again, is a rule of its own (a new node's GPU memory label comes a while after it joins).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from ..clock import Clock
from ..contract import keys as k
from .decision import label_memory_mib
from .store import Deadline, NodeNotFound, PodStore

log = logging.getLogger(__name__)

NODE_LABELS_TTL = 30.0
"""Seconds a node's labels are reused (see NodeLabelCache.get): a label that changes, or a node
recreated under its name with another GPU, reaches the calls this much later."""
NODE_LABELS_RETRY = 2.0
"""Seconds a node without a usable GPU memory label is reused by calls that need it."""
NODES_KEPT = 20_000


@dataclass(frozen=True, slots=True)
class _NodeEntry:
    read_at: float
    uid: str
    labels: Mapping[str, str]
    knows_memory: bool


class NodeLabelCache:
    """Node name -> its labels as last read, with when and under which uid."""

    def __init__(self, store: PodStore, clock: Clock) -> None:
        self.store = store
        self.clock = clock
        self.entries: dict[str, _NodeEntry] = {}

    async def get(self, node: str, needs_memory: bool, deadline: Deadline
                  ) -> Mapping[str, str] | None:
        """The node's labels, read at most every NODE_LABELS_TTL seconds per node: every
        fractional call checks that its node exists, and a node's GPU memory label seldom
        changes. A node that is not there is asked again on the next call, and so is one
        without a usable GPU memory label by a call that needs it, after NODE_LABELS_RETRY
        seconds: GPU feature discovery labels a new node a while after it joins, and a refusal
        (INVALID_ARGUMENT) is final to a scheduler, yet a caller must not turn every call into
        a read. A read that finds another uid (the node was recreated) replaces the entry."""
        now = self.clock.monotonic()
        cached = self.entries.get(node)
        if cached is not None and now - cached.read_at < (
                NODE_LABELS_TTL if cached.knows_memory or not needs_memory
                else NODE_LABELS_RETRY):
            return cached.labels
        try:
            labels = await self.store.node_labels(node, deadline)
        except NodeNotFound:
            self.entries.pop(node, None)
            return None
        uid = str(getattr(labels, "uid", ""))
        if cached is not None and cached.uid != uid:
            log.info("node %s was recreated (uid %s, was %s): its labels are read anew",
                     node, uid or "-", cached.uid or "-")
        if len(self.entries) >= NODES_KEPT:
            self.entries.clear()  # a cluster's node count is far below this; never unbounded
        usable = label_memory_mib(labels.get(k.NODE_GPU_MEMORY_LABEL)) is not None
        self.entries[node] = _NodeEntry(now, uid, labels, usable)
        return labels
