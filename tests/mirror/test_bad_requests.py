"""Bad requests are INVALID_ARGUMENT with google.rpc.BadRequest field violations naming the
field, and the API server receives no PATCH."""

from __future__ import annotations

import grpc
import pytest

from kai_fractions.api.v1 import allocation_pb2 as pb
from kai_fractions.contract.names import MAX_NAME
from kai_fractions.mirror.decision import MAX_ID, MAX_IDEMPOTENCY_KEY, MAX_IDS
from kai_fractions.mirror.errors import InvalidAllocation
from kai_fractions.mirror.grpc.proto import allocation_from_proto
from kai_fractions.mirror.grpc.server import MAX_RECEIVE_MESSAGE_BYTES

from .messages import GPU_A, GPU_B, SM, TS, allocation, bad_request_fields, mirror_request

pytestmark = pytest.mark.integration

NS, NAME = "team-a", "train-0"
SM_POD = {"gpu-fraction": "0.5", "nvidia.com/container.trainer.gpu-compute.mode": "sm-sharing"}


def refused(mirror, request) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        mirror.stub.MirrorAllocation(request, timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert mirror.patches(NS, NAME) == 0
    return e.value


def test_negative_portion(mirror_tcp):
    pod = mirror_tcp.create_pod(NAME, {"gpu-fraction": "0.5"})
    error = refused(mirror_tcp, mirror_request(allocation(pod, portion="-0.5")))
    assert bad_request_fields(error) == [(
        "allocation.received_gpu.portion", "must be greater than 0 "
        "(got '-0.5')")]
    assert error.details() == ("allocation.received_gpu.portion: must be greater than 0 "
                               "(got '-0.5')")


def test_unparsable_portion(mirror_tcp):
    pod = mirror_tcp.create_pod(NAME, {"gpu-fraction": "0.5"})
    error = refused(mirror_tcp, mirror_request(allocation(pod, portion="half")))
    assert bad_request_fields(error) == [(
        "allocation.received_gpu.portion", "must be a finite decimal number such as 0.5 "
        "(no NaN, Inf or hex) (got 'half')")]


def test_unknown_container(mirror_tcp):
    pod = mirror_tcp.create_pod(NAME, {"gpu-fraction": "0.5"})
    error = refused(mirror_tcp, mirror_request(allocation(pod, container="worker")))
    assert bad_request_fields(error) == [(
        "allocation.container_name", "names container 'worker', which is not in pod "
        "team-a/train-0 (containers: trainer) (got 'worker')")]


def test_mode_mix_in_one_allocation(mirror_tcp):
    pod = mirror_tcp.create_pod(NAME, {**SM_POD, "gpu-fraction-num-devices": "2"})
    error = refused(mirror_tcp, mirror_request(allocation(pod, modes=(SM, TS),
                                                          gpus=(GPU_A, GPU_B))))
    assert bad_request_fields(error) == [(
        "allocation.selected_fractional_gpu_groups[1].compute_sharing_mode",
        "is time-slicing but container 'trainer' asks for sm-sharing; one GPU runs one compute "
        "mode (got 'time-slicing')")]


def test_missing_node_memory_label(mirror_tcp):
    mirror_tcp.create_node("gpu-node-1", None)
    pod = mirror_tcp.create_pod(NAME, {"gpu-fraction": "0.5"})
    error = refused(mirror_tcp, mirror_request(allocation(pod, memory=0)))
    assert bad_request_fields(error) == [(
        "allocation.node_gpu_memory_mib", "unknown: the node has no nvidia.com/gpu.memory label "
        "(GPU feature discovery publishes it); it is needed for all GPU memory arithmetic "
        "(got '0')")]


def test_unknown_node(mirror_tcp):
    pod = mirror_tcp.create_pod(NAME, {"gpu-fraction": "0.5"})
    error = refused(mirror_tcp, mirror_request(allocation(pod, memory=0, node="nowhere")))
    assert bad_request_fields(error) == [(
        "allocation.selected_node", "names a node that does not exist (got 'nowhere')")]


def test_broken_pod_annotation_is_named_by_key(mirror_tcp):
    pod = mirror_tcp.create_pod(NAME, {"gpu-fraction": "NaN"})
    error = refused(mirror_tcp, mirror_request(allocation(pod)))
    assert bad_request_fields(error) == [(
        'pod.metadata.annotations["gpu-fraction"]', "must be a finite decimal number such as "
        "0.5 (no NaN, Inf or hex) (got 'NaN')")]


def test_several_errors_at_once(mirror_tcp):
    pod = mirror_tcp.create_pod(NAME, {"gpu-fraction": "0.5"})
    alloc = allocation(pod, portion="x", memory=-1)
    alloc.received_resource_type = pb.RECEIVED_RESOURCE_TYPE_FRACTION
    error = refused(mirror_tcp, mirror_request(alloc, key="bad\tkey"))
    assert [f for f, _ in bad_request_fields(error)] == ["idempotency_key"]
    error = refused(mirror_tcp, mirror_request(alloc))
    assert [f for f, _ in bad_request_fields(error)] == [
        "allocation.received_gpu.portion", "allocation.node_gpu_memory_mib"]


def test_missing_resource_type_and_pod(mirror_tcp):
    error = refused(mirror_tcp, mirror_request(pb.Allocation()))
    assert bad_request_fields(error) == [
        ("allocation.pod.namespace", "is required"),
        ("allocation.pod.name", "is required"),
        ("allocation.received_resource_type", "is required: Fraction or Regular")]


def test_release_without_pod_name(mirror_tcp):
    with pytest.raises(grpc.RpcError) as e:
        mirror_tcp.stub.ReleaseAllocation(pb.ReleaseAllocationRequest(
            pod=pb.PodRef(namespace=NS)), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_request_fields(e.value) == [("pod.name", "is required")]


def test_release_with_a_bad_idempotency_key(mirror_tcp):
    """Checked as MirrorAllocation checks it: a key is logged, so a newline or a megabyte is
    refused, not silently carried."""
    mirror_tcp.create_pod(NAME, {"gpu-fraction": "0.5"})
    for key in ("k" * 257, "a\nb"):
        with pytest.raises(grpc.RpcError) as e:
            mirror_tcp.stub.ReleaseAllocation(pb.ReleaseAllocationRequest(
                pod=pb.PodRef(namespace=NS, name=NAME), idempotency_key=key), timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert [f for f, _ in bad_request_fields(e.value)] == ["idempotency_key"]
    assert mirror_tcp.patches(NS, NAME) == 0


def test_names_no_pod_could_have_are_refused_and_echoed_cut(mirror_tcp):
    """A name is logged and echoed in the status: 20,000 characters made the status exceed
    gRPC's 16 KiB (the caller got RESOURCE_EXHAUSTED), a newline forged a log line."""
    pod = mirror_tcp.create_pod(NAME, {"gpu-fraction": "0.5"})
    forged = "x\nERROR forged line"
    alloc = allocation(pod)
    alloc.pod.name = forged
    error = refused(mirror_tcp, mirror_request(alloc))
    assert bad_request_fields(error) == [(
        "allocation.pod.name", "must be a Kubernetes name (lowercase letters, digits, '-' and "
        "'.') (got 'x\\nERROR forged line')")]
    for ref in (pb.PodRef(namespace=NS, name="n" * 20_000),
                pb.PodRef(namespace="Team A", name=NAME),
                pb.PodRef(namespace=NS, name=NAME, uid="u\n" * 5)):
        with pytest.raises(grpc.RpcError) as e:
            mirror_tcp.stub.ReleaseAllocation(pb.ReleaseAllocationRequest(pod=ref), timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert len(e.value.details()) < 300
    assert mirror_tcp.patches(NS, NAME) == 0


def test_a_node_name_no_node_could_have_is_refused_before_any_read(mirror_tcp):
    """It was read from the API server first: 400 came back as INTERNAL (counted against the
    mirror, feeding its alert), echoed whole in the status and the log."""
    pod = mirror_tcp.create_pod(NAME, {"gpu-fraction": "0.5"})
    for node in ("n" * 20_000 + "\nX", "Gpu_Node"):
        gets = mirror_tcp.kube.count("GET")
        with pytest.raises(grpc.RpcError) as e:
            mirror_tcp.stub.PreviewAllocation(pb.PreviewAllocationRequest(
                allocation=allocation(pod, node=node)), timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "allocation.selected_node" in e.value.details()
        assert len(e.value.details()) < 1000 and "\nX" not in e.value.details()
        assert mirror_tcp.kube.count("GET") == gets  # no node read


def test_a_container_not_in_a_pod_of_many_names_a_few(mirror_tcp):
    containers = tuple(f"worker-{i:02d}-" + "c" * 50 for i in range(121))
    pod = mirror_tcp.create_pod(NAME, {"gpu-fraction": "0.5"}, containers=containers)
    error = refused(mirror_tcp, mirror_request(allocation(pod, container="trainer")))
    ((field, rule),) = bad_request_fields(error)
    assert field == "allocation.container_name"
    assert rule.startswith("names container 'trainer', which is not in pod team-a/train-0 "
                           f"(containers: {containers[0]}, ")
    assert rule.endswith(", ... (121 in all)) (got 'trainer')")


def test_preview_validates_the_same_way(mirror_tcp):
    pod = mirror_tcp.create_pod(NAME, {"gpu-fraction": "0.5"})
    with pytest.raises(grpc.RpcError) as e:
        mirror_tcp.stub.PreviewAllocation(pb.PreviewAllocationRequest(
            allocation=allocation(pod, portion="2")), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [f for f, _ in bad_request_fields(e.value)] == ["allocation.received_gpu.portion"]


WIDE = "\U0001F600"  # four bytes in UTF-8: the widest character a string field may hold
LONGEST_NAME = ".".join(["a" * 63] * 3 + ["a" * (MAX_NAME - 192)])  # 253 characters
LONGEST_FRACTIONAL = "c" * 34
"""The longest fractional container's name: KAI's `nvidia.com/container.<c>.gpu-memory.request`
holds no longer one (an annotation key's name holds 63 characters)."""


def largest_request(pod: dict, node: str, container: str) -> pb.MirrorAllocationRequest:
    """A MirrorAllocationRequest with every field at its bound, each string of the widest
    characters its rule allows."""
    alloc = allocation(pod, node=node, container=container, portion="0." + "5" + "0" * 61,
                       modes=(TS,) * MAX_IDS, memory=1 << 40,
                       gpus=tuple(f"GPU-{i:04x}" + "a" * (MAX_ID - 8) for i in range(MAX_IDS)))
    for i, group in enumerate(alloc.selected_fractional_gpu_groups):
        group.id = f"{i:02d}" + WIDE * (MAX_ID - 2)
    alloc.cdi, alloc.reserve_mib = True, 0
    return mirror_request(alloc, key=WIDE * MAX_IDEMPOTENCY_KEY, replace=True)


def test_the_largest_valid_request_is_served_and_the_limit_leaves_it_room(mirror_tcp):
    namespace = "n" * 63
    mirror_tcp.create_node(LONGEST_NAME, None)
    pod = mirror_tcp.create_pod(LONGEST_NAME, {"gpu-fraction": "0.5",
                                               "gpu-fraction-num-devices": str(MAX_IDS)},
                                namespace=namespace, containers=(LONGEST_FRACTIONAL,))
    request = largest_request(pod, LONGEST_NAME, LONGEST_FRACTIONAL)
    assert len(request.allocation.received_gpu.portion) == 64
    reply = mirror_tcp.stub.MirrorAllocation(request, timeout=10)
    assert reply.changed and len(reply.containers[0].devices) == MAX_IDS
    # The fields a pod does not let reach their bound, at it: the uid and the container name.
    request.allocation.pod.uid = WIDE * MAX_NAME
    request.allocation.container_name = LONGEST_NAME
    assert 40_000 < request.ByteSize() < MAX_RECEIVE_MESSAGE_BYTES // 2.5


def test_a_request_past_the_receive_limit_is_refused_unread(mirror_tcp):
    """1.3 million empty groups (2.6 MB, under gRPC's default 4 MiB) were read and turned into
    tuples on the loop every call shares before the bound refused them."""
    pod = mirror_tcp.create_pod(NAME, {"gpu-fraction": "0.5"})
    alloc = allocation(pod)
    alloc.selected_fractional_gpu_groups.extend([pb.FractionalGpuGroup()] * 70_000)
    assert alloc.ByteSize() > MAX_RECEIVE_MESSAGE_BYTES
    with pytest.raises(grpc.RpcError) as e:
        mirror_tcp.stub.MirrorAllocation(mirror_request(alloc), timeout=10)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert mirror_tcp.patches(NS, NAME) == 0


def test_a_repeated_field_past_its_bound_is_refused_before_it_is_read(mirror_tcp):
    """Within the receive limit, the bound is checked on the message's lengths: the one
    violation, not one per group built first."""
    pod = mirror_tcp.create_pod(NAME, {"gpu-fraction": "0.5"})
    alloc = allocation(pod)
    alloc.selected_fractional_gpu_groups.extend([pb.FractionalGpuGroup()] * 20_000)
    error = refused(mirror_tcp, mirror_request(alloc))
    assert bad_request_fields(error) == [
        ("allocation.selected_fractional_gpu_groups", f"must list at most {MAX_IDS} (got 20001)")]


@pytest.mark.parametrize("field", ["reserved_gpu_ids", "selected_fractional_gpu_groups"])
def test_allocation_from_proto_refuses_a_long_repeated_field(field):
    alloc = pb.Allocation()
    if field == "reserved_gpu_ids":
        alloc.reserved_gpu_ids.extend([""] * (MAX_IDS + 1))
    else:
        alloc.selected_fractional_gpu_groups.extend([pb.FractionalGpuGroup()] * (MAX_IDS + 1))
    with pytest.raises(InvalidAllocation) as e:
        allocation_from_proto(alloc)
    assert [(x.key, x.rule) for x in e.value.errors] == [
        (field, f"must list at most {MAX_IDS} (got {MAX_IDS + 1})")]
    alloc.ClearField(field)
    assert allocation_from_proto(alloc).gpu_ids == ()
