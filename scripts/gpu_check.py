"""Measures GPU enforcement on a real NVIDIA GPU (started by `scripts/gpu-check`; see there).

Driver side (`main`): reads the GPU's facts with nvidia-smi, starts ONE MPS control daemon in a
temporary pipe directory, runs client processes under it, stops it (and checks that no process
of it is left), then tries the r615 cgroup memory limit on a temporary cgroup. Client side
(`python gpu_check.py client ...`): one allocation or one matrix-multiply loop in its own
process, with PyTorch, else CuPy; a small CUDA C program built with nvcc stands in for both.

It never changes the GPU's compute mode or MIG settings: it reports them and says what works.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

MIB = 1 << 20
REPO = Path(__file__).resolve().parent.parent
CLIENT_TIMEOUT_S = 180
SMI_FIELDS = ("name", "driver_version", "compute_mode", "mig.mode.current", "memory.total",
              "uuid")


# -- facts ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GpuFacts:
    index: int
    name: str
    driver: str
    compute_mode: str
    mig_mode: str
    memory_total: str
    uuid: str


def parse_smi(line: str, index: int) -> GpuFacts:
    """One line of `nvidia-smi --query-gpu=<SMI_FIELDS> --format=csv,noheader`."""
    values = [v.strip() for v in line.split(",")]
    if len(values) != len(SMI_FIELDS):
        raise ValueError(f"unexpected nvidia-smi line: {line!r}")
    name, driver, mode, mig, memory, uuid = values
    return GpuFacts(index, name, driver, mode, mig, memory, uuid)


def gpu_facts(smi: str, index: int) -> GpuFacts:
    out = subprocess.run([smi, f"--query-gpu={','.join(SMI_FIELDS)}", "--format=csv,noheader",
                          "-i", str(index)], capture_output=True, text=True, timeout=60,
                         check=True).stdout
    return parse_smi(out.strip().splitlines()[0], index)


def backend() -> str:
    """torch, cupy, nvcc, or "" (none): what the clients compute with."""
    for module in ("torch", "cupy"):
        if importlib.util.find_spec(module) is not None:
            return module
    return "nvcc" if shutil.which("nvcc") else ""


def has_memory_limits(library: str = "libnvidia-ml.so.1") -> bool:
    """The driver's NVML exports nvmlDeviceSetMemoryLimits_v1 (r615+)."""
    try:
        return hasattr(ctypes.CDLL(library), "nvmlDeviceSetMemoryLimits_v1")
    except OSError:
        return False


def ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else float("nan")


# -- the CUDA C stand-in (no PyTorch, no CuPy) ------------------------------------------------

CUDA_SOURCE = r"""
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <sys/stat.h>
#include <unistd.h>
#include <cuda_runtime.h>
#define T 16
__global__ void mm(const float* a, const float* b, float* c, int n) {
  __shared__ float as[T][T], bs[T][T];
  int r = blockIdx.y * T + threadIdx.y, col = blockIdx.x * T + threadIdx.x;
  float s = 0;
  for (int k = 0; k < n; k += T) {
    as[threadIdx.y][threadIdx.x] = a[r * n + k + threadIdx.x];
    bs[threadIdx.y][threadIdx.x] = b[(k + threadIdx.y) * n + col];
    __syncthreads();
    for (int i = 0; i < T; ++i) s += as[threadIdx.y][i] * bs[i][threadIdx.x];
    __syncthreads();
  }
  c[r * n + col] = s;
}
static double now() {
  timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9;
}
static void wait_go(const char* ready, const char* go) {
  if (!strcmp(ready, "-")) return;
  FILE* f = fopen(ready, "w"); if (f) fclose(f);
  struct stat st; double t = now();
  while (stat(go, &st)) { if (now() - t > 300) exit(3); usleep(10000); }
}
int main(int argc, char** argv) {
  if (argc == 3 && !strcmp(argv[1], "alloc")) {
    size_t bytes = strtoull(argv[2], 0, 10), fr = 0, tot = 0; void* p = 0;
    cudaError_t e = cudaMemGetInfo(&fr, &tot);
    if (e == cudaSuccess) e = cudaMalloc(&p, bytes);
    if (e == cudaSuccess) e = cudaMemset(p, 1, bytes);
    if (e == cudaSuccess) e = cudaDeviceSynchronize();
    printf("{\"ok\": %s, \"oom\": %s, \"error\": \"%s\", \"total\": %zu, \"free\": %zu}\n",
           e ? "false" : "true", e == cudaErrorMemoryAllocation ? "true" : "false",
           e ? cudaGetErrorString(e) : "", tot, fr);
    return e == cudaSuccess ? 0 : e == cudaErrorMemoryAllocation ? 1 : 2;
  }
  if (argc == 6 && !strcmp(argv[1], "matmul")) {
    double seconds = atof(argv[2]); int n = atoi(argv[3]);
    float *a, *b, *c; size_t sz = (size_t)n * n * sizeof(float);
    if (cudaMalloc(&a, sz) || cudaMalloc(&b, sz) || cudaMalloc(&c, sz)) {
      printf("{\"ok\": false, \"error\": \"cudaMalloc failed\"}\n"); return 2; }
    cudaMemset(a, 0, sz); cudaMemset(b, 0, sz);
    dim3 blk(T, T), grd(n / T, n / T);
    mm<<<grd, blk>>>(a, b, c, n); cudaDeviceSynchronize();
    wait_go(argv[4], argv[5]);
    double t0 = now(); long it = 0;
    do { mm<<<grd, blk>>>(a, b, c, n); mm<<<grd, blk>>>(a, b, c, n); it += 2;
         cudaDeviceSynchronize(); } while (now() - t0 < seconds);
    double el = now() - t0; cudaError_t e = cudaGetLastError();
    printf("{\"ok\": %s, \"iterations\": %ld, \"seconds\": %.4f, \"tflops\": %.4f, "
           "\"error\": \"%s\"}\n", e ? "false" : "true", it, el,
           2.0 * n * n * (double)n * it / el / 1e12, e ? cudaGetErrorString(e) : "");
    return e ? 2 : 0;
  }
  fprintf(stderr, "usage: gpu-check-client alloc BYTES | matmul SECONDS N READY GO\n");
  return 2;
}
"""


# -- client side (one process per measurement) ------------------------------------------------

def _emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def _is_oom(error: BaseException) -> bool:
    text = f"{type(error).__name__} {error}".lower()
    return "out of memory" in text or "outofmemory" in text or "memoryallocation" in text


def client_alloc(nbytes: int, which: str) -> int:
    """Exit 0: allocated and touched `nbytes`; 1: out of memory; 2: anything else."""
    total = free = 0
    try:
        if which == "torch":
            import torch

            free, total = torch.cuda.mem_get_info()
            block = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            block.fill_(1)
            torch.cuda.synchronize()
        else:
            import cupy

            free, total = cupy.cuda.runtime.memGetInfo()
            block = cupy.empty(nbytes, dtype=cupy.uint8)
            block.fill(1)
            cupy.cuda.runtime.deviceSynchronize()
    except Exception as e:  # the point is to report any failure as a value
        oom = _is_oom(e)
        _emit({"ok": False, "oom": oom, "error": f"{type(e).__name__}: {str(e)[:300]}",
               "total": total, "free": free})
        return 1 if oom else 2
    _emit({"ok": True, "oom": False, "error": "", "total": total, "free": free})
    return 0


def _wait_go(ready: str, go: str) -> None:
    if ready == "-":
        return
    Path(ready).touch()
    deadline = time.monotonic() + 300
    while not Path(go).exists():
        if time.monotonic() > deadline:
            raise SystemExit(3)
        time.sleep(0.01)


def client_matmul(seconds: float, n: int, ready: str, go: str, which: str) -> int:
    if which == "torch":
        import torch

        a = torch.randn(n, n, device="cuda", dtype=torch.float16)
        b = torch.randn(n, n, device="cuda", dtype=torch.float16)

        def step() -> None:
            torch.matmul(a, b)

        sync = torch.cuda.synchronize
    else:
        import cupy

        a = cupy.random.standard_normal((n, n), dtype=cupy.float32).astype(cupy.float16)
        b = cupy.random.standard_normal((n, n), dtype=cupy.float32).astype(cupy.float16)

        def step() -> None:
            cupy.matmul(a, b)

        sync = cupy.cuda.runtime.deviceSynchronize
    for _ in range(5):
        step()
    sync()
    _wait_go(ready, go)
    iterations, start = 0, time.perf_counter()
    while True:
        for _ in range(4):
            step()
        iterations += 4
        sync()
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            break
    _emit({"ok": True, "iterations": iterations, "seconds": round(elapsed, 4),
           "tflops": round(2 * n**3 * iterations / elapsed / 1e12, 4), "error": ""})
    return 0


# -- driver side ------------------------------------------------------------------------------

@dataclass
class Report:
    lines: list[str] = field(default_factory=list)
    checks: list[tuple[str, bool | None]] = field(default_factory=list)

    def say(self, text: str = "") -> None:
        print(text, flush=True)
        self.lines.append(text)

    def check(self, name: str, passed: bool | None, detail: str) -> None:
        verdict = {True: "PASS", False: "FAIL", None: "SKIP"}[passed]
        self.checks.append((name, passed))
        self.say(f"[{verdict}] {name}: {detail}")


class Clients:
    """Starts client processes; each prints one JSON line."""

    def __init__(self, which: str, workdir: Path, gpu: int) -> None:
        self.which = which
        self.workdir = workdir
        self.gpu = gpu
        self.binary: Path | None = None
        if which == "nvcc":
            source = workdir / "gpu_check_client.cu"
            source.write_text(CUDA_SOURCE)
            self.binary = workdir / "gpu-check-client"
            subprocess.run(["nvcc", "-O2", "-o", str(self.binary), str(source)], check=True,
                           timeout=240)

    def argv(self, *args: str) -> list[str]:
        if self.binary is not None:
            return [str(self.binary), *args]
        return [sys.executable, str(Path(__file__).resolve()), "client", "--backend",
                self.which, *args]

    def env(self, extra: dict[str, str], mps_pipe: Path | None) -> dict[str, str]:
        env = {key: value for key, value in os.environ.items()
               if not key.startswith("CUDA_MPS_")}
        env["CUDA_VISIBLE_DEVICES"] = str(self.gpu)
        if mps_pipe is not None:
            env["CUDA_MPS_PIPE_DIRECTORY"] = str(mps_pipe)
        else:
            # No MPS: a pipe directory where no daemon listens, so a daemon some other user
            # runs in the default one (/tmp/nvidia-mps) is not picked up by accident.
            env["CUDA_MPS_PIPE_DIRECTORY"] = str(self.workdir / "no-mps")
        env.update(extra)
        return env

    def start(self, args: list[str], extra: dict[str, str], mps_pipe: Path | None,
              prefix: list[str] | None = None) -> subprocess.Popen:
        return subprocess.Popen([*(prefix or []), *self.argv(*args)],
                                env=self.env(extra, mps_pipe), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    @staticmethod
    def result(process: subprocess.Popen) -> tuple[int, dict]:
        try:
            out, err = process.communicate(timeout=CLIENT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            out, err = process.communicate()
            return 124, {"ok": False, "error": f"timed out after {CLIENT_TIMEOUT_S} s"}
        for line in reversed(out.strip().splitlines()):
            with contextlib.suppress(ValueError):
                return process.returncode, json.loads(line)
        return process.returncode, {"ok": False, "error": (err or out).strip()[-400:]}

    def run(self, args: list[str], extra: dict[str, str], mps_pipe: Path | None,
            prefix: list[str] | None = None) -> tuple[int, dict]:
        return self.result(self.start(args, extra, mps_pipe, prefix))


def _pids_with_env(name: str, value: str) -> list[int]:
    """Processes whose environment has name=value (the daemon and servers WE started)."""
    wanted = f"{name}={value}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if wanted in (entry / "environ").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
    return pids


@contextlib.contextmanager
def mps_daemon(control: str, workdir: Path, gpu: int, report: Report) -> Iterator[Path]:
    """One MPS control daemon with its own pipe and log directories; stopped on the way out,
    every process of it included (only ours: found by our pipe directory)."""
    pipe, logs = workdir / "mps-pipe", workdir / "mps-log"
    pipe.mkdir()
    logs.mkdir()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("CUDA_MPS_")},
           "CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(logs),
           "CUDA_VISIBLE_DEVICES": str(gpu)}
    subprocess.run([control, "-d"], env=env, check=True, timeout=30)
    try:
        deadline = time.monotonic() + 10
        while not (pipe / "control").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        report.say(f"MPS control daemon started (pipe directory {pipe})")
        yield pipe
    finally:
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            subprocess.run([control], input="quit\n", env=env, text=True, timeout=30,
                           capture_output=True)
        deadline = time.monotonic() + 15
        while (left := _pids_with_env("CUDA_MPS_PIPE_DIRECTORY", str(pipe))) and \
                time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in left:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        left = _pids_with_env("CUDA_MPS_PIPE_DIRECTORY", str(pipe))
        report.say("MPS control daemon stopped" + (
            f"; STILL RUNNING: {left}" if left else "; no process of it is left"))
        log = logs / "control.log"
        if log.exists():
            tail = log.read_text(errors="replace").strip().splitlines()[-5:]
            report.say("MPS control.log (last lines): " + " | ".join(tail))


def check_mps(report: Report, clients: Clients, control: str, workdir: Path, gpu: int,
              limit_mib: int, seconds: float, size: int) -> None:
    with mps_daemon(control, workdir, gpu, report) as pipe:
        code, probe = clients.run(["alloc", str(MIB)], {}, pipe)
        if code != 0:
            report.check("MPS client starts", False, f"a 1 MiB allocation under MPS failed "
                         f"(exit {code}): {probe.get('error')}; (1)-(3) not measured")
            return
        report.check("MPS client starts", True, "a client connected and allocated 1 MiB")

        # (1) pinned device memory limit
        pinned = {"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={limit_mib}M"}
        below = (limit_mib - 256) * MIB
        code_below, low = clients.run(["alloc", str(below)], pinned, pipe)
        code_above, high = clients.run(["alloc", str((limit_mib + 1) * MIB)], pinned, pipe)
        report.check(
            f"(1) pinned limit {limit_mib} MiB: {limit_mib - 256} MiB fits",
            code_below == 0, f"exit {code_below}; client saw total "
            f"{int(low.get('total', 0)) // MIB} MiB; {low.get('error') or 'allocated'}")
        report.check(
            f"(1) pinned limit {limit_mib} MiB: {limit_mib + 1} MiB refused",
            code_above == 1, f"exit {code_above}; {high.get('error') or 'ALLOCATED'}")

        # (2) active-thread percentage 100 vs 50, one client at a time
        def matmul(pct: int, ready: str = "-", go: str = "-") -> subprocess.Popen:
            return clients.start(["matmul", str(seconds), str(size), ready, go],
                                 {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(pct)}, pipe)

        _, full = Clients.result(matmul(100))
        _, half = Clients.result(matmul(50))
        if not (full.get("ok") and half.get("ok")):
            report.check("(2) matmul clients", False, f"100%: {full}; 50%: {half}")
            return
        r = ratio(half["tflops"], full["tflops"])
        report.check("(2) active-thread percentage 50 vs 100", 0.35 <= r <= 0.75,
                     f"{half['tflops']:.2f} vs {full['tflops']:.2f} TFLOPS, ratio {r:.2f} "
                     "(expected about 0.5; PASS within 0.35..0.75)")

        # (3) two clients at 50% side by side vs one at 100%
        go = workdir / "go"
        readies = [workdir / f"ready-{i}" for i in range(2)]
        pair = [matmul(50, str(ready), str(go)) for ready in readies]
        deadline = time.monotonic() + CLIENT_TIMEOUT_S
        while not all(r.exists() for r in readies) and time.monotonic() < deadline:
            if any(p.poll() is not None for p in pair):
                break
            time.sleep(0.02)
        go.touch()
        both = [Clients.result(p)[1] for p in pair]
        if not all(b.get("ok") for b in both):
            report.check("(3) two clients at 50%", False, f"{both}")
            return
        total = sum(b["tflops"] for b in both)
        r = ratio(total, full["tflops"])
        report.check("(3) two clients at 50% side by side vs one at 100%", r >= 0.8,
                     f"{both[0]['tflops']:.2f} + {both[1]['tflops']:.2f} = {total:.2f} vs "
                     f"{full['tflops']:.2f} TFLOPS, ratio {r:.2f} (PASS >= 0.8)")


def fresh_cgroup_answer(uuid: str, group: str) -> str:
    """What the driver answers for a cgroup no limit was ever set on (nvml.h documents
    NVML_ERROR_NOT_FOUND; the node agent reads that as "no limit"). NVML must be initialized."""
    import pynvml

    limits = pynvml.c_nvmlGetMemoryLimits_v1_t()
    limits.nameSpace = group.encode()
    try:
        pynvml.nvmlDeviceGetMemoryLimits_v1(pynvml.nvmlDeviceGetHandleByUUID(uuid), limits)
    except pynvml.NVMLError as e:
        return f"{type(e).__name__} ({e.value})"
    return f"success: soft {limits.softLimit}, hard {limits.hardLimit}"


def check_cgroup_limit(report: Report, clients: Clients, facts: GpuFacts, limit_mib: int,
                       control: str | None, workdir: Path) -> None:
    name = "(4) cgroup hard limit (nvmlDeviceSetMemoryLimits_v1)"
    if not has_memory_limits():
        report.check(name, None, f"driver {facts.driver} has no nvmlDeviceSetMemoryLimits_v1 "
                     "(needs r615 or newer)")
        return
    root = Path(os.environ.get("GPU_CHECK_CGROUP_ROOT", "/sys/fs/cgroup"))
    if not (root / "cgroup.controllers").exists():
        report.check(name, None, f"{root} is not a cgroup v2 mount")
        return
    if os.geteuid() != 0 or not os.access(root, os.W_OK):
        report.check(name, None, f"{root} is not writable here (memory limits need root)")
        return
    try:
        sys.path.insert(0, str(REPO))
        from kai_fractions.node.nvml import PynvmlNvml
    except ImportError as e:
        report.check(name, None, f"kai_fractions / nvidia-ml-py not importable: {e}")
        return
    group = root / f"kf-gpu-check-{os.getpid()}"
    try:
        group.mkdir()
    except OSError as e:
        report.check(name, None, f"cannot create {group}: {e.strerror or e}")
        return
    nvml = PynvmlNvml()
    nvml.init()
    try:
        report.say(f"cgroup {group} before any limit: "
                   f"{fresh_cgroup_answer(facts.uuid, str(group))}")
        hard = limit_mib * MIB
        nvml.set_memory_limits(facts.uuid, str(group), hard // 2, hard)
        limits = nvml.get_memory_limits(facts.uuid, str(group))
        report.say(f"cgroup {group}: soft {limits.soft // MIB} MiB, hard {limits.hard // MIB} "
                   "MiB set")
        join = ["sh", "-c", f'echo $$ > "{group}/cgroup.procs" && exec "$0" "$@"']
        code_below, low = clients.run(["alloc", str((limit_mib - 256) * MIB)], {}, None, join)
        code_above, high = clients.run(["alloc", str((limit_mib + 1) * MIB)], {}, None, join)
        report.check(f"{name}: {limit_mib - 256} MiB fits", code_below == 0,
                     f"exit {code_below}; client saw total {int(low.get('total', 0)) // MIB} "
                     f"MiB; {low.get('error') or 'allocated'}")
        report.check(f"{name}: {limit_mib + 1} MiB refused", code_above == 1,
                     f"exit {code_above}; {high.get('error') or 'ALLOCATED'}")
        if control is not None:
            # An MPS client's memory is allocated by the MPS server, which runs in the
            # daemon's cgroup: does the client's own cgroup limit still hold it?
            (workdir / "cgroup-mps").mkdir()
            with mps_daemon(control, workdir / "cgroup-mps", facts.index, report) as pipe:
                code_mps, mps = clients.run(["alloc", str((limit_mib + 1) * MIB)], {}, pipe,
                                            join)
            report.check(f"{name}: {limit_mib + 1} MiB refused to an MPS client in the cgroup",
                         code_mps == 1, f"exit {code_mps}; {mps.get('error') or 'ALLOCATED'}")
    except Exception as e:  # report, then clean up
        report.check(name, False, f"{type(e).__name__}: {e}")
    finally:
        with contextlib.suppress(Exception):
            nvml.clear_memory_limits(facts.uuid, str(group))
        with contextlib.suppress(Exception):
            nvml.shutdown()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.2)
        report.say(f"cgroup {group} " + ("still there!" if group.exists() else "removed"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/gpu-check", description=__doc__)
    sub = parser.add_subparsers(dest="command")
    client = sub.add_parser("client")
    client.add_argument("--backend", choices=("torch", "cupy"), required=True)
    client.add_argument("mode", choices=("alloc", "matmul"))
    client.add_argument("args", nargs="*")
    parser.add_argument("--gpu", type=int, default=0, help="GPU index (default: %(default)s)")
    parser.add_argument("--limit-mib", type=int, default=4096,
                        help="the memory limit L tried (default: %(default)s)")
    parser.add_argument("--seconds", type=float, default=6.0,
                        help="length of each matmul measurement (default: %(default)s)")
    parser.add_argument("--size", type=int, default=8192, help="matrix size (default: 8192)")
    parser.add_argument("--save", action="store_true",
                        help="also write benchmarks/results/gpu-check-<date>-<driver>.txt")
    parser.add_argument("--nvidia-smi", default=os.environ.get("NVIDIA_SMI", "nvidia-smi"))
    parser.add_argument("--mps-control", default=os.environ.get(
        "MPS_CONTROL", "nvidia-cuda-mps-control"))
    args = parser.parse_args(argv)
    if args.command == "client":
        if args.mode == "alloc":
            return client_alloc(int(args.args[0]), args.backend)
        seconds, size, ready, go = args.args
        return client_matmul(float(seconds), int(size), ready, go, args.backend)

    report = Report()
    started = datetime.datetime.now(datetime.UTC)
    try:
        facts = gpu_facts(args.nvidia_smi, args.gpu)
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as e:
        print(f"gpu-check: no usable NVIDIA GPU {args.gpu}: {e}", file=sys.stderr)
        return 3
    which = backend()
    report.say(f"gpu-check {started.isoformat(timespec='seconds')}")
    report.say(f"GPU {facts.index}: {facts.name} ({facts.uuid}), {facts.memory_total}, driver "
               f"{facts.driver}, compute mode {facts.compute_mode}, MIG {facts.mig_mode}")
    report.say(f"client backend: {which or 'none'}; python {sys.version.split()[0]}")
    if facts.compute_mode.replace(" ", "_").upper() != "EXCLUSIVE_PROCESS":
        report.say(f"note: compute mode is {facts.compute_mode}, not EXCLUSIVE_PROCESS (left "
                   "as it is): MPS runs for one user beside non-MPS processes; the node agent "
                   "sets EXCLUSIVE_PROCESS on its own nodes")
    if facts.mig_mode.lower() == "enabled":
        report.say("note: MIG is enabled (left as it is): MPS and memory limits apply per MIG "
                   "instance, and cgroup limits do not support MIG handles")
    if not which:
        report.check("client backend", False, "no PyTorch, CuPy or nvcc: nothing can allocate "
                     "GPU memory or run a matmul here")
    else:
        with tempfile.TemporaryDirectory(prefix="kf-gpu-check-") as tmp:
            workdir = Path(tmp)
            clients = Clients(which, workdir, args.gpu)
            control = shutil.which(args.mps_control)
            if control is None:
                report.check("MPS", False, f"{args.mps_control} not found; (1)-(3) not measured")
            else:
                check_mps(report, clients, args.mps_control, workdir, args.gpu, args.limit_mib,
                          args.seconds, args.size if which != "nvcc" else 4096)
            check_cgroup_limit(report, clients, facts, args.limit_mib, control, workdir)
    took = (datetime.datetime.now(datetime.UTC) - started).total_seconds()
    failed = [name for name, passed in report.checks if passed is False]
    report.say(f"done in {took:.0f} s: {sum(p is True for _, p in report.checks)} passed, "
               f"{len(failed)} failed, {sum(p is None for _, p in report.checks)} skipped")
    if args.save:
        out = REPO / "benchmarks" / "results" / (
            f"gpu-check-{started:%Y%m%d}-{facts.driver}.txt")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("\n".join(report.lines) + "\n")
        print(f"wrote {out.relative_to(REPO)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
