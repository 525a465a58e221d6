"""The blocking PodStore over the official `kubernetes` client (in-cluster or kubeconfig): the
BindRequest follower's, and the mirror's own where its event-loop transport cannot go
(aio_store). The requests and what their refusals mean are `kube_api`'s.

Every request gets a timeout bounded by the caller's deadline, and transient failures (429, 5xx,
timeouts, refused or reset connections) are retried with bounded, jittered exponential backoff.
"""

from __future__ import annotations

import datetime
import functools
import logging
import random
import uuid
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import urllib3
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException
from kubernetes.client.rest import RESTResponse

from ..kubeconfig import load_api_client as _load_api_client
from .kube_api import (
    MERGE_PATCH,
    Refusal,
    annotation_patch,
    decoded,
    failure,
    node_refusal,
    patch_refusal,
    pod_path,
    read_refusal,
    write_as_headers,
)
from .retry import Backoff, Transient, retrying
from .store import (
    NO_DEADLINE,
    Clock,
    Deadline,
    PodSnapshot,
    SystemClock,
    label_selector,
    matches_labels,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

COMPONENT = "kai-fractions-mirror"
DEFAULT_BACKOFF = Backoff()
CONNECTION_POOL_SIZE = 32
"""The official client's kept connections: at least one per thread that may use it at once
(behind a proxy, ThreadedPodStore's worker threads, up to 32 in asyncio's default executor; the
BindRequest follower; the pod watch). The client's default (5 per CPU, 10 on two) makes
concurrent calls open a connection, then discard it with a warning (seen in benchmarks/, P1,
when the mirror still served from threads)."""


def load_api_client(kubeconfig: str | None = None) -> k8s.ApiClient:
    """The mirror's client: enough kept connections for its threads' concurrent calls."""
    return _load_api_client(kubeconfig, pool_size=CONNECTION_POOL_SIZE)


def refusal_of(e: ApiException) -> Refusal:
    return Refusal.of(e.status or 0, e.reason, e.body,
                      (e.headers or {}).get("Retry-After") if e.headers is not None else None)


class KubePodStore:
    def __init__(
        self,
        api_client: k8s.ApiClient,
        *,
        backoff: Backoff = DEFAULT_BACKOFF,
        request_timeout: float = 10.0,
        clock: Clock | None = None,
        rng: random.Random | None = None,
        component: str = COMPONENT,
        write_as: str = "",
    ) -> None:
        self.core = k8s.CoreV1Api(api_client)
        self.write_headers = write_as_headers(write_as)
        """Pod writes impersonate `write_as` (kube_api.write_as_headers); reads do not."""
        self.backoff = backoff
        self.request_timeout = request_timeout
        self.clock = clock or SystemClock()
        self.rng = rng or random.Random()
        self.component = component

    # -- plumbing -----------------------------------------------------------------------------

    def _call(self, what: str, deadline: Deadline, fn: Callable[[float], Any],
              on_status: Callable[[Refusal], Exception | None] | None = None) -> Any:
        """fn(timeout) -> urllib3 response; returns its decoded JSON body. `on_status` claims
        the refusals its caller gives a meaning (404: no such pod, ...)."""

        def once() -> Any:
            try:
                response = fn(deadline.timeout(self.request_timeout))
                try:
                    return decoded(what, response.data)
                finally:
                    response.release_conn()  # back to the pool (the body was read unbuffered)
            except ApiException as e:
                refusal = refusal_of(e)
                mapped = on_status(refusal) if on_status is not None else None
                raise (mapped or failure(what, refusal)) from None
            except (urllib3.exceptions.HTTPError, OSError) as e:
                raise Transient(f"{type(e).__name__}: {e}") from None

        return retrying(once, what=what, backoff=self.backoff, deadline=deadline,
                        clock=self.clock, rng=self.rng)

    # -- PodStore -----------------------------------------------------------------------------

    def get_pod(self, namespace: str, name: str, deadline: Deadline = NO_DEADLINE
                ) -> PodSnapshot:
        obj = self._call(f"read pod {namespace}/{name}", deadline, lambda t:
                         self.core.read_namespaced_pod(name, namespace, _preload_content=False,
                                                       _request_timeout=t),
                         functools.partial(read_refusal, namespace, name))
        return PodSnapshot.from_object(obj)

    def patch_annotations(
        self, namespace: str, name: str, changes: Mapping[str, str | None], *, uid: str,
        resource_version: str, deadline: Deadline = NO_DEADLINE,
    ) -> PodSnapshot:
        body = annotation_patch(changes, uid=uid, resource_version=resource_version)
        obj = self._call(f"patch pod {namespace}/{name}", deadline, lambda t:
                         self._send_patch(namespace, name, body, t),
                         functools.partial(patch_refusal, namespace, name))
        return PodSnapshot.from_object(obj)

    def _send_patch(self, namespace: str, name: str, body: bytes, timeout: float
                    ) -> urllib3.BaseHTTPResponse:
        """The pod merge patch as `CoreV1Api.patch_namespaced_pod` sends it (same URL, headers,
        credentials, TLS and connection pool), without the generated method's per-call argument
        validation and model serialization (a measurable part of a MirrorAllocation's CPU:
        benchmarks/, P1). This is the mirror's hot path; its reads stay on
        the generated methods. Raises ApiException on a non-2xx answer, as they do."""
        api = self.core.api_client
        path = pod_path(namespace, name)
        headers = {**api.default_headers, "Content-Type": MERGE_PATCH,
                   "Accept": "application/json", **self.write_headers}
        if api.cookie:
            headers["Cookie"] = api.cookie
        # The credentials the generated method would send (a refreshed token included).
        api.update_params_for_auth(headers, [], ["BearerToken"], path, "PATCH", body)
        response = api.rest_client.pool_manager.request(
            "PATCH", api.configuration.host + path, body=body, headers=headers,
            timeout=urllib3.Timeout(total=timeout), preload_content=False)
        if not 200 <= response.status <= 299:
            failed = RESTResponse(response)
            failed.read()
            response.release_conn()
            raise ApiException(http_resp=failed)
        return response

    def node_labels(self, node: str, deadline: Deadline = NO_DEADLINE) -> Mapping[str, str]:
        obj = self._call(f"read node {node}", deadline, lambda t:
                         self.core.read_node(node, _preload_content=False, _request_timeout=t),
                         functools.partial(node_refusal, node))
        labels = (obj.get("metadata") or {}).get("labels") or {}
        return {str(k): str(v) for k, v in labels.items()}

    def list_pods(self, namespace: str, labels: Mapping[str, str],
                  deadline: Deadline = NO_DEADLINE) -> list[PodSnapshot]:
        selector = label_selector(labels)
        obj = self._call(f"list pods in {namespace} ({selector})", deadline, lambda t:
                         self.core.list_namespaced_pod(namespace, label_selector=selector,
                                                       _preload_content=False,
                                                       _request_timeout=t))
        pods = [PodSnapshot.from_object(item) for item in obj.get("items") or []]
        # The selector already filtered on a real server; filtering again costs nothing and
        # keeps a server that ignores selectors from handing us another group's pod.
        return [p for p in pods if matches_labels(p.labels, labels)]

    def emit_event(self, pod: PodSnapshot, event_type: str, reason: str, message: str,
                   deadline: Deadline = NO_DEADLINE) -> None:
        now = datetime.datetime.now(datetime.UTC)
        event = k8s.CoreV1Event(
            metadata=k8s.V1ObjectMeta(name=f"{pod.name}.{uuid.uuid4().hex[:16]}",
                                      namespace=pod.namespace),
            involved_object=k8s.V1ObjectReference(
                api_version="v1", kind="Pod", name=pod.name, namespace=pod.namespace,
                uid=pod.uid or None, resource_version=pod.resource_version or None),
            reason=reason, message=message[:1024], type=event_type,
            source=k8s.V1EventSource(component=self.component),
            first_timestamp=now, last_timestamp=now, count=1,
        )
        self._call(f"record event {reason} on pod {pod.namespace}/{pod.name}", deadline,
                   lambda t: self.core.create_namespaced_event(
                       pod.namespace, event, _preload_content=False, _request_timeout=t))
