"""The simulated NVML's records: the GPU models it knows, the fake GPUs and processes, the
driver's out-of-memory refusal, the call log and the failure entries, and which NVML function
each seam method stands for.

Plain data with no behaviour of the fake's own: apart from `FakeNvml` so that the seam
(`nvml.py`) and its test controls (`nvml_controls.py`) share them without importing each other.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from ..contract import MIB
from ..node.nvml import (
    GET_MEMORY_LIMITS,
    SET_MEMORY_LIMITS,
    GpuComputeMode,
)

# Name and total memory as NVML reports them for a few common data-centre GPUs.
GPU_MODELS: Mapping[str, tuple[str, int]] = {
    "H100-80GB": ("NVIDIA H100 80GB HBM3", 81559 * MIB),
    "H200-141GB": ("NVIDIA H200", 143771 * MIB),
    "A100-40GB": ("NVIDIA A100-SXM4-40GB", 40960 * MIB),
    "A100-80GB": ("NVIDIA A100-SXM4-80GB", 81920 * MIB),
    "L4": ("NVIDIA L4", 23034 * MIB),
    "T4": ("Tesla T4", 15360 * MIB),
}
DEFAULT_MODEL = "H100-80GB"
MEMORY_LIMITS_DRIVER = 615
"""The first driver branch with nvmlDeviceSet/GetMemoryLimits_v1 (and MPS v3 namespaces)."""
CALL_LOG_SIZE = 10_000
"""How many calls `FakeNvml.calls` keeps, newest last: a demo left running (--keep) polls NVML
for hours and must not grow without end; a test makes far fewer calls than this."""

PROCESS_KINDS = ("compute", "graphics", "mps")
"""`FakeProcess.kind`: the NVML listing a process is in."""

# The NVML function each seam method stands for (what error messages name).
_FUNCTIONS = {
    "init": "nvmlInit",
    "shutdown": "nvmlShutdown",
    "driver_version": "nvmlSystemGetDriverVersion",
    "devices": "nvmlDeviceGetCount",
    "running_processes": "nvmlDeviceGetComputeRunningProcesses",
    "other_processes": "nvmlDeviceGetGraphicsRunningProcesses",
    # not a method of its own: the MPS client listing inside `other_processes`, failed apart
    "mps_processes": "nvmlDeviceGetMPSComputeRunningProcesses",
    "process_utilization": "nvmlDeviceGetProcessUtilization",
    "memory_limits_supported": "nvmlDeviceGetMemoryLimits_v1",
    "get_memory_limits": GET_MEMORY_LIMITS,
    "set_memory_limits": SET_MEMORY_LIMITS,
    "clear_memory_limits": SET_MEMORY_LIMITS,
    "set_compute_mode": "nvmlDeviceSetComputeMode",
}
SEAM_METHODS = tuple(_FUNCTIONS)


def driver_has_memory_limits(version: str) -> bool:
    """Whether a real driver of this version exports the r615 memory-limit functions: its
    branch (the number before the first dot) is 615 or newer. An unreadable version is taken
    as new, so a typo does not silently simulate an old driver."""
    branch = version.strip().split(".", 1)[0]
    return not branch.isdigit() or int(branch) >= MEMORY_LIMITS_DRIVER


def fake_uuid(seed: str, index: int) -> str:
    """A stable, well-formed GPU UUID (GPU-8-4-4-4-12 hex) for a seed and an index."""
    h = hashlib.sha256(f"{seed}/{index}".encode()).hexdigest()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


@dataclass
class FakeGpu:
    uuid: str
    name: str = GPU_MODELS[DEFAULT_MODEL][0]
    memory_total: int = GPU_MODELS[DEFAULT_MODEL][1]
    compute_mode: GpuComputeMode = GpuComputeMode.DEFAULT
    mig: bool = False
    lost: bool = False
    """A lost GPU answers identity calls and fails everything else with GPU_IS_LOST."""


@dataclass
class FakeProcess:
    pid: int
    gpu: str
    """The GPU's UUID."""
    used_bytes: int | None
    sm_percent: int | None = None
    """None: NVML has no utilisation sample for it."""
    memory_percent: int = 0
    cgroup: str = ""
    """The process's cgroup path (counted in `current_used` of the limits of it and its parents)."""
    kind: str = "compute"
    """Which NVML listing has it: `compute` (`running_processes`), or `graphics` or `mps` (an
    MPS client some drivers list apart): `other_processes`. Its memory counts in the GPU's
    used memory whatever its kind."""


class GpuOutOfMemory(Exception):
    """A simulated allocation the driver refuses (what CUDA reports as
    cudaErrorMemoryAllocation): a cgroup hard limit in force on the GPU would be exceeded
    (`cgroup` names it), or the GPU's own memory (`cgroup` is None, `hard` its total)."""

    def __init__(self, gpu: str, cgroup: str | None, hard: int, used: int, extra: int):
        self.gpu, self.cgroup, self.hard, self.used, self.extra = gpu, cgroup, hard, used, extra
        over = (f"cgroup {cgroup} to {(used + extra) // MIB} MiB, over its hard limit of "
                f"{hard // MIB} MiB" if cgroup is not None else
                f"the GPU to {(used + extra) // MIB} MiB in use, over its {hard // MIB} MiB of "
                "memory")
        super().__init__(f"out of memory on {gpu}: {extra // MIB} MiB more would take {over}")


@dataclass(frozen=True, slots=True)
class NvmlCall:
    method: str
    args: tuple[Any, ...] = ()


class CallLog(deque):
    """The newest calls (at most `maxlen`), oldest first; a slice gives a list, so a test can
    take the calls since a `len()` it noted (while the log is not full)."""

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return list(self)[index]
        return super().__getitem__(index)


class CgroupTree(Protocol):
    """What the fake asks of the node's cgroup tree (`CgroupFs`, `FakeCgroupFs`)."""

    def exists(self, path: str) -> bool: ...


@dataclass
class _Failure:
    code: int
    remaining: int | None  # None: forever
    device: str | None = None  # only calls on this GPU fail



def _under(cgroup: str, path: str) -> bool:
    """`cgroup` is `path` or below it (a cgroup v2 limit covers its whole subtree)."""
    base = path.rstrip("/")
    return bool(cgroup) and (cgroup.rstrip("/") == base or cgroup.startswith(base + "/"))
