"""Protobuf <-> the mirror's own values (kai_fractions.v1 Allocation, ContainerPlan)."""

from __future__ import annotations

from ...api.v1 import allocation_pb2 as pb
from ...contract import ComputeMode, ContainerPlan, ContractError
from ...contract import keys as k
from ..decision import MAX_IDS, AllocationInput
from ..errors import InvalidAllocation

_RESOURCE_TYPES = {
    pb.RECEIVED_RESOURCE_TYPE_UNSPECIFIED: "",
    pb.RECEIVED_RESOURCE_TYPE_REGULAR: k.RESOURCE_TYPE_REGULAR,
    pb.RECEIVED_RESOURCE_TYPE_FRACTION: k.RESOURCE_TYPE_FRACTION,
}
_MODES = {
    pb.COMPUTE_SHARING_MODE_UNSPECIFIED: "",  # KAI's older plain group ids: time-slicing
    pb.COMPUTE_SHARING_MODE_TIME_SLICING: ComputeMode.TIME_SLICING.value,
    pb.COMPUTE_SHARING_MODE_SM_SHARING: ComputeMode.SM_SHARING.value,
}
_MODE_TO_PROTO = {
    ComputeMode.TIME_SLICING: pb.COMPUTE_SHARING_MODE_TIME_SLICING,
    ComputeMode.SM_SHARING: pb.COMPUTE_SHARING_MODE_SM_SHARING,
}


def _enum(table: dict[int, str], number: int) -> str:
    # An enum number this server does not know stays visible in the error ("7").
    return table.get(number, str(number))


def _check_lengths(msg: pb.Allocation) -> None:
    """The repeated fields' bounds, checked before anything is built from them: a request of
    a million empty groups (2 MB, under the receive limit of old) cost every other call on the
    loop most of a second while they were turned into tuples, only to be refused after."""
    errors = [ContractError(field, f"must list at most {MAX_IDS} (got {count})")
              for field, count in (("reserved_gpu_ids", len(msg.reserved_gpu_ids)),
                                   ("selected_fractional_gpu_groups",
                                    len(msg.selected_fractional_gpu_groups)))
              if count > MAX_IDS]
    if errors:
        raise InvalidAllocation(errors)


def allocation_from_proto(msg: pb.Allocation) -> AllocationInput:
    """Raises InvalidAllocation for a repeated field past its bound (decision.MAX_IDS)."""
    _check_lengths(msg)
    # Each field read through the protobuf runtime costs: every one is read once.
    pod, gpu = msg.pod, msg.received_gpu
    groups = [(g.id, g.compute_sharing_mode) for g in msg.selected_fractional_gpu_groups]
    return AllocationInput(
        namespace=pod.namespace,
        pod_name=pod.name,
        pod_uid=pod.uid,
        selected_node=msg.selected_node,
        resource_type=_enum(_RESOURCE_TYPES, msg.received_resource_type),
        gpu_count=gpu.count,
        portion=gpu.portion,
        group_ids=tuple(group_id for group_id, _ in groups),
        group_modes=tuple(_enum(_MODES, mode) for _, mode in groups),
        gpu_ids=tuple(msg.reserved_gpu_ids),
        node_gpu_memory_mib=msg.node_gpu_memory_mib,
        cdi=msg.cdi,
        reserve_mib=msg.reserve_mib if msg.HasField("reserve_mib") else None,
        container=msg.container_name,
    )


def plan_to_proto(plan: ContainerPlan) -> pb.ContainerPlan:
    return pb.ContainerPlan(
        container=plan.container,
        env=plan.env,
        memory_request_bytes=plan.request_bytes,
        memory_limit_bytes=plan.limit_bytes,
        compute_sharing_mode=_MODE_TO_PROTO[plan.compute_mode],
        active_thread_percentage=plan.active_thread_percentage or 0,
        devices=list(plan.device_uuids),
    )
