"""NodeEnforcer requests whose bytes do not decode (a string field that is not UTF-8, a
truncated message), through the agent's real socket: INVALID_ARGUMENT naming `request` and
the rule, with no trace in the log, and nothing provisioned, released or drained.

They used to be decoded by gRPC before the servicer ran: the caller got INTERNAL
("Exception deserializing request!") and gRPC logged an ERROR with a trace."""

from __future__ import annotations

import logging

import grpc
import pytest
from google.protobuf.message import Message

from kai_fractions.api.v1 import allocation_pb2, node_pb2

from .builders import Rig, binder_annotations

pytestmark = pytest.mark.integration

UID = "0a1b2c3d-0000-4000-8000-000000000777"
SERVICE = "/kai_fractions.v1.NodeEnforcer/"
TOKEN = "~~"
"""Put in the field to spoil, then replaced by two bytes no UTF-8 text holds (same length, so
every length prefix stays right)."""
NOT_UTF8 = b"\xc0\x80"


def rule(message: str) -> str:
    return (f"request: must be a valid protobuf encoding of kai_fractions.v1.{message} "
            "(string fields UTF-8)")


def spoiled(request: Message) -> bytes:
    data = request.SerializeToString()
    assert data.count(TOKEN.encode()) == 1
    return data.replace(TOKEN.encode(), NOT_UTF8)


def refused(rig: Rig, method: str, data: bytes) -> grpc.RpcError:
    with grpc.insecure_channel(f"unix:{rig.options.socket}") as channel:
        call = channel.unary_unary(SERVICE + method, request_serializer=lambda b: b,
                                   response_deserializer=lambda b: b)
        with pytest.raises(grpc.RpcError) as e:
            call(data, timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.value.code(), e.value.details())
    return e.value


def provision(rig: Rig, **fields: str) -> node_pb2.ProvisionRequest:
    annotations = binder_annotations(devices=rig.gpu0)
    if "annotation" in fields:
        annotations["gpu-fraction"] = fields.pop("annotation")
    containers = [fields.pop("container", "main")]
    return node_pb2.ProvisionRequest(
        pod=allocation_pb2.PodRef(**{"namespace": "jobs", "name": "direct", "uid": UID,
                                     **fields}),
        annotations=annotations, containers=containers)


# A singular string of a nested message, a map's value, a repeated string, a top-level string.
CASES = [
    ("Provision", "ProvisionRequest", lambda rig: provision(rig, uid=TOKEN)),
    ("Provision", "ProvisionRequest", lambda rig: provision(rig, annotation=TOKEN)),
    ("Provision", "ProvisionRequest", lambda rig: provision(rig, container=TOKEN)),
    ("Release", "ReleaseRequest", lambda rig: node_pb2.ReleaseRequest(
        pod=allocation_pb2.PodRef(namespace="jobs", name=TOKEN))),
    ("Release", "ReleaseRequest", lambda rig: node_pb2.ReleaseRequest(
        pod=allocation_pb2.PodRef(uid=UID), container=TOKEN)),
    ("Drain", "DrainRequest", lambda rig: node_pb2.DrainRequest(
        pod=allocation_pb2.PodRef(uid=UID), container=TOKEN)),
]


def test_undecodable_requests_are_invalid_argument_naming_request_without_a_trace(
        running: Rig, caplog) -> None:
    caplog.set_level(logging.INFO)
    for method, message, build in CASES:
        error = refused(running, method, spoiled(build(running)))
        assert error.details().startswith(rule(message)), error.details()
        assert "UTF-8" in error.details().removeprefix(rule(message))  # the parser's reason
    for method, message, good in (
            ("Provision", "ProvisionRequest", provision(running)),
            ("Release", "ReleaseRequest", node_pb2.ReleaseRequest(
                pod=allocation_pb2.PodRef(uid=UID))),
            ("Drain", "DrainRequest", node_pb2.DrainRequest(
                pod=allocation_pb2.PodRef(uid=UID)))):
        for data in (good.SerializeToString()[:-3], b"\xff\xff\xff\xff"):
            error = refused(running, method, data)
            assert error.details().startswith(rule(message)), error.details()
    # GetNodeState's request has no field: only bytes that are no message at all fail.
    for data in (b"\x0a\x05ab", b"\xff\xff\xff\xff"):
        error = refused(running, "GetNodeState", data)
        assert error.details().startswith(rule("GetNodeStateRequest")), error.details()
    assert running.reconciler.pods.provisioned == {}
    assert running.mps.control.terminated == []
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
