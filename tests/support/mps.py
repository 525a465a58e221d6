"""The REAL ``nvidia-cuda-mps-control`` daemon (Debian ``nvidia-cuda-mps``, driver 535, legacy
control protocol: no ``-p 3``) started without a GPU.

The control daemon starts, answers the legacy control commands and quits cleanly; starting an
MPS *server* fails here (needs a GPU). Every client call exits 0 on command errors — read stdout
(``Unknown command "x"``). The client exits 1 with ``Cannot find MPS control daemon process``
when no daemon listens on the pipe directory.

The pipe directory holds unix sockets (path limit 107 bytes), so it is a short ``/tmp/kmps-*``
folder, never pytest's long ``tmp_path``.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support import tools

MAX_PIPE_DIR_LEN = 83  # leaves room for the socket names under the 107-byte sun_path limit
_PID_RE = re.compile(r"Control\s+(\d+)\]\s+Starting control daemon")


def mps_control_binary() -> Path:
    """Path of the real ``nvidia-cuda-mps-control`` (for the node engine's own runner)."""
    return tools.mps_control()


def _short_tmp_dir(prefix: str) -> Path:
    base = "/tmp" if os.access("/tmp", os.W_OK) else tempfile.gettempdir()
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
    if len(str(path)) > MAX_PIPE_DIR_LEN:
        shutil.rmtree(path, ignore_errors=True)
        raise RuntimeError(f"temp dir {path} is too long for MPS unix sockets")
    return path


def mps_env(
    pipe_dir: Path | str, log_dir: Path | str, base: Mapping[str, str] | None = None
) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env["CUDA_MPS_PIPE_DIRECTORY"] = str(pipe_dir)
    env["CUDA_MPS_LOG_DIRECTORY"] = str(log_dir)
    return env


def mps_command(
    binary: Path | str,
    pipe_dir: Path | str,
    line: str,
    *,
    log_dir: Path | str | None = None,
    timeout: float = 10.0,
) -> subprocess.CompletedProcess[str]:
    """Runs ``nvidia-cuda-mps-control`` once with ``line`` on stdin (what an operator types)."""
    env = mps_env(pipe_dir, log_dir or pipe_dir)
    return subprocess.run(
        [str(binary)],
        input=line.rstrip("\n") + "\n",
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _pid_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie waiting to be reaped by init counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    state = stat.rsplit(")", 1)[-1].split()[0]
    return state not in ("Z", "X")


@dataclass
class MpsDaemon:
    binary: Path
    pipe_dir: Path
    log_dir: Path
    pid: int

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """``CUDA_MPS_PIPE_DIRECTORY`` / ``CUDA_MPS_LOG_DIRECTORY`` for clients of this daemon."""
        return mps_env(self.pipe_dir, self.log_dir, base)

    def command(self, line: str, timeout: float = 10.0) -> str:
        """Sends one control command; returns stdout without the trailing newline.
        Raises when the client itself fails (e.g. the daemon is gone)."""
        res = mps_command(self.binary, self.pipe_dir, line, log_dir=self.log_dir, timeout=timeout)
        if res.returncode != 0:
            raise RuntimeError(
                f"nvidia-cuda-mps-control {line!r} exited {res.returncode}: "
                f"{(res.stdout + res.stderr).strip()}"
            )
        return res.stdout.rstrip("\n")

    def is_alive(self) -> bool:
        return _pid_alive(self.pid)

    def wait_gone(self, timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.is_alive():
                return True
            time.sleep(0.02)
        return not self.is_alive()

    def quit(self, timeout: float = 5.0) -> bool:
        """``quit`` on the control channel; True when the daemon exited within ``timeout``."""
        if not self.is_alive():
            return True
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            self.command("quit", timeout=timeout)
        return self.wait_gone(timeout)

    def kill(self) -> None:
        if self.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            self.wait_gone(2.0)

    def control_log(self) -> str:
        path = self.log_dir / "control.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def cleanup(self) -> None:
        """Stops the daemon (``quit``, then SIGKILL) and removes its folders."""
        if not self.quit():
            self.kill()
        shutil.rmtree(self.pipe_dir, ignore_errors=True)
        shutil.rmtree(self.log_dir, ignore_errors=True)


def start_mps_daemon(binary: Path | str | None = None, *, timeout: float = 10.0) -> MpsDaemon:
    """Starts ``nvidia-cuda-mps-control -d`` on fresh short pipe/log folders and waits for it."""
    binary = Path(binary) if binary is not None else mps_control_binary()
    pipe_dir = _short_tmp_dir("kmps-")
    log_dir = _short_tmp_dir("kmpsl-")
    try:
        res = subprocess.run(
            [str(binary), "-d"],
            env=mps_env(pipe_dir, log_dir),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if res.returncode != 0:
            raise RuntimeError(
                f"{binary} -d exited {res.returncode}: {(res.stdout + res.stderr).strip()}"
            )
        deadline = time.monotonic() + timeout
        pid = None
        while time.monotonic() < deadline:
            log = log_dir / "control.log"
            match = _PID_RE.search(log.read_text(errors="replace")) if log.exists() else None
            if match and (pipe_dir / "control").exists():
                pid = int(match.group(1))
                break
            time.sleep(0.01)
        if pid is None:
            raise RuntimeError(
                f"the MPS control daemon did not come up within {timeout}s "
                f"(pipe dir {pipe_dir}: {sorted(p.name for p in pipe_dir.iterdir())})"
            )
        return MpsDaemon(binary=binary, pipe_dir=pipe_dir, log_dir=log_dir, pid=pid)
    except BaseException:
        if (pipe_dir / "control").exists():  # started but not recognised: stop it anyway
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                mps_command(binary, pipe_dir, "quit", log_dir=log_dir, timeout=5)
        shutil.rmtree(pipe_dir, ignore_errors=True)
        shutil.rmtree(log_dir, ignore_errors=True)
        raise


@pytest.fixture
def mps_daemon() -> Iterator[MpsDaemon]:
    """A running real MPS control daemon; ``quit`` (then SIGKILL) and cleaned up at teardown."""
    daemon = start_mps_daemon()
    try:
        yield daemon
    finally:
        daemon.cleanup()
