"""HTTPS server for the webhooks: POST /validate, POST /mutate, GET /healthz.

Standard library only (ThreadingHTTPServer + ssl). The listening socket stays plain; each
accepted connection is wrapped with the context current at that moment (certificate reload),
and the TLS handshake runs in the connection's own thread with a timeout, so one slow client
cannot hold up the others.

Memory is bounded whoever sends the requests (any pod that reaches the Service can): a body is
at most MAX_BODY, at most MAX_BODIES bodies are held at once and at most MAX_REVIEWS of them
parsed; a request that finds no room within QUEUE_WAIT gets a 503. Threads are bounded too: at
most MAX_CONNECTIONS connections are open, each with its thread; a new one past that takes the
place of the one that has waited longest on its peer (an idle keep-alive, a slow handshake, a
request that trickles in, answers read slowly), or is closed at once when every connection is
being served.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable, Mapping
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from .config import AdmissionConfig
from .errors import clip
from .mutate import mutate
from .review import Decision, ReviewError, deny, parse_review, response
from .tls import ReloadingContext
from .validate import validate

log = logging.getLogger(__name__)

MAX_BODY = 3 * 1024 * 1024
"""The largest AdmissionReview read. The API server itself reads no write request over 3 MiB
(its MaxRequestBodyBytes: twice etcd's default 1.5 MiB request limit, as JSON is larger than
the protobuf etcd stores), so no pod it can store is larger than that in JSON. Pods are a few
KiB; a review past this (an UPDATE carries two objects) is refused with 413, so the pod fails
closed, never open. A larger cap only raises what a hostile body costs: parsed, JSON takes tens
of times its size in memory."""
MAX_BODIES = 4
"""Request bodies held at once (read, or waiting for a review)."""
MAX_REVIEWS = 2
"""Bodies parsed and reviewed at once. Python runs one at a time anyway (the GIL), so more
would add no throughput, only parsed bodies in memory; the chart's memory limit holds two of
the largest."""
QUEUE_WAIT = 5.0
"""How long a request waits for room before it gets 503: less than the webhook's timeout, so
the API server hears why."""
BODY_DEADLINE = 10.0
"""The whole body must arrive within this: a slow sender holds its room no longer."""
_CHUNK = 64 * 1024
HANDSHAKE_TIMEOUT = 10.0
IO_TIMEOUT = 30.0
MAX_CONNECTIONS = 128
"""Connections (and so threads) open at once. The API server keeps a pool of keep-alive
connections per webhook and replica, and opens more only for calls at the same moment; a
connection flood from a pod would otherwise cost a thread each, without end."""
REFUSAL_LOG_EVERY = 60.0
"""At most one warning this often about connections closed for want of room."""

Reviewer = Callable[[Mapping[str, Any], AdmissionConfig], Decision]
ROUTES: dict[str, Reviewer] = {"/validate": validate, "/mutate": mutate}


def parse_listen(address: str) -> tuple[str, int]:
    """`0.0.0.0:8443`, `[::]:8443` or `:8443` -> (host, port); raises ValueError."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"--listen must be HOST:PORT, got {address!r}")
    host = host.strip("[]") or "0.0.0.0"
    return host, int(port)


class Connections:
    """The open connections and whether each is waiting (on its peer: for its handshake, for
    a request, or for the peer to take a response: a place another connection may take) or
    being served, since when. Thread-safe: the accepting thread admits, each connection's
    thread moves its own between the two."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._open: dict[socket.socket, tuple[bool, float]] = {}  # -> (waiting, since)
        self.evicted = 0
        self.refused = 0

    def admit(self, conn: socket.socket) -> bool:
        """Takes a place for `conn`, making one by closing the connection that has waited
        longest when all are taken; False when every connection is being served."""
        with self._lock:
            if len(self._open) >= self.limit:
                waiting = [(since, i, c) for i, (c, (idle, since)) in enumerate(self._open.items())
                           if idle]
                if not waiting:
                    self.refused += 1
                    return False
                _since, _i, victim = min(waiting)
                del self._open[victim]
                self.evicted += 1
                # The plain socket's shutdown: its thread, blocked reading, sees the end and
                # exits (the TLS object stays as that thread uses it).
                with contextlib.suppress(OSError):
                    socket.socket.shutdown(victim, socket.SHUT_RDWR)
            self._open[conn] = (True, time.monotonic())
            return True

    def mark(self, conn: socket.socket, *, waiting: bool) -> bool:
        """False when `conn` has given its place up (evicted): it must stop."""
        with self._lock:
            if conn not in self._open:
                return False
            self._open[conn] = (waiting, time.monotonic())
            return True

    def close(self, conn: socket.socket) -> None:
        with self._lock:
            self._open.pop(conn, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._open)


class WebhookServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128
    """The listen backlog (the standard library's 5 made connects past it wait ~1 s to retry)."""

    def __init__(self, address: tuple[str, int], config: AdmissionConfig,
                 tls: ReloadingContext) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.config = config
        self.tls = tls
        self.bodies = threading.BoundedSemaphore(MAX_BODIES)
        self.reviews = threading.BoundedSemaphore(MAX_REVIEWS)
        self.connections = Connections(MAX_CONNECTIONS)
        self._logged = {"refused": -REFUSAL_LOG_EVERY, "evicted": -REFUSAL_LOG_EVERY}
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        # On the accepting thread, before a thread is started for the connection.
        evicted = self.connections.evicted
        if not self.connections.admit(request):
            self._warn("refused", "closed a connection from %s at once: all %d connections are "
                       "being served (%d closed so far)", client_address[0],
                       self.connections.limit, self.connections.refused)
            self.shutdown_request(request)
            return
        if self.connections.evicted != evicted:
            self._warn("evicted", "all %d connections were taken: closed the one that had "
                       "waited longest for its peer to make room for %s (%d so far)",
                       self.connections.limit, client_address[0], self.connections.evicted)
        super().process_request(request, client_address)

    def _warn(self, kind: str, message: str, *args: Any) -> None:
        """At most one warning of each kind a REFUSAL_LOG_EVERY: a flood must not flood the log."""
        now = time.monotonic()
        if now - self._logged[kind] >= REFUSAL_LOG_EVERY:
            self._logged[kind] = now
            log.warning(message, *args)

    def shutdown_request(self, request: Any) -> None:
        self.connections.close(request)
        super().shutdown_request(request)

    def get_request(self) -> tuple[socket.socket, Any]:
        sock, addr = self.socket.accept()
        try:
            wrapped = self.tls.current().wrap_socket(
                sock, server_side=True, do_handshake_on_connect=False)
        except (OSError, ssl.SSLError):
            sock.close()
            raise
        return wrapped, addr

    def finish_request(self, request: Any, client_address: Any) -> None:
        # Runs in the connection's thread: do the handshake here, bounded.
        try:
            request.settimeout(HANDSHAKE_TIMEOUT)
            request.do_handshake()
            request.settimeout(IO_TIMEOUT)
        except (OSError, ssl.SSLError) as e:
            log.debug("TLS handshake with %s failed: %s", client_address, e)
            return
        super().finish_request(request, client_address)

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], OSError):  # the peer went, or its place was taken
            log.debug("connection with %s ended: %s", client_address, sys.exc_info()[1])
            return
        log.exception("error while serving %s", client_address)

    @property
    def port(self) -> int:
        return self.server_address[1]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: the API server reuses connections
    server: WebhookServer
    server_version = "kai-fractions-admission"
    sys_version = ""

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.client_address[0], *args)

    def handle_one_request(self) -> None:
        # Waiting for the next request (keep-alive): another connection may take the place.
        self.server.connections.mark(self.request, waiting=True)
        super().handle_one_request()

    def parse_request(self) -> bool:
        # Reads the headers too: once they are in, the request is being served, unless its
        # place was taken meanwhile (the end of the stream then ended the headers).
        if not super().parse_request():
            return False
        if not self.server.connections.mark(self.request, waiting=False):
            self.close_connection = True
            return False
        return True

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        # Writing waits on the peer to read: a slow reader's place may be taken.
        self.server.connections.mark(self.request, waiting=True)
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _send_text(self, status: int, text: str) -> None:
        self._send(*_text(status, text))

    def do_GET(self) -> None:
        if self.path.split("?", 1)[0] == "/healthz":
            self._send_text(HTTPStatus.OK, "ok")
        else:
            self._send_text(HTTPStatus.NOT_FOUND, f"no such path {clip(self.path, 200)}; "
                            "GET /healthz, POST /validate or /mutate")

    def do_POST(self) -> None:
        route = ROUTES.get(self.path.split("?", 1)[0])
        if route is None:
            if self._drain():
                self._send_text(HTTPStatus.NOT_FOUND, f"no such path {clip(self.path, 200)}; "
                                "POST /validate or /mutate")
            return
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self.close_connection = True
            self._send_text(HTTPStatus.LENGTH_REQUIRED, "a Content-Length header is required")
            return
        if int(length) > MAX_BODY:
            self.close_connection = True
            self._send_text(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                            f"the body is {int(length)} bytes, larger than the {MAX_BODY} bytes "
                            "an AdmissionReview can take (the API server's own request limit)")
            return
        if not self._room(self.server.bodies):
            return
        try:
            body = self._read_body(int(length))
            if body is None or not self._room(self.server.reviews):
                return
            try:
                answer = self._review(route, body)
            finally:
                self.server.reviews.release()
        finally:
            self.server.bodies.release()
        # Written with no room held: a peer that reads its answers slowly holds only its
        # connection (a place another may take), never the room the other reviews need.
        self._send(*answer)

    def _room(self, slots: threading.BoundedSemaphore) -> bool:
        """Takes one of `slots`, or answers 503 (and closes: the body is not read)."""
        if slots.acquire(timeout=QUEUE_WAIT):
            return True
        self.close_connection = True
        self._send_text(HTTPStatus.SERVICE_UNAVAILABLE, "the webhook is busy with other "
                        f"reviews and found no room within {QUEUE_WAIT:g} s; try again")
        return False

    def _read_body(self, length: int, keep: bool = True) -> bytes | None:
        """The body, read within BODY_DEADLINE (discarded when not `keep`); None after
        answering 400 or 408 when it does not arrive whole."""
        deadline = time.monotonic() + BODY_DEADLINE
        chunks: list[bytes] = []
        got = 0
        try:
            while got < length:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                self.connection.settimeout(min(left, IO_TIMEOUT))
                chunk = self.rfile.read1(min(length - got, _CHUNK))
                if not chunk:
                    break
                got += len(chunk)
                if keep:
                    chunks.append(chunk)
        except TimeoutError:
            self.close_connection = True
            self._send_text(HTTPStatus.REQUEST_TIMEOUT, f"the body did not arrive within "
                            f"{BODY_DEADLINE:g} s ({got} of {length} bytes)")
            return None
        finally:
            self.connection.settimeout(IO_TIMEOUT)
        if got < length:
            self.close_connection = True
            self._send_text(HTTPStatus.BAD_REQUEST, f"the body ended after {got} of the "
                            f"{length} bytes its Content-Length announced")
            return None
        return b"".join(chunks)

    def _review(self, route: Reviewer, body: bytes) -> tuple[int, bytes, str]:
        """The answer to send: status, body, content type."""
        try:
            request = parse_review(body)
        except ReviewError as e:
            return _text(HTTPStatus.BAD_REQUEST, clip(str(e)))
        try:
            decision = route(request, self.server.config)
        except Exception:
            # Never a stack trace to a user: the log has it, the caller gets a reason.
            log.exception("reviewing %s failed", request.get("uid"))
            decision = deny("kai-fractions admission: internal error while reviewing this "
                            "object; the webhook's log has the details", code=500,
                            reason="InternalError")
        log.info("%s %s %s/%s by %s: %s", self.path, request.get("operation"),
                 request.get("namespace") or "-", request.get("name") or "-",
                 (request.get("userInfo") or {}).get("username", "-"),
                 "allowed" + (f" with {len(decision.patch)} patch op(s)" if decision.patch
                              else "") if decision.allowed
                 else f"denied: {clip(decision.message)}")
        payload = json.dumps(response(request["uid"], decision)).encode()
        return HTTPStatus.OK, payload, "application/json"

    def _drain(self) -> bool:
        """Reads and drops the body of a request that gets no review, so the connection can be
        reused; one too large (or without a length) closes it instead. False: answered already
        (the body did not arrive)."""
        length = self.headers.get("Content-Length")
        if length and length.isdigit() and int(length) <= MAX_BODY:
            return self._read_body(int(length), keep=False) is not None
        self.close_connection = True
        return True


def _text(status: int, text: str) -> tuple[int, bytes, str]:
    return status, (text + "\n").encode(), "text/plain; charset=utf-8"


def make_server(listen: str, config: AdmissionConfig, tls: ReloadingContext) -> WebhookServer:
    return WebhookServer(parse_listen(listen), config, tls)
