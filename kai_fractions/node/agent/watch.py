"""The node's pods as the API server says: a list, then a watch, forever.

`PodWatcher.run` keeps `PodCache` equal to the pods bound to this node: it lists (replacing the
cache, so a pod deleted while the watch was down disappears), then watches from the list's
resourceVersion. A 410 Gone relists at once; any other failure relists after a jittered
exponential backoff (0.5 s doubling to 30 s), and the time since the API was last reachable
feeds the node condition (NotReconciling).

Under a rollout every agent starts at once: the first list waits a random part of
`first_list_jitter` seconds, and with `cached_lists` lists ask for resourceVersion "0", which
the API server answers from its watch cache (indexed by node) instead of a read of every pod
from etcd; the list after a 410 stays a consistent read, so a cache behind the expired watch
cannot send the agent round again (as client-go's reflector does).

Every change calls `on_change`, which only marks the worker dirty: the worker reads the whole
cache (level-triggered), so coalesced or replayed events are harmless.
"""

from __future__ import annotations

import copy
import logging
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from .kube import Gone, KubeError, PodSource, on_node, pod_uid, resource_version

log = logging.getLogger(__name__)


class PodCache:
    """uid -> pod manifest of the pods bound to this node; thread-safe."""

    def __init__(self, monotonic: Callable[[], float] = time.monotonic):
        self._lock = threading.Lock()
        self._pods: dict[str, dict[str, Any]] = {}
        self._monotonic = monotonic
        self.synced = False
        """True once a list succeeded: before that the agent must not apply anything (an apply
        without the node's pods would clear the limits of every running pod)."""
        self.api_down_since: float | None = None
        """Monotonic time of the first failure of the current streak; None while the API
        answers."""
        self.last_error: str | None = None
        self.lists = 0
        self.generation = 0
        """Bumped on every change, so the worker can tell whether anything moved."""

    def replace(self, pods: list[dict[str, Any]]) -> None:
        with self._lock:
            self._pods = {pod_uid(p): p for p in pods if pod_uid(p)}
            self.synced = True
            self.api_down_since = None
            self.last_error = None
            self.lists += 1
            self.generation += 1

    def upsert(self, pod: dict[str, Any]) -> bool:
        """Stores `pod` unless the cache already has a newer version of it."""
        uid = pod_uid(pod)
        if not uid:
            return False
        with self._lock:
            old = self._pods.get(uid)
            if old is not None and _newer(old, pod):
                return False
            self._pods[uid] = pod
            self.generation += 1
            return True

    def remove(self, uid: str) -> bool:
        with self._lock:
            if self._pods.pop(uid, None) is None:
                return False
            self.generation += 1
            return True

    def failed(self, error: str) -> None:
        with self._lock:
            if self.api_down_since is None:
                self.api_down_since = self._monotonic()
            self.last_error = error

    def snapshot(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            return dict(self._pods)

    def get(self, uid: str) -> dict[str, Any] | None:
        with self._lock:
            pod = self._pods.get(uid)
            return copy.deepcopy(pod) if pod is not None else None


def _newer(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether `a` is a later version than `b` (resourceVersions are opaque in general, but
    integers on every API server in practice; anything else is taken as "not newer")."""
    try:
        return int(resource_version(a)) > int(resource_version(b))
    except ValueError:
        return False


class PodWatcher:
    def __init__(self, source: PodSource, node: str, cache: PodCache,
                 on_change: Callable[[], None], *, resync_seconds: float = 300.0,
                 backoff_base: float = 0.5, backoff_cap: float = 30.0,
                 monotonic: Callable[[], float] = time.monotonic,
                 rng: random.Random | None = None, first_list_jitter: float = 0.0,
                 cached_lists: bool = False):
        self.source = source
        self.node = node
        self.cache = cache
        self.on_change = on_change
        self.resync_seconds = resync_seconds
        self.backoff_base = backoff_base
        self.backoff_cap = backoff_cap
        self.monotonic = monotonic
        self.rng = rng or random.Random()
        self.failures = 0
        self.first_list_jitter = first_list_jitter
        self.cached_lists = cached_lists
        self._consistent_next = False  # after a 410: the next list reads from etcd

    def delay(self) -> float:
        delay = min(self.backoff_cap, self.backoff_base * 2 ** min(self.failures, 16))
        return delay * (1 - 0.5 * self.rng.random())

    def run(self, stop: threading.Event) -> None:
        if self.first_list_jitter > 0:
            wait = self.rng.uniform(0, self.first_list_jitter)
            log.info("first list of node %s's pods in %.2f s (agents restarted together "
                     "list apart)", self.node, wait)
            if stop.wait(wait):
                return
        rv = ""
        listed_at = float("-inf")
        while not stop.is_set():
            try:
                if not rv or self.monotonic() - listed_at >= self.resync_seconds:
                    rv = self._list()
                    listed_at = self.monotonic()
                for kind, pod in self.source.watch_pods(self.node, rv, stop):
                    if stop.is_set():
                        return
                    rv = resource_version(pod) or rv
                    self._event(kind, pod)
                    self.failures = 0
            except Gone as e:
                log.info("the pod watch expired (%s); listing again", e.message)
                rv = ""
                self._consistent_next = True
            except (KubeError, OSError, ValueError) as e:
                message = e.message if isinstance(e, KubeError) else f"{type(e).__name__}: {e}"
                self.cache.failed(message)
                delay = self.delay()
                self.failures += 1
                log.warning("pod list/watch failed (%s); again in %.1fs", message, delay)
                rv = ""  # level-triggered: a fresh list after any failure misses nothing
                stop.wait(delay)

    def _list(self) -> str:
        if self.cached_lists and not self._consistent_next:
            items, rv = self.source.list_pods(self.node, version="0")
        else:
            items, rv = self.source.list_pods(self.node)
        self._consistent_next = False
        mine = [p for p in items if on_node(p, self.node)]
        self.cache.replace(mine)
        self.failures = 0
        log.info("listed %d pod(s) on node %s at resourceVersion %s", len(mine), self.node,
                 rv or "-")
        self.on_change()
        return rv

    def _event(self, kind: str, pod: dict[str, Any]) -> None:
        uid = pod_uid(pod)
        if kind == "BOOKMARK" or not uid:
            return
        if kind == "DELETED" or not on_node(pod, self.node):
            changed = self.cache.remove(uid)
        elif kind in ("ADDED", "MODIFIED"):
            changed = self.cache.upsert(pod)
        else:
            return
        if changed:
            self.on_change()
