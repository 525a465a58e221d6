"""The mirror's watch-fed cache of pods: the usual MirrorAllocation costs one API request (the
guarded PATCH) instead of two (GET, then PATCH).

The cache only ever saves a read; correctness never rests on it being fresh (MirrorService):
* a write carries the cached uid and resourceVersion as its precondition, so a stale entry makes
  the API server refuse it (409) and the service reads the pod from the API and recomputes;
* an answer that writes nothing ("the pod already carries this allocation") and a refusal
  (an invalid annotation, another allocation on the pod) are confirmed by a read from the API
  first, so a stale entry never turns into a success nobody checked, nor into a wrong refusal;
* a pod the cache lacks, or holds with another uid than the caller names, is read from the API.

Entries keep only what the contract reads, shared between pods (`pod_trimming`), and only for
Pending pods (`pod_feed.pod_selector`).
A pod that carries the mirror's record (it was allocated, and waits for its bind or its start)
is kept as its identity alone (`ALLOCATED`, `pod_trimming`), and a lookup of it misses:
a duplicate call or a conflicting allocation for such a pod is answered from the API server's
copy anyway, and a rebind (`replace`) of an allocated pod is rare, so its annotations, the
largest and least shared part of a pod, would save next to no read. What the entry still does
is keep an older copy of the pod (a list that started before the write) from taking its place.
The cache is fed from outside: by a list + watch of pods on the mirror server's event loop
(`pod_feed`), by every pod the mirror reads, and by every pod a PATCH returns (write-through),
newest resourceVersion first. A pod the watch deleted is remembered for a while (a tombstone,
`_bury`), so that the late answer of a read or write of it that was in flight does not bring it
back, over the pod recreated under its name, until the next list.
What the list and the watch bring is also prepared for an allocation (`prepare`: the mirror
parses it as its user wrote it) while the pod waits for the scheduler, for at most
`PREPARED_KEPT` pods at a time (a parse costs memory per pod): the head of the queue, in the
order the cache learned of its pods. Slots that free (the mirror wrote the pod, or it left) are
refilled in gaps between the calls with the oldest pods still waiting (`_refill`, a quarter of
the slots at a time), so a scheduler that works through a long queue finds the next pods
parsed; a pod allocated before its turn is parsed by its allocation, and one the mirror has
allocated is never prepared.

A queue of tens of thousands of Pending pods must not stall the loop that serves (measured as
P6 in benchmarks/): on that loop, the list is trimmed and stored page by page as it arrives
(`keep`), then merged (prepared, and the pods it lacks removed) in slices of at most
`SLICE_SECONDS` of work (`merge_soon`); each page and each slice waits for a gap between the
calls (`foreground`); watch events that arrive meanwhile win over the list. Watch events are
applied in such slices too (`event_soon`): a Job of thousands of pods created at once brings
them back to back.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import logging
import re
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from ..kube.objects import later_version
from .foreground import Foreground, Slices
from .pod_trimming import ALLOCATED, _shared, trimmed  # noqa: F401  (_shared: re-exported)
from .record import MIRRORED_ANNOTATION  # noqa: F401  (re-exported)
from .store import PodSnapshot

# The trimming lives in `pod_trimming`; `trimmed`, ALLOCATED, its table of shared values
# (`_shared`) and MIRRORED_ANNOTATION are re-exported: tests/mirror/test_pod_cache.py reads
# them from this module.

log = logging.getLogger(__name__)


def _holds(old: PodSnapshot | None, pod: PodSnapshot) -> bool:
    """Whether `old` is the same pod as `pod` at its version or a later one. Another uid is
    always news: versions of two pods are compared by no one (an etcd restored from a backup
    numbers anew, and a list must always win over the cache); a late answer about a deleted
    pod is kept out by its tombstone instead (`_buried`). A pod without a version is news too
    (nothing orders it, and it must not pin a stale entry); a version that is not a number
    counts as not later, which at worst costs one refused write and a re-read."""
    return old is not None and old.uid == pod.uid and bool(pod.resource_version) and (
        old.resource_version == pod.resource_version
        or later_version(old.resource_version, pod.resource_version))


_RESOURCE_VERSION = re.compile(r'"resourceVersion":"([^"]*)"')
_RESOURCE_VERSION_BYTES = re.compile(rb'"resourceVersion":"([^"]*)"')
ECHOES_KEPT = 4096
"""resourceVersions of the mirror's own writes kept until their watch event arrives (more are
only in flight when the watch lags far behind; a forgotten one just costs a parse)."""
PREPARED_KEPT = 256
"""Pods held prepared at most: the oldest ones held, which a scheduler that binds its queue in
order binds first; a gang of this many starts from parsed pods, and the slots its pods free are
refilled between the calls. The bound keeps a large queue's memory to the trimmed pods."""
TOMBSTONES_KEPT = 4096
"""Deleted pods remembered at most (`_bury`): the oldest is forgotten first."""
TOMBSTONE_SECONDS = 60.0
"""How long a deleted pod is remembered: longer than any read or write of it still in flight
(a request's timeout and its retries), whose late answer would otherwise bring it back."""
SETTLE_EVERY = 1000
"""Listed pods between two `settle()`s (each a young collection, then gc.freeze)."""
SLICE_SECONDS = 0.0005
"""The most work a list's merge does on the serving loop at a time: a call that arrives
meanwhile waits for one slice at most (between slices the merge waits for a gap between calls:
`foreground`)."""


class PodCache:
    """(namespace, name) -> trimmed PodSnapshot; thread-safe."""

    def __init__(self, prepare: Callable[[PodSnapshot], object] | None = None, *,
                 prepared_kept: int = PREPARED_KEPT, slice_seconds: float = SLICE_SECONDS,
                 foreground: Foreground | None = None,
                 monotonic: Callable[[], float] = time.perf_counter) -> None:
        self.prepare = prepare
        """Run on the pods the list and the watch bring in that carry no allocation of the
        mirror's, up to `prepared_kept` held at a time: the work an allocation for the
        pod would otherwise start with, done while the pod waits to be scheduled (the
        mirror's is compute.user_request, which the others run on first use)."""
        self._lock = threading.Lock()
        self._pods: dict[tuple[str, str], PodSnapshot] = {}
        self._echoes: dict[str, None] = {}  # an ordered set: the oldest is forgotten first
        self._tombstones: dict[tuple[str, str, str], float] = {}
        """Pods the watch said were deleted: (namespace, name, uid) -> when, oldest
        first, at most TOMBSTONES_KEPT for TOMBSTONE_SECONDS (`_bury`)."""
        self.synced = False
        """True once a list arrived. Lookups do not wait for it: until then only the pods read
        or written so far are here, and every other pod is read from the API."""
        self.hits = 0
        self.misses = 0
        self.prepared_kept = prepared_kept
        self.slice_seconds = slice_seconds
        self.foreground = foreground or Foreground()
        """The calls in flight on the serving loop (MirrorService marks its own): the list's
        work on that loop waits for a gap between them (its feed's pace, the merge's slices)."""
        self._monotonic = monotonic
        self._event_slices = Slices(self.foreground, slice_seconds, monotonic)
        self._prepared: set[tuple[str, str]] = set()  # the keys whose entry was prepared
        self._waiting: collections.deque[tuple[str, str]] = collections.deque()
        """Keys brought in while every slot was taken, oldest first (some may have left or been
        prepared since: skipped when their turn comes); `_refill` prepares them."""
        self._refilling: asyncio.Task | None = None
        self._touched: set[tuple[str, str]] | None = None
        """While a list is merged (merge_soon): the keys a watch event changed since, whose
        event is newer than anything the list says about them."""
        self._merging: asyncio.Task | None = None
        self._kept = 0
        self.lists = 0
        """Full lists merged so far (replace, or merge_soon's when its last slice is done)."""

    def __len__(self) -> int:
        return len(self._pods)

    def lookup(self, namespace: str, name: str, uid: str = "") -> PodSnapshot | None:
        """The pod as last seen; None (a miss: the caller reads the API) when not held, held
        as its identity only, or held as another pod than `uid` (a recreation the cache may
        not have seen yet)."""
        pod = self._pods.get((namespace, name))  # one dict read: atomic under the GIL
        if pod is None or pod.spec is ALLOCATED or (uid and pod.uid != uid):
            self.misses += 1
            return None
        self.hits += 1
        return pod

    def remember(self, pod: PodSnapshot, *, written: bool = False) -> None:
        """Keeps `pod` (as read, or as a PATCH returned it: `written`) unless the cache holds a
        newer version."""
        kept = trimmed({"metadata": pod.metadata, "spec": pod.spec})
        # When the watch brought this version first, there is no echo left to expect.
        if self._store(kept) and written and kept.resource_version:
            with self._lock:
                self._echoes[kept.resource_version] = None
                if len(self._echoes) > ECHOES_KEPT:
                    del self._echoes[next(iter(self._echoes))]

    def is_echo(self, line: str | bytes) -> bool:
        """Whether a raw watch event (as the event loop's watch reads it, bytes, or the
        official client's, str) is the mirror's own write coming back, which the cache
        already holds: it is then skipped unparsed (a parse per allocation the mirror wrote
        itself would be wasted). resourceVersions are
        unique across a cluster's writes, and the object's own is the first in the event
        (metadata comes first). Should the pattern ever catch another field, the event is
        skipped wrongly at worst, and an entry that is stale only ever costs a refused write or
        a confirming read."""
        if not self._echoes:
            return False
        if isinstance(line, bytes):
            found = _RESOURCE_VERSION_BYTES.search(line)
            version = found.group(1).decode("latin-1") if found is not None else None
        else:
            found = _RESOURCE_VERSION.search(line)
            version = found.group(1) if found is not None else None
        if version is None:
            return False
        with self._lock:
            return self._echoes.pop(version, False) is None

    def replace(self, items: list[Mapping[str, Any]]) -> None:
        """A full list: pods that are gone disappear, writes newer than the list are kept."""
        self.cancel_merge()
        fresh = {(p.namespace, p.name): p for p in map(trimmed, items) if p.name}
        with self._lock:
            for key, pod in fresh.items():
                old = self._pods.get(key)
                # The same version stays the same object: what was prepared for it is kept.
                if _holds(old, pod):
                    fresh[key] = old
            new = [pod for key, pod in fresh.items() if self._pods.get(key) is not pod]
            self._prepared -= {key for key in self._prepared if key not in fresh}
            self._prepared -= {(pod.namespace, pod.name) for pod in new}
            self._pods = fresh
            self._waiting.clear()  # the list's order is the queue's now: _prepare refills it
            self.synced = True
            self.lists += 1
        for key, pod in list(fresh.items()):  # new, or held and still waiting its turn
            if key not in self._prepared:
                self._prepare(pod)
        self._refill_soon()

    def keep(self, obj: Mapping[str, Any]) -> PodSnapshot:
        """`trimmed`, as each pod of a list page arrives on the serving loop, and stored at
        once unless the cache holds that version or a newer one, so a call for a pod of an
        early page finds it while the rest of the list is still on its way (the merge then
        prepares it and removes what the list lacks). A pod held at the listed version comes
        back as the object held, so its copy goes at once: a re-list is mostly such copies,
        and all freed together when the merged list goes, they held the serving loop
        (benchmarks/README.md, P6 round thirteen). Every SETTLE_EVERY pods, what the cache
        keeps is moved out of the cyclic collector's way (`settle`)."""
        self._kept += 1
        if self._kept % SETTLE_EVERY == 0:
            settle()
        pod = trimmed(obj)
        if not pod.name:
            return pod
        held = self._pods.get((pod.namespace, pod.name))  # one dict read: atomic
        if held is not None and held.uid == pod.uid and pod.resource_version and (
                held.resource_version == pod.resource_version):
            return held
        self._store(pod)
        return pod

    def merge_soon(self, items: list[Mapping[str, Any] | PodSnapshot]) -> None:
        """`replace` for the serving event loop (called on it): the list is merged in slices
        of `slice_seconds` of work by a task of its own, which a later list cancels. Until the
        last slice, lookups see the cache as it was with part of the list merged in; watch
        events handled meanwhile win over the list (they are newer); the pods the list lacks
        leave at the end, unless an event brought them."""
        self.cancel_merge()
        self._touched = set()
        self._merging = asyncio.get_running_loop().create_task(
            self._merge(items, self._touched), name="pod-cache-merge")

    def cancel_merge(self) -> None:
        """Stops a merge in progress (a newer list, or the feed's end) and a refill of the
        prepared pods; what they did stays (the next list or freed slot refills)."""
        if self._merging is not None:
            self._merging.cancel()
            self._merging = None
        if self._refilling is not None:
            self._refilling.cancel()
            self._refilling = None
        self._touched = None

    async def _merge(self, items: list[Mapping[str, Any] | PodSnapshot],
                     touched: set[tuple[str, str]]) -> None:
        listed: set[tuple[str, str]] = set()
        started = self._monotonic()
        self._waiting.clear()  # the list's order is the queue's now: _prepare refills it
        slices = Slices(self.foreground, self.slice_seconds, self._monotonic)
        for item in items:
            pod = trimmed(item)
            if pod.name:
                key = (pod.namespace, pod.name)
                listed.add(key)
                if key not in touched and (self._store(pod) or (
                        self._pods.get(key) is pod and key not in self._prepared)):
                    self._prepare(pod)  # new, or stored as its page arrived (keep)
            await slices.step()
        del items  # the list's references go as soon as it is merged
        stale = []
        for key in list(self._pods):  # the pods the list lacks, found in slices too
            if key not in listed and key not in touched:
                stale.append(key)
            await slices.step()
        with self._lock:
            for key in stale:
                if key not in touched:  # an event may have brought it back meanwhile
                    self._pods.pop(key, None)
                    self._prepared.discard(key)
            self.synced = True
            self.lists += 1
            self._touched = None
            self._merging = None
        self._refill_soon()
        settle()
        log.info("pod cache synced: %d pod(s), a list of %d merged in %.1f s", len(self._pods),
                 len(listed), self._monotonic() - started)

    def event(self, kind: str, obj: Mapping[str, Any]) -> None:
        """One watch event (ADDED, MODIFIED, DELETED; BOOKMARK and others change nothing)."""
        if kind not in ("ADDED", "MODIFIED", "DELETED"):
            return
        pod = trimmed(obj)
        if not pod.name:
            return
        key = (pod.namespace, pod.name)
        if self._touched is not None:
            self._touched.add(key)
        if kind != "DELETED":
            if self._store(pod):
                self._prepare(pod)
            return
        with self._lock:
            old = self._pods.get(key)
            # A recreated pod of the same name may already be here: drop only this one.
            if old is not None and old.uid == pod.uid:
                del self._pods[key]
                self._prepared.discard(key)
            self._bury(key, pod)
        self._refill_soon()

    async def event_soon(self, kind: str, obj: Mapping[str, Any]) -> None:
        """`event`, for the serving loop's watch: a burst of events (a Job's thousands of pods
        created at once) is applied in slices of `slice_seconds` of work, its decoding
        included, with a gap between the calls after each (`foreground`)."""
        self.event(kind, obj)
        await self._event_slices.step()

    def _prepare(self, pod: PodSnapshot) -> None:
        if self.prepare is None or pod.spec is ALLOCATED:
            return  # allocated already: the scheduler binds it next, it does not allocate it
        key = (pod.namespace, pod.name)
        with self._lock:
            if key not in self._prepared and len(self._prepared) >= self.prepared_kept:
                self._waiting.append(key)  # its turn comes when a slot frees (_refill)
                if len(self._waiting) > 2 * len(self._pods) + self.prepared_kept:
                    # Only a long watch with much churn and no list gets here: forget the
                    # keys that left, keep the order of the others.
                    self._waiting = collections.deque(
                        held for held in dict.fromkeys(self._waiting) if held in self._pods)
                return
            self._prepared.add(key)
        try:
            self.prepare(pod)
        except Exception:  # the feed outlives it; an allocation for the pod redoes the work
            log.exception("preparing pod %s/%s for allocations failed", pod.namespace, pod.name)

    def _refill_soon(self) -> None:
        """Starts `_refill` on the running loop once a quarter of the slots is free and pods
        wait for them: in batches, because each refill first waits for a gap between the calls,
        and that wait per freed slot cost the calls more than the parse it moved (off the loop,
        as in a thread's watch, the next list or event takes a free slot instead)."""
        free = self.prepared_kept - len(self._prepared)
        if (self.prepare is None or not self._waiting or self._refilling is not None
                or free < max(1, self.prepared_kept // 4)):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._refilling = loop.create_task(self._refill(), name="pod-cache-prepare")

    async def _refill(self) -> None:
        """Prepares the oldest pods waiting, one slice of work at a time between the calls,
        until every slot is taken or none waits."""
        try:
            await self.foreground.gap()  # a slot frees inside a call: the call goes first
            slices = Slices(self.foreground, self.slice_seconds, self._monotonic)
            while self._waiting and len(self._prepared) < self.prepared_kept:
                key = self._waiting.popleft()
                pod = self._pods.get(key)
                if pod is not None and key not in self._prepared:
                    self._prepare(pod)
                await slices.step()  # skipping thousands the calls got to first is work too
        finally:
            self._refilling = None

    def _bury(self, key: tuple[str, str], pod: PodSnapshot) -> None:
        """Remembers a deleted pod for a while (called under the lock): a read or a write
        answered before its deletion but arriving after it must not bring it back, where only
        the next list would remove it. Bounded by a count and an age, oldest forgotten first."""
        if not pod.uid:
            return  # nothing to know it by
        now = self._monotonic()
        tomb = (*key, pod.uid)
        self._tombstones.pop(tomb, None)  # re-inserted last: the dict stays oldest first
        self._tombstones[tomb] = now
        while True:  # the one just buried stays: it is the newest
            oldest = next(iter(self._tombstones))
            if (len(self._tombstones) <= TOMBSTONES_KEPT
                    and now - self._tombstones[oldest] <= TOMBSTONE_SECONDS):
                break
            del self._tombstones[oldest]

    def _buried(self, key: tuple[str, str], pod: PodSnapshot) -> bool:
        """Whether `pod` is the deleted pod of `key`'s tombstone (called under the lock): a
        deleted pod's uid never comes back, and a pod that left Pending never returns to it."""
        tomb = (*key, pod.uid)
        when = self._tombstones.get(tomb)
        if when is None:
            return False
        if self._monotonic() - when > TOMBSTONE_SECONDS:
            del self._tombstones[tomb]
            return False
        return True

    def _store(self, pod: PodSnapshot) -> bool:
        """Whether `pod` was news: False when the cache held this version or a newer one, or
        the watch said it was deleted."""
        key = (pod.namespace, pod.name)
        with self._lock:
            old = self._pods.get(key)
            if _holds(old, pod) or (self._tombstones and self._buried(key, pod)):
                return False
            self._pods[key] = pod
            freed = key in self._prepared
            self._prepared.discard(key)  # the new version is not prepared yet
        if freed:  # a list or an event prepares the new version at once (still the head)
            self._refill_soon()
        return True


def settle() -> None:
    """Moves every object alive now out of CPython's cyclic collector's reach (gc.freeze),
    after collecting the young generations. A full collection visits every tracked object:
    with tens of thousands of cached pods (several tracked objects each) it holds the serving
    loop for a long stretch (benchmarks/README.md, round five). Entries hold no reference
    cycles, so reference counting still frees them when they leave; only cyclic garbage older
    than the last full collection stays, which the young collection first keeps small."""
    gc.collect(1)
    gc.freeze()
