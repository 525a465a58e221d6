"""The agent's Kubernetes seams and their implementation over the official `kubernetes` client.

`PodSource` lists and watches the pods bound to one node; `ClusterWriter` does the few writes the
agent makes: a merge patch of its derived annotations on a pod (guarded by the pod's uid), the
node's condition (a strategic merge patch of `nodes/status`, merged by condition type), the
node's GPU memory label, and pod events. `tests/support/fake_kube.py`'s `FakeCluster`
implements both in memory.

Every error is one of the types below, with the API server's message: the agent logs it, counts
it and tries again on its next pass; nothing here retries by itself (the loop is the retry).
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

import urllib3
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines

from ...kubeconfig import api_error_message

MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"


class KubeError(Exception):
    """A Kubernetes request failed; `status` is the HTTP status when the server answered."""

    reason = "APIError"

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.message = message
        self.status = status


class NotFound(KubeError):
    reason = "NotFound"


class Conflict(KubeError):
    """409: the object changed or was recreated (another uid) since it was read."""

    reason = "Conflict"


class Gone(KubeError):
    """410: the watch's resourceVersion is older than the server keeps; list again."""

    reason = "Expired"


def on_node(pod: Mapping[str, Any], node: str) -> bool:
    """Whether a pod is bound to `node` (checked on our side too: a server, or a test double,
    that ignores the field selector must not make the agent manage another node's pods)."""
    return str((pod.get("spec") or {}).get("nodeName") or "") == node


def pod_uid(pod: Mapping[str, Any]) -> str:
    return str((pod.get("metadata") or {}).get("uid") or "")


def resource_version(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("resourceVersion") or "")


class PodSource(Protocol):
    def list_pods(self, node: str, version: str = "") -> tuple[list[dict[str, Any]], str]:
        """The node's pods and the list's resourceVersion; `version` "0" lets the API server
        answer from its watch cache (cheap, possibly a moment old)."""
        ...

    def watch_pods(self, node: str, resource_version: str, stop: threading.Event
                   ) -> Iterator[tuple[str, dict[str, Any]]]:
        """(event type, pod) from `resource_version` on, until the server ends the stream or
        `stop` is set; raises Gone when the version expired."""
        ...


class ClusterWriter(Protocol):
    def patch_pod_annotations(self, namespace: str, name: str, uid: str,
                              annotations: Mapping[str, str]) -> dict[str, Any]:
        """One merge patch carrying `metadata.uid` (a recreated pod of the same name is
        refused with Conflict); returns the updated pod."""
        ...

    def get_node(self, name: str) -> dict[str, Any]:
        ...

    def patch_node_status(self, name: str, conditions: list[dict[str, Any]]) -> None:
        ...

    def patch_node_labels(self, name: str, labels: Mapping[str, str]) -> None:
        ...

    def create_event(self, namespace: str, event: dict[str, Any]) -> None:
        ...




def _error(what: str, e: Exception) -> KubeError:
    if isinstance(e, ApiException):
        text = f"{what}: {api_error_message(e)}"
        cls = {404: NotFound, 409: Conflict, 410: Gone}.get(e.status or 0, KubeError)
        return cls(text, e.status)
    return KubeError(f"{what}: {type(e).__name__}: {e}")


_TRANSPORT_ERRORS = (ApiException, urllib3.exceptions.HTTPError, OSError, ValueError)


class KubeCluster:
    """PodSource and ClusterWriter over `kubernetes.client.CoreV1Api`."""

    def __init__(self, api_client: k8s.ApiClient, *, request_timeout: float = 10.0,
                 watch_seconds: int = 300):
        self.core = k8s.CoreV1Api(api_client)
        self.request_timeout = request_timeout
        self.watch_seconds = watch_seconds
        # The server ends a watch after watch_seconds; the read timeout only catches a
        # connection that went silent, so it leaves the server some slack.
        self.read_timeout = watch_seconds + 30.0
        self._responses: set[Any] = set()
        self._lock = threading.Lock()

    def _json(self, what: str, call: Any) -> Any:
        try:
            response = call()
            return json.loads(response.data or b"null")
        except _TRANSPORT_ERRORS as e:
            raise _error(what, e) from None

    # -- PodSource ----------------------------------------------------------------------------

    def list_pods(self, node: str, version: str = "") -> tuple[list[dict[str, Any]], str]:
        body = self._json(f"list the pods of node {node}", lambda: (
            self.core.list_pod_for_all_namespaces(
                field_selector=f"spec.nodeName={node}", _preload_content=False,
                resource_version=version or None,
                _request_timeout=self.request_timeout)))
        items = [i for i in (body or {}).get("items") or [] if isinstance(i, dict)]
        return items, resource_version(body or {})

    def watch_pods(self, node: str, resource_version: str, stop: threading.Event
                   ) -> Iterator[tuple[str, dict[str, Any]]]:
        what = f"watch the pods of node {node}"
        try:
            response = self.core.list_pod_for_all_namespaces(
                field_selector=f"spec.nodeName={node}", watch=True,
                allow_watch_bookmarks=True, resource_version=resource_version or None,
                timeout_seconds=self.watch_seconds, _preload_content=False,
                _request_timeout=(self.request_timeout, self.read_timeout))
        except _TRANSPORT_ERRORS as e:
            raise _error(what, e) from None
        with self._lock:
            self._responses.add(response)
        try:
            for line in iter_resp_lines(response):
                if stop.is_set():
                    return
                if not line.strip():
                    continue
                event = json.loads(line)
                kind, obj = str(event.get("type") or ""), event.get("object") or {}
                if kind == "ERROR":
                    code = obj.get("code")
                    message = f"{what}: {code} {obj.get('reason')}: {obj.get('message')}"
                    if code == 410:
                        raise Gone(message, 410)
                    raise KubeError(message, code)
                yield kind, obj
        except _TRANSPORT_ERRORS as e:
            if stop.is_set():
                return
            raise _error(what, e) from None
        finally:
            with self._lock:
                self._responses.discard(response)
            response.release_conn()

    def close_watches(self) -> None:
        """Ends every open watch at once (shutdown): the blocked read returns."""
        with self._lock:
            responses = list(self._responses)
        for response in responses:
            # already closed, or an older urllib3: the watch thread is a daemon anyway
            with contextlib.suppress(Exception):
                response.shutdown()

    # -- ClusterWriter ------------------------------------------------------------------------

    def patch_pod_annotations(self, namespace: str, name: str, uid: str,
                              annotations: Mapping[str, str]) -> dict[str, Any]:
        body = {"metadata": {"uid": uid, "annotations": dict(annotations)}}
        return self._json(f"patch the annotations of pod {namespace}/{name}", lambda: (
            self.core.patch_namespaced_pod(name, namespace, body, _content_type=MERGE_PATCH,
                                           _preload_content=False,
                                           _request_timeout=self.request_timeout)))

    def get_node(self, name: str) -> dict[str, Any]:
        return self._json(f"read node {name}", lambda: self.core.read_node(
            name, _preload_content=False, _request_timeout=self.request_timeout))

    def patch_node_status(self, name: str, conditions: list[dict[str, Any]]) -> None:
        # Strategic merge: the API server merges `conditions` by type, so the kubelet's own
        # conditions are left alone.
        body = {"status": {"conditions": conditions}}
        self._json(f"patch the conditions of node {name}", lambda: (
            self.core.patch_node_status(name, body, _content_type=STRATEGIC_MERGE_PATCH,
                                        _preload_content=False,
                                        _request_timeout=self.request_timeout)))

    def patch_node_labels(self, name: str, labels: Mapping[str, str]) -> None:
        body = {"metadata": {"labels": dict(labels)}}
        self._json(f"label node {name}", lambda: self.core.patch_node(
            name, body, _content_type=MERGE_PATCH, _preload_content=False,
            _request_timeout=self.request_timeout))

    def create_event(self, namespace: str, event: dict[str, Any]) -> None:
        self._json(f"record event {event.get('reason')} in {namespace}", lambda: (
            self.core.create_namespaced_event(namespace, k8s.CoreV1Event.from_dict(event),
                                              _preload_content=False,
                                              _request_timeout=self.request_timeout)))
