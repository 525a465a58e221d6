"""The mirror's HTTP/1.1 client (mirror.http1) against a scripted peer: the bytes of a request;
an answer delimited by Content-Length, chunked coding or the end of the connection; 1xx answers;
keep-alive and the pool of idle connections; every failure of the peer (its connection closed,
never reused); timeouts; requests refused before anything is sent; TLS."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import struct
from dataclasses import dataclass

import pytest

from kai_fractions.mirror import http1
from kai_fractions.mirror.http1 import MAX_HEADERS, Http1Pool, ProtocolError, Response

from .certs import CertificateAuthority

TIMEOUT = 2.0
"""Of a request or a wait on the peer: only a failing test ever waits that long."""


class Close(bytes):
    """In a peer's script: these bytes, then the peer closes the connection."""


class Peer:
    """A server on 127.0.0.1 that answers each request it reads, on whichever connection, with
    the next raw bytes of its script and keeps the connection for the next request (a `Close`
    answer ends it, an empty answer is no answer at all). It records what it saw."""

    def __init__(self, script: tuple[bytes, ...], tls: ssl.SSLContext | None) -> None:
        self.script = list(script)
        self.tls = tls
        self.requests: list[bytes] = []
        """Raw, head and body, in the order they arrived."""
        self.connections = 0
        self.ended = 0
        """Connections closed, by either side."""
        self.alpn: list[str | None] = []
        self._changed = asyncio.Event()
        self._handlers: dict[asyncio.Task, asyncio.StreamWriter] = {}

    async def __aenter__(self) -> Peer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self.tls)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._server.close()
        for writer in self._handlers.values():
            writer.close()  # the handler reads the end of its connection, and returns
        async with asyncio.timeout(TIMEOUT):
            await asyncio.gather(*self._handlers)
        await self._server.wait_closed()

    async def saw_end_of(self, count: int) -> None:
        """Until `count` connections have ended."""
        async with asyncio.timeout(TIMEOUT):
            while self.ended < count:
                self._changed.clear()
                await self._changed.wait()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._handlers[asyncio.current_task()] = writer
        self.connections += 1
        if self.tls is not None:
            self.alpn.append(writer.get_extra_info("ssl_object").selected_alpn_protocol())
        try:
            while self.script and (request := await _read_request(reader)) is not None:
                self.requests.append(request)
                answer = self.script.pop(0)
                writer.write(answer)
                await writer.drain()
                if isinstance(answer, Close):
                    break
            else:
                await reader.read()  # the script is spent: keep the connection until the EOF
        except ConnectionError:
            pass
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
            self.ended += 1
            self._changed.set()


async def _read_request(reader: asyncio.StreamReader) -> bytes | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    lengths = [line.partition(b":")[2] for line in head.split(b"\r\n")
               if line.lower().startswith(b"content-length:")]
    return head + await reader.readexactly(int(lengths[0]) if lengths else 0)


@pytest.fixture
async def serve():
    """`peer, pool = await serve(*script, server_tls=..., **pool_options)`: a peer and a pool of
    connections to it, both closed after the test."""
    async with contextlib.AsyncExitStack() as stack:
        async def start(*script: bytes, server_tls: ssl.SSLContext | None = None,
                        **pool_options) -> tuple[Peer, Http1Pool]:
            peer = await stack.enter_async_context(Peer(script, server_tls))
            pool = Http1Pool("127.0.0.1", peer.port, **pool_options)
            stack.push_async_callback(pool.close)
            return peer, pool

        yield start


def message(*lines: str, body: bytes = b"") -> bytes:
    """A request or an answer of exactly these lines, a blank line and `body`."""
    return "".join(f"{line}\r\n" for line in (*lines, "")).encode("latin-1") + body


def ok(body: bytes = b"ok", *headers: str) -> bytes:
    return message("HTTP/1.1 200 OK", *headers, f"Content-Length: {len(body)}", body=body)


def chunked(body: bytes) -> bytes:
    """An answer with this already chunk-coded body."""
    return message("HTTP/1.1 200 OK", "Transfer-Encoding: chunked", body=body)


def chunks(*parts: bytes) -> bytes:
    coded = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in parts if part)
    return coded + b"0\r\n\r\n"


def header_lines(count: int) -> list[str]:
    return [f"X-Header-{i}: {i}" for i in range(count)]


async def get(pool: Http1Pool, target: str = "/") -> Response:
    return await pool.request("GET", target, {}, timeout=TIMEOUT)


async def assert_recovers(peer: Peer, pool: Http1Pool) -> None:
    """The failed request's connection was closed, and the next request opens a new one."""
    await peer.saw_end_of(1)
    assert (await get(pool)).body == b"ok"
    assert pool.opened == peer.connections == 2


async def fails_then_recovers(serve, answer: bytes, error: type[Exception]) -> Exception:
    peer, pool = await serve(answer, ok())
    with pytest.raises(error) as raised:
        await get(pool)
    await assert_recovers(peer, pool)
    return raised.value


# -- the request ------------------------------------------------------------------------------

async def test_a_request_is_its_line_host_headers_in_order_length_and_body(serve):
    peer, pool = await serve(ok(), ok())
    body = b'{"metadata":{"annotations":{}}}'
    await pool.request("PATCH", "/api/v1/namespaces/ns/pods/p?fieldManager=m",
                       {"Authorization": "Bearer t", "Content-Type": "application/merge-patch+json",
                        "Accept": "application/json"}, body, timeout=TIMEOUT)
    await pool.request("GET", "/api/v1/pods", {"Accept": "application/json"}, timeout=TIMEOUT)
    host = f"Host: 127.0.0.1:{peer.port}"
    assert peer.requests == [
        message("PATCH /api/v1/namespaces/ns/pods/p?fieldManager=m HTTP/1.1", host,
                "Authorization: Bearer t", "Content-Type: application/merge-patch+json",
                "Accept: application/json", f"Content-Length: {len(body)}", body=body),
        message("GET /api/v1/pods HTTP/1.1", host, "Accept: application/json",
                "Content-Length: 0"),
    ]


# Read from the head the pool would send: a test cannot bind the default ports 80 and 443.
@pytest.mark.parametrize(("host", "port", "tls", "header"), [
    ("api.example", 80, False, "api.example"),
    ("api.example", 443, True, "api.example"),
    ("api.example", 443, False, "api.example:443"),
    ("api.example", 80, True, "api.example:80"),
    ("10.0.0.1", 6443, True, "10.0.0.1:6443"),
    ("::1", 6443, True, "[::1]:6443"),
    ("fd00::1", 80, False, "[fd00::1]"),
])
def test_the_host_header_names_the_port_unless_it_is_the_default(host, port, tls, header):
    pool = Http1Pool(host, port, tls=ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT) if tls else None)
    assert pool._head("GET", "/", {}, 0).split(b"\r\n")[1] == f"Host: {header}".encode()


@pytest.mark.parametrize(("target", "headers"), [
    ("/pods\r\nX-Forged: 1", {}),
    ("/pods\nGET /secrets", {}),
    ("/", {"Authorization": "Bearer token\n"}),
    ("/", {"Authorization": "Bearer tok\ren"}),
    ("/", {"X-Forged: 1\r\nX-Name": "value"}),
], ids=["crlf-in-target", "lf-in-target", "lf-in-value", "cr-in-value", "crlf-in-name"])
async def test_a_line_break_in_the_target_or_a_header_is_refused_before_anything_is_sent(
        serve, target, headers):
    peer, pool = await serve(ok())
    with pytest.raises(ValueError, match="line break"):
        await pool.request("GET", target, headers, timeout=TIMEOUT)
    await get(pool, "/next")
    # What the peer saw starts with the next request, on the first connection the pool opened.
    assert [request.split(b"\r\n")[0] for request in peer.requests] == [b"GET /next HTTP/1.1"]
    assert pool.opened == peer.connections == 1


# -- the answer -------------------------------------------------------------------------------

@pytest.mark.parametrize(("line", "status", "reason"), [
    ("HTTP/1.1 200 OK", 200, "OK"),
    ("HTTP/1.1 404 Not Found", 404, "Not Found"),
    ("HTTP/1.1 500", 500, ""),
    ("HTTP/1.0 503 Service Unavailable", 503, "Service Unavailable"),
])
async def test_the_status_line_gives_the_status_and_reason(serve, line, status, reason):
    _, pool = await serve(message(line, "Content-Length: 0"))
    response = await get(pool)
    assert (response.status, response.reason) == (status, reason)


async def test_header_names_are_lower_cased_and_a_repeated_header_joined(serve):
    _, pool = await serve(ok(b"ok", "Content-Type: text/plain", "X-Multi: a", "x-multi:b",
                             "X-MULTI:   c  "))
    assert (await get(pool)).headers == {
        "content-type": "text/plain", "x-multi": "a, b, c", "content-length": "2"}


async def test_a_sized_answer_is_read_to_its_length_and_the_connection_kept(serve):
    peer, pool = await serve(ok(b"first"), ok(b"second"))
    assert await get(pool) == Response(200, "OK", {"content-length": "5"}, b"first")
    assert (await get(pool)).body == b"second"
    assert pool.opened == peer.connections == 1


async def test_a_chunked_answer_is_reassembled_with_its_extensions_and_trailers_skipped(serve):
    body = (b"4\r\nWiki\r\n5;name=value\r\npedia\r\nE\r\n in\r\n\r\nchunks.\r\na\r\n0123456789\r\n"
            b"0\r\nExpires: never\r\nX-Checksum: 1\r\n\r\n")
    peer, pool = await serve(chunked(body), ok(b"next"))
    response = await get(pool)
    assert response.body == b"Wikipedia in\r\n\r\nchunks.0123456789"
    assert response.headers == {"transfer-encoding": "chunked"}
    # The next answer is read from where the trailers ended, on the same connection.
    assert (await get(pool)).body == b"next"
    assert pool.opened == peer.connections == 1


async def test_an_answer_without_a_length_is_read_to_the_end_and_its_connection_not_reused(
        serve):
    peer, pool = await serve(Close(message("HTTP/1.1 200 OK", "Content-Type: text/plain",
                                           body=b"all of it\r\n\r\nand more")), ok())
    assert (await get(pool)).body == b"all of it\r\n\r\nand more"
    await assert_recovers(peer, pool)


# A body read here would wait for bytes that never come (and the next answer would be lost).
@pytest.mark.parametrize(("method", "answer"), [
    ("GET", message("HTTP/1.1 204 No Content")),
    ("GET", message("HTTP/1.1 304 Not Modified", "Content-Length: 5")),
    ("HEAD", message("HTTP/1.1 200 OK", "Content-Length: 5")),
    ("HEAD", message("HTTP/1.1 200 OK", "Transfer-Encoding: chunked")),
], ids=["204", "304", "head-sized", "head-chunked"])
async def test_an_answer_that_has_no_body_is_not_read_for_one(serve, method, answer):
    peer, pool = await serve(answer, ok(b"next"))
    assert (await pool.request(method, "/", {}, timeout=TIMEOUT)).body == b""
    assert (await get(pool)).body == b"next"
    assert pool.opened == peer.connections == 1


async def test_informational_answers_before_the_real_one_are_skipped(serve):
    informational = message("HTTP/1.1 100 Continue") + message(
        "HTTP/1.1 103 Early Hints", "Link: </style.css>; rel=preload")
    _, pool = await serve(informational + ok(b"real"))
    response = await get(pool)
    assert (response.status, response.headers, response.body) == (
        200, {"content-length": "4"}, b"real")


async def test_an_answer_may_have_max_headers_header_lines(serve):
    _, pool = await serve(ok(b"ok", *header_lines(MAX_HEADERS - 1)))
    assert len((await get(pool)).headers) == MAX_HEADERS


# -- keep-alive and the pool ------------------------------------------------------------------

async def test_sequential_requests_reuse_one_connection(serve):
    peer, pool = await serve(ok(b"1"), ok(b"2"), ok(b"3"))
    assert [(await get(pool)).body for _ in range(3)] == [b"1", b"2", b"3"]
    assert pool.opened == peer.connections == 1
    assert len(peer.requests) == 3


@pytest.mark.parametrize("answer", [
    ok(b"ok", "Connection: close"),
    ok(b"ok", "Connection: Keep-Alive, Close"),
    message("HTTP/1.0 200 OK", "Content-Length: 2", body=b"ok"),
], ids=["connection-close", "connection-close-in-a-list", "http-1.0"])
async def test_an_answer_that_ends_its_connection_makes_the_next_request_open_one(serve, answer):
    peer, pool = await serve(answer, ok())  # the peer keeps it open: the client must close it
    assert (await get(pool)).body == b"ok"
    await assert_recovers(peer, pool)


@pytest.mark.parametrize("farewell", [
    b"", message("HTTP/1.1 408 Request Timeout", "Connection: close", "Content-Length: 0"),
], ids=["silent", "after-an-unsolicited-408"])
async def test_an_idle_connection_the_server_closed_is_not_reused(serve, farewell):
    peer, pool = await serve(Close(ok(b"first") + farewell), ok(b"second"))
    assert (await get(pool)).body == b"first"
    await peer.saw_end_of(1)
    await asyncio.sleep(0.01)  # for the client's loop to read the end of the connection
    response = await get(pool)
    assert (response.status, response.body) == (200, b"second")
    assert pool.opened == peer.connections == 2


async def test_max_idle_bounds_the_connections_kept(serve):
    peer, pool = await serve(*[ok()] * 6, max_idle=1)
    await asyncio.gather(*(get(pool) for _ in range(3)))
    assert pool.opened == 3
    await peer.saw_end_of(2)  # all but the one kept
    await get(pool)
    assert pool.opened == 3
    await asyncio.gather(get(pool), get(pool))
    assert pool.opened == peer.connections == 4


async def test_max_connections_bounds_the_requests_under_way_and_the_rest_wait(serve):
    peer, pool = await serve(*[ok(b"%d" % i) for i in range(5)], max_connections=2)
    answers = await asyncio.gather(*(get(pool) for _ in range(5)))
    assert sorted(a.body for a in answers) == [b"0", b"1", b"2", b"3", b"4"]
    assert pool.opened == peer.connections == 2  # the waiting three reused them


async def test_the_wait_for_a_connection_counts_against_the_requests_timeout(serve):
    _, pool = await serve(b"", max_connections=1)  # the first request is never answered
    first = asyncio.create_task(get(pool))
    await asyncio.sleep(0.05)
    with pytest.raises(TimeoutError):
        await pool.request("GET", "/", {}, timeout=0.1)
    assert pool.opened == 1
    first.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await first


async def test_close_closes_the_idle_connections(serve):
    peer, pool = await serve(ok(), ok())
    await asyncio.gather(get(pool), get(pool))
    assert peer.ended == 0
    await pool.close()
    await peer.saw_end_of(2)


# -- failures ---------------------------------------------------------------------------------

CUT_SHORT = {
    "before-any-byte": Close(b""),
    "in-the-status-line": Close(b"HTTP/1.1 20"),
    "in-the-headers": Close(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n"),
    "in-a-sized-body": Close(message("HTTP/1.1 200 OK", "Content-Length: 10", body=b"abc")),
    "in-a-chunk": Close(chunked(b"5\r\nab")),
    "before-the-last-chunk": Close(chunked(b"2\r\nab\r\n")),
    "in-the-trailers": Close(chunked(b"2\r\nab\r\n0\r\nExpires: never\r\n")),
}


@pytest.mark.parametrize("answer", list(CUT_SHORT.values()), ids=list(CUT_SHORT))
async def test_an_answer_cut_short_is_a_connection_error(serve, answer):
    error = await fails_then_recovers(serve, answer, ConnectionError)
    assert not isinstance(error, ProtocolError)


MALFORMED = {
    "http-2-status-line": message("HTTP/2 200 OK"),
    "not-http": b"SSH-2.0-OpenSSH_9.6\r\n",
    "lower-case-version": message("http/1.1 200 OK"),
    "four-digit-status": message("HTTP/1.1 2000 OK"),
    "two-digit-status": message("HTTP/1.1 20 OK"),
    "letters-for-status": message("HTTP/1.1 2OO OK"),
    "no-status": message("HTTP/1.1"),
    "two-spaces-before-status": message("HTTP/1.1  200 OK"),
    "status-line-over-the-stream-limit": b"HTTP/1.1 200 " + b"x" * (1 << 17),
    "header-without-colon": message("HTTP/1.1 200 OK", "X-Broken", "Content-Length: 0"),
    "header-without-name": message("HTTP/1.1 200 OK", ": value", "Content-Length: 0"),
    "space-before-colon": message("HTTP/1.1 200 OK", "Content-Length : 0"),
    "folded-header": message("HTTP/1.1 200 OK", "X-A: 1", " folded", "Content-Length: 0"),
    "too-many-header-lines": ok(b"ok", *header_lines(MAX_HEADERS)),
    "too-many-trailer-lines": chunked(b"0\r\n" + message(*header_lines(MAX_HEADERS + 1))),
    "switching-protocols": message("HTTP/1.1 101 Switching Protocols", "Upgrade: websocket",
                                   "Connection: Upgrade"),
    **{f"content-length-{name}": message("HTTP/1.1 200 OK", *lines, body=b"ok") for name, lines in {
        "negative": ["Content-Length: -1"],
        "signed": ["Content-Length: +2"],
        "decimal": ["Content-Length: 2.0"],
        "hex": ["Content-Length: 0x2"],
        "word": ["Content-Length: two"],
        "empty": ["Content-Length:"],
        "of-17-digits": ["Content-Length: " + "0" * 16 + "2"],
        "repeated": ["Content-Length: 2", "Content-Length: 2"],
    }.items()},
    **{f"chunk-size-{name}": chunked(size + b"\r\nok\r\n0\r\n\r\n") for name, size in {
        "not-hex": b"zz", "negative": b"-2", "empty": b"", "prefixed": b"0x2", "signed": b"+2",
    }.items()},
    "chunk-not-followed-by-crlf": chunked(b"2\r\nokXY0\r\n\r\n"),
}


@pytest.mark.parametrize("answer", list(MALFORMED.values()), ids=list(MALFORMED))
async def test_a_malformed_answer_is_a_protocol_error(serve, answer):
    await fails_then_recovers(serve, answer, ProtocolError)


FRAMINGS = {
    "content-length": ok,
    "chunked": lambda body: chunked(chunks(body[:5], body[5:])),
    "until-the-end": lambda body: Close(message("HTTP/1.1 200 OK", body=body)),
}


@pytest.mark.parametrize("framing", list(FRAMINGS.values()), ids=list(FRAMINGS))
async def test_a_body_of_max_body_bytes_is_read(serve, monkeypatch, framing):
    monkeypatch.setattr(http1, "MAX_BODY", 8)
    _, pool = await serve(framing(b"x" * 8))
    assert (await get(pool)).body == b"x" * 8


@pytest.mark.parametrize("framing", list(FRAMINGS.values()), ids=list(FRAMINGS))
async def test_a_body_larger_than_max_body_is_a_protocol_error(serve, monkeypatch, framing):
    monkeypatch.setattr(http1, "MAX_BODY", 8)
    await fails_then_recovers(serve, framing(b"x" * 9), ProtocolError)


@pytest.mark.parametrize("answer", [
    b"", b"HTTP/1.1 200 OK\r\n", message("HTTP/1.1 200 OK", "Content-Length: 10", body=b"abc"),
], ids=["no-answer", "status-line-only", "part-of-the-body"])
async def test_an_answer_not_complete_within_the_timeout_is_a_timeout_error(serve, answer):
    peer, pool = await serve(answer, ok())
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(TimeoutError):
        await pool.request("GET", "/", {}, timeout=0.1)
    assert 0.09 <= loop.time() - started < 1
    await assert_recovers(peer, pool)


# -- TLS --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Pki:
    ca: bytes
    stranger: bytes
    """Another CA's certificate."""
    server: ssl.SSLContext
    """For "localhost" and 127.0.0.1, offering h2 before http/1.1."""


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    ca = CertificateAuthority()
    cert, key = ca.issue("localhost", server=True).write(tmp_path_factory.mktemp("pki"), "server")
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert, key)
    server.set_alpn_protocols(["h2", "http/1.1"])
    return Pki(ca.pem, CertificateAuthority("someone else's CA").pem, server)


def client_tls(ca: bytes) -> ssl.SSLContext:
    """As aio_store.tls_context makes it for a CA given as data."""
    context = ssl.create_default_context(cadata=ca.decode())
    context.set_alpn_protocols(["http/1.1"])
    return context


@pytest.mark.parametrize("server_hostname", ["localhost", None], ids=["dns-name", "ip-address"])
async def test_tls_verifies_the_server_and_negotiates_http_1_1(serve, pki, server_hostname):
    peer, pool = await serve(ok(b"1"), ok(b"2"), server_tls=pki.server, tls=client_tls(pki.ca),
                             server_hostname=server_hostname)
    assert [(await get(pool)).body for _ in range(2)] == [b"1", b"2"]
    assert pool.opened == peer.connections == 1
    assert peer.alpn == ["http/1.1"]
    assert peer.requests[0].startswith(
        f"GET / HTTP/1.1\r\nHost: 127.0.0.1:{peer.port}\r\n".encode())


@pytest.mark.parametrize(("trusted", "server_hostname"), [
    ("stranger", "localhost"), ("ca", "kubernetes.default.svc"),
], ids=["untrusted-ca", "wrong-name"])
async def test_tls_refuses_a_server_it_cannot_verify(serve, pki, trusted, server_hostname):
    peer, pool = await serve(ok(), server_tls=pki.server, tls=client_tls(getattr(pki, trusted)),
                             server_hostname=server_hostname)
    with pytest.raises(ssl.SSLCertVerificationError) as raised:
        await get(pool)
    assert isinstance(raised.value, OSError)  # a failure of the peer, as the module promises
    assert peer.requests == []
    assert pool.opened == 0


# -- streams ----------------------------------------------------------------------------------

WATCH = "/api/v1/pods?watch=true"
LINES = b'{"a":1}\n{"b":2}\n\n{"c":3}\n{"d":4}'
"""A body of lines: an empty one among them, the last without its newline."""
LINES_READ = [b'{"a":1}', b'{"b":2}', b"", b'{"c":3}', b'{"d":4}']
STREAM_FRAMINGS = {
    "content-length": ok,
    # A line across two chunks, several lines in one, a chunk that ends within a line.
    "chunked": lambda body: chunked(chunks(body[:3], body[3:20], body[20:26], body[26:])),
    "until-the-end": lambda body: Close(message("HTTP/1.1 200 OK", body=body)),
}


@contextlib.asynccontextmanager
async def open_stream(pool: Http1Pool, target: str = WATCH, *, timeout: float = TIMEOUT,
                      idle_timeout: float = TIMEOUT):
    async with pool.stream("GET", target, {"Accept": "application/json"}, timeout=timeout,
                           idle_timeout=idle_timeout) as stream:
        yield stream


async def lines_of(pool: Http1Pool, **options) -> list[bytes]:
    async with open_stream(pool, **options) as stream:
        return [line async for line in stream.lines()]


@dataclass
class Conversation:
    """One connection of a LivePeer, its answer's head sent: the test writes the rest."""

    writer: asyncio.StreamWriter
    ended: asyncio.Event
    """Set when the client has closed the connection."""

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    def reset(self) -> None:
        """Ends the connection with a TCP reset (SO_LINGER 0), not a FIN."""
        self.writer.get_extra_info("socket").setsockopt(
            socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.writer.transport.abort()


class LivePeer:
    """A server on 127.0.0.1 that reads each connection's request, answers `head`, and hands
    the connection to the test (`next`), which writes the body as the test goes on."""

    def __init__(self, head: bytes) -> None:
        self.head = head
        self._conversations: asyncio.Queue[Conversation] = asyncio.Queue()
        self._handlers: dict[asyncio.Task, asyncio.StreamWriter] = {}

    async def __aenter__(self) -> LivePeer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._server.close()
        for writer in self._handlers.values():
            writer.close()
        async with asyncio.timeout(TIMEOUT):
            await asyncio.gather(*self._handlers)
        await self._server.wait_closed()

    async def next(self) -> Conversation:
        async with asyncio.timeout(TIMEOUT):
            return await self._conversations.get()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._handlers[asyncio.current_task()] = writer
        ended = asyncio.Event()
        try:
            if await _read_request(reader) is None:
                return
            writer.write(self.head)
            self._conversations.put_nowait(Conversation(writer, ended))
            await reader.read()  # until the client closes its end
        except ConnectionError:
            pass
        finally:
            ended.set()
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


@pytest.fixture
async def live():
    """`peer, pool = await live(head)`: a LivePeer and a pool of connections to it."""
    async with contextlib.AsyncExitStack() as stack:
        async def start(head: bytes) -> tuple[LivePeer, Http1Pool]:
            peer = await stack.enter_async_context(LivePeer(head))
            pool = Http1Pool("127.0.0.1", peer.port)
            stack.push_async_callback(pool.close)
            return peer, pool

        yield start


async def ended(conversation: Conversation) -> None:
    async with asyncio.timeout(TIMEOUT):
        await conversation.ended.wait()


def live_head(framing: str, length: int = 0) -> bytes:
    return {"chunked": message("HTTP/1.1 200 OK", "Content-Type: application/json",
                               "Transfer-Encoding: chunked"),
            "content-length": message("HTTP/1.1 200 OK", "Content-Type: application/json",
                                      f"Content-Length: {length}"),
            "until-the-end": message("HTTP/1.1 200 OK", "Content-Type: application/json"),
            }[framing]


def live_piece(framing: str, data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data) if framing == "chunked" else data


async def test_a_stream_is_a_get_with_no_body_on_a_connection_of_its_own(serve):
    peer, pool = await serve(chunked(chunks(b"x\n")), ok(b"next"))
    assert await lines_of(pool) == [b"x"]
    assert peer.requests == [message(f"GET {WATCH} HTTP/1.1", f"Host: 127.0.0.1:{peer.port}",
                                     "Accept: application/json", "Content-Length: 0")]
    await peer.saw_end_of(1)  # closed at the end of the block, though it could carry more
    assert (await get(pool)).body == b"next"
    assert pool.opened == peer.connections == 2


@pytest.mark.parametrize("framing", list(STREAM_FRAMINGS.values()), ids=list(STREAM_FRAMINGS))
async def test_lines_are_the_bodys_lines_however_it_is_delimited_and_cut(serve, framing):
    _, pool = await serve(framing(LINES))
    assert await lines_of(pool) == LINES_READ


@pytest.mark.parametrize("framing", list(STREAM_FRAMINGS.values()), ids=list(STREAM_FRAMINGS))
async def test_a_body_that_ends_with_a_newline_has_no_empty_last_line(serve, framing):
    _, pool = await serve(framing(b"one\ntwo\n"))
    assert await lines_of(pool) == [b"one", b"two"]


@pytest.mark.parametrize("framing", list(STREAM_FRAMINGS))
async def test_the_head_comes_before_the_body_and_each_line_as_soon_as_it_is_complete(
        live, framing):
    pieces = [b"ab", b"c\nde", b"f\ng\nh"]
    peer, pool = await live(live_head(framing, sum(map(len, pieces))))
    async with open_stream(pool) as stream:
        # Nothing of the body was sent yet.
        assert (stream.status, stream.reason) == (200, "OK")
        assert stream.headers["content-type"] == "application/json"
        conversation = await peer.next()
        lines = stream.lines()
        first = asyncio.ensure_future(anext(lines))
        await conversation.send(live_piece(framing, pieces[0]))
        await asyncio.sleep(0.02)
        assert not first.done()  # half a line is not a line
        await conversation.send(live_piece(framing, pieces[1]))
        assert await asyncio.wait_for(first, TIMEOUT) == b"abc"
        await conversation.send(live_piece(framing, pieces[2]))
        assert [await anext(lines), await anext(lines)] == [b"def", b"g"]
        if framing == "chunked":
            await conversation.send(b"0\r\n\r\n")
        elif framing == "until-the-end":
            conversation.writer.close()
        assert [line async for line in lines] == [b"h"]
    await ended(conversation)


STATUS = b'{"kind":"Status","code":403,"reason":"Forbidden"}'
ERROR_ANSWERS = {
    "content-length": message("HTTP/1.1 403 Forbidden", f"Content-Length: {len(STATUS)}",
                              body=STATUS),
    "chunked": message("HTTP/1.1 403 Forbidden", "Transfer-Encoding: chunked",
                       body=chunks(STATUS[:10], STATUS[10:])),
    "until-the-end": Close(message("HTTP/1.1 403 Forbidden", body=STATUS)),
}


@pytest.mark.parametrize("answer", list(ERROR_ANSWERS.values()), ids=list(ERROR_ANSWERS))
async def test_read_gives_the_whole_body_of_an_error_answer(serve, answer):
    peer, pool = await serve(answer)
    async with open_stream(pool) as stream:
        assert (stream.status, stream.reason) == (403, "Forbidden")
        assert await stream.read() == STATUS
    await peer.saw_end_of(1)


@pytest.mark.parametrize("reads", ["lines", "read"])
async def test_a_peer_silent_mid_stream_is_a_timeout_error_and_its_connection_closed(
        live, reads):
    peer, pool = await live(live_head("chunked"))
    loop = asyncio.get_running_loop()
    async with open_stream(pool, idle_timeout=0.1) as stream:
        conversation = await peer.next()
        await conversation.send(live_piece("chunked", b"first\n"))
        started = loop.time()
        with pytest.raises(TimeoutError):
            if reads == "lines":
                lines = stream.lines()
                assert await anext(lines) == b"first"
                started = loop.time()
                await anext(lines)
            else:
                await stream.read()
        assert 0.09 <= loop.time() - started < 1
        await ended(conversation)  # by the failure itself, before the block ends


async def test_the_timeout_bounds_the_head_only_and_the_idle_timeout_each_wait_for_the_body(
        live):
    peer, pool = await live(live_head("chunked"))
    async with open_stream(pool, timeout=0.05, idle_timeout=TIMEOUT) as stream:
        conversation = await peer.next()
        lines = stream.lines()
        for line in (b"1", b"2"):
            await asyncio.sleep(0.1)  # twice the timeout, all of it within the idle timeout
            await conversation.send(live_piece("chunked", line + b"\n"))
            assert await anext(lines) == line


@pytest.mark.parametrize("answer", [b"", b"HTTP/1.1 200 OK\r\n"], ids=["no-answer",
                                                                       "status-line-only"])
async def test_a_head_not_complete_within_the_timeout_is_a_timeout_error(serve, answer):
    peer, pool = await serve(answer, ok())
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(TimeoutError):
        async with open_stream(pool, timeout=0.1, idle_timeout=TIMEOUT):
            pytest.fail("the stream opened without its head")
    assert 0.09 <= loop.time() - started < 1
    await assert_recovers(peer, pool)


async def _read_all(stream: http1.Stream) -> None:
    async for _ in stream.lines():
        pass


@pytest.mark.parametrize("answer", [
    chunked(chunks(b"ok\n01234", b"56789\n")),
    chunked(chunks(b"0123", b"45678")),
    Close(message("HTTP/1.1 200 OK", body=b"ok\n0123456789\n")),
], ids=["across-chunks", "unfinished-across-chunks", "until-the-end"])
async def test_a_line_longer_than_max_body_is_a_protocol_error(serve, monkeypatch, answer):
    monkeypatch.setattr(http1, "MAX_BODY", 8)  # a chunk is bounded by it too
    peer, pool = await serve(answer)
    async with open_stream(pool) as stream:
        with pytest.raises(ProtocolError, match="longer than 8 bytes"):
            await _read_all(stream)
    await peer.saw_end_of(1)


@pytest.mark.parametrize("answer", [
    chunked(chunks(b"abc\ndefg", b"h\nijklmn", b"\n")),
    Close(message("HTTP/1.1 200 OK", body=b"abc\ndefgh\nijklmn\n")),
], ids=["chunked", "until-the-end"])
async def test_lines_within_max_body_are_read_however_the_pieces_cut_them(
        serve, monkeypatch, answer):
    """MAX_BODY bounds a line, not what a piece of the body carries around it: no line here is
    longer than 6 bytes (nor any chunk than 8), though a piece with its neighbours is."""
    monkeypatch.setattr(http1, "MAX_BODY", 8)
    _, pool = await serve(answer)
    assert await lines_of(pool) == [b"abc", b"defgh", b"ijklmn"]


async def _break_early(stream: http1.Stream) -> None:
    async for _ in stream.lines():
        break


async def _raise(stream: http1.Stream) -> None:
    await anext(stream.lines())
    raise RuntimeError("the caller's own failure")


@pytest.mark.parametrize("use", [_read_all, _break_early, _raise],
                         ids=["read-to-the-end", "break-out-of-lines", "exception-in-the-block"])
async def test_a_streams_connection_is_closed_when_its_block_ends_and_never_pooled(serve, use):
    peer, pool = await serve(chunked(chunks(b"one\ntwo\n")), ok(b"next"))
    with contextlib.suppress(RuntimeError):
        async with open_stream(pool) as stream:
            await use(stream)
    await peer.saw_end_of(1)
    assert (await get(pool)).body == b"next"
    assert pool.opened == peer.connections == 2
    assert len(pool._idle) == 1  # the request's connection, not the stream's


@pytest.mark.parametrize("framing", list(STREAM_FRAMINGS))
async def test_a_peer_that_resets_mid_stream_is_a_connection_error(live, framing):
    peer, pool = await live(live_head(framing, 100))
    async with open_stream(pool) as stream:
        conversation = await peer.next()
        await conversation.send(live_piece(framing, b"first\nsec"))
        lines = stream.lines()
        assert await anext(lines) == b"first"
        conversation.reset()
        with pytest.raises(ConnectionError) as raised:
            await anext(lines)
    assert not isinstance(raised.value, ProtocolError)


@pytest.mark.parametrize("framing", ["chunked", "content-length"])
async def test_a_body_cut_short_mid_stream_is_a_connection_error(live, framing):
    peer, pool = await live(live_head(framing, 100))
    async with open_stream(pool) as stream:
        conversation = await peer.next()
        await conversation.send(live_piece(framing, b"first\nsec")[:-2])
        conversation.writer.close()
        with pytest.raises(ConnectionError) as raised:
            await _read_all(stream)
    assert not isinstance(raised.value, ProtocolError)
