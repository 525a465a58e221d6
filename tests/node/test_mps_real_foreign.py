"""The REAL `nvidia-cuda-mps-control` (the 535 build, legacy protocol, no GPU needed for the
control daemon) under MpsDaemon with the real runner and the real /proc:

- its pipe directory removed under it: the daemon it ran is stopped, not left beside the new
  one (and past the agent's stop);
- a daemon started by another tool without the agent's device numbering is not adopted, and
  left running; one started as the agent does is;
- control.log, cut in place, goes on from its start (the daemon appends).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kai_fractions.node.mps.daemon import MpsDaemon, SystemClock, legacy_pipe_dir
from kai_fractions.node.mps.runner import SubprocessRunner
from kai_fractions.node.procfs import Procfs
from tests.support import tools

pytestmark = pytest.mark.integration


@pytest.fixture
def root() -> Iterator[Path]:
    # unix socket paths are at most 107 bytes: pytest's tmp_path is too long for a pipe dir
    path = Path(tempfile.mkdtemp(prefix="kf", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def leftovers() -> Iterator[list[int]]:
    """Pids to SIGKILL at the end, whatever the test found."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        if pid and Procfs().is_alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _supervisor(root: Path, **kw) -> MpsDaemon:
    def reapply(control) -> None:
        control.set_default_pinned_mem_limit(0, 4096)

    return MpsDaemon(str(tools.mps_control()), str(root / "p"), str(root / "l"),
                     SubprocessRunner(), SystemClock(), on_restart=reapply,
                     health_timeout=1.0, stop_grace=2.0, **kw)


def test_a_daemon_cut_off_from_its_pipe_dir_is_stopped_and_replaced(root, leftovers):
    daemon = _supervisor(root)
    assert daemon.ensure_running() is True
    first = daemon.pid()
    leftovers.append(first)
    shutil.rmtree(root / "p")  # a cleanup script; the daemon runs on, unreachable
    assert Procfs().is_alive(first)
    assert daemon.ensure_running() is True
    second = daemon.pid()
    leftovers.append(second)
    assert second not in (None, first)
    assert not Procfs().is_alive(first)  # not left beside the new one
    assert daemon.restarts == 1
    assert f"pid {first}" in daemon.restart_cause
    assert daemon.control.get_default_pinned_mem_limit(0) == "4G"  # its state put back
    assert daemon.stop() is True and not Procfs().is_alive(second)


def test_the_stop_ends_a_daemon_cut_off_from_its_pipe_dir(root, leftovers):
    daemon = _supervisor(root)
    assert daemon.ensure_running() is True
    first = daemon.pid()
    leftovers.append(first)
    shutil.rmtree(root / "p")
    assert daemon.stop() is True
    assert not Procfs().is_alive(first)  # it used to outlive the agent


def _foreign(root: Path, **env: str) -> tuple[str, dict[str, str]]:
    """Starts a daemon on the supervisor's legacy pipe directory as another tool would."""
    pipe = legacy_pipe_dir(str(root / "p"), "shared")
    os.makedirs(pipe)
    os.makedirs(root / "l", exist_ok=True)
    full = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "CUDA_MPS_PIPE_DIRECTORY": pipe,
            "CUDA_MPS_LOG_DIRECTORY": str(root / "l"), **env}
    subprocess.run([str(tools.mps_control()), "-d"], env=full, check=True, timeout=10)
    return pipe, full


def _quit(env: dict[str, str]) -> None:
    subprocess.run([str(tools.mps_control())], input="quit\n", env=env, text=True,
                   capture_output=True, timeout=10, check=False)


def test_a_foreign_daemon_numbering_the_gpus_otherwise_is_not_adopted(root, leftovers):
    _, env = _foreign(root, CUDA_VISIBLE_DEVICES="1")  # and no CUDA_DEVICE_ORDER
    daemon = _supervisor(root)
    foreign = daemon.pid()
    leftovers.append(foreign)
    try:
        assert foreign is not None
        assert daemon.ensure_running() is False
        err = daemon.last_error
        assert err.reason == "MpsDaemonAlreadyRunning"
        assert "CUDA_DEVICE_ORDER unset" in err.message
        assert "CUDA_VISIBLE_DEVICES='1'" in err.message
        assert daemon.starts == 0 and daemon.not_running is True
        # nothing was set through it
        assert daemon.control.get_default_pinned_mem_limit(0) == ""
        assert daemon.stop() is False  # not ours: left running
        assert Procfs().is_alive(foreign) and daemon.pid() == foreign
    finally:
        _quit(env)


def test_a_foreign_daemon_started_as_the_agent_does_is_adopted(root, leftovers):
    _, env = _foreign(root, CUDA_DEVICE_ORDER="PCI_BUS_ID")
    daemon = _supervisor(root)
    leftovers.append(daemon.pid())
    try:
        assert daemon.ensure_running() is True
        assert daemon.starts == 0 and daemon.last_error is None
    finally:
        _quit(env)


def test_the_daemon_writes_on_from_the_start_of_its_cut_log(root, leftovers):
    """It holds control.log open with O_APPEND: after a cut its next line lands at the start,
    not past a hole of zeros where the old end was."""
    daemon = _supervisor(root, log_max_bytes=2048)
    assert daemon.ensure_running() is True
    leftovers.append(daemon.pid())
    log = root / "l" / "control.log"
    try:
        for _ in range(40):  # a health check each: ~220 bytes of log
            assert daemon.ensure_running() is True
        assert (root / "l" / "control.log.1").stat().st_size > 0
        size = log.stat().st_size
        assert size <= 2048 + 400
        text = log.read_bytes()
        assert b"\0" not in text
        assert size == 0 or text.startswith(b"[")
    finally:
        assert daemon.stop() is True
