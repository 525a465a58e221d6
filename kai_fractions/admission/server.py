"""HTTPS server for the webhooks: POST /validate, POST /mutate, GET /healthz.

Standard library only (ThreadingHTTPServer + ssl). The listening socket stays plain; each
accepted connection is wrapped with the context current at that moment (certificate reload),
and the TLS handshake runs in the connection's own thread with a timeout, so one slow client
cannot hold up the others.

Memory is bounded whoever sends the requests (any pod that reaches the Service can): a body is
at most MAX_BODY, the bodies held at once at most BODY_BUDGET bytes (counted as they arrive,
and each must arrive at BODY_RATE), with the answers being written (each holds the larger of
its body and itself until its write ends, and must be read at BODY_RATE too), at most
MAX_REVIEWS of them parsed, and none parsed that opens more than review.MAX_OPENINGS arrays and
objects; a request that finds no room within QUEUE_WAIT gets a 503. Threads are bounded too: at
most MAX_CONNECTIONS connections are open, each with its thread (of THREAD_STACK). Past that, a
new connection takes the place of one that waits on its peer (a handshake or headers stuck for
PENDING_GRACE, a body or an answer's write PENDING_GRACE behind BODY_RATE; failing those, an
idle keep-alive), or waits in the listen backlog, unaccepted, until one is free: a request
being served (waiting on the server: for room, a review) is never cut off. A handshake or a
request's head is closed after HEAD_TIMEOUT in any case.

Given an AdmissionMetrics (metrics.py), each answer is counted where it is decided (a review by
its outcome, as soon as it ran; a refusal by its reason: a review whose answer then finds no
room is answered 503 and counted as a `no_room` refusal too), and the connections, the body
budget and the drain are read at each scrape, from the state above.

Measured (RSS, CPython 3.11, glibc's malloc): with 1,000 idle connections open (about 60 KiB
each) and ten rounds of six of the costliest bodies these bounds let through sent at once (3
MiB, 200,000 nested objects, for /mutate), the process peaked at 282 MiB (256 MiB with
MALLOC_ARENA_MAX=2), 189 MiB without the open connections; it idles at 30 MiB. The chart's
memory limit must hold that: 384Mi. 100 peers each sending a review answered with 4 MiB (a
fractional pod with a 3 MiB env value) and never reading it: 79 to 89 MiB (MALLOC_ARENA_MAX=2;
484 to 592 MiB when answers held no room and had 30 s a send).
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
from typing import TYPE_CHECKING, Any

from .config import AdmissionConfig
from .errors import clip
from .mutate import mutate
from .review import (
    Decision,
    ReviewError,
    TooManyOpenings,
    deny,
    parse_review,
    response,
    user_of,
)
from .tls import ReloadingContext
from .validate import validate

if TYPE_CHECKING:
    from .metrics import AdmissionMetrics

log = logging.getLogger(__name__)

MAX_BODY = 3 * 1024 * 1024
"""The largest AdmissionReview read. The API server itself reads no write request over 3 MiB
(its MaxRequestBodyBytes: twice etcd's default 1.5 MiB request limit, as JSON is larger than
the protobuf etcd stores), so no pod it can store is larger than that in JSON. Pods are a few
KiB; a review past this (an UPDATE carries two objects) is refused with 413, so the pod fails
closed, never open. A larger cap only raises what a hostile body costs: parsed, JSON takes tens
of times its size in memory."""
MAX_BODIES = 4
BODY_BUDGET = MAX_BODIES * MAX_BODY
"""Bytes of request bodies held at once, counted as they arrive (a body announced but not sent
holds nothing): MAX_BODIES of the largest, or thousands of real reviews. A review's answer is
held in its body's place until it is written, which it takes for itself where it is larger (a
fractional pod with a 3 MiB env value is answered with a 4 MiB patch): answers their peers do
not read took the process past the chart's memory limit when they held nothing."""
BODY_GRACE = 1.0
BODY_RATE = 1024 * 1024
"""A body must arrive within BODY_GRACE plus a second per BODY_RATE bytes (a few KiB: about a
second; the largest: 4 s), and an answer be read so too. The API server sends its body and
reads its answer at once; a peer that trickles either is cut, so slow peers hold neither room
nor a place for long."""
MAX_REVIEWS = 1
"""Bodies parsed and reviewed at once. Python runs one at a time anyway (the GIL), so more
would add no throughput, only parsed bodies in memory: the costliest review these bounds let
through peaks at 120 MB of Python objects (tracemalloc; review.MAX_OPENINGS), and two at once
took the process to 384 MiB (with 1,000 connections open). A review may wait for the one before
it: the costliest takes about 0.6 s (for /mutate), real ones a millisecond."""
QUEUE_WAIT = 5.0
"""How long a request waits for room before it gets 503: less than the webhook's timeout, so
the API server hears why."""
RETRY_AFTER = 1
"""The 503's Retry-After (seconds): client-go, the API server's webhook client, retries a 5xx
only when it has one."""
_CHUNK = 16 * 1024
"""Read at most this much of a body at a time (a TLS record is at most 16 KiB anyway): each
connection reading a body has a buffer of this size allocated."""
HANDSHAKE_TIMEOUT = 10.0
IO_TIMEOUT = 30.0
MAX_CONNECTIONS = 1024
"""Connections (and so threads) open at once. The API server keeps a pool of keep-alive
connections per webhook and replica, and opens more for calls at the same moment (a burst of
pod creations); a connection flood from a pod would otherwise cost a thread each, without
end."""
THREAD_STACK = 1024 * 1024
"""The stack of each connection's thread: 1 GiB of address space for MAX_CONNECTIONS instead
of 8 GiB (the default 8 MiB each; untouched pages cost no memory either way). The deepest
bodies json.loads accepts (nested up to the recursion limit, anywhere in a review), reviewed
and answered, need about 200 KiB (192 KiB crashed the process, 208 KiB did not): five times
that."""
PENDING_GRACE = 2.0
"""When every place is taken, a connection whose handshake or request headers have not come for
this long, or whose body or answer's write is this far behind BODY_RATE, makes way for a new
one (the API server sends its request at once and reads the answer at once)."""
HEAD_TIMEOUT = 10.0
"""A connection's handshake and first byte, and a request's line and headers from its first
byte, must come within this (the API server sends them at once); past it the connection is
closed, places free or not: else a peer sending a byte now and then held one (a thread) for
as long as it liked."""
ACCEPT_WAIT = 0.5
"""How long the accepting thread waits for a free place at a time before it looks whether the
server is being shut down."""
DRAIN_TIMEOUT = 15.0
"""On shutdown, how long the requests being served may take to finish: longer than any can
(body, room, review), and than the webhook's 10 s timeout."""
REFUSAL_LOG_EVERY = 60.0
"""At most one warning this often about connections closed or kept waiting for want of room."""

Reviewer = Callable[[Mapping[str, Any], AdmissionConfig], Decision]
ROUTES: dict[str, Reviewer] = {"/validate": validate, "/mutate": mutate}


def parse_listen(address: str) -> tuple[str, int]:
    """`0.0.0.0:8443`, `[::]:8443` or `:8443` -> (host, port); raises ValueError."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"--listen must be HOST:PORT, got {address!r}")
    host = host.strip("[]") or "0.0.0.0"
    return host, int(port)


NEW, IDLE, HEADERS, READING, SERVING, WRITING = (
    "new", "idle", "headers", "reading", "serving", "writing")
"""A connection's state: NEW, its handshake on its way, or done and no byte of a request come
yet; IDLE, a keep-alive waiting for its next request (no byte of it come yet); HEADERS, a
request's line and headers on their way; READING, its body on its way; SERVING, the request
waiting on the server (for room, for a review); WRITING, its answer being written (waiting on
the peer to read)."""


class Connections:
    """The open connections, each with its state and since when. Thread-safe: the accepting
    thread makes room and admits, each connection's thread moves its own between the states."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._changed = threading.Condition()
        self._open: dict[socket.socket, tuple[str, float]] = {}  # -> (state, since)
        self.evicted = 0
        self.waited = 0
        """New connections left waiting in the listen backlog, every place taken by one that
        may keep it: each counted once, when the accepting thread first finds it at the head
        of the backlog with no place for it, however many ACCEPT_WAITs it then waits. (The
        connections queued behind it are not seen until they reach the head: one that finds a
        place there is not counted.)"""
        self._head_waits = False
        """The connection at the head of the backlog was counted in `waited`; it stays there
        until a place is found for it."""

    def make_room(self, timeout: float) -> bool:
        """True when a new connection can be admitted: a place is free, or one was freed by
        closing the connection that may give it up (the one stuck longest past PENDING_GRACE
        first: a handshake or headers that have not come, a body or an answer behind BODY_RATE;
        then an idle keep-alive, the longest idle). False after `timeout` without."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while len(self._open) >= self.limit:
                now = time.monotonic()
                victim, wake = self._victim(now)
                if victim is not None:
                    self._evict(victim)
                    break
                if not self._head_waits:  # a connection waits: counted once, not per call
                    self.waited += 1
                    self._head_waits = True
                if now >= deadline:
                    return False
                self._changed.wait(min(deadline, wake) - now)
            self._head_waits = False  # the head connection is accepted now
            return True

    def _victim(self, now: float) -> tuple[socket.socket | None, float]:
        """The connection to close for a new one, if any; else when one may become so."""
        best: tuple[int, float] | None = None
        victim = None
        wake = float("inf")
        for conn, (state, since) in self._open.items():
            # One stuck on its peer first: an idle keep-alive is the API server's, which may be
            # sending its next request on it as it is closed (a POST is not retried).
            if state == IDLE:
                rank = (1, since)
            elif state in (NEW, HEADERS, READING, WRITING):
                if now - since < PENDING_GRACE:
                    wake = min(wake, since + PENDING_GRACE)
                    continue
                rank = (0, since)
            else:
                continue
            if best is None or rank < best:
                best, victim = rank, conn
        return victim, wake

    def _evict(self, conn: socket.socket) -> None:
        self._cut(conn)
        self.evicted += 1

    def _cut(self, conn: socket.socket) -> None:
        """Takes `conn`'s place back (its thread, finding it gone, answers nothing more) and
        ends it: the plain socket's shutdown, so that its thread, blocked reading or writing,
        sees the end and exits (the TLS object stays as that thread uses it)."""
        del self._open[conn]
        with contextlib.suppress(OSError):
            socket.socket.shutdown(conn, socket.SHUT_RDWR)

    def admit(self, conn: socket.socket) -> None:
        with self._changed:
            self._open[conn] = (NEW, time.monotonic())

    def mark(self, conn: socket.socket, state: str, since: float | None = None) -> bool:
        """Puts `conn` in `state`, waiting on its peer `since` then (default: now; a body or an
        answer moving at BODY_RATE says so ahead of time). False when `conn` has given its place
        up (evicted): it must stop."""
        with self._changed:
            if conn not in self._open:
                return False
            was, _since = self._open[conn]
            self._open[conn] = (state, time.monotonic() if since is None else since)
            if state != was and state != SERVING:
                self._changed.notify_all()  # a place the accepting thread may take, in time
            return True

    def close(self, conn: socket.socket) -> None:
        with self._changed:
            self._open.pop(conn, None)
            self._changed.notify_all()

    def close_stuck(self, older_than: float) -> None:
        """Closes each connection whose handshake or request head (NEW, HEADERS) has waited on
        its peer longer than `older_than`; its thread, finding it gone, answers nothing."""
        now = time.monotonic()
        with self._changed:
            stuck = [conn for conn, (state, since) in self._open.items()
                     if state in (NEW, HEADERS) and now - since > older_than]
            for conn in stuck:
                self._cut(conn)
            if stuck:
                self._changed.notify_all()  # places free for the accepting thread

    def close_idle(self) -> None:
        """Closes every idle keep-alive (on shutdown: no request comes on it any more)."""
        with self._changed:
            for conn in [c for c, (state, _since) in self._open.items() if state == IDLE]:
                with contextlib.suppress(OSError):
                    socket.socket.shutdown(conn, socket.SHUT_RDWR)

    def wait_served(self, timeout: float) -> bool:
        """Waits until no connection is but an idle keep-alive; False after `timeout`. A new
        connection whose request has not begun, or a request whose head has not come, within
        PENDING_GRACE is closed meanwhile: it would otherwise hold the shutdown for `timeout`
        (the API server sends its request at once; one accepted just before the listener
        closed still gets that long)."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                now = time.monotonic()
                waiting = [(conn, state, since) for conn, (state, since) in self._open.items()
                           if state != IDLE]
                if not waiting:
                    return True
                if now >= deadline:
                    return False
                wake = deadline
                for conn, state, since in waiting:
                    if state not in (NEW, HEADERS):
                        continue
                    if now - since < PENDING_GRACE:
                        wake = min(wake, since + PENDING_GRACE)
                    else:
                        self._cut(conn)
                        wake = now  # look again: it no longer holds the exit
                self._changed.wait(wake - now)

    def __len__(self) -> int:
        with self._changed:
            return len(self._open)


class Budget:
    """A count of units (bytes) shared by the requests; thread-safe."""

    def __init__(self, size: int) -> None:
        self.size = self.free = size
        self._changed = threading.Condition()

    def take(self, n: int, timeout: float) -> bool:
        """Takes `n` units once they are free; False after `timeout` without."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while self.free < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
            self.free -= n
            return True

    def give(self, n: int) -> None:
        with self._changed:
            self.free += n
            self._changed.notify_all()


class WebhookServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128
    """The listen backlog (the standard library's 5 made connects past it wait ~1 s to retry);
    new connections wait there while every place is taken."""

    def __init__(self, address: tuple[str, int], config: AdmissionConfig,
                 tls: ReloadingContext, metrics: AdmissionMetrics | None = None) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.config = config
        self.tls = tls
        self.bodies = Budget(BODY_BUDGET)
        self.reviews = threading.BoundedSemaphore(MAX_REVIEWS)
        self.connections = Connections(MAX_CONNECTIONS)
        self.draining = False
        """Set on shutdown: /healthz answers 503 (the endpoint is taken out of the Service),
        and each answer closes its connection (the API server connects again, elsewhere)."""
        self._logged = {"waited": -REFUSAL_LOG_EVERY, "evicted": -REFUSAL_LOG_EVERY}
        self.metrics = metrics
        """Counts the answers (None: no metrics); reads the connections, the body budget and
        the drain above at each scrape."""
        super().__init__(address, _Handler)
        if metrics is not None:
            metrics.watch(self)

    def get_request(self) -> tuple[socket.socket, Any]:
        # Accept only when there is a place: a connection that finds none waits in the listen
        # backlog (its client waits), instead of being closed or closing one being served.
        waited, evicted = self.connections.waited, self.connections.evicted
        room = self.connections.make_room(ACCEPT_WAIT)
        if self.connections.waited != waited:
            self._warn("waited", "all %d connections are busy: new connections wait in the "
                       "listen backlog (%d so far)", self.connections.limit,
                       self.connections.waited)
        if self.connections.evicted != evicted:
            self._warn("evicted", "all %d connections were taken: closed one waiting on its "
                       "peer to make room for a new one (%d so far)", self.connections.limit,
                       self.connections.evicted)
        if not room:
            raise OSError("no place for a new connection yet")  # serve_forever tries again
        sock, addr = self.socket.accept()
        try:
            wrapped = self.tls.current().wrap_socket(
                sock, server_side=True, do_handshake_on_connect=False)
        except (OSError, ssl.SSLError):
            sock.close()
            raise
        return wrapped, addr

    def process_request(self, request: Any, client_address: Any) -> None:
        # On the accepting thread (the only one that admits), after make_room found a place.
        self.connections.admit(request)
        # threading.stack_size applies to the threads started while it is set; the accepting
        # thread starts them all, and sets it back at once.
        previous = threading.stack_size(THREAD_STACK)
        try:
            super().process_request(request, client_address)
        finally:
            threading.stack_size(previous)

    def _warn(self, kind: str, message: str, *args: Any) -> None:
        """At most one warning of each kind a REFUSAL_LOG_EVERY: a flood must not flood the log."""
        now = time.monotonic()
        if now - self._logged[kind] >= REFUSAL_LOG_EVERY:
            self._logged[kind] = now
            log.warning(message, *args)

    def service_actions(self) -> None:
        # serve_forever calls this every poll (half a second).
        self.connections.close_stuck(HEAD_TIMEOUT)

    def shutdown_request(self, request: Any) -> None:
        self.connections.close(request)
        super().shutdown_request(request)

    def finish_request(self, request: Any, client_address: Any) -> None:
        # Runs in the connection's thread: do the handshake here, bounded.
        try:
            request.settimeout(HANDSHAKE_TIMEOUT)
            request.do_handshake()
            request.settimeout(IO_TIMEOUT)
        except (OSError, ssl.SSLError) as e:
            log.debug("TLS handshake with %s failed: %s", client_address, e)
            return
        # The request's headers get their own PENDING_GRACE.
        if self.connections.mark(request, NEW):
            super().finish_request(request, client_address)

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], OSError):  # the peer went, or its place was taken
            log.debug("connection with %s ended: %s", client_address, sys.exc_info()[1])
            return
        log.exception("error while serving %s", client_address)

    def drain(self, timeout: float = DRAIN_TIMEOUT) -> bool:
        """Stops accepting (the listening socket is closed: new connections are refused), closes
        the idle keep-alives and waits up to `timeout` for the requests being served to be
        answered. Call it while serve_forever runs, from another thread (as `shutdown`);
        False: some were not answered in time."""
        self.draining = True
        self.shutdown()
        self.server_close()
        self.connections.close_idle()
        return self.connections.wait_served(timeout)

    @property
    def port(self) -> int:
        return self.server_address[1]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: the API server reuses connections
    server: WebhookServer
    server_version = "kai-fractions-admission"
    sys_version = ""
    _requests = 0
    _held = 0
    """Bytes of the body this request holds of the server's BODY_BUDGET."""
    _queued = 0.0
    """Seconds this request has waited for room (the body's, a review's): QUEUE_WAIT in all,
    so that its 503 comes well within the API server's timeout, which then retries."""

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.client_address[0], *args)

    def handle_one_request(self) -> None:
        # After its first request, a connection waits for its next one (keep-alive): another
        # connection may take the place at once. Once a byte of the request has come, it is a
        # request on its way (HEADERS): its place is taken only after PENDING_GRACE.
        connections = self.server.connections
        if self._requests and not connections.mark(self.request, IDLE):
            self.close_connection = True
            return
        try:
            begun = self.rfile.peek(1)
        except TimeoutError:
            begun = b""
        if not begun or not connections.mark(self.request, HEADERS):
            self.close_connection = True
            return
        super().handle_one_request()

    def parse_request(self) -> bool:
        # Reads the headers too: once they are in, the request is being served, unless its
        # place was taken meanwhile (the end of the stream then ended the headers).
        if not super().parse_request():
            return False
        if not self.server.connections.mark(self.request, SERVING):
            self.close_connection = True
            return False
        self._requests += 1
        return True

    def _send(self, status: int, body: bytes, content_type: str,
              headers: tuple[tuple[str, str], ...] = ()) -> None:
        """Writes the answer within BODY_GRACE + len(body) / BODY_RATE, else raises TimeoutError
        (the connection is then closed): writing waits on the peer to read, and the answer is
        held meanwhile. A reader PENDING_GRACE behind that rate may make way for a new
        connection."""
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in headers:
            self.send_header(name, value)
        if self.server.draining and not self.close_connection:
            self.close_connection = True
            self.send_header("Connection", "close")
        allowed = BODY_GRACE + len(body) / BODY_RATE
        start = time.monotonic()
        view = memoryview(body)
        try:
            self.server.connections.mark(self.request, WRITING, start)
            self.connection.settimeout(allowed)
            self.end_headers()
            for done in range(0, len(body), _CHUNK):
                if not self.server.connections.mark(self.request, WRITING,
                                                    start + done / BODY_RATE):
                    raise ConnectionAbortedError("its place was taken by a new connection")
                left = start + allowed - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"the answer was not read within {allowed:.1f} s")
                self.connection.settimeout(left)
                self.wfile.write(view[done:done + _CHUNK])
        finally:
            self.connection.settimeout(IO_TIMEOUT)

    def send_error(self, code: int, message: str | None = None,
                   explain: str | None = None) -> None:
        # The standard library's own answers (a bad request line, an unsupported method): a few
        # hundred bytes, waited on as ours are, and the connection is closed after. A request
        # line the server cut short itself (its place taken, its head too slow) is nobody's to
        # answer, nor a refusal to count.
        if not self.server.connections.mark(self.request, WRITING):
            self.close_connection = True
            return
        self._refused("protocol")
        self.connection.settimeout(BODY_GRACE)
        super().send_error(code, message, explain)

    def _send_text(self, status: int, text: str,
                   headers: tuple[tuple[str, str], ...] = ()) -> None:
        self._send(*_text(status, text), headers)

    def _refuse(self, reason: str, status: int, text: str,
                headers: tuple[tuple[str, str], ...] = ()) -> None:
        """Answers with a refusal instead of a review, counted by `reason` (metrics.REFUSALS)."""
        self._refused(reason)
        self._send_text(status, text, headers)

    def _refused(self, reason: str) -> None:
        if self.server.metrics is not None:
            self.server.metrics.refused(reason)

    def do_GET(self) -> None:
        if self.path.split("?", 1)[0] == "/healthz":
            if self.server.draining:
                self._send_text(HTTPStatus.SERVICE_UNAVAILABLE, "shutting down")
            else:
                self._send_text(HTTPStatus.OK, "ok")
        else:
            self._refuse("not_found", HTTPStatus.NOT_FOUND, f"no such path "
                         f"{clip(self.path, 200)}; GET /healthz, POST /validate or /mutate")

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0]
        route = ROUTES.get(path)
        if route is None:
            if self._drain():
                self._refuse("not_found", HTTPStatus.NOT_FOUND, f"no such path "
                             f"{clip(self.path, 200)}; POST /validate or /mutate")
            return
        length = _content_length(self.headers.get("Content-Length"))
        if length is None:
            self.close_connection = True
            self._refuse("length_required", HTTPStatus.LENGTH_REQUIRED,
                         "a Content-Length header of decimal digits is required")
            return
        if length > MAX_BODY:
            self.close_connection = True
            said = f"{length} bytes" if length < 10**18 else "over 10^18 bytes"
            self._refuse("body_too_large", HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                         f"the body is {said}, larger than the {MAX_BODY} bytes an "
                         "AdmissionReview can take (the API server's own request limit)")
            return
        self._queued = 0.0
        try:
            body = self._read_body(length)
            if body is None:
                return
            whole = time.monotonic()
            if not self.server.reviews.acquire(timeout=max(0.0, QUEUE_WAIT - self._queued)):
                self._busy()
                return
            try:
                answer, outcome = self._review(route, body)
            finally:
                self.server.reviews.release()
            decided = time.monotonic() - whole
            del body
            # A review that ran is counted with its outcome even if its answer then finds no
            # room (a 503, counted as no_room too): an internal error must not go unseen.
            if answer[0] == HTTPStatus.OK and self.server.metrics is not None:
                self.server.metrics.reviewed(path[1:], outcome, decided)
            # The answer is held until it is written, in the body's room, and more where it is
            # larger: taken at once or not at all (it holds a part already, as a body's later
            # bytes do). Its write is bounded in time (_send).
            more = len(answer[1]) - self._held
            if more > 0:
                if not self.server.bodies.take(more, 0):
                    self._busy()
                    return
                self._held += more
            if answer[0] != HTTPStatus.OK:
                self._refused(outcome)
            self._send(*answer)
        finally:
            self.server.bodies.give(self._held)
            self._held = 0

    def _busy(self) -> None:
        """503: the body was read whole (and dropped), so the connection stays usable."""
        self._refuse("no_room", HTTPStatus.SERVICE_UNAVAILABLE, "the webhook is busy with other "
                     f"reviews and found no room within {QUEUE_WAIT:g} s; try again",
                     (("Retry-After", str(RETRY_AFTER)),))

    def _read_body(self, length: int, keep: bool = True) -> bytes | None:
        """The body, read within BODY_GRACE + length / BODY_RATE, its bytes taken from the
        server's BODY_BUDGET as they arrive (discarded, and not counted, when not `keep`); None
        after answering 400 or 408 when it does not arrive whole, or 503 when it finds no room:
        its first bytes wait QUEUE_WAIT for room, the others none (bodies waiting while each
        holds a part could hold all of it between them); the rest is then read and dropped, so
        that the answer is not lost to a reset."""
        allowed = BODY_GRACE + length / BODY_RATE
        start = time.monotonic()
        connections = self.server.connections
        chunks: list[bytes] = []
        got = 0
        dropped = False
        try:
            while got < length:
                # Waiting on the peer: PENDING_GRACE behind BODY_RATE, it may make way.
                if not connections.mark(self.request, READING, start + got / BODY_RATE):
                    self.close_connection = True
                    return None
                left = start + allowed - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                self.connection.settimeout(min(left, IO_TIMEOUT))
                chunk = self.rfile.read1(min(length - got, _CHUNK))
                if not chunk:
                    break
                got += len(chunk)
                if keep and not dropped:
                    waited = time.monotonic()
                    if self._held:
                        taken = self.server.bodies.take(len(chunk), 0)
                    else:  # waits on the server, not on its peer
                        connections.mark(self.request, SERVING)
                        taken = self.server.bodies.take(len(chunk), QUEUE_WAIT - self._queued)
                        self._queued += time.monotonic() - waited
                    if taken:
                        self._held += len(chunk)
                        chunks.append(chunk)
                    else:
                        dropped = True
                        self.server.bodies.give(self._held)
                        self._held = 0
                        chunks = []
                    start += time.monotonic() - waited  # the sender did not wait on itself
            placed = connections.mark(self.request, SERVING)  # what follows waits on the server
        except TimeoutError:
            self.close_connection = True
            self._refuse("body_timeout", HTTPStatus.REQUEST_TIMEOUT, f"the body did not arrive "
                         f"within {allowed:.1f} s ({got} of {length} bytes): a body must come "
                         f"within {BODY_GRACE:g} s and 1 s more per {BODY_RATE / 2**20:g} MiB")
            return None
        finally:
            self.connection.settimeout(IO_TIMEOUT)
        if got < length:
            self.close_connection = True
            if placed:  # else the server ended the stream, taking its place: nobody to tell
                self._refuse("body_short", HTTPStatus.BAD_REQUEST, f"the body ended after "
                             f"{got} of the {length} bytes its Content-Length announced")
            return None
        if dropped:
            self._busy()
            return None
        return b"".join(chunks)

    def _review(self, route: Reviewer, body: bytes) -> tuple[tuple[int, bytes, str], str]:
        """The answer to send (status, body, content type), and what it is for the metrics: a
        review's outcome (metrics.OUTCOMES), or why the body was refused (metrics.REFUSALS)."""
        try:
            request = parse_review(body)
        except ReviewError as e:
            rule = "too_many_openings" if isinstance(e, TooManyOpenings) else "malformed"
            return _text(HTTPStatus.BAD_REQUEST, clip(str(e))), rule
        outcome = "error"
        try:
            decision = route(request, self.server.config)
            outcome = "allowed" if decision.allowed else "denied"
        except Exception:
            # Never a stack trace to a user: the log has it, the caller gets a reason.
            log.exception("reviewing %s failed", request.get("uid"))
            decision = deny("kai-fractions admission: internal error while reviewing this "
                            "object; the webhook's log has the details", code=500,
                            reason="InternalError")
        log.info("%s %s %s/%s by %s: %s", self.path, request.get("operation"),
                 request.get("namespace") or "-", request.get("name") or "-",
                 user_of(request) or "-",
                 "allowed" + (f" with {len(decision.patch)} patch op(s)" if decision.patch
                              else "") if decision.allowed
                 else f"denied: {clip(decision.message)}")
        payload = json.dumps(response(request["uid"], decision)).encode()
        return (HTTPStatus.OK, payload, "application/json"), outcome

    def _drain(self) -> bool:
        """Reads and drops the body of a request that gets no review, so the connection can be
        reused; one too large (or without a length) closes it instead. False: answered already
        (the body did not arrive)."""
        length = _content_length(self.headers.get("Content-Length"))
        if length is not None and length <= MAX_BODY:
            return self._read_body(length, keep=False) is not None
        self.close_connection = True
        return True


def _content_length(value: str | None) -> int | None:
    """A Content-Length of ASCII digits as a number; None for any other (`isdigit` alone takes
    '²', which int() refuses). Past 18 digits it is larger than any body allowed: not parsed
    (int() refuses over 4,300 digits)."""
    if value is None or not (value.isascii() and value.isdigit()):
        return None
    return int(value) if len(value) <= 18 else 10**18


def _text(status: int, text: str) -> tuple[int, bytes, str]:
    return status, (text + "\n").encode(), "text/plain; charset=utf-8"


def make_server(listen: str, config: AdmissionConfig, tls: ReloadingContext,
                metrics: AdmissionMetrics | None = None) -> WebhookServer:
    return WebhookServer(parse_listen(listen), config, tls, metrics)
