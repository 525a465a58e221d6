"""The real node agent (fake NVML, the test API server) refuses at start what it cannot work with,
exit 2 with one line that names the flag: a marker directory it cannot write (every gate on
the node would wait while its condition said Ready), a metrics port or a socket path it cannot
have. A flag refused before the agent is built publishes nothing; an agent whose start failed
says why in the node condition (False, NotReconciling), so that a condition an agent before it
left (True, if it was killed) does not go on saying the node is ready."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import pytest

from kai_fractions.cli.node_agent import marker_dir_problem
from tests.support.agent_process import AgentEnv

pytestmark = pytest.mark.integration

EXIT_WAIT = 60  # a hang, not a speed: a refused start exits at once


def refused(env: AgentEnv, *extra: str, said: bool = False) -> str:
    """The agent's last line, once it has exited 2. `said`: the start failed once the agent
    was built, and the node's condition (True before, as a killed agent leaves it) says why;
    else the node has no condition."""
    left = [{"type": "gpu-fractioning.nvidia.com/Ready", "status": "True",
             "reason": "AgentReady", "message": "left by an agent that was killed"}]
    env.kube.core.create_node({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": env.node, "labels": {"nvidia.com/gpu.memory": "81559"}},
        "status": {"conditions": left if said else []}})
    run = env.start(*extra)
    try:
        rc = run.proc.wait(EXIT_WAIT)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the agent started with {extra}:\n{run.log_tail()}") from None
    assert rc == 2, run.log_tail()
    last = run.log().strip().splitlines()[-1]
    if said:
        condition = env.condition()
        assert condition is not None and condition["status"] == "False", condition
        assert condition["reason"] == "NotReconciling", condition
        why = last.removeprefix("kai-fractions node-agent: ")
        assert condition["message"].startswith(f"the node agent could not start ({why})")
    else:
        assert env.condition() is None, env.condition()
    return last


def test_a_marker_dir_that_is_a_file(agent_env: AgentEnv):
    path = agent_env.tmp / "markerfile"
    path.write_text("x")
    assert refused(agent_env, f"--marker-dir={path}") == (
        f"kai-fractions node-agent: --marker-dir {path}: exists and is not a directory")


def test_a_marker_dir_under_a_file(agent_env: AgentEnv):
    (agent_env.tmp / "afile").write_text("x")
    path = agent_env.tmp / "afile" / "markers"
    assert refused(agent_env, f"--marker-dir={path}") == (
        f"kai-fractions node-agent: --marker-dir {path}: cannot be created: Not a directory")


def test_a_metrics_port_in_use(agent_env: AgentEnv):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert refused(agent_env, f"--metrics-listen=127.0.0.1:{port}", said=True) == (
            f"kai-fractions node-agent: --metrics-listen 127.0.0.1:{port}: Address already in "
            "use")
    assert not agent_env.socket.exists()


def test_a_socket_under_a_file(agent_env: AgentEnv):
    parent = agent_env.short / "afile"
    parent.write_text("")
    assert refused(agent_env, f"--socket={parent}/agent.sock", said=True) == (
        f"kai-fractions node-agent: --socket {parent}/agent.sock: cannot create its directory "
        f"{parent}: File exists")


def test_a_missing_marker_dir_is_made(tmp_path: Path):
    path = tmp_path / "a" / "markers"
    assert marker_dir_problem(str(path)) is None
    assert path.is_dir()


def test_a_link_to_a_file_is_not_a_marker_dir(tmp_path: Path):
    (tmp_path / "file").write_text("x")
    (tmp_path / "link").symlink_to(tmp_path / "file")
    assert marker_dir_problem(str(tmp_path / "link")) == (
        f"--marker-dir {tmp_path / 'link'}: exists and is not a directory")
