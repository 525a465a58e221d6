"""The demo's pure parts: placement, the example pods, the downward-API file, the config."""

from __future__ import annotations

from pathlib import Path

import pytest

from kai_fractions.contract import ComputeMode, Dialect
from kai_fractions.demo.config import DemoConfig, DemoConfigError, config_from_dict, load_config
from kai_fractions.demo.kubelet import container_id, downward_annotations
from kai_fractions.demo.scheduler import Ask, GpuSlot, Placer
from kai_fractions.demo.workloads import WorkloadError, load_examples, pod_of
from kai_fractions.gate import parse_annotations

from .expected import EXAMPLES

TS, SM = ComputeMode.TIME_SLICING, ComputeMode.SM_SHARING


def test_placer_fills_in_index_order_one_mode_per_gpu():
    placer = Placer([GpuSlot(0, "GPU-a", 100), GpuSlot(1, "GPU-b", 100)])
    assert [g.index for g in placer.place(Ask("ns/a", TS, 60))] == [0]
    assert [g.index for g in placer.place(Ask("ns/b", TS, 40))] == [0]
    assert [g.index for g in placer.place(Ask("ns/c", SM, 10))] == [1]
    assert placer.place(Ask("ns/d", TS, 1)) == (
        "0/2 GPUs fit ns/d: it needs 1 GPU(s) with 1 MiB free that run time-slicing or nothing "
        "yet, 0 found (GPU 0: 0 MiB free, time-slicing; GPU 1: 90 MiB free, sm-sharing); one "
        "GPU runs one compute mode")
    assert [g.index for g in placer.place(Ask("ns/e", SM, 90))] == [1]
    assert placer.used == {"GPU-a": 100, "GPU-b": 100}


def test_placer_multi_device():
    placer = Placer([GpuSlot(i, f"GPU-{i}", 100) for i in range(3)])
    placer.place(Ask("ns/a", SM, 10))
    assert [g.index for g in placer.place(Ask("ns/b", TS, 50, count=2))] == [1, 2]
    assert isinstance(placer.place(Ask("ns/c", TS, 60, count=2)), str)


def test_example_pods():
    pods = load_examples(EXAMPLES, "team-x")
    assert [(p.namespace, p.name, p.source) for p in pods] == [
        ("team-x", "gpu-fraction-with-limit", "gpu-fraction-with-limit.yaml"),
        ("team-x", "llm-inference-0", "inference-deployment.yaml (Deployment llm-inference)"),
        ("team-x", "embeddings-batch-0", "job.yaml (Job embeddings-batch)"),
        ("team-x", "memory-request", "memory-request.yaml"),
        ("team-x", "multi-device-fraction", "multi-device-fraction.yaml"),
        ("team-x", "request-and-limit", "request-and-limit.yaml"),
        ("team-x", "sm-sharing", "sm-sharing.yaml"),
    ]
    llm = pods[1].manifest
    assert llm["metadata"]["annotations"] == {
        "nvidia.com/container.vllm.gpu-memory.request": "20Gi",
        "nvidia.com/container.vllm.gpu-memory.limit": "24Gi"}
    assert llm["spec"]["containers"][0]["name"] == "vllm"


def test_cronjob_template_and_kinds_without_pods():
    cron = {"kind": "CronJob", "metadata": {"name": "nightly"}, "spec": {"jobTemplate": {
        "spec": {"template": {"metadata": {"labels": {"a": "b"}},
                              "spec": {"containers": [{"name": "c"}]}}}}}}
    pod, note = pod_of(cron, "default")
    assert (pod["metadata"], note) == ({"labels": {"a": "b"}, "name": "nightly-0",
                                        "namespace": "default"}, "CronJob nightly")
    assert pod_of({"kind": "Queue", "metadata": {"name": "q"}}, "default") is None


def test_example_errors(tmp_path: Path):
    with pytest.raises(WorkloadError, match="no such directory"):
        load_examples(tmp_path / "none")
    (tmp_path / "a.yaml").write_text("kind: Pod\nmetadata: {name: x}\n---\n"
                                     "kind: Pod\nmetadata: {name: x}\n")
    with pytest.raises(WorkloadError, match="more than one pod named default/x"):
        load_examples(tmp_path)


def test_downward_file_reads_back_through_the_gate():
    annotations = {"b": 'quote " and \\ backslash', "a": "line\nbreak\ttab", "c": "ünïcode"}
    text = downward_annotations(annotations)
    assert text.splitlines()[0] == 'a="line\\nbreak\\ttab"'
    assert parse_annotations(text) == annotations


def test_container_ids_are_stable_and_well_formed():
    cid = container_id("uid-1", "main")
    assert cid == container_id("uid-1", "main") != container_id("uid-1", "other")
    assert cid.startswith("containerd://") and len(cid) == len("containerd://") + 64


def test_config_defaults_and_reserve():
    # Upstream KAI main subtracts no reserve; an explicit one simulates a patched KAI.
    assert (DemoConfig().mirror_reserve_mib, DemoConfig().dialect) == (0, Dialect.UPSTREAM)
    assert config_from_dict({"sm_sharing": False}).mirror_reserve_mib == 0
    patched = config_from_dict({"reserve_mib": 1024})
    assert (patched.mirror_reserve_mib, patched.dialect) == (1024, Dialect.PATCHED)
    nvml = config_from_dict({"gpus": [{"model": "A100-40GB", "count": 3}]}).nvml()
    assert [g.name for g in nvml.gpus] == ["NVIDIA A100-SXM4-40GB"] * 3


def test_config_file(tmp_path: Path):
    path = tmp_path / "demo.yaml"
    path.write_text("node: gpu-7\nexamples: manifests\nmemory_enforcement: [cgroup]\n")
    config = load_config(path)
    assert (config.node, config.examples, config.memory_enforcement) == (
        "gpu-7", tmp_path / "manifests", "cgroup")
    path.write_text("node: [1\n")
    with pytest.raises(DemoConfigError, match=f"^{path}: not valid YAML: "):
        load_config(path)
    path.write_bytes(b"node: \xff\xfe\n")  # not text: an error naming the file, no traceback
    with pytest.raises(DemoConfigError, match=f"^{path}: cannot read: not UTF-8 text"):
        load_config(path)


@pytest.mark.parametrize("data, error", [
    ({"node": "Demo_Node"}, "node: must be a lower-case DNS name, got 'Demo_Node'"),
    ({"sm_sharing": "yes"}, "sm_sharing: must be true or false, got 'yes'"),
    ({"reserve_mib": -1}, "reserve_mib: must be a whole number of MiB >= 0, got -1"),
    ({"memory_enforcement": "cgroup,magic"},
     "memory_enforcement: --memory-enforcement: unknown mechanism 'magic'; known: cgroup, "
     "mps-pinned, watchdog"),
    ([1], "the config must be a mapping of the keys node, gpus, driver_version, sm_sharing, "
          "memory_enforcement, reserve_mib, namespace, examples"),
])
def test_config_errors(data, error):
    with pytest.raises(DemoConfigError) as e:
        config_from_dict(data)
    assert str(e.value) == error


@pytest.mark.parametrize(("driver", "limits"), [("550.54.15", False), ("535.104.05", False),
                                                ("615.00.00", True), ("620.10.01", True)])
def test_the_simulated_gpus_follow_the_simulated_driver(driver, limits):
    from kai_fractions.node.errors import NvmlFunctionNotFound

    nvml = config_from_dict({"driver_version": driver}).nvml()
    nvml.init()
    gpu = nvml.gpus[0].uuid
    assert nvml.memory_limits_supported() is limits
    if limits:
        nvml.set_memory_limits(gpu, "/pod", 1, 2)
    else:
        with pytest.raises(NvmlFunctionNotFound, match="nvmlDeviceSetMemoryLimits_v1"):
            nvml.set_memory_limits(gpu, "/pod", 1, 2)


def test_an_allocation_over_a_cgroup_hard_limit_fails_and_changes_nothing():
    from kai_fractions.sim.nvml import FakeNvml, GpuOutOfMemory

    mib = 1024 * 1024
    nvml = FakeNvml.simulated(1)
    nvml.init()
    gpu = nvml.gpus[0].uuid
    nvml.add_process(7, gpu, 6 * mib, cgroup="/pod/c1")
    nvml.add_process(8, gpu, 1 * mib, cgroup="/pod/c2")
    nvml.set_memory_limits(gpu, "/pod", 0, 10 * mib)
    nvml.allocate(7, gpu, 3 * mib)  # 10 MiB in the pod: at the limit, not over it
    with pytest.raises(GpuOutOfMemory) as e:
        nvml.allocate(7, gpu, 1)
    assert (e.value.cgroup, e.value.hard, e.value.used) == ("/pod", 10 * mib, 10 * mib)
    assert [p.used_bytes for p in nvml.processes] == [9 * mib, 1 * mib]
