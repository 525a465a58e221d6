"""Small AdmissionReview requests built in code, for the pure webhook functions."""

from __future__ import annotations

import copy
from typing import Any

from kai_fractions.admission.config import AdmissionConfig

CONFIG = AdmissionConfig(gate_image="registry.example.com/kai-fractions:0.1.0")
ALICE = "alice"
BINDER = "system:serviceaccount:kai-scheduler:binder"
MIRROR = "system:serviceaccount:kai-fractions:kai-fractions-mirror"
GPU = "GPU-3f2a1b4c-0000-1111-2222-333344445555"


def pod(annotations: dict[str, str] | None = None, *, containers: tuple[str, ...] = ("main",),
        **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "p", "namespace": "ns", "annotations": dict(annotations or {})},
        # KAI's scheduler, as every fractional pod names it (else the webhook warns)
        "spec": {"schedulerName": "kai-scheduler",
                 "containers": [{"name": n, "image": "img"} for n in containers], **spec},
    }


def request(obj: dict[str, Any], *, old: dict[str, Any] | None = None, user: str = ALICE,
            kind: str = "Pod", group: str = "", sub: str = "") -> dict[str, Any]:
    req: dict[str, Any] = {
        "uid": "u-1", "kind": {"group": group, "version": "v1", "kind": kind},
        "namespace": "ns", "operation": "UPDATE" if old is not None else "CREATE",
        "userInfo": {"username": user}, "object": copy.deepcopy(obj),
    }
    if old is not None:
        req["oldObject"] = copy.deepcopy(old)
    if sub:
        req["subResource"] = sub
    return req


SM = {"nvidia.com/container.main.gpu-memory.request": "8Gi",
      "nvidia.com/container.main.gpu-compute.mode": "sm-sharing"}
TS = {"nvidia.com/container.main.gpu-memory.request": "8Gi"}
