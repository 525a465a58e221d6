"""P4 contract throughput: parse + validate + plan, pods per second (target >= 20,000/s).

One pod = a manifest dict -> PodView -> parse_pod (all validation) -> plan_pod -> env + digest:
everything the node agent and the mirror do per pod that is pure contract work.

Two figures: pods per second, the best of 7 runs of 5,000 pods (these shared machines slow
down for seconds at a time; noise only ever slows a run, so the fastest short run is the one
closest to the code's own speed); and, where valgrind is installed, the instructions one pod
costs (callgrind, the same count on any machine and under any load: the figure to compare
changes by).

And the parse of one hostile pod: just under the API server's 256 KiB of annotations, all of
them compute modes naming containers the pod does not have (4,500 keys, 246,390 bytes; any user
who can create a pod can send one, and the webhooks and every node agent pass parse it). Admitted
with capped warnings as it is, and refused with a memory request after them all: time per view +
parse, the best of 7 runs of 20 (a parse that walks the annotations once per key took seconds).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

from kai_fractions.contract import parse_pod, plan_pod, view_from_pod_spec

from .harness import Result, best_of, rate
from .stub_apiserver import REPO

_UUID = "GPU-3f2a9c1e-7b4d-4e8a-b6c5-1d2e3f4a5b6c"


def _pods(count: int) -> list[tuple[dict, dict]]:
    """A realistic mix: sm-sharing with request+limit, time-slicing request-only, legacy
    gpu-fraction (already bound), each with unrelated annotations beside them."""
    pods = []
    for i in range(count):
        kind = i % 3
        ann = {"kubectl.kubernetes.io/last-applied-configuration": "{}", "team": f"t{i % 7}"}
        if kind == 0:
            ann.update({
                "nvidia.com/container.main.gpu-memory.request": "8Gi",
                "nvidia.com/container.main.gpu-memory.limit": "16Gi",
                "nvidia.com/container.main.gpu-compute.mode": "sm-sharing",
                "nvidia.com/container.main.gpu-compute.portion": "0.1",
            })
        elif kind == 1:
            ann["nvidia.com/container.main.gpu-memory.request"] = f"{(i % 40 + 1) * 512}Mi"
            ann["nvidia.com/container.main.gpu-compute.portion"] = "0.25"
        else:
            ann.update({"gpu-fraction": "0.5", "gpu-fraction.limit": "0.75",
                        "nvidia.com/container.main.gpu-memory.request": "40000Mi",
                        "nvidia.com/container.main.gpu-memory.limit": "60000Mi",
                        "nvidia.com/container.main.gpu-compute.portion": "0.5"})
        ann["nvidia.com/container.main.gpus.devices"] = _UUID
        meta = {"name": f"pod-{i}", "namespace": "bench", "uid": f"uid-{i:08d}",
                "annotations": ann}
        spec = {"containers": [{"name": "main"}, {"name": "sidecar"}],
                "initContainers": [{"name": "setup"}]}
        pods.append((meta, spec))
    return pods


def run(quick: bool = False) -> Result:
    result = Result("P4", "contract throughput (parse + validate + plan)")
    one = _one(_pods(300))
    one()  # warm the parse caches the way a running agent has them warm
    runs, count = (3, 1000) if quick else (7, 5000)
    pods_per_s = best_of(runs, lambda: rate(one, count))
    result.add("pods per second", round(pods_per_s), "pods/s", ">= 20000")
    result.add("time per pod", round(1e6 / pods_per_s, 1), "us")
    if not quick and shutil.which("valgrind"):
        result.add("instructions per pod (callgrind)", round(instructions_per_pod()), "instr")
    result.notes.append(f"best of {runs} runs of {count} pods")
    stray = _stray_pod()
    refused = _stray_pod(refused=True)
    parses = 5 if quick else 20
    for name, (meta, spec) in (("admitted", stray), ("refused", refused)):
        per_s = best_of(runs, lambda m=meta, s=spec: rate(
            lambda: parse_pod(view_from_pod_spec(m, s)), parses))
        result.add(f"time per parse, {STRAY_KEYS:,} stray compute modes ({name})",
                   round(1e3 / per_s, 2), "ms")
    size = sum(len(key) + len(value) for key, value in stray[0]["annotations"].items())
    result.notes.append(f"stray-key pod: {size:,} bytes of annotations; best of {runs} runs of "
                        f"{parses} parses")
    return result


STRAY_KEYS = 4500
"""Compute modes on containers the pod lacks that fit under 256 KiB of annotations."""


def _stray_pod(refused: bool = False) -> tuple[dict, dict]:
    """A pod of one container whose annotations are STRAY_KEYS compute modes naming containers
    it does not have: admitted with a warning (capped) for a pod that asks for no fraction; with
    a memory request after them, each is refused."""
    ann = {f"nvidia.com/container.g{i}.gpu-compute.mode": "time-slicing"
           for i in range(STRAY_KEYS)}
    if refused:
        ann["nvidia.com/container.main.gpu-memory.request"] = "1Gi"
    meta = {"name": "stray", "namespace": "bench", "uid": "uid-stray", "annotations": ann}
    return meta, {"containers": [{"name": "main"}]}


def _one(pods: list[tuple[dict, dict]]):
    index = iter(range(10**9))

    def one() -> None:
        meta, spec = pods[next(index) % len(pods)]
        for plan in plan_pod(parse_pod(view_from_pod_spec(meta, spec))):
            plan.env  # noqa: B018 - the env is part of what a plan costs
            plan.digest  # noqa: B018

    return one


_LOOP = """
import sys
from benchmarks.bench_contract import _one, _pods
one = _one(_pods(300))
for _ in range(300 + int(sys.argv[1])):
    one()
"""


def instructions_per_pod(count: int = 2000) -> float:
    """Instructions of `count` pods beyond the same program with none (start-up and the 300
    warm-up pods cancel out), under callgrind, with a fixed hash seed."""
    def collected(pods: int) -> int:
        done = subprocess.run(
            ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable,
             "-c", _LOOP, str(pods)], capture_output=True, text=True, check=True, cwd=REPO,
            env={**os.environ, "PYTHONHASHSEED": "0"})
        return int(re.search(r"Collected : (\d+)", done.stderr)[1])

    return (collected(count) - collected(0)) / count
