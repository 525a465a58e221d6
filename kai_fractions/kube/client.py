"""Requests to the Kubernetes API on an event loop, over aiohttp: one try each (callers that
retry use `retry.retrying`), every failure one of `errors`.

`Kube` is built from the official client's `ApiClient`: its configuration says where the server
is (URL with path prefix, TLS, proxy), and the client itself supplies the credentials of each
request. The aiohttp session is opened on the first request, on the loop that makes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any
from urllib.parse import urlencode

import aiohttp
from kubernetes import client as k8s
from yarl import URL

from .config import CredentialError, Endpoint, ExecCredential, auth_headers, endpoint
from .errors import BadAnswer, KubeError, Transient, not_sent, refused, unreachable

JSON = "application/json"
MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"

CONNECTIONS = 32
"""Requests in flight at most, and idle connections kept: one per call in flight at the load
the mirror is built for (a scheduler's 16 concurrent calls, retries and the cache's list)."""

KEEPALIVE = ((socket.SOL_SOCKET, "SO_KEEPALIVE", 1), (socket.IPPROTO_TCP, "TCP_KEEPIDLE", 30),
             (socket.IPPROTO_TCP, "TCP_KEEPINTVL", 10), (socket.IPPROTO_TCP, "TCP_KEEPCNT", 3))
"""TCP keepalive on every connection (each option where the platform has it): a watch whose
peer is gone without a FIN or RST (an API server or load balancer lost, a NAT entry dropped)
fails within about a minute (30 s idle, then 3 probes 10 s apart), not at its read timeout
(the watch's length and some slack: a server sends nothing on a quiet watch, so that timeout
cannot be shorter)."""

Query = Mapping[str, str] | None
Observer = Callable[[str, str], object]
"""Told of every request made: its verb (the HTTP method; WATCH for a watch) and how it
ended (the HTTP status code, or `unreachable`): the API request metric of the mirror and of
the node agent."""


def _unobserved(verb: str, code: str) -> None:
    pass


class Kube:
    """Raises ConfigError at construction for settings that cannot work."""

    def __init__(self, api_client: k8s.ApiClient, *, connections: int = CONNECTIONS,
                 request_timeout: float = 10.0, observe: Observer | None = None) -> None:
        self.api_client = api_client
        self.observe = observe or _unobserved
        self.endpoint = endpoint(api_client.configuration)
        self._route = _route(self.endpoint)
        self.connections = connections
        self.request_timeout = request_timeout
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=self.connections,
                                             ssl=self.endpoint.tls or False,
                                             socket_factory=_keepalive_socket)
            # No cookie jar: the official client's cookie, if any, is sent as it sends it. Its
            # User-Agent goes with every request (auth_headers), so aiohttp adds none.
            self._session = aiohttp.ClientSession(
                connector=connector, cookie_jar=aiohttp.DummyCookieJar())
        return self._session

    async def request(self, method: str, path: str, *, what: str, query: Query = None,
                      body: Any = None, content_type: str = JSON,
                      timeout: float | None = None,
                      headers: Mapping[str, str] | None = None) -> Any:
        """The decoded JSON of a 2xx answer to `method path?query`. `body` is sent as JSON
        (bytes as they are); `what` names the request in errors ("patch pod ns/name")."""
        status, payload = await self._answer(method, path, what, query, body, content_type,
                                             timeout, headers)
        return decoded(payload, what, status)

    async def read(self, method: str, path: str, *, what: str, query: Query = None,
                   body: Any = None, content_type: str = JSON, timeout: float | None = None,
                   headers: Mapping[str, str] | None = None) -> bytes:
        """`request`'s answer as it came, undecoded (`decoded` makes it JSON): for a caller
        that decodes it later, when its loop has time."""
        return (await self._answer(method, path, what, query, body, content_type, timeout,
                                   headers))[1]

    async def _answer(self, method: str, path: str, what: str, query: Query, body: Any,
                      content_type: str, timeout: float | None,
                      headers: Mapping[str, str] | None) -> tuple[int, bytes]:
        """The status and body of a 2xx answer; anything else raises."""
        data = body if body is None or isinstance(body, bytes) else (
            json.dumps(body, separators=(",", ":")).encode())
        sent = await self._headers(what, method, path, data, content_type, headers, timeout)
        seconds = self.request_timeout if timeout is None else timeout
        try:
            async with self.session.request(
                    method, self._url(path, query), data=data, headers=sent,
                    timeout=aiohttp.ClientTimeout(total=seconds), **self._route) as response:
                payload = await response.read()
                self.observe(method, str(response.status))
                if not 200 <= response.status <= 299:
                    self._refused(response.status, sent)
                    raise refused(what, response.status, response.reason, payload,
                                  response.headers.get("Retry-After"))
                return response.status, payload
        except KubeError:
            raise
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            self.observe(method, "unreachable")
            raise unreachable(what, e, sent=not _no_connection(e)) from None
        except ValueError as e:  # aiohttp refused to send it (a header): a KubeError too
            raise not_sent(what, e, sent) from None

    @contextlib.asynccontextmanager
    async def stream(self, path: str, *, what: str, query: Query = None,
                     timeout: float | None = None, idle_timeout: float | None = None
                     ) -> AsyncIterator[AsyncIterator[bytes]]:
        """A GET whose answer is read line by line as it arrives (a watch). `timeout` bounds
        the wait for the answer's head, `idle_timeout` each wait for more of its body."""
        seconds = self.request_timeout if timeout is None else timeout
        limits = aiohttp.ClientTimeout(total=None, sock_read=idle_timeout)
        sent = await self._headers(what, "GET", path, None, JSON, None, timeout)
        async with contextlib.AsyncExitStack() as stack:
            try:
                async with asyncio.timeout(seconds):  # the connection and the answer's head
                    response = await stack.enter_async_context(self.session.get(
                        self._url(path, query), timeout=limits, headers=sent, **self._route))
                    self.observe("WATCH", str(response.status))
                    if not 200 <= response.status <= 299:
                        self._refused(response.status, sent)
                        raise refused(what, response.status, response.reason,
                                      await response.read(),
                                      response.headers.get("Retry-After"))
            except (aiohttp.ClientError, OSError, TimeoutError) as e:
                self.observe("WATCH", "unreachable")
                raise unreachable(what, e, sent=not _no_connection(e)) from None
            except ValueError as e:
                raise not_sent(what, e, sent) from None
            yield _lines(response.content, what)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _url(self, path: str, query: Query) -> URL:
        target = self.endpoint.base_url + path
        if query:
            target += "?" + urlencode(query)
        return URL(target, encoded=True)  # the paths are quoted by `objects` already

    async def _headers(self, what: str, method: str, path: str, data: bytes | None,
                       content_type: str, extra: Mapping[str, str] | None,
                       timeout: float | None) -> dict[str, str]:
        """Transient, and nothing sent, when the credentials cannot be had (a token file being
        rotated, an exec plugin that failed or gave none within `timeout`, say): a caller's
        loop tries again as it would for an API server away."""
        try:
            refreshing = self.api_client.configuration.refresh_api_key_hook
            if isinstance(refreshing, ExecCredential) and refreshing.due():
                # The plugin runs off this loop; the request's own timeout bounds the wait.
                await refreshing.refresh(self.request_timeout if timeout is None else timeout)
            headers = auth_headers(self.api_client, method, path, data)
        except CredentialError as e:
            raise Transient(f"{what}: {e}", answer=str(e), sent=False) from None
        point = self.endpoint
        if point.proxy and point.tls is None and point.proxy_headers:
            # aiohttp sends proxy headers only with a CONNECT (an https server); a plain-http
            # server's requests go to the proxy as they are, so they carry them themselves.
            headers.update(point.proxy_headers)
        if data is not None:
            headers["Content-Type"] = content_type
        if extra:
            headers.update(extra)
        return headers

    def _refused(self, status: int, sent: Mapping[str, str]) -> None:
        """A 401 to credentials an exec plugin gave: it runs again before the next request
        (once for every request refused them)."""
        refreshing = self.api_client.configuration.refresh_api_key_hook
        if status == 401 and isinstance(refreshing, ExecCredential):
            refreshing.refused(sent.get("authorization"))


def _no_connection(error: BaseException) -> bool:
    """Whether `error` is a connection that could not be made (refused, no route, a name
    that does not resolve, a TLS handshake or a proxy that failed): the request was never
    sent. Anything else may come after it was (a reset, a timeout, which may also fire while
    connecting, so it counts as sent)."""
    return isinstance(error, aiohttp.ClientConnectorError | ConnectionRefusedError)


def _keepalive_socket(address: tuple[Any, ...]) -> socket.socket:
    """A socket for one of aiohttp's connections, with `KEEPALIVE` set."""
    family, kind, proto, *_ = address
    sock = socket.socket(family=family, type=kind, proto=proto)
    try:
        for level, option, value in KEEPALIVE:
            if hasattr(socket, option):
                sock.setsockopt(level, getattr(socket, option), value)
    except OSError:
        sock.close()
        raise
    return sock


def _route(point: Endpoint) -> dict[str, Any]:
    """The per-request options of aiohttp that say how the server is reached."""
    route: dict[str, Any] = {}
    if point.server_hostname:
        route["server_hostname"] = point.server_hostname
    if point.proxy:
        route["proxy"] = point.proxy
        if point.proxy_headers:
            route["proxy_headers"] = point.proxy_headers
    return route


def decoded(payload: bytes, what: str, status: int = 200) -> Any:
    """The JSON of a 2xx answer (None for an empty one); BadAnswer, with the answer's
    `status`, when it is not JSON: a server did answer (a proxy's page, say)."""
    try:
        return json.loads(payload or b"null")
    except ValueError:
        raise BadAnswer(f"{what}: the API server's answer is not JSON "
                        f"({payload[:60]!r})", status) from None


async def _lines(content: aiohttp.StreamReader, what: str) -> AsyncIterator[bytes]:
    """The body's lines, each whole however the server chunks it and however long it is
    (a pod with large annotations is one long line)."""
    pending = b""
    try:
        async for chunk in content.iter_any():
            pending += chunk
            *complete, pending = pending.split(b"\n")
            for line in complete:
                yield line
    except (aiohttp.ClientError, OSError, TimeoutError) as e:
        raise unreachable(what, e) from None
    if pending:
        yield pending
