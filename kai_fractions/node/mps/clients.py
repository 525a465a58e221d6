"""MPS clients: the row `client list` gives, and who is a client of which server and how its
GPU work is ended, over either protocol.

Separate from `control` because these helpers take any control client (`MpsControl`, or the
simulator's) and are what the watchdog and the MPS supervisor drain clients with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import errors as e
from .errors import MpsError


@dataclass(frozen=True, slots=True)
class MpsClient:
    pid: int
    namespace: str | None


def client_servers(control: Any) -> dict[int, int | None]:
    """Every MPS client's pid -> its server's pid (None with the v3 protocol, whose `client
    terminate` needs none), from a control client (`MpsControl`, or the simulator's). A legacy
    server that exits between the two listings has no client left; any other error (a timeout,
    a busy daemon) raises MpsError: then nobody can tell who is a client."""
    if control.supports_protocol_v3():
        return {int(c.pid): None for c in control.client_list()}
    clients: dict[int, int | None] = {}
    for server in control.get_server_list():
        try:
            for pid in control.get_client_list(server):
                clients[pid] = server
        except MpsError as err:
            if err.reason != e.SERVER_NOT_FOUND:
                raise
    return clients


def end_client(control: Any, pid: int, server: int | None) -> None:
    """Ends a client's outstanding GPU work (`client_servers` gave its server). Raises
    MpsError."""
    if server is None:
        control.client_terminate(pid)
    else:
        control.terminate_client(server, pid)
