"""The MPS control daemon (the real legacy binary) SIGKILLed in the middle of an apply, right
before the agent sets a GPU's pinned memory limit on it: the command fails, the container stays
pending with no marker, the supervisor starts a new daemon, the engine applies everything again
on it, and only then is the pod marked ready. In-process agent over the fake NVML library."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from kai_fractions.node.agent.agent import NodeAgent
from kai_fractions.node.agent.options import AgentOptions
from kai_fractions.node.config import NodeConfig
from kai_fractions.node.mps import MpsDaemon, SubprocessRunner
from kai_fractions.node.mps.daemon import ProcDaemonProcesses
from kai_fractions.node.mps.runner import CommandResult
from kai_fractions.node.nvml import PynvmlNvml
from kai_fractions.sim.cgroups import FakeCgroupFs
from tests.faults.agent_rig import first_daemon_then_sm_pod
from tests.support import tools
from tests.support.fake_kube import FakeCluster
from tests.support.mps import mps_command

pytestmark = [pytest.mark.faults, pytest.mark.integration]

GPU = "GPU-00000000-0000-0000-0000-0000000000b0"
PINNED = "set_default_device_pinned_mem_limit 0"


class KillingRunner:
    """The real runner; the first time a command starting with `trigger` is about to reach the
    daemon, the daemon is SIGKILLed first. Logs (what, daemon pid) for the test."""

    def __init__(self, pipe_dir: Path, trigger: str) -> None:
        self.inner = SubprocessRunner()
        self.pipe_dir = str(pipe_dir)
        self.trigger = trigger
        self.processes = ProcDaemonProcesses()
        self.killed: int | None = None
        self.log: list[tuple[str, str, int | None]] = []

    def run(self, argv: Sequence[str], stdin: str | None = None,
            env: Mapping[str, str] | None = None, timeout: float = 10) -> CommandResult:
        line = (stdin or "").strip()
        if self.killed is None and line.startswith(self.trigger):
            pid = self.processes.daemon_pid(self.pipe_dir)
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            while self.processes.is_alive(pid):
                time.sleep(0.01)
            self.killed = pid
            self.log.append(("kill", "", pid))
        result = self.inner.run(argv, stdin, env, timeout)
        self.log.append(("cmd" if result.returncode == 0 else "failed", line,
                         self.processes.daemon_pid(self.pipe_dir)))
        return result


def test_daemon_killed_before_the_pinned_limit_is_set(fake_nvml, short_tmp: Path):
    fake_nvml.add_gpu(GPU, memory_mib=81559)
    pipe, logs = short_tmp / "mps", short_tmp / "log"
    runner = KillingRunner(pipe, PINNED)
    config = NodeConfig(node_name="node-a", sm_sharing=True, mps_pipe_dir=str(pipe),
                        mps_log_dir=str(logs), mps_control_binary=str(tools.mps_control()),
                        proc_root=str(short_tmp))
    daemon = MpsDaemon(config.mps_control_binary, str(pipe), str(logs), runner,
                       backoff_initial=0.2)
    runner.pipe_dir = daemon.pipe_dir  # a daemon without namespaces runs under shared/
    cluster = FakeCluster()
    cluster.add_node("node-a")
    agent = NodeAgent(config=config, options=AgentOptions(
        marker_dir=str(short_tmp / "markers"), socket=None, metrics_listen=None,
        retry_seconds=0.1, retry_max_seconds=0.3), nvml=PynvmlNvml(),
        cgroup_fs=FakeCgroupFs(assume_present=True), source=cluster, cluster=cluster,
        mps=daemon)
    store, write = agent.reconciler.markers, agent.reconciler.markers.write

    def marker_written(*args, **kw):
        runner.log.append(("marker", "", None))
        return write(*args, **kw)

    store.write = marker_written
    agent.start()
    try:
        first, uid = first_daemon_then_sm_pod(daemon, cluster, short_tmp / "markers", GPU)
        second = daemon.pid()
    finally:
        agent.stop(timeout=20)
        with contextlib.suppress(Exception):
            mps_command(tools.mps_control(), daemon.pipe_dir, "quit", log_dir=logs, timeout=5)
    assert runner.killed == first and second not in (None, first)
    assert daemon.restarts == 1
    assert agent.metrics.registry.get_sample_value(
        "kai_fractions_mps_daemon_restarts_total") == 1
    events = runner.log
    kill = events.index(("kill", "", first))
    assert events[kill + 1] == ("failed", f"{PINNED} 20480M", None)  # the daemon was gone
    marker_at = events.index(("marker", "", None))
    assert marker_at > kill
    # before the marker: the pinned limit set on the NEW daemon, and read back from it
    after = events[kill + 2:marker_at]
    assert (("cmd", f"{PINNED} 20480M", second) in after
            and ("cmd", "get_default_device_pinned_mem_limit 0", second) in after), after
    assert cluster.event_reasons(uid) == ["Applied"]
