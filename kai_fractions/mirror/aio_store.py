"""The mirror's AsyncPodStore on its event loop: the requests of `kube_api` over `Http1Pool`
connections to the API server, so a MirrorAllocation never leaves the gRPC server's loop (no
thread handoff, no waiting for the GIL between the server, a worker and the HTTP client:
measured in benchmarks/, P1, that handoff alone cost as much as the mirror's own work).

It is configured from the official client's Configuration, loaded as for every other component
(`kubeconfig.load_api_client`: kubeconfig or in-cluster): the server URL with its path prefix,
TLS (CA, client certificate, verification, tls-server-name) and, for every request, the
headers and credentials the official client would send, read through the client itself so a
refreshed token (in-cluster, exec plugins) is used as soon as it is. A configuration with a
proxy gets the official client, in worker threads (`async_pod_store`).

Every request gets a timeout bounded by the caller's deadline; transient failures (429, 5xx,
timeouts, refused or reset connections) are retried with bounded, jittered backoff, exactly as
KubePodStore does.
"""

from __future__ import annotations

import functools
import logging
import random
import ssl
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

from kubernetes import client as k8s
from kubernetes.client.rest import should_bypass_proxies

from ..clock import AsyncClock, SystemClock
from ..kubeconfig import ConfigError
from .http1 import Http1Pool
from .kube_api import (
    MERGE_PATCH,
    Refusal,
    annotation_patch,
    decoded,
    failure,
    node_path,
    node_refusal,
    patch_refusal,
    pod_path,
    read_refusal,
)
from .kube_store import CONNECTION_POOL_SIZE, DEFAULT_BACKOFF, KubePodStore
from .retry import Backoff, Transient, retrying_async
from .store import NO_DEADLINE, AsyncPodStore, Deadline, PodSnapshot, ThreadedPodStore

log = logging.getLogger(__name__)

OnStatus = Callable[[Refusal], Exception | None]


def async_pod_store(api_client: k8s.ApiClient, **options: Any) -> AsyncPodStore:
    """The mirror's store for `api_client`'s cluster: AsyncKubePodStore, or the official
    client in worker threads when the configuration sends the API's traffic through a proxy
    (which Http1Pool does not speak). Raises ConfigError for TLS settings that cannot load."""
    configuration = api_client.configuration
    if configuration.proxy and not should_bypass_proxies(configuration.host,
                                                         configuration.no_proxy or ""):
        log.info("the Kubernetes API is behind the proxy %s: the mirror reaches it through "
                 "the official client, in worker threads", configuration.proxy)
        return ThreadedPodStore(KubePodStore(api_client, **options))
    return AsyncKubePodStore(api_client, **options)


def tls_context(configuration: k8s.Configuration) -> ssl.SSLContext:
    """The TLS the official client's pool would use: its CA (file or data), client certificate,
    `verify_ssl` and `assert_hostname`."""
    context = ssl.create_default_context(cafile=configuration.ssl_ca_cert,
                                         cadata=configuration.ca_cert_data)
    if configuration.cert_file:
        context.load_cert_chain(configuration.cert_file, configuration.key_file)
    if not configuration.verify_ssl:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    elif configuration.assert_hostname is False:
        context.check_hostname = False
    context.set_alpn_protocols(["http/1.1"])
    return context


class AsyncKubePodStore:
    def __init__(
        self,
        api_client: k8s.ApiClient,
        *,
        backoff: Backoff = DEFAULT_BACKOFF,
        request_timeout: float = 10.0,
        clock: AsyncClock | None = None,
        rng: random.Random | None = None,
        max_idle: int = CONNECTION_POOL_SIZE,
    ) -> None:
        self.api = api_client
        self.backoff = backoff
        self.request_timeout = request_timeout
        self.clock = clock or SystemClock()
        self.rng = rng or random.Random()
        configuration = api_client.configuration
        url = urlsplit(configuration.host)
        try:
            port = url.port  # raises ValueError for a port that is not one
        except ValueError:
            port = -1
        if url.scheme not in ("http", "https") or not url.hostname or port == -1:
            raise ConfigError(f"the Kubernetes API server URL {configuration.host!r} is not "
                              "http(s)://host[:port][/path]")
        tls = None
        if url.scheme == "https":
            try:
                tls = tls_context(configuration)
            except (OSError, ValueError) as e:  # ssl.SSLError is an OSError
                raise ConfigError(f"cannot load the TLS settings for the Kubernetes API "
                                  f"server: {e}") from None
        assert_name = configuration.assert_hostname
        self.pool = Http1Pool(
            url.hostname, port or (443 if tls else 80), tls=tls, max_idle=max_idle,
            server_hostname=configuration.tls_server_name
            or (assert_name if isinstance(assert_name, str) else None) or url.hostname)
        self._prefix = url.path.rstrip("/")
        """A path the server is reached under (a cluster behind an API gateway)."""

    # -- AsyncPodStore -------------------------------------------------------------------------

    async def get_pod(self, namespace: str, name: str, deadline: Deadline = NO_DEADLINE
                      ) -> PodSnapshot:
        obj = await self._call(f"read pod {namespace}/{name}", "GET",
                               pod_path(namespace, name), deadline,
                               functools.partial(read_refusal, namespace, name))
        return PodSnapshot.from_object(obj)

    async def patch_annotations(
        self, namespace: str, name: str, changes: Mapping[str, str | None], *, uid: str,
        resource_version: str, deadline: Deadline = NO_DEADLINE,
    ) -> PodSnapshot:
        body = annotation_patch(changes, uid=uid, resource_version=resource_version)
        obj = await self._call(f"patch pod {namespace}/{name}", "PATCH",
                               pod_path(namespace, name), deadline,
                               functools.partial(patch_refusal, namespace, name), body)
        return PodSnapshot.from_object(obj)

    async def node_labels(self, node: str, deadline: Deadline = NO_DEADLINE
                          ) -> Mapping[str, str]:
        obj = await self._call(f"read node {node}", "GET", node_path(node), deadline,
                               functools.partial(node_refusal, node))
        labels = (obj.get("metadata") or {}).get("labels") or {}
        return {str(k): str(v) for k, v in labels.items()}

    async def close(self) -> None:
        await self.pool.close()

    # -- plumbing ------------------------------------------------------------------------------

    def _headers(self, method: str, path: str, body: bytes) -> dict[str, str]:
        """What the official client sends with such a request: its default headers (its
        User-Agent), its cookie, and its credentials as of now."""
        api = self.api
        headers = {**api.default_headers, "Accept": "application/json"}
        if body:
            headers["Content-Type"] = MERGE_PATCH
        if api.cookie:
            headers["Cookie"] = api.cookie
        api.update_params_for_auth(headers, [], ["BearerToken"], path, method, body)
        return headers

    async def _call(self, what: str, method: str, path: str, deadline: Deadline,
                    on_status: OnStatus, body: bytes = b"") -> Any:
        """The decoded JSON of a 2xx answer; `on_status` claims the refusals its caller gives
        a meaning (404: no such pod, ...), `kube_api.failure` the rest."""

        async def once() -> Any:
            timeout = deadline.timeout(self.request_timeout)
            try:
                response = await self.pool.request(method, self._prefix + path,
                                                   self._headers(method, path, body), body,
                                                   timeout=timeout)
            except TimeoutError:
                raise Transient(f"no answer within {timeout:.3g} s") from None
            except OSError as e:
                raise Transient(f"{type(e).__name__}: {e}") from None
            if not 200 <= response.status <= 299:
                refusal = Refusal.of(response.status, response.reason, response.body,
                                     response.headers.get("retry-after"))
                raise (on_status(refusal) or failure(what, refusal)) from None
            return decoded(what, response.body)

        return await retrying_async(once, what=what, backoff=self.backoff, deadline=deadline,
                                    clock=self.clock, rng=self.rng)
