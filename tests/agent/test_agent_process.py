"""End to end on one machine: the kmock API, the REAL agent process (`kai-fractions node-agent`),
the real pynvml over the fake libnvidia-ml.so.1, and the real `nvidia-cuda-mps-control` (535,
legacy protocol: no namespaces, so sm-sharing goes through the client env and the pipe link).

Annotation keys, cgroup paths, metric names and label sets are spelled out literally.
"""

from __future__ import annotations

import json
import os
import signal
import stat
from pathlib import Path
from typing import Any

import grpc
import pytest

from kai_fractions.api.v1 import node_pb2, node_pb2_grpc
from kai_fractions.contract import derived_annotations, parse_pod, plan_pod, pod_views
from kai_fractions.marker import read_boot_id
from tests.support.agent_process import GPU0, H100_MIB, AgentEnv, wait_for

pytestmark = pytest.mark.integration

GIB = 1 << 30
MAX = 0xFFFFFFFFFFFFFFFF
CONTAINER_HEX = "c0ffee" + "0" * 58
PID = 4242
COND = "gpu-fractioning.nvidia.com/Ready"


def binder_keys(mode: str = "sm-sharing") -> dict[str, str]:
    return {
        "nvidia.com/container.main.gpu-memory.request": "10Gi",
        "nvidia.com/container.main.gpu-memory.limit": "20Gi",
        "nvidia.com/container.main.gpu-compute.mode": mode,
        "nvidia.com/container.main.gpus.devices": GPU0,
        "nvidia.com/container.main.gpu-compute.portion": "0.5",
    }


def pod_body(name: str, annotations: dict[str, str], node: str | None) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{
        "name": "main", "image": "registry.invalid/app:1",
        "resources": {"requests": {"cpu": "100m"}}}]}  # Burstable
    if node:
        spec["nodeName"] = node
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "default", "annotations": annotations},
            "spec": spec}


def expected_derived(pod: dict[str, Any]) -> dict[str, str]:
    """What the mirror writes: computed by the contract package from the stored pod."""
    view = next(pod_views(pod))
    (plan,) = plan_pod(parse_pod(view))
    return derived_annotations(plan)


def start_running(env: AgentEnv, uid: str, slice_: Path, leaf: Path) -> None:
    """What the kubelet reports once the pod runs: container ID and QoS class."""
    env.kube.core.patch_namespaced_pod_status(
        name=pod_name(env, uid), namespace="default",
        body={"status": {"phase": "Running", "qosClass": "Burstable", "containerStatuses": [
            {"name": "main", "containerID": f"containerd://{CONTAINER_HEX}", "ready": False,
             "restartCount": 0, "image": "x", "imageID": "x"}]}})


def pod_name(env: AgentEnv, uid: str) -> str:
    for p in env.kube.core.list_namespaced_pod("default").items:
        if p.metadata.uid == uid:
            return p.metadata.name
    raise AssertionError(f"no pod {uid}")


def metric_lines(text: str, name: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(name + "{")]


def metric(text: str, name: str, labels: str) -> float | None:
    """The value of `name{labels}` in a scrape, None when the series is absent."""
    for line in text.splitlines():
        if line.startswith(f"{name}{labels} "):
            return float(line.rsplit(" ", 1)[1])
    return None


def ready(env: AgentEnv) -> bool:
    c = env.condition()
    return c is not None and c["status"] == "True"


def stub(env: AgentEnv) -> node_pb2_grpc.NodeEnforcerStub:
    channel = grpc.insecure_channel(f"unix:{env.socket}")
    return node_pb2_grpc.NodeEnforcerStub(channel)


# ---------------------------------------------------------------------------------------------


def test_end_to_end_mirrored_pod_applied_then_released(agent_env: AgentEnv) -> None:
    env = agent_env
    env.nvml.add_gpu(GPU0, memory_mib=H100_MIB)
    env.create_node()
    run = env.start("--publish-gpu-memory-label", "--legacy-condition")
    wait_for(lambda: ready(env), what="node condition True", run=run, timeout=20)
    cond = env.condition()
    assert cond is not None and cond["reason"] == "AgentReady"
    assert "sm-sharing through the MPS client env only" in cond["message"]
    legacy = env.condition("gpu-sharing.nvidia.com/Ready")
    assert legacy is not None and legacy["status"] == "True"
    wait_for(lambda: env.node_object()["metadata"]["labels"].get("nvidia.com/gpu.memory"),
             what="gpu memory label", run=run)
    assert env.node_object()["metadata"]["labels"]["nvidia.com/gpu.memory"] == "81559"

    # the mirror's work: binder keys and derived annotations, then the bind (nodeName)
    created = env.kube.core.create_namespaced_pod("default", pod_body("p", binder_keys(), None))
    uid = created.metadata.uid
    slice_, leaf = env.make_cgroups(uid, CONTAINER_HEX)
    stored = env.kube.get_object("v1/pods", "default", "p")
    assert stored is not None
    derived = expected_derived(stored)
    digest = derived["kai-fractions.io/container.main.plan-digest"]
    assert set(derived) == {
        "kai-fractions.io/container.main.memory-request-mib",
        "kai-fractions.io/container.main.memory-limit-mib",
        "kai-fractions.io/container.main.mps-pinned-mem-limit",
        "kai-fractions.io/container.main.plan-digest",
        "kai-fractions.io/container.main.mps-active-thread-percentage",
        "kai-fractions.io/container.main.mps-pipe-directory",
    }
    env.kube.core.patch_namespaced_pod("p", "default", {
        "metadata": {"annotations": derived}, "spec": {"nodeName": env.node}})
    start_running(env, uid, slice_, leaf)
    env.proc_entry(PID, f"/kubepods.slice/kubepods-burstable.slice/"
                        f"kubepods-burstable-pod{uid.replace('-', '_')}.slice/"
                        f"cri-containerd-{CONTAINER_HEX}.scope")
    env.nvml.add_process(0, PID, 2 * GIB, sm_util=40)

    marker = wait_for(lambda: env.marker(uid).exists() and env.marker(uid), run=run,
                      what="the readiness marker", timeout=15)
    body = json.loads(marker.read_text())
    assert body["version"] == 1 and body["pod_uid"] == uid
    assert body["boot_id"] == read_boot_id()  # this boot's: a reboot voids it
    assert body["containers"] == {"main": {
        "state": "applied", "plan_digest": digest, "reason": "Applied",
        # (no MPS namespaces: the pinned limit is set, but its tenants can change it)
        "message": "limits in force: memory cgroup,mps-pinned (tenants can change it),watchdog "
                   "(reports, stops nothing); compute mps-client-env"}}
    assert stat.S_IMODE(marker.stat().st_mode) == 0o644
    assert stat.S_IMODE(marker.parent.stat().st_mode) == 0o755
    assert stat.S_IMODE(env.marker_dir.stat().st_mode) == 0o700
    # already mirrored: the agent wrote no annotation of its own
    patches = [r for r in env.kube.requests("PATCH", "/api/v1/namespaces/default/pods/p")]
    assert len(patches) == 1  # the test's own

    # limits as the fake NVML recorded them: exact bytes and cgroup paths
    wait_for(lambda: (GPU0, str(leaf)) in env.nvml.limits(), run=run, what="leaf limit")
    limits = env.nvml.limits()
    assert {k: (v.soft, v.hard) for k, v in limits.items()} == {
        (GPU0, str(slice_)): (10 * GIB, 20 * GIB),
        (GPU0, str(leaf)): (10 * GIB, 20 * GIB),
    }
    assert [(c.uuid, c.args) for c in env.nvml.calls("SetComputeMode")] == [(GPU0, ("3",))]
    # MPS: the pinned limit read back from the real daemon, and the legacy pipe link
    answer = env.mps("get_default_device_pinned_mem_limit 0")
    assert answer.stdout.strip() == "20G"
    namespace = Path(derived["kai-fractions.io/container.main.mps-pipe-directory"]).name
    link = env.mps_pipe_dir / "shared" / namespace
    assert os.readlink(link) == "legacy"
    assert (link / "control").exists()  # resolves to the daemon's own pipe directory
    # ... which lies inside the server directory, all a container mounts
    assert env.mps_daemon_dir == env.mps_pipe_dir / "shared" / "legacy"

    applied = wait_for(lambda: [e for e in env.events(uid) if e["reason"] == "Applied"],
                       run=run, what="Applied event")
    assert len(applied) == 1 and applied[0]["type"] == "Normal"
    assert applied[0]["message"] == f"container main: GPU limits in force (plan {digest})"

    labels = (f'{{gpu="0",gpu_uuid="{GPU0}",namespace="default",pod="p",pod_uuid="{uid}"}}')
    ours = (f'{{container="main",gpu="0",gpu_uuid="{GPU0}",namespace="default",'
            f'node="{env.node}",pod="p",pod_uuid="{uid}"}}')
    text = wait_for(lambda: (t := run.metrics()) and metric(
        t, "gpu_fractioning_gpu_sm_utilization_percent", labels) == 40 and t,
        run=run, what="usage metrics")
    assert metric(text, "gpu_fractioning_gpu_memory_used_bytes", labels) == 2 * GIB
    # 40% of the GPU on a 20 GiB limit of an 81559 MiB GPU: 40 / (20480 / 81559) = 159.3,
    # clamped to 100 as upstream does
    assert metric(text, "gpu_fractioning_gpu_sm_utilization_percent_normalized", labels) == 100
    assert metric(text, "kai_fractions_container_gpu_memory_limit_bytes", ours) == 20 * GIB
    assert metric(text, "kai_fractions_container_gpu_sm_share_percent", ours) == 50
    assert metric(text, "kai_fractions_containers",
                  f'{{node="{env.node}",state="applied"}}') == 1
    assert (metric(text, "kai_fractions_reconcile_duration_seconds_count", "") or 0) >= 1

    # the node-local API over the root-only socket
    assert stat.S_IMODE(env.socket.stat().st_mode) == 0o600
    state = stub(env).GetNodeState(node_pb2.GetNodeStateRequest(), timeout=5)
    assert state.node_name == env.node and state.memory_limits_supported
    assert [(d.uuid, d.compute_mode) for d in state.devices] == [(GPU0, "ExclusiveProcess")]
    (alloc,) = state.allocations
    assert (alloc.pod.uid, alloc.container, alloc.state, alloc.plan_digest) == (
        uid, "main", node_pb2.ALLOCATION_STATE_APPLIED, digest)
    assert alloc.memory_used_bytes == 2 * GIB and alloc.active_thread_percentage == 50
    assert "not enforced by the daemon" in alloc.message
    assert "every sm-sharing tenant of the node can change" in alloc.message
    # the watchdog reports (the default policy): it is no limit in force; nor is the pinned
    # limit of a daemon without namespaces
    assert sorted((a.mechanism, a.cgroup_path) for a in alloc.applied_limits) == [
        ("cgroup", str(slice_)), ("cgroup", str(leaf))]
    assert state.condition.ready and state.condition.type == COND

    # delete: everything released, no stale series
    env.kube.core.delete_namespaced_pod("p", "default")
    wait_for(lambda: not env.marker(uid).parent.exists(), run=run, what="marker dir removed")
    wait_for(lambda: env.nvml.limits() == {}, run=run, what="limits cleared")
    # The pass that releases the limits removes the link after them: wait, do not race it.
    wait_for(lambda: not os.path.lexists(link), run=run, what="MPS namespace link removed")
    text = wait_for(lambda: (t := run.metrics()) and uid not in t and
                    not metric_lines(t, "kai_fractions_container_gpu_memory_limit_bytes") and t,
                    run=run, what="series removed")
    for name in ("gpu_fractioning_gpu_memory_used_bytes",
                 "kai_fractions_container_gpu_memory_used_bytes",
                 "gpu_fractioning_gpu_sm_utilization_percent",
                 "gpu_fractioning_gpu_sm_utilization_percent_normalized"):
        assert metric_lines(text, name) == []

    # SIGTERM: clean exit, condition says so, socket gone, the daemon it started stopped
    assert run.stop() == 0, run.log()
    cond = env.condition()
    assert cond is not None and (cond["status"], cond["reason"]) == ("False", "NotReconciling")
    assert not env.socket.exists()
    assert "Cannot find MPS control daemon" in (env.mps("get_server_list").stderr
                                                + env.mps("get_server_list").stdout)


def test_with_a_heartbeat_lease_the_agent_renews_it_and_the_mirror_reads_it(
        agent_env: AgentEnv) -> None:
    """`--heartbeat-lease-namespace`: the real process creates kai-fractions-agent.<node> in
    that namespace; the follower's silent-node check takes it for a heartbeat of its own when
    the condition's stands still (the agent then writes its Node every 5 min only)."""
    import asyncio
    import datetime

    from kubernetes import client as k8s

    from kai_fractions.kube.client import Kube
    from kai_fractions.mirror.node_liveness import NodeLiveness

    env = agent_env
    env.nvml.add_gpu(GPU0, memory_mib=H100_MIB)
    env.create_node()
    run = env.start("--heartbeat-lease-namespace", "kf", sm_sharing=False)
    wait_for(lambda: ready(env), what="node condition True", run=run, timeout=20)
    path = f"/apis/coordination.k8s.io/v1/namespaces/kf/leases/kai-fractions-agent.{env.node}"
    wait_for(lambda: env.kube.count("POST", "/apis/coordination.k8s.io/v1/namespaces/kf/leases"),
             what="the heartbeat Lease", run=run)

    async def checks(lease_namespace: str, times: tuple[float, ...]) -> list[bool]:
        """One mirror's checks of the node at these moments of its monotonic clock (the
        agent renews its Lease every 60 s of real time: not within this test's milliseconds)."""
        kube = Kube(k8s.ApiClient(env.kube.configuration()))
        now = [0.0]
        try:
            lease = await kube.request("GET", path, what="read the Lease")
            assert lease["spec"]["holderIdentity"] == env.node
            assert lease["spec"]["leaseDurationSeconds"] == 180
            liveness = NodeLiveness(kube, (COND,), stale_after_seconds=180,
                                    lease_namespace=lease_namespace,
                                    monotonic=lambda: now[0])
            out = []
            for t in times:
                now[0] = t
                out.append(await liveness.check(env.node))
            return out
        finally:
            await kube.close()

    # The condition's heartbeat an hour old by the agent's clock (the agent renews the Lease,
    # and leaves its Node alone for 5 min). The mirror trusts no other machine's clock: a
    # heartbeat is silent once the mirror has seen it stand still for 180 s. Without the Lease
    # that is at the second check; with it, the Lease the agent created is a heartbeat of its
    # own, read once the condition's stood still, and silent 180 s after that.
    hour_ago = (datetime.datetime.now(datetime.UTC) - datetime.timedelta(hours=1)).strftime(
        "%Y-%m-%dT%H:%M:%SZ")
    env.kube.core.patch_node_status(env.node, {"status": {"conditions": [
        {**env.condition(), "lastHeartbeatTime": hour_ago}]}})
    assert asyncio.run(checks("", (0, 180))) == [False, True]  # a mirror that reads no Lease
    assert env.condition()["status"] == "Unknown"
    env.kube.core.patch_node_status(env.node, {"status": {"conditions": [
        {**env.condition(), "status": "True"}]}})
    assert asyncio.run(checks("kf", (0, 180, 360))) == [False, False, True]
    assert env.condition()["status"] == "Unknown"
    assert run.stop() == 0


def test_follower_mode_agent_writes_derived_annotations_before_the_marker(
        agent_env: AgentEnv) -> None:
    env = agent_env
    env.nvml.add_gpu(GPU0, memory_mib=H100_MIB)
    env.create_node()
    run = env.start(sm_sharing=False)
    wait_for(lambda: ready(env), what="node condition True", run=run, timeout=20)
    created = env.kube.core.create_namespaced_pod(
        "default", pod_body("f", binder_keys("time-slicing"), env.node))
    uid = created.metadata.uid
    env.make_cgroups(uid, CONTAINER_HEX)
    start_running(env, uid, *env.make_cgroups(uid, CONTAINER_HEX))
    wait_for(lambda: env.marker(uid).exists(), run=run, what="marker", timeout=15)
    stored = env.kube.get_object("v1/pods", "default", "f")
    assert stored is not None
    want = expected_derived(stored)
    notes = stored["metadata"]["annotations"]
    assert {k: notes.get(k) for k in want} == want
    assert set(want) == {
        "kai-fractions.io/container.main.memory-request-mib",
        "kai-fractions.io/container.main.memory-limit-mib",
        "kai-fractions.io/container.main.mps-pinned-mem-limit",
        "kai-fractions.io/container.main.plan-digest"}
    assert notes["kai-fractions.io/container.main.memory-limit-mib"] == "20480"
    # one merge patch, guarded by the pod's uid
    (patch,) = [r for r in env.kube.requests("PATCH", "/api/v1/namespaces/default/pods/f")]
    assert patch.data["metadata"]["uid"] == uid
    assert patch.data["metadata"]["annotations"] == want
    body = json.loads(env.marker(uid).read_text())
    assert body["containers"]["main"]["plan_digest"] == want[
        "kai-fractions.io/container.main.plan-digest"]
    assert run.stop() == 0


def test_restart_between_limits_and_marker_converges_without_duplicates(
        agent_env: AgentEnv) -> None:
    env = agent_env
    env.nvml.add_gpu(GPU0, memory_mib=H100_MIB)
    env.create_node()
    created = env.kube.core.create_namespaced_pod(
        "default", pod_body("r", binder_keys("time-slicing"), env.node))
    uid = created.metadata.uid
    slice_, leaf = env.make_cgroups(uid, CONTAINER_HEX)
    start_running(env, uid, slice_, leaf)

    # The first agent dies (SIGKILL: no cleanup) after applying the pod's limits, before its
    # marker: the pod's marker directory is a plain file, so the write fails and is retried.
    # (Not the whole --marker-dir: the agent refuses to start on that.)
    env.marker_dir.mkdir()
    (env.marker_dir / uid).write_text("")
    first = env.start(sm_sharing=False)
    wait_for(lambda: "the readiness marker could not be written" in first.log(), run=first,
             what="the failed marker write", timeout=20)
    assert first.stop(signal.SIGKILL) == -signal.SIGKILL
    (env.marker_dir / uid).unlink()
    limits_after_crash = env.nvml.limits()
    assert {k: (v.soft, v.hard) for k, v in limits_after_crash.items()} == {
        (GPU0, str(slice_)): (10 * GIB, 20 * GIB), (GPU0, str(leaf)): (10 * GIB, 20 * GIB)}
    sets_after_crash = env.nvml.calls("SetMemoryLimits")
    assert len(sets_after_crash) == 2
    assert not env.marker(uid).exists()

    second = env.start(sm_sharing=False)
    wait_for(lambda: env.marker(uid).exists(), run=second, what="marker", timeout=20)
    wait_for(lambda: ready(env), run=second, what="condition True")
    assert env.nvml.calls("SetMemoryLimits") == sets_after_crash  # nothing rewritten
    assert env.nvml.limits() == limits_after_crash  # nothing leaked, nothing lost
    body = json.loads(env.marker(uid).read_text())
    stored = env.kube.get_object("v1/pods", "default", "r")
    assert stored is not None
    assert body["containers"]["main"]["plan_digest"] == stored["metadata"]["annotations"][
        "kai-fractions.io/container.main.plan-digest"]
    applied = [e for e in env.events(uid) if e["reason"] == "Applied"]
    assert len(applied) == 1
    assert second.stop() == 0


def test_nvml_broken_condition_false_and_no_marker_until_it_works(agent_env: AgentEnv) -> None:
    env = agent_env
    env.nvml.add_gpu(GPU0, memory_mib=H100_MIB)
    env.nvml.set_init_error(9)  # NVML_ERROR_DRIVER_NOT_LOADED
    env.create_node()
    created = env.kube.core.create_namespaced_pod(
        "default", pod_body("n", binder_keys("time-slicing"), env.node))
    uid = created.metadata.uid
    start_running(env, uid, *env.make_cgroups(uid, CONTAINER_HEX))
    run = env.start(sm_sharing=False)
    # published after the first pass over the listed pods (the new pod among them)
    cond = wait_for(lambda: (c := env.condition()) and c["status"] == "False" and c,
                    run=run, what="condition False", timeout=20)
    assert "listed 1 pods of node gpu-node-1 at resourceVersion" in run.log()
    assert cond["reason"] == "NVMLUnavailable"
    assert cond["message"] == (
        "NVML does not work on this node (NVMLUnavailable): NVML is installed but the NVIDIA "
        "kernel driver is not loaded: check `nvidia-smi` on the node and load the driver (the "
        "GPU may also be missing or unsupported)")
    state = stub(env).GetNodeState(node_pb2.GetNodeStateRequest(), timeout=5)
    assert not state.condition.ready and state.condition.reason == "NVMLUnavailable"
    assert list(state.allocations) == [] and list(state.devices) == []
    assert not env.marker(uid).exists()
    assert env.nvml.limits() == {} and env.nvml.calls("SetMemoryLimits") == []
    stored = env.kube.get_object("v1/pods", "default", "n")
    assert stored is not None and not any(
        k.startswith("kai-fractions.io/") for k in stored["metadata"]["annotations"])

    env.nvml.set_init_error(None)  # the driver comes back
    wait_for(lambda: env.marker(uid).exists(), run=run, what="marker after recovery", timeout=20)
    wait_for(lambda: ready(env), run=run, what="condition True after recovery")
    assert run.stop() == 0


def test_bad_flags_exit_2(agent_env: AgentEnv) -> None:
    run = agent_env.start("--memory-enforcement=cgroup,magic")
    assert run.proc.wait(20) == 2
    assert ("kai-fractions node-agent: --memory-enforcement: unknown mechanism 'magic'; known: "
            "cgroup, mps-pinned, watchdog") in run.log()
