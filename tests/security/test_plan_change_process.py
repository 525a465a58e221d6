"""Issue 17, finding 2 through the REAL node agent process (kmock, the fake libnvidia-ml.so.1,
no admission webhook in front of the API, as when it is down or set to Ignore): a tenant edits
the user-owned keys of its running pod. The agent keeps the applied plan: the cgroup limits
stay, the pod keeps its memory in the GPU's accounting (a pod that would fit only without it is
refused), the watchdog still reports usage above the OLD cap, `PlanChangeRefused` events and
the refusal metric say why, and a restarted agent does the same from what the cluster, the
markers and the GPU say."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.support.agent_process import GPU0, H100_MIB, AgentEnv, AgentRun, wait_for

pytestmark = pytest.mark.integration

GIB = 1 << 30
HEX = "7a" * 32
PID = 5151
LIMIT = "nvidia.com/container.main.gpu-memory.limit"


def bound(env: AgentEnv, name: str, request: str, limit: str) -> str:
    """A pod bound by an unmodified KAI (binder keys only), running on the node."""
    body = {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "default", "annotations": {
                "nvidia.com/container.main.gpu-memory.request": request,
                LIMIT: limit,
                "nvidia.com/container.main.gpu-compute.mode": "time-slicing",
                "nvidia.com/container.main.gpus.devices": GPU0,
                "nvidia.com/container.main.gpu-compute.portion": "0.5"}},
            "spec": {"nodeName": env.node, "containers": [{
                "name": "main", "image": "registry.invalid/app:1",
                "resources": {"requests": {"cpu": "100m"}}}]}}
    uid = env.kube.core.create_namespaced_pod("default", body).metadata.uid
    env.make_cgroups(uid, HEX)
    env.kube.core.patch_namespaced_pod_status(name=name, namespace="default", body={"status": {
        "phase": "Running", "qosClass": "Burstable", "containerStatuses": [
            {"name": "main", "containerID": f"containerd://{HEX}", "ready": False,
             "restartCount": 0, "image": "x", "imageID": "x"}]}})
    return uid


def marker(env: AgentEnv, uid: str) -> dict[str, Any] | None:
    path = env.marker(uid)
    return json.loads(path.read_text()) if path.exists() else None


def limits(env: AgentEnv, uid: str) -> dict[str, tuple[int, int]]:
    part = uid.replace("-", "_")
    return {path: (v.soft, v.hard) for (_gpu, path), v in env.nvml.limits().items()
            if part in path}


def messages(env: AgentEnv, uid: str, reason: str) -> list[str]:
    return [e["message"] for e in env.events(uid) if e["reason"] == reason]


def refused_metric(run: AgentRun, env: AgentEnv, uid: str) -> float | None:
    labels = (f'{{container="main",namespace="default",node="{env.node}",pod="p",'
              f'pod_uuid="{uid}",reason="PlanChangeRefused"}}')
    for line in run.metrics().splitlines():
        if line.startswith(f"kai_fractions_container_refused{labels} "):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_a_tenant_editing_its_running_pod_keeps_its_applied_plan(agent_env: AgentEnv) -> None:
    env = agent_env
    env.nvml.add_gpu(GPU0, memory_mib=H100_MIB)
    env.create_node()
    run = env.start(sm_sharing=False)
    uid = bound(env, "p", "10Gi", "20Gi")
    wait_for(lambda: (m := marker(env, uid)) and m["containers"]["main"]["state"] == "applied",
             run=run, what="the applied marker", timeout=20)
    applied = marker(env, uid)["containers"]["main"]
    before = limits(env, uid)
    assert set(before.values()) == {(10 * GIB, 20 * GIB)} and len(before) == 2

    # 1. the limit raised to 75 GiB: refused, the 20 GiB cap stays
    env.kube.core.patch_namespaced_pod("p", "default", {
        "metadata": {"annotations": {LIMIT: "75Gi"}}})
    (raised,) = wait_for(lambda: messages(env, uid, "PlanChangeRefused"), run=run,
                         what="PlanChangeRefused for the raised limit")
    assert raised.startswith("container main: the pod's GPU annotations changed after this "
                             "container's limits were applied (memory limit 20480 MiB -> "
                             "76800 MiB): the change is refused and the applied plan")
    assert limits(env, uid) == before

    # 2. the annotations made invalid: the pod still holds its 10 GiB of the GPU, so a pod
    # that fits only without it is refused
    env.kube.core.patch_namespaced_pod("p", "default", {
        "metadata": {"annotations": {LIMIT: "a lot"}}})
    wait_for(lambda: len(messages(env, uid, "PlanChangeRefused")) == 2, run=run,
             what="PlanChangeRefused for the invalid limit")
    waiting = bound(env, "q", "75Gi", "75Gi")
    entry = wait_for(lambda: (m := marker(env, waiting)) and m["containers"]["main"], run=run,
                     what="the second pod's marker")
    assert (entry["state"], entry["reason"]) == ("refused", "MemoryOvercommitted")
    assert limits(env, waiting) == {}
    assert limits(env, uid) == before
    assert marker(env, uid)["containers"]["main"] == applied
    assert wait_for(lambda: refused_metric(run, env, uid), run=run, what="metric") == 1

    # 3. the watchdog still guards the OLD cap
    env.proc_entry(PID, f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod"
                        f"{uid.replace('-', '_')}.slice/cri-containerd-{HEX}.scope")
    env.nvml.add_process(0, PID, 30 * GIB)
    (violation,) = wait_for(lambda: messages(env, uid, "LimitViolation"), run=run,
                            what="LimitViolation above the old cap")
    assert "above its cap of 20480 MiB" in violation

    # 4. a new agent reads the applied plan back from the pod and the marker
    assert run.stop() == 0
    second = env.start(sm_sharing=False)
    wait_for(lambda: len(messages(env, uid, "PlanChangeRefused")) == 3, run=second,
             what="PlanChangeRefused from the new agent", timeout=20)
    wait_for(lambda: len(messages(env, uid, "LimitViolation")) == 2, run=second,
             what="LimitViolation from the new agent")
    assert limits(env, uid) == before and limits(env, waiting) == {}
    assert marker(env, uid)["containers"]["main"] == applied
    assert marker(env, waiting)["containers"]["main"]["reason"] == "MemoryOvercommitted"
    assert wait_for(lambda: refused_metric(second, env, uid), run=second, what="metric") == 1
    assert second.stop() == 0
