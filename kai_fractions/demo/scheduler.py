"""The demo's stand-in for KAI Scheduler: a deterministic placement, then the mirror, then bind.

Placement (pure, `Placer`): pods in order, each on the first GPU(s) in index order that run its
compute mode (or nothing yet) and still have its memory request free. One GPU runs one compute
mode; a pod that fits nowhere is told, per GPU, what keeps it off (another compute mode, too
little free memory). The memory a pod occupies is what the mirror would write for it: the
scheduler asks with `PreviewAllocation` (the contract's binder arithmetic, nothing written),
then decides, then calls `MirrorAllocation` (one guarded patch of the pod's annotations) and
only then binds the pod, the order KAI's binder follows.
"""

from __future__ import annotations

import uuid as uuid_mod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..api.v1 import allocation_pb2 as pb
from ..contract import MIB, ComputeMode, ContainerShare, format_plain

_MODES = {ComputeMode.TIME_SLICING: pb.COMPUTE_SHARING_MODE_TIME_SLICING,
          ComputeMode.SM_SHARING: pb.COMPUTE_SHARING_MODE_SM_SHARING}
_GROUPS = uuid_mod.UUID("6f1c1a52-5d0e-4b8e-9a51-0c6e4d2b7f10")
"""Namespace of the demo's GPU group ids (KAI names each fractional group with a UUID)."""


@dataclass(frozen=True, slots=True)
class GpuSlot:
    index: int
    uuid: str
    capacity_mib: int
    """What the scheduler may hand out: the GPU's memory minus the reserve."""


@dataclass(frozen=True, slots=True)
class Ask:
    ref: str
    """namespace/name, for messages."""
    mode: ComputeMode
    request_mib: int
    """Per device."""
    count: int = 1


@dataclass
class Placer:
    gpus: Sequence[GpuSlot]
    used: dict[str, int] = field(default_factory=dict)
    modes: dict[str, ComputeMode] = field(default_factory=dict)

    def free_mib(self, gpu: GpuSlot) -> int:
        return gpu.capacity_mib - self.used.get(gpu.uuid, 0)

    def fits(self, gpu: GpuSlot, ask: Ask) -> bool:
        mode = self.modes.get(gpu.uuid)
        return (mode is None or mode is ask.mode) and ask.request_mib <= self.free_mib(gpu)

    def blocker(self, gpu: GpuSlot, ask: Ask) -> str:
        """What this GPU has, and what keeps `ask` off it, if anything: another compute mode,
        too little free memory, or both."""
        mode = self.modes.get(gpu.uuid)
        free = f"{self.free_mib(gpu)} MiB free"
        if self.fits(gpu, ask):
            return f"fits ({free})"
        why = []
        if mode is not None and mode is not ask.mode:
            why.append(f"runs {mode.value}")
        if ask.request_mib > self.free_mib(gpu):
            why.append(f"only {free}")
        return ", and ".join(why)

    def place(self, ask: Ask) -> tuple[GpuSlot, ...] | str:
        """The GPUs chosen (and booked), or why none fit: each GPU's blocker."""
        fitting = [g for g in self.gpus if self.fits(g, ask)]
        if len(fitting) < ask.count:
            states = "; ".join(f"GPU {g.index}: {self.blocker(g, ask)}" for g in self.gpus)
            return (f"{ask.ref} needs {ask.count} GPU(s) with {ask.request_mib} MiB free that "
                    f"run {ask.mode.value} or nothing yet; {len(fitting)} of {len(self.gpus)} "
                    f"fit ({states})")
        chosen = tuple(fitting[: ask.count])
        for g in chosen:
            self.used[g.uuid] = self.used.get(g.uuid, 0) + ask.request_mib
            self.modes.setdefault(g.uuid, ask.mode)
        return chosen


def group_id(pod_uid: str, index: int) -> str:
    return str(uuid_mod.uuid5(_GROUPS, f"{pod_uid}/{index}"))


def allocation(pod: dict[str, Any], share: ContainerShare, node: str,
               gpus: Sequence[str]) -> pb.Allocation:
    """What KAI's BindRequest would say for this pod on these GPUs. A `gpu-fraction` pod
    received that portion; a memory request leaves the portion to the mirror (request /
    usable memory). The node's GPU memory is left to the mirror too (its label)."""
    meta = pod["metadata"]
    mode = _MODES[share.compute_mode]
    return pb.Allocation(
        pod=pb.PodRef(namespace=meta["namespace"], name=meta["name"], uid=meta["uid"]),
        selected_node=node,
        received_resource_type=pb.RECEIVED_RESOURCE_TYPE_FRACTION,
        received_gpu=pb.ReceivedGpu(count=len(gpus), portion=format_plain(share.fraction)
                                    if share.fraction is not None else ""),
        selected_fractional_gpu_groups=[
            pb.FractionalGpuGroup(id=group_id(meta["uid"], i), compute_sharing_mode=mode)
            for i in range(len(gpus))],
        reserved_gpu_ids=list(gpus),
    )


def request_mib(preview: pb.PreviewAllocationResponse) -> int:
    return max(-(-c.memory_request_bytes // MIB) for c in preview.containers)


def idempotency_key(pod: dict[str, Any]) -> str:
    meta = pod["metadata"]
    return f"{meta['namespace']}/{meta['name']}/{meta['uid']}/attempt-1"
