"""A small HTTP/1.1 client on asyncio streams, for the mirror's requests to ONE API server.

Why not aiohttp (already installed with the `kubernetes` client): less CPU per request, measured
in benchmarks/README.md (round three). What it covers is
exactly what the mirror sends and an API server answers: a request with a body of known length;
an answer delimited by Content-Length, chunked transfer coding or the end of the connection;
1xx answers skipped; keep-alive with a pool of idle connections; TLS (ALPN `http/1.1`).
`stream` reads an answer piece by piece on a connection of its own (a watch), line by line.
Not covered, on purpose: proxies, redirects, compression (never asked for), HTTP/2.

Errors: a failure of the peer is an OSError (ConnectionError for a reset or an answer cut
short, its subclass ProtocolError for a malformed answer, ssl.SSLError for TLS), the caller's
timeout a TimeoutError; the connection it happened on is closed, never reused. A request that
fails is not sent again here: the caller's retries decide (kube_api's writes are guarded).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass

MAX_BODY = 64 << 20
"""Bytes an answer's body may have: far above any Kubernetes object (etcd stores at most
1.5 MiB), far below what a broken peer could make us hold."""
MAX_HEADERS = 200
_NO_BODY_STATUS = frozenset({204, 304})


class ProtocolError(ConnectionError):
    """The peer's answer is not HTTP/1.1 as this client reads it."""


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    reason: str
    headers: Mapping[str, str]
    """Lower-case names; a repeated header's values joined by ", "."""
    body: bytes


class _Connection:
    __slots__ = ("reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @property
    def usable(self) -> bool:
        """Open, and silent since its last answer. An idle connection the server closed (its
        idle timeout) has seen EOF; one it wrote to while idle (a `408 Request Timeout` before
        the close, or more body than it announced) holds bytes no request asked for, and the
        next request would read them as its answer. StreamReader has no public way to ask
        whether it holds data, hence its `_buffer` (present in every CPython since 3.4)."""
        return not (self.writer.is_closing() or self.reader.at_eof() or self.reader._buffer)

    def close(self) -> None:
        self.writer.close()


class Http1Pool:
    """Connections to one `host:port`. `request` takes an idle connection or opens one, and
    keeps it for the next request when the answer allows (at most `max_idle` are kept). At
    most `max_connections` requests are under way at once; more wait for one to end (within
    their own timeout), so a burst of calls on the event loop never becomes a burst of
    connections to the API server. Create and use it on one event loop."""

    def __init__(self, host: str, port: int, *, tls: ssl.SSLContext | None = None,
                 server_hostname: str | None = None, max_idle: int = 32,
                 max_connections: int = 32) -> None:
        self.host, self.port = host, port
        self.tls = tls
        self.server_hostname = server_hostname
        self.max_idle = max_idle
        self._slots = asyncio.Semaphore(max_connections)
        default = 443 if tls is not None else 80
        name = f"[{host}]" if ":" in host else host
        self._host_header = name if port == default else f"{name}:{port}"
        self._idle: list[_Connection] = []
        self.opened = 0
        """Connections opened so far (the tests and benchmarks read it)."""

    async def request(self, method: str, target: str, headers: Mapping[str, str],
                      body: bytes = b"", *, timeout: float) -> Response:
        """One request (`target` is the path and query) and its whole answer, within
        `timeout` seconds (TimeoutError). Raises ValueError for a header that would break the
        request's framing, OSError for a failure of the peer (see the module's docstring)."""
        head = self._head(method, target, headers, len(body))
        async with asyncio.timeout(timeout), self._slots:
            connection = await self._take()
            with _spent_on_failure(connection):
                connection.writer.write(head + body if body else head)
                answer = await _read_head(connection.reader, method)
                response = Response(answer.status, answer.reason, answer.headers,
                                    await answer.body(connection.reader))
            if answer.keep_alive and len(self._idle) < self.max_idle:
                self._idle.append(connection)
            else:
                connection.close()
        return response

    @contextlib.asynccontextmanager
    async def stream(self, method: str, target: str, headers: Mapping[str, str], *,
                     timeout: float, idle_timeout: float) -> AsyncIterator[Stream]:
        """A request whose answer is read as it arrives (a watch), on a connection of its own
        that is closed when the block ends. `timeout` bounds the connection and the answer's
        head; `idle_timeout` each wait for more of its body (a peer gone silent)."""
        head = self._head(method, target, headers, 0)
        async with asyncio.timeout(timeout):
            connection = await self._open()
            with _spent_on_failure(connection):
                connection.writer.write(head)
                answer = await _read_head(connection.reader, method)
        try:
            yield Stream(answer, connection, idle_timeout)
        finally:
            connection.close()

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()
        for connection in idle:
            with contextlib.suppress(OSError):  # already broken: nothing left to close
                await connection.writer.wait_closed()

    def _head(self, method: str, target: str, headers: Mapping[str, str], length: int
              ) -> bytes:
        lines = [f"{method} {target} HTTP/1.1", f"Host: {self._host_header}"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        if any("\r" in line or "\n" in line for line in lines):
            # A value with a line break (a token file's stray newline, say) would forge
            # headers or a second request.
            raise ValueError("an HTTP request header or target holds a line break")
        lines.append(f"Content-Length: {length}\r\n\r\n")
        return "\r\n".join(lines).encode("latin-1")

    async def _take(self) -> _Connection:
        while self._idle:
            connection = self._idle.pop()
            if connection.usable:
                return connection
            connection.close()
        return await self._open()

    async def _open(self) -> _Connection:
        reader, writer = await asyncio.open_connection(
            self.host, self.port, ssl=self.tls,
            server_hostname=self.server_hostname if self.tls is not None else None)
        self.opened += 1
        return _Connection(reader, writer)


class Stream:
    """An answer being read: its status and headers, then its body as lines or whole."""

    def __init__(self, head: _Head, connection: _Connection, idle_timeout: float) -> None:
        self.status, self.reason, self.headers = head.status, head.reason, head.headers
        self._head, self._connection, self._idle_timeout = head, connection, idle_timeout

    async def read(self) -> bytes:
        """The rest of the body (an error answer's Status, say)."""
        with _spent_on_failure(self._connection):
            async with asyncio.timeout(self._idle_timeout):
                return await self._head.body(self._connection.reader)

    async def lines(self) -> AsyncIterator[bytes]:
        """Each line of the body as it arrives, without its newline."""
        pending = b""
        with _spent_on_failure(self._connection):
            async for piece in self._head.pieces(self._connection.reader, self._idle_timeout):
                *complete, pending = (pending + piece).split(b"\n")
                for line in complete:
                    if len(line) > MAX_BODY:
                        raise ProtocolError(f"a line longer than {MAX_BODY} bytes")
                    yield line
                if len(pending) > MAX_BODY:  # a line still without its end: do not hold more
                    raise ProtocolError(f"a line longer than {MAX_BODY} bytes")
        if pending:
            yield pending


@contextlib.contextmanager
def _spent_on_failure(connection: _Connection) -> Iterator[None]:
    """Any failure while a connection carries a request leaves it unusable: it is closed, and
    the failure becomes the module's kind (ConnectionError, ProtocolError)."""
    try:
        yield
    except BaseException as e:  # cancelled and timed out included: the stream is spent
        connection.close()
        if isinstance(e, asyncio.IncompleteReadError):
            raise ConnectionError("the API server closed the connection before it "
                                  "answered") from None
        if isinstance(e, asyncio.LimitOverrunError | ValueError) and \
                not isinstance(e, ProtocolError):
            raise ProtocolError(f"an answer the client cannot read: {e}") from None
        raise


@dataclass(frozen=True, slots=True)
class _Head:
    """An answer's status line and headers, and how its body is delimited."""

    status: int
    reason: str
    headers: Mapping[str, str]
    keep_alive: bool
    """Whether the connection can carry another request once the body is read."""
    framing: str
    """"none", "chunked", "length" or "eof"."""
    length: int = 0

    async def body(self, reader: asyncio.StreamReader) -> bytes:
        if self.framing == "none":
            return b""
        if self.framing == "length":
            return await reader.readexactly(self.length)
        parts: list[bytes] = []
        size = 0
        async for piece in self.pieces(reader):
            size += len(piece)
            if size > MAX_BODY:
                raise ProtocolError(f"an answer larger than {MAX_BODY} bytes")
            parts.append(piece)
        return b"".join(parts)

    async def pieces(self, reader: asyncio.StreamReader, idle_timeout: float | None = None
                     ) -> AsyncIterator[bytes]:
        """The body as it arrives: chunk by chunk, or read by read; each wait for the next
        piece bounded by `idle_timeout`."""
        if self.framing == "none":
            return
        left = self.length
        while True:
            async with asyncio.timeout(idle_timeout):
                if self.framing == "chunked":
                    piece = await _chunk(reader)
                elif self.framing == "length":
                    piece = await reader.read(min(left, 65536)) if left else b""
                    if left and not piece:
                        raise asyncio.IncompleteReadError(piece, left)
                    left -= len(piece)
                else:
                    piece = await reader.read(65536)
            if not piece:
                return
            yield piece


async def _read_head(reader: asyncio.StreamReader, method: str) -> _Head:
    while True:
        version, status, reason = _status_line(await reader.readuntil(b"\r\n"))
        headers = await _headers(reader)
        if not 100 <= status < 200 or status == 101:
            break  # 1xx answers (100 Continue, 103 Early Hints) precede the real one
    if status == 101:
        raise ProtocolError("the server switched protocols (101), which was not asked for")
    keep = version == "HTTP/1.1" and "close" not in headers.get("connection", "").lower()
    if method == "HEAD" or status in _NO_BODY_STATUS:
        return _Head(status, reason, headers, keep, "none")
    if "chunked" in headers.get("transfer-encoding", "").lower():
        return _Head(status, reason, headers, keep, "chunked")
    if "content-length" in headers:
        length = _number(headers["content-length"], "Content-Length")
        if length > MAX_BODY:
            raise ProtocolError(f"an answer of {length} bytes is larger than {MAX_BODY}")
        return _Head(status, reason, headers, keep, "length", length)
    return _Head(status, reason, headers, False, "eof")  # the end of the connection ends it


def _status_line(line: bytes) -> tuple[str, int, str]:
    parts = line.decode("latin-1").rstrip("\r\n").split(" ", 2)
    if len(parts) < 2 or parts[0] not in ("HTTP/1.1", "HTTP/1.0") or \
            not (len(parts[1]) == 3 and parts[1].isdigit()):
        raise ProtocolError(f"not an HTTP/1.1 status line: {line[:80]!r}")
    return parts[0], int(parts[1]), parts[2] if len(parts) > 2 else ""


async def _headers(reader: asyncio.StreamReader) -> dict[str, str]:
    headers: dict[str, str] = {}
    for _ in range(MAX_HEADERS + 1):  # the lines and the blank one that ends them
        line = await reader.readuntil(b"\r\n")
        if line == b"\r\n":
            return headers
        name, sep, value = line.decode("latin-1").partition(":")
        if not sep or not name or name != name.strip():
            raise ProtocolError(f"not an HTTP header line: {line[:80]!r}")
        key, value = name.lower(), value.strip()
        headers[key] = f"{headers[key]}, {value}" if key in headers else value
    raise ProtocolError(f"more than {MAX_HEADERS} header lines")


async def _chunk(reader: asyncio.StreamReader) -> bytes:
    """The next chunk's data; b"" for the last chunk (its trailers read)."""
    line = await reader.readuntil(b"\r\n")
    length = _number(line.split(b";", 1)[0].strip().decode("latin-1"), "chunk size", 16)
    if length == 0:
        await _headers(reader)  # trailers, then the blank line that ends the body
        return b""
    if length > MAX_BODY:
        raise ProtocolError(f"a chunk of {length} bytes is larger than {MAX_BODY}")
    data = await reader.readexactly(length)
    if await reader.readexactly(2) != b"\r\n":
        raise ProtocolError("a chunk not followed by CRLF")
    return data


def _number(text: str, what: str, base: int = 10) -> int:
    digits = "0123456789abcdefABCDEF" if base == 16 else "0123456789"
    if not text or len(text) > 16 or any(c not in digits for c in text):
        raise ProtocolError(f"{what} {text[:20]!r} is not a number")
    return int(text, base)
