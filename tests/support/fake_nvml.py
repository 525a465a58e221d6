"""Python side of the fake NVML library (``tests/fakes/nvml``; format in its README.md).

``FakeNvml`` writes the config the C fake re-reads on every call, and parses the state file and
the call log it appends to. ``load_into_pynvml()`` points the REAL pynvml at a fake variant
in-process; ``FakeNvml.env()`` gives the environment for a subprocess instead.

Fixtures: ``fake_nvml`` (full library loaded into pynvml, env vars set with monkeypatch) and
``fake_nvml_old_driver`` (the same with the variant lacking the r615 memory-limit symbols).
Both start with no GPU: add them with ``add_gpu()`` (every change is written at once).
"""

from __future__ import annotations

import ctypes
import os
import uuid as uuid_mod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from urllib.parse import unquote

import pytest

from tests.support import tools

ENV_CONFIG = "KAI_FAKE_NVML_CONFIG"
ENV_STATE = "KAI_FAKE_NVML_STATE"
ENV_LOG = "KAI_FAKE_NVML_LOG"
MEMORY_LIMIT_MAX = 0xFFFFFFFFFFFFFFFF  # NVML_DEVICE_MEMORY_LIMIT_MAX
MIB = 1024 * 1024


@dataclass(frozen=True)
class FakeGpu:
    index: int
    uuid: str
    memory_bytes: int
    name: str = "NVIDIA H100 80GB HBM3"
    compute_mode: int = 0
    mig: bool = False
    lost: bool = False
    reserved_bytes: int = 0
    util_gpu: int | None = None
    util_memory: int = 0

    def line(self) -> str:
        parts = [
            "gpu",
            f"index={self.index}",
            f"uuid={self.uuid}",
            f"memory={self.memory_bytes}",
            f"reserved={self.reserved_bytes}",
            f"compute_mode={self.compute_mode}",
            f"mig={int(self.mig)}",
            f"lost={int(self.lost)}",
            f"util_memory={self.util_memory}",
        ]
        if self.util_gpu is not None:
            parts.append(f"util_gpu={self.util_gpu}")
        if not self.name.strip() or "\n" in self.name or "\r" in self.name:
            raise ValueError(f"a fake GPU name must be one non-empty line: {self.name!r}")
        if any(c.isspace() for c in self.uuid):
            raise ValueError(f"a fake GPU uuid cannot hold whitespace: {self.uuid!r}")
        parts.append(f"name={self.name}")
        return " ".join(parts)


@dataclass(frozen=True)
class FakeProcess:
    gpu_index: int
    pid: int
    used_bytes: int | None  # None -> "used=na" (pynvml reports usedGpuMemory=None)
    sm_util: int | None = None  # None -> no process-utilisation sample
    mem_util: int = 0
    cgroup: str | None = None

    def line(self) -> str:
        used = "na" if self.used_bytes is None else str(self.used_bytes)
        parts = [
            "process",
            f"gpu={self.gpu_index}",
            f"pid={self.pid}",
            f"used={used}",
            f"mem={self.mem_util}",
        ]
        if self.sm_util is not None:
            parts.append(f"sm={self.sm_util}")
        if self.cgroup is not None:
            if any(c.isspace() for c in self.cgroup):
                raise ValueError(
                    f"the fake cannot hold whitespace in a cgroup path: {self.cgroup!r}"
                )
            parts.append(f"cgroup={self.cgroup}")
        return " ".join(parts)


@dataclass(frozen=True)
class InjectedError:
    function: str
    code: int
    times: int | None  # None: forever
    id: str

    def line(self) -> str:
        times = "" if self.times is None else f" times={self.times}"
        return f"error {self.function} {self.code}{times} id={self.id}"


@dataclass(frozen=True)
class NvmlCall:
    """One line of the call log."""

    name: str  # "SetMemoryLimits", "SetComputeMode" or "Call" (trace)
    uuid: str | None  # None for trace lines; "-" when the handle was invalid
    args: tuple[str, ...]  # the remaining fields, namespace unescaped
    rc: int

    @property
    def ok(self) -> bool:
        return self.rc == 0


@dataclass(frozen=True)
class MemoryLimit:
    soft: int
    hard: int

    @property
    def cleared(self) -> bool:
        return self.soft == 0 and self.hard == MEMORY_LIMIT_MAX


@dataclass
class FakeNvml:
    """Config writer and state/log reader for one fake NVML instance in ``directory``."""

    directory: Path
    driver_version: str = "615.48.02"
    variant: str = "full"
    auto_write: bool = True  # write the config after every change
    trace: bool = False
    init_error: int | None = None
    gpus: list[FakeGpu] = field(default_factory=list)
    processes: list[FakeProcess] = field(default_factory=list)
    errors: list[InjectedError] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.directory = Path(self.directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        if self.auto_write:
            self.write()

    # -- paths --------------------------------------------------------------------------------
    @property
    def config_path(self) -> Path:
        return self.directory / "fake-nvml.conf"

    @property
    def state_path(self) -> Path:
        return Path(f"{self.config_path}.state")

    @property
    def log_path(self) -> Path:
        return Path(f"{self.config_path}.log")

    def library_path(self, variant: str | None = None) -> Path:
        return tools.fake_nvml_library(variant or self.variant)

    def env(
        self, variant: str | None = None, base: Mapping[str, str] | None = None
    ) -> dict[str, str]:
        """Environment for a subprocess that should load this fake by soname."""
        env = dict(os.environ if base is None else base)
        env[ENV_CONFIG] = str(self.config_path)
        env[ENV_STATE] = str(self.state_path)
        env[ENV_LOG] = str(self.log_path)
        lib_dir = str(self.library_path(variant).parent)
        old = env.get("LD_LIBRARY_PATH")
        env["LD_LIBRARY_PATH"] = f"{lib_dir}:{old}" if old else lib_dir
        return env

    # -- configuration ------------------------------------------------------------------------
    def add_gpu(
        self,
        uuid: str | None = None,
        memory_mib: int = 81920,
        name: str = "NVIDIA H100 80GB HBM3",
        compute_mode: int = 0,
        *,
        memory_bytes: int | None = None,
        mig: bool = False,
        lost: bool = False,
        reserved_bytes: int = 0,
        util_gpu: int | None = None,
        util_memory: int = 0,
    ) -> FakeGpu:
        index = len(self.gpus)
        gpu = FakeGpu(
            index=index,
            uuid=uuid or f"GPU-00000000-0000-0000-0000-{index + 1:012d}",
            memory_bytes=memory_bytes if memory_bytes is not None else memory_mib * MIB,
            name=name,
            compute_mode=compute_mode,
            mig=mig,
            lost=lost,
            reserved_bytes=reserved_bytes,
            util_gpu=util_gpu,
            util_memory=util_memory,
        )
        self.gpus.append(gpu)
        self._changed()
        return gpu

    def update_gpu(self, index: int, **changes: object) -> FakeGpu:
        """E.g. ``update_gpu(0, lost=True)`` or ``update_gpu(0, mig=True)``."""
        self.gpus[index] = replace(self.gpus[index], **changes)  # type: ignore[arg-type]
        self._changed()
        return self.gpus[index]

    def add_process(
        self,
        gpu_index: int,
        pid: int,
        used_bytes: int | None,
        *,
        sm_util: int | None = None,
        mem_util: int = 0,
        cgroup: str | None = None,
    ) -> FakeProcess:
        proc = FakeProcess(gpu_index, pid, used_bytes, sm_util, mem_util, cgroup)
        proc.line()  # validate now, not at write time
        self.processes.append(proc)
        self._changed()
        return proc

    def remove_process(self, pid: int) -> None:
        self.processes = [p for p in self.processes if p.pid != pid]
        self._changed()

    def clear_processes(self) -> None:
        self.processes = []
        self._changed()

    def inject_error(self, function: str, code: int, times: int | None = None) -> InjectedError:
        """``function`` is the exported C symbol (``nvmlDeviceSetMemoryLimits_v1``, not the
        pynvml name); ``code`` an ``nvmlReturn_t`` (e.g. ``pynvml.NVML_ERROR_NO_PERMISSION``).
        With ``times`` the error clears after that many calls (counted in the state file)."""
        if times is not None and times < 1:
            raise ValueError("times must be >= 1 (or None for forever)")
        err = InjectedError(function, int(code), times, f"{function}-{uuid_mod.uuid4().hex[:10]}")
        self.errors.append(err)
        self._changed()
        return err

    def clear_errors(self) -> None:
        self.errors = []
        self._changed()

    def set_init_error(self, code: int | None) -> None:
        self.init_error = None if code is None else int(code)
        self._changed()

    def set_driver_version(self, version: str) -> None:
        self.driver_version = version
        self._changed()

    def set_trace(self, enabled: bool = True) -> None:
        self.trace = enabled
        self._changed()

    def render(self) -> str:
        lines = ["# written by tests/support/fake_nvml.py", f"driver_version {self.driver_version}"]
        if self.init_error is not None:
            lines.append(f"init_error {self.init_error}")
        if self.trace:
            lines.append("trace 1")
        lines += [g.line() for g in self.gpus]
        lines += [p.line() for p in self.processes]
        lines += [e.line() for e in self.errors]
        return "\n".join(lines) + "\n"

    def write(self) -> Path:
        """Writes the config atomically (the fake may be reading it concurrently)."""
        tmp = self.config_path.with_name(self.config_path.name + ".tmp")
        tmp.write_text(self.render())
        os.replace(tmp, self.config_path)
        return self.config_path

    def _changed(self) -> None:
        if self.auto_write:
            self.write()

    # -- state and log ------------------------------------------------------------------------
    def _state_lines(self) -> list[list[str]]:
        if not self.state_path.exists():
            return []
        return [line.split() for line in self.state_path.read_text().splitlines() if line.strip()]

    def limit_history(self) -> list[tuple[str, str, MemoryLimit]]:
        """Every successful SetMemoryLimits, in order: (gpu uuid, namespace, limit)."""
        return [
            (f[1], unquote(f[2]), MemoryLimit(int(f[3]), int(f[4])))
            for f in self._state_lines()
            if f[0] == "limit" and len(f) == 5
        ]

    def limits(self, *, include_cleared: bool = False) -> dict[tuple[str, str], MemoryLimit]:
        """Effective limits per (gpu uuid, cgroup namespace) — the last record wins; cleared
        ones (soft 0, hard MAX) are left out unless ``include_cleared``."""
        result: dict[tuple[str, str], MemoryLimit] = {}
        for gpu_uuid, namespace, limit in self.limit_history():
            result[(gpu_uuid, namespace)] = limit
        if not include_cleared:
            result = {k: v for k, v in result.items() if not v.cleared}
        return result

    def compute_modes(self) -> dict[str, int]:
        """Persisted compute modes per gpu uuid (only GPUs whose mode was set)."""
        return {
            f[1]: int(f[2]) for f in self._state_lines() if f[0] == "compute_mode" and len(f) == 3
        }

    def error_hits(self, error: InjectedError | str) -> int:
        """How often a counted injected error fired (errors without ``times`` are not counted)."""
        err_id = error.id if isinstance(error, InjectedError) else error
        return sum(1 for f in self._state_lines() if f[:2] == ["error_hit", err_id])

    def calls(self, name: str | None = None) -> list[NvmlCall]:
        """The parsed call log (``name``: ``SetMemoryLimits``, ``SetComputeMode`` or ``Call``)."""
        if not self.log_path.exists():
            return []
        result = []
        for line in self.log_path.read_text().splitlines():
            fields = line.split()
            if not fields or not fields[-1].startswith("rc="):
                continue
            rc = int(fields[-1][3:])
            if fields[0] == "Call":
                call = NvmlCall("Call", None, (fields[1],), rc)
            else:
                call = NvmlCall(fields[0], fields[1], tuple(unquote(f) for f in fields[2:-1]), rc)
            if name is None or call.name == name:
                result.append(call)
        return result

    def reset_state(self) -> None:
        """Forget persisted limits, compute modes and error hits (as after a reboot)."""
        self.state_path.unlink(missing_ok=True)

    # -- in-process ---------------------------------------------------------------------------
    def activate(self, monkeypatch: pytest.MonkeyPatch, variant: str | None = None) -> ctypes.CDLL:
        """Points this process's env vars at this fake and loads ``variant`` into pynvml."""
        monkeypatch.setenv(ENV_CONFIG, str(self.config_path))
        monkeypatch.setenv(ENV_STATE, str(self.state_path))
        monkeypatch.setenv(ENV_LOG, str(self.log_path))
        return load_into_pynvml(self.library_path(variant))


def load_into_pynvml(library: Path | str) -> ctypes.CDLL:
    """Makes the REAL pynvml use ``library`` from now on (no nvmlInit done here).

    pynvml keeps the library in ``pynvml.nvmlLib`` and caches looked-up symbols in
    ``pynvml._nvmlGetFunctionPointer_cache``; both are replaced, so tests can switch between
    the full and the old-driver fake in one process. The fake's init refcount is reset.
    """
    import pynvml

    lib = ctypes.CDLL(str(library))
    if hasattr(lib, "fake_nvml_reset"):
        lib.fake_nvml_reset()
    with pynvml.libLoadLock:
        pynvml.nvmlLib = lib
        pynvml._nvmlGetFunctionPointer_cache.clear()
        pynvml._nvmlLib_refcount = 0
    return lib


def unload_from_pynvml() -> None:
    """Forgets the library in pynvml (the next nvmlInit loads ``libnvidia-ml.so.1`` by soname)."""
    import pynvml

    with pynvml.libLoadLock:
        lib = pynvml.nvmlLib
        pynvml.nvmlLib = None
        pynvml._nvmlGetFunctionPointer_cache.clear()
        pynvml._nvmlLib_refcount = 0
    if lib is not None and hasattr(lib, "fake_nvml_reset"):
        lib.fake_nvml_reset()


# ----------------------------------------------------------------------------------------------
# fixtures


def _fake_fixture(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, variant: str
) -> Iterator[FakeNvml]:
    fake = FakeNvml(tmp_path / f"fake-nvml-{variant}", variant=variant)
    fake.activate(monkeypatch)
    try:
        yield fake
    finally:
        unload_from_pynvml()


@pytest.fixture
def fake_nvml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeNvml]:
    """Full fake (r615 memory limits present), loaded into pynvml; no GPU yet."""
    yield from _fake_fixture(tmp_path, monkeypatch, "full")


@pytest.fixture
def fake_nvml_old_driver(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeNvml]:
    """Old-driver fake (no memory-limit symbols), loaded into pynvml; no GPU yet."""
    yield from _fake_fixture(tmp_path, monkeypatch, "old-driver")
