"""Talks to the MPS control daemon through `nvidia-cuda-mps-control`, one command per run.

Two protocols:
- legacy (v2): the command is written to the client's stdin (`echo get_server_list | ...`);
- v3 (driver r615+): module-verb argv (`-p 3 namespace create <n> --server=shared`).

The client exits 0 even when the daemon rejects a command, so every answer is parsed from
stdout (`answers` lists what the real daemon prints and reads it); the daemon reports some
rejections only in control.log, so every setter reads its value back and compares. The old
binary ignores argv it does not know (`-p 3 ...`), so v3 support is probed from `--help`.
One command per run keeps answers unambiguous: the daemon prints nothing for some commands
(an unset limit), so the lines of a multi-command session cannot be matched to commands.
Argument checks live in `arguments`, the client listing and drain helpers in `clients`.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Sequence

from kai_fractions.contract import MPS_SERVER
from kai_fractions.contract import keys as k

from . import errors as e
from .answers import (
    _DEVICE_RE,
    _INVALID_PROCESS_RE,
    _PCT_RE,
    _STATUS_RE,
    CLIENT_LIST_COLUMNS,
    _busy,
    _excerpt,
    _parse_float,
    _parse_int,
    _reads_done,
    classify_answer,
    displayed_mem_limit,
    error_for_exit,
    parse_mem_limit,
)
from .arguments import NAME_RE, check_index, check_namespace, check_pct, check_positive
from .clients import MpsClient, client_servers, end_client
from .errors import MpsError
from .runner import CommandNotFound, CommandResult, CommandRunner, CommandTimeout

# Re-exported for this module's users (the package, `daemon`, the watchdog, the agent's MPS
# supervisor, the simulator, tests), who import these names from here.
__all__ = [
    "BUSY_PAUSE_S",
    "BUSY_RETRIES",
    "CLIENT_LIST_COLUMNS",
    "ENV_DEVICE_ORDER",
    "ENV_LOG_DIRECTORY",
    "NAME_RE",
    "MpsClient",
    "MpsControl",
    "check_index",
    "check_namespace",
    "check_pct",
    "check_positive",
    "classify_answer",
    "client_servers",
    "control_env",
    "displayed_mem_limit",
    "end_client",
    "error_for_exit",
    "parse_mem_limit",
]

ENV_LOG_DIRECTORY = "CUDA_MPS_LOG_DIRECTORY"
"""Read by the control daemon only (where control.log goes); not part of the pod contract."""
ENV_DEVICE_ORDER = ("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
"""For the daemon and the servers it starts: CUDA numbers devices fastest first by default,
NVML by PCI bus. A pinned limit is addressed by the NVML index (and read back by it), so on a
node with GPUs of mixed kinds the default order would set it on another GPU."""


def control_env(pipe_dir: str, log_dir: str) -> dict[str, str]:
    """The environment of every MPS control call, the daemon's start included."""
    return {k.ENV_PIPE_DIRECTORY: pipe_dir, ENV_LOG_DIRECTORY: log_dir,
            ENV_DEVICE_ORDER[0]: ENV_DEVICE_ORDER[1]}


_CLIENT_LOCKS: dict[str, threading.Lock] = {}
_CLIENT_LOCKS_GUARD = threading.Lock()


def _client_lock(pipe_dir: str) -> threading.Lock:
    """One client at a time per daemon from this process: under concurrent clients the legacy
    daemon turns most away and may even answer one with nothing at all (exit 0, empty output,
    seen with the 535 binary), which would read as an unset value."""
    with _CLIENT_LOCKS_GUARD:
        return _CLIENT_LOCKS.setdefault(pipe_dir, threading.Lock())


BUSY_RETRIES = 6
BUSY_PAUSE_S = 0.02
"""A busy daemon is asked again this many times, `BUSY_PAUSE_S` doubling in between (1.3 s in
all): another client's command takes milliseconds."""


class MpsControl:
    """One MPS control daemon (by its pipe directory), one command per `nvidia-cuda-mps-control`
    run. Inputs are validated before anything runs; every failure raises `MpsError`."""

    def __init__(
        self,
        binary: str,
        pipe_dir: str,
        log_dir: str,
        runner: CommandRunner,
        server: str = MPS_SERVER,
        *,
        protocol_v3: bool | None = None,
        timeout: float = 10.0,
        sleep: Callable[[float], None] = time.sleep,
    ):
        if not NAME_RE.fullmatch(server):
            raise MpsError(e.INVALID_ARGUMENT,
                           f"MPS server name {server!r} must match [a-z0-9_]+")
        self.binary = str(binary)
        self.pipe_dir = str(pipe_dir)
        self.log_dir = str(log_dir)
        self.runner = runner
        self.server = server
        self.timeout = timeout
        self.sleep = sleep
        """Between the tries at a busy daemon (a seam: tests do not wait)."""
        self._protocol_v3 = protocol_v3

    # ------------------------------------------------------------------ plumbing

    @property
    def env(self) -> dict[str, str]:
        return control_env(self.pipe_dir, self.log_dir)

    def _run(self, argv: Sequence[str], stdin: str | None, what: str,
             timeout: float | None) -> CommandResult:
        """One command; a daemon busy with another client is asked again (BUSY_RETRIES)."""
        pause = BUSY_PAUSE_S
        for _ in range(BUSY_RETRIES):
            try:
                return self._run_once(argv, stdin, what, timeout)
            except MpsError as err:
                if err.reason != e.MPS_DAEMON_BUSY:
                    raise
            self.sleep(pause)
            pause *= 2
        return self._run_once(argv, stdin, what, timeout)

    def _run_once(self, argv: Sequence[str], stdin: str | None, what: str,
                  timeout: float | None) -> CommandResult:
        limit = self.timeout if timeout is None else timeout
        try:
            with _client_lock(self.pipe_dir):
                result = self.runner.run(argv, stdin=stdin, env=self.env, timeout=limit)
        except CommandTimeout as exc:
            raise MpsError(
                e.MPS_DAEMON_UNREACHABLE,
                f"the MPS control daemon on {self.pipe_dir} did not answer {what!r} within "
                f"{limit:g}s (wedged or stopped); the supervisor restarts it") from exc
        except CommandNotFound as exc:
            raise MpsError(
                e.MPS_BINARY_NOT_FOUND,
                f"{exc.message}; install the NVIDIA driver's nvidia-cuda-mps-control on the "
                "node or point --mps-control-binary at it") from exc
        if result.returncode == 1 and not (result.stdout + result.stderr).strip():
            # A client turned away in silence (a command's own failures print why).
            raise _busy(what, "exit 1, no output", self.pipe_dir)
        if result.returncode != 0:
            raise error_for_exit(result, what, binary=self.binary, pipe_dir=self.pipe_dir)
        return result

    def _check(self, stdout: str, what: str) -> str:
        found = classify_answer(stdout)
        if found is None:
            return stdout.strip()
        reason, line = found
        if reason == e.UNKNOWN_COMMAND:
            message = (f"the MPS control daemon does not know {what!r} ({line}): a command "
                       "this driver's MPS does not have (upgrade the NVIDIA driver)")
        else:
            message = f"the MPS control daemon rejected {what!r}: {line}"
        raise MpsError(reason, message)

    def _expect_done(self, stdout: str, what: str) -> None:
        """For commands whose success prints nothing (or a known text, `_DONE_RE`): the
        daemon's known error texts keep their reasons, and any other text is CommandFailed
        quoting it: an answer no pattern knows must not pass as a drain or a delete done."""
        self._check(stdout, what)
        if _reads_done(stdout):
            return
        raise MpsError(
            e.COMMAND_FAILED,
            f"the MPS control daemon answered {what!r} with {_excerpt(stdout)!r}, which is not "
            "an answer it gives on success: taken as failed")

    def _confirm_gone(self, stdout: str, what: str, subject: str,
                      still_listed: Callable[[], bool]) -> None:
        """For v3 `client terminate` / `namespace delete`, whose success wording on r615 is
        pinned nowhere we can test: a known failure text keeps its reason (ClientNotFound,
        NamespaceBusy, ...); silence or an answer that reads as done is success, unread (a
        terminated client may stay connected, and listed, until its process exits, which
        the kill that follows a drain brings about); any other answer is decided by reading
        back whether `subject` is gone."""
        self._check(stdout, what)
        if _reads_done(stdout):
            return
        if still_listed():
            raise MpsError(
                e.COMMAND_FAILED,
                f"after {what!r} (answered {_excerpt(stdout) or '(no output)'!r}) the daemon "
                f"still lists {subject}: taken as failed (see {self.log_dir}/control.log)")

    def _legacy(self, command: str, timeout: float | None = None) -> str:
        result = self._run([self.binary], command + "\n", command, timeout)
        return self._check(result.stdout, command)

    def _v3(self, args: Sequence[str], timeout: float | None = None) -> str:
        self._require_v3(" ".join(args))
        argv = [self.binary, "-p", "3", *args]
        result = self._run(argv, None, " ".join(args), timeout)
        return self._check(result.stdout, " ".join(args))

    def _client_cmd(self, args: Sequence[str], timeout: float | None = None, *,
                    check: bool = True) -> str:
        self._require_v3(" ".join(args))
        result = self._run([self.binary, *args], None, " ".join(args), timeout)
        return self._check(result.stdout, " ".join(args)) if check else result.stdout

    # ------------------------------------------------------------------ protocol probe

    def supports_protocol_v3(self) -> bool:
        """Whether the binary has the v3 control protocol (cached). Its `--help` lists
        `-p, --protocol` from r615 on; the 535 binary's help does not mention it."""
        if self._protocol_v3 is None:
            argv = [self.binary, "--help"]
            try:
                # Any exit status: only the text matters (some tools exit non-zero on --help).
                result = self.runner.run(argv, stdin=None, env=self.env, timeout=self.timeout)
            except CommandTimeout as exc:
                raise MpsError(e.COMMAND_FAILED,
                               f"{self.binary} --help did not finish within "
                               f"{self.timeout:g}s") from exc
            except CommandNotFound as exc:
                raise MpsError(
                    e.MPS_BINARY_NOT_FOUND,
                    f"{exc.message}; install the NVIDIA driver's nvidia-cuda-mps-control on the "
                    "node or point --mps-control-binary at it") from exc
            self._protocol_v3 = bool(re.search(r"--protocol\b", result.stdout + result.stderr))
        return self._protocol_v3

    def _require_v3(self, what: str) -> None:
        if not self.supports_protocol_v3():
            raise MpsError(
                e.PROTOCOL_UNSUPPORTED,
                f"{self.binary} has no v3 control protocol (-p 3, NVIDIA driver r615 or newer), "
                f"needed for {what!r}: per-container MPS namespaces are unavailable on this "
                "node; upgrade the driver or run the agent with --no-sm-sharing")

    # ------------------------------------------------------------------ legacy commands

    def command(self, line: str, timeout: float | None = None) -> str:
        """Any legacy command, as an operator would type it; returns the checked answer."""
        if not line.strip() or "\n" in line or "\r" in line:
            raise MpsError(e.INVALID_ARGUMENT, f"one command line expected, got {line!r}")
        return self._legacy(line.strip(), timeout)

    def get_server_list(self, timeout: float | None = None) -> list[int]:
        out = self._legacy("get_server_list", timeout)
        pids = []
        for line in out.splitlines():
            if line.strip():
                pids.append(_parse_int(line, "get_server_list"))
        return pids

    def set_default_pinned_mem_limit(self, device_index: int, mib: int) -> str:
        """Sets the default pinned device memory limit for servers started from now on and
        returns the daemon's readback (`4G`). Raises NotApplied when the readback disagrees:
        the daemon reports a bad device index only in its log."""
        check_index(device_index, "device_index")
        check_positive(mib, "mib")
        command = f"set_default_device_pinned_mem_limit {device_index} {mib}M"
        self._legacy(command)
        got = self.get_default_pinned_mem_limit(device_index)
        expected = displayed_mem_limit(mib)
        if got != expected:
            raise MpsError(
                e.NOT_APPLIED,
                f"after {command!r} the daemon reads back {got or '(unset)'!r}, not "
                f"{expected!r}: GPU index {device_index} may not exist (see "
                f"{self.log_dir}/control.log)")
        return got

    def get_default_pinned_mem_limit(self, device_index: int) -> str:
        """The daemon's text (`4G`, `7M`), or "" when no default limit is set for the device."""
        check_index(device_index, "device_index")
        return self._legacy(f"get_default_device_pinned_mem_limit {device_index}")

    def get_default_pinned_mem_limit_mib(self, device_index: int) -> int | None:
        """The readback in MiB (a lower bound once >= 1 GiB), None when unset."""
        text = self.get_default_pinned_mem_limit(device_index)
        try:
            return parse_mem_limit(text)
        except ValueError as exc:
            raise MpsError(e.UNEXPECTED_OUTPUT,
                           f"get_default_device_pinned_mem_limit {device_index} printed "
                           f"{text!r}") from exc

    def set_default_active_thread_percentage(self, pct: int) -> str:
        check_pct(pct)
        command = f"set_default_active_thread_percentage {pct}"
        out = self._legacy(command)
        # The daemon echoes the (possibly unchanged) current value; it logs rejections only.
        if _parse_float(out, command) != float(pct):
            raise MpsError(e.NOT_APPLIED,
                           f"after {command!r} the daemon reports {out!r}")
        return out

    def get_default_active_thread_percentage(self) -> str:
        """The daemon's text, e.g. `25.0` (100.0 until set)."""
        return self._legacy("get_default_active_thread_percentage")

    def get_default_active_thread_percentage_value(self) -> float:
        out = self.get_default_active_thread_percentage()
        return _parse_float(out, "get_default_active_thread_percentage")

    def set_active_thread_percentage(self, pid: int, pct: int) -> str:
        """For the running server `pid` (clients attaching from now on)."""
        check_positive(pid, "pid")
        check_pct(pct)
        command = f"set_active_thread_percentage {pid} {pct}"
        out = self._legacy(command)
        if out and _parse_float(out, command) != float(pct):
            raise MpsError(e.NOT_APPLIED, f"after {command!r} the daemon reports {out!r}")
        return out

    def set_device_pinned_mem_limit(self, pid: int, device_index: int, mib: int) -> str:
        """For the running server `pid` (clients attaching from now on)."""
        check_positive(pid, "pid")
        check_index(device_index, "device_index")
        check_positive(mib, "mib")
        return self._legacy(f"set_device_pinned_mem_limit {pid} {device_index} {mib}M")

    def get_client_list(self, server_pid: int) -> list[int]:
        """Client pids of the server `server_pid` (legacy; v3 has `client_list`)."""
        check_positive(server_pid, "server_pid")
        out = self._legacy(f"get_client_list {server_pid}")
        return [_parse_int(line, "get_client_list") for line in out.splitlines() if line.strip()]

    def terminate_client(self, server_pid: int, client_pid: int) -> None:
        """Ends the client's outstanding GPU work on that server (legacy drain; v3 has
        `client_terminate`)."""
        check_positive(server_pid, "server_pid")
        check_positive(client_pid, "client_pid")
        command = f"terminate_client {server_pid} {client_pid}"
        out = self._run([self.binary], command + "\n", command, None).stdout
        # The 535 daemon ends this answer with a numeric status line (objdump: `%d`; `1` is a
        # failure, and a failure on the server's side prints nothing but that `1`). Whether
        # success prints `0` or nothing cannot be seen without a GPU (no server, no client
        # here): both are taken as success, any other status as a failure.
        lines = [line.strip() for line in out.splitlines() if line.strip()]
        status = int(lines.pop()) if lines and _STATUS_RE.fullmatch(lines[-1]) else None
        text = "\n".join(lines)
        gone = _INVALID_PROCESS_RE.search(text)
        if gone is not None:
            raise MpsError(e.CLIENT_NOT_FOUND,
                           f"the MPS control daemon rejected {command!r}: {gone.group(0)} "
                           f"(process {client_pid} is no client of server {server_pid})")
        self._expect_done(text, command)
        if status not in (None, 0):
            raise MpsError(
                e.COMMAND_FAILED,
                f"the MPS control daemon answered {command!r} with status {status}"
                f"{f' ({_excerpt(text)!r})' if text else ''}: the client's work was not ended "
                f"(see {self.log_dir}/control.log)")

    def quit(self, timeout: float | None = None) -> None:
        """Stops the daemon and its servers; synchronous (returns when the daemon exited).

        Legacy: `quit` on stdin. A v3 daemon makes every client speak v3, which takes commands
        from argv, so there the documented top-level `-q` is used instead."""
        if self._protocol_v3:
            result = self._run([self.binary, "-q"], None, "-q", timeout)
            self._check(result.stdout, "-q")
        else:
            self._legacy("quit", timeout)

    # ------------------------------------------------------------------ v3 commands

    def namespace_create(self, name: str, *, exist_ok: bool = False) -> None:
        self._check_namespace(name)
        try:
            self._v3(["namespace", "create", name, f"--server={self.server}"])
        except MpsError as exc:
            if not (exist_ok and exc.reason == e.NAMESPACE_EXISTS):
                raise

    def namespace_set_active_thread_percentage(self, name: str, pct: int) -> None:
        """Only takes effect for a namespace without clients yet (MPS fixes it at first attach).
        Read back like every setter (`namespace get <n> <server> active-thread-percentage`):
        raises NotApplied when the daemon holds another value (it may report a rejection only
        in its log)."""
        self._check_namespace(name)
        check_pct(pct)
        what = f"namespace set {name} --server={self.server} --active-thread-percentage={pct}"
        self._v3(["namespace", "set", name, f"--server={self.server}",
                  f"--active-thread-percentage={pct}"])
        got = self.namespace_get_active_thread_percentage(name)
        if got != float(pct):
            raise MpsError(
                e.NOT_APPLIED,
                f"after {what!r} the daemon reads back "
                f"{'(unset)' if got is None else f'{got:g}'} for namespace {name}, not {pct} "
                f"(see {self.log_dir}/control.log)")

    def namespace_get_active_thread_percentage(self, name: str) -> float | None:
        """The namespace's active-thread percentage as the daemon holds it (`25`, `25.0` or
        `25%`); None when it prints none (not set)."""
        self._check_namespace(name)
        args = ["namespace", "get", name, self.server, "active-thread-percentage"]
        out = self._v3(args).strip()
        if not out or out == "-":
            return None
        m = _PCT_RE.fullmatch(out)
        if m is None:
            raise MpsError(e.UNEXPECTED_OUTPUT,
                           f"{' '.join(args)} printed {out!r}, not a percentage")
        return float(m.group(1))

    def namespace_get_pipe_directory(self, name: str) -> str:
        self._check_namespace(name)
        out = self._v3(["namespace", "get", name, self.server, "pipe-directory"])
        lines = [line.strip() for line in out.splitlines() if line.strip()]
        m = re.search(r"(/\S*)$", lines[0]) if len(lines) == 1 else None
        if m is None:
            raise MpsError(e.UNEXPECTED_OUTPUT,
                           f"namespace get {name} {self.server} pipe-directory printed {out!r}, "
                           "not one absolute path")
        return m.group(1)

    def namespace_delete(self, name: str, *, missing_ok: bool = False) -> None:
        """Raises NamespaceBusy while clients are attached: retry after they exit."""
        self._check_namespace(name)
        args = ["namespace", "delete", name, f"--server={self.server}"]
        try:
            self._confirm_gone(self._v3(args), " ".join(args), f"namespace {name}",
                               lambda: name in self.namespace_list())
        except MpsError as exc:
            if not (missing_ok and exc.reason == e.NAMESPACE_NOT_FOUND):
                raise

    def namespace_list(self, timeout: float | None = None) -> list[str]:
        """Every namespace of the server as the daemon lists it (the implicit `default` too,
        when it lists it): callers only ever delete names they own."""
        out = self._v3(["namespace", "list", f"--server={self.server}"], timeout)
        names: list[str] = []
        for line in out.splitlines():
            token = re.split(r"[\s,]+", line.strip(), maxsplit=1)[0]
            if not token or token.lower() in ("name", "names", "namespace", "namespaces"):
                continue
            if not NAME_RE.fullmatch(token):
                raise MpsError(e.UNEXPECTED_OUTPUT,
                               f"namespace list printed a line that is not a name: {line!r}")
            names.append(token)
        return names

    def client_list(self) -> list[MpsClient]:
        what = "client list --format=csv,noheader"
        out = self._client_cmd(["client", "list", "--format=csv,noheader"], check=False)
        clients = []
        for line in out.splitlines():
            if not line.strip():
                continue
            fields = [f.strip() for f in line.split(",")]
            if not fields[0].isdigit():
                # Only a line that is not a client's row can be the daemon's error: a row ends
                # with the client's command line, which its tenant chooses (`--on-error=x`).
                self._check(line, what)
            pid = _parse_int(fields[0], "client list")
            ns_at = CLIENT_LIST_COLUMNS.index("namespace")
            if len(fields) <= ns_at or not _DEVICE_RE.fullmatch(fields[2]):
                ns_at = 2  # pid, server, namespace
            namespace = fields[ns_at] if len(fields) > ns_at and fields[ns_at] else None
            clients.append(MpsClient(pid=pid, namespace=namespace))
        return clients

    def client_terminate(self, pid: int) -> None:
        """Ends the client's outstanding GPU work (drain) before its process is stopped."""
        check_positive(pid, "pid")
        args = ["client", "terminate", str(pid)]
        self._confirm_gone(self._client_cmd(args, check=False), " ".join(args),
                           f"client {pid}", lambda: any(c.pid == pid for c in self.client_list()))

    def _check_namespace(self, name: str) -> None:
        check_namespace(self.pipe_dir, self.server, name)
