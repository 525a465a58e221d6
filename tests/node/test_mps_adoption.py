"""A control daemon the agent did not start is adopted only when it numbers the GPUs as the
agent's own daemons do (CUDA_DEVICE_ORDER=PCI_BUS_ID, no CUDA_VISIBLE_DEVICES): every pinned
limit is set by NVML index. It used to be adopted without a look, and a limit "on GPU 0" then
landed on another GPU, read back by the same wrong number. One that does not, or whose
environment cannot be read, is reported (MpsDaemonAlreadyRunning, naming the variable), never
used, never stopped.

Over the recording runner and a fake process table (the real daemon:
test_mps_real_foreign.py)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from kai_fractions.node.mps.adoption import environment_problem
from kai_fractions.node.mps.control import control_env
from kai_fractions.node.mps.daemon import MpsDaemon
from kai_fractions.node.mps.runner import CommandResult, CommandTimeout, RecordingRunner
from kai_fractions.node.mps.trust import TRUST_RECHECK_SECONDS
from kai_fractions.node.procfs import Procfs
from tests.node.test_mps_daemon import (
    BIN,
    GOOD_ENV,
    LIST,
    NO_DAEMON,
    FakeClock,
    FakeProcesses,
    make,
)

FOREIGN = 4242


@pytest.fixture
def dirs(tmp_path):
    return str(tmp_path / "pipe"), str(tmp_path / "log")


def launched(dirs, processes: FakeProcesses, pid: int = 5151,
             env: dict[str, str] | OSError | None = None) -> tuple[MpsDaemon, FakeClock]:
    """A supervisor on a fake clock that finds no daemon and starts its own (`pid`, with
    `env` as its environment when given) at its first look."""
    runner = RecordingRunner()

    def start(_call):
        processes.pid = pid
        processes.alive.add(pid)
        if env is not None:
            processes.env[pid] = env
        return CommandResult(0, "", "")

    runner.respond([BIN], NO_DAEMON, "", stdin=LIST)
    runner.respond([BIN, "-d"], start)
    clock = FakeClock()
    return make(dirs, runner, clock=clock, processes=processes, protocol_v3=False), clock


def _found_running(dirs, env, **kw):
    """A daemon (pid 4242) answers at the first look, started by someone else with `env`."""
    runner, processes = RecordingRunner(), FakeProcesses(pid=FOREIGN)
    runner.respond([BIN], "", stdin=LIST)
    if env is not None:
        processes.env[FOREIGN] = env
    applied = []
    daemon = make(dirs, runner, kw.pop("clock", None), processes, protocol_v3=False,
                  on_restart=applied.append, **kw)
    return daemon, runner, processes, applied


@pytest.mark.parametrize(("env", "named"), [
    ({}, ["CUDA_DEVICE_ORDER unset (CUDA_DEVICE_ORDER=PCI_BUS_ID expected"]),
    ({"CUDA_DEVICE_ORDER": "FASTEST_FIRST"},
     ["CUDA_DEVICE_ORDER='FASTEST_FIRST' (CUDA_DEVICE_ORDER=PCI_BUS_ID expected"]),
    ({"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "1"},
     ["CUDA_VISIBLE_DEVICES='1' (no CUDA_VISIBLE_DEVICES expected: it hides and renumbers"]),
    ({"CUDA_VISIBLE_DEVICES": ""},
     ["CUDA_DEVICE_ORDER unset", "CUDA_VISIBLE_DEVICES='' (no CUDA_VISIBLE_DEVICES"]),
])
def test_a_daemon_that_numbers_the_gpus_otherwise_is_not_adopted(dirs, caplog, env, named):
    daemon, runner, processes, applied = _found_running(dirs, env)
    with caplog.at_level(logging.WARNING):
        assert daemon.ensure_running() is False
    err = daemon.last_error
    assert err.reason == "MpsDaemonAlreadyRunning"
    for text in named:
        assert text in err.message
    assert f"pid {FOREIGN} on {daemon.pipe_dir} was not started by this agent" in err.message
    assert "would land on another GPU" in err.message
    assert f"CUDA_MPS_PIPE_DIRECTORY={daemon.pipe_dir} nvidia-cuda-mps-control" in err.message
    # nothing applied through it, nothing started, nothing killed: it holds none of our state
    assert applied == [] and daemon.starts == 0 and processes.killed == []
    assert (BIN, "-d") not in runner.argvs
    assert daemon.not_running is True
    assert caplog.text.count("was not started by this agent") == 1
    assert daemon.ensure_running() is False and daemon.last_error == err
    assert caplog.text.count("was not started by this agent") == 1  # once per daemon


def test_an_environment_that_cannot_be_read_is_not_guessed_at(dirs):
    daemon, _, processes, applied = _found_running(
        dirs, PermissionError(13, "Permission denied"))
    assert daemon.ensure_running() is False
    assert daemon.last_error.reason == "MpsDaemonAlreadyRunning"
    assert (f"its environment cannot be checked (/proc/{FOREIGN}/environ: [Errno 13] "
            "Permission denied)") in daemon.last_error.message
    assert applied == [] and processes.killed == []


def test_a_daemon_whose_process_cannot_be_found_is_not_adopted(dirs):
    """It answers, but no process holds its lock in /proc/locks (an agent outside the host's
    pid namespace): its environment cannot be read, so it is not used."""
    daemon, _, _, _ = _found_running(dirs, None)
    daemon.processes.pid = None
    assert daemon.ensure_running() is False
    assert daemon.last_error.reason == "MpsDaemonAlreadyRunning"
    assert "whose process cannot be found" in daemon.last_error.message
    assert "host's pid namespace" in daemon.last_error.message


def test_a_daemon_started_as_the_agent_does_is_adopted(dirs, caplog):
    daemon, _, _, applied = _found_running(
        dirs, {**GOOD_ENV, "PATH": "/usr/bin", "CUDA_MPS_PIPE_DIRECTORY": "x"})
    with caplog.at_level(logging.INFO):
        assert daemon.ensure_running() is True
    assert "numbers the GPUs as the agent does: adopted" in caplog.text
    assert daemon.last_error is None and daemon.not_running is False
    assert applied == [] and daemon.starts == 0  # adopted: it holds what it held
    assert daemon.ensure_running() is True


def test_a_refused_daemon_replaced_by_a_proper_one_is_adopted(dirs):
    daemon, _, processes, _ = _found_running(dirs, {})
    assert daemon.ensure_running() is False
    processes.alive.discard(FOREIGN)  # the operator stopped it and started one right
    processes.pid = 4343
    processes.alive.add(4343)
    assert daemon.ensure_running() is True
    assert daemon.last_error is None and daemon.not_running is False


def test_a_refused_daemon_is_never_killed_nor_stopped(dirs):
    """Other workloads may use it: silent for long, it is still not the agent's to kill; and
    the agent's stop (had it started a daemon before) leaves it running."""
    clock = FakeClock()
    daemon, runner, processes, _ = _found_running(dirs, {}, clock=clock)
    assert daemon.ensure_running() is False
    runner.respond([BIN], CommandTimeout([BIN], 2), stdin=LIST)
    for _ in range(5):
        clock.now += 30
        assert daemon.ensure_running() is False
        assert daemon.last_error.reason == "MpsDaemonAlreadyRunning"
    assert processes.killed == [] and (BIN, "-d") not in runner.argvs
    assert daemon.stop() is False
    assert processes.killed == [] and "quit\n" not in runner.stdins


def test_the_daemon_the_supervisor_started_is_not_vetted(dirs):
    """Its environment is the one the supervisor gave it: its pid is noted at its first
    answer, and only another daemon, found later, is looked at."""
    processes = FakeProcesses()
    daemon, clock = launched(dirs, processes, env=OSError("not to be read"))
    assert daemon.ensure_running() is True
    assert daemon.ensure_running() is True
    # it died; another one, started by someone else without the agent's environment, took
    # its place before the next look: found once the trusted pid is read again
    processes.alive.discard(5151)
    processes.pid = 6161
    processes.alive.add(6161)
    processes.env[6161] = {}
    clock.now += TRUST_RECHECK_SECONDS
    assert daemon.ensure_running() is False
    assert daemon.last_error.reason == "MpsDaemonAlreadyRunning"
    assert "pid 6161" in daemon.last_error.message


def test_the_agents_own_start_environment_passes_its_own_check():
    env = control_env("/run/kai-fractions/mps", "/var/log/kai-fractions/mps")
    assert environment_problem(1, env, env, "/run/kai-fractions/mps") is None


def test_procfs_reads_an_environment_and_a_command_line(tmp_path):
    proc = tmp_path / "proc"
    (proc / "7" / "ns").mkdir(parents=True)
    (proc / "7" / "environ").write_bytes(b"A=1\0B=x=y\0A=2\0NOEQUALS\0\0")
    (proc / "7" / "cmdline").write_bytes(b"/usr/bin/nvidia-cuda-mps-control\0-d\0")
    (proc / "8").mkdir()
    (proc / "8" / "cmdline").write_bytes(b"")
    (proc / "self").mkdir()
    (proc / "7" / "ns" / "mnt").symlink_to("mnt:[4026531841]")
    procfs = Procfs(proc)
    assert procfs.environ(7) == {"A": "1", "B": "x=y"}  # the first one, as getenv reads
    assert procfs.cmdline(7) == ["/usr/bin/nvidia-cuda-mps-control", "-d"]
    assert procfs.cmdline(8) == []  # a kernel thread, a zombie
    assert procfs.environ(9) is None and procfs.cmdline(9) is None
    assert procfs.mount_namespace(7) == "mnt:[4026531841]"
    assert procfs.mount_namespace(9) is None
    assert sorted(procfs.pids()) == [7, 8]
    assert Procfs(tmp_path / "none").pids() == []


def test_procfs_reads_a_real_process():
    """Read once the child runs its own code: Popen returns while the child may still be in
    execve, where the kernel shows neither its environ nor its cmdline (read empty: this
    test used to flake on it)."""
    env = {"KF_PROBE": "a b", "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    argv = [sys.executable, "-c", "import sys, time; print('ready', flush=True); time.sleep(30)"]
    child = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        procfs = Procfs()
        assert child.pid in procfs.pids()
        assert procfs.environ(child.pid) == env
        assert procfs.cmdline(child.pid) == argv
        assert procfs.mount_namespace(child.pid) == procfs.mount_namespace("self")
    finally:
        child.kill()
        child.wait()
        if child.stdout is not None:
            child.stdout.close()


def _stat(pid: int, state: str) -> bytes:
    return f"{pid} (nvidia-cuda-mps) {state} 1 {pid} {pid} 0 -1".encode()


def test_procfs_environ_not_readable_yet_is_none_not_empty(tmp_path):
    """An environ that reads empty while the cmdline does too (a process in execve, or one
    whose memory is gone as it exits) or of a zombie says nothing of the environment it has:
    None (cannot be read yet), never {} (which the adoption check would take for
    CUDA_DEVICE_ORDER unset, and refuse for good). A process started with an empty
    environment (`env -i`) has a command line: {}."""
    proc = tmp_path / "proc"
    for pid, state, cmdline in ((10, "R", b""), (11, "Z", b""), (12, "S", b"env-i-child\0"),
                                (13, "Z", b"x\0")):
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "environ").write_bytes(b"")
        (proc / str(pid) / "cmdline").write_bytes(cmdline)
        (proc / str(pid) / "stat").write_bytes(_stat(pid, state))
    procfs = Procfs(proc)
    assert procfs.environ(10) is None  # in execve
    assert procfs.environ(11) is None  # a zombie
    assert procfs.environ(12) == {}  # started so
    assert procfs.environ(13) is None  # exiting: state says so even with a cmdline left


def test_the_agents_daemon_that_answers_then_exits_is_not_taken_for_a_stranger(dirs):
    """It answered the health check and exited before its lock holder was looked up (SIGKILLed
    in between): no daemon runs now, which is what the supervisor says (MpsDaemonUnreachable,
    not running), not "a daemon whose process cannot be found" that is not adopted."""
    processes = FakeProcesses()
    daemon, clock = launched(dirs, processes)
    assert daemon.ensure_running() is True
    processes.alive.discard(5151)  # gone right after its answer below
    clock.now += TRUST_RECHECK_SECONDS  # when its pid is read again
    assert daemon.ensure_running() is False
    assert daemon.last_error.reason == "MpsDaemonUnreachable"
    assert "pid 5151" in daemon.last_error.message and "answered, then exited" in \
        daemon.last_error.message
    assert daemon.not_running is True


def test_procfs_environ_read_again_once_exec_finished(tmp_path):
    """Its environ read empty while exec was still building the image, and its cmdline, read
    next, shows exec done: the environment is read again rather than taken as empty."""
    proc = tmp_path / "proc"
    (proc / "20").mkdir(parents=True)
    (proc / "20" / "environ").write_bytes(b"CUDA_DEVICE_ORDER=PCI_BUS_ID\0")
    (proc / "20" / "cmdline").write_bytes(b"nvidia-cuda-mps-control\0-d\0")
    (proc / "20" / "stat").write_bytes(_stat(20, "S"))

    class MidExec(Procfs):
        environ_reads = 0

        def _read_bytes(self, *parts: str) -> bytes | None:
            if parts[-1] == "environ":
                self.environ_reads += 1
                if self.environ_reads == 1:
                    return b""  # the first look came before exec set it up
            return super()._read_bytes(*parts)

    procfs = MidExec(proc)
    assert procfs.environ(20) == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert procfs.environ_reads == 2


def test_an_empty_environment_is_looked_at_again(dirs):
    """An empty environment is refused, but not for good: it is what /proc may show of a
    process caught mid-exec, and no daemon the agent starts has one."""
    daemon, _, processes, _ = _found_running(dirs, {})
    assert daemon.ensure_running() is False
    assert "CUDA_DEVICE_ORDER unset" in daemon.last_error.message
    processes.env[FOREIGN] = dict(GOOD_ENV)
    assert daemon.ensure_running() is True
    assert daemon.last_error is None and processes.killed == []


def test_a_trusted_daemon_s_pid_is_read_again_only_every_few_seconds(dirs):
    """Reading /proc/locks costs milliseconds on some hosts, and every pass and 5 s check
    asks: the answering daemon is taken for the trusted one until TRUST_RECHECK_SECONDS have
    passed since its pid was last read."""
    processes = FakeProcesses()
    daemon, clock = launched(dirs, processes)
    assert daemon.ensure_running() is True
    reads = processes.pid_reads
    for _ in range(5):
        clock.now += 1.0
        assert daemon.ensure_running() is True
    assert processes.pid_reads == reads
    clock.now += TRUST_RECHECK_SECONDS
    assert daemon.ensure_running() is True
    assert processes.pid_reads == reads + 1
