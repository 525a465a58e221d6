"""The test- and demo-facing side of `FakeNvml` (the `FakeNvmlControls` mixin): building the
fake from a GPU count or a config (dict, YAML), failing seam calls on request, adding,
allocating and freeing process memory, and reading back the calls made.

Apart from the seam itself (`nvml.py`: what the node agent calls, as the real NVML answers it):
none of this is NVML, only how a test or the demo sets the fake up and drives it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..contract import MIB, QuantityError, memory_bytes
from ..node.errors import (
    NVML_CODES_BY_NAME,
    ConfigError,
)
from ..node.nvml import (
    MEMORY_LIMIT_MAX,
    GpuComputeMode,
)
from .nvml_records import (
    _FUNCTIONS,
    DEFAULT_MODEL,
    GPU_MODELS,
    PROCESS_KINDS,
    CgroupTree,
    FakeGpu,
    FakeProcess,
    GpuOutOfMemory,
    NvmlCall,
    _Failure,
    _under,
    fake_uuid,
)

if TYPE_CHECKING:
    from .nvml import FakeNvml

_MODE_NAMES = {
    "default": GpuComputeMode.DEFAULT,
    "exclusive-process": GpuComputeMode.EXCLUSIVE_PROCESS,
    "exclusive_process": GpuComputeMode.EXCLUSIVE_PROCESS,
    "prohibited": GpuComputeMode.PROHIBITED,
}


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


def _code(error: str | int) -> int:
    if isinstance(error, int):
        return error
    if error not in NVML_CODES_BY_NAME:
        raise ConfigError(f"unknown NVML error {error!r}; one of: "
                          + ", ".join(NVML_CODES_BY_NAME))
    return NVML_CODES_BY_NAME[error]


class FakeNvmlControls:
    """`FakeNvml`'s construction and test controls; the state they use is `FakeNvml.__init__`'s."""

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
        /proc form `/kubepods.slice/...`, not /etc; else NVML_ERROR_INVALID_ARGUMENT) and
        present in `tree` (the one the node agent sees; else NVML_ERROR_OPERATING_SYSTEM, nvml.h's
        "the cgroup path cannot be opened"). A tree that tells of its removals
        (`FakeCgroupFs.on_remove`) clears the limits of each cgroup it removes, and below it, as
        removing a cgroup does (nvml.h)."""
        with self._lock:
            self.cgroup_root = root.rstrip("/") or "/"
            self.cgroup_tree = tree
            on_remove = getattr(tree, "on_remove", None)
            if on_remove is not None:
                on_remove(self._cgroup_removed)

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
