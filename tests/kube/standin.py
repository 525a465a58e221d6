"""A scripted Kubernetes API stand-in on the test's own event loop (aiohttp's server), for
what kmock and FaultyApi cannot do: a path prefix, a Retry-After header, an answer that is not
JSON, a watch written piece by piece, a stream that goes silent or is reset, TLS (with a client
certificate and the name the client asked for), and a proxy's view of the request.

Each request is recorded (`seen`) and answered by the next entry of the script (the last one
from then on). An entry is an `Answer` or a `Stream`: a whole answer, or a head and then body
pieces written one by one.
"""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

TIMEOUT = 5.0
"""Of any one wait: only a failing test ever waits that long."""


@dataclass(frozen=True)
class Answer:
    status: int = 200
    body: Any = None
    """JSON unless bytes."""
    headers: dict[str, str] = field(default_factory=dict)

    def payload(self) -> bytes:
        return self.body if isinstance(self.body, bytes) else json.dumps(self.body).encode()


def status(code: int, reason: str, message: str) -> dict[str, Any]:
    """A Kubernetes Status object."""
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code,
            "reason": reason, "message": message}


@dataclass(frozen=True)
class Stream:
    """A 200 whose body is written in `pieces`, each flushed on its own (chunked coding).
    Then the body ends, unless `then` is "silent" (the peer says nothing more) or "reset"
    (the connection is reset, no end of body)."""

    pieces: Sequence[bytes] = ()
    then: str = "end"
    pause: float = 0.0
    """Before each piece."""


def events(*pairs: tuple[str, Any]) -> list[bytes]:
    """Watch events, one JSON line each."""
    return [json.dumps({"type": kind, "object": obj}).encode() + b"\n" for kind, obj in pairs]


@dataclass(frozen=True)
class Seen:
    method: str
    target: str
    """As on the request line: origin-form (`/path?query`), or absolute-form via a proxy."""
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    """Names lower-cased."""
    body: bytes
    port: int
    """The client's port: one per connection."""
    server_name: str | None = None
    """TLS: the name the client asked for (SNI)."""
    client_cert: str | None = None
    """TLS: the common name of the client's certificate."""

    @property
    def json(self) -> Any:
        return json.loads(self.body)


class StandIn:
    def __init__(self, *script: Answer | Stream, tls: ssl.SSLContext | None = None) -> None:
        self.script = script or (Answer(200, {}),)
        self.tls = tls
        self.seen: list[Seen] = []
        self._names: list[str | None] = []
        self._release = asyncio.Event()
        if tls is not None:
            tls.sni_callback = lambda _ssl, name, _context: self._names.append(name)

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    @property
    def connections(self) -> int:
        return len({seen.port for seen in self.seen})

    async def __aenter__(self) -> StandIn:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._serve)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5,
                                     handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0, ssl_context=self.tls)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._release.set()
        await self._runner.cleanup()

    async def _serve(self, request: web.Request) -> web.StreamResponse:
        transport = request.transport
        assert transport is not None
        cert = transport.get_extra_info("peercert")
        subject = dict(pair for rdn in cert["subject"] for pair in rdn) if cert else {}
        self.seen.append(Seen(
            request.method, request.raw_path, request.path, dict(request.query),
            {k.lower(): v for k, v in request.headers.items()}, await request.read(),
            transport.get_extra_info("peername")[1],
            self._names[-1] if self._names else None, subject.get("commonName")))
        entry = self.script[min(len(self.seen), len(self.script)) - 1]
        if isinstance(entry, Answer):
            return web.Response(status=entry.status, body=entry.payload(),
                                headers={"Content-Type": "application/json", **entry.headers})
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        for piece in entry.pieces:
            if entry.pause:
                await asyncio.sleep(entry.pause)
            await response.write(piece)
        if entry.then == "silent":
            await self._release.wait()
        elif entry.then == "reset":
            sock = transport.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            transport.abort()
            return response
        await response.write_eof()
        return response
