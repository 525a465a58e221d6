"""P4 contract throughput: parse + validate + plan, pods per second (target >= 20,000/s).

One pod = a manifest dict -> PodView -> parse_pod (all validation) -> plan_pod -> env + digest:
everything the node agent and the mirror do per pod that is pure contract work.
"""

from __future__ import annotations

from kai_fractions.contract import parse_pod, plan_pod, view_from_pod_spec

from .harness import Result, best_of, rate

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
    pods = _pods(300)
    index = iter(range(10**9))

    def one() -> None:
        meta, spec = pods[next(index) % len(pods)]
        for plan in plan_pod(parse_pod(view_from_pod_spec(meta, spec))):
            plan.env  # noqa: B018 - the env is part of what a plan costs
            plan.digest  # noqa: B018

    one()  # warm the parse caches the way a running agent has them warm
    count = 3000 if quick else 20000
    pods_per_s = best_of(3, lambda: rate(one, count))
    result.add("pods per second", round(pods_per_s), "pods/s", ">= 20000")
    result.add("time per pod", round(1e6 / pods_per_s, 1), "us")
    return result
