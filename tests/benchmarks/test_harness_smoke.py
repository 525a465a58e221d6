"""The benchmark harness runs: each benchmark in its smallest mode produces well-formed figures,
and `scripts/gpu-check` refuses to run without a GPU and cleans up what it starts.

No timing is asserted anywhere: these machines are noisy and a benchmark is no pass/fail test.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from benchmarks import bench_agent_steady, bench_contract, bench_mirror, bench_node, run
from benchmarks.harness import Result
from tests.support import tools

REPO = Path(__file__).resolve().parents[2]
GPU_CHECK = REPO / "scripts" / "gpu-check"


def assert_well_formed(result: Result, benchmark: str, *names: str) -> None:
    assert result.benchmark == benchmark
    assert result.title
    assert result.figures, "no figures"
    seen = [f.name for f in result.figures]
    assert len(seen) == len(set(seen)), f"duplicate figure names: {seen}"
    for f in result.figures:
        assert f.name and f.unit, f
        assert isinstance(f.value, int | float) and math.isfinite(f.value), f
        assert f.value >= 0, f
        if f.target:
            assert f.met in (True, False), f  # the target parses
        else:
            assert f.met is None
    for name in names:
        assert name in seen, f"{name!r} missing from {seen}"
    json.dumps(result.to_dict())


# -- benchmarks -------------------------------------------------------------------------------

def test_p1_mirror_overhead_smoke():
    result = bench_mirror.run(quick=True, smoke=True)
    assert_well_formed(
        result, "P1",
        "(a2) gRPC echo, aio p50, c=1", "(b) bare PATCH, aiohttp p99, c=16",
        "(b2) bare GET+PATCH, aiohttp rate, c=1", "(d2) aio echo + KubePodStore PATCH p50, c=1",
        "(c) MirrorAllocation p99, c=1", "(c) MirrorAllocation rate, c=16",
        "(c) MirrorAllocation p99, c=16", "ratio c/(a2+b), c=1", "ratio c/(a2+b), c=16",
        "ratio c/d2, c=16", "(d3) aio echo + bare aiohttp PATCH p50, c=1",
        "ratio d3/(a2+b), c=1", "mirror CPU per allocation, c=16",
        "stub CPU per API request, c=1")
    targets = {f.name: f.target for f in result.figures if f.target}
    assert targets == {"ratio c/(a2+b), c=1": "<= 1.2",
                       "(c) MirrorAllocation rate, c=16": ">= 800",
                       "(c) MirrorAllocation p99, c=16": "< 25"}
    # (a) and (d), the thread-pool baselines, are gone with the official client
    assert not any(f.name.startswith(("(a) ", "(d) ")) for f in result.figures)


def test_p1_bare_patch_is_the_guarded_merge_patch(tmp_path, monkeypatch):
    """(b) and (b2) write what the mirror writes with aiohttp, guarded by the pod's uid (and
    (b2) by the resourceVersion it read): a patch for another uid is refused."""
    import aiohttp

    from benchmarks.stub_apiserver import kubeconfig, pod_uid, running

    with running(bench_mirror.POD_TEMPLATE) as url:
        config = kubeconfig(url, tmp_path / "kubeconfig")
        for read_first in (False, True):
            patch = bench_mirror.BarePatch(config, {"kai-fractions.io/x": str(read_first)},
                                           read_first=read_first)
            try:
                latencies, wall = patch.measure(f"ns{read_first}", ["p1", "p2", "p3"], 2)
                assert len(latencies) == 3 and wall > 0
                written = patch.loop.run_until_complete(patch.patch("ns", "p4"))
                assert written["metadata"]["annotations"]["kai-fractions.io/x"] == str(read_first)
                assert written["metadata"]["uid"] == pod_uid("ns", "p4")
                monkeypatch.setattr(bench_mirror, "pod_uid", lambda namespace, name: "another")
                with pytest.raises(aiohttp.ClientResponseError) as refused:
                    patch.loop.run_until_complete(patch.patch("ns", "p4"))
                assert refused.value.status == 409
                monkeypatch.undo()
            finally:
                patch.close()


def mps_daemons() -> set[int]:
    """Pids of MPS control daemons running now (any user's, any pipe directory)."""
    found = set()
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue  # not a process, or gone meanwhile
        if argv[0].endswith(b"nvidia-cuda-mps-control") and b"-d" in argv:
            found.add(int(entry.name))
    return found


@pytest.fixture
def no_daemon_left():
    """A benchmark stops every MPS daemon it starts (its agent's)."""
    before = mps_daemons()
    yield
    assert mps_daemons() - before == set()


def test_mirror_cache_comparison_smoke(capsys):
    bench_mirror.compare_cache(count=6)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" calls/s")[0].split()[-1].isdigit() for line in lines] == [True] * 6
    assert sum("mirror CPU" in line for line in lines) == 4


def test_mirror_tree_comparison_smoke(capsys):
    # This checkout against itself: two mirror processes, each importing from its own tree.
    bench_mirror.compare_tree(bench_mirror.REPO, count=6, rounds=2)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and all("p50" in line and "mirror CPU" in line for line in lines)
    assert sum("this tree" in line for line in lines) == 2


def test_p2_node_convergence_smoke(no_daemon_left):
    result = bench_node.run(smoke=True)
    assert_well_formed(result, "P2", "one pod p50", "one pod p99", "10 pods at once: last marker",
                       "10 pods at once: passes")
    figures = {f.name: f for f in result.figures}
    assert figures["one pod p99"].target == "<= 100"
    assert figures["10 pods at once: passes"].value >= 1


def test_p3_agent_steady_state_smoke(no_daemon_left):
    result = bench_agent_steady.run(smoke=True)
    assert_well_formed(result, "P3", "CPU, agent process", "peak RSS", "watchdog CPU per check")
    figures = {f.name: f for f in result.figures}
    assert (figures["CPU, agent process"].target, figures["peak RSS"].target) == ("<= 1", "<= 80")
    assert figures["containers with usage seen"].value == 10  # the watchdog saw every process
    assert figures["peak RSS"].value > 0


def test_p4_contract_throughput_smoke():
    assert_well_formed(bench_contract.run(quick=True), "P4", "pods per second",
                       "time per parse, 4,500 stray compute modes (admitted)",
                       "time per parse, 4,500 stray compute modes (refused)")


def test_runner_prints_a_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "results.json"
    assert run.main(["P4", "--quick", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "pods per second" in table.splitlines()[1]
    written = json.loads(out.read_text())
    assert written["quick"] is True
    assert [r["benchmark"] for r in written["results"]] == ["P4"]
    assert {"python", "cpus", "cpu_model", "platform"} <= set(written["machine"])


def test_runner_smoke_runs_quick_where_a_benchmark_has_no_smoke_mode(tmp_path, capsys):
    out = tmp_path / "results.json"
    assert run.main(["P4", "--smoke", "--json", str(out)]) == 0
    assert "pods per second" in capsys.readouterr().out
    written = json.loads(out.read_text())
    assert (written["smoke"], written["quick"]) == (True, True)


def test_runner_refuses_an_unknown_benchmark(capsys):
    with pytest.raises(SystemExit) as exit_:
        run.main(["P9"])
    assert exit_.value.code == 2
    assert "unknown benchmark(s): P9" in capsys.readouterr().err


# -- scripts/gpu-check ------------------------------------------------------------------------

def _gpu_check(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(GPU_CHECK), *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, **env})


def _gpu_check_module():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_gpu_check_is_valid_bash():
    subprocess.run(["bash", "-n", str(GPU_CHECK)], check=True)
    assert os.access(GPU_CHECK, os.X_OK)


def test_gpu_check_refuses_without_nvidia_smi():
    done = _gpu_check(NVIDIA_SMI="/nonexistent/nvidia-smi")
    assert done.returncode == 3
    assert done.stderr.startswith("gpu-check: refusing to run: no NVIDIA GPU here "
                                  "(/nonexistent/nvidia-smi not found).")
    assert done.stdout == ""


def test_gpu_check_refuses_when_nvidia_smi_finds_no_gpu():
    """The real nvidia-smi without a driver (exits 9)."""
    done = _gpu_check(NVIDIA_SMI=str(tools.real_nvidia_smi()))
    assert done.returncode == 3
    assert "gpu-check: refusing to run: no NVIDIA GPU here" in done.stderr
    assert "-L said: NVIDIA-SMI" in done.stderr
    assert done.stdout == ""


def test_gpu_check_python_parts():
    gc = _gpu_check_module()
    facts = gc.parse_smi("NVIDIA H200, 570.86.15, Exclusive_Process, Disabled, 143771 MiB, "
                         "GPU-3f2a9c1e-7b4d-4e8a-b6c5-1d2e3f4a5b6c", 0)
    assert (facts.name, facts.driver, facts.compute_mode, facts.mig_mode) == (
        "NVIDIA H200", "570.86.15", "Exclusive_Process", "Disabled")
    with pytest.raises(ValueError, match="unexpected nvidia-smi line"):
        gc.parse_smi("NVIDIA H200, 570.86.15", 0)
    assert gc.has_memory_limits(str(tools.fake_nvml_library("full"))) is True
    assert gc.has_memory_limits(str(tools.fake_nvml_library("old-driver"))) is False
    assert gc.has_memory_limits("/nonexistent/libnvidia-ml.so.1") is False
    assert gc.ratio(1.0, 2.0) == 0.5 and math.isnan(gc.ratio(1.0, 0.0))
    assert "__global__ void mm(" in gc.CUDA_SOURCE


def test_gpu_check_reports_what_a_never_limited_cgroup_reads(fake_nvml):
    """nvml.h: NOT_FOUND for a cgroup no limit was set on; the check prints the raw answer."""
    from kai_fractions.node.nvml import PynvmlNvml

    gc = _gpu_check_module()
    uuid = "GPU-00000000-0000-0000-0000-000000000001"
    fake_nvml.add_gpu(uuid, memory_mib=81559)
    nvml = PynvmlNvml()
    nvml.init()
    try:
        assert gc.fresh_cgroup_answer(uuid, "/sys/fs/cgroup/kf") == "NVMLError_NotFound (6)"
        nvml.set_memory_limits(uuid, "/sys/fs/cgroup/kf", 1, 2)
        assert gc.fresh_cgroup_answer(uuid, "/sys/fs/cgroup/kf") == "success: soft 1, hard 2"
    finally:
        nvml.shutdown()


def test_gpu_check_stops_the_mps_daemon_it_starts():
    """The real (legacy) control daemon, started and stopped the way the script does it."""
    gc = _gpu_check_module()
    report = gc.Report()
    with tempfile.TemporaryDirectory(prefix="kfg-", dir="/tmp") as tmp:
        with gc.mps_daemon(str(tools.mps_control()), Path(tmp), 0, report) as pipe:
            running = gc._pids_with_env("CUDA_MPS_PIPE_DIRECTORY", str(pipe))
            assert len(running) == 1
            assert (pipe / "control").exists()
        assert gc._pids_with_env("CUDA_MPS_PIPE_DIRECTORY", str(pipe)) == []
    assert report.lines[0] == f"MPS control daemon started (pipe directory {pipe})"
    assert report.lines[1] == "MPS control daemon stopped; no process of it is left"


def test_percentile_is_the_nearest_rank() -> None:
    """The smallest sample with at least q % at or below it: of 300, p99 is the 4th largest
    (rank 297), not the 3rd (Python's round-half-to-even made it 298 before); of 100, p99 is
    the 2nd largest, not the maximum."""
    from benchmarks.harness import percentile

    assert percentile(list(range(1, 301)), 99) == 297
    assert percentile(list(range(100, 0, -1)), 99) == 99
    assert percentile(list(range(1, 101)), 50) == 50
    assert percentile(list(range(1, 1001)), 99.9) == 999
    assert percentile([7.0], 99) == 7.0
