"""MpsHealth over a real MpsDaemon (recording runner, fake process table and clock): a daemon
that is slow to answer is reported as not answering, never killed at once, and one found
running is adopted, even when it was slow at the agent's first look. And the Drain over a real
legacy MpsControl."""

from __future__ import annotations

from types import SimpleNamespace

from kai_fractions.node.agent.metrics import AgentMetrics
from kai_fractions.node.agent.mps_supervisor import MpsHealth, drain
from kai_fractions.node.mps.control import MpsControl
from kai_fractions.node.mps.daemon import MpsDaemon
from kai_fractions.node.mps.runner import CommandResult, CommandTimeout, RecordingRunner
from kai_fractions.node.procfs import PodContainer
from tests.node.test_mps_daemon import BIN, LIST, FakeClock, FakeProcesses


def test_a_daemon_slow_at_the_first_look_is_adopted_not_owned(tmp_path):
    """The first look used to take one missed health answer for "no daemon": the agent then
    believed it had started the daemon and stopped it at shutdown, with every tenant's
    clients."""
    runner = RecordingRunner()
    runner.respond([BIN], CommandTimeout([BIN], 2), "", stdin=LIST)
    processes = FakeProcesses(pid=4242)
    daemon = MpsDaemon(BIN, str(tmp_path / "p"), str(tmp_path / "l"), runner, FakeClock(),
                       protocol_v3=False, processes=processes)
    health = MpsHealth(daemon, AgentMetrics("node-a"), lambda: None)
    _v3, error = health.check()
    assert error is not None and error.reason == "MpsDaemonNotAnswering"
    assert health.check() == (False, None)  # it answers again
    assert not health.owned
    assert processes.killed == [] and (BIN, "-d") not in runner.argvs
    health.stop()
    assert "quit\n" not in runner.stdins  # not ours to stop


class SlowToAnswer:
    """Health answers of a daemon that the agent starts and that answers only `slow_for`
    seconds after its start (a loaded node): until then each check times out."""

    def __init__(self, clock: FakeClock, processes: FakeProcesses, slow_for: float = 10.5):
        self.clock, self.processes, self.slow_for = clock, processes, slow_for
        self.started_at: float | None = None

    def health(self, _call):
        if self.started_at is None:
            return CommandResult(1, "", "Cannot find MPS control daemon process\n")
        if self.clock.now < self.started_at + self.slow_for:
            raise CommandTimeout([BIN], 2)
        return CommandResult(0, "", "")

    def start(self, _call):
        self.started_at = self.clock.now
        self.processes.pid = 4242
        self.processes.alive.add(4242)
        return CommandResult(0, "", "")


def test_a_daemon_the_agent_started_is_its_own_even_when_it_answered_late(tmp_path):
    """`-d` returned 0 but the new daemon answered only after the start timeout: it is still
    the daemon this agent started, and stopped at shutdown."""
    clock, processes, runner = FakeClock(), FakeProcesses(), RecordingRunner()
    daemon_side = SlowToAnswer(clock, processes)
    runner.respond([BIN], daemon_side.health, stdin=LIST)
    runner.respond([BIN, "-d"], daemon_side.start)
    daemon = MpsDaemon(BIN, str(tmp_path / "p"), str(tmp_path / "l"), runner, clock,
                       protocol_v3=False, processes=processes)
    health = MpsHealth(daemon, AgentMetrics("node-a"), lambda: None)
    _v3, error = health.check()
    assert error is not None and error.reason == "MpsDaemonUnreachable"
    assert daemon.starts == 1 and health.owned
    clock.now += 5
    assert health.check() == (False, None)  # it answers now
    assert health.owned
    health.stop()
    assert "quit\n" in runner.stdins


def test_the_health_check_tells_a_daemon_not_running_from_one_not_answering(tmp_path):
    """What the pass hands the engine (`Engine.apply`'s `mps_not_running`): a daemon process
    that does not answer may hold its namespaces and limits (the markers stay); once it is
    gone and cannot be started again, they are gone with it. A change between the two asks
    for a pass at the periodic check."""
    clock, processes, runner = FakeClock(), FakeProcesses(pid=4242), RecordingRunner()
    state = ["hung"]

    def health(_call):
        if state[0] == "hung":
            raise CommandTimeout([BIN], 2)
        return CommandResult(1, "", "Cannot find MPS control daemon process\n")

    runner.respond([BIN], health, stdin=LIST)
    runner.respond([BIN, "-d"], CommandResult(1, "", "boom\n"))
    daemon = MpsDaemon(BIN, str(tmp_path / "p"), str(tmp_path / "l"), runner, clock,
                       protocol_v3=False, processes=processes)
    health_ = MpsHealth(daemon, AgentMetrics("node-a"), lambda: None)
    _v3, error = health_.check()
    assert error is not None and error.reason == "MpsDaemonNotAnswering"
    assert health_.not_running is False
    assert health_.needs_pass() is False  # still the same
    state[0] = "dead"
    processes.alive.discard(4242)
    assert health_.needs_pass() is True  # gone now: the pass must say so
    _v3, error = health_.check()
    assert error is not None and error.reason == "CommandFailed"  # its start failed
    assert health_.not_running is True


def test_a_legacy_client_that_exits_mid_drain_does_not_abort_the_pods_drain():
    """The legacy daemon answers `Invalid process N!` for a pid that is no client (any more):
    nothing left to drain of it, and the pod's other clients are still drained."""
    uid, cid = "0a1b2c3d-0000-4000-8000-000000000001", "ab" * 32
    runner = RecordingRunner()
    runner.respond([BIN], "777\n", stdin=LIST)
    runner.respond([BIN], "11\n12\n", stdin="get_client_list 777\n")
    runner.respond([BIN], "Invalid process 11!\n1\n", stdin="terminate_client 777 11\n")
    runner.respond([BIN], "", stdin="terminate_client 777 12\n")
    control = MpsControl(BIN, "/tmp/p", "/tmp/l", runner, protocol_v3=False,
                         sleep=lambda s: None)
    container = SimpleNamespace(key=SimpleNamespace(pod_uid=uid, container="main"),
                                container_id=f"containerd://{cid}",
                                plan=SimpleNamespace(device_uuids=("GPU-0",)))
    nvml = SimpleNamespace(running_processes=lambda _uuid: [SimpleNamespace(pid=11),
                                                            SimpleNamespace(pid=12)])
    procfs = SimpleNamespace(container_of=lambda _pid: PodContainer(uid, cid))
    desired = SimpleNamespace(containers=[container])
    assert drain(control, desired, nvml, procfs, uid) == [12]
    assert runner.stdins[-2:] == ["terminate_client 777 11\n", "terminate_client 777 12\n"]
