"""Hand-made pods for the inspect tests: a user's request, then what the mirror writes (the
contract's binder arithmetic and derived values), then what the kubelet reports."""

from __future__ import annotations

import copy
from fractions import Fraction
from typing import Any

from kai_fractions.admission.config import GATE_CONTAINER
from kai_fractions.contract import (
    DEFAULT_DIALECT,
    BindDecision,
    ComputeMode,
    Dialect,
    binder_annotations,
    derived_annotations,
    parse_pod,
    plan_pod,
    view_from_pod_spec,
)

NODE = "gpu-node-1"
GPU0 = "GPU-00000000-1111-2222-3333-444444444440"
GPU1 = "GPU-00000000-1111-2222-3333-444444444441"
NODE_MIB = 40960
MIB = 1024 * 1024


def pod(name: str, annotations: dict[str, str], *, namespace: str = "team-a",
        uid: str = "", container: str = "main", gate: bool = True) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{"name": container, "image": "x"}]}
    if gate:
        spec["initContainers"] = [{"name": GATE_CONTAINER, "image": "gate"}]
    meta: dict[str, Any] = {"name": name, "namespace": namespace,
                            "annotations": dict(annotations)}
    if uid:
        meta["uid"] = uid
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def bind(p: dict[str, Any], gpus: tuple[str, ...], *, node: str = NODE,
         portion: str | None = None, reserve: int = 0,
         dialect: Dialect = DEFAULT_DIALECT) -> dict[str, Any]:
    """The pod as the mirror leaves it, bound to `node` (needs metadata.uid), written in the
    KAI `dialect` (the patched one adds the compute portion an sm-sharing cap comes from)."""
    out = copy.deepcopy(p)
    meta = out["metadata"]
    request = parse_pod(view_from_pod_spec(meta, out["spec"]))
    share = request.share
    assert share is not None
    decision = BindDecision(node_gpu_memory_mib=NODE_MIB, gpu_ids=gpus,
                            received_portion=Fraction(portion) if portion else None,
                            group_modes=(share.compute_mode,) * len(gpus), reserve_mib=reserve,
                            dialect=dialect)
    meta["annotations"].update(binder_annotations(request, decision))
    [plan] = plan_pod(parse_pod(view_from_pod_spec(meta, out["spec"])))
    meta["annotations"].update(derived_annotations(plan))
    out["spec"]["nodeName"] = node
    return out


def gate_status(p: dict[str, Any], *, exit_code: int | None, message: str = "",
                running: bool = False) -> dict[str, Any]:
    out = copy.deepcopy(p)
    if running:
        state: dict[str, Any] = {"running": {}}
    else:
        state = {"terminated": {"exitCode": exit_code, "message": message,
                                "reason": "Completed" if exit_code == 0 else "Error"}}
    out["status"] = {"initContainerStatuses": [{
        "name": GATE_CONTAINER, "image": "gate", "imageID": "", "ready": exit_code == 0,
        "restartCount": 0, "state": state}]}
    return out


def memory_pod(name: str, uid: str, request: str = "8Gi", limit: str | None = None,
               mode: ComputeMode = ComputeMode.TIME_SLICING, **kw: Any) -> dict[str, Any]:
    annotations = {"nvidia.com/container.main.gpu-memory.request": request}
    if limit:
        annotations["nvidia.com/container.main.gpu-memory.limit"] = limit
    if mode is ComputeMode.SM_SHARING:
        annotations["nvidia.com/container.main.gpu-compute.mode"] = mode.value
    return pod(name, annotations, uid=uid, **kw)


def node(labels: dict[str, str] | None = None, conditions: list[dict[str, Any]] | None = None,
         name: str = NODE) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": dict(labels if labels is not None else
                                                      {"nvidia.com/gpu.memory": str(NODE_MIB)})},
            "status": {"conditions": conditions if conditions is not None else [
                {"type": "gpu-fractioning.nvidia.com/Ready", "status": "True",
                 "reason": "Reconciling", "message": "ok"}]}}
