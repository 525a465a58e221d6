"""The REAL MPS control daemon (the legacy 535 binary) gone under a running sm-sharing pod, with
the real supervisor telling "not running" from "not answering":

- SIGKILLed, and every start of a new one fails: the pod's readiness marker is set aside (the
  MPS server that enforces its share of the SMs went with the daemon; its pinned limit too,
  though no tier on this daemon) until a daemon runs again with the limit set;
- stopped by the agent that started it, at a graceful stop (SIGTERM: a rollout, `helm
  upgrade`): the marker is set aside before the daemon is asked to quit, and the next agent
  writes it again once it has applied everything on its own daemon. Both in-process and as the
  real agent process.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from kai_fractions.marker import SET_ASIDE_FILE
from kai_fractions.node.agent.agent import NodeAgent
from kai_fractions.node.agent.options import AgentOptions
from kai_fractions.node.config import NodeConfig
from kai_fractions.node.mps import MpsDaemon, SubprocessRunner
from kai_fractions.node.mps.runner import CommandResult
from kai_fractions.node.nvml import PynvmlNvml
from kai_fractions.sim.cgroups import FakeCgroupFs
from tests.agent.builders import wait_for
from tests.agent.test_agent_process import (
    CONTAINER_HEX,
    binder_keys,
    pod_body,
    ready,
    start_running,
)
from tests.faults.agent_rig import first_daemon_then_sm_pod
from tests.support import tools
from tests.support.agent_process import GPU0, H100_MIB, AgentEnv
from tests.support.agent_process import wait_for as wait_for_run
from tests.support.fake_kube import FakeCluster
from tests.support.mps import mps_command

pytestmark = [pytest.mark.faults, pytest.mark.integration]

GPU = "GPU-00000000-0000-0000-0000-0000000000b2"
GET_PINNED = "get_default_device_pinned_mem_limit 0"


class Runner:
    """The real runner; `refuse_starts` makes every `-d` fail (a daemon that cannot be started
    again: its binary broken, its directories unusable). Notes, at the daemon's `quit`,
    whether each watched marker file was still there."""

    def __init__(self) -> None:
        self.inner = SubprocessRunner()
        self.refuse_starts = False
        self.refused = 0
        self.watched: list[Path] = []
        self.at_quit: list[tuple[bool, ...]] = []

    def run(self, argv: Sequence[str], stdin: str | None = None,
            env: Mapping[str, str] | None = None, timeout: float = 10) -> CommandResult:
        if list(argv[1:]) == ["-d"] and self.refuse_starts:
            self.refused += 1
            return CommandResult(1, "", "refused by the test\n")
        if (stdin or "").strip() == "quit":
            self.at_quit.append(tuple(p.exists() for p in self.watched))
        return self.inner.run(argv, stdin, env, timeout)


def _agent(short_tmp: Path, cluster: FakeCluster, runner: Runner) -> tuple[NodeAgent, MpsDaemon]:
    pipe, logs = short_tmp / "mps", short_tmp / "log"
    config = NodeConfig(node_name="node-a", sm_sharing=True, mps_pipe_dir=str(pipe),
                        mps_log_dir=str(logs), mps_control_binary=str(tools.mps_control()),
                        proc_root=str(short_tmp))
    daemon = MpsDaemon(config.mps_control_binary, str(pipe), str(logs), runner,
                       backoff_initial=0.2, backoff_max=0.5)
    agent = NodeAgent(config=config, options=AgentOptions(
        marker_dir=str(short_tmp / "markers"), socket=None, metrics_listen=None,
        retry_seconds=0.1, retry_max_seconds=0.3, mps_check_seconds=0.1), nvml=PynvmlNvml(),
        cgroup_fs=FakeCgroupFs(assume_present=True), source=cluster, cluster=cluster,
        mps=daemon)
    return agent, daemon


def _node(fake_nvml, short_tmp: Path
          ) -> tuple[FakeCluster, Runner, NodeAgent, MpsDaemon]:
    """One H100 on node-a, and an agent (not started) over the real legacy daemon."""
    fake_nvml.add_gpu(GPU, memory_mib=81559)
    cluster = FakeCluster()
    cluster.add_node("node-a")
    runner = Runner()
    return (cluster, runner, *_agent(short_tmp, cluster, runner))


def _pinned(daemon: MpsDaemon, logs: Path) -> bool:
    """The daemon holds the 20G default pinned limit of GPU 0 (asked until it answers: the
    legacy daemon turns a client away while it serves the agent's)."""
    def read() -> bool:
        res = mps_command(tools.mps_control(), daemon.pipe_dir, GET_PINNED, log_dir=logs,
                          timeout=5)
        return res.returncode == 0 and res.stdout.strip() == "20G"
    return bool(wait_for(read, timeout=10, interval=0.1, what="the 20G pinned limit"))


def _quit(daemon: MpsDaemon, logs: Path) -> None:
    with contextlib.suppress(Exception):
        mps_command(tools.mps_control(), daemon.pipe_dir, "quit", log_dir=logs, timeout=5)


def test_a_killed_daemon_that_cannot_be_started_again_sets_the_marker_aside(
        fake_nvml, short_tmp: Path) -> None:
    cluster, runner, agent, daemon = _node(fake_nvml, short_tmp)
    markers, logs = short_tmp / "markers", short_tmp / "log"
    agent.start()
    try:
        first, uid = first_daemon_then_sm_pod(daemon, cluster, markers, GPU)
        marker, aside = markers / uid / "marker.json", markers / uid / SET_ASIDE_FILE
        assert _pinned(daemon, logs)
        runner.refuse_starts = True
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: not marker.exists() and aside.exists(), timeout=20,
                 what="the marker set aside")
        # The set-aside may come before the first refused start (a backoff can run first).
        wait_for(lambda: runner.refused >= 1, timeout=20, what="a start refused")
        assert daemon.pid() is None
        result = wait_for(lambda: (r := agent.reconciler.view.results.get((uid, "main")))
                          and r.not_in_force and r, timeout=10, what="the pass's result")
        assert result.reason == "NamespaceCapNotSet"  # the server's: the limit is no tier here
        assert result.message.startswith("the MPS control daemon is not running (")
        wait_for(lambda: "MpsCapNotInForce" in cluster.event_reasons(uid), timeout=10,
                 what="the warning")
        runner.refuse_starts = False  # a daemon can run again: the limit first, then the marker
        wait_for(marker.exists, timeout=20, what="the marker written again")
        assert json.loads(marker.read_text())["containers"]["main"]["state"] == "applied"
        assert _pinned(daemon, logs)
        assert daemon.pid() not in (None, first)
    finally:
        agent.stop(timeout=20)
        _quit(daemon, logs)
    assert cluster.event_reasons(uid) == ["Applied", "MpsCapNotInForce", "Applied"]


def test_a_graceful_stop_sets_the_marker_aside_before_its_daemon_quits(
        fake_nvml, short_tmp: Path) -> None:
    cluster, runner, agent, daemon = _node(fake_nvml, short_tmp)
    markers, logs = short_tmp / "markers", short_tmp / "log"
    agent.start()
    try:
        first, uid = first_daemon_then_sm_pod(daemon, cluster, markers, GPU)
        marker, aside = markers / uid / "marker.json", markers / uid / SET_ASIDE_FILE
        runner.watched = [marker, aside]
    finally:
        agent.stop(timeout=20)
    try:
        assert runner.at_quit == [(False, True)]  # set aside before the daemon was asked
        assert daemon.pid() is None  # it quit
        # the next agent: its own daemon, everything applied on it, then the marker
        second_runner = Runner()
        second_runner.watched = [marker, aside]
        second, second_daemon = _agent(short_tmp, cluster, second_runner)
        second.start()
        try:
            wait_for(marker.exists, timeout=30, what="the marker written again")
            assert _pinned(second_daemon, logs)
            assert not aside.exists()
        finally:
            second.stop(timeout=20)
        assert second_runner.at_quit == [(False, True)]  # and again at its own stop
        assert second_daemon.pid() is None
    finally:
        _quit(daemon, logs)
    assert first is not None and cluster.event_reasons(uid) == ["Applied", "Applied"]


def test_sigterm_sets_the_marker_aside_and_the_next_agent_writes_it_again(
        agent_env: AgentEnv) -> None:
    """The real agent process: SIGTERM stops the MPS daemon it started, its sm-sharing pod's
    marker set aside first; the next agent process writes it again."""
    env = agent_env
    env.nvml.add_gpu(GPU0, memory_mib=H100_MIB)
    env.create_node()
    run = env.start()
    wait_for_run(lambda: ready(env), what="node condition True", run=run, timeout=20)
    created = env.kube.core.create_namespaced_pod(
        "default", pod_body("sm", binder_keys("sm-sharing"), env.node))
    uid = created.metadata.uid
    start_running(env, uid, *env.make_cgroups(uid, CONTAINER_HEX))
    marker = env.marker(uid)
    aside = marker.parent / SET_ASIDE_FILE
    wait_for_run(marker.exists, run=run, what="the marker", timeout=20)
    body = json.loads(marker.read_text())
    assert "mps-pinned" in body["containers"]["main"]["message"]

    assert run.stop() == 0, run.log()
    assert not marker.exists() and aside.exists()
    assert json.loads(aside.read_text())["containers"] == body["containers"]  # the hold
    assert "set aside its marker" in run.log()
    assert "the node agent stopped, and its MPS control daemon with it" in run.log()
    assert "Cannot find MPS control daemon" in (env.mps("get_server_list").stderr
                                                + env.mps("get_server_list").stdout)

    second = env.start()
    wait_for_run(marker.exists, run=second, what="the marker written again", timeout=30)
    assert json.loads(marker.read_text())["containers"] == body["containers"]
    assert not aside.exists()
    wait_for_run(lambda: env.mps("get_default_device_pinned_mem_limit 0").stdout.strip()
                 == "20G", run=second, what="the pinned limit on its daemon", timeout=10)
    applied = wait_for_run(
        lambda: len([e for e in env.events(uid) if e["reason"] == "Applied"]) == 2 or None,
        run=second, what="the second Applied", timeout=10)
    assert applied
    assert second.stop() == 0, second.log()
