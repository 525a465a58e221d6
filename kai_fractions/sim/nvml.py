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
hard limit in force, or over the GPU's own memory. Memory-limit calls on a cgroup path are
refused the way the real library refuses a path that names no cgroup only when the fake knows
the node's cgroup tree (`use_cgroups`, opt-in: many tests name made-up paths).
"""

from __future__ import annotations

import hashlib
import threading
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ..contract import MIB, QuantityError, memory_bytes
from ..node.errors import (
    NVML_CODES_BY_NAME,
    NVML_ERROR_FUNCTION_NOT_FOUND,
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_ERROR_UNINITIALIZED,
    ConfigError,
    nvml_error,
)
from ..node.nvml import (
    GET_MEMORY_LIMITS,
    MEMORY_LIMIT_MAX,
    SET_MEMORY_LIMITS,
    DeviceInfo,
    GpuComputeMode,
    GpuProcess,
    MemoryLimits,
    ProcessUtilization,
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
    "process_utilization": "nvmlDeviceGetProcessUtilization",
    "memory_limits_supported": "nvmlDeviceGetMemoryLimits_v1",
    "get_memory_limits": GET_MEMORY_LIMITS,
    "set_memory_limits": SET_MEMORY_LIMITS,
    "clear_memory_limits": SET_MEMORY_LIMITS,
    "set_compute_mode": "nvmlDeviceSetComputeMode",
}
SEAM_METHODS = tuple(_FUNCTIONS)

_MODE_NAMES = {
    "default": GpuComputeMode.DEFAULT,
    "exclusive-process": GpuComputeMode.EXCLUSIVE_PROCESS,
    "exclusive_process": GpuComputeMode.EXCLUSIVE_PROCESS,
    "prohibited": GpuComputeMode.PROHIBITED,
}


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


def _flag(value: Any, where: str) -> bool:
    """A YAML boolean only: `mig: "false"` is a non-empty string, which bool() takes as true."""
    if not isinstance(value, bool):
        raise ConfigError(f"{where}: must be true or false (a YAML boolean, unquoted), got "
                          f"{value!r}")
    return value


def _memory(value: Any, where: str) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected bytes or a quantity such as 80Gi, got {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise ConfigError(f"{where}: must be greater than zero, got {value}")
        return value
    try:
        return memory_bytes(str(value))
    except QuantityError as e:
        raise ConfigError(f"{where}: {e} (got {value!r})") from None


def _under(cgroup: str, path: str) -> bool:
    """`cgroup` is `path` or below it (a cgroup v2 limit covers its whole subtree)."""
    base = path.rstrip("/")
    return bool(cgroup) and (cgroup.rstrip("/") == base or cgroup.startswith(base + "/"))


def _code(error: str | int) -> int:
    if isinstance(error, int):
        return error
    if error not in NVML_CODES_BY_NAME:
        raise ConfigError(f"unknown NVML error {error!r}; one of: "
                          + ", ".join(NVML_CODES_BY_NAME))
    return NVML_CODES_BY_NAME[error]


class FakeNvml:
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

    # -- construction -----------------------------------------------------------------------

    @classmethod
    def simulated(
        cls, count: int = 2, *, model: str = DEFAULT_MODEL, seed: str = "kai-fractions",
        **kwargs: Any,
    ) -> FakeNvml:
        """`count` identical GPUs of a known model (see GPU_MODELS) with stable UUIDs."""
        if model not in GPU_MODELS:
            raise ConfigError(f"unknown GPU model {model!r}; known: " + ", ".join(GPU_MODELS))
        name, total = GPU_MODELS[model]
        gpus = [FakeGpu(uuid=fake_uuid(seed, i), name=name, memory_total=total)
                for i in range(count)]
        return cls(gpus, **kwargs)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, seed: str = "kai-fractions") -> FakeNvml:
        """Build from a small dict (or parsed YAML); see the module docstring for the shape.

        gpus[]: model (a GPU_MODELS key) and/or name + memory (bytes or a quantity), count,
        uuid (only with count 1), compute_mode (default | exclusive-process | prohibited), mig.
        processes[]: gpu (index or UUID), pid, used (bytes, quantity or "na"), sm, mem, cgroup,
        kind (compute, the default; graphics; mps: `FakeProcess.kind`).
        """
        if not isinstance(data, Mapping):
            raise ConfigError("fake NVML config must be a mapping")
        known = {"driver_version", "memory_limits", "gpus", "processes", "seed"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"fake NVML config: unknown keys {unknown}; known: "
                              + ", ".join(sorted(known)))
        seed = str(data.get("seed", seed))
        gpus: list[FakeGpu] = []
        for n, entry in enumerate(data.get("gpus") or []):
            gpus.extend(cls._gpus_from(entry, f"gpus[{n}]", seed, len(gpus)))
        limits = data.get("memory_limits")
        if limits is not None and not isinstance(limits, bool):
            raise ConfigError(f"memory_limits: must be true or false, got {limits!r}")
        fake = cls(gpus, driver_version=str(data.get("driver_version", "615.00.00")),
                   memory_limits=limits)
        for n, entry in enumerate(data.get("processes") or []):
            fake.processes.append(fake._process_from(entry, f"processes[{n}]"))
        return fake

    @classmethod
    def from_yaml(cls, source: str | Path, *, seed: str = "kai-fractions") -> FakeNvml:
        """From YAML text, or from a file when given a Path."""
        import yaml

        text = source.read_text() if isinstance(source, Path) else source
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"fake NVML config is not valid YAML: {e}") from None
        return cls.from_dict(data, seed=seed)

    @staticmethod
    def _gpus_from(entry: Any, where: str, seed: str, first: int) -> list[FakeGpu]:
        if not isinstance(entry, Mapping):
            raise ConfigError(f"{where}: must be a mapping")
        known = {"model", "name", "memory", "count", "uuid", "compute_mode", "mig"}
        unknown = sorted(set(entry) - known)
        if unknown:
            raise ConfigError(f"{where}: unknown keys {unknown}; known: "
                              + ", ".join(sorted(known)))
        model = str(entry.get("model", DEFAULT_MODEL))
        if model not in GPU_MODELS:
            raise ConfigError(f"{where}.model: unknown GPU model {model!r}; known: "
                              + ", ".join(GPU_MODELS))
        name, total = GPU_MODELS[model]
        name = str(entry.get("name", name))
        if "memory" in entry:
            total = _memory(entry["memory"], f"{where}.memory")
            if total < MIB:  # NVML reports memory in whole MiB; a bare number is bytes
                raise ConfigError(f"{where}.memory: must be at least 1Mi (a bare number is "
                                  f"bytes: write 80Gi for 80 GiB), got {entry['memory']!r}")
        count = entry.get("count", 1)
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise ConfigError(f"{where}.count: must be a whole number >= 1, got {count!r}")
        if "uuid" in entry and count != 1:
            raise ConfigError(f"{where}: uuid can only be given with count 1")
        mig = _flag(entry.get("mig", False), f"{where}.mig")
        mode_name = str(entry.get("compute_mode", "default"))
        if mode_name not in _MODE_NAMES:
            raise ConfigError(f"{where}.compute_mode: one of default, exclusive-process, "
                              f"prohibited, got {mode_name!r}")
        return [
            FakeGpu(uuid=str(entry.get("uuid") or fake_uuid(seed, first + i)), name=name,
                    memory_total=total, compute_mode=_MODE_NAMES[mode_name],
                    mig=mig)
            for i in range(count)
        ]

    def _process_from(self, entry: Any, where: str) -> FakeProcess:
        if not isinstance(entry, Mapping):
            raise ConfigError(f"{where}: must be a mapping")
        for required in ("gpu", "pid", "used"):
            if required not in entry:
                raise ConfigError(f"{where}: {required} is required")
        gpu = entry["gpu"]
        if isinstance(gpu, int) and not isinstance(gpu, bool):
            if not 0 <= gpu < len(self.gpus):
                raise ConfigError(f"{where}.gpu: no GPU with index {gpu}")
            uuid = self.gpus[gpu].uuid
        else:
            uuid = str(gpu)
            if uuid not in {g.uuid for g in self.gpus}:
                raise ConfigError(f"{where}.gpu: no GPU {uuid}")
        used = None if entry["used"] == "na" else _memory(entry["used"], f"{where}.used")
        sm = entry.get("sm")
        kind = str(entry.get("kind", "compute"))
        if kind not in PROCESS_KINDS:
            raise ConfigError(f"{where}.kind: one of {', '.join(PROCESS_KINDS)}, got {kind!r}")
        return FakeProcess(pid=int(entry["pid"]), gpu=uuid, used_bytes=used,
                           sm_percent=None if sm is None else int(sm),
                           memory_percent=int(entry.get("mem", 0)),
                           cgroup=str(entry.get("cgroup", "")), kind=kind)

    # -- test controls ----------------------------------------------------------------------

    def fail(self, method: str, error: str | int = "Unknown", *, times: int | None = 1,
             device: str | None = None) -> None:
        """Make the next `times` calls of a seam method (None: all) raise this NVML error.

        `error` is an NVML error name (NoPermission, FunctionNotFound, GpuIsLost, ...) or an
        nvmlReturn_t; `device` limits the failure to calls on that GPU.
        """
        if method not in _FUNCTIONS:
            raise ConfigError(f"unknown seam method {method!r}; one of: " + ", ".join(_FUNCTIONS))
        with self._lock:
            self._failures.setdefault(method, []).append(
                _Failure(code=_code(error), remaining=times, device=device))

    def clear_failures(self) -> None:
        with self._lock:
            self._failures.clear()

    def use_cgroups(self, root: str, tree: CgroupTree) -> None:
        """From now on, a memory-limit call's cgroup must be a directory of the node's cgroup
        tree, named by its full sysfs path as the real library needs it: under `root` (not the
        /proc form `/kubepods.slice/...`, not /etc) and present in `tree` (the one the node
        agent sees). Else the call fails with NVML_ERROR_INVALID_ARGUMENT, as a path that names
        no cgroup v2 directory does."""
        with self._lock:
            self.cgroup_root = root.rstrip("/") or "/"
            self.cgroup_tree = tree

    def gpu(self, uuid_or_index: str | int) -> FakeGpu:
        if isinstance(uuid_or_index, int):
            return self.gpus[uuid_or_index]
        for g in self.gpus:
            if g.uuid == uuid_or_index:
                return g
        raise KeyError(uuid_or_index)

    def add_process(self, pid: int, gpu: str | int, used_bytes: int | None, **kw: Any) -> None:
        with self._lock:
            self.processes.append(FakeProcess(pid=pid, gpu=self.gpu(gpu).uuid,
                                              used_bytes=used_bytes, **kw))

    def over_hard_limit(self, pid: int, gpu: str | int, extra: int) -> GpuOutOfMemory | None:
        """Why the driver would refuse `extra` bytes more for process `pid` on `gpu`: the first
        hard limit in force on that GPU for its cgroup or a parent that it would exceed; None
        when nothing stops it."""
        with self._lock:
            uuid = self.gpu(gpu).uuid
            proc = next((p for p in self.processes if p.pid == pid and p.gpu == uuid), None)
            if proc is None:
                raise KeyError(f"no process {pid} on {uuid}")
            for (limit_gpu, path), (_soft, hard) in sorted(self.limits.items()):
                if limit_gpu != uuid or not _under(proc.cgroup, path):
                    continue
                used = sum(p.used_bytes or 0 for p in self.processes
                           if p.gpu == uuid and _under(p.cgroup, path))
                if used + extra > hard:
                    return GpuOutOfMemory(uuid, path, hard, used, extra)
            return None

    def allocate(self, pid: int, gpu: str | int, extra: int) -> None:
        """Process `pid` allocates `extra` bytes more on `gpu`, as its CUDA calls would: the
        driver refuses it (GpuOutOfMemory, nothing changes) when a cgroup hard limit in force
        would be exceeded (`over_hard_limit`), or the GPU's memory (what all its processes use,
        plus `extra`, over `memory_total`); else its usage grows. Not an NVML call (NVML
        only observes memory), so it is not recorded in `calls`."""
        with self._lock:
            refused = self.over_hard_limit(pid, gpu, extra)
            if refused is not None:
                raise refused
            device = self.gpu(gpu)
            uuid = device.uuid
            used = sum(p.used_bytes or 0 for p in self.processes if p.gpu == uuid)
            if used + extra > device.memory_total:
                raise GpuOutOfMemory(uuid, None, device.memory_total, used, extra)
            for p in self.processes:
                if p.pid == pid and p.gpu == uuid:
                    p.used_bytes = (p.used_bytes or 0) + extra

    def free(self, pid: int, gpu: str | int, nbytes: int) -> None:
        """Process `pid` frees `nbytes` of what it uses on `gpu`."""
        with self._lock:
            uuid = self.gpu(gpu).uuid
            for p in self.processes:
                if p.pid == pid and p.gpu == uuid:
                    p.used_bytes = max(0, (p.used_bytes or 0) - nbytes)

    def remove_process(self, pid: int) -> None:
        with self._lock:
            self.processes = [p for p in self.processes if p.pid != pid]

    def calls_of(self, method: str) -> list[NvmlCall]:
        with self._lock:  # a deque must not change while it is read
            return [c for c in self.calls if c.method == method]

    @property
    def set_limit_calls(self) -> list[tuple[str, str, int, int]]:
        """Every memory-limit write as (uuid, cgroup path, soft, hard), clears included."""
        out = []
        with self._lock:
            calls = list(self.calls)
        for c in calls:
            if c.method == "set_memory_limits":
                out.append(c.args)
            elif c.method == "clear_memory_limits":
                out.append((*c.args, 0, MEMORY_LIMIT_MAX))
        return out

    # -- the call frame ---------------------------------------------------------------------

    def _begin(self, method: str, *args: Any, device: str | None = None,
               needs_init: bool = True) -> None:
        self.calls.append(NvmlCall(method, args))
        for failure in self._failures.get(method, []):
            if failure.device is not None and failure.device != device:
                continue
            if failure.remaining is not None:
                if failure.remaining <= 0:
                    continue
                failure.remaining -= 1
            raise nvml_error(failure.code, _FUNCTIONS[method], device=device)
        if needs_init and self.initialized <= 0:
            raise nvml_error(NVML_ERROR_UNINITIALIZED, _FUNCTIONS[method], device=device)

    def _find(self, method: str, uuid: str, *, allow_lost: bool = False) -> FakeGpu:
        for g in self.gpus:
            if g.uuid == uuid:
                if g.lost and not allow_lost:
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
                raise nvml_error(NVML_ERROR_INVALID_ARGUMENT, _FUNCTIONS[method], device=uuid,
                                 detail=f"namespace {namespace!r}: no such cgroup")
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
        """The graphics processes, then the MPS clients listed apart (`FakeProcess.kind`)."""
        with self._lock:
            self._begin("other_processes", uuid, device=uuid)
            self._find("other_processes", uuid)
            return tuple(GpuProcess(pid=p.pid, used_bytes=p.used_bytes)
                         for kind in ("graphics", "mps") for p in self.processes
                         if p.gpu == uuid and p.kind == kind)

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
            self._begin("get_memory_limits", uuid, namespace, device=uuid)
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
            self._begin("set_memory_limits", uuid, namespace, soft, hard, device=uuid)
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
            self._begin("clear_memory_limits", uuid, namespace, device=uuid)
            self._limits_gpu("clear_memory_limits", uuid, namespace)
            self._store(uuid, namespace, 0, MEMORY_LIMIT_MAX)

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
