"""The workloads webhook's warnings (a mount at CUDA's default MPS pipe directory, a GPU-sharing
key where no pod reads it) come when their cause does, not with every update.

Before: each UPDATE of a workload repeated them all. The deployment controller updates a
ReplicaSet on each scale, so every scale sent both warnings again to kube-controller-manager,
which logs each. Now an UPDATE gives only the warnings the old object did not already give.
"""

from __future__ import annotations

import copy
from typing import Any

from kai_fractions.admission.validate import validate

from .reviews import CONFIG, request

CONTROLLER = "system:serviceaccount:kube-system:deployment-controller"


def replica_set(replicas: int) -> dict[str, Any]:
    """A Deployment's ReplicaSet whose template mounts the host's /tmp at /tmp (time-slicing:
    the host's /tmp/nvidia-mps comes with it) and whose own metadata carries `gpu-memory`,
    which its pods do not get."""
    return {
        "apiVersion": "apps/v1", "kind": "ReplicaSet",
        "metadata": {"name": "d-abc", "namespace": "ns",
                     "annotations": {"gpu-memory": "8192",
                                     "deployment.kubernetes.io/revision": "1"}},
        "spec": {"replicas": replicas, "selector": {"matchLabels": {"a": "b"}},
                 "template": {
                     "metadata": {"labels": {"a": "b", "kai.scheduler/queue": "q"},
                                  "annotations": {"gpu-fraction": "0.5"}},
                     "spec": {"schedulerName": "kai-scheduler",
                              "containers": [{"name": "main", "image": "i", "volumeMounts": [
                                  {"name": "t", "mountPath": "/tmp"}]}],
                              "volumes": [{"name": "t", "hostPath": {"path": "/tmp"}}]}}},
    }


def _warnings(obj: dict[str, Any], old: dict[str, Any] | None = None) -> tuple[str, ...]:
    d = validate(request(obj, old=old, kind="ReplicaSet", group="apps", user=CONTROLLER),
                 CONFIG)
    assert d.allowed, d
    return d.warnings


def _mps(warnings: tuple[str, ...]) -> list[str]:
    return [w for w in warnings if "CUDA's default MPS pipe directory" in w]


def _misplaced(warnings: tuple[str, ...]) -> list[str]:
    return [w for w in warnings if w.startswith("metadata.annotations['gpu-memory']")]


def test_a_scale_repeats_no_warning_the_create_gave() -> None:
    """Before: the CREATE and each scale (an UPDATE of `spec.replicas` only) gave both
    warnings. Now: the CREATE gives them, the scales none."""
    created = _warnings(replica_set(1))
    assert len(_mps(created)) == 1 and len(_misplaced(created)) == 1, created
    for before, after in ((1, 2), (2, 3), (3, 0)):
        assert _warnings(replica_set(after), old=replica_set(before)) == ()


def test_an_update_gives_the_warnings_it_brings() -> None:
    """An UPDATE that brings a cause (here the mount, added to a template that had none) gets
    its warning, and not those the old object already gave (the misplaced key); so does one
    that brings a second misplaced key."""
    old = replica_set(1)
    old["spec"]["template"]["spec"]["containers"][0].pop("volumeMounts")
    old["spec"]["template"]["spec"].pop("volumes")
    warnings = _warnings(replica_set(1), old=old)
    assert len(_mps(warnings)) == 1 and _misplaced(warnings) == [], warnings
    moved = copy.deepcopy(old)
    moved["metadata"]["annotations"]["gpu-memory.limit"] = "9000"
    assert len(_warnings(moved)) == 2  # as created: both keys
    [warning] = _warnings(moved, old=old)
    assert warning.startswith("metadata.annotations['gpu-memory.limit']: "), warning
