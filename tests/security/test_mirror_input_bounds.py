"""Issue 17, finding 9, through the real gRPC server: a caller's oversized input is refused
with INVALID_ARGUMENT naming the field, before anything is written; error details always fit
gRPC's metadata (a 5000-GPU list answered RESOURCE_EXHAUSTED on the caller's side before, for
its details; now the server's receive limit refuses a request that large unread)."""

from __future__ import annotations

import grpc
import pytest

from tests.mirror.messages import allocation, bad_request_fields, mirror_request

pytestmark = pytest.mark.integration

NS, NAME = "team-a", "train-0"


def refused(mirror, request) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        mirror.stub.MirrorAllocation(request, timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
    assert mirror.patches(NS, NAME) == 0
    return e.value


def test_int64_max_node_memory_is_refused_before_any_write(mirror_tcp):
    pod = mirror_tcp.create_pod(NAME, {"gpu-fraction": "0.5"})
    error = refused(mirror_tcp, mirror_request(allocation(pod, memory=2**63 - 1)))
    assert bad_request_fields(error) == [(
        "allocation.node_gpu_memory_mib",
        f"must be at most 1099511627776 MiB (got '{2**63 - 1}')")]


def test_2000_gpu_ids_are_refused_with_details_that_fit(mirror_tcp):
    """2,000 ids fit the server's receive limit (74 KB of 128 KiB): refused by the bound, with
    details that stay small."""
    pod = mirror_tcp.create_pod(NAME, {"gpu-fraction": "0.5"})
    gpus = tuple(f"GPU-{i:08x}-0000-4000-8000-000000000000" for i in range(2000))
    error = refused(mirror_tcp, mirror_request(allocation(pod, gpus=gpus, count=0)))
    fields = bad_request_fields(error)
    assert fields[0] == ("allocation.reserved_gpu_ids", "must list at most 64 (got 2000)")
    assert sum(len(f) + len(d) for f, d in fields) < 4096
    assert len(error.details()) < 4096


def test_5000_gpu_ids_are_refused_unread(mirror_tcp):
    """185 KB: past the server's receive limit, refused before anything is parsed."""
    pod = mirror_tcp.create_pod(NAME, {"gpu-fraction": "0.5"})
    gpus = tuple(f"GPU-{i:08x}-0000-4000-8000-000000000000" for i in range(5000))
    with pytest.raises(grpc.RpcError) as raised:
        mirror_tcp.stub.MirrorAllocation(mirror_request(allocation(pod, gpus=gpus, count=0)),
                                         timeout=10)
    assert raised.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert mirror_tcp.patches(NS, NAME) == 0


def test_oversized_names_are_refused(mirror_tcp):
    pod = mirror_tcp.create_pod(NAME, {"gpu-fraction": "0.5"})
    error = refused(mirror_tcp, mirror_request(allocation(pod, node="n" * 5000)))
    assert bad_request_fields(error)[0] == (
        "allocation.selected_node", "must be at most 253 characters (got 5000)")


def test_a_portion_above_what_the_pod_asked_for_is_refused(mirror_tcp):
    """Finding 1: portion 1 mirrored onto a pod that asked for gpu-fraction 0.1 was written,
    signed and applied as a 79 GiB cap."""
    pod = mirror_tcp.create_pod(NAME, {"gpu-fraction": "0.1"})
    error = refused(mirror_tcp, mirror_request(allocation(pod, portion="1")))
    assert bad_request_fields(error) == [(
        "allocation.received_gpu.portion",
        "grants more than container 'trainer' asks for (at most 0.1 of a GPU) (got '1')")]


def test_a_portion_below_a_memory_sized_pods_request_is_refused(mirror_tcp):
    """The pod keeps its own request (20000 MiB), so a portion the scheduler did not size for
    it (0.25 of 40960 MiB) would leave the node guaranteeing more than the GPU's ledger holds.
    Upstream KAI sizes it 0.49 (tests/contract/test_binder.py, _kai_portion)."""
    pod = mirror_tcp.create_pod(NAME, {
        "nvidia.com/container.trainer.gpu-memory.request": "20000Mi"})
    error = refused(mirror_tcp, mirror_request(allocation(pod, portion="0.25")))
    assert bad_request_fields(error) == [(
        "allocation.received_gpu.portion",
        "is too small for container 'trainer': its own request of 20000 MiB of GPU memory (the "
        "binder keeps it) needs at least 0.49 of a 40960 MiB GPU, as KAI's scheduler sizes it "
        "(got '0.25')")]
    mirror_tcp.stub.MirrorAllocation(mirror_request(allocation(pod, portion="0.49")), timeout=10)
    assert mirror_tcp.patches(NS, NAME) == 1


def test_more_gpus_than_the_pod_asked_for_are_refused(mirror_tcp):
    pod = mirror_tcp.create_pod(NAME, {"gpu-fraction": "0.5"})
    gpus = ("GPU-1111aaaa-0000-4000-8000-000000000001", "GPU-2222bbbb-0000-4000-8000-000000000002")
    error = refused(mirror_tcp, mirror_request(allocation(pod, gpus=gpus, modes=(1, 1))))
    assert [field for field, _ in bad_request_fields(error)] == ["allocation.reserved_gpu_ids"]


def test_an_allocation_for_a_node_that_does_not_exist_is_refused(mirror_tcp):
    """Finding 9: `selected_node` was not checked when the caller gave the node's memory."""
    pod = mirror_tcp.create_pod(NAME, {"gpu-fraction": "0.5"})
    error = refused(mirror_tcp, mirror_request(allocation(pod, node="no-such-node")))
    assert bad_request_fields(error) == [(
        "allocation.selected_node", "names a node that does not exist (got 'no-such-node')")]
