"""A control daemon that holds the pipe directory but never answers is killed as wedged only
when it is the agent's: the one this supervisor launched or adopted, or one whose environment
numbers the GPUs as the agent's own starts do (one this agent launched before it restarted).
One started otherwise, or whose environment cannot be read, is another's: reported
(MpsDaemonAlreadyRunning) and never killed, silent or not. It used to be SIGKILLed after three
silent checks, its environment never read (the check ran only after a healthy answer).

An environment that cannot be read yet (the process starting or exiting) refuses the daemon
for this look only: the next one reads it again.

Over the recording runner, a fake process table and a fake clock."""

from __future__ import annotations

import signal

import pytest

from kai_fractions.node.mps.control import control_env
from kai_fractions.node.mps.runner import CommandResult, CommandTimeout, RecordingRunner
from tests.node.test_mps_daemon import BIN, GOOD_ENV, LIST, FakeClock, FakeProcesses, make

FOREIGN = 4242


@pytest.fixture
def dirs(tmp_path):
    return str(tmp_path / "pipe"), str(tmp_path / "log")


def _silent(dirs, env):
    """A daemon (pid 4242) that never answers, its environment `env`, found by a fresh
    supervisor."""
    runner, clock, processes = RecordingRunner(), FakeClock(), FakeProcesses(pid=FOREIGN)
    runner.respond([BIN], CommandTimeout([BIN], 2.0), stdin=LIST)
    processes.env[FOREIGN] = env
    daemon = make(dirs, runner, clock, processes, protocol_v3=False)
    return daemon, runner, clock, processes


@pytest.mark.parametrize("env", [{}, {"CUDA_DEVICE_ORDER": "FASTEST_FIRST"},
                                 PermissionError(13, "Permission denied")])
def test_a_silent_daemon_that_is_not_the_agents_is_never_killed(dirs, env):
    daemon, runner, clock, processes = _silent(dirs, env)
    for _ in range(6):  # 75 s, 6 checks: far past the 3 checks over 30 s of a wedged one
        assert daemon.ensure_running() is False
        assert daemon.last_error.reason == "MpsDaemonAlreadyRunning"
        assert f"pid {FOREIGN}" in daemon.last_error.message
        assert daemon.not_running is True  # it holds nothing the agent set
        clock.now += 15
    assert processes.killed == [] and (BIN, "-d") not in runner.argvs
    assert daemon.stop() is False  # not the agent's to stop either
    assert processes.killed == [] and "quit\n" not in runner.stdins


def test_a_silent_daemon_with_the_agents_environment_is_taken_as_wedged(dirs):
    """One the agent launched before it restarted (this supervisor never saw it start): its
    environment is the agent's, so it is the agent's to kill once it stayed silent."""
    env = {**control_env(f"{dirs[0]}/shared/legacy", dirs[1]), "PATH": "/usr/bin"}
    daemon, runner, clock, processes = _silent(dirs, env)
    runner.respond([BIN, "-d"], lambda _call: CommandResult(0, "", ""))
    for _ in range(2):
        assert daemon.ensure_running() is False
        assert daemon.last_error.reason == "MpsDaemonNotAnswering"
        clock.now += 15
    daemon.ensure_running()  # the third silent check, 30 s after the first
    assert processes.killed == [(FOREIGN, signal.SIGKILL)]
    assert (BIN, "-d") in runner.argvs


class _Appearing(FakeProcesses):
    """No daemon at the first look; pid 4242, started by someone else, from the next on."""

    def __init__(self) -> None:
        super().__init__(pid=FOREIGN)
        self.looks = 0

    def daemon_pid(self, pipe_dir: str) -> int | None:
        self.looks += 1
        return None if self.looks == 1 else super().daemon_pid(pipe_dir)


def test_a_foreign_daemon_that_appears_during_a_start_is_not_killed(dirs):
    """No lock holder when the supervisor looked, one by the time it starts its own: a
    daemon someone else just started, not a wedged one of the agent's."""
    runner, clock, processes = RecordingRunner(), FakeClock(), _Appearing()
    runner.respond([BIN], CommandTimeout([BIN], 2.0), stdin=LIST)
    processes.env[FOREIGN] = {}
    daemon = make(dirs, runner, clock, processes, protocol_v3=False)
    assert daemon.ensure_running() is False
    assert daemon.last_error.reason == "MpsDaemonAlreadyRunning"
    assert processes.killed == [] and (BIN, "-d") not in runner.argvs
    assert daemon.not_running is True


def test_an_environment_not_readable_yet_is_checked_again(dirs):
    """It answers, but /proc shows no environment yet (a daemon still in execve, or one
    exiting): refused for this look, not for good; the next look reads it and adopts it."""
    runner, processes = RecordingRunner(), FakeProcesses(pid=FOREIGN)
    runner.respond([BIN], "", stdin=LIST)
    processes.env[FOREIGN] = None
    daemon = make(dirs, runner, FakeClock(), processes, protocol_v3=False)
    assert daemon.ensure_running() is False
    assert daemon.last_error.reason == "MpsDaemonAlreadyRunning"
    assert "cannot be read yet" in daemon.last_error.message
    assert daemon.not_running is True
    processes.env[FOREIGN] = dict(GOOD_ENV)
    assert daemon.ensure_running() is True
    assert daemon.last_error is None and daemon.not_running is False
    assert processes.killed == [] and daemon.starts == 0


def test_a_silent_daemon_not_readable_yet_is_not_killed_then_judged_again(dirs):
    """Silent from the first look, its environment unreadable yet: not killed meanwhile; once
    it reads as the agent's, its silence counts from then."""
    daemon, runner, clock, processes = _silent(dirs, None)
    runner.respond([BIN, "-d"], lambda _call: CommandResult(0, "", ""))
    for _ in range(4):
        assert daemon.ensure_running() is False
        assert daemon.last_error.reason == "MpsDaemonAlreadyRunning"
        clock.now += 15
    assert processes.killed == []
    processes.env[FOREIGN] = dict(GOOD_ENV)
    for _ in range(2):
        assert daemon.ensure_running() is False
        assert daemon.last_error.reason == "MpsDaemonNotAnswering"
        clock.now += 15
    assert processes.killed == []
    daemon.ensure_running()
    assert processes.killed == [(FOREIGN, signal.SIGKILL)]
