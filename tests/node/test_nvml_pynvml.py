"""PynvmlNvml: the REAL pynvml bindings against the project's fake libnvidia-ml.so.1."""

from __future__ import annotations

import pynvml
import pytest

from kai_fractions.node import errors as node_errors
from kai_fractions.node.desired import LimitTarget
from kai_fractions.node.errors import (
    NvmlDriverNotLoaded,
    NvmlError,
    NvmlFunctionNotFound,
    NvmlGpuLost,
    NvmlLibraryNotFound,
    NvmlNoPermission,
    NvmlNotFound,
    NvmlUnknown,
)
from kai_fractions.node.memory_limits import MemoryLimitEnforcer
from kai_fractions.node.nvml import (
    MEMORY_LIMIT_MAX,
    DeviceInfo,
    GpuComputeMode,
    GpuProcess,
    MemoryLimits,
    Nvml,
    PynvmlNvml,
)
from tests.support.fake_nvml import MemoryLimit

MIB = 1 << 20
GIB = 1 << 30
U0 = "GPU-00000000-0000-0000-0000-000000000001"
U1 = "GPU-00000000-0000-0000-0000-000000000002"
SLICE = ("/sys/fs/cgroup/kubepods.slice/kubepods-burstable.slice/"
         "kubepods-burstable-pod0a1b2c3d_0000_4000_8000_00000000000a.slice")


@pytest.fixture
def nvml(fake_nvml):
    fake_nvml.add_gpu(U0, memory_mib=81559)
    fake_nvml.add_gpu(U1, memory_mib=40960, name="NVIDIA A100-SXM4-40GB", compute_mode=3)
    n = PynvmlNvml()
    n.init()
    yield n
    n.shutdown()


def test_inventory_through_the_real_bindings(nvml, fake_nvml) -> None:
    fake_nvml.add_process(0, 4242, 3 * GIB)
    assert isinstance(nvml, Nvml)
    assert nvml.driver_version() == "615.48.02"
    assert nvml.devices() == (
        DeviceInfo(0, U0, "NVIDIA H100 80GB HBM3", 81559 * MIB, 3 * GIB, GpuComputeMode.DEFAULT,
                   False),
        DeviceInfo(1, U1, "NVIDIA A100-SXM4-40GB", 40960 * MIB, 0,
                   GpuComputeMode.EXCLUSIVE_PROCESS, False),
    )
    assert nvml.memory_limits_supported()


def test_processes_and_utilisation(nvml, fake_nvml) -> None:
    fake_nvml.add_process(0, 10, 2 * GIB, sm_util=40, mem_util=5)
    fake_nvml.add_process(0, 11, None)
    assert nvml.running_processes(U0) == (GpuProcess(10, 2 * GIB), GpuProcess(11, None))
    assert nvml.running_processes(U1) == ()
    (u,) = nvml.process_utilization(U0)
    assert (u.pid, u.sm_percent, u.memory_percent) == (10, 40, 5) and u.timestamp_us > 0
    assert nvml.process_utilization(U1) == ()  # "no samples" is not an error


def test_set_get_clear_limits_reach_the_library(nvml, fake_nvml) -> None:
    nvml.set_memory_limits(U0, SLICE, 10 * GIB, 20 * GIB)
    assert [(c.uuid, c.args, c.rc) for c in fake_nvml.calls("SetMemoryLimits")] == [
        (U0, (SLICE, str(10 * GIB), str(20 * GIB)), 0)]
    assert nvml.get_memory_limits(U0, SLICE) == MemoryLimits(10 * GIB, 20 * GIB, 0)
    assert nvml.get_memory_limits(U1, SLICE) == MemoryLimits(0, MEMORY_LIMIT_MAX, 0)
    fake_nvml.add_process(0, 77, GIB, cgroup=SLICE + "/cri-containerd-x.scope")
    assert nvml.get_memory_limits(U0, SLICE).current_used == GIB
    nvml.clear_memory_limits(U0, SLICE)
    assert fake_nvml.calls("SetMemoryLimits")[-1].args == (SLICE, "0", str(MEMORY_LIMIT_MAX))
    assert fake_nvml.limits() == {}
    assert nvml.get_memory_limits(U0, SLICE).cleared


def test_a_cgroup_never_limited_reads_as_no_limit(nvml, fake_nvml) -> None:
    """nvml.h answers NVML_ERROR_NOT_FOUND "if the limits were not found for this device and
    cgroup": a new pod's cgroup. That is no limit in force, so the first write goes ahead."""
    assert nvml.get_memory_limits(U0, SLICE) == MemoryLimits(0, MEMORY_LIMIT_MAX, 0)
    target = LimitTarget(U0, SLICE, GIB, 2 * GIB, "uid", None)
    assert MemoryLimitEnforcer(nvml).ensure(target) is not None
    assert fake_nvml.limits() == {(U0, SLICE): MemoryLimit(GIB, 2 * GIB)}
    with pytest.raises(NvmlNotFound) as e:  # an unknown GPU is still an error
        nvml.get_memory_limits("GPU-ffffffff-0000-0000-0000-000000000000", SLICE)
    assert e.value.reason == "GPUNotFound"


@pytest.mark.parametrize(("soft", "hard"), [(0, MEMORY_LIMIT_MAX + 1), (-1, GIB), (2 * GIB, GIB)])
def test_limits_outside_the_field_are_never_written(nvml, fake_nvml, soft, hard) -> None:
    """ctypes stores 2^64 + n as n: a write of it would put another cap in force."""
    with pytest.raises(NvmlUnknown, match="must satisfy 0 <= soft <= hard <= "):
        nvml.set_memory_limits(U0, SLICE, soft, hard)
    assert fake_nvml.calls("SetMemoryLimits") == []


def test_the_fake_library_refuses_a_limit_above_the_device(nvml, fake_nvml) -> None:
    """nvml.h, SetMemoryLimits: INVALID_ARGUMENT if "a limit exceeds total device memory";
    NVML_DEVICE_MEMORY_LIMIT_MAX itself means no limit."""
    total = 81559 * MIB
    with pytest.raises(NvmlUnknown, match="Invalid Argument"):
        nvml.set_memory_limits(U0, SLICE, GIB, total + 1)
    nvml.set_memory_limits(U0, SLICE, GIB, total)
    nvml.clear_memory_limits(U0, SLICE)


def test_compute_mode_set(nvml, fake_nvml) -> None:
    nvml.set_compute_mode(U0, GpuComputeMode.EXCLUSIVE_PROCESS)
    assert fake_nvml.compute_modes() == {U0: 3}
    assert nvml.devices()[0].compute_mode is GpuComputeMode.EXCLUSIVE_PROCESS


def test_old_driver_lacks_the_memory_limit_functions(fake_nvml_old_driver) -> None:
    fake_nvml_old_driver.set_driver_version("535.104.05")
    fake_nvml_old_driver.add_gpu(U0)
    nvml = PynvmlNvml()
    nvml.init()
    try:
        assert nvml.driver_version() == "535.104.05"
        assert not nvml.memory_limits_supported()
        with pytest.raises(NvmlFunctionNotFound) as e:
            nvml.set_memory_limits(U0, SLICE, 1, 2)
        assert e.value.reason == "DriverTooOld"
        assert "need NVIDIA driver r615 or newer" in e.value.message
        with pytest.raises(NvmlFunctionNotFound):
            nvml.get_memory_limits(U0, SLICE)
        assert len(nvml.devices()) == 1  # everything else still works
    finally:
        nvml.shutdown()


def test_library_path_switches_between_fake_builds(fake_nvml) -> None:
    fake_nvml.add_gpu(U0)
    old = PynvmlNvml(str(fake_nvml.library_path("old-driver")))
    old.init()
    assert not old.memory_limits_supported()
    old.shutdown()
    full = PynvmlNvml(str(fake_nvml.library_path("full")))
    full.init()
    assert full.memory_limits_supported()
    full.shutdown()


def test_missing_library(tmp_path) -> None:
    nvml = PynvmlNvml(str(tmp_path / "libnvidia-ml.so.1"))
    with pytest.raises(NvmlLibraryNotFound) as e:
        nvml.init()
    assert e.value.reason == "NVMLUnavailable"
    assert e.value.message == (
        f"the NVML library (libnvidia-ml.so.1) could not be loaded from "
        f"{tmp_path / 'libnvidia-ml.so.1'}: install the NVIDIA driver on this node, or point "
        "--nvml-library at libnvidia-ml.so.1")


def test_driver_not_loaded(fake_nvml) -> None:
    fake_nvml.set_init_error(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    with pytest.raises(NvmlDriverNotLoaded) as e:
        PynvmlNvml().init()
    assert e.value.reason == "NVMLUnavailable"
    assert "kernel driver is not loaded" in e.value.message


def test_injected_errors_map_to_types(nvml, fake_nvml) -> None:
    fake_nvml.inject_error("nvmlDeviceSetMemoryLimits_v1", pynvml.NVML_ERROR_NO_PERMISSION, 1)
    with pytest.raises(NvmlNoPermission) as e:
        nvml.set_memory_limits(U0, SLICE, 1, 2)
    assert e.value.message == (
        f"NVML refused nvmlDeviceSetMemoryLimits_v1 on GPU {U0}: insufficient permissions; the "
        "node agent must run as root in a privileged container to set GPU memory limits and "
        "compute modes")
    assert e.value.code == pynvml.NVML_ERROR_NO_PERMISSION
    nvml.set_memory_limits(U0, SLICE, 1, 2)  # the error was injected once
    fake_nvml.inject_error("nvmlDeviceGetComputeRunningProcesses_v3",
                           pynvml.NVML_ERROR_UNKNOWN, 1)
    with pytest.raises(NvmlUnknown) as e2:
        nvml.running_processes(U0)
    assert e2.value.function == "nvmlDeviceGetComputeRunningProcesses"
    assert "Unknown Error" in e2.value.message


def test_a_cgroup_nvml_cannot_open_names_the_cgroup(nvml, fake_nvml) -> None:
    """Before: NVML_ERROR_OPERATING_SYSTEM (17), which nvml.h returns from both memory-limit
    functions "if the cgroup path cannot be opened", became NvmlUnknown (reason NVMLError,
    "check the driver with nvidia-smi"), naming neither the cgroup nor where to look. Now it is
    NvmlCgroupUnavailable: code 17, the agent's reason for a missing cgroup (CgroupNotFound),
    and a message naming the path and what to check. 17 from another call stays NVML's."""
    calls = [("nvmlDeviceSetMemoryLimits_v1", lambda: nvml.set_memory_limits(U0, SLICE, 1, 2)),
             ("nvmlDeviceGetMemoryLimits_v1", lambda: nvml.get_memory_limits(U0, SLICE)),
             ("nvmlDeviceSetMemoryLimits_v1", lambda: nvml.clear_memory_limits(U0, SLICE))]
    for function, call in calls:
        fake_nvml.inject_error(function, 17, 1)
        with pytest.raises(NvmlError) as e:
            call()
        assert (e.value.reason, e.value.code, e.value.function) == ("CgroupNotFound", 17,
                                                                    function)
        assert isinstance(e.value, node_errors.NvmlCgroupUnavailable)
        assert e.value.cgroup == SLICE
        assert e.value.message.startswith(f"NVML could not open the cgroup {SLICE} ({function} "
                                          f"on GPU {U0}: NVML_ERROR_OPERATING_SYSTEM)"), \
            e.value.message
        for hint in ("--cgroup-root", "--cgroup-driver", "mount"):
            assert hint in e.value.message
    fake_nvml.inject_error("nvmlDeviceSetComputeMode", 17, 1)
    with pytest.raises(NvmlUnknown) as other:
        nvml.set_compute_mode(U0, GpuComputeMode.DEFAULT)
    assert (other.value.reason, other.value.code) == ("NVMLError", 17)


def test_unknown_uuid_and_lost_gpu(nvml, fake_nvml) -> None:
    with pytest.raises(NvmlNotFound) as e:
        nvml.running_processes("GPU-ffffffff-0000-0000-0000-000000000000")
    assert e.value.reason == "GPUNotFound"
    fake_nvml.update_gpu(0, lost=True)
    with pytest.raises(NvmlGpuLost):
        nvml.get_memory_limits(U0, SLICE)


def test_init_is_idempotent_per_seam(fake_nvml) -> None:
    fake_nvml.add_gpu(U0)
    nvml = PynvmlNvml()
    nvml.init()
    nvml.init()
    nvml.shutdown()
    nvml.shutdown()  # a second shutdown is a no-op, not an NVML error
    with pytest.raises(NvmlUnknown):  # uninitialised again
        nvml.driver_version()
