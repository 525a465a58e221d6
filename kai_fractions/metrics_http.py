"""A Prometheus registry served over HTTP at `--metrics-listen` (the node agent's and the
mirror's), by prometheus_client's own server in a thread of its own: a scrape never waits
for, nor holds up, the component's event loop beyond the GIL."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, start_http_server


def parse_listen(listen: str, flag: str = "--metrics-listen") -> tuple[str, int]:
    """`HOST:PORT`, `[v6]:PORT` or `:PORT` -> (host, port); raises ValueError naming `flag`."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"{flag}: expected HOST:PORT, got {listen!r}")
    host = host.strip("[]") or "0.0.0.0"
    return host, int(port)


class MetricsEndpoint:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._server: Any = None

    def serve(self, listen: str) -> tuple[str, int]:
        """Starts serving; returns the address bound (the real port when `listen` asked for
        port 0). Raises ValueError for a bad address, OSError when it cannot be bound."""
        host, port = parse_listen(listen)
        self._server, _thread = start_http_server(port, host, registry=self.registry)
        bound = self._server.server_address
        return str(bound[0]), int(bound[1])

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
