"""Acceptance: the engine through the REAL pynvml bindings and the project's fake
libnvidia-ml.so.1. The fake records every nvmlDeviceSetMemoryLimits_v1 call, so these tests pin
the exact bytes and cgroup paths the driver would receive, for both kubelet cgroup layouts."""

from __future__ import annotations

from pathlib import Path

import pynvml
import pytest

from kai_fractions.node.cgroups import HostCgroupFs
from kai_fractions.node.config import Mechanism, NodeConfig, WatchdogPolicy
from kai_fractions.node.desired import NodePod, plan_node
from kai_fractions.node.engine import ContainerState, Engine
from kai_fractions.node.inventory import take_inventory
from kai_fractions.node.nvml import MEMORY_LIMIT_MAX, PynvmlNvml
from kai_fractions.sim.mps import FakeMpsControl

from .nodepods import CID_A, CID_B, GPU0, GPU1, UID_A, UID_B, annotations, make_cgroups, node_pod

MAX = str(MEMORY_LIMIT_MAX)
G10, G20, G4, G8 = (str(n << 30) for n in (10, 20, 4, 8))


def pods() -> tuple[NodePod, NodePod]:
    a = node_pod(UID_A, name="a", notes=annotations(mode="sm-sharing", portion="0.5"),
                 container_ids={"main": CID_A})
    b = node_pod(UID_B, name="b", qos="Guaranteed", container_ids={"main": CID_B},
                 notes=annotations(mode="time-slicing", devices=(GPU1,), request="4Gi",
                                   limit="8Gi"))
    return a, b


class Agentish:
    """What the agent will do: PynvmlNvml + Engine over a temp cgroup root (fresh each time,
    like a restarted process; the fake library keeps the GPU's state in its state file)."""

    def __init__(self, root: Path, mps: FakeMpsControl, **config):
        self.config = NodeConfig(node_name="node-a", cgroup_root=str(root), **config)
        self.nvml = PynvmlNvml()
        self.nvml.init()
        self.mps = mps
        self.engine = Engine(self.nvml, HostCgroupFs(), mps, config=self.config)

    def apply(self, *node_pods: NodePod, marked: tuple[str, ...] = ()):
        inv = take_inventory(self.nvml, mps_namespaces=self.mps.supports_protocol_v3())
        return self.engine.apply(plan_node(node_pods, inv, self.config, marked=marked))

    def close(self) -> None:
        self.nvml.shutdown()


@pytest.fixture
def gpus(fake_nvml):
    fake_nvml.add_gpu(GPU0, memory_mib=81559)
    fake_nvml.add_gpu(GPU1, memory_mib=81559)
    return fake_nvml


def set_calls(fake) -> list[tuple[str, str, str, str, int]]:
    return [(c.uuid, *c.args, c.rc) for c in fake.calls("SetMemoryLimits")]


@pytest.mark.parametrize("driver", ["systemd", "cgroupfs"])
def test_limits_reach_nvml_with_exact_bytes_and_paths(tmp_path: Path, gpus, driver) -> None:
    root = tmp_path / "cg"
    agent = Agentish(root, FakeMpsControl(), cgroup_driver=driver)
    a, b = pods()
    make_cgroups(root, agent.config.layout, [a, b])
    if driver == "systemd":
        slice_a = (f"{root}/kubepods.slice/kubepods-burstable.slice/"
                   "kubepods-burstable-pod0a1b2c3d_0000_4000_8000_00000000000a.slice")
        leaf_a = f"{slice_a}/cri-containerd-{'a' * 64}.scope"
        slice_b = f"{root}/kubepods.slice/kubepods-pod0a1b2c3d_0000_4000_8000_00000000000b.slice"
        leaf_b = f"{slice_b}/cri-containerd-{'b' * 64}.scope"
    else:
        slice_a = f"{root}/kubepods/burstable/pod{UID_A}"
        leaf_a = f"{slice_a}/{'a' * 64}"
        slice_b = f"{root}/kubepods/pod{UID_B}"
        leaf_b = f"{slice_b}/{'b' * 64}"
    try:
        report = agent.apply(a, b)
        assert {r.state for r in report.containers.values()} == {ContainerState.APPLIED}
        assert set_calls(gpus) == [
            (GPU0, slice_a, G10, G20, 0),
            (GPU1, slice_b, G4, G8, 0),
            (GPU0, leaf_a, G10, G20, 0),
            (GPU1, leaf_b, G4, G8, 0),
        ]
        assert [(c.uuid, c.args) for c in gpus.calls("SetComputeMode")] == [(GPU0, ("3",))]
        # the second apply only reads
        assert agent.apply(a, b).writes == ()
        assert len(gpus.calls("SetMemoryLimits")) == 4
        assert len(gpus.calls("SetComputeMode")) == 1
    finally:
        agent.close()


def test_release_clears_through_nvml(tmp_path: Path, gpus) -> None:
    root = tmp_path / "cg"
    agent = Agentish(root, FakeMpsControl())
    a, b = pods()
    make_cgroups(root, agent.config.layout, [a, b])
    try:
        agent.apply(a, b)
        report = agent.engine.release(UID_A)
        slice_a = (f"{root}/kubepods.slice/kubepods-burstable.slice/"
                   "kubepods-burstable-pod0a1b2c3d_0000_4000_8000_00000000000a.slice")
        assert sorted(set_calls(gpus)[4:]) == sorted([
            (GPU0, slice_a, "0", MAX, 0),
            (GPU0, f"{slice_a}/cri-containerd-{'a' * 64}.scope", "0", MAX, 0)])
        assert report.complete
        assert {ns for (_u, ns) in gpus.limits()} == {
            f"{root}/kubepods.slice/kubepods-pod0a1b2c3d_0000_4000_8000_00000000000b.slice",
            f"{root}/kubepods.slice/kubepods-pod0a1b2c3d_0000_4000_8000_00000000000b.slice/"
            f"cri-containerd-{'b' * 64}.scope"}
    finally:
        agent.close()


def test_restart_clears_stale_limits_of_vanished_pods(tmp_path: Path, gpus) -> None:
    root = tmp_path / "cg"
    mps = FakeMpsControl()
    first = Agentish(root, mps)
    a, b = pods()
    make_cgroups(root, first.config.layout, [a, b])
    first.apply(a, b)
    first.close()
    # a new agent process: pod b was deleted while no agent ran (its cgroup and its marker
    # linger)
    second = Agentish(root, mps)
    try:
        report = second.apply(a, marked=(UID_A, UID_B))
        assert report.containers[(UID_A, "main")].state is ContainerState.APPLIED
        slice_b = f"{root}/kubepods.slice/kubepods-pod0a1b2c3d_0000_4000_8000_00000000000b.slice"
        assert sorted(set_calls(gpus)[4:]) == sorted([
            (GPU1, slice_b, "0", MAX, 0),
            (GPU1, f"{slice_b}/cri-containerd-{'b' * 64}.scope", "0", MAX, 0)])
        assert all(uuid == GPU0 for uuid, _ns in gpus.limits())
        assert second.apply(a).writes == ()
    finally:
        second.close()


def test_injected_nvml_error_mid_apply_then_convergence(tmp_path: Path, gpus) -> None:
    root = tmp_path / "cg"
    agent = Agentish(root, FakeMpsControl())
    a, b = pods()
    make_cgroups(root, agent.config.layout, [a, b])
    gpus.inject_error("nvmlDeviceSetMemoryLimits_v1", pynvml.NVML_ERROR_UNKNOWN, times=1)
    try:
        report = agent.apply(a, b)
        ra, rb = report.containers[(UID_A, "main")], report.containers[(UID_B, "main")]
        # read back without it, and not set: known not in force, NVML's error in the message
        assert ra.state is ContainerState.PENDING and ra.reason == "MemoryLimitNotInForce"
        assert ra.limit_missing
        assert "(NVMLError: NVML nvmlDeviceSetMemoryLimits_v1 failed on GPU " + GPU0 \
            in ra.message
        assert rb.state is ContainerState.APPLIED
        assert set_calls(gpus)[0][-1] == pynvml.NVML_ERROR_UNKNOWN  # the failed call, logged
        report = agent.apply(a, b)
        assert report.containers[(UID_A, "main")].state is ContainerState.APPLIED
        assert [w.gpu_uuid for w in report.writes] == [GPU0]
        assert agent.apply(a, b).writes == ()
    finally:
        agent.close()


def test_old_driver_falls_back_or_refuses(tmp_path: Path, fake_nvml_old_driver) -> None:
    fake = fake_nvml_old_driver
    fake.set_driver_version("535.104.05")
    fake.add_gpu(GPU0)
    fake.add_gpu(GPU1)
    root = tmp_path / "cg"
    a, b = pods()
    mps = FakeMpsControl(protocol_v3=False)
    # the time-slicing container (b) only has the watchdog: one that stops what exceeds its
    # cap (kill); a report one caps nothing and is refused (tests/node/test_engine.py)
    agent = Agentish(root, mps, watchdog_policy=WatchdogPolicy.KILL)
    make_cgroups(root, agent.config.layout, [a, b])
    try:
        report = agent.apply(a, b)
        ra, rb = report.containers[(UID_A, "main")], report.containers[(UID_B, "main")]
        assert ra.state is ContainerState.APPLIED and rb.state is ContainerState.APPLIED
        assert ra.mechanisms == {Mechanism.MPS_PINNED, Mechanism.WATCHDOG}
        assert rb.mechanisms == {Mechanism.WATCHDOG}
        assert mps.default_pinned_mib == {0: 20480}
        assert fake.calls("SetMemoryLimits") == []
    finally:
        agent.close()
    strict = Agentish(root, FakeMpsControl(protocol_v3=False), memory_enforcement="cgroup")
    try:
        report = strict.apply(a, b)
        for uid in (UID_A, UID_B):
            r = report.containers[(uid, "main")]
            assert (r.state, r.reason) == (ContainerState.REFUSED, "MemoryLimitsUnsupported")
            assert "NVIDIA driver 535.104.05 has no cgroup GPU memory limits" in r.message
        assert fake.calls("SetMemoryLimits") == []
    finally:
        strict.close()
