"""The REAL pynvml (nvidia-ml-py) driving the fake libnvidia-ml.so.1 (tests/fakes/nvml)."""

from __future__ import annotations

import ctypes
import subprocess
import sys
import threading
import time

import pynvml
import pytest

from tests.support.fake_nvml import (
    MEMORY_LIMIT_MAX,
    MIB,
    FakeNvml,
    MemoryLimit,
    load_into_pynvml,
)

UUID0 = "GPU-11111111-2222-3333-4444-555555555555"
UUID1 = "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"
POD_CGROUP = (
    "/sys/fs/cgroup/kubepods.slice/kubepods-burstable.slice/"
    "kubepods-burstable-pod0f3c1a2b_1111_2222_3333_444455556666.slice"
)
CONTAINER_CGROUP = f"{POD_CGROUP}/cri-containerd-0123456789abcdef.scope"


@pytest.fixture
def two_gpus(fake_nvml: FakeNvml) -> FakeNvml:
    fake_nvml.add_gpu(UUID0, memory_mib=81559, name="NVIDIA H100 80GB HBM3")
    fake_nvml.add_gpu(UUID1, memory_mib=40960, name="NVIDIA A100-SXM4-40GB", compute_mode=3)
    fake_nvml.add_process(
        0, pid=4242, used_bytes=3 * 1024 * MIB, sm_util=30, cgroup=CONTAINER_CGROUP
    )
    fake_nvml.add_process(0, pid=4243, used_bytes=None)
    return fake_nvml


def _set_limits(handle: object, namespace: str, soft: int, hard: int) -> None:
    limits = pynvml.c_nvmlSetMemoryLimits_v1_t()
    limits.nameSpace = namespace.encode()
    limits.softLimit = soft
    limits.hardLimit = hard
    pynvml.nvmlDeviceSetMemoryLimits_v1(handle, limits)


def _get_limits(handle: object, namespace: str) -> pynvml.c_nvmlGetMemoryLimits_v1_t:
    limits = pynvml.c_nvmlGetMemoryLimits_v1_t()
    limits.nameSpace = namespace.encode()
    pynvml.nvmlDeviceGetMemoryLimits_v1(handle, limits)
    return limits


def test_real_pynvml_reads_the_fake(two_gpus: FakeNvml) -> None:
    pynvml.nvmlInit()
    try:
        assert pynvml.nvmlSystemGetDriverVersion() == "615.48.02"
        assert pynvml.nvmlDeviceGetCount() == 2
        h0 = pynvml.nvmlDeviceGetHandleByIndex(0)
        assert pynvml.nvmlDeviceGetUUID(h0) == UUID0
        assert pynvml.nvmlDeviceGetName(h0) == "NVIDIA H100 80GB HBM3"
        assert pynvml.nvmlDeviceGetIndex(pynvml.nvmlDeviceGetHandleByUUID(UUID1)) == 1

        mem = pynvml.nvmlDeviceGetMemoryInfo(h0)
        assert mem.total == 81559 * MIB
        assert mem.used == 3 * 1024 * MIB
        assert mem.free == mem.total - mem.used
        mem2 = pynvml.nvmlDeviceGetMemoryInfo(h0, version=pynvml.nvmlMemory_v2)
        assert (mem2.total, mem2.reserved, mem2.used) == (81559 * MIB, 0, 3 * 1024 * MIB)

        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h0)
        assert [(p.pid, p.usedGpuMemory) for p in procs] == [(4242, 3 * 1024 * MIB), (4243, None)]
        assert (
            pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByIndex(1)) == []
        )

        samples = pynvml.nvmlDeviceGetProcessUtilization(h0, 0)
        assert [(s.pid, s.smUtil) for s in samples] == [(4242, 30)]
        assert samples[0].timeStamp > 0
        assert pynvml.nvmlDeviceGetUtilizationRates(h0).gpu == 30
        assert pynvml.nvmlDeviceGetComputeMode(h0) == pynvml.NVML_COMPUTEMODE_DEFAULT
        assert pynvml.nvmlDeviceGetMigMode(h0) == [0, 0]
        h1 = pynvml.nvmlDeviceGetHandleByIndex(1)
        assert pynvml.nvmlDeviceGetComputeMode(h1) == pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
        with pytest.raises(pynvml.NVMLError_NotFound):  # no process with an sm sample on GPU 1
            pynvml.nvmlDeviceGetProcessUtilization(h1, 0)
    finally:
        pynvml.nvmlShutdown()


def test_config_changes_are_seen_while_running(two_gpus: FakeNvml) -> None:
    pynvml.nvmlInit()
    h0 = pynvml.nvmlDeviceGetHandleByIndex(0)
    assert len(pynvml.nvmlDeviceGetComputeRunningProcesses(h0)) == 2
    two_gpus.add_process(0, pid=5000, used_bytes=MIB)
    two_gpus.remove_process(4243)
    pids = [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h0)]
    assert pids == [4242, 5000]
    two_gpus.update_gpu(0, lost=True)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        pynvml.nvmlDeviceGetMemoryInfo(h0)
    assert pynvml.nvmlDeviceGetUUID(h0) == UUID0  # identity still answers
    pynvml.nvmlShutdown()


def test_memory_limits_round_trip_logged_and_persisted(two_gpus: FakeNvml) -> None:
    pynvml.nvmlInit()
    h0 = pynvml.nvmlDeviceGetHandleByIndex(0)

    # nvml.h: NVML_ERROR_NOT_FOUND "if the limits were not found for this device and cgroup"
    with pytest.raises(pynvml.NVMLError_NotFound):
        _get_limits(h0, POD_CGROUP)

    _set_limits(h0, POD_CGROUP, soft=20 * 1024 * MIB, hard=40 * 1024 * MIB)
    got = _get_limits(h0, POD_CGROUP)
    assert (got.softLimit, got.hardLimit) == (20 * 1024 * MIB, 40 * 1024 * MIB)
    assert got.currentUsed == 3 * 1024 * MIB  # pid 4242 lives below the pod cgroup
    with pytest.raises(pynvml.NVMLError_NotFound):
        _get_limits(h0, "/sys/fs/cgroup/other.slice")

    calls = two_gpus.calls("SetMemoryLimits")
    assert [(c.uuid, c.args, c.rc) for c in calls] == [
        (UUID0, (POD_CGROUP, str(20 * 1024 * MIB), str(40 * 1024 * MIB)), 0)
    ]
    assert two_gpus.limits() == {(UUID0, POD_CGROUP): MemoryLimit(20 * 1024 * MIB, 40 * 1024 * MIB)}

    # clear, as the agent does before a cgroup goes away
    _set_limits(h0, POD_CGROUP, soft=0, hard=MEMORY_LIMIT_MAX)
    assert two_gpus.limits() == {}
    assert two_gpus.limits(include_cleared=True)[(UUID0, POD_CGROUP)].cleared
    cleared = _get_limits(h0, POD_CGROUP)
    assert (cleared.softLimit, cleared.hardLimit) == (0, pynvml.NVML_DEVICE_MEMORY_LIMIT_MAX)
    pynvml.nvmlShutdown()


def test_limits_survive_a_restart_in_another_process(two_gpus: FakeNvml) -> None:
    pynvml.nvmlInit()
    _set_limits(pynvml.nvmlDeviceGetHandleByIndex(0), POD_CGROUP, soft=1024 * MIB, hard=2048 * MIB)
    pynvml.nvmlDeviceSetComputeMode(
        pynvml.nvmlDeviceGetHandleByIndex(0), pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
    )
    pynvml.nvmlShutdown()

    script = (
        "import pynvml\n"
        "pynvml.nvmlInit()\n"
        f"h = pynvml.nvmlDeviceGetHandleByUUID({UUID0!r})\n"
        "g = pynvml.c_nvmlGetMemoryLimits_v1_t()\n"
        f"g.nameSpace = {POD_CGROUP!r}.encode()\n"
        "pynvml.nvmlDeviceGetMemoryLimits_v1(h, g)\n"
        "print(g.softLimit, g.hardLimit, pynvml.nvmlDeviceGetComputeMode(h))\n"
    )
    # a new process finds libnvidia-ml.so.1 by soname through LD_LIBRARY_PATH
    out = subprocess.run(
        [sys.executable, "-c", script],
        env=two_gpus.env(),
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout.split()
    assert out == [str(1024 * MIB), str(2048 * MIB), "3"]
    assert two_gpus.compute_modes() == {UUID0: 3}
    assert [(c.uuid, c.args, c.rc) for c in two_gpus.calls("SetComputeMode")] == [
        (UUID0, ("3",), 0)
    ]


def test_old_driver_lacks_memory_limits(fake_nvml_old_driver: FakeNvml) -> None:
    fake_nvml_old_driver.add_gpu(UUID0)
    pynvml.nvmlInit()
    h0 = pynvml.nvmlDeviceGetHandleByIndex(0)
    assert pynvml.nvmlDeviceGetUUID(h0) == UUID0
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        _set_limits(h0, POD_CGROUP, soft=MIB, hard=2 * MIB)
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        _get_limits(h0, POD_CGROUP)
    assert fake_nvml_old_driver.calls() == []
    pynvml.nvmlShutdown()


def test_switching_variants_in_one_process(two_gpus: FakeNvml) -> None:
    load_into_pynvml(two_gpus.library_path("old-driver"))
    pynvml.nvmlInit()
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        _set_limits(pynvml.nvmlDeviceGetHandleByIndex(0), POD_CGROUP, soft=0, hard=MIB)
    pynvml.nvmlShutdown()

    load_into_pynvml(two_gpus.library_path("full"))
    pynvml.nvmlInit()
    _set_limits(pynvml.nvmlDeviceGetHandleByIndex(0), POD_CGROUP, soft=0, hard=MIB)
    pynvml.nvmlShutdown()
    assert two_gpus.limits() == {(UUID0, POD_CGROUP): MemoryLimit(0, MIB)}


def test_injected_error_raises_the_typed_exception_and_clears(two_gpus: FakeNvml) -> None:
    err = two_gpus.inject_error(
        "nvmlDeviceSetMemoryLimits_v1", pynvml.NVML_ERROR_NO_PERMISSION, times=1
    )
    pynvml.nvmlInit()
    h0 = pynvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_NoPermission):
        _set_limits(h0, POD_CGROUP, soft=MIB, hard=2 * MIB)
    _set_limits(h0, POD_CGROUP, soft=MIB, hard=2 * MIB)  # the retry goes through
    assert [c.rc for c in two_gpus.calls("SetMemoryLimits")] == [pynvml.NVML_ERROR_NO_PERMISSION, 0]
    assert two_gpus.calls()[0].uuid == UUID0
    assert two_gpus.error_hits(err) == 1

    two_gpus.inject_error("nvmlDeviceGetComputeRunningProcesses_v3", pynvml.NVML_ERROR_GPU_IS_LOST)
    for _ in range(3):
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            pynvml.nvmlDeviceGetComputeRunningProcesses(h0)
    two_gpus.clear_errors()
    assert len(pynvml.nvmlDeviceGetComputeRunningProcesses(h0)) == 2
    pynvml.nvmlShutdown()


def test_init_error_driver_not_loaded(fake_nvml: FakeNvml) -> None:
    fake_nvml.add_gpu(UUID0)
    fake_nvml.set_init_error(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
        pynvml.nvmlInit()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlDeviceGetCount()
    fake_nvml.set_init_error(None)
    pynvml.nvmlInit()
    assert pynvml.nvmlDeviceGetCount() == 1
    pynvml.nvmlShutdown()


def test_missing_or_broken_config(fake_nvml: FakeNvml, capfd: pytest.CaptureFixture[str]) -> None:
    fake_nvml.config_path.unlink()
    with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
        pynvml.nvmlInit()
    fake_nvml.config_path.write_text("gpu uuid=GPU-x\nbogus line\n")
    with pytest.raises(pynvml.NVMLError_Unknown):
        pynvml.nvmlInit()
    assert "gpu: uuid= and memory= are required" in capfd.readouterr().err


def test_argument_validation(two_gpus: FakeNvml) -> None:
    pynvml.nvmlInit()
    h0 = pynvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_NotFound):
        pynvml.nvmlDeviceGetHandleByUUID("GPU-does-not-exist")
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetHandleByIndex(2)
    with pytest.raises(pynvml.NVMLError_ArgumentVersionMismatch):
        pynvml.nvmlDeviceGetMemoryInfo(h0, version=0x1000001)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        _set_limits(h0, "relative/path", soft=0, hard=MIB)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        _set_limits(h0, POD_CGROUP, soft=2 * MIB, hard=MIB)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceSetComputeMode(h0, pynvml.NVML_COMPUTEMODE_EXCLUSIVE_THREAD)

    lib = pynvml.nvmlLib
    count = ctypes.c_uint(1)
    infos = (pynvml.c_nvmlProcessInfo_v3_t * 1)()
    rc = lib.nvmlDeviceGetComputeRunningProcesses_v3(h0, ctypes.byref(count), infos)
    assert (rc, count.value) == (pynvml.NVML_ERROR_INSUFFICIENT_SIZE, 2)
    assert (
        lib.nvmlDeviceGetComputeRunningProcesses_v3(h0, None, None)
        == pynvml.NVML_ERROR_INVALID_ARGUMENT
    )
    assert lib.nvmlDeviceGetCount_v2(None) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    assert lib.nvmlDeviceSetMemoryLimits_v1(h0, None) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    assert lib.nvmlDeviceGetUUID(None, ctypes.create_string_buffer(96), 96) == (
        pynvml.NVML_ERROR_INVALID_ARGUMENT
    )
    assert lib.nvmlDeviceGetUUID(h0, ctypes.create_string_buffer(8), 8) == (
        pynvml.NVML_ERROR_INSUFFICIENT_SIZE
    )
    assert [c.rc for c in two_gpus.calls("SetMemoryLimits")] == [2, 2, 2]
    pynvml.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlDeviceGetCount()


def test_concurrent_callers(two_gpus: FakeNvml) -> None:
    pynvml.nvmlInit()
    errors: list[BaseException] = []

    def worker(n: int) -> None:
        try:
            h = pynvml.nvmlDeviceGetHandleByIndex(n % 2)
            for i in range(100):
                pynvml.nvmlDeviceGetComputeRunningProcesses(h)
                if n % 2 == 0:
                    _set_limits(h, f"{POD_CGROUP}/c{n}", soft=i * MIB, hard=(i + 1) * MIB)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(6)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    pynvml.nvmlShutdown()
    assert errors == []
    assert len(two_gpus.calls("SetMemoryLimits")) == 300
    assert two_gpus.limits()[(UUID0, f"{POD_CGROUP}/c4")] == MemoryLimit(99 * MIB, 100 * MIB)
    assert time.monotonic() - start < 20
