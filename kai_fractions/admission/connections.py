"""The admission server's connection table: each open connection with its state (NEW, IDLE,
HEADERS, READING, SERVING, WRITING) and since when, the limit on how many are open, and which
one makes way for a new connection when every place is taken (one stuck on its peer for
PENDING_GRACE first, then an idle keep-alive; a request being served never), the closing of
handshakes and heads that take too long, and the wait for the requests being served on
shutdown.

Separate from server.py because it is shared state with a protocol of its own: the accepting
thread makes room and admits, each connection's thread (handler.py) moves its own
connection between the states, and the metrics read its counts at each scrape.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

PENDING_GRACE = 2.0
"""When every place is taken, a connection whose handshake or request headers have not come for
this long, or whose body or answer's write is this far behind BODY_RATE, makes way for a new
one (the API server sends its request at once and reads the answer at once)."""

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
