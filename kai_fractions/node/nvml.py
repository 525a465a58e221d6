"""The NVML seam: the few NVML calls the node engine and agent make, by GPU UUID.

`Nvml` is the protocol; `PynvmlNvml` is the real implementation over nvidia-ml-py (module
`pynvml`) and `kai_fractions.sim.nvml.FakeNvml` the simulated one. Both raise the typed
errors of `errors.py` (built by `errors.nvml_error`), never a pynvml exception; the error of
`other_processes` carries what its other listing listed (`other_listings`). A memory-limit call
on a cgroup that cannot be opened (removed, or not where NVML looks) raises
`NvmlCgroupUnavailable`, naming the path.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import IntEnum
from types import MappingProxyType
from typing import Any, Protocol, TypeVar, runtime_checkable

from .errors import (
    NVML_ERROR_FUNCTION_NOT_FOUND,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_LIBRARY_NOT_FOUND,
    NVML_ERROR_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED,
    NvmlCapabilityMissing,
    NvmlError,
    nvml_error,
)

MEMORY_LIMIT_MAX = 0xFFFF_FFFF_FFFF_FFFF
"""NVML_DEVICE_MEMORY_LIMIT_MAX: a hard limit of this value means "no limit"."""

SET_MEMORY_LIMITS = "nvmlDeviceSetMemoryLimits_v1"
GRAPHICS_PROCESSES = "nvmlDeviceGetGraphicsRunningProcesses"
MPS_PROCESSES = "nvmlDeviceGetMPSComputeRunningProcesses"
GET_MEMORY_LIMITS = "nvmlDeviceGetMemoryLimits_v1"


class GpuComputeMode(IntEnum):
    """nvmlComputeMode_t."""

    DEFAULT = 0
    EXCLUSIVE_THREAD = 1  # removed by NVIDIA; never set
    PROHIBITED = 2
    EXCLUSIVE_PROCESS = 3


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    index: int
    uuid: str
    name: str
    memory_total: int
    """Bytes."""
    memory_used: int
    """Bytes allocated by processes (reserved memory excluded when the driver tells them apart)."""
    compute_mode: GpuComputeMode
    mig_enabled: bool


@dataclass(frozen=True, slots=True)
class GpuProcess:
    pid: int
    """Host pid when NVML is called on the host."""
    used_bytes: int | None
    """None when the driver cannot tell (NVML_VALUE_NOT_AVAILABLE)."""


@dataclass(frozen=True, slots=True)
class ProcessUtilization:
    pid: int
    sm_percent: int
    memory_percent: int
    timestamp_us: int


@dataclass(frozen=True, slots=True)
class MemoryLimits:
    soft: int
    hard: int
    current_used: int = 0

    @property
    def cleared(self) -> bool:
        """No limit in force: soft 0 and hard NVML_DEVICE_MEMORY_LIMIT_MAX."""
        return self.soft == 0 and self.hard == MEMORY_LIMIT_MAX


@runtime_checkable
class Nvml(Protocol):
    """GPUs are named by UUID everywhere; a cgroup namespace is the cgroup's full sysfs path."""

    def init(self) -> None: ...
    def shutdown(self) -> None: ...
    def driver_version(self) -> str: ...
    def devices(self) -> tuple[DeviceInfo, ...]: ...
    def running_processes(self, uuid: str) -> tuple[GpuProcess, ...]: ...
    def other_processes(self, uuid: str) -> tuple[GpuProcess, ...]: ...
    def process_utilization(
        self, uuid: str, since_us: int = 0
    ) -> tuple[ProcessUtilization, ...]: ...
    def memory_limits_supported(self) -> bool: ...
    def get_memory_limits(self, uuid: str, namespace: str) -> MemoryLimits: ...
    def set_memory_limits(self, uuid: str, namespace: str, soft: int, hard: int) -> None: ...
    def clear_memory_limits(self, uuid: str, namespace: str) -> None: ...
    def set_compute_mode(self, uuid: str, mode: GpuComputeMode) -> None: ...


@dataclass(frozen=True, slots=True)
class OtherListings:
    """What `Nvml.other_processes` listed when one of its listings failed: an MPS client that
    some drivers list in the MPS listing only must not be lost to a failing graphics listing,
    nor a graphics process to a failing MPS listing."""

    processes: tuple[GpuProcess, ...]
    """Those of the listings that worked (graphics first), as `other_processes` returns them."""
    failed: Mapping[str, NvmlError]
    """The NVML function of each listing that failed (GRAPHICS_PROCESSES, MPS_PROCESSES) ->
    its error."""


def listings_failed(failed: Mapping[str, NvmlError],
                    processes: Iterable[GpuProcess]) -> NvmlError:
    """The error `Nvml.other_processes` raises when listings failed: the MPS listing's where it
    failed (what it hides matters more), else the graphics one's, with what was listed
    (`other_listings`). Every implementation of the seam raises it so."""
    error = failed.get(MPS_PROCESSES) or failed[GRAPHICS_PROCESSES]
    listed = OtherListings(tuple(processes), MappingProxyType(dict(failed)))
    error.listings = listed  # type: ignore[attr-defined]
    return error


def other_listings(error: NvmlError) -> OtherListings:
    """What an error of `Nvml.other_processes` leaves listed (`listings_failed`); one that
    carries nothing (the call failed before either listing: the GPU lost, NVML down) failed
    both listings."""
    listings = getattr(error, "listings", None)
    if isinstance(listings, OtherListings):
        return listings
    return OtherListings((), MappingProxyType({GRAPHICS_PROCESSES: error,
                                               MPS_PROCESSES: error}))


T = TypeVar("T")

# pynvml keeps the library and a function-pointer cache in module globals; swapping the library
# (--nvml-library, tests switching between fake builds) must happen under one lock.
_SWAP_LOCK = threading.Lock()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class PynvmlNvml:
    """The real seam over nvidia-ml-py.

    `library_path` loads that libnvidia-ml.so.1 instead of the one on the loader path (the
    `--nvml-library` flag; tests point it at the project's fake library).
    """

    def __init__(self, library_path: str | None = None):
        import pynvml  # imported here so that importing this module never needs the package

        self._pynvml = pynvml
        self._library_path = library_path
        self._handles: dict[str, Any] = {}
        self._initialized = False

    # -- plumbing ---------------------------------------------------------------------------

    def _error(self, exc: Exception, function: str, device: str | None,
               cgroup: str | None = None) -> NvmlError:
        p = self._pynvml
        if isinstance(exc, p.NVMLLibraryMismatchError):
            return nvml_error(NVML_ERROR_FUNCTION_NOT_FOUND, function, device=device)
        code = int(getattr(exc, "value", 999))
        try:
            detail = str(exc)
        except Exception:  # str() itself calls into NVML; never let that mask the error
            detail = None
        return nvml_error(code, function, device=device, library=self._library_path,
                          detail=detail, cgroup=cgroup)

    def _call(self, function: str, fn: Callable[..., T], *args: Any,
              device: str | None = None, cgroup: str | None = None) -> T:
        p = self._pynvml
        try:
            return fn(*args)
        except (p.NVMLError, p.NVMLLibraryMismatchError) as exc:
            raise self._error(exc, function, device, cgroup) from None

    def _load_library(self) -> None:
        if self._library_path is None:
            return
        p = self._pynvml
        try:
            lib = ctypes.CDLL(self._library_path)
        except OSError:
            raise nvml_error(NVML_ERROR_LIBRARY_NOT_FOUND, "nvmlInit",
                             library=self._library_path) from None
        with _SWAP_LOCK:
            current = p.nvmlLib
            if current is None or getattr(current, "_handle", None) != lib._handle:
                p.nvmlLib = lib
                # cached pointers belong to the previous library
                p._nvmlGetFunctionPointer_cache.clear()

    def _handle(self, uuid: str) -> Any:
        handle = self._handles.get(uuid)
        if handle is None:
            handle = self._call("nvmlDeviceGetHandleByUUID",
                                self._pynvml.nvmlDeviceGetHandleByUUID, uuid, device=uuid)
            self._handles[uuid] = handle
        return handle

    # -- the seam ---------------------------------------------------------------------------

    def init(self) -> None:
        if self._initialized:
            return  # one nvmlInit per seam, so one shutdown undoes it
        self._load_library()
        self._call("nvmlInit", self._pynvml.nvmlInit)
        self._initialized = True

    def shutdown(self) -> None:
        if not self._initialized:
            return
        self._handles.clear()
        self._initialized = False
        self._call("nvmlShutdown", self._pynvml.nvmlShutdown)

    def driver_version(self) -> str:
        return _text(self._call("nvmlSystemGetDriverVersion",
                                self._pynvml.nvmlSystemGetDriverVersion))

    def devices(self) -> tuple[DeviceInfo, ...]:
        p = self._pynvml
        count = self._call("nvmlDeviceGetCount", p.nvmlDeviceGetCount)
        out = []
        for i in range(count):
            handle = self._call("nvmlDeviceGetHandleByIndex", p.nvmlDeviceGetHandleByIndex, i)
            uuid = _text(self._call("nvmlDeviceGetUUID", p.nvmlDeviceGetUUID, handle))
            self._handles[uuid] = handle
            out.append(self._device(handle, uuid))
        return tuple(out)

    def _device(self, handle: Any, uuid: str) -> DeviceInfo:
        p = self._pynvml
        index = self._call("nvmlDeviceGetIndex", p.nvmlDeviceGetIndex, handle, device=uuid)
        name = _text(self._call("nvmlDeviceGetName", p.nvmlDeviceGetName, handle, device=uuid))
        try:
            mem = self._call("nvmlDeviceGetMemoryInfo_v2", p.nvmlDeviceGetMemoryInfo, handle,
                             p.nvmlMemory_v2, device=uuid)
        except NvmlCapabilityMissing:  # older drivers: v1 counts reserved memory as used
            mem = self._call("nvmlDeviceGetMemoryInfo", p.nvmlDeviceGetMemoryInfo, handle,
                             device=uuid)
        mode = self._call("nvmlDeviceGetComputeMode", p.nvmlDeviceGetComputeMode, handle,
                          device=uuid)
        try:
            current, _pending = self._call("nvmlDeviceGetMigMode", p.nvmlDeviceGetMigMode,
                                           handle, device=uuid)
            mig = bool(current)
        except NvmlCapabilityMissing:  # GPUs without MIG say NotSupported
            mig = False
        return DeviceInfo(
            index=int(index), uuid=uuid, name=name, memory_total=int(mem.total),
            memory_used=int(mem.used), compute_mode=GpuComputeMode(int(mode)), mig_enabled=mig,
        )

    def running_processes(self, uuid: str) -> tuple[GpuProcess, ...]:
        p = self._pynvml
        procs = self._call("nvmlDeviceGetComputeRunningProcesses",
                           p.nvmlDeviceGetComputeRunningProcesses, self._handle(uuid),
                           device=uuid)
        return tuple(
            GpuProcess(pid=int(x.pid),
                       used_bytes=None if x.usedGpuMemory is None else int(x.usedGpuMemory))
            for x in procs
        )

    def other_processes(self, uuid: str) -> tuple[GpuProcess, ...]:
        """The processes `running_processes` (the compute listing) may leave out: the graphics
        listing (NVML lists a graphics-only process there only) and the MPS client listing
        (some drivers list MPS clients there only), in that order; a process in both may be
        in each. A listing this binding or the driver lacks (an older one: FunctionNotFound,
        or the binding's version mismatch) or that the GPU does not support (NotSupported)
        counts as no such processes: it is no blindness. Each listing is taken on its own: one
        that fails otherwise leaves the other's processes, and its error is raised once both
        were taken, carrying them (`other_listings`)."""
        p = self._pynvml
        out: list[GpuProcess] = []
        failed: dict[str, NvmlError] = {}
        for function in (GRAPHICS_PROCESSES, MPS_PROCESSES):
            fn = getattr(p, function, None)
            if fn is None:
                continue
            try:
                procs = self._call(function, fn, self._handle(uuid), device=uuid)
            except NvmlCapabilityMissing:
                continue
            except NvmlError as e:
                failed[function] = e
                continue
            out.extend(GpuProcess(pid=int(x.pid), used_bytes=None if x.usedGpuMemory is None
                                  else int(x.usedGpuMemory)) for x in procs)
        if failed:
            raise listings_failed(failed, out)
        return tuple(out)

    def process_utilization(self, uuid: str, since_us: int = 0) -> tuple[ProcessUtilization, ...]:
        p = self._pynvml
        try:
            samples = p.nvmlDeviceGetProcessUtilization(self._handle(uuid), since_us)
        except p.NVMLError as exc:
            if getattr(exc, "value", None) == NVML_ERROR_NOT_FOUND:
                return ()  # "no samples since that timestamp" is not an error
            raise self._error(exc, "nvmlDeviceGetProcessUtilization", uuid) from None
        return tuple(
            ProcessUtilization(pid=int(s.pid), sm_percent=int(s.smUtil),
                               memory_percent=int(s.memUtil), timestamp_us=int(s.timeStamp))
            for s in samples
        )

    def memory_limits_supported(self) -> bool:
        """True when the driver's NVML exports both memory-limit functions (r615+).

        Decided by the symbols' presence, not by the version string: that is what the call
        itself will see, and it stays right for backports and odd version schemes.
        """
        p = self._pynvml
        for name in (SET_MEMORY_LIMITS, GET_MEMORY_LIMITS):
            try:
                p._nvmlGetFunctionPointer(name)
            except p.NVMLError as exc:
                if getattr(exc, "value", None) == NVML_ERROR_FUNCTION_NOT_FOUND:
                    return False
                raise self._error(exc, name, None) from None
        return True

    def get_memory_limits(self, uuid: str, namespace: str) -> MemoryLimits:
        p = self._pynvml
        limits = p.c_nvmlGetMemoryLimits_v1_t()
        limits.nameSpace = namespace.encode()
        handle = self._handle(uuid)
        try:
            p.nvmlDeviceGetMemoryLimits_v1(handle, limits)
        except (p.NVMLError, p.NVMLLibraryMismatchError) as exc:
            if getattr(exc, "value", None) == NVML_ERROR_NOT_FOUND:
                # nvml.h: "the limits were not found for this device and cgroup", the answer
                # for every cgroup no limit was ever set on: no limit is in force.
                return MemoryLimits(soft=0, hard=MEMORY_LIMIT_MAX)
            raise self._error(exc, GET_MEMORY_LIMITS, uuid, namespace) from None
        return MemoryLimits(soft=int(limits.softLimit), hard=int(limits.hardLimit),
                            current_used=int(limits.currentUsed))

    def set_memory_limits(self, uuid: str, namespace: str, soft: int, hard: int) -> None:
        if not 0 <= soft <= hard <= MEMORY_LIMIT_MAX:
            # ctypes would store a value of 2^64 or more modulo 2^64: another cap than asked.
            raise nvml_error(NVML_ERROR_INVALID_ARGUMENT, SET_MEMORY_LIMITS, device=uuid,
                             detail=f"soft {soft} and hard {hard} bytes must satisfy "
                             f"0 <= soft <= hard <= {MEMORY_LIMIT_MAX}")
        p = self._pynvml
        limits = p.c_nvmlSetMemoryLimits_v1_t()
        limits.nameSpace = namespace.encode()
        limits.softLimit = soft
        limits.hardLimit = hard
        self._call(SET_MEMORY_LIMITS, p.nvmlDeviceSetMemoryLimits_v1, self._handle(uuid),
                   limits, device=uuid, cgroup=namespace)

    def clear_memory_limits(self, uuid: str, namespace: str) -> None:
        # One call: soft back to 0 (NVIDIA asks for that before a cgroup is deleted) and hard
        # back to "no limit".
        self.set_memory_limits(uuid, namespace, 0, MEMORY_LIMIT_MAX)

    def set_compute_mode(self, uuid: str, mode: GpuComputeMode) -> None:
        if mode is GpuComputeMode.EXCLUSIVE_THREAD:
            raise nvml_error(NVML_ERROR_NOT_SUPPORTED, "nvmlDeviceSetComputeMode", device=uuid)
        self._call("nvmlDeviceSetComputeMode", self._pynvml.nvmlDeviceSetComputeMode,
                   self._handle(uuid), int(mode), device=uuid)
