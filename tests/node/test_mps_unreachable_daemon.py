"""A control daemon cut off from its pipe directory (the directory, or its lock file, removed
under it: a cleanup script, a tmpfs remounted) still runs, with its MPS servers, but no client
reaches it and no lock names it. The supervisor used to start a second daemon beside it and
count a restart, leaving the first one running, unseen, past the agent's stop. Now it finds
such daemons by their environment and stops them before it starts a new one, and at its stop.

The supervisor over the recording runner and a fake process table; the /proc reading over a
fake /proc tree (the real daemon: test_mps_real_foreign.py)."""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

import pytest

from kai_fractions.node.mps.processes import ProcDaemonProcesses
from kai_fractions.node.mps.runner import CommandResult, CommandTimeout, RecordingRunner
from kai_fractions.node.procfs import Procfs
from tests.node.test_mps_daemon import BIN, LIST, NO_DAEMON, FakeClock, FakeProcesses, make

ORPHAN = 777


@pytest.fixture
def dirs(tmp_path):
    return str(tmp_path / "pipe"), str(tmp_path / "log")


def _cut_off(processes: FakeProcesses) -> None:
    """The daemon that ran (pid 4242) lost its directory: it runs on, holding no lock there."""
    processes.unreachable.append(4242)
    processes.pid = None


def test_a_daemon_cut_off_from_its_pipe_dir_is_stopped_before_the_new_start(dirs, caplog):
    clock, processes, runner = FakeClock(), FakeProcesses(pid=4242), RecordingRunner()
    runner.respond([BIN], "", NO_DAEMON, "", stdin=LIST)
    alive_at_start: list[bool] = []

    def start(_call):
        alive_at_start.append(processes.is_alive(4242))
        processes.pid = 5151
        processes.alive.add(5151)
        return CommandResult(0, "", "")

    runner.respond([BIN, "-d"], start)
    applied = []
    daemon = make(dirs, runner, clock, processes, protocol_v3=False, on_restart=applied.append)
    assert daemon.ensure_running() is True  # found running
    _cut_off(processes)
    with caplog.at_level(logging.WARNING):
        assert daemon.ensure_running() is True
    assert processes.killed == [(4242, signal.SIGTERM)]
    assert alive_at_start == [False]  # gone before the new daemon was started
    assert daemon.restarts == 1 and len(applied) == 1  # a restart: its state put back
    assert "4242" in daemon.restart_cause and "could no longer be reached" in \
        daemon.restart_cause
    assert "pipe directory or lock file was removed" in caplog.text
    assert "restarting the MPS control daemon: the MPS control daemon pid 4242" in caplog.text


def test_one_that_ignores_sigterm_is_killed(dirs):
    clock, processes, runner = FakeClock(), FakeProcesses(ignores_term=True), RecordingRunner()
    processes.unreachable.append(ORPHAN)
    processes.alive.add(ORPHAN)
    runner.respond([BIN], NO_DAEMON, "", stdin=LIST)
    daemon = make(dirs, runner, clock, processes, protocol_v3=False, stop_grace=1,
                  poll_interval=0.25)
    assert daemon.ensure_running() is True
    assert processes.killed == [(ORPHAN, signal.SIGTERM), (ORPHAN, signal.SIGKILL)]
    assert clock.slept[:4] == [0.25] * 4  # the grace, on the daemon's clock
    assert not processes.is_alive(ORPHAN)


def test_nothing_is_stopped_when_no_daemon_is_cut_off(dirs):
    processes, runner = FakeProcesses(), RecordingRunner()
    runner.respond([BIN], NO_DAEMON, "", stdin=LIST)
    daemon = make(dirs, runner, processes=processes, protocol_v3=False)
    assert daemon.ensure_running() is True
    assert processes.killed == []
    assert daemon.restart_cause == f"no MPS control daemon answered on {daemon.pipe_dir}"


def test_stop_also_stops_a_daemon_cut_off_from_its_pipe_dir(dirs):
    """The agent stops (its own daemon) right after the directory went: nothing answers
    `quit`, and the daemon would outlive the agent."""
    processes, runner = FakeProcesses(pid=4242), RecordingRunner()
    runner.respond([BIN], NO_DAEMON, stdin="quit\n")
    daemon = make(dirs, runner, processes=processes, protocol_v3=False)
    _cut_off(processes)
    assert daemon.stop() is True
    assert processes.killed == [(4242, signal.SIGTERM)]


# -- finding them in /proc --------------------------------------------------------------------

PIPE = "/run/kai-fractions/mps/shared/legacy"
OWN_NS, HOST_NS, POD_NS = "mnt:[4026531841]", "mnt:[4026531840]", "mnt:[4026532999]"


def _process(proc: Path, pid: int, argv: list[str], env: dict[str, str] | None,
             ns: str = OWN_NS, state: str = "S", comm: str = "nvidia-cuda-mps") -> Path:
    d = proc / str(pid)
    (d / "ns").mkdir(parents=True)
    (d / "comm").write_text(comm + "\n")
    (d / "stat").write_text(f"{pid} ({comm}) {state} 1 {pid} {pid} 0 -1\n")
    (d / "cmdline").write_bytes(b"".join(a.encode() + b"\0" for a in argv))
    if env is not None:
        (d / "environ").write_bytes(b"".join(f"{k}={v}".encode() + b"\0"
                                             for k, v in env.items()))
    os.symlink(ns, d / "ns" / "mnt")
    return d


def _tree(tmp_path: Path) -> tuple[Path, Path]:
    proc = tmp_path / "proc"
    (proc / "self" / "ns").mkdir(parents=True)
    os.symlink(OWN_NS, proc / "self" / "ns" / "mnt")
    _process(proc, 1, ["/sbin/init"], {}, ns=HOST_NS, comm="systemd")
    pipe = tmp_path / "pipe"
    pipe.mkdir()
    (pipe / "control_lock").write_text("")
    return proc, pipe


def test_the_daemons_on_a_pipe_dir_that_hold_no_lock_there(tmp_path):
    proc, pipe = _tree(tmp_path)
    control = "/usr/bin/nvidia-cuda-mps-control"
    ours = {"CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    _process(proc, 10, [control, "-d"], ours)  # cut off (its directory was made again)
    _process(proc, 11, [control, "-d"], ours)  # the one holding the lock now
    _process(proc, 12, ["nvidia-cuda-mps-server"], ours)  # a server: not a daemon
    _process(proc, 13, [control], ours)  # a control client (the agent's own health check)
    _process(proc, 14, [control, "-d"], {"CUDA_MPS_PIPE_DIRECTORY": "/elsewhere"})
    _process(proc, 15, [control, "-d"], ours, ns=POD_NS)  # a tenant's, in its container
    _process(proc, 16, [control, "-f"], {"CUDA_MPS_PIPE_DIRECTORY": f"{pipe}/"},
             ns=HOST_NS)  # a host tool's, in the foreground, the path with a slash
    _process(proc, 17, [control, "-d"], ours, state="Z")  # exited
    _process(proc, 18, [control, "-d"], {})  # no pipe directory: /tmp/nvidia-mps
    _process(proc, 19, ["/bin/sleep", "-d"], ours, comm="sleep")
    _process(proc, 20, [control, "-d", "-p", "3", "-m"], ours)  # v3, multi-user
    st = os.stat(pipe / "control_lock")
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    (proc / "locks").write_text(f"1: POSIX  ADVISORY  WRITE 11 {dev} 0 EOF\n")
    found = ProcDaemonProcesses(Procfs(proc))
    assert sorted(found.unreachable_daemons(str(pipe))) == [10, 16, 20]
    assert found.environ(10) == ours
    assert found.environ(99) is None


def test_a_daemon_whose_environment_cannot_be_read_is_left_alone(tmp_path, caplog):
    proc, pipe = _tree(tmp_path)
    d = _process(proc, 10, ["/usr/bin/nvidia-cuda-mps-control", "-d"], None)
    (d / "environ").mkdir()  # reading it fails (IsADirectoryError), as EACCES would
    (proc / "locks").write_text("")
    with caplog.at_level(logging.WARNING):
        assert ProcDaemonProcesses(Procfs(proc)).unreachable_daemons(str(pipe)) == []
    assert "cannot tell whether MPS control daemon pid 10 runs on" in caplog.text


def test_a_wedged_daemon_and_one_cut_off_are_both_dealt_with(dirs):
    clock, processes, runner = FakeClock(), FakeProcesses(pid=4242), RecordingRunner()
    processes.unreachable.append(ORPHAN)
    processes.alive.add(ORPHAN)
    runner.respond([BIN], CommandTimeout([BIN], 2), stdin=LIST)

    def start(_call):
        runner.respond([BIN], "", stdin=LIST)
        return CommandResult(0, "", "")

    runner.respond([BIN, "-d"], start)
    daemon = make(dirs, runner, clock, processes, protocol_v3=False, wedged_checks=1,
                  wedged_after=0)
    assert daemon.ensure_running() is True
    assert processes.killed == [(4242, signal.SIGKILL), (ORPHAN, signal.SIGTERM)]
    assert "pid 4242" in daemon.restart_cause and "did not answer: killed" in \
        daemon.restart_cause
    assert f"pid {ORPHAN}" in daemon.restart_cause


def test_a_killed_daemon_is_alive_until_its_last_thread_has_exited(tmp_path):
    """Its main thread reads as a zombie while its other threads exit; its lock goes with the
    last one, so a start right after the kill must wait for that."""
    proc, _ = _tree(tmp_path)
    control = "/usr/bin/nvidia-cuda-mps-control"
    leader = _process(proc, 30, [control, "-d"], {}, state="Z")
    (leader / "task" / "30").mkdir(parents=True)
    (leader / "task" / "31").mkdir()
    processes = ProcDaemonProcesses(Procfs(proc))
    assert processes.is_alive(30)
    (leader / "task" / "31").rmdir()
    assert not processes.is_alive(30)
    assert not processes.is_alive(99)  # no such process
