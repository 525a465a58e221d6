"""MpsDaemon supervision through the recording runner, a fake process table and a fake clock:
start argv, health, bounded exponential backoff (never sleeping), wedged daemons, re-applying
state after a restart, and stop."""

from __future__ import annotations

import os
import signal
import stat

import pytest

from kai_fractions.node.mps.daemon import MpsDaemon, ProcDaemonProcesses
from kai_fractions.node.mps.errors import MpsError
from kai_fractions.node.mps.runner import CommandResult, CommandTimeout, RecordingRunner
from kai_fractions.node.procfs import Procfs

BIN = "/usr/bin/nvidia-cuda-mps-control"
OLD_HELP = "CUDA MPS Control for Linux/Unix.\n"
V3_HELP = "  -p, --protocol <2|3>   Protocol 2 (legacy, default) or 3.\n"
NO_DAEMON = CommandResult(1, "", "Cannot find MPS control daemon process\n")
LIST = "get_server_list\n"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0
        self.slept: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


GOOD_ENV = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
"""What the agent's own starts give a daemon, as far as adoption looks."""


class FakeProcesses:
    """The daemon's process table: `pid` holds the lock while alive; `env` is each pid's
    environment (GOOD_ENV when not given; an OSError to raise: unreadable; None: cannot be
    read yet, the process starting or exiting); `unreachable`
    are daemons started on the pipe directory that no longer hold its lock. SIGTERM ends a
    process unless `ignores_term`, SIGKILL always."""

    def __init__(self, pid: int | None = None, ignores_term: bool = False):
        self.pid = pid
        self.alive: set[int] = {pid} if pid else set()
        self.ignores_term = ignores_term
        self.killed: list[tuple[int, int]] = []
        self.env: dict[int, dict[str, str] | OSError | None] = {}
        self.unreachable: list[int] = []
        self.pid_reads = 0
        """Lookups of the lock holder (a read of /proc/locks for the real one)."""

    def daemon_pid(self, pipe_dir: str) -> int | None:
        self.pid_reads += 1
        return self.pid if self.pid in self.alive else None

    def environ(self, pid: int) -> dict[str, str] | None:
        if pid not in self.alive:
            return None
        env = self.env.get(pid, GOOD_ENV)
        if isinstance(env, OSError):
            raise env
        return None if env is None else dict(env)

    def unreachable_daemons(self, pipe_dir: str) -> list[int]:
        return [pid for pid in self.unreachable if pid in self.alive and pid != self.pid]

    def is_alive(self, pid: int) -> bool:
        return pid in self.alive

    def kill(self, pid: int, sig: int) -> None:
        self.killed.append((pid, sig))
        if sig == signal.SIGKILL or (sig == signal.SIGTERM and not self.ignores_term):
            self.alive.discard(pid)


@pytest.fixture
def dirs(tmp_path):
    return str(tmp_path / "pipe"), str(tmp_path / "log")


def make(dirs, runner, clock=None, processes=None, **kw) -> MpsDaemon:
    pipe, logs = dirs
    return MpsDaemon(BIN, pipe, logs, runner, clock or FakeClock(),
                     processes=processes or FakeProcesses(), **kw)


def test_first_start_argv_env_dirs_and_state_applied(dirs):
    runner = RecordingRunner()
    runner.respond([BIN, "--help"], OLD_HELP)
    runner.respond([BIN], NO_DAEMON, "", stdin=LIST)
    applied = []
    daemon = make(dirs, runner, on_restart=applied.append)
    assert daemon.ensure_running() is True
    root, logs = dirs
    # No namespaces (this binary has no v3): the daemon runs inside the server directory, the
    # one sm-sharing containers mount, and reaches them through their namespace links.
    pipe = os.path.join(root, "shared", "legacy")
    assert daemon.pipe_dir == pipe
    env = {"CUDA_MPS_PIPE_DIRECTORY": pipe, "CUDA_MPS_LOG_DIRECTORY": logs,
           "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert [(c.argv, c.stdin) for c in runner.calls] == [
        ((BIN, "--help"), None), ((BIN,), LIST), ((BIN, "-d"), None), ((BIN,), LIST)]
    assert runner.calls[1].env == runner.calls[2].env == env
    assert runner.calls[1].timeout == 2.0  # health checks never wait long
    for d in (pipe, logs):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o755
    assert applied == [daemon.control]  # a fresh daemon knows nothing: state goes back
    assert (daemon.restarts, daemon.failures) == (0, 0)
    # healthy now: nothing else runs
    assert daemon.ensure_running() is True
    assert runner.argvs[-1] == (BIN,) and len(runner.calls) == 5


def test_v3_and_multi_user_start_argv(dirs):
    runner = RecordingRunner()
    runner.respond([BIN, "--help"], V3_HELP)
    runner.respond([BIN, "-p", "3", "namespace", "list", "--server=shared"], NO_DAEMON, "")
    daemon = make(dirs, runner, multi_user=True)
    assert daemon.start_argv() == [BIN, "-d", "-p", "3", "-m"]
    assert daemon.ensure_running() is True
    # a v3 daemon runs in the root: its control socket is outside the server directory that
    # sm-sharing containers mount
    assert daemon.pipe_dir == dirs[0]
    assert runner.calls[-1].env["CUDA_MPS_PIPE_DIRECTORY"] == dirs[0]
    assert (BIN, "-d", "-p", "3", "-m") in runner.argvs
    # a v3 daemon is health-checked in v3
    assert runner.argvs[-1] == (BIN, "-p", "3", "namespace", "list", "--server=shared")


def test_declared_protocol_skips_the_probe(dirs):
    runner = RecordingRunner()
    daemon = make(dirs, runner, protocol_v3=False)
    assert daemon.start_argv() == [BIN, "-d"]
    assert runner.calls == []


def test_an_error_answer_still_proves_the_daemon_is_alive(dirs):
    runner = RecordingRunner()
    runner.respond([BIN, "-p", "3", "namespace", "list", "--server=shared"],
                   "Server shared not found\n")
    assert make(dirs, runner, protocol_v3=True).healthy() is True


def test_a_daemon_busy_with_other_clients_is_alive_and_never_killed(dirs):
    """The legacy daemon serves one client at a time and turns others away with "Cannot send
    command": taken for a dead daemon, the supervisor would SIGKILL it, and every MPS workload
    on the node with it."""
    runner = RecordingRunner()
    busy = CommandResult(1, "Cannot send command to MPS control daemon process\n", "")
    runner.respond([BIN], busy, stdin=LIST)
    processes = FakeProcesses(pid=4242)
    clock = FakeClock()
    daemon = make(dirs, runner, clock=clock, processes=processes, protocol_v3=False)
    assert daemon.ensure_running() is True
    assert processes.killed == [] and daemon.restarts == 0
    assert [c.argv for c in runner.calls] == [(BIN,)] * 7  # asked again, never started
    assert sum(clock.slept) == pytest.approx(1.26)  # on the daemon's clock: no real wait
    # Free again: answered at once.
    runner.respond([BIN], busy, "", stdin=LIST)
    assert daemon.healthy() is True and len(runner.calls) == 9


def test_restart_after_death_counts_and_reapplies(dirs):
    runner = RecordingRunner()
    runner.respond([BIN], "", NO_DAEMON, "", stdin=LIST)
    applied = []
    processes = FakeProcesses(pid=4242)
    daemon = make(dirs, runner, processes=processes, protocol_v3=False,
                  on_restart=applied.append)
    assert daemon.ensure_running() is True  # found running: nothing to re-apply
    assert applied == [] and daemon.restarts == 0
    processes.alive.discard(4242)
    assert daemon.ensure_running() is True  # died in between: restarted
    assert daemon.restarts == 1 and len(applied) == 1
    assert runner.argvs.count((BIN, "-d")) == 1
    assert daemon.last_error is None
    assert daemon.last_health_error.reason == "MpsDaemonUnreachable"


def test_a_restart_that_answers_late_still_counts_and_reapplies(dirs):
    """`-d` returned 0 but the new daemon answered only after the start timeout: it holds none
    of the state (namespaces, percentages, pinned defaults), so its first answer, at a later
    check, must put everything back before it counts as running."""
    clock, processes, runner = FakeClock(), FakeProcesses(pid=4242), RecordingRunner()
    daemon_side = {"phase": "up", "started_at": 0.0}

    def health(_call):
        if daemon_side["phase"] == "dead":
            return NO_DAEMON
        if daemon_side["phase"] == "slow" and clock.now < daemon_side["started_at"] + 10.5:
            raise CommandTimeout([BIN], 2)
        return CommandResult(0, "", "")

    def start(_call):
        daemon_side.update(phase="slow", started_at=clock.now)
        processes.pid = 5151
        processes.alive.add(5151)
        return CommandResult(0, "", "")

    runner.respond([BIN], health, stdin=LIST)
    runner.respond([BIN, "-d"], start)
    applied = []
    daemon = make(dirs, runner, clock, processes, protocol_v3=False, on_restart=applied.append)
    assert daemon.ensure_running() is True  # found running
    daemon_side["phase"] = "dead"
    processes.alive.discard(4242)
    assert daemon.ensure_running() is False  # restarted, but no answer in time
    assert daemon.last_error.reason == "MpsDaemonUnreachable"
    assert daemon.restarts == 0 and daemon.starts == 1 and applied == []
    clock.now += 5
    assert daemon.ensure_running() is True  # it answers: the state is put back first
    assert len(applied) == 1 and daemon.last_error is None
    assert daemon.restarts == 1  # a restart, counted once it answered
    assert daemon.ensure_running() is True and len(applied) == 1  # once
    assert runner.argvs.count((BIN, "-d")) == 1


def test_a_daemon_that_never_answers_after_its_start_is_no_restart(dirs):
    """`-d` returns 0 but the daemon dies before it ever answers, start after start: failed
    starts, backed off, never a restart each (the restart alert, a pass per try)."""
    clock, processes, runner = FakeClock(), FakeProcesses(pid=4242), RecordingRunner()
    up = [True]
    runner.respond([BIN], lambda _call: CommandResult(0, "", "") if up[0] else NO_DAEMON,
                   stdin=LIST)
    runner.respond([BIN, "-d"], CommandResult(0, "", ""))
    daemon = make(dirs, runner, clock, processes, protocol_v3=False)
    assert daemon.ensure_running() is True  # one ran: the next one to answer is a restart
    up[0] = False
    processes.alive.discard(4242)
    for _ in range(6):
        assert daemon.ensure_running() is False
        clock.now += 61
    assert daemon.starts == runner.argvs.count((BIN, "-d")) > 1 and daemon.restarts == 0


def test_bounded_exponential_backoff_without_sleeping(dirs):
    runner = RecordingRunner()
    runner.respond([BIN], NO_DAEMON, stdin=LIST)
    runner.respond([BIN, "-d"], CommandResult(1, "", "boom\n"))
    clock = FakeClock()
    daemon = make(dirs, runner, clock, protocol_v3=False, backoff_initial=1, backoff_max=4)
    attempts = []
    for _ in range(40):  # 10 simulated seconds in 0.25 s steps
        before = runner.argvs.count((BIN, "-d"))
        assert daemon.ensure_running() is False
        if runner.argvs.count((BIN, "-d")) > before:
            attempts.append(clock.now - 1000.0)
        clock.now += 0.25
    # tries at 0, then after 1, 2, 4, 4 (capped) seconds
    assert attempts == [0.0, 1.0, 3.0, 7.0]
    assert clock.slept == []
    assert daemon.failures == 4
    assert daemon.last_error == MpsError(
        "CommandFailed", f"{BIN} '-d' exited 1: boom")
    # the daemon comes back: the next attempt succeeds, and once it has run a while the
    # backoff starts over
    runner.respond([BIN, "-d"], "")
    runner.respond([BIN], NO_DAEMON, "", stdin=LIST)
    clock.now += 4
    assert daemon.ensure_running() is True
    assert daemon.last_error is None
    assert daemon.failures == 4  # not yet: it may die again at once
    clock.now += 60
    assert daemon.ensure_running() is True
    assert daemon.failures == 0


class CrashesAfterOneAnswer:
    """A daemon that starts, answers one command, then dies (on the state put back, say)."""

    def __init__(self) -> None:
        self.answers, self.starts = 0, 0

    def run(self, argv, stdin=None, env=None, timeout=10.0):
        if argv[1:] == ["--help"]:
            return CommandResult(0, "usage", "")
        if argv[1:] == ["-d"]:
            self.starts += 1
            self.answers = 1
            return CommandResult(0, "", "")
        if self.answers:
            self.answers -= 1
            return CommandResult(0, "", "")
        return CommandResult(1, "", "Cannot find MPS control daemon process\n")


def test_a_daemon_that_dies_right_after_each_start_is_restarted_with_a_backoff(dirs):
    """It answered once, so each start looked like a success and reset the backoff: the agent
    restarted it on every call (each restart runs a pass, whose check restarts it again)."""
    runner, clock = CrashesAfterOneAnswer(), FakeClock()
    daemon = make(dirs, runner, clock, protocol_v3=False, backoff_initial=1, backoff_max=8)
    starts_at = []
    for _ in range(60):  # a call a second for a minute
        before = runner.starts
        daemon.ensure_running()
        if runner.starts > before:
            starts_at.append(clock.now - 1000.0)
        clock.now += 1
    assert starts_at == [0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 24.0, 32.0, 40.0, 48.0, 56.0]  # to 8 s
    assert clock.slept == []


def test_started_but_never_answering_times_out_on_the_fake_clock(dirs):
    runner = RecordingRunner()
    runner.respond([BIN], NO_DAEMON, stdin=LIST)
    clock = FakeClock()
    daemon = make(dirs, runner, clock, protocol_v3=False, start_timeout=1, poll_interval=0.25)
    assert daemon.ensure_running() is False
    assert clock.slept == [0.25] * 4
    assert daemon.last_error.reason == "MpsDaemonUnreachable"
    assert "does not answer" in daemon.last_error.message
    assert "control.log" in daemon.last_error.message


def test_a_wedged_daemon_is_killed_before_the_new_start(dirs):
    """Killed only once it stayed silent for 3 checks spanning 30 s (the defaults); until then
    it is reported as not answering, and nothing is started."""
    runner = RecordingRunner()
    hung = CommandTimeout([BIN], 2)
    runner.respond([BIN], hung, hung, hung, "", stdin=LIST)
    processes = FakeProcesses(pid=4242)
    clock = FakeClock()
    daemon = make(dirs, runner, clock, processes=processes, protocol_v3=False)
    runner.respond([BIN, "-d"], lambda call: (
        CommandResult(0, "", "") if not processes.is_alive(4242)
        else CommandResult(1, "An instance of this daemon is already running\n", "")))
    for _ in range(2):
        assert daemon.ensure_running() is False
        assert daemon.last_error.reason == "MpsDaemonNotAnswering"
        assert "pid 4242" in daemon.last_error.message
        clock.now += 15
    assert processes.killed == [] and (BIN, "-d") not in runner.argvs
    assert daemon.ensure_running() is True  # third silent check, 30 s after the first
    assert processes.killed == [(4242, signal.SIGKILL)]
    assert runner.argvs.count((BIN, "-d")) == 1 and daemon.starts == 1


def test_one_slow_health_answer_never_kills_the_daemon(dirs):
    """A daemon that misses the 2 s health timeout once (a loaded node) is alive: killing it
    would kill every tenant's MPS clients. It is reported as not answering, and its next
    answer clears that."""
    runner = RecordingRunner()
    runner.respond([BIN], CommandTimeout([BIN], 2), "", stdin=LIST)
    processes = FakeProcesses(pid=4242)
    clock = FakeClock()
    daemon = make(dirs, runner, clock, processes=processes, protocol_v3=False)
    assert daemon.ensure_running() is False
    assert daemon.last_error.reason == "MpsDaemonNotAnswering"
    assert "did not answer" in daemon.last_error.message  # what the health check saw
    clock.now += 5
    assert daemon.ensure_running() is True
    assert daemon.last_error is None
    assert processes.killed == [] and (BIN, "-d") not in runner.argvs
    assert (daemon.restarts, daemon.starts) == (0, 0)


def test_an_answer_restarts_the_silence_count(dirs):
    """Silent checks must be consecutive: one answer in between starts the window over."""
    runner = RecordingRunner()
    hung = CommandTimeout([BIN], 2)
    runner.respond([BIN], hung, hung, "", hung, hung, "", stdin=LIST)
    processes = FakeProcesses(pid=4242)
    clock = FakeClock()
    daemon = make(dirs, runner, clock, processes=processes, protocol_v3=False)
    results = []
    for _ in range(6):
        results.append(daemon.ensure_running())
        clock.now += 20
    assert results == [False, False, True, False, False, True]
    assert processes.killed == []


def test_many_quick_silent_checks_are_not_enough_to_kill(dirs):
    """Passes can come in bursts: the count alone does not make a daemon wedged, the window
    must be spanned too (and both are settings)."""
    runner = RecordingRunner()
    runner.respond([BIN], CommandTimeout([BIN], 2), stdin=LIST)
    processes = FakeProcesses(pid=4242)
    clock = FakeClock()
    daemon = make(dirs, runner, clock, processes=processes, protocol_v3=False,
                  wedged_after=10, wedged_checks=2)
    for _ in range(10):
        assert daemon.ensure_running() is False
        clock.now += 1
    assert processes.killed == []
    clock.now += 1  # 11 s after the first silent check
    daemon.ensure_running()
    assert processes.killed == [(4242, signal.SIGKILL)]


def test_a_dead_daemon_is_restarted_at_once(dirs):
    """No process holds the lock: nothing to wait for."""
    runner = RecordingRunner()
    runner.respond([BIN], NO_DAEMON, "", stdin=LIST)
    daemon = make(dirs, runner, processes=FakeProcesses(), protocol_v3=False)
    assert daemon.ensure_running() is True
    assert runner.argvs.count((BIN, "-d")) == 1 and daemon.starts == 1


def test_second_instance_message_is_its_own_reason(dirs):
    runner = RecordingRunner()
    runner.respond([BIN], NO_DAEMON, stdin=LIST)
    runner.respond([BIN, "-d"], CommandResult(1, "An instance of this daemon is already running\n",
                                              ""))
    daemon = make(dirs, runner, protocol_v3=False)
    assert daemon.ensure_running() is False
    assert daemon.last_error.reason == "MpsDaemonAlreadyRunning"


def test_failed_reapply_is_retried_while_the_daemon_runs(dirs):
    runner = RecordingRunner()
    runner.respond([BIN], NO_DAEMON, "", stdin=LIST)
    outcomes = [MpsError("NotApplied", "no"), None]

    def reapply(control):
        outcome = outcomes.pop(0)
        if outcome:
            raise outcome

    daemon = make(dirs, runner, protocol_v3=False, on_restart=reapply)
    assert daemon.ensure_running() is False
    assert daemon.last_error == MpsError("NotApplied", "no")
    assert daemon.ensure_running() is True
    assert outcomes == []
    assert runner.argvs.count((BIN, "-d")) == 1


def test_missing_binary_is_a_failure_with_backoff(dirs):
    from kai_fractions.node.mps.runner import CommandNotFound
    runner = RecordingRunner(CommandNotFound([BIN], f"cannot execute {BIN}: No such file"))
    daemon = make(dirs, runner)
    assert daemon.healthy() is False
    assert daemon.ensure_running() is False
    assert daemon.last_error.reason == "MpsBinaryNotFound"
    assert daemon.failures == 1


def test_stop_quits_and_waits(dirs):
    runner = RecordingRunner()
    processes = FakeProcesses(pid=77)
    runner.respond([BIN], lambda call: processes.alive.discard(77) or CommandResult(0, "", ""),
                   stdin="quit\n")
    daemon = make(dirs, runner, processes=processes, protocol_v3=False)
    assert daemon.stop() is True
    assert runner.stdins == ["quit\n"]
    assert processes.killed == []


def test_stop_kills_a_daemon_that_ignores_quit(dirs):
    runner = RecordingRunner()
    runner.respond([BIN], CommandTimeout([BIN], 1), stdin="quit\n")
    processes = FakeProcesses(pid=78)
    clock = FakeClock()
    daemon = make(dirs, runner, clock, processes, protocol_v3=False, poll_interval=0.5)
    assert daemon.stop(grace=1) is True
    assert processes.killed == [(78, signal.SIGKILL)]
    assert runner.calls[0].timeout == 1
    assert sum(clock.slept) == pytest.approx(1.0)


def test_stop_without_a_daemon_is_fine(dirs):
    assert make(dirs, RecordingRunner(NO_DAEMON), protocol_v3=False).stop() is True


def test_proc_daemon_processes_reads_the_lock_holder(tmp_path):
    pipe = tmp_path / "pipe"
    pipe.mkdir()
    lock = pipe / "control_lock"
    lock.write_text("")
    st = os.stat(lock)
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    proc = tmp_path / "proc"
    for pid, comm, state in ((10, "nvidia-cuda-mps", "S"), (11, "bash", "S"),
                             (12, "nvidia-cuda-mps", "Z")):
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "comm").write_text(comm + "\n")
        (proc / str(pid) / "stat").write_text(f"{pid} ({comm}) {state} 1 {pid} {pid} 0 -1\n")
    (proc / "locks").write_text(
        f"1: POSIX  ADVISORY  WRITE 11 {dev} 0 EOF\n"
        f"2: POSIX  ADVISORY  WRITE 12 {dev} 0 EOF\n"
        f"3: POSIX  ADVISORY  WRITE 10 {dev} 0 EOF\n")
    found = ProcDaemonProcesses(Procfs(proc))
    assert found.daemon_pid(str(pipe)) == 10  # not bash, not the zombie
    assert found.is_alive(10) and not found.is_alive(12) and not found.is_alive(13)
    (proc / "locks").write_text("")
    assert found.daemon_pid(str(pipe)) is None


# -- not running, or not answering (`MpsDaemon.not_running`) ----------------------------------
# A daemon's namespaces, percentages and default pinned limits die with it: while none runs
# that holds them, the agent sets aside the readiness markers that vouch for them. A daemon
# process that still runs but does not answer may hold them all: its markers stay.


def test_not_running_while_a_start_fails_and_the_supervisor_backs_off(dirs):
    runner = RecordingRunner()
    runner.respond([BIN], NO_DAEMON, stdin=LIST)
    runner.respond([BIN, "-d"], CommandResult(1, "", "boom\n"))
    clock = FakeClock()
    daemon = make(dirs, runner, clock, protocol_v3=False)
    assert daemon.not_running is False  # nothing known before the first look
    assert daemon.ensure_running() is False and daemon.not_running is True
    clock.now += 0.5  # backing off: no start, still none
    assert daemon.ensure_running() is False and daemon.not_running is True
    assert runner.argvs.count((BIN, "-d")) == 1


def test_not_running_without_a_binary(dirs):
    from kai_fractions.node.mps.runner import CommandNotFound
    daemon = make(dirs, RecordingRunner(CommandNotFound([BIN], f"cannot execute {BIN}")))
    assert daemon.ensure_running() is False
    assert (daemon.last_error.reason, daemon.not_running) == ("MpsBinaryNotFound", True)


def test_a_live_daemon_that_does_not_answer_is_not_taken_for_not_running(dirs):
    runner = RecordingRunner()
    runner.respond([BIN], CommandTimeout([BIN], 2), CommandTimeout([BIN], 2), "", stdin=LIST)
    clock = FakeClock()
    daemon = make(dirs, runner, clock, processes=FakeProcesses(pid=4242), protocol_v3=False)
    for _ in range(2):
        assert daemon.ensure_running() is False
        assert (daemon.last_error.reason, daemon.not_running) == ("MpsDaemonNotAnswering",
                                                                  False)
        clock.now += 5
    assert daemon.ensure_running() is True and daemon.not_running is False


def test_a_daemon_that_died_soon_after_its_start_is_not_running_while_backing_off(dirs):
    """It answered once, so no start failed: the backoff before the next start still says
    why none runs (it used to report no error of its own), and that none does."""
    runner, clock = CrashesAfterOneAnswer(), FakeClock()
    daemon = make(dirs, runner, clock, protocol_v3=False, backoff_initial=4, backoff_max=8)
    assert daemon.ensure_running() is True  # started (a first start: no backoff yet)
    clock.now += 1
    assert daemon.ensure_running() is True  # died at once, started again: a quick death
    clock.now += 1
    assert daemon.ensure_running() is False  # dead again, backing off
    assert runner.starts == 2
    assert daemon.not_running is True
    assert daemon.last_error is not None
    assert daemon.last_error.reason == "MpsDaemonUnreachable"
    assert "does not answer any more" in daemon.last_error.message


def test_a_daemon_started_but_not_answering_yet_holds_nothing(dirs):
    """`-d` returned 0 and its process runs, but it has not answered: a new daemon knows none
    of the namespaces or limits set on the one before, so it is not running as far as they
    go; once it answers (its state put back) it is."""
    clock, processes, runner = FakeClock(), FakeProcesses(pid=4242), RecordingRunner()
    up = ["old"]

    def health(_call):
        if up[0] == "old":
            return CommandResult(0, "", "")
        if up[0] == "new" and clock.now >= 1030:
            return CommandResult(0, "", "")
        if up[0] == "new":
            raise CommandTimeout([BIN], 2)
        return NO_DAEMON

    def start(_call):
        up[0] = "new"
        processes.pid = 5151
        processes.alive.add(5151)
        return CommandResult(0, "", "")

    runner.respond([BIN], health, stdin=LIST)
    runner.respond([BIN, "-d"], start)
    daemon = make(dirs, runner, clock, processes, protocol_v3=False, on_restart=lambda c: None)
    assert daemon.ensure_running() is True and daemon.not_running is False
    up[0] = "dead"
    processes.alive.discard(4242)
    assert daemon.ensure_running() is False  # started again, no answer within 10 s
    assert daemon.pid() == 5151 and daemon.not_running is True
    clock.now += 5
    assert daemon.ensure_running() is False  # its process runs, silent: still holds nothing
    assert daemon.last_error.reason == "MpsDaemonNotAnswering"
    assert daemon.not_running is True
    clock.now += 20
    assert daemon.ensure_running() is True and daemon.not_running is False
