"""The agent's Kubernetes seams and their implementation over `kai_fractions.kube`.

`PodSource` gives the pods bound to one node as `kube.listwatch.list_watch` lists and watches
them, and the event loop that runs that loop; `ClusterWriter` does the few writes the agent
makes: a merge patch of its derived annotations on a pod (guarded by the pod's uid), the node's
condition (a strategic merge patch of `nodes/status`, merged by condition type), the node's GPU
memory label, pod events, and its heartbeat Lease. `tests/support/fake_kube.py`'s `FakeCluster`
implements both in memory.

Every error is one of `kai_fractions.kube.errors`, with the API server's message and the object
named: the agent logs it, counts it and tries again on its next pass; nothing here retries by
itself (the loop is the retry).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Coroutine, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from ...kube.blocking import BlockingKube
from ...kube.client import MERGE_PATCH, STRATEGIC_MERGE_PATCH, Observer
from ...kube.errors import Conflict, NotFound
from ...kube.listwatch import Collection, Source
from ...kube.objects import (
    annotation_patch,
    events_path,
    lease_body,
    lease_path,
    node_path,
    pod_path,
    pods_path,
)

if TYPE_CHECKING:
    from kubernetes import client as k8s

__all__ = ["LEASE_LABELS", "ClusterWriter", "KubeCluster", "PodSource", "on_node"]

LEASE_LABELS = {"app.kubernetes.io/name": "kai-fractions",
                "app.kubernetes.io/component": "node-agent-heartbeat"}
"""On the heartbeat Leases the agents create: `helm uninstall` leaves them (Helm did not make
them), and this selects them."""


def on_node(pod: Mapping[str, Any], node: str) -> bool:
    """Whether a pod is bound to `node` (checked on our side too: a server, or a test double,
    that ignores the field selector must not make the agent manage another node's pods)."""
    return str((pod.get("spec") or {}).get("nodeName") or "") == node


class PodSource(Protocol):
    def node_pods(self, node: str) -> Source:
        """The pods bound to `node` (asked of the server by field selector), as
        `kube.listwatch.list_watch` drives them."""
        ...

    def spawn(self, work: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        """Runs `work` on the source's event loop; cancelling the future ends it."""
        ...

    def close(self) -> None:
        """Ends the source's connections and its loop (the agent's last step when it stops;
        closing again does nothing)."""
        ...


class ClusterWriter(Protocol):
    def patch_pod_annotations(self, namespace: str, name: str, uid: str,
                              annotations: Mapping[str, str]) -> dict[str, Any]:
        """One merge patch carrying `metadata.uid` (a recreated pod of the same name is
        refused); returns the updated pod."""
        ...

    def get_node(self, name: str) -> dict[str, Any]:
        ...

    def patch_node_status(self, name: str, conditions: list[dict[str, Any]]) -> None:
        ...

    def patch_node_labels(self, name: str, labels: Mapping[str, str]) -> None:
        ...

    def create_event(self, namespace: str, event: dict[str, Any]) -> None:
        ...

    def renew_lease(self, namespace: str, name: str, spec: Mapping[str, Any]) -> None:
        """Merges `spec` into the Lease, creating it when there is none."""
        ...


class KubeCluster:
    """PodSource and ClusterWriter over `kube.blocking.BlockingKube`: the writes block the
    calling thread, the list + watch runs on the BlockingKube's loop. `close` ends both."""

    def __init__(self, api_client: k8s.ApiClient, *, request_timeout: float = 10.0,
                 watch_seconds: int = 300, read_timeout: float | None = None):
        """Raises kube.config.ConfigError for settings that cannot work."""
        self.blocking = BlockingKube(api_client, name="agent-kube",
                                     request_timeout=request_timeout)
        self.request_timeout = request_timeout
        self.watch_seconds = watch_seconds
        self.read_timeout = read_timeout
        """How long a watch may stay silent (None: the server's timeout and some slack)."""
        self._leases: set[tuple[str, str]] = set()
        """Leases this process created or found: renewed with a PATCH."""

    def close(self) -> None:
        self.blocking.close()

    def observe_requests(self, observe: Observer) -> None:
        """Tell `observe` of every request to the API server from now on (the metrics)."""
        self.blocking.kube.observe = observe

    # -- PodSource ----------------------------------------------------------------------------

    def node_pods(self, node: str) -> Collection:
        return Collection(self.blocking.kube, pods_path(),
                          {"fieldSelector": f"spec.nodeName={node}"},
                          what=f"pods of node {node}", watch_seconds=self.watch_seconds,
                          request_timeout=self.request_timeout, read_timeout=self.read_timeout)

    def spawn(self, work: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        return self.blocking.spawn(lambda _kube: work)

    # -- ClusterWriter ------------------------------------------------------------------------

    def patch_pod_annotations(self, namespace: str, name: str, uid: str,
                              annotations: Mapping[str, str]) -> dict[str, Any]:
        return self.blocking.request(
            "PATCH", pod_path(namespace, name),
            what=f"patch the annotations of pod {namespace}/{name}",
            body=annotation_patch(annotations, uid=uid), content_type=MERGE_PATCH)

    def get_node(self, name: str) -> dict[str, Any]:
        return self.blocking.request("GET", node_path(name), what=f"read node {name}")

    def patch_node_status(self, name: str, conditions: list[dict[str, Any]]) -> None:
        # Strategic merge: the API server merges `conditions` by type, so the kubelet's own
        # conditions are left alone.
        self.blocking.request("PATCH", node_path(name) + "/status",
                              what=f"patch the conditions of node {name}",
                              body={"status": {"conditions": conditions}},
                              content_type=STRATEGIC_MERGE_PATCH)

    def patch_node_labels(self, name: str, labels: Mapping[str, str]) -> None:
        self.blocking.request("PATCH", node_path(name), what=f"label node {name}",
                              body={"metadata": {"labels": dict(labels)}},
                              content_type=MERGE_PATCH)

    def create_event(self, namespace: str, event: dict[str, Any]) -> None:
        self.blocking.request("POST", events_path(namespace),
                              what=f"record event {event.get('reason')} in {namespace}",
                              body=event)

    def renew_lease(self, namespace: str, name: str, spec: Mapping[str, Any]) -> None:
        # A merge patch with no resourceVersion: the agent is the Lease's only writer (the
        # chart's own-node policy), so one request a renewal. A process's first renewal creates
        # it (409 when it exists): a PATCH refused with 404 at every start would show in the
        # agent's refused-writes alert.
        what = f"renew lease {namespace}/{name}"

        def patch() -> None:
            self.blocking.request("PATCH", lease_path(namespace, name), what=what,
                                  body={"spec": dict(spec)}, content_type=MERGE_PATCH)

        if (namespace, name) in self._leases:
            try:
                return patch()
            except NotFound:
                self._leases.discard((namespace, name))
        try:
            self.blocking.request("POST", lease_path(namespace), what=what,
                                  body=lease_body(namespace, name, spec, LEASE_LABELS))
        except Conflict:  # it exists: this renewal is a patch after all
            patch()
        self._leases.add((namespace, name))
