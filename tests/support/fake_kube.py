"""An in-memory cluster with the agent's Kubernetes seams (`PodSource` and `ClusterWriter`), for
the agent's unit tests and the benchmarks' simulated nodes (benchmarks/node_sim.py).

Pods, nodes and events live in dicts; every write takes the next resourceVersion of one counter
and is appended to a history that watches replay. Faults: `fail(op, error, times)` makes the next
call(s) of an operation raise; `expire()` makes open and new watches raise Gone (410) until the
next list. `calls` counts operations, so tests can pin relists and reconnects.
"""

from __future__ import annotations

import copy
import threading
import uuid as uuid_mod
from collections import Counter
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from typing import Any

from kai_fractions.node.agent.kube import Conflict, Gone, KubeError, NotFound, on_node, pod_uid


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class FakeCluster:
    def __init__(self) -> None:
        self._lock = threading.Condition()
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
        self.annotation_patches: list[tuple[str, dict[str, str]]] = []
        self._faults: dict[str, list[Exception]] = {}
        self._expired = False
        self._end_watches = 0

    # -- test controls ----------------------------------------------------------------------

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def _record(self, kind: str, pod: dict[str, Any]) -> None:
        self.history.append((self._rv, kind, copy.deepcopy(pod)))
        self._lock.notify_all()

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
            self._lock.notify_all()

    def end_watches(self) -> None:
        """Open watches end normally (the server's timeout)."""
        with self._lock:
            self._end_watches += 1
            self._lock.notify_all()

    def _enter(self, op: str) -> None:
        self.calls[op] += 1
        faults = self._faults.get(op)
        if faults:
            raise faults.pop(0)

    # -- PodSource ----------------------------------------------------------------------------

    def list_pods(self, node: str, version: str = "") -> tuple[list[dict[str, Any]], str]:
        with self._lock:
            self._enter("list_pods")
            self.list_versions.append(version)
            self._expired = False
            # Like kmock, the node's field selector is ignored: the agent must filter.
            return [copy.deepcopy(p) for p in self.pods.values()], str(self._rv)

    def watch_pods(self, node: str, resource_version: str, stop: threading.Event
                   ) -> Iterator[tuple[str, dict[str, Any]]]:
        with self._lock:
            self._enter("watch_pods")
            ended = self._end_watches
        since = int(resource_version or 0)
        while not stop.is_set():
            with self._lock:
                if self._expired:
                    raise Gone("watch: 410 Expired: too old resource version", 410)
                if self._end_watches != ended:
                    return
                # Writers notify; the timeout only bounds how late a stop is seen. Nothing new
                # costs no scan of the history (the benchmarks run this fake beside the agent).
                if self._rv <= since:
                    self._lock.wait(0.05)
                    continue
                pending = [(rv, kind, pod) for rv, kind, pod in self.history if rv > since]
                if not pending:  # versions that went to other objects (the node)
                    since = self._rv
                    continue
            for rv, kind, pod in pending:
                since = rv
                yield kind, copy.deepcopy(pod)

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
            if pod_uid(pod) != uid:
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

    # -- helpers for tests --------------------------------------------------------------------

    def pods_on(self, node: str) -> list[dict[str, Any]]:
        with self._lock:
            return [copy.deepcopy(p) for p in self.pods.values() if on_node(p, node)]

    def event_reasons(self, uid: str | None = None) -> list[str]:
        with self._lock:
            return [e["reason"] for e in self.events
                    if uid is None or e["involvedObject"].get("uid") == uid]
