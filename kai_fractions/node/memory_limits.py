"""The cgroup GPU memory-limit enforcer: NVML soft/hard limits on a cgroup, idempotently.

soft = the guaranteed share (the NvFractions request), hard = the cap (the limit), in bytes, on
each of the container's GPUs. Every write is preceded by a read, so a limit already in force is
never rewritten (an agent restart costs reads, not writes). Clearing sets soft 0 and hard
NVML_DEVICE_MEMORY_LIMIT_MAX, which NVIDIA asks for before a cgroup is deleted.

On a driver without the r615 functions every call raises `NvmlFunctionNotFound` (reason
DriverTooOld); the plan (`desired.py`) already chose the fallback or refused, so reaching that
here means the driver changed under the agent, and the engine reports it per container.
"""

from __future__ import annotations

from dataclasses import dataclass

from .desired import LimitTarget
from .nvml import MEMORY_LIMIT_MAX, MemoryLimits, Nvml


@dataclass(frozen=True, slots=True)
class LimitWrite:
    """A write that happened: what was there before and what is there now."""

    gpu_uuid: str
    path: str
    before: MemoryLimits
    soft: int
    hard: int


class MemoryLimitEnforcer:
    def __init__(self, nvml: Nvml):
        self.nvml = nvml

    def supported(self) -> bool:
        return self.nvml.memory_limits_supported()

    def read(self, gpu_uuid: str, path: str) -> MemoryLimits:
        return self.nvml.get_memory_limits(gpu_uuid, path)

    def ensure(self, target: LimitTarget) -> LimitWrite | None:
        """Makes `target` the limits in force; returns the write, or None when already so."""
        before = self.nvml.get_memory_limits(target.gpu_uuid, target.path)
        if (before.soft, before.hard) == (target.soft, target.hard):
            return None
        self.nvml.set_memory_limits(target.gpu_uuid, target.path, target.soft, target.hard)
        return LimitWrite(target.gpu_uuid, target.path, before, target.soft, target.hard)

    def clear(self, gpu_uuid: str, path: str) -> LimitWrite | None:
        """Removes any limit on `path` for the GPU; returns the write, or None when none was."""
        before = self.nvml.get_memory_limits(gpu_uuid, path)
        if before.cleared:
            return None
        self.nvml.clear_memory_limits(gpu_uuid, path)
        return LimitWrite(gpu_uuid, path, before, 0, MEMORY_LIMIT_MAX)
