"""The event loop's way to the Kubernetes API: `Http1Pool` connections configured as the
official client is, for the mirror's pod store (aio_store) and its pod watch (aio_listwatch).

The configuration is the official client's `Configuration`, loaded as for every other component
(`kubeconfig.load_api_client`: kubeconfig or in-cluster): the server URL with its path prefix,
TLS (CA, client certificate, verification, tls-server-name) and, for every request, the headers
and credentials the official client would send, read through the client itself so a refreshed
token (in-cluster, exec plugins) is used as soon as it is. Http1Pool does not speak to proxies:
`behind_proxy` tells when the official client must carry the traffic instead.
"""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import AsyncIterator, Mapping
from urllib.parse import urlsplit

from kubernetes import client as k8s
from kubernetes.client.rest import should_bypass_proxies

from ..kubeconfig import ConfigError
from .http1 import Http1Pool, Response, Stream
from .kube_api import MERGE_PATCH

CONNECTION_POOL_SIZE = 32
"""Requests in flight to the API server at most, and idle connections kept: one per call in
flight at the load the mirror is built for (a scheduler's 16, plus retries and the cache's
list); a larger burst waits for a connection within each call's deadline."""


def behind_proxy(configuration: k8s.Configuration) -> bool:
    """Whether the official client would reach the server through its proxy (`no_proxy`
    taken into account, by the client's own rule)."""
    return bool(configuration.proxy) and not should_bypass_proxies(
        configuration.host, configuration.no_proxy or "")


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


class AsyncKubeApi:
    """Requests to the server of `client`'s configuration, one try each (the callers retry).
    Raises ConfigError at construction for a server URL or TLS settings that cannot work."""

    def __init__(self, client: k8s.ApiClient, *, connections: int = CONNECTION_POOL_SIZE
                 ) -> None:
        self.client = client
        configuration = client.configuration
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
            url.hostname, port or (443 if tls else 80), tls=tls, max_idle=connections,
            max_connections=connections,
            server_hostname=configuration.tls_server_name
            or (assert_name if isinstance(assert_name, str) else None) or url.hostname)
        self._prefix = url.path.rstrip("/")
        """A path the server is reached under (a cluster behind an API gateway)."""

    async def request(self, method: str, path: str, *, query: str = "", body: bytes = b"",
                      timeout: float, extra_headers: Mapping[str, str] | None = None
                      ) -> Response:
        """`path` is the API path (`/api/v1/...`); `query` is encoded, without its `?`."""
        headers = self.headers(method, path, body)
        if extra_headers:
            headers.update(extra_headers)
        return await self.pool.request(method, self._target(path, query), headers, body,
                                       timeout=timeout)

    @contextlib.asynccontextmanager
    async def stream(self, path: str, query: str, *, timeout: float, idle_timeout: float
                     ) -> AsyncIterator[Stream]:
        """A GET whose answer is read as it arrives (a watch); see Http1Pool.stream."""
        async with self.pool.stream("GET", self._target(path, query),
                                    self.headers("GET", path, b""), timeout=timeout,
                                    idle_timeout=idle_timeout) as stream:
            yield stream

    def headers(self, method: str, path: str, body: bytes) -> dict[str, str]:
        """What the official client sends with such a request: its default headers (its
        User-Agent), its cookie, and its credentials as of now."""
        client = self.client
        headers = {**client.default_headers, "Accept": "application/json"}
        if body:
            headers["Content-Type"] = MERGE_PATCH
        if client.cookie:
            headers["Cookie"] = client.cookie
        client.update_params_for_auth(headers, [], ["BearerToken"], path, method, body)
        return headers

    async def close(self) -> None:
        await self.pool.close()

    def _target(self, path: str, query: str) -> str:
        return f"{self._prefix}{path}?{query}" if query else self._prefix + path
