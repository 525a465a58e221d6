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
request's head is closed after HEAD_TIMEOUT in any case. The parts: the connection table in
connections.py, the body bounds and their count in body_budget.py, the request handler in
handler.py; this module listens, accepts and starts a thread per connection.

Given an AdmissionMetrics (metrics.py), the connections, the body budget and the drain
are read at each scrape, from the state above; the answers are counted by the handler.

Measured (RSS, CPython 3.11, glibc's malloc): with 1,000 idle connections open (about 60 KiB
each) and ten rounds of six of the costliest bodies these bounds let through sent at once (3
MiB, 200,000 nested objects, for /mutate), the process peaked at 282 MiB (256 MiB with
MALLOC_ARENA_MAX=2), 189 MiB without the open connections; it idles at 30 MiB. The chart's
memory limit must hold that: 384Mi. 100 peers each sending a review answered with 4 MiB (a
fractional pod with a 3 MiB env value) and never reading it: 79 to 89 MiB (MALLOC_ARENA_MAX=2;
484 to 592 MiB when answers held no room and had 30 s a send).
"""

from __future__ import annotations

import logging
import socket
import ssl
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

# Read here as `server.X` by the tests (the constants that lived here). The timings they change
# (PENDING_GRACE, BODY_GRACE, BODY_RATE, QUEUE_WAIT) are not re-exported: a copy changed here
# would change nothing; they are patched where they are read.
from .body_budget import BODY_BUDGET, MAX_BODIES, MAX_BODY, Budget  # noqa: F401
from .config import AdmissionConfig
from .connections import (  # noqa: F401
    HEADERS,
    IDLE,
    NEW,
    READING,
    SERVING,
    WRITING,
    Connections,
)
from .handler import (  # noqa: F401
    IO_TIMEOUT,
    ROUTES,
    Reviewer,
    _Handler,
)
from .tls import ReloadingContext

if TYPE_CHECKING:
    from .metrics import AdmissionMetrics

log = logging.getLogger(__name__)

MAX_REVIEWS = 1
"""Bodies parsed and reviewed at once. Python runs one at a time anyway (the GIL), so more
would add no throughput, only parsed bodies in memory: the costliest review these bounds let
through peaks at 120 MB of Python objects (tracemalloc; review.MAX_OPENINGS), and two at once
took the process to 384 MiB (with 1,000 connections open). A review may wait for the one before
it: the costliest takes about 0.6 s (for /mutate), real ones a millisecond."""
HANDSHAKE_TIMEOUT = 10.0
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


def parse_listen(address: str) -> tuple[str, int]:
    """`0.0.0.0:8443`, `[::]:8443` or `:8443` -> (host, port); raises ValueError."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"--listen must be HOST:PORT, got {address!r}")
    host = host.strip("[]") or "0.0.0.0"
    return host, int(port)


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


def make_server(listen: str, config: AdmissionConfig, tls: ReloadingContext,
                metrics: AdmissionMetrics | None = None) -> WebhookServer:
    return WebhookServer(parse_listen(listen), config, tls, metrics)
