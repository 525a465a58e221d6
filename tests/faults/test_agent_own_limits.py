"""The REAL agent process clears only the GPU memory limits it set (kmock, the fake
libnvidia-ml.so.1): a limit someone else put on a pod's cgroup (NVIDIA's container toolkit sets
them from a pod's env) survives its passes and its restarts, while a limit of its own is cleared
by a new agent process from the record it keeps beside the markers, even for a pod whose marker
is gone."""

from __future__ import annotations

import json
import os
import signal
import stat

import pytest

from kai_fractions.node.nvml import PynvmlNvml
from tests.faults.test_agent_process_faults import GIB, one_pod_applied
from tests.support.agent_process import GPU0, AgentEnv, wait_for

pytestmark = [pytest.mark.faults, pytest.mark.integration]


def test_the_agent_clears_its_own_limits_and_no_one_elses(
        agent_env: AgentEnv, monkeypatch: pytest.MonkeyPatch) -> None:
    env = agent_env
    node, run, ours = one_pod_applied(env)
    record = env.marker_dir / ".limits.json"
    assert stat.S_IMODE(os.stat(record).st_mode) == 0o600
    _name, _slice, leaf = node.live[ours]
    # the container's own cgroup may get its limit a pass after the pod counts as applied
    # (its slice carries the cap meanwhile): the record says so once it has
    wait_for(lambda: [GPU0, str(leaf)] in json.loads(record.read_text())["limits"], run=run,
             timeout=10, what=f"the record of the limit on {leaf}")

    # a pod the agent has nothing to do with, whose leaf the toolkit limited
    plain = env.kube.core.create_namespaced_pod("default", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "plain", "namespace": "default"},
        "spec": {"nodeName": env.node, "containers": [{"name": "main", "image": "x"}]}}
    ).metadata.uid
    _plain_slice, plain_leaf = env.make_cgroups(plain, "ee" * 32)
    env.nvml.activate(monkeypatch)
    toolkit = PynvmlNvml()
    toolkit.init()
    try:
        toolkit.set_memory_limits(GPU0, str(plain_leaf), GIB, 2 * GIB)
    finally:
        toolkit.shutdown()

    # the agent is killed; meanwhile its pod is deleted (its cgroup lingers) and its marker
    # directory goes (as for a pod that never got one: pending when the agent stopped)
    run.stop(signal.SIGKILL)
    node.delete(ours)
    (env.marker_dir / ours / "marker.json").unlink()
    second = env.start(sm_sharing=False)
    wait_for(lambda: str(leaf) not in node.limits(), run=second, timeout=30,
             what="the gone pod's limits cleared by the new agent")
    assert node.limits() == {str(plain_leaf): (GIB, 2 * GIB)}  # the toolkit's stays
    # the record is saved once the sweep that cleared them ends: a moment after the clears
    wait_for(lambda: json.loads(record.read_text())["limits"] == [], run=second, timeout=10,
             what="the record emptied")
    assert second.stop() == 0
