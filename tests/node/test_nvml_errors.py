"""nvml_error: each NVML return code becomes a typed error with a reason and an actionable
message (the same for the pynvml seam and the in-memory fake)."""

from __future__ import annotations

import pytest

from kai_fractions.node.errors import (
    NvmlCapabilityMissing,
    NvmlDriverNotLoaded,
    NvmlError,
    NvmlFunctionNotFound,
    NvmlGpuLost,
    NvmlLibraryNotFound,
    NvmlNoPermission,
    NvmlNotFound,
    NvmlNotSupported,
    NvmlUnknown,
    nvml_error,
)

U = "GPU-00000000-0000-0000-0000-000000000001"


@pytest.mark.parametrize(("code", "cls", "reason"), [
    (12, NvmlLibraryNotFound, "NVMLUnavailable"),
    (9, NvmlDriverNotLoaded, "NVMLUnavailable"),
    (4, NvmlNoPermission, "NVMLNoPermission"),
    (13, NvmlFunctionNotFound, "DriverTooOld"),
    (3, NvmlNotSupported, "NotSupported"),
    (6, NvmlNotFound, "GPUNotFound"),
    (15, NvmlGpuLost, "GPULost"),
    (999, NvmlUnknown, "NVMLError"),
    (2, NvmlUnknown, "NVMLError"),
])
def test_codes_map_to_types_and_reasons(code, cls, reason) -> None:
    err = nvml_error(code, "nvmlDeviceGetUUID", device=U)
    assert type(err) is cls and isinstance(err, NvmlError)
    assert err.reason == reason and err.code == code and err.function == "nvmlDeviceGetUUID"
    assert str(err) == err.message and err.message


def test_capability_missing_covers_both_cases() -> None:
    assert isinstance(nvml_error(13, "f"), NvmlCapabilityMissing)
    assert isinstance(nvml_error(3, "f"), NvmlCapabilityMissing)


@pytest.mark.parametrize(("code", "function", "message"), [
    (3, "nvmlDeviceSetMemoryLimits_v1",
     f"nvmlDeviceSetMemoryLimits_v1 is not supported on GPU {U} (GPUs in MIG mode and some "
     "models cannot do this); use a GPU without MIG for fractional sharing"),
    (6, "nvmlDeviceGetHandleByUUID",
     f"NVML did not find GPU {U} (nvmlDeviceGetHandleByUUID): the pod may be bound to a GPU "
     "this node does not have, or the GPU was removed"),
    (15, "nvmlDeviceGetMemoryInfo",
     f"GPU {U} is lost (fell off the bus) during nvmlDeviceGetMemoryInfo: drain the node and "
     "reset or replace the GPU"),
    (13, "nvmlDeviceGetFooBar",
     "the NVIDIA driver's NVML has no nvmlDeviceGetFooBar: upgrade the NVIDIA driver to one "
     "that has it"),
    (999, "nvmlDeviceGetIndex",
     f"NVML nvmlDeviceGetIndex failed on GPU {U} (nvmlReturn_t 999); check the driver with "
     "`nvidia-smi` and the agent log"),
])
def test_messages(code, function, message) -> None:
    assert nvml_error(code, function, device=U).message == message
