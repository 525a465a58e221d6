"""`Nvml.other_processes` through the REAL pynvml bindings: the graphics and MPS client listings,
which the compute listing leaves out, and which a driver may lack.

The project's fake libnvidia-ml.so.1 exports neither nvmlDeviceGetGraphicsRunningProcesses_v3
nor nvmlDeviceGetMPSComputeRunningProcesses_v3, as a driver older than those versions does:
pynvml raises FunctionNotFound (its unversioned names, a library mismatch), which is no such
processes, not an error and not blindness."""

from __future__ import annotations

from types import SimpleNamespace

import pynvml
import pytest

from kai_fractions.node.errors import NvmlNoPermission
from kai_fractions.node.nvml import GpuProcess, PynvmlNvml

GIB = 1 << 30
U0 = "GPU-00000000-0000-0000-0000-000000000001"


@pytest.fixture
def nvml(fake_nvml):
    fake_nvml.add_gpu(U0, memory_mib=81559)
    n = PynvmlNvml()
    n.init()
    yield n
    n.shutdown()


def test_listings_the_library_lacks_are_no_processes(nvml, fake_nvml) -> None:
    fake_nvml.add_process(0, 10, 2 * GIB)
    with pytest.raises(pynvml.NVMLError):  # the fake lacks it, as an older driver does
        pynvml.nvmlDeviceGetGraphicsRunningProcesses_v3(pynvml.nvmlDeviceGetHandleByIndex(0))
    assert nvml.other_processes(U0) == ()
    assert nvml.running_processes(U0) == (GpuProcess(10, 2 * GIB),)


def test_graphics_then_mps_clients(nvml, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pynvml, "nvmlDeviceGetGraphicsRunningProcesses",
                        lambda _h: [SimpleNamespace(pid=7, usedGpuMemory=GIB)])
    monkeypatch.setattr(pynvml, "nvmlDeviceGetMPSComputeRunningProcesses",
                        lambda _h: [SimpleNamespace(pid=8, usedGpuMemory=None)])
    assert nvml.other_processes(U0) == (GpuProcess(7, GIB), GpuProcess(8, None))


def test_a_listing_the_gpu_does_not_support_is_skipped(nvml, monkeypatch) -> None:
    def not_supported(_h):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetGraphicsRunningProcesses",
                        lambda _h: [SimpleNamespace(pid=7, usedGpuMemory=GIB)])
    monkeypatch.setattr(pynvml, "nvmlDeviceGetMPSComputeRunningProcesses", not_supported)
    assert nvml.other_processes(U0) == (GpuProcess(7, GIB),)
    monkeypatch.delattr(pynvml, "nvmlDeviceGetMPSComputeRunningProcesses")  # an old binding
    assert nvml.other_processes(U0) == (GpuProcess(7, GIB),)


def test_other_errors_are_raised(nvml, monkeypatch) -> None:
    def refused(_h):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NO_PERMISSION)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetGraphicsRunningProcesses", refused)
    with pytest.raises(NvmlNoPermission) as e:
        nvml.other_processes(U0)
    assert e.value.function == "nvmlDeviceGetGraphicsRunningProcesses"
