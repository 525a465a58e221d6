"""A simulated MPS control daemon and its supervisor, for the demo's simulated node (and tests).

The demo has no GPU and no `nvidia-cuda-mps-control`, yet the node agent must drive MPS as it
would on a real node. `FakeMpsControl` has `MpsControl`'s methods with the same validation, error
reasons and readback formats (`4096` MiB reads back `4G`, percentages `25.0`); every call is
recorded in `calls` as (method, args) before it is validated. `inject(method, error)` makes the
next call(s) of a method fail; `kill()` loses every setting, like the real daemon exiting;
`hang()` makes a daemon that still runs (and keeps every setting) stop answering, until
`resume()`. `FakeMpsSupervisor` has `MpsDaemon`'s interface over a `FakeMpsControl`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..contract import MPS_SERVER
from ..node.mps import errors as e
from ..node.mps.control import (
    NAME_RE,
    MpsClient,
    check_index,
    check_namespace,
    check_pct,
    check_positive,
    control_env,
    displayed_mem_limit,
    parse_mem_limit,
)
from ..node.mps.errors import MpsError


@dataclass
class FakeNamespace:
    name: str
    active_thread_percentage: int | None = None
    clients: set[int] = field(default_factory=set)
    attached_once: bool = False
    """A client has attached since the namespace was made: MPS fixed its percentage then, for
    good (only a namespace made again takes another)."""


@dataclass
class FakeServer:
    pid: int
    clients: set[int] = field(default_factory=set)
    active_thread_percentage: int | None = None
    pinned_mib: dict[int, int] = field(default_factory=dict)


class FakeMpsControl:
    def __init__(
        self,
        binary: str = "nvidia-cuda-mps-control",
        pipe_dir: str = "/run/kai-fractions/mps",
        log_dir: str = "/var/log/kai-fractions/mps",
        server: str = MPS_SERVER,
        *,
        protocol_v3: bool = True,
        devices: int = 8,
        calls: list[tuple[str, tuple[Any, ...]]] | None = None,
    ):
        if not NAME_RE.fullmatch(server):
            raise MpsError(e.INVALID_ARGUMENT, f"MPS server name {server!r} must match [a-z0-9_]+")
        self.binary = binary
        self.pipe_dir = pipe_dir
        self.log_dir = log_dir
        self.server = server
        self.protocol_v3 = protocol_v3
        self.devices = devices
        """GPU indexes 0..devices-1 exist; others behave like the daemon's invalid ordinal."""
        self.calls: list[tuple[str, tuple[Any, ...]]] = calls if calls is not None else []
        self.running = True
        self.answering = True
        """False while a running daemon does not answer (`hang`): it keeps its settings."""
        self.default_pinned_mib: dict[int, int] = {}
        self.default_active_thread_percentage: float = 100.0
        self.servers: dict[int, FakeServer] = {}
        self.namespaces: dict[str, FakeNamespace] = {}
        self.terminated: list[int] = []
        """Pids whose GPU work `client_terminate` / `terminate_client` ended, in order."""
        self._injected: dict[str, list[MpsError | Callable[[], None]]] = {}

    # ------------------------------------------------------------------ test controls

    def inject(self, method: str, error: MpsError, times: int = 1) -> None:
        """The next `times` calls of `method` raise `error` (after being recorded)."""
        self._injected.setdefault(method, []).extend([error] * times)

    def kill(self) -> None:
        """The daemon dies: every call fails as unreachable and all settings are lost."""
        self.running = False
        self.default_pinned_mib.clear()
        self.default_active_thread_percentage = 100.0
        self.servers.clear()
        self.namespaces.clear()

    def start(self) -> None:
        self.running = True
        self.answering = True

    def hang(self) -> None:
        """The daemon still runs, holding every setting, but answers nothing (a hung or very
        slow daemon): every call fails as unreachable, as a client's timeout would."""
        self.answering = False

    def resume(self) -> None:
        """A hung daemon answers again, with every setting it held."""
        self.answering = True

    def add_server(self, pid: int) -> FakeServer:
        server = self.servers.setdefault(pid, FakeServer(pid))
        if server.active_thread_percentage is None:
            server.active_thread_percentage = int(self.default_active_thread_percentage)
        return server

    def attach_client(self, pid: int, namespace: str | None = None,
                      server_pid: int | None = None) -> None:
        """A CUDA process connects (to a namespace in v3, to a server in legacy mode)."""
        if namespace is not None:
            ns = self.namespaces[namespace]
            ns.clients.add(pid)
            ns.attached_once = True
        else:
            self.add_server(server_pid or 1).clients.add(pid)

    def detach_client(self, pid: int) -> None:
        for ns in self.namespaces.values():
            ns.clients.discard(pid)
        for server in self.servers.values():
            server.clients.discard(pid)

    def methods_called(self) -> list[str]:
        return [name for name, _ in self.calls]

    # ------------------------------------------------------------------ plumbing

    @property
    def env(self) -> dict[str, str]:
        return control_env(self.pipe_dir, self.log_dir)

    def _enter(self, method: str, *args: Any, v3: bool = False) -> None:
        self.calls.append((method, args))
        queue = self._injected.get(method)
        if queue:
            raise queue.pop(0)  # type: ignore[misc]
        if v3 and not self.protocol_v3:
            raise MpsError(e.PROTOCOL_UNSUPPORTED,
                           f"{self.binary} has no v3 control protocol (-p 3, NVIDIA driver r615 "
                           f"or newer), needed for {method!r}: per-container MPS namespaces are "
                           "unavailable on this node; upgrade the driver or run the agent with "
                           "--no-sm-sharing")

    def _alive(self, what: str) -> None:
        if not self.running:
            raise MpsError(e.MPS_DAEMON_UNREACHABLE,
                           f"no MPS control daemon answers on {self.pipe_dir} ({what!r}: Cannot "
                           "find MPS control daemon process); the supervisor starts it")
        if not self.answering:
            raise MpsError(e.MPS_DAEMON_UNREACHABLE,
                           f"the MPS control daemon on {self.pipe_dir} did not answer {what!r} "
                           "in time")

    def _server(self, pid: int) -> FakeServer:
        if pid not in self.servers:
            raise MpsError(e.SERVER_NOT_FOUND,
                           f"the MPS control daemon rejected the command: Server {pid} not found")
        return self.servers[pid]

    def _namespace(self, name: str) -> FakeNamespace:
        if name not in self.namespaces:
            raise MpsError(e.NAMESPACE_NOT_FOUND,
                           f"the MPS control daemon rejected the command: namespace {name} "
                           "not found")
        return self.namespaces[name]

    def _check_namespace(self, name: str) -> None:
        check_namespace(self.pipe_dir, self.server, name)

    # ------------------------------------------------------------------ MpsControl's surface

    def supports_protocol_v3(self) -> bool:
        return self.protocol_v3

    def command(self, line: str, timeout: float | None = None) -> str:
        self._enter("command", line)
        self._alive(line)
        word = line.split()[0] if line.split() else line
        raise MpsError(e.UNKNOWN_COMMAND,
                       f"the MPS control daemon does not know {line!r} (Unknown command "
                       f'"{word}"): a command this driver\'s MPS does not have (upgrade the '
                       "NVIDIA driver)")

    def get_server_list(self, timeout: float | None = None) -> list[int]:
        self._enter("get_server_list")
        self._alive("get_server_list")
        return sorted(self.servers)

    def set_default_pinned_mem_limit(self, device_index: int, mib: int) -> str:
        self._enter("set_default_pinned_mem_limit", device_index, mib)
        check_index(device_index, "device_index")
        check_positive(mib, "mib")
        self._alive("set_default_device_pinned_mem_limit")
        if device_index >= self.devices:
            raise MpsError(e.NOT_APPLIED,
                           f"after 'set_default_device_pinned_mem_limit {device_index} {mib}M' "
                           f"the daemon reads back '(unset)', not {displayed_mem_limit(mib)!r}: "
                           f"GPU index {device_index} may not exist (see "
                           f"{self.log_dir}/control.log)")
        self.default_pinned_mib[device_index] = mib
        return displayed_mem_limit(mib)

    def get_default_pinned_mem_limit(self, device_index: int) -> str:
        self._enter("get_default_pinned_mem_limit", device_index)
        check_index(device_index, "device_index")
        self._alive("get_default_device_pinned_mem_limit")
        mib = self.default_pinned_mib.get(device_index)
        return "" if mib is None else displayed_mem_limit(mib)

    def get_default_pinned_mem_limit_mib(self, device_index: int) -> int | None:
        return parse_mem_limit(self.get_default_pinned_mem_limit(device_index))

    def set_default_active_thread_percentage(self, pct: int) -> str:
        self._enter("set_default_active_thread_percentage", pct)
        check_pct(pct)
        self._alive("set_default_active_thread_percentage")
        self.default_active_thread_percentage = float(pct)
        return f"{float(pct)}"

    def get_default_active_thread_percentage(self) -> str:
        self._enter("get_default_active_thread_percentage")
        self._alive("get_default_active_thread_percentage")
        return f"{self.default_active_thread_percentage}"

    def get_default_active_thread_percentage_value(self) -> float:
        return float(self.get_default_active_thread_percentage())

    def set_active_thread_percentage(self, pid: int, pct: int) -> str:
        self._enter("set_active_thread_percentage", pid, pct)
        check_positive(pid, "pid")
        check_pct(pct)
        self._alive("set_active_thread_percentage")
        self._server(pid).active_thread_percentage = pct
        return f"{float(pct)}"

    def set_device_pinned_mem_limit(self, pid: int, device_index: int, mib: int) -> str:
        self._enter("set_device_pinned_mem_limit", pid, device_index, mib)
        check_positive(pid, "pid")
        check_index(device_index, "device_index")
        check_positive(mib, "mib")
        self._alive("set_device_pinned_mem_limit")
        self._server(pid).pinned_mib[device_index] = mib
        return ""

    def get_client_list(self, server_pid: int) -> list[int]:
        self._enter("get_client_list", server_pid)
        check_positive(server_pid, "server_pid")
        self._alive("get_client_list")
        return sorted(self._server(server_pid).clients)

    def terminate_client(self, server_pid: int, client_pid: int) -> None:
        self._enter("terminate_client", server_pid, client_pid)
        check_positive(server_pid, "server_pid")
        check_positive(client_pid, "client_pid")
        self._alive("terminate_client")
        server = self._server(server_pid)
        if client_pid in server.clients:
            server.clients.discard(client_pid)
            self.terminated.append(client_pid)

    def quit(self, timeout: float | None = None) -> None:
        self._enter("quit")
        self._alive("quit")
        self.kill()

    def namespace_create(self, name: str, *, exist_ok: bool = False) -> None:
        self._enter("namespace_create", name, v3=True)
        self._check_namespace(name)
        self._alive("namespace create")
        if name in self.namespaces:
            if exist_ok:
                return
            raise MpsError(e.NAMESPACE_EXISTS,
                           f"the MPS control daemon rejected 'namespace create {name} "
                           f"--server={self.server}': namespace {name} already exists")
        self.namespaces[name] = FakeNamespace(name)

    def namespace_set_active_thread_percentage(self, name: str, pct: int) -> None:
        self._enter("namespace_set_active_thread_percentage", name, pct, v3=True)
        self._check_namespace(name)
        check_pct(pct)
        self._alive("namespace set")
        ns = self._namespace(name)
        # The cap of a namespace can be set only before its first client attaches
        # (enforcement-primitives): with clients attached, or after they have all left.
        if ns.clients and ns.active_thread_percentage != pct:
            raise MpsError(e.NAMESPACE_BUSY,
                           f"the MPS control daemon rejected 'namespace set {name}': clients "
                           "are attached (the cap is fixed at the first attach)")
        if ns.attached_once and ns.active_thread_percentage != pct:
            raise MpsError(e.NAMESPACE_BUSY,
                           f"the MPS control daemon rejected 'namespace set {name}': the cap "
                           "was fixed when its first client attached")
        ns.active_thread_percentage = pct

    def namespace_get_active_thread_percentage(self, name: str) -> float | None:
        self._enter("namespace_get_active_thread_percentage", name, v3=True)
        self._check_namespace(name)
        self._alive("namespace get")
        pct = self._namespace(name).active_thread_percentage
        return None if pct is None else float(pct)

    def namespace_get_pipe_directory(self, name: str) -> str:
        self._enter("namespace_get_pipe_directory", name, v3=True)
        self._check_namespace(name)
        self._alive("namespace get")
        self._namespace(name)
        return f"{self.pipe_dir.rstrip('/')}/{self.server}/{name}"

    def namespace_delete(self, name: str, *, missing_ok: bool = False) -> None:
        self._enter("namespace_delete", name, v3=True)
        self._check_namespace(name)
        self._alive("namespace delete")
        if name not in self.namespaces:
            if missing_ok:
                return
            self._namespace(name)
        if self.namespaces[name].clients:
            raise MpsError(e.NAMESPACE_BUSY,
                           f"the MPS control daemon rejected 'namespace delete {name} "
                           f"--server={self.server}': clients are attached")
        del self.namespaces[name]

    def namespace_list(self, timeout: float | None = None) -> list[str]:
        self._enter("namespace_list", v3=True)
        self._alive("namespace list")
        return sorted(self.namespaces)

    def client_list(self) -> list[MpsClient]:
        self._enter("client_list", v3=True)
        self._alive("client list")
        clients = [MpsClient(pid, ns.name) for ns in self.namespaces.values() for pid in ns.clients]
        clients += [MpsClient(pid, None) for s in self.servers.values() for pid in s.clients]
        return sorted(clients, key=lambda c: c.pid)

    def client_terminate(self, pid: int) -> None:
        self._enter("client_terminate", pid, v3=True)
        check_positive(pid, "pid")
        self._alive("client terminate")
        if not any(pid in ns.clients for ns in self.namespaces.values()) and not any(
                pid in s.clients for s in self.servers.values()):
            raise MpsError(e.CLIENT_NOT_FOUND,
                           f"the MPS control daemon rejected 'client terminate {pid}': client "
                           f"{pid} not found")
        self.detach_client(pid)
        self.terminated.append(pid)


class FakeMpsSupervisor:
    """`MpsDaemon`'s interface over a `FakeMpsControl`: `control.kill()` makes the daemon die,
    `can_start=False` makes every (re)start fail (`not_running` then), `control.hang()` makes a
    running daemon stop answering (never restarted here; not `not_running`: it keeps its
    settings)."""

    def __init__(self, control: FakeMpsControl | None = None, *, can_start: bool = True):
        self.control = control or FakeMpsControl()
        self.can_start = can_start
        self.restarts = 0
        self.starts = 0
        self.last_error: MpsError | None = None
        self.not_running = False
        self.on_restart: Any = None
        self.stopped = False
        self._seen_running = False

    def healthy(self) -> bool:
        return self.control.running and self.control.answering

    def ensure_running(self) -> bool:
        self.not_running = False
        if self.control.running and not self.control.answering:
            self.last_error = MpsError(e.MPS_DAEMON_NOT_ANSWERING,
                                       f"the MPS control daemon on {self.control.pipe_dir} runs "
                                       "but does not answer")
            return False
        if self.control.running:
            self._seen_running = True
            self.last_error = None
            return True
        if not self.can_start:
            self.last_error = MpsError(e.MPS_DAEMON_UNREACHABLE,
                                       f"no MPS control daemon answers on "
                                       f"{self.control.pipe_dir} and it cannot be started")
            self.not_running = True
            return False
        self.control.start()
        self.starts += 1
        if self._seen_running:
            self.restarts += 1
        self._seen_running = True
        if self.on_restart is not None:
            self.on_restart(self.control)
        self.last_error = None
        return True

    def stop(self, grace: float | None = None) -> bool:
        self.control.kill()
        self.stopped = True
        return True
