"""An in-memory cluster with the agent's Kubernetes seams (`PodSource` and `ClusterWriter`), for
the agent's unit tests and the benchmarks' simulated nodes (benchmarks/node_sim.py).

Pods, nodes and events live in dicts; every write takes the next resourceVersion of one counter
and is appended to a history that watches replay. The pods' list and watch (`node_pods(node)`)
run on one event loop in a thread of its own (`spawn`), as KubeCluster's run on its
BlockingKube's. Faults: `fail(op, error, times)` makes the next call(s) of an operation raise
(`list_pods` and `watch_pods` are the list and the watch); `expire()` makes open and new watches
raise Gone (410) until the next list. `calls` counts operations, so tests can pin relists and
reconnects; `watching` is the number of watches open now.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import copy
import threading
import uuid as uuid_mod
from collections import Counter
from collections.abc import AsyncIterator, Coroutine, Mapping
from datetime import UTC, datetime
from typing import Any

from kai_fractions.kube.errors import Conflict, Gone, KubeError, NotFound
from kai_fractions.kube.objects import uid_of
from kai_fractions.node.agent.kube import on_node

_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def _shared_loop() -> asyncio.AbstractEventLoop:
    """One event loop, in a daemon thread, for every fake's list + watch."""
    global _loop
    with _loop_lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="fake-kube-loop",
                             daemon=True).start()
        return _loop


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class FakeCluster:
    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._rv = 0
        self.pods: dict[str, dict[str, Any]] = {}
        """uid -> pod."""
        self.nodes: dict[str, dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []
        self.history: list[tuple[int, str, dict[str, Any]]] = []
        """(resourceVersion, event type, pod) of every pod change."""
        self.calls: Counter[str] = Counter()
        self.list_versions: list[str] = []
        """The resourceVersion each list asked for ("" a consistent read, "0" any)."""
        self.node_status_patches: list[list[dict[str, Any]]] = []
        self.leases: dict[tuple[str, str], dict[str, Any]] = {}
        """(namespace, name) -> spec."""
        self.annotation_patches: list[tuple[str, dict[str, str]]] = []
        self._faults: dict[str, list[Exception]] = {}
        self._expired = False
        self._end_watches = 0
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()
        self.watching = 0

    # -- test controls ----------------------------------------------------------------------

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def _record(self, kind: str, pod: dict[str, Any]) -> None:
        self.history.append((self._rv, kind, copy.deepcopy(pod)))
        self._wake()

    def _wake(self) -> None:
        """Called with the lock held."""
        for loop, event in list(self._waiters):
            with contextlib.suppress(RuntimeError):  # a closed loop
                loop.call_soon_threadsafe(event.set)

    def add_pod(self, pod: Mapping[str, Any]) -> dict[str, Any]:
        pod = copy.deepcopy(dict(pod))
        with self._lock:
            meta = pod.setdefault("metadata", {})
            meta.setdefault("uid", str(uuid_mod.uuid4()))
            meta.setdefault("namespace", "default")
            meta.setdefault("creationTimestamp", _now())
            meta["resourceVersion"] = self._next_rv()
            self.pods[meta["uid"]] = pod
            self._record("ADDED", pod)
            return copy.deepcopy(pod)

    def update_pod(self, uid: str, **changes: Any) -> dict[str, Any]:
        """Replace top-level parts of a pod (`status=...`, `metadata=...`, `spec=...`)."""
        with self._lock:
            pod = self.pods[uid]
            for key, value in changes.items():
                pod[key] = copy.deepcopy(value)
            pod["metadata"]["uid"] = uid
            pod["metadata"]["resourceVersion"] = self._next_rv()
            self._record("MODIFIED", pod)
            return copy.deepcopy(pod)

    def delete_pod(self, uid: str) -> None:
        with self._lock:
            pod = self.pods.pop(uid)
            pod["metadata"]["resourceVersion"] = self._next_rv()
            self._record("DELETED", pod)

    def add_node(self, name: str, labels: Mapping[str, str] | None = None) -> dict[str, Any]:
        with self._lock:
            node = {"apiVersion": "v1", "kind": "Node",
                    "metadata": {"name": name, "labels": dict(labels or {}),
                                 "resourceVersion": self._next_rv()},
                    "status": {"conditions": []}}
            self.nodes[name] = node
            return copy.deepcopy(node)

    def condition(self, node: str, kind: str) -> dict[str, Any] | None:
        with self._lock:
            for c in self.nodes[node]["status"].get("conditions") or []:
                if c.get("type") == kind:
                    return copy.deepcopy(c)
        return None

    def fail(self, op: str, error: Exception | None = None, times: int = 1) -> None:
        """The next `times` calls of `op` (a method name of the seams) raise `error`."""
        with self._lock:
            self._faults.setdefault(op, []).extend(
                [error or KubeError(f"injected failure of {op}", 500)] * times)

    def expire(self) -> None:
        """Watches raise Gone (410) until the next list, like an etcd compaction."""
        with self._lock:
            self._expired = True
            self._wake()

    def end_watches(self) -> None:
        """Open watches end normally (the server's timeout)."""
        with self._lock:
            self._end_watches += 1
            self._wake()

    def _enter(self, op: str) -> None:
        self.calls[op] += 1
        faults = self._faults.get(op)
        if faults:
            raise faults.pop(0)

    # -- PodSource ----------------------------------------------------------------------------

    def node_pods(self, node: str) -> FakePods:
        return FakePods(self, node)

    def spawn(self, work: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        return asyncio.run_coroutine_threadsafe(work, _shared_loop())

    def close(self) -> None:
        """The shared loop stays: nothing to end."""

    # -- ClusterWriter ------------------------------------------------------------------------

    def patch_pod_annotations(self, namespace: str, name: str, uid: str,
                              annotations: Mapping[str, str]) -> dict[str, Any]:
        with self._lock:
            self._enter("patch_pod_annotations")
            same_name = [p for p in self.pods.values()
                         if p["metadata"].get("namespace") == namespace
                         and p["metadata"].get("name") == name]
            if not same_name:
                raise NotFound(f"pod {namespace}/{name} not found", 404)
            pod = same_name[0]
            if uid_of(pod) != uid:
                raise Conflict(f"pod {namespace}/{name}: uid precondition failed", 409)
            pod["metadata"].setdefault("annotations", {}).update(annotations)
            pod["metadata"]["resourceVersion"] = self._next_rv()
            self.annotation_patches.append((uid, dict(annotations)))
            self._record("MODIFIED", pod)
            return copy.deepcopy(pod)

    def get_node(self, name: str) -> dict[str, Any]:
        with self._lock:
            self._enter("get_node")
            if name not in self.nodes:
                raise NotFound(f"node {name} not found", 404)
            return copy.deepcopy(self.nodes[name])

    def patch_node_status(self, name: str, conditions: list[dict[str, Any]]) -> None:
        with self._lock:
            self._enter("patch_node_status")
            if name not in self.nodes:
                raise NotFound(f"node {name} not found", 404)
            # a strategic merge by condition type, as the real API server does
            current = self.nodes[name]["status"].setdefault("conditions", [])
            for cond in conditions:
                current[:] = [c for c in current if c.get("type") != cond.get("type")]
                current.append(copy.deepcopy(cond))
            self.node_status_patches.append(copy.deepcopy(conditions))
            self.nodes[name]["metadata"]["resourceVersion"] = self._next_rv()

    def patch_node_labels(self, name: str, labels: Mapping[str, str]) -> None:
        with self._lock:
            self._enter("patch_node_labels")
            if name not in self.nodes:
                raise NotFound(f"node {name} not found", 404)
            self.nodes[name]["metadata"].setdefault("labels", {}).update(labels)

    def create_event(self, namespace: str, event: dict[str, Any]) -> None:
        with self._lock:
            self._enter("create_event")
            self.events.append(copy.deepcopy(event))

    def renew_lease(self, namespace: str, name: str, spec: Mapping[str, Any]) -> None:
        with self._lock:
            self._enter("renew_lease")
            self.leases.setdefault((namespace, name), {}).update(copy.deepcopy(dict(spec)))

    # -- helpers for tests --------------------------------------------------------------------

    def pods_on(self, node: str) -> list[dict[str, Any]]:
        with self._lock:
            return [copy.deepcopy(p) for p in self.pods.values() if on_node(p, node)]

    def event_reasons(self, uid: str | None = None) -> list[str]:
        with self._lock:
            return [e["reason"] for e in self.events
                    if uid is None or e["involvedObject"].get("uid") == uid]


class FakePods:
    """The pods of one node as `kube.listwatch.list_watch` drives them (a kube.listwatch.Source)."""

    def __init__(self, cluster: FakeCluster, node: str) -> None:
        self.cluster = cluster
        self.node = node
        self.what = f"pods of node {node}"

    async def list(self, resource_version: str = "") -> tuple[list[dict[str, Any]], str]:
        c = self.cluster
        with c._lock:
            c._enter("list_pods")
            c.list_versions.append(resource_version)
            c._expired = False
            # Like kmock, the node's field selector is ignored: the agent must filter.
            return [copy.deepcopy(p) for p in c.pods.values()], str(c._rv)

    async def watch(self, resource_version: str) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        c = self.cluster
        with c._lock:
            c._enter("watch_pods")
            ended = c._end_watches
            c.watching += 1
            waiter = (asyncio.get_running_loop(), asyncio.Event())
            c._waiters.add(waiter)
        since = int(resource_version or 0)
        try:
            while True:
                waiter[1].clear()
                with c._lock:
                    if c._expired:
                        raise Gone(f"watch {self.what}: 410 Expired: too old resource version",
                                   410)
                    if c._end_watches != ended:
                        return
                    # Writers wake the watch; nothing new costs no scan of the history (the
                    # benchmarks run this fake beside the agent).
                    pending = ([(rv, kind, pod) for rv, kind, pod in c.history if rv > since]
                               if c._rv > since else [])
                    if c._rv > since and not pending:  # versions that went to the node
                        since = c._rv
                if not pending:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(waiter[1].wait(), 1.0)
                    continue
                for rv, kind, pod in pending:
                    since = rv
                    yield kind, copy.deepcopy(pod)
        finally:
            with c._lock:
                c._waiters.discard(waiter)
                c.watching -= 1
