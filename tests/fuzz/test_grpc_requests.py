"""Random protobuf field values, and random bytes (a valid request spoiled: cut short, a byte
changed, a string field made non-UTF-8), through the real AllocationMirror gRPC server over
the in-memory store: every answer is OK or a well-formed status a scheduler can act on
(INVALID_ARGUMENT with field violations, NOT_FOUND, FAILED_PRECONDITION), never INTERNAL or
UNKNOWN, and a refused call writes nothing."""

from __future__ import annotations

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from hypothesis import event, given
from hypothesis import strategies as st

from kai_fractions.api.v1 import allocation_pb2 as pb
from kai_fractions.api.v1 import allocation_pb2_grpc as pb_grpc
from kai_fractions.mirror.grpc.server import MirrorServer, ServerOptions
from kai_fractions.mirror.record import MIRRORED_ANNOTATION
from kai_fractions.mirror.service import MirrorService
from kai_fractions.mirror.signing import signing_annotations
from kai_fractions.signing import Keyring, KeyringSource
from tests.support.fake_store import FakePodStore

from .strategies import FUZZ, GPU_A, GPU_B, annotations, values

pytestmark = pytest.mark.integration

UID = "0b7e1c9a-3d2f-4a5b-8c6d-7e8f9a0b1c2d"
ACTIONABLE = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
              grpc.StatusCode.FAILED_PRECONDITION}
INT32 = st.integers(-2**31, 2**31 - 1)
INT64 = st.integers(-2**63, 2**63 - 1)
ENUM = st.one_of(st.integers(0, 3), INT32)
short_text = st.one_of(st.sampled_from(["", "team-a", "train-0", "trainer", UID, "node-1",
                                        GPU_A, GPU_B, "group-0"]), st.text(max_size=20))

def _valid_allocation() -> pb.Allocation:
    return pb.Allocation(
        pod=pb.PodRef(namespace="team-a", name="train-0", uid=UID), selected_node="node-1",
        received_resource_type=pb.RECEIVED_RESOURCE_TYPE_FRACTION,
        received_gpu=pb.ReceivedGpu(count=1, portion="0.5"),
        selected_fractional_gpu_groups=[pb.FractionalGpuGroup(
            id="group-0", compute_sharing_mode=pb.COMPUTE_SHARING_MODE_TIME_SLICING)],
        reserved_gpu_ids=[GPU_A], node_gpu_memory_mib=40960)


def _set(field: str):
    def apply(msg: pb.Allocation, value) -> None:
        target, _, name = field.rpartition(".")
        holder = getattr(msg, target) if target else msg
        if isinstance(value, list):
            del getattr(holder, name)[:]
            getattr(holder, name).extend(value)
        else:
            setattr(holder, name, value)
    return apply


_groups = st.lists(st.builds(pb.FractionalGpuGroup, id=short_text, compute_sharing_mode=ENUM),
                   max_size=3)
# One strategy per field: a mostly valid request with a few fields made strange reaches every
# branch behind validation (writes, conflicts, replaces, sm-sharing), not only the first refusal.
_FIELDS = {
    "pod.namespace": st.sampled_from(["team-a", "", "other"]),
    "pod.name": st.sampled_from(["train-0", "", "gone"]),
    "pod.uid": st.sampled_from([UID, "", "another-uid"]),
    "selected_node": st.sampled_from(["node-1", "", "no-such-node"]),
    "received_resource_type": ENUM,
    "received_gpu.count": st.one_of(st.integers(-1, 3), INT32),
    "received_gpu.portion": st.one_of(values, st.sampled_from(["0.5", "0.25", "1"])),
    "selected_fractional_gpu_groups": _groups,
    "reserved_gpu_ids": st.lists(st.one_of(st.sampled_from([GPU_A, GPU_B]), short_text),
                                 max_size=3),
    "node_gpu_memory_mib": st.one_of(st.sampled_from([0, 40960, 81920]), INT64),
    "cdi": st.booleans(),
    "reserve_mib": st.one_of(st.sampled_from([0, 1024]), INT64),
    "container_name": st.one_of(st.sampled_from(["", "trainer", "side"]), short_text),
}
_SM_GROUP = [pb.FractionalGpuGroup(id="group-0",
                                   compute_sharing_mode=pb.COMPUTE_SHARING_MODE_SM_SHARING)]


_POD_ANNOTATIONS = [
    {"gpu-fraction": "0.5"},
    {"nvidia.com/container.trainer.gpu-memory.request": "10Gi"},
    {"nvidia.com/container.trainer.gpu-memory.limit": "12Gi",
     "nvidia.com/container.trainer.gpu-compute.mode": "sm-sharing"},
    {"gpu-memory": "8192", "gpu-fraction-container-name": "side"},
]
SM_POD = 2


@st.composite
def allocations(draw, sm: bool | None = None) -> pb.Allocation:
    msg = _valid_allocation()
    if sm if sm is not None else draw(st.booleans()):
        _set("selected_fractional_gpu_groups")(msg, list(_SM_GROUP))
    count = draw(st.sampled_from([0, 0, 1, 1, 2, 3]))
    for field in draw(st.lists(st.sampled_from(sorted(_FIELDS)), min_size=count,
                               max_size=count, unique=True)):
        _set(field)(msg, draw(_FIELDS[field]))
    return msg


@st.composite
def scenarios(draw) -> tuple[dict[str, str], list[pb.MirrorAllocationRequest]]:
    """Pod annotations, then 1-3 MirrorAllocation calls on that pod (repeats, other decisions,
    replaces): mostly valid, so that the branches behind validation are reached too."""
    index = draw(st.integers(0, len(_POD_ANNOTATIONS) - 1))
    base = _POD_ANNOTATIONS[index]
    kind = draw(st.sampled_from(["as is", "as is", "plus random", "random"]))
    anns = {"as is": base, "plus random": {**base, **draw(annotations)},
            "random": draw(annotations)}[kind]
    keys = st.one_of(st.sampled_from(["", "bind/1", "bind/2"]), st.text(max_size=300))
    requests = draw(st.lists(st.builds(pb.MirrorAllocationRequest,
                                       allocation=allocations(index == SM_POD),
                                       idempotency_key=keys, replace=st.booleans()),
                             min_size=1, max_size=3))
    return anns, requests


pod_annotations = st.one_of(
    st.sampled_from(_POD_ANNOTATIONS),
    st.builds(lambda a, b: {**a, **b}, st.sampled_from(_POD_ANNOTATIONS), annotations),
    annotations,
)


@pytest.fixture(scope="module")
def rig():
    store = FakePodStore()
    store.nodes["node-1"] = {"nvidia.com/gpu.memory": "40960"}
    service = MirrorService(store, extra_annotations=signing_annotations(
        KeyringSource.fixed(Keyring.of(bytes(range(32))))))
    server = MirrorServer(service, ServerOptions(listen="127.0.0.1:0")).start()
    channel = grpc.insecure_channel(server.address)
    try:
        yield store, pb_grpc.AllocationMirrorStub(channel), channel
    finally:
        channel.close()
        server.stop(grace=0)


def reset(store: FakePodStore, anns: dict[str, str]) -> None:
    store.pods.clear()
    store.add_pod({"metadata": {"name": "train-0", "namespace": "team-a", "uid": UID,
                                "annotations": dict(anns)},
                   "spec": {"containers": [{"name": "trainer"}, {"name": "side"}]}})
    store.patches.clear()


def check_status(error: grpc.RpcError) -> None:
    event(error.code().name)
    assert error.code() in ACTIONABLE, (error.code(), error.details())
    assert error.details()
    if error.code() == grpc.StatusCode.INVALID_ARGUMENT:
        status = rpc_status.from_call(error)
        assert status is not None
        bad = error_details_pb2.BadRequest()
        assert any(d.Unpack(bad) for d in status.details if d.Is(bad.DESCRIPTOR))
        assert bad.field_violations and all(v.field and v.description
                                            for v in bad.field_violations)


@FUZZ
@given(scenarios())
def test_mirror_allocation_answers_are_well_formed(rig, scenario):
    store, stub, _ = rig
    anns, requests = scenario
    reset(store, anns)
    for request in requests:
        before = len(store.patches)
        try:
            reply = stub.MirrorAllocation(request, timeout=10)
        except grpc.RpcError as e:
            check_status(e)
            assert len(store.patches) == before  # refused: nothing written
        else:
            event("OK, changed" if reply.changed else "OK, unchanged")
            written = store.patches[before:]
            if reply.changed:
                assert len(written) == 1
            else:  # nothing, or only the record: a repeat under a new key (aliasKeys)
                assert len(written) <= 1
                assert all(set(changes) == {MIRRORED_ANNOTATION} for _, _, changes in written)


@FUZZ
@given(allocations(), pod_annotations)
def test_preview_answers_are_well_formed_and_write_nothing(rig, allocation, anns):
    store, stub, _ = rig
    reset(store, anns)
    try:
        stub.PreviewAllocation(pb.PreviewAllocationRequest(allocation=allocation), timeout=10)
    except grpc.RpcError as e:
        check_status(e)
    assert store.patches == []


@FUZZ
@given(st.builds(pb.PodRef, namespace=short_text, name=short_text, uid=short_text),
       st.text(max_size=20), pod_annotations)
def test_release_answers_are_well_formed(rig, pod, key, anns):
    store, stub, _ = rig
    reset(store, anns)
    try:
        stub.ReleaseAllocation(pb.ReleaseAllocationRequest(pod=pod, idempotency_key=key),
                               timeout=10)
    except grpc.RpcError as e:
        check_status(e)
        assert store.patches == []


_GOOD = {
    "MirrorAllocation": pb.MirrorAllocationRequest(allocation=_valid_allocation(),
                                                   idempotency_key="bind/1"),
    "PreviewAllocation": pb.PreviewAllocationRequest(allocation=_valid_allocation()),
    "ReleaseAllocation": pb.ReleaseAllocationRequest(pod=pb.PodRef(namespace="team-a",
                                                                   name="train-0")),
}


@st.composite
def spoiled_requests(draw) -> tuple[str, bytes]:
    """A method and a valid request's bytes spoiled one way: cut short, one byte changed, two
    bytes replaced by `\\xc0\\x80` (an overlong NUL: not UTF-8 where a string held them), or
    random bytes."""
    method = draw(st.sampled_from(sorted(_GOOD)))
    data = _GOOD[method].SerializeToString()
    at = draw(st.integers(0, len(data) - 2))
    kind = draw(st.sampled_from(["cut", "byte", "not utf-8", "random"]))
    event(f"spoiled: {kind}")
    if kind == "cut":
        spoiled = data[:at]
    elif kind == "byte":
        spoiled = data[:at] + bytes([draw(st.integers(0, 255))]) + data[at + 1:]
    elif kind == "not utf-8":
        spoiled = data[:at] + b"\xc0\x80" + data[at + 2:]
    else:
        spoiled = draw(st.binary(max_size=64))
    return method, spoiled


@FUZZ
@given(spoiled_requests(), pod_annotations)
def test_requests_that_may_not_decode_are_answered_well_formed(rig, request, anns):
    store, _, channel = rig
    method, data = request
    reset(store, anns)
    call = channel.unary_unary(f"/kai_fractions.v1.AllocationMirror/{method}",
                               request_serializer=lambda b: b,
                               response_deserializer=lambda b: b)
    try:
        call(data, timeout=10)
    except grpc.RpcError as e:
        check_status(e)
        assert store.patches == []
