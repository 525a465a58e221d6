"""Builders for the node-engine tests: pod manifests bound to a node, cgroup trees, inventories.

Annotation keys are written out literally here (never built from kai_fractions' key helpers), so a
typo in the contract package cannot hide behind the same typo in a test.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from kai_fractions.node.cgroups import CgroupFs, CgroupLayout, ContainerId, QosClass
from kai_fractions.node.desired import DesiredState, NodePod
from kai_fractions.node.inventory import Capabilities, Inventory
from kai_fractions.node.nvml import DeviceInfo, GpuComputeMode

MIB = 1 << 20
GIB = 1 << 30
GPU0 = "GPU-11111111-2222-3333-4444-555555555555"
GPU1 = "GPU-66666666-7777-8888-9999-aaaaaaaaaaaa"
H100 = 81559 * MIB
UID_A = "0a1b2c3d-0000-4000-8000-00000000000a"
UID_B = "0a1b2c3d-0000-4000-8000-00000000000b"
UID_C = "0a1b2c3d-0000-4000-8000-00000000000c"
CID_A = "containerd://" + "a" * 64
CID_B = "containerd://" + "b" * 64
CID_C = "containerd://" + "c" * 64


def annotations(
    container: str = "main",
    *,
    request: str | None = "10Gi",
    limit: str | None = "20Gi",
    mode: str | None = None,
    devices: Iterable[str] | None = (GPU0,),
    portion: str | None = "0.5",
) -> dict[str, str]:
    p = f"nvidia.com/container.{container}"
    out: dict[str, str] = {}
    if request is not None:
        out[f"{p}.gpu-memory.request"] = request
    if limit is not None:
        out[f"{p}.gpu-memory.limit"] = limit
    if mode is not None:
        out[f"{p}.gpu-compute.mode"] = mode
    if devices is not None:
        out[f"{p}.gpus.devices"] = ",".join(devices)
    if portion is not None:
        out[f"{p}.gpu-compute.portion"] = portion
    return out


def manifest(
    uid: str = UID_A,
    *,
    name: str = "p",
    namespace: str = "default",
    containers: Iterable[str] = ("main",),
    notes: Mapping[str, str] | None = None,
    qos: str | None = "Burstable",
    container_ids: Mapping[str, str] | None = None,
    created: str = "2025-01-01T00:00:00Z",
    phase: str = "Running",
    node: str = "node-a",
) -> dict[str, Any]:
    ids = {"main": CID_A} if container_ids is None else dict(container_ids)
    status: dict[str, Any] = {"phase": phase, "containerStatuses": [
        {"name": c, "containerID": ids[c]} for c in containers if c in ids]}
    if qos is not None:
        status["qosClass"] = qos
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "uid": uid,
                     "creationTimestamp": created,
                     "annotations": annotations() if notes is None else dict(notes)},
        "spec": {"nodeName": node, "containers": [{"name": c, "image": "x"} for c in containers]},
        "status": status,
    }


def node_pod(uid: str = UID_A, **kw: Any) -> NodePod:
    return NodePod.from_manifest(manifest(uid, **kw))


def device(uuid: str = GPU0, index: int = 0, *, total: int = H100, mig: bool = False,
           mode: GpuComputeMode = GpuComputeMode.DEFAULT) -> DeviceInfo:
    return DeviceInfo(index=index, uuid=uuid, name="NVIDIA H100 80GB HBM3", memory_total=total,
                      memory_used=0, compute_mode=mode, mig_enabled=mig)


def inventory(*devices: DeviceInfo, memory_limits: bool = True,
              mps_namespaces: bool | None = None, driver: str = "615.48.02") -> Inventory:
    devs = devices or (device(GPU0, 0), device(GPU1, 1))
    return Inventory(driver_version=driver, devices=tuple(devs), capabilities=Capabilities(
        memory_limits=memory_limits,
        mps_namespaces=memory_limits if mps_namespaces is None else mps_namespaces))


def make_cgroups(root: Path | str, layout: CgroupLayout, pods: Iterable[NodePod]) -> list[str]:
    """Create the pod and container cgroup directories kubelet would create; returns them."""
    made = []
    for p in pods:
        pod_path = layout.pod_path(p.uid, p.qos)
        made.append(pod_path)
        for cid in p.container_ids.values():
            made.append(layout.container_path(p.uid, p.qos, ContainerId.parse(cid)))
    for path in made:
        assert path.startswith(str(root))
        Path(path).mkdir(parents=True, exist_ok=True)
    return made


def pod_cgroup(root: str, uid: str, qos: QosClass = QosClass.BURSTABLE) -> str:
    """The systemd-layout pod slice path, spelled out (pins the layout independently)."""
    u = uid.replace("-", "_")
    if qos is QosClass.GUARANTEED:
        return f"{root}/kubepods.slice/kubepods-pod{u}.slice"
    level = {QosClass.BURSTABLE: "burstable", QosClass.BEST_EFFORT: "besteffort"}[qos]
    return f"{root}/kubepods.slice/kubepods-{level}.slice/kubepods-{level}-pod{u}.slice"


def exists_all(fs: CgroupFs, paths: Iterable[str]) -> bool:
    return all(fs.exists(p) for p in paths)


def watchdog_caps(state: DesiredState) -> dict[tuple[str, str], dict[str, int]]:
    """(pod uid, container) -> {GPU uuid: cap} of each container the watchdog guards (caps)."""
    return {(m.pod_uid, m.container_name): dict(m.caps) for m in state.watchdog_containers()
            if m.caps}
