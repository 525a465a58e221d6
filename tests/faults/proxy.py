"""A TCP proxy that breaks connections on purpose (for faults kmock cannot make): reset every
open connection (a watch cut mid-stream), reset the next N new connections at once (connection
refused/reset on connect), or stall new connections (accepted, never answered: timeouts).
Byte-level, so long-running watch streams pass through unchanged while nothing is injected."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from urllib.parse import urlsplit


def _rst(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()


class FaultProxy:
    def __init__(self, upstream_url: str) -> None:
        parts = urlsplit(upstream_url)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._lock = threading.Lock()
        self._open: list[tuple[socket.socket, socket.socket]] = []
        self._stalled: list[socket.socket] = []
        self.reset_next = 0
        """New connections to reset at once (then counted down)."""
        self.stall = False
        """New connections are accepted and never answered while set."""
        self.connections = 0
        self.resets = 0
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="fault-proxy", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            with self._lock:
                self.connections += 1
                if self.reset_next > 0:
                    self.reset_next -= 1
                    self.resets += 1
                    _rst(client)
                    continue
                if self.stall:
                    self._stalled.append(client)
                    continue
            try:
                upstream = socket.create_connection(self.upstream, timeout=5)
                upstream.settimeout(None)
            except OSError:
                _rst(client)
                continue
            with self._lock:
                self._open.append((client, upstream))
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    def reset_all(self) -> int:
        """Reset every open (and stalled) connection now; returns how many."""
        with self._lock:
            pairs, self._open = self._open, []
            stalled, self._stalled = self._stalled, []
            self.resets += len(pairs) + len(stalled)
        for client, upstream in pairs:
            _rst(client)
            _rst(upstream)
        for client in stalled:
            _rst(client)
        return len(pairs) + len(stalled)

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self.listener.close()
        self.reset_all()
