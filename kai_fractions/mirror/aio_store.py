"""The mirror's AsyncPodStore on its event loop: the requests of `kube_api` over the loop's own
connections to the API server (aio_api), so a MirrorAllocation never leaves the gRPC server's
loop (no thread handoff, no waiting for the GIL between the server, a worker and the HTTP client:
benchmarks/README.md, round three, measured what that handoff cost).

Every request gets a timeout bounded by the caller's deadline; transient failures (429, 5xx,
timeouts, refused or reset connections) are retried with bounded, jittered backoff, exactly as
KubePodStore does. A configuration with a proxy gets the official client, in worker threads
(`async_pod_store`).
"""

from __future__ import annotations

import functools
import logging
import random
from collections.abc import Callable, Mapping
from typing import Any

from kubernetes import client as k8s

from ..clock import AsyncClock, SystemClock
from .aio_api import AsyncKubeApi, behind_proxy
from .kube_api import (
    Refusal,
    annotation_patch,
    decoded,
    failure,
    node_path,
    node_refusal,
    patch_refusal,
    pod_path,
    read_refusal,
    write_as_headers,
)
from .kube_store import DEFAULT_BACKOFF, KubePodStore
from .retry import Backoff, Transient, retrying_async
from .store import NO_DEADLINE, AsyncPodStore, Deadline, PodSnapshot, ThreadedPodStore

log = logging.getLogger(__name__)

OnStatus = Callable[[Refusal], Exception | None]


def async_pod_store(api_client: k8s.ApiClient, **options: Any) -> AsyncPodStore:
    """The mirror's store for `api_client`'s cluster: AsyncKubePodStore, or the official
    client in worker threads when the configuration sends the API's traffic through a proxy
    (which Http1Pool does not speak). Raises ConfigError for settings that cannot work."""
    if behind_proxy(api_client.configuration):
        log.info("the Kubernetes API is behind the proxy %s: the mirror reaches it through "
                 "the official client, in worker threads", api_client.configuration.proxy)
        return ThreadedPodStore(KubePodStore(api_client, **options))
    return AsyncKubePodStore(api_client, **options)


class AsyncKubePodStore:
    def __init__(
        self,
        api_client: k8s.ApiClient,
        *,
        backoff: Backoff = DEFAULT_BACKOFF,
        request_timeout: float = 10.0,
        clock: AsyncClock | None = None,
        rng: random.Random | None = None,
        write_as: str = "",
    ) -> None:
        self.api = api_client
        self.transport = AsyncKubeApi(api_client)
        self.write_headers = write_as_headers(write_as)
        """Pod writes impersonate `write_as` (kube_api.write_as_headers); reads do not."""
        self.backoff = backoff
        self.request_timeout = request_timeout
        self.clock = clock or SystemClock()
        self.rng = rng or random.Random()

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
                               functools.partial(patch_refusal, namespace, name), body,
                               self.write_headers)
        return PodSnapshot.from_object(obj)

    async def node_labels(self, node: str, deadline: Deadline = NO_DEADLINE
                          ) -> Mapping[str, str]:
        obj = await self._call(f"read node {node}", "GET", node_path(node), deadline,
                               functools.partial(node_refusal, node))
        labels = (obj.get("metadata") or {}).get("labels") or {}
        return {str(k): str(v) for k, v in labels.items()}

    async def close(self) -> None:
        await self.transport.close()

    # -- plumbing ------------------------------------------------------------------------------

    async def _call(self, what: str, method: str, path: str, deadline: Deadline,
                    on_status: OnStatus, body: bytes = b"",
                    headers: Mapping[str, str] | None = None) -> Any:
        """The decoded JSON of a 2xx answer; `on_status` claims the refusals its caller gives
        a meaning (404: no such pod, ...), `kube_api.failure` the rest."""

        async def once() -> Any:
            timeout = deadline.timeout(self.request_timeout)
            try:
                response = await self.transport.request(method, path, body=body,
                                                        timeout=timeout, extra_headers=headers)
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
