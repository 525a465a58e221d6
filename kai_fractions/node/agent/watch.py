"""The node's pods as the API server says: a list, then a watch, forever.

`PodWatcher` keeps `PodCache` equal to the pods bound to this node with the one list + watch
loop of `kai_fractions.kube.listwatch`, run on the source's event loop: a list replaces the
cache (so a pod deleted while the watch was down disappears), the watch resumes from the last
resourceVersion seen. A 410 Gone relists at once; any other failure relists after a jittered
exponential backoff (0.5 s doubling to 30 s), and the time since the API was last reachable
feeds the node condition (NotReconciling).

Under a rollout every agent starts at once: the first list waits a random part of
`first_list_jitter` seconds, and with `cached_lists` lists ask for resourceVersion "0", which
the API server answers from its watch cache (indexed by node) instead of a read of every pod
from etcd; the list after a 410 stays a consistent read, so a cache behind the expired watch
cannot send the agent round again (as client-go's reflector does). A watch cache may also lag
behind etcd and lack a pod started meanwhile: the pods such a list lacks that the agent knew,
or holds a marker for, are taken for gone only once a consistent list agrees
(`confirm_absent`, which the reconciler asks before it clears anything).

Every change calls `on_change`, which only marks the worker dirty: the worker reads the whole
cache (level-triggered), so coalesced or replayed events are harmless. A pod the watch saw
deleted is remembered for a while (`TOMBSTONES`): a read that began before the deletion (a
consistent list confirming pods, the answer to an annotation patch) must not bring it back.
"""

from __future__ import annotations

import concurrent.futures
import copy
import logging
import random
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, NoReturn

from ...clock import AsyncClock, SystemClock
from ...kube.errors import KubeError
from ...kube.listwatch import WATCH_BACKOFF, WATCH_CACHE, Source, list_watch
from ...kube.objects import later_version, resource_version, uid_of
from ...kube.retry import Backoff
from .kube import PodSource, on_node

log = logging.getLogger(__name__)

TOMBSTONES = 1024
"""Deleted pods remembered (uid and the deletion's resourceVersion), oldest dropped first: far
more than a node deletes while one read is in flight."""


class PodCache:
    """uid -> pod manifest of the pods bound to this node; thread-safe."""

    def __init__(self, monotonic: Callable[[], float] = time.monotonic):
        self._lock = threading.Lock()
        self._pods: dict[str, dict[str, Any]] = {}
        self._deleted: OrderedDict[str, str] = OrderedDict()
        """uid -> resourceVersion of its deletion, for the pods the watch saw deleted."""
        self._monotonic = monotonic
        self.synced = False
        """True once a list succeeded: before that the agent must not apply anything (an apply
        without the node's pods would clear the limits of every running pod)."""
        self.consistent = True
        """False after a list from the API server's watch cache (`cached_lists`), which may lag
        behind etcd and lack a pod started meanwhile, until a consistent list confirms the pods
        the agent would otherwise take for gone (`PodWatcher.confirm_absent`)."""
        self.generation = 0
        """Lists handed to `replace` so far."""
        self.api_down_since: float | None = None
        """Monotonic time of the first failure of the current streak; None while the API
        answers."""
        self.last_error: str | None = None

    def replace(self, pods: list[dict[str, Any]], *, consistent: bool = True) -> None:
        with self._lock:
            self._pods = {uid_of(p): p for p in pods if uid_of(p)}
            self.consistent = consistent
            self.generation += 1
            self.synced = True
            self.api_down_since = None
            self.last_error = None

    def upsert(self, pod: dict[str, Any]) -> bool:
        """Stores `pod` unless the cache already has a newer version of it."""
        with self._lock:
            return self._upsert(pod)

    def _upsert(self, pod: dict[str, Any]) -> bool:
        uid = uid_of(pod)
        if not uid:
            return False
        deleted = self._deleted.get(uid)
        if deleted is not None and not later_version(resource_version(pod), deleted):
            return False  # read before its deletion (uids are never reused): no ghost
        old = self._pods.get(uid)
        if old is not None and later_version(resource_version(old), resource_version(pod)):
            return False
        self._pods[uid] = pod
        return True

    def confirm(self, generation: int, found: list[dict[str, Any]]) -> None:
        """What a consistent list said of the pods absent from list `generation`: those it
        `found` are stored (unless a newer version is here), and the cache is consistent again,
        unless another list replaced it meanwhile."""
        with self._lock:
            for pod in found:
                self._upsert(pod)
            if self.generation == generation:
                self.consistent = True

    def remove(self, uid: str, *, deleted: str | None = None) -> bool:
        """`deleted`: the resourceVersion of the pod's deletion, when the watch said so; a later
        upsert of an older version of it is then ignored."""
        with self._lock:
            if deleted is not None:
                self._deleted[uid] = deleted
                self._deleted.move_to_end(uid)
                while len(self._deleted) > TOMBSTONES:
                    self._deleted.popitem(last=False)
            return self._pods.pop(uid, None) is not None

    def failed(self, error: str) -> None:
        with self._lock:
            if self.api_down_since is None:
                self.api_down_since = self._monotonic()
            self.last_error = error

    def snapshot(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            return dict(self._pods)

    def __contains__(self, uid: object) -> bool:
        with self._lock:
            return uid in self._pods

    def get(self, uid: str) -> dict[str, Any] | None:
        with self._lock:
            pod = self._pods.get(uid)
            return copy.deepcopy(pod) if pod is not None else None


CONFIRM_TIMEOUT = 30.0
"""The longest a pass waits for the consistent list that confirms pods gone."""


class _Listing:
    """The node's pods as `list_watch` lists and watches them, remembering whether the last
    list was asked of the API server's watch cache."""

    def __init__(self, source: Source) -> None:
        self.source = source
        self.what = source.what
        self.from_watch_cache = False

    async def list(self, resource_version: str = "") -> tuple[list[Any], str]:
        listed = await self.source.list(resource_version)
        self.from_watch_cache = resource_version == WATCH_CACHE
        return listed

    def watch(self, resource_version: str) -> AsyncIterator[tuple[str, Mapping[str, Any]]]:
        return self.source.watch(resource_version)


class PodWatcher:
    def __init__(self, source: PodSource, node: str, cache: PodCache,
                 on_change: Callable[[], None], *, resync_seconds: float = 300.0,
                 backoff: Backoff = WATCH_BACKOFF,
                 monotonic: Callable[[], float] = time.monotonic,
                 clock: AsyncClock | None = None, rng: random.Random | None = None,
                 first_list_jitter: float = 0.0, cached_lists: bool = False):
        self.source = source
        self.node = node
        self.cache = cache
        self.on_change = on_change
        self.resync_seconds = resync_seconds
        self.backoff = backoff
        self.monotonic = monotonic
        self.clock = clock or SystemClock()
        self.rng = rng or random.Random()
        self.first_list_jitter = first_list_jitter
        self.cached_lists = cached_lists
        self._listing: _Listing | None = None

    def run(self, stop: threading.Event) -> None:
        """Lists and watches on the source's loop until `stop` is set; the loop's list or
        watch is cancelled then, so this returns at once."""
        future = self.source.spawn(self.watch())
        future.add_done_callback(self._ended)
        try:
            stop.wait()
        finally:
            future.cancel()

    async def watch(self) -> NoReturn:
        """The loop itself; ends only when cancelled."""
        if self.first_list_jitter > 0:
            wait = self.rng.uniform(0, self.first_list_jitter)
            log.info("first list of node %s's pods in %.2f s (agents restarted together "
                     "list apart)", self.node, wait)
            await self.clock.asleep(wait)
        self._listing = _Listing(self.source.node_pods(self.node))
        await list_watch(self._listing, self._listed, self._event,
                         on_failure=self._failed, backoff=self.backoff, rng=self.rng,
                         resync_seconds=self.resync_seconds, relist_after_failure=True,
                         cached_lists=self.cached_lists, monotonic=self.monotonic,
                         clock=self.clock)

    def list_once(self) -> None:
        """One consistent list handed to the cache as the loop hands its lists (what the
        agent's tests drive it with)."""
        items, _ = self.source.spawn(self.source.node_pods(self.node).list("")).result()
        self._listed(items, consistent=True)

    def _listed(self, items: list[Any], consistent: bool | None = None) -> None:
        """`consistent` None: as the loop asked for its last list."""
        if consistent is None:
            consistent = self._listing is None or not self._listing.from_watch_cache
        self.cache.replace([p for p in items if on_node(p, self.node)], consistent=consistent)
        self.on_change()

    def confirm_absent(self, uids: set[str], generation: int,
                       timeout: float = CONFIRM_TIMEOUT) -> bool:
        """After list `generation`, from the watch cache: a consistent list of the node's pods,
        for the `uids` that list lacks and the agent would take for gone (it knew them, or
        their marker is here). Those it finds go back into the cache; the others are gone
        indeed. False when the API did not answer: nothing may be taken for gone then (its
        limits would be cleared while it may still run). It vouches for list `generation`
        only: a list that replaced it meanwhile may lack other pods (`PodCache.confirm`)."""
        future = self.source.spawn(self.source.node_pods(self.node).list(""))
        try:
            items, _ = future.result(timeout)
        except (KubeError, TimeoutError) as e:
            future.cancel()
            log.warning("a list from the watch cache lacks %d pod(s) this agent had limits "
                        "or markers for, and the consistent list to confirm they are gone "
                        "failed (%s): nothing is applied or cleared until one answers",
                        len(uids), e)
            return False
        found = [dict(p) for p in items if on_node(p, self.node) and uid_of(p) in uids]
        self.cache.confirm(generation, found)
        if found:
            log.warning("the list from the watch cache lacked %d pod(s) still on this node "
                        "(the cache lagged): kept", len(found))
        return True

    def _failed(self, error: KubeError) -> None:
        self.cache.failed(error.message)

    def _event(self, kind: str, pod: Mapping[str, Any]) -> None:
        uid = uid_of(pod)
        if kind == "BOOKMARK" or not uid:
            return
        if kind == "DELETED":
            changed = self.cache.remove(uid, deleted=resource_version(pod))
        elif not on_node(pod, self.node):
            changed = self.cache.remove(uid)
        elif kind in ("ADDED", "MODIFIED"):
            changed = self.cache.upsert(dict(pod))
        else:
            return
        if changed:
            self.on_change()

    def _ended(self, future: concurrent.futures.Future[Any]) -> None:
        if future.cancelled():
            return
        error = future.exception()
        if error is not None:  # a bug in a handler: said, and kept in the condition
            log.error("the watch of node %s's pods stopped: %s", self.node, error,
                      exc_info=error)
            self.cache.failed(f"the pod watch stopped: {type(error).__name__}: {error}")
