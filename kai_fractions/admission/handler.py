"""The admission server's request handler: reads a request's head and its body under the
server's bounds (the body at BODY_RATE, its bytes taken from the body budget as they arrive),
routes it (ROUTES), has it reviewed, and writes the answer within its time; and the numbers it
reads and answers by (BODY_GRACE, BODY_RATE, QUEUE_WAIT, RETRY_AFTER, IO_TIMEOUT).

Given an AdmissionMetrics (metrics.py), each answer is counted where it is decided (a review by
its outcome, as soon as it ran; a refusal by its reason: a review whose answer then finds no
room is answered 503 and counted as a `no_room` refusal too).

Separate from server.py, which owns the listening, the accepting and the threads: this is what
one connection's thread runs, request after request. It logs as kai_fractions.admission.server,
as it did when it was part of that module.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING, Any

from .body_budget import MAX_BODY
from .config import AdmissionConfig
from .connections import HEADERS, IDLE, READING, SERVING, WRITING
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
from .validate import validate

if TYPE_CHECKING:
    from .server import WebhookServer

log = logging.getLogger("kai_fractions.admission.server")  # its name before the split

BODY_GRACE = 1.0
BODY_RATE = 1024 * 1024
"""A body must arrive within BODY_GRACE plus a second per BODY_RATE bytes (a few KiB: about a
second; the largest: 4 s), and an answer be read so too. The API server sends its body and
reads its answer at once; a peer that trickles either is cut, so slow peers hold neither room
nor a place for long."""
QUEUE_WAIT = 5.0
"""How long a request waits for room before it gets 503: less than the webhook's timeout, so
the API server hears why."""
RETRY_AFTER = 1
"""The 503's Retry-After (seconds): client-go, the API server's webhook client, retries a 5xx
only when it has one."""
_CHUNK = 16 * 1024
"""Read at most this much of a body at a time (a TLS record is at most 16 KiB anyway): each
connection reading a body has a buffer of this size allocated."""
IO_TIMEOUT = 30.0

Reviewer = Callable[[Mapping[str, Any], AdmissionConfig], Decision]
ROUTES: dict[str, Reviewer] = {"/validate": validate, "/mutate": mutate}


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
