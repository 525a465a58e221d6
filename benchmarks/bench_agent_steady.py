"""P3 agent steady-state cost: CPU (percent of one core) and peak RSS (VmHWM) of the node agent with
100 running fractional containers on 8 GPUs, each with one CUDA process, the watchdog checking
every second, the gRPC socket and the metrics endpoint open.

The agent runs in a process of its own (`python -m benchmarks.bench_agent_steady --child`) on a
simulated node (`benchmarks.node_sim`); nothing else runs in it, so `getrusage` is the agent's.
The pods are built here and handed over as JSON (the child imports what the agent imports, not
the mirror). The window opens once every marker is written, the watchdog has seen every
container's GPU memory and the node has settled, and lasts 60 s (`--quick`: 10 s). CPU of the
child processes the agent runs (the MPS control client) is reported separately and together.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from .harness import Result
from .node_sim import GPU_MIB, REPO, bound_pod, gpu_uuid, mode_of, sim_node, wait_until

GPUS = 8
CONTAINERS = 100
WATCHDOG_S = 1.0
SETTLE_S = 2.0
USED_MIB = 4000
"""Each container's process uses this much (its request is about 5.5 GiB)."""


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    return 0


def _rusage() -> tuple[float, float, float, int]:
    """(own CPU s, children's CPU s, monotonic s, peak RSS kB). The peak is VmHWM, not
    ru_maxrss: Linux carries the PARENT's high-water mark into ru_maxrss across fork + exec, so
    a child of a big benchmark runner would report the runner's size."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime, time.monotonic(),
            _status_kb("VmHWM"))


def _pass_seconds(node) -> float:
    return node.agent.metrics.registry.get_sample_value(
        "kai_fractions_reconcile_duration_seconds_sum") or 0.0


def _with_usage(reconciler) -> int:
    """Containers whose GPU memory the watchdog has seen."""
    return sum(1 for u in reconciler.view.usage.values() if u.used_bytes)


def child(pods_file: str, seconds: float, settle: float = SETTLE_S) -> int:
    """Runs the agent, measures the window, prints one JSON line."""
    pods = json.loads(Path(pods_file).read_text())
    with sim_node(GPUS, watchdog_interval=WATCHDOG_S, serve=True, start=False) as node:
        for i, pod in enumerate(pods):
            node.make_cgroups(pod)
            node.gpu_process(pod, i % GPUS, USED_MIB)
            node.cluster.add_pod(pod)
        node.nvml_fake.write()
        del pods
        reconciler = node.agent.reconciler
        checks = [0, 0.0]
        original = reconciler.check_usage

        def check_usage() -> None:
            start = time.thread_time()
            original()
            checks[0] += 1
            checks[1] += time.thread_time() - start

        reconciler.check_usage = check_usage
        node.agent.start()
        # sim_node(start=False) leaves stopping to whoever started the agent: stopping it
        # stops the MPS control daemon it started (it would outlive this process).
        try:
            uids = list(node.cluster.pods)
            wait_until(lambda: all((node.markers / uid / "marker.json").exists()
                                   for uid in uids), "every marker", 60, interval=0.05)
            # Steady state also means the watchdog has seen every container's GPU memory: on a
            # loaded machine its first check can come before the last container was applied.
            wait_until(lambda: _with_usage(reconciler) >= len(uids),
                       "the watchdog to see every container's GPU memory", 60, interval=0.05)
            time.sleep(settle)
            cpu0, kids0, t0, maxrss_start = _rusage()
            passes0, checks0, check_cpu0 = reconciler.passes, checks[0], checks[1]
            pass_s0 = _pass_seconds(node)
            threading.Event().wait(seconds)
            cpu1, kids1, t1, maxrss = _rusage()
            pass_s = _pass_seconds(node) - pass_s0
            watched = _with_usage(reconciler)
            print(json.dumps({
                "wall_s": t1 - t0, "cpu_s": cpu1 - cpu0, "children_cpu_s": kids1 - kids0,
                "maxrss_kb": maxrss, "maxrss_start_kb": maxrss_start, "rss_kb": _status_kb("VmRSS"),
                "passes": reconciler.passes - passes0,
                "watchdog_checks": checks[0] - checks0, "watchdog_cpu_s": checks[1] - check_cpu0,
                "pass_wall_s": pass_s, "containers_with_usage": watched,
                "threads": threading.active_count()}), flush=True)
        finally:
            node.agent.stop(timeout=20)
    return 0


def run(quick: bool = False, smoke: bool = False) -> Result:
    """`quick`: a 10 s window; `smoke`: 10 containers for 1 s (the harness's own test)."""
    seconds = 1.0 if smoke else 10.0 if quick else 60.0
    settle = 0.5 if smoke else SETTLE_S
    containers = 10 if smoke else CONTAINERS
    result = Result("P3", f"agent steady state: {containers} containers on {GPUS} GPUs, "
                    f"watchdog every {WATCHDOG_S:g} s")
    with tempfile.TemporaryDirectory(prefix="kf-p3-") as tmp:
        pods_file = Path(tmp) / "pods.json"
        pods_file.write_text(json.dumps([
            bound_pod(i, gpu_uuid(i % GPUS), mode_of(i % GPUS), running=True)
            for i in range(containers)]))
        done = subprocess.run(
            [sys.executable, "-m", "benchmarks.bench_agent_steady", "--child", str(pods_file),
             "--seconds", str(seconds), "--settle", str(settle)], cwd=REPO,
            capture_output=True, text=True,
            timeout=seconds + 180)
    if done.returncode != 0:
        raise RuntimeError(f"the agent process failed ({done.returncode}): "
                           f"{done.stderr.strip()[-2000:]}")
    m = json.loads(done.stdout.strip().splitlines()[-1])
    wall = m["wall_s"]
    result.add("CPU, agent process", round(m["cpu_s"] / wall * 100, 3), "% of core", "<= 1")
    result.add("CPU, with its MPS control calls",
               round((m["cpu_s"] + m["children_cpu_s"]) / wall * 100, 3), "% of core")
    result.add("peak RSS", round(m["maxrss_kb"] / 1024, 1), "MB", "<= 80")
    result.add("peak RSS before the window (start-up)", round(m["maxrss_start_kb"] / 1024, 1),
               "MB")
    result.add("RSS at the end", round(m["rss_kb"] / 1024, 1), "MB")
    result.add("watchdog checks per second", round(m["watchdog_checks"] / wall, 2), "/s")
    result.add("watchdog CPU per check", round(
        m["watchdog_cpu_s"] / max(1, m["watchdog_checks"]) * 1e3, 2), "ms")
    result.add("reconcile passes in the window", m["passes"], "passes")
    result.add("time in passes", round(m["pass_wall_s"] / wall * 100, 3), "% of wall")
    result.add("containers with usage seen", m["containers_with_usage"], "containers")
    result.notes.append(
        f"window {wall:.1f} s after all markers were written, the watchdog saw every "
        f"container's GPU memory, and {settle:g} s of settling; "
        f"GPUs of {GPU_MIB} MiB, half sm-sharing (legacy MPS daemon), half time-slicing; "
        f"{m['threads']} threads in the agent process")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_agent_steady")
    parser.add_argument("--child", metavar="PODS_JSON")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--settle", type=float, default=SETTLE_S)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.child:
        return child(args.child, args.seconds, args.settle)
    for f in run(quick=args.quick).figures:
        print(f"{f.name:42} {f.value:>12} {f.unit:10} {f.target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
