"""The gate with a fractional container whose name is too long to be its own id in the derived
keys: it finds those keys by `Keys.derived` of the container's name (never by reading a name
out of them), releases once the plan is applied, and waits while a derived key the env reads is
missing, naming the real container. Every key the pod carries is one Kubernetes accepts."""

from __future__ import annotations

import re
from types import MappingProxyType

import pytest

from kai_fractions.contract import (
    DEFAULT_KEYS,
    ContainerView,
    PodView,
    derived_annotations,
    parse_pod,
    plan_pod,
)
from kai_fractions.gate import Outcome, judge
from kai_fractions.gate.check import pod_view
from kai_fractions.marker import ContainerMarker, Marker

from .pods import GPU, UID

BOOT = "0b0a1c2d-3e4f-4a5b-8c6d-7e8f9a0b1c2d"
NAME = "tensorrt-llm-inference-server"  # 29 characters: KAI takes it
P = f"nvidia.com/container.{NAME}"
_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")


def is_valid_key(key: str) -> bool:
    name = key.rpartition("/")[2]
    return len(name) <= 63 and _NAME.fullmatch(name) is not None


def bound(mode: str) -> tuple[dict[str, str], str]:
    """The pod's annotations once bound (user's, binder's, derived) and its plan digest."""
    notes = {f"{P}.gpu-memory.request": "8Gi", f"{P}.gpu-compute.mode": mode,
             f"{P}.gpus.devices": GPU, "received-resource-type": "Fraction"}
    view = PodView(name="llm-0", namespace="team-a", uid=UID,
                   annotations=MappingProxyType(notes),
                   containers=(ContainerView(NAME), ContainerView("metrics")))
    (plan,) = plan_pod(parse_pod(view))
    return {**notes, **derived_annotations(plan)}, plan.digest


def verdict(notes: dict[str, str], digest: str, containers: tuple[str, ...] = ()):
    marker = Marker.build(UID, {NAME: ContainerMarker.applied(digest)}, boot_id=BOOT,
                          clock=lambda: 1.7e9)
    return judge(notes, marker, pod_uid=UID, keys=DEFAULT_KEYS, boot_id=BOOT,
                 containers=containers)


@pytest.mark.parametrize("mode", ["sm-sharing", "time-slicing"])
def test_a_long_named_container_is_released_once_applied(mode: str):
    notes, digest = bound(mode)
    assert [key for key in notes if not is_valid_key(key)] == []
    for containers in ((), (NAME, "metrics")):
        v = verdict(notes, digest, containers)
        assert (v.outcome, v.message) == (Outcome.RELEASE, f"limits applied: {NAME} {digest}")


def test_without_the_pods_list_the_gate_names_only_real_containers():
    notes, _ = bound("sm-sharing")
    assert [c.name for c in pod_view(notes, UID, DEFAULT_KEYS).containers] == [NAME]


def test_a_missing_derived_key_is_waited_for_naming_the_real_container():
    notes, digest = bound("sm-sharing")
    key = DEFAULT_KEYS.derived(NAME, ".mps-active-thread-percentage")
    del notes[key]
    v = verdict(notes, digest)
    assert (v.outcome, v.message) == (
        Outcome.WAIT, f"container {NAME!r}: annotation {key} is missing (the workload's env "
        "reads it)")
