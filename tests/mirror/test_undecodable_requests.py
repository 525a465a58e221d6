"""Requests whose bytes do not decode (a string field that is not UTF-8, a truncated message)
are INVALID_ARGUMENT with a BadRequest violation naming `request`, counted and logged as any
other refusal, with no trace, and the API server receives no PATCH.

They used to be decoded by gRPC before the servicer ran: the caller got UNKNOWN with
protobuf's own text ("Unexpected <class 'DecodeError'>: ..."), gRPC logged an ERROR with a
trace, and no metric counted the call."""

from __future__ import annotations

import logging
from collections.abc import Callable

import grpc
import pytest
from google.protobuf.message import Message

from kai_fractions.api.v1 import allocation_pb2 as pb
from kai_fractions.mirror.metrics import MirrorMetrics
from tests.support.agent_process import wait_for

from .messages import allocation, bad_request_fields, mirror_request

pytestmark = pytest.mark.integration

NS, NAME = "team-a", "train-0"
SERVICE = "/kai_fractions.v1.AllocationMirror/"
TOKEN = "~~"
"""Put in the field to spoil, then replaced by two bytes no UTF-8 text holds (same length, so
every length prefix stays right)."""
NOT_UTF8 = b"\xc0\x80"  # an overlong NUL: Go and Java decoders are lenient about it, upb is not


def rule(message: str) -> str:
    return f"must be a valid protobuf encoding of kai_fractions.v1.{message} (string fields UTF-8)"


def spoiled(request: Message) -> bytes:
    data = request.SerializeToString()
    assert data.count(TOKEN.encode()) == 1
    return data.replace(TOKEN.encode(), NOT_UTF8)


def raw(mirror, method: str) -> Callable[..., bytes]:
    return mirror.channel.unary_unary(SERVICE + method, request_serializer=lambda b: b,
                                      response_deserializer=lambda b: b)


def _mirror(pod: dict, field: str) -> Message:
    alloc = allocation(pod)
    key = ""
    if field == "pod.name":
        alloc.pod.name = TOKEN
    elif field == "received_gpu.portion":
        alloc.received_gpu.portion = TOKEN
    elif field == "reserved_gpu_ids":
        alloc.reserved_gpu_ids[0] = TOKEN
    elif field == "selected_fractional_gpu_groups.id":
        alloc.selected_fractional_gpu_groups[0].id = TOKEN
    elif field == "idempotency_key":
        key = TOKEN
    return mirror_request(alloc, key=key)


# (method, request message, field spoiled, builder): a singular string of a nested message, a
# repeated string, a string of a repeated message, a top-level string, on each method.
CASES = [
    ("MirrorAllocation", "MirrorAllocationRequest", field, lambda pod, f=field: _mirror(pod, f))
    for field in ("pod.name", "received_gpu.portion", "reserved_gpu_ids",
                  "selected_fractional_gpu_groups.id", "idempotency_key")
] + [
    ("PreviewAllocation", "PreviewAllocationRequest", "selected_node",
     lambda pod: pb.PreviewAllocationRequest(allocation=allocation(pod, node=TOKEN))),
    ("ReleaseAllocation", "ReleaseAllocationRequest", "pod.namespace",
     lambda pod: pb.ReleaseAllocationRequest(pod=pb.PodRef(namespace=TOKEN, name=NAME))),
    ("ReleaseAllocation", "ReleaseAllocationRequest", "idempotency_key",
     lambda pod: pb.ReleaseAllocationRequest(pod=pb.PodRef(namespace=NS, name=NAME),
                                             idempotency_key=TOKEN)),
]


def refused_undecoded(mirror, method: str, data: bytes) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        raw(mirror, method)(data, timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.value.code(), e.value.details())
    return e.value


@pytest.mark.parametrize(("method", "message", "field", "build"), CASES,
                         ids=[f"{c[0]}-{c[2]}" for c in CASES])
def test_a_string_field_that_is_not_utf8_is_invalid_argument_naming_request(
        mirror_tcp, method, message, field, build):
    pod = mirror_tcp.create_pod(NAME, {"gpu-fraction": "0.5"},
                                containers=("trainer",))
    error = refused_undecoded(mirror_tcp, method, spoiled(build(pod)))
    ((name, description),) = bad_request_fields(error)
    assert name == "request"
    assert description.startswith(rule(message)), description
    assert "UTF-8" in description.removeprefix(rule(message))  # the parser's reason follows
    assert error.details() == f"request: {description}"
    assert mirror_tcp.patches(NS, NAME) == 0


@pytest.mark.parametrize(("method", "message"), [
    ("MirrorAllocation", "MirrorAllocationRequest"),
    ("PreviewAllocation", "PreviewAllocationRequest"),
    ("ReleaseAllocation", "ReleaseAllocationRequest"),
])
def test_a_truncated_or_garbled_request_is_invalid_argument_naming_request(
        mirror_tcp, method, message):
    pod = mirror_tcp.create_pod(NAME, {"gpu-fraction": "0.5"})
    good = {"MirrorAllocation": mirror_request(allocation(pod)),
            "PreviewAllocation": pb.PreviewAllocationRequest(allocation=allocation(pod)),
            "ReleaseAllocation": pb.ReleaseAllocationRequest(
                pod=pb.PodRef(namespace=NS, name=NAME))}[method].SerializeToString()
    for data in (good[:-3], b"\xff\xff\xff\xff"):
        error = refused_undecoded(mirror_tcp, method, data)
        ((name, description),) = bad_request_fields(error)
        assert name == "request"
        assert description.startswith(rule(message)), description
    assert mirror_tcp.patches(NS, NAME) == 0


def test_an_undecodable_request_is_counted_and_logged_as_a_refusal_without_a_trace(
        mirror_factory, caplog):
    """The call reaches the servicer's accounting: counted by method and code, logged at INFO
    as other refusals are; nothing at ERROR (gRPC's trace of the DecodeError was)."""
    metrics = MirrorMetrics()
    mirror = mirror_factory(metrics=metrics)
    pod = mirror.create_pod(NAME, {"gpu-fraction": "0.5"})
    caplog.set_level(logging.INFO)
    refused_undecoded(mirror, "MirrorAllocation", spoiled(_mirror(pod, "pod.name")))
    refused_undecoded(mirror, "ReleaseAllocation", b"\xff\xff\xff\xff")

    def calls(method: str) -> float | None:
        return metrics.registry.get_sample_value(
            "kai_fractions_mirror_calls_total", {"method": method, "code": "INVALID_ARGUMENT"})

    # A refusal reaches the caller as its handler unwinds, a moment before it is counted.
    wait_for(lambda: calls("MirrorAllocation") == 1 and calls("ReleaseAllocation") == 1,
             what="the refusals counted")
    refusals = [r.getMessage() for r in caplog.records
                if r.levelno == logging.INFO and " refused: INVALID_ARGUMENT: request: " in
                r.getMessage()]
    assert len(refusals) == 2, refusals
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert mirror.patches(NS, NAME) == 0
