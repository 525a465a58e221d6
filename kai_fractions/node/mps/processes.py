"""The MPS control daemon's process as `/proc` shows it: the one that serves a pipe directory (the
holder of its `control_lock`), the environment it runs with, the daemons that can no longer be
reached through their pipe directory, and signals. `ProcDaemonProcesses` reads the real /proc
(through `Procfs`); the supervisor's tests use a fake with the same methods.

What the 535 binary shows there (checked): the daemon detaches (daemon(3)), keeps its argv
(`nvidia-cuda-mps-control -d`) and the environment it was started with, and its `comm` is the
kernel's 15 characters, `nvidia-cuda-mps`, which an MPS server's (`nvidia-cuda-mps-server`) and
a control client's share: only the holder of the lock, or the argv with `-d`/`-f`, tell the
daemon from them.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Protocol

from kai_fractions.contract import keys as k
from kai_fractions.node.procfs import Procfs

log = logging.getLogger(__name__)

LOCK_FILE = "control_lock"
DAEMON_COMM = "nvidia-cuda-mps"
"""The daemon's /proc/<pid>/comm (the kernel keeps 15 characters of the name)."""
DAEMON_BINARY = "nvidia-cuda-mps-control"
DAEMON_FLAGS = ("-d", "-f")
"""The daemon's argv has one of these (background, foreground); a control client's never."""


class DaemonProcesses(Protocol):
    """How the supervisor finds, checks and signals the daemon's process."""

    def daemon_pid(self, pipe_dir: str) -> int | None: ...

    def environ(self, pid: int) -> dict[str, str] | None:
        """None when the process is gone, or its environment cannot be read yet (it is
        starting or exiting: `Procfs.environ`); raises OSError when it cannot be read."""
        ...

    def unreachable_daemons(self, pipe_dir: str) -> list[int]:
        """Daemons started on `pipe_dir` that no longer hold its lock: their directory (or its
        lock file) was removed, so no client reaches them and no lock names them."""
        ...

    def is_alive(self, pid: int) -> bool: ...

    def kill(self, pid: int, sig: int) -> None: ...


class ProcDaemonProcesses:
    """The real one: the holder of `<pipe dir>/control_lock` per `/proc/locks`."""

    def __init__(self, procfs: Procfs | None = None):
        self.procfs = procfs or Procfs()

    def daemon_pid(self, pipe_dir: str) -> int | None:
        for pid in self.procfs.lock_holders_of(Path(pipe_dir) / LOCK_FILE):
            if self.procfs.is_alive(pid) and (self.procfs.comm(pid) or "").startswith(DAEMON_COMM):
                return pid
        return None

    def environ(self, pid: int) -> dict[str, str] | None:
        return self.procfs.environ(pid)

    def unreachable_daemons(self, pipe_dir: str) -> list[int]:
        """Every live control daemon (its argv: `nvidia-cuda-mps-control` with `-d` or `-f`)
        whose `CUDA_MPS_PIPE_DIRECTORY` names `pipe_dir` and that does not hold its lock now.
        Only daemons in the agent's own mount namespace or the host's (pid 1's) count: the
        one the agent started, or a host tool's. A process in a container's namespace names a
        directory of that container's, whatever it is called, and is not the agent's to
        stop. A process whose environment cannot be read is left out (logged)."""
        wanted = os.path.normpath(pipe_dir)
        holder = self.daemon_pid(pipe_dir)
        namespaces = {ns for ns in (self._namespace("self"), self._namespace(1)) if ns}
        found = []
        for pid in self.procfs.pids():
            if pid == holder or not (self.procfs.comm(pid) or "").startswith(DAEMON_COMM):
                continue
            argv = self.procfs.cmdline(pid) or []
            if not argv or os.path.basename(argv[0]) != DAEMON_BINARY \
                    or not any(arg in DAEMON_FLAGS for arg in argv[1:]):
                continue  # an MPS server, or a control client
            try:
                env = self.procfs.environ(pid)
                namespace = self.procfs.mount_namespace(pid)
            except OSError as err:
                log.warning("cannot tell whether MPS control daemon pid %d runs on %s: %s",
                            pid, pipe_dir, err)
                continue
            named = (env or {}).get(k.ENV_PIPE_DIRECTORY)
            if named is None or os.path.normpath(named) != wanted:
                continue
            if namespace in namespaces and self.procfs.is_alive(pid):
                found.append(pid)
        return found

    def _namespace(self, pid: int | str) -> str | None:
        try:
            return self.procfs.mount_namespace(pid)
        except OSError:
            return None  # pid 1's, without the right to read it: only our own counts

    def is_alive(self, pid: int) -> bool:
        """Runs. A killed daemon's main thread reads as a zombie while its other threads are
        still exiting, and its lock is released only with the last of them: until then it is
        alive here, or a start right after the kill finds the lock held."""
        if self.procfs.is_alive(pid):
            return True
        return self.procfs.state(pid) == "Z" and self.procfs.threads(pid) > 1

    def kill(self, pid: int, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
