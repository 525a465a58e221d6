"""Bound pods and their plans for the signing tests (annotations typed out, as the mirror
writes them for KAI's NvFractions contract)."""

from __future__ import annotations

from kai_fractions.contract import ContainerPlan, parse_pod, plan_pod, view_from_pod_spec

UID = "0b7e1c9a-3d2f-4a5b-8c6d-7e8f9a0b1c2d"
GPU_A = "GPU-1111aaaa-0000-4000-8000-000000000001"
GPU_B = "GPU-2222bbbb-0000-4000-8000-000000000002"
KEY_A = bytes(range(32))
KEY_B = bytes(range(100, 132))


def time_slicing(container: str = "main") -> dict[str, str]:
    return {
        f"nvidia.com/container.{container}.gpu-memory.request": "20Gi",
        f"nvidia.com/container.{container}.gpu-memory.limit": "30Gi",
        f"nvidia.com/container.{container}.gpus.devices": GPU_A,
        "received-resource-type": "Fraction",
    }


def sm_sharing(container: str = "main") -> dict[str, str]:
    return {
        f"nvidia.com/container.{container}.gpu-memory.request": "10Gi",
        f"nvidia.com/container.{container}.gpu-compute.mode": "sm-sharing",
        f"nvidia.com/container.{container}.gpu-compute.portion": "0.25",
        f"nvidia.com/container.{container}.gpus.devices": f"{GPU_A},{GPU_B}",
        "received-resource-type": "Fraction",
    }


def pod(annotations: dict[str, str], *, uid: str = UID, name: str = "train-0",
        namespace: str = "team-a", containers: tuple[str, ...] = ("main",)) -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "uid": uid,
                         "annotations": dict(annotations)},
            "spec": {"containers": [{"name": c, "image": "registry.invalid/app:1"}
                                    for c in containers]}}


def plans_of(obj: dict) -> tuple[ContainerPlan, ...]:
    return plan_pod(parse_pod(view_from_pod_spec(obj["metadata"], obj["spec"])))


def plan_of(annotations: dict[str, str], **kwargs) -> ContainerPlan:
    (plan,) = plans_of(pod(annotations, **kwargs))
    return plan
