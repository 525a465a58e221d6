"""Building kai_fractions.v1 requests for the mirror tests, and reading status details."""

from __future__ import annotations

import json

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from kai_fractions.api.v1 import allocation_pb2 as pb
from kai_fractions.contract import DEFAULT_KEYS, parse_pod, plan_pod, view_from_pod_spec
from kai_fractions.mirror.record import MIRRORED_ANNOTATION, allocation_digest

GPU_A = "GPU-1111aaaa-0000-4000-8000-000000000001"
GPU_B = "GPU-2222bbbb-0000-4000-8000-000000000002"
TS = pb.COMPUTE_SHARING_MODE_TIME_SLICING
SM = pb.COMPUTE_SHARING_MODE_SM_SHARING
FRACTION = pb.RECEIVED_RESOURCE_TYPE_FRACTION


def allocation(pod: dict, *, portion: str = "0.5", modes=(TS,), gpus=(GPU_A,),
               memory: int = 40960, node: str = "gpu-node-1", reserve: int | None = None,
               cdi: bool = False, container: str = "", uid: str | None = None,
               count: int | None = None) -> pb.Allocation:
    meta = pod["metadata"]
    msg = pb.Allocation(
        pod=pb.PodRef(namespace=meta["namespace"], name=meta["name"],
                      uid=meta["uid"] if uid is None else uid),
        selected_node=node, received_resource_type=FRACTION,
        received_gpu=pb.ReceivedGpu(count=len(gpus) if count is None else count,
                                    portion=portion),
        selected_fractional_gpu_groups=[pb.FractionalGpuGroup(id=f"group-{i}",
                                                              compute_sharing_mode=m)
                                        for i, m in enumerate(modes)],
        reserved_gpu_ids=list(gpus), node_gpu_memory_mib=memory, cdi=cdi,
        container_name=container)
    if reserve is not None:
        msg.reserve_mib = reserve
    return msg


def mirror_request(alloc: pb.Allocation, key: str = "", replace: bool = False
                   ) -> pb.MirrorAllocationRequest:
    return pb.MirrorAllocationRequest(allocation=alloc, idempotency_key=key, replace=replace)


def bad_request_fields(error: grpc.RpcError) -> list[tuple[str, str]]:
    status = rpc_status.from_call(error)
    assert status is not None, "the status carries no details"
    out = []
    for detail in status.details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            br = error_details_pb2.BadRequest()
            detail.Unpack(br)
            out += [(v.field, v.description) for v in br.field_violations]
    return out


def detail(error: grpc.RpcError, message_type):
    status = rpc_status.from_call(error)
    assert status is not None
    for item in status.details:
        if item.Is(message_type.DESCRIPTOR):
            out = message_type()
            item.Unpack(out)
            return out
    raise AssertionError(f"no {message_type.DESCRIPTOR.full_name} in the status details")


def node_plan(pod: dict):
    """The plan the node agent derives from the pod's annotations (one container)."""
    view = view_from_pod_spec(pod["metadata"], pod["spec"])
    (plan,) = plan_pod(parse_pod(view, DEFAULT_KEYS))
    return plan


def record(pod: dict) -> dict:
    return json.loads(pod["metadata"]["annotations"][MIRRORED_ANNOTATION])


def expected_record(pod: dict, owned: dict[str, str], container: str = "trainer",
                    key: str = "") -> dict:
    return {"v": 1, "uid": pod["metadata"]["uid"], "container": container,
            "keys": sorted(owned), "digest": allocation_digest(owned), "idempotencyKey": key}
