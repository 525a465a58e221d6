"""MpsHealth over a real MpsDaemon (recording runner, fake process table and clock): a daemon
that is slow to answer is reported as not answering, never killed at once, and one found
running is adopted, even when it was slow at the agent's first look."""

from __future__ import annotations

from kai_fractions.node.agent.metrics import AgentMetrics
from kai_fractions.node.agent.mps_supervisor import MpsHealth
from kai_fractions.node.mps.daemon import MpsDaemon
from kai_fractions.node.mps.runner import CommandTimeout, RecordingRunner
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
