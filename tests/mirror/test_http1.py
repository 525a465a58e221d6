"""The mirror's HTTP/1.1 client (mirror.http1) against a scripted peer: the bytes of a request;
an answer delimited by Content-Length, chunked coding or the end of the connection; 1xx answers;
keep-alive and the pool of idle connections; every failure of the peer (its connection closed,
never reused); timeouts; requests refused before anything is sent; TLS."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
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
