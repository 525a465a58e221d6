"""An sm-sharing container whose GPU reads back a compute mode other than EXCLUSIVE_PROCESS, and
whose set fails, is known not in force: in DEFAULT mode a process that leaves MPS (no
CUDA_MPS_PIPE_DIRECTORY) opens a context of its own, outside the namespace's active-thread cap
and the pinned limit. It is pending `ComputeModeNotInForce` (`mps_cap_missing`, so no marker
vouches for it) until the mode is set or read back in force, whatever a later pass fails at
first. A time-slicing GPU left in EXCLUSIVE_PROCESS only keeps a second process from starting:
a plain pending, nothing known out of force."""

from __future__ import annotations

from pathlib import Path

from kai_fractions.node import engine
from kai_fractions.node.engine import ContainerState
from kai_fractions.node.nvml import GpuComputeMode

from .nodepods import GPU0, GPU1
from .test_engine import UID_A, UID_B, Node, sm_pod, ts_pod

COMPUTE_MODE_NOT_IN_FORCE = "ComputeModeNotInForce"
"""kai_fractions.node.engine_reports.COMPUTE_MODE_NOT_IN_FORCE, as GetNodeState's readers see it."""


def _reset_behind_the_agent(node: Node) -> None:
    """The sm-sharing pod is applied (GPU 0 in EXCLUSIVE_PROCESS); then its GPU is put back in
    DEFAULT (nvidia-smi -c 0, a GPU reset) and every set of the agent's fails."""
    assert node.apply(sm_pod()).converged
    assert node.nvml.gpu(GPU0).compute_mode is GpuComputeMode.EXCLUSIVE_PROCESS
    node.nvml.gpu(GPU0).compute_mode = GpuComputeMode.DEFAULT
    node.nvml.fail("set_compute_mode", "NoPermission", times=None)


def test_an_sm_gpu_read_back_default_whose_set_fails_is_not_in_force(tmp_path: Path) -> None:
    node = Node(tmp_path / "cgroup")
    _reset_behind_the_agent(node)
    for _ in range(2):  # every pass that reads it back so
        report = node.apply(sm_pod())
        r = report.containers[(UID_A, "main")]
        assert (r.state, r.reason, r.mps_cap_missing, r.not_in_force) == (
            ContainerState.PENDING, COMPUTE_MODE_NOT_IN_FORCE, True, True)
        assert r.message.startswith(
            f"GPU {GPU0} reads back compute mode DEFAULT, not the EXCLUSIVE_PROCESS sm-sharing "
            "needs, and could not be set (NVMLNoPermission: NVML refused "
            f"nvmlDeviceSetComputeMode on GPU {GPU0}"), r.message
        assert r.message.endswith(f"run nvidia-smi -i {GPU0} -c EXCLUSIVE_PROCESS")
        (g0, _g1) = report.gpus
        assert (g0.compute_mode, g0.error is not None) == (GpuComputeMode.DEFAULT, True)
    assert COMPUTE_MODE_NOT_IN_FORCE in engine.NOT_IN_FORCE_REASONS


def test_a_new_pod_on_a_gpu_whose_mode_cannot_be_set_is_not_in_force_either(
        tmp_path: Path) -> None:
    node = Node(tmp_path / "cgroup")
    node.nvml.fail("set_compute_mode", "NoPermission", times=None)
    r = node.apply(sm_pod()).containers[(UID_A, "main")]
    assert (r.reason, r.not_in_force) == (COMPUTE_MODE_NOT_IN_FORCE, True)


def test_the_knowledge_outlasts_a_pass_that_cannot_read_the_mode(tmp_path: Path) -> None:
    """Known until a set succeeds: a pass with NVML down still reports it (its own failure in
    the message), so no marker is vouched for again on a read that proved nothing; the pass
    whose set succeeds applies the container."""
    node = Node(tmp_path / "cgroup")
    _reset_behind_the_agent(node)
    node.apply(sm_pod())
    desired = node.desired(sm_pod())
    node.nvml.clear_failures()
    node.nvml.fail("devices", "DriverNotLoaded", times=1)
    r = node.engine.apply(desired).containers[(UID_A, "main")]
    assert (r.state, r.reason, r.not_in_force) == (ContainerState.PENDING,
                                                   COMPUTE_MODE_NOT_IN_FORCE, True)
    assert r.message.startswith(
        f"GPU {GPU0} was read back compute mode DEFAULT, not the EXCLUSIVE_PROCESS sm-sharing "
        "needs, and could not be set (NVMLNoPermission) and is not known set since (this pass: "
        "NVMLUnavailable: "), r.message
    report = node.apply(sm_pod())
    assert report.converged
    assert report.compute_modes_set == ((GPU0, GpuComputeMode.EXCLUSIVE_PROCESS),)
    assert report.containers[(UID_A, "main")].state is ContainerState.APPLIED


def test_a_mode_read_back_in_force_ends_it(tmp_path: Path) -> None:
    """Set by someone else (an operator's nvidia-smi) while the agent's sets still fail: read
    back in force, nothing to set, applied."""
    node = Node(tmp_path / "cgroup")
    _reset_behind_the_agent(node)
    assert node.apply(sm_pod()).containers[(UID_A, "main")].not_in_force
    node.nvml.gpu(GPU0).compute_mode = GpuComputeMode.EXCLUSIVE_PROCESS
    report = node.apply(sm_pod())
    assert report.converged and report.compute_modes_set == ()
    desired = node.desired(sm_pod())
    node.nvml.fail("devices", "DriverNotLoaded", times=1)  # nothing known missing any more
    r = node.engine.apply(desired).containers[(UID_A, "main")]
    assert (r.reason, r.not_in_force) == ("NVMLUnavailable", False)


def test_it_is_forgotten_once_no_plan_needs_the_mode(tmp_path: Path) -> None:
    node = Node(tmp_path / "cgroup")
    _reset_behind_the_agent(node)
    assert node.apply(sm_pod()).containers[(UID_A, "main")].not_in_force
    node.apply()  # the pod went
    desired = node.desired(sm_pod())
    node.nvml.fail("devices", "DriverNotLoaded", times=1)
    r = node.engine.apply(desired).containers[(UID_A, "main")]
    assert (r.reason, r.not_in_force) == ("NVMLUnavailable", False)


def test_a_time_slicing_gpu_left_exclusive_is_only_pending(tmp_path: Path) -> None:
    """EXCLUSIVE_PROCESS on a time-slicing GPU keeps a second process from starting; no cap of
    the container is escaped there, so its marker may stay (a plain pending)."""
    node = Node(tmp_path / "cgroup")
    assert node.apply(ts_pod()).converged
    node.nvml.gpu(GPU1).compute_mode = GpuComputeMode.EXCLUSIVE_PROCESS  # ts_pod()'s GPU
    node.nvml.fail("set_compute_mode", "NoPermission", times=None)
    r = node.apply(ts_pod()).containers[(UID_B, "main")]
    assert (r.state, r.reason, r.mps_cap_missing, r.not_in_force) == (
        ContainerState.PENDING, "NVMLNoPermission", False, False)
