"""A simulated NVML (GPUs, their processes, memory limits, compute modes), for the demo's
simulated node (and tests): the demo runs without a GPU, a driver or any C library.

It implements the `Nvml` seam with the same typed errors as the real one, records every call,
keeps the memory limits and compute modes that were set, and fails on request:

    nvml = FakeNvml.simulated(2, model="H100-80GB", seed="node-a")
    nvml = FakeNvml.from_dict({"driver_version": "615.00.00",
                               "gpus": [{"model": "H100-80GB", "count": 2}],
                               "processes": [{"gpu": 0, "pid": 4242, "used": "2Gi"}]})
    nvml.fail("set_memory_limits", "NoPermission", times=1)

The simulated driver decides what exists: below driver 615 (`driver_version: 550.54.15`) the
r615 memory-limit functions raise FunctionNotFound, exactly as a real old driver's NVML does, so
the node agent falls back (or refuses) as it would on such a node; `memory_limits: true|false`
overrides the driver's say.

Allocations (`allocate`, what a CUDA process would do) fail as the driver would: over a cgroup
hard limit in force, or over the GPU's own memory. Only when the fake knows the node's cgroup
tree (`use_cgroups`, opt-in: many tests name made-up paths) are memory-limit calls on a cgroup
path checked as the real library checks them: a path outside the cgroup root is refused
NVML_ERROR_INVALID_ARGUMENT, and one that is not in the tree fails
NVML_ERROR_OPERATING_SYSTEM (nvml.h: "if the cgroup path cannot be opened"); and, as nvml.h
says ("Removing the cgroup will also clear any limits"), a cgroup the tree removes
(`FakeCgroupFs.remove`) takes its limits, and those below it, with it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from ..node.errors import (
    NVML_ERROR_FUNCTION_NOT_FOUND,
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_ERROR_OPERATING_SYSTEM,
    NVML_ERROR_UNINITIALIZED,
    ConfigError,
    NvmlCapabilityMissing,
    NvmlError,
    nvml_error,
)
from ..node.nvml import (
    MEMORY_LIMIT_MAX,
    SET_MEMORY_LIMITS,
    DeviceInfo,
    GpuComputeMode,
    GpuProcess,
    MemoryLimits,
    ProcessUtilization,
    listings_failed,
)
from .nvml_controls import FakeNvmlControls
from .nvml_records import (
    _FUNCTIONS,
    CALL_LOG_SIZE,
    DEFAULT_MODEL,
    GPU_MODELS,
    MEMORY_LIMITS_DRIVER,
    PROCESS_KINDS,
    SEAM_METHODS,
    CallLog,
    CgroupTree,
    FakeGpu,
    FakeProcess,
    GpuOutOfMemory,
    NvmlCall,
    _Failure,
    _under,
    driver_has_memory_limits,
    fake_uuid,
)


class FakeNvml(FakeNvmlControls):
    """In-memory GPUs behind the `Nvml` seam. Mutate `gpus`/`processes` freely between calls."""

    def __init__(
        self,
        gpus: Iterable[FakeGpu] = (),
        *,
        processes: Iterable[FakeProcess] = (),
        driver_version: str = "615.00.00",
        memory_limits: bool | None = None,
    ):
        self.gpus: list[FakeGpu] = list(gpus)
        self.processes: list[FakeProcess] = list(processes)
        self.driver: str = driver_version
        self.has_memory_limits = (driver_has_memory_limits(driver_version)
                                  if memory_limits is None else memory_limits)
        """False: the driver lacks the r615 memory-limit functions (FunctionNotFound), as a real
        driver below 615 does; by default it follows `driver_version`."""
        self.limits: dict[tuple[str, str], tuple[int, int]] = {}
        """(gpu uuid, cgroup path) -> (soft, hard): what is in force now."""
        self.calls: CallLog = CallLog(maxlen=CALL_LOG_SIZE)
        """The newest CALL_LOG_SIZE seam calls, oldest first."""
        self.cgroup_root: str | None = None
        self.cgroup_tree: CgroupTree | None = None
        """Set by `use_cgroups`; None: any absolute path is taken as a cgroup."""
        self.initialized = 0
        self._failures: dict[str, list[_Failure]] = {}
        self._lock = threading.RLock()
        uuids = [g.uuid for g in self.gpus]
        if len(set(uuids)) != len(uuids):
            raise ConfigError("FakeNvml: GPU UUIDs must be unique")

    # -- the call frame ---------------------------------------------------------------------

    def _begin(self, method: str, *args: Any, device: str | None = None,
               needs_init: bool = True, record: bool = True, cgroup: str | None = None) -> None:
        if record:  # False: a part of a call recorded already (`other_processes`)
            self.calls.append(NvmlCall(method, args))
        for failure in self._failures.get(method, []):
            if failure.device is not None and failure.device != device:
                continue
            if failure.remaining is not None:
                if failure.remaining <= 0:
                    continue
                failure.remaining -= 1
            raise nvml_error(failure.code, _FUNCTIONS[method], device=device, cgroup=cgroup)
        if needs_init and self.initialized <= 0:
            raise nvml_error(NVML_ERROR_UNINITIALIZED, _FUNCTIONS[method], device=device)

    def _find(self, method: str, uuid: str) -> FakeGpu:
        for g in self.gpus:
            if g.uuid == uuid:
                if g.lost:
                    raise nvml_error(NVML_ERROR_GPU_IS_LOST, _FUNCTIONS[method], device=uuid)
                return g
        raise nvml_error(NVML_ERROR_NOT_FOUND, _FUNCTIONS[method], device=uuid)

    def _limits_gpu(self, method: str, uuid: str, namespace: str) -> FakeGpu:
        if not self.has_memory_limits:
            raise nvml_error(NVML_ERROR_FUNCTION_NOT_FOUND, _FUNCTIONS[method], device=uuid)
        gpu = self._find(method, uuid)
        if not namespace.startswith("/"):
            raise nvml_error(NVML_ERROR_INVALID_ARGUMENT, _FUNCTIONS[method], device=uuid,
                             detail=f"namespace {namespace!r} is not an absolute cgroup path")
        if self.cgroup_root is not None and self.cgroup_tree is not None:
            path = namespace.rstrip("/") or "/"
            if not _under(path, self.cgroup_root):
                raise nvml_error(NVML_ERROR_INVALID_ARGUMENT, _FUNCTIONS[method], device=uuid,
                                 detail=f"namespace {namespace!r} is not a cgroup: the full "
                                 f"sysfs path of one starts with {self.cgroup_root}/")
            if not self.cgroup_tree.exists(path):
                raise nvml_error(NVML_ERROR_OPERATING_SYSTEM, _FUNCTIONS[method], device=uuid,
                                 cgroup=namespace)
        if gpu.mig:
            raise nvml_error(NVML_ERROR_NOT_SUPPORTED, _FUNCTIONS[method], device=uuid)
        return gpu

    # -- the seam ---------------------------------------------------------------------------

    def init(self) -> None:
        with self._lock:
            self._begin("init", needs_init=False)
            self.initialized += 1

    def shutdown(self) -> None:
        with self._lock:
            self._begin("shutdown")
            self.initialized -= 1

    def driver_version(self) -> str:
        with self._lock:
            self._begin("driver_version")
            return self.driver

    def devices(self) -> tuple[DeviceInfo, ...]:
        with self._lock:
            self._begin("devices")
            out = []
            for index, g in enumerate(self.gpus):
                if g.lost:
                    raise nvml_error(NVML_ERROR_GPU_IS_LOST, "nvmlDeviceGetMemoryInfo",
                                     device=g.uuid)
                used = sum(p.used_bytes or 0 for p in self.processes if p.gpu == g.uuid)
                out.append(DeviceInfo(index=index, uuid=g.uuid, name=g.name,
                                      memory_total=g.memory_total, memory_used=used,
                                      compute_mode=g.compute_mode, mig_enabled=g.mig))
            return tuple(out)

    def running_processes(self, uuid: str) -> tuple[GpuProcess, ...]:
        with self._lock:
            self._begin("running_processes", uuid, device=uuid)
            self._find("running_processes", uuid)
            return tuple(GpuProcess(pid=p.pid, used_bytes=p.used_bytes)
                         for p in self.processes if p.gpu == uuid and p.kind == "compute")

    def other_processes(self, uuid: str) -> tuple[GpuProcess, ...]:
        """The graphics processes, then the MPS clients listed apart (`FakeProcess.kind`), each
        listing taken on its own as the real seam takes it: `fail("other_processes")` fails
        the graphics listing, `fail("mps_processes")` the MPS one; one failing keeps the
        other's processes (`nvml.listings_failed`)."""
        with self._lock:
            self.calls.append(NvmlCall("other_processes", (uuid,)))
            out: list[GpuProcess] = []
            failed: dict[str, NvmlError] = {}
            for kind, method in (("graphics", "other_processes"), ("mps", "mps_processes")):
                try:
                    self._begin(method, uuid, device=uuid, record=False)
                    self._find(method, uuid)
                except NvmlCapabilityMissing:
                    continue  # a listing the driver lacks: no such processes
                except NvmlError as e:
                    failed[_FUNCTIONS[method]] = e
                    continue
                out.extend(GpuProcess(pid=p.pid, used_bytes=p.used_bytes)
                           for p in self.processes if p.gpu == uuid and p.kind == kind)
            if failed:
                raise listings_failed(failed, out)
            return tuple(out)

    def process_utilization(self, uuid: str, since_us: int = 0) -> tuple[ProcessUtilization, ...]:
        with self._lock:
            self._begin("process_utilization", uuid, since_us, device=uuid)
            self._find("process_utilization", uuid)
            return tuple(
                ProcessUtilization(pid=p.pid, sm_percent=p.sm_percent,
                                   memory_percent=p.memory_percent, timestamp_us=since_us + 1)
                for p in self.processes if p.gpu == uuid and p.sm_percent is not None
            )

    def memory_limits_supported(self) -> bool:
        with self._lock:
            self._begin("memory_limits_supported")
            return self.has_memory_limits

    def get_memory_limits(self, uuid: str, namespace: str) -> MemoryLimits:
        with self._lock:
            self._begin("get_memory_limits", uuid, namespace, device=uuid, cgroup=namespace)
            self._limits_gpu("get_memory_limits", uuid, namespace)
            soft, hard = self.limits.get((uuid, namespace), (0, MEMORY_LIMIT_MAX))
            base = namespace.rstrip("/") or "/"
            used = sum(
                p.used_bytes or 0 for p in self.processes
                if p.gpu == uuid and p.cgroup
                and (p.cgroup == base or p.cgroup.startswith(base.rstrip("/") + "/"))
            )
            return MemoryLimits(soft=soft, hard=hard, current_used=used)

    def set_memory_limits(self, uuid: str, namespace: str, soft: int, hard: int) -> None:
        with self._lock:
            self._begin("set_memory_limits", uuid, namespace, soft, hard, device=uuid,
                        cgroup=namespace)
            gpu = self._limits_gpu("set_memory_limits", uuid, namespace)
            if soft < 0 or hard < 0 or soft > hard or hard > MEMORY_LIMIT_MAX:
                raise nvml_error(NVML_ERROR_INVALID_ARGUMENT, SET_MEMORY_LIMITS, device=uuid,
                                 detail=f"soft {soft} must be <= hard {hard}")
            total = gpu.memory_total
            if hard > total and hard != MEMORY_LIMIT_MAX:
                # as NVML: "a limit exceeds total device memory" (MAX itself means no limit)
                raise nvml_error(NVML_ERROR_INVALID_ARGUMENT, SET_MEMORY_LIMITS, device=uuid,
                                 detail=f"hard {hard} exceeds the GPU's {total} bytes")
            self._store(uuid, namespace, soft, hard)

    def clear_memory_limits(self, uuid: str, namespace: str) -> None:
        with self._lock:
            self._begin("clear_memory_limits", uuid, namespace, device=uuid, cgroup=namespace)
            self._limits_gpu("clear_memory_limits", uuid, namespace)
            self._store(uuid, namespace, 0, MEMORY_LIMIT_MAX)

    def _cgroup_removed(self, path: str) -> None:
        """The cgroup tree removed `path` (and everything below it): nvml.h, "Removing the
        cgroup will also clear any limits"."""
        with self._lock:
            for key in [k for k in self.limits if _under(k[1], path)]:
                del self.limits[key]

    def _store(self, uuid: str, namespace: str, soft: int, hard: int) -> None:
        if soft == 0 and hard == MEMORY_LIMIT_MAX:
            self.limits.pop((uuid, namespace), None)
        else:
            self.limits[(uuid, namespace)] = (soft, hard)

    def set_compute_mode(self, uuid: str, mode: GpuComputeMode) -> None:
        with self._lock:
            self._begin("set_compute_mode", uuid, GpuComputeMode(mode), device=uuid)
            gpu = self._find("set_compute_mode", uuid)
            if mode is GpuComputeMode.EXCLUSIVE_THREAD:
                raise nvml_error(NVML_ERROR_NOT_SUPPORTED, "nvmlDeviceSetComputeMode",
                                 device=uuid)
            gpu.compute_mode = GpuComputeMode(mode)


__all__ = [
    "CALL_LOG_SIZE",
    "DEFAULT_MODEL",
    "GPU_MODELS",
    "MEMORY_LIMITS_DRIVER",
    "PROCESS_KINDS",
    "SEAM_METHODS",
    "CallLog",
    "CgroupTree",
    "FakeGpu",
    "FakeNvml",
    "FakeProcess",
    "GpuOutOfMemory",
    "NvmlCall",
    "driver_has_memory_limits",
    "fake_uuid",
]
