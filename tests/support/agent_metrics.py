"""A live agent's /metrics with every family populated: the REAL agent process (`agent_env`)
with one applied sm-sharing pod whose first limit write NVML refuses once (a reconcile error)
and whose process then runs over its cap (usage, SM share, one limit violation), and one refused
pod (a time-slicing newcomer on the sm-sharing GPU), so the scrape holds a sample of every
metric the agent exports. Used by the metrics and dashboard tests."""

from __future__ import annotations

from typing import Any

from tests.support.agent_process import GPU0, H100_MIB, AgentEnv, AgentRun, wait_for
from tests.support.promql import sample_value

GIB = 1 << 30
CONTAINER_HEX = "5ca1ab1e" + "0" * 56
PID = 5151
NVML_ERROR_NO_PERMISSION = 4  # nvmlReturn_t
NVML_ERROR_UNKNOWN = 999


def _binder_keys(mode: str) -> dict[str, str]:
    return {"nvidia.com/container.main.gpu-memory.request": "10Gi",
            "nvidia.com/container.main.gpu-memory.limit": "20Gi",
            "nvidia.com/container.main.gpu-compute.mode": mode,
            "nvidia.com/container.main.gpus.devices": GPU0,
            "nvidia.com/container.main.gpu-compute.portion": "0.5"}


def _pod(env: AgentEnv, name: str, mode: str) -> str:
    body: dict[str, Any] = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "annotations": _binder_keys(mode)},
        "spec": {"nodeName": env.node, "containers": [{
            "name": "main", "image": "registry.invalid/app:1",
            "resources": {"requests": {"cpu": "100m"}}}]}}
    return str(env.kube.core.create_namespaced_pod("default", body).metadata.uid)


def populated_scrape(env: AgentEnv) -> tuple[str, dict[str, str], AgentRun]:
    """(the scrape, {"applied": uid, "refused": uid}, the agent run)."""
    env.nvml.add_gpu(GPU0, memory_mib=H100_MIB)
    env.create_node()
    run = env.start()
    env.nvml.inject_error("nvmlDeviceSetMemoryLimits_v1", NVML_ERROR_NO_PERMISSION, times=1)
    applied = _pod(env, "applied", "sm-sharing")
    env.make_cgroups(applied, CONTAINER_HEX)
    env.kube.core.patch_namespaced_pod_status(name="applied", namespace="default", body={
        "status": {"phase": "Running", "qosClass": "Burstable", "containerStatuses": [
            {"name": "main", "containerID": f"containerd://{CONTAINER_HEX}", "ready": False,
             "restartCount": 0, "image": "x", "imageID": "x"}]}})
    env.proc_entry(PID, f"/kubepods.slice/kubepods-burstable.slice/"
                        f"kubepods-burstable-pod{applied.replace('-', '_')}.slice/"
                        f"cri-containerd-{CONTAINER_HEX}.scope")
    wait_for(lambda: env.marker(applied).exists(), run=run, what="the applied pod's marker",
             timeout=20)
    refused = _pod(env, "refused", "time-slicing")
    # one usage check blind on the GPU (kai_fractions_agent_gpu_usage_unreadable_total), then
    # the process over its 20 GiB cap
    env.nvml.inject_error("nvmlDeviceGetComputeRunningProcesses_v3", NVML_ERROR_UNKNOWN, times=1)
    env.nvml.add_process(0, PID, 25 * GIB, sm_util=10)

    def full() -> str | None:
        text = run.metrics()
        done = (sample_value(text, "kai_fractions_container_gpu_memory_limit_violations_total",
                       pod_uuid=applied) == 1
                and sample_value(text, "kai_fractions_container_refused", pod_uuid=refused) == 1
                and sample_value(text, "gpu_fractioning_gpu_sm_utilization_percent",
                           pod_uuid=applied) == 10
                and sample_value(text, "kai_fractions_node_ready") is not None
                and sample_value(text, "kai_fractions_reconcile_errors_total",
                           reason="MemoryLimitNotInForce") is not None
                and sample_value(text, "kai_fractions_agent_gpu_usage_unreadable_total")
                is not None)
        return text if done else None

    text = wait_for(full, run=run, what="every metric family populated", timeout=20)
    return text, {"applied": applied, "refused": refused}, run


__all__ = ["GIB", "populated_scrape"]
