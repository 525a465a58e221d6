"""A bound fractional pod as the gate sees it: annotations (binder + derived) and its plan."""

from __future__ import annotations

from types import MappingProxyType

from kai_fractions.contract import (
    ContainerPlan,
    ContainerView,
    PodView,
    derived_annotations,
    parse_pod,
    plan_pod,
)

UID = "5f0c6c1e-2b2b-4c4c-8d8d-000000000001"
GPU = "GPU-3f2a1b4c-0000-1111-2222-333344445555"

USER_KEYS = {
    "nvidia.com/container.main.gpu-memory.request": "8Gi",
    "nvidia.com/container.main.gpu-memory.limit": "10Gi",
    "nvidia.com/container.main.gpu-compute.mode": "sm-sharing",
}
BINDER_KEYS = {
    "nvidia.com/container.main.gpus.devices": GPU,
    "nvidia.com/container.main.gpu-compute.portion": "0.5",
    "received-resource-type": "Fraction",
}


def plan_of(annotations: dict[str, str], uid: str = UID) -> ContainerPlan:
    view = PodView(name="llm-0", namespace="team-a", uid=uid,
                   annotations=MappingProxyType(annotations),
                   containers=(ContainerView("main"), ContainerView("metrics")))
    [plan] = plan_pod(parse_pod(view))
    return plan


def bound_annotations(uid: str = UID) -> dict[str, str]:
    """What the pod carries once bound: the user's keys, the binder's, and the derived ones."""
    annotations = {**USER_KEYS, **BINDER_KEYS, "prometheus.io/scrape": "true"}
    return {**annotations, **derived_annotations(plan_of(annotations, uid))}


def go_quote(value: str) -> str:
    """Go's %q for the ASCII values these tests use."""
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def downward_file(annotations: dict[str, str]) -> str:
    """The kubelet's rendering: sorted key="value" lines, no newline after the last."""
    return "\n".join(f"{k}={go_quote(v)}" for k, v in sorted(annotations.items()))
