"""The MPS control daemon (the real legacy binary) dies under a running sm-sharing pod, and the
one the supervisor starts answers only after the start timeout (a loaded node): `-d` returned
0, so the new daemon runs but holds none of the pod's settings. Its first answer, at a later
check, must count as a restart (the engine drops its MPS caches and the pass applies
everything again) and bring the settings back (here the pinned memory limit), not be taken
for a daemon whose state is applied. In-process agent over the fake NVML library."""

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
from kai_fractions.node.mps.runner import CommandResult, CommandTimeout
from kai_fractions.node.nvml import PynvmlNvml
from kai_fractions.sim.cgroups import FakeCgroupFs
from tests.agent.builders import wait_for
from tests.faults.agent_rig import first_daemon_then_sm_pod
from tests.support import tools
from tests.support.fake_kube import FakeCluster
from tests.support.mps import mps_command

pytestmark = [pytest.mark.faults, pytest.mark.integration]

GPU = "GPU-00000000-0000-0000-0000-0000000000b1"
GET_PINNED = "get_default_device_pinned_mem_limit 0"


class SlowAfterRestartRunner:
    """The real runner; once armed, the next daemon started answers no control command for
    `slow_for` seconds after its `-d` returned (each times out, as a client of a busy daemon
    does)."""

    def __init__(self, slow_for: float) -> None:
        self.inner = SubprocessRunner()
        self.slow_for = slow_for
        self.armed = False
        self.slow_until = 0.0
        self.timeouts = 0

    def run(self, argv: Sequence[str], stdin: str | None = None,
            env: Mapping[str, str] | None = None, timeout: float = 10) -> CommandResult:
        if list(argv[1:]) == ["-d"]:
            result = self.inner.run(argv, stdin, env, timeout)
            if self.armed and result.returncode == 0:
                self.armed = False
                self.slow_until = time.monotonic() + self.slow_for
            return result
        if not argv[1:] and time.monotonic() < self.slow_until:
            self.timeouts += 1
            raise CommandTimeout(list(argv), timeout)
        return self.inner.run(argv, stdin, env, timeout)


def _pinned(daemon: MpsDaemon, logs: Path) -> str:
    res = mps_command(tools.mps_control(), daemon.pipe_dir, GET_PINNED, log_dir=logs, timeout=5)
    return res.stdout.strip() if res.returncode == 0 else ""


def test_a_restart_that_answers_late_gets_the_pods_settings_back(fake_nvml, short_tmp: Path):
    fake_nvml.add_gpu(GPU, memory_mib=81559)
    pipe, logs = short_tmp / "mps", short_tmp / "log"
    runner = SlowAfterRestartRunner(slow_for=1.5)
    config = NodeConfig(node_name="node-a", sm_sharing=True, mps_pipe_dir=str(pipe),
                        mps_log_dir=str(logs), mps_control_binary=str(tools.mps_control()),
                        proc_root=str(short_tmp))
    daemon = MpsDaemon(config.mps_control_binary, str(pipe), str(logs), runner,
                       start_timeout=0.5, backoff_initial=0.2)
    cluster = FakeCluster()
    cluster.add_node("node-a")
    agent = NodeAgent(config=config, options=AgentOptions(
        marker_dir=str(short_tmp / "markers"), socket=None, metrics_listen=None,
        retry_seconds=0.1, retry_max_seconds=0.3, mps_check_seconds=0.1), nvml=PynvmlNvml(),
        cgroup_fs=FakeCgroupFs(assume_present=True), source=cluster, cluster=cluster,
        mps=daemon)
    agent.start()
    try:
        first, _ = first_daemon_then_sm_pod(daemon, cluster, short_tmp / "markers", GPU)
        # The legacy daemon may turn a second client away while the agent's own check runs.
        wait_for(lambda: _pinned(daemon, logs) == "20G", timeout=10,
                 what="the pinned limit on the first daemon")
        runner.armed = True
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: daemon.pid() not in (None, first), timeout=20, what="a new daemon")
        second = daemon.pid()
        wait_for(lambda: time.monotonic() > runner.slow_until, timeout=20,
                 what="the slow period's end")
        wait_for(lambda: _pinned(daemon, logs) == "20G", timeout=10,
                 what="the pinned limit on the new daemon")
    finally:
        agent.stop(timeout=20)
        with contextlib.suppress(Exception):
            mps_command(tools.mps_control(), daemon.pipe_dir, "quit", log_dir=logs, timeout=5)
    assert runner.timeouts > 0  # the new daemon did answer late
    assert daemon.pid() is None or daemon.pid() != first
    assert second != first and daemon.restarts == 1
    assert agent.metrics.registry.get_sample_value(
        "kai_fractions_mps_daemon_restarts_total") == 1
