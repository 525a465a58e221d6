"""MirrorError -> a gRPC status with machine-readable details (google.rpc.*), never a trace.

INVALID_ARGUMENT carries BadRequest field violations: a request field path
(`allocation.received_gpu.portion`; `request` for a request that did not decode) or, for a
problem in the pod's own annotations, `pod.metadata.annotations["<key>"]`, each with the rule
in words.
"""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from ...contract import ContractError
from ...contract.errors import shown
from ...grpc_decode import REQUEST_FIELD
from ..errors import (
    AllocationConflict,
    ApiRejected,
    ApiUnavailable,
    DeadlineExceeded,
    InvalidAllocation,
    MirrorError,
    PodNotFound,
    PodReplaced,
)

DOMAIN = "kai-fractions.io"
# Top-level fields of the Allocation message: an error key starting with one of these is a
# request field; anything else is an annotation key of the pod.
ALLOCATION_FIELDS = frozenset({
    "pod", "selected_node", "received_resource_type", "received_gpu",
    "selected_fractional_gpu_groups", "reserved_gpu_ids", "node_gpu_memory_mib", "cdi",
    "reserve_mib", "container_name",
})
REQUEST_FIELDS = frozenset({"idempotency_key", "replace", REQUEST_FIELD})
"""Fields of the request message itself, and `request`: the request as a whole (one that did
not decode, `grpc_decode`)."""


def field_path(key: str, prefix: str) -> str:
    head = key.split(".", 1)[0].split("[", 1)[0]
    if head in REQUEST_FIELDS:
        return key
    if head in ALLOCATION_FIELDS:
        return prefix + key
    return f'pod.metadata.annotations["{key}"]'


MAX_VIOLATIONS = 20
"""Field violations one status carries: with values cut to 80 characters (contract.errors.shown)
the details stay far below gRPC's metadata limit (16 KiB by default, 8 KiB on some clients)."""


def _description(e: ContractError) -> str:
    return e.rule if e.value is None else f"{e.rule} (got {shown(e.value)})"


def _violations(errors: tuple[ContractError, ...], prefix: str) -> list[tuple[str, str]]:
    out = [(field_path(e.key, prefix), _description(e)) for e in errors[:MAX_VIOLATIONS]]
    if len(errors) > MAX_VIOLATIONS:
        out.append(("", f"... and {len(errors) - MAX_VIOLATIONS} more"))
    return out


def _pack(*messages) -> list[any_pb2.Any]:
    packed = []
    for message in messages:
        holder = any_pb2.Any()
        holder.Pack(message)
        packed.append(holder)
    return packed


def to_status(error: MirrorError, *, field_prefix: str = "allocation.") -> grpc.Status:
    message = str(error)
    details: list = []
    if isinstance(error, InvalidAllocation):
        code = code_pb2.INVALID_ARGUMENT
        violations = _violations(error.errors, field_prefix)
        details = _pack(error_details_pb2.BadRequest(field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=field, description=description)
            for field, description in violations]))
        message = "; ".join(f"{field}: {description}" if field else description
                            for field, description in violations)
    elif isinstance(error, PodReplaced):
        code = code_pb2.NOT_FOUND
        details = _pack(error_details_pb2.ErrorInfo(
            reason="POD_REPLACED", domain=DOMAIN,
            metadata={"expected_uid": error.expected_uid, "actual_uid": error.actual_uid}),
            _resource(error))
    elif isinstance(error, PodNotFound):
        code = code_pb2.NOT_FOUND
        details = _pack(_resource(error))
    elif isinstance(error, AllocationConflict):
        code = code_pb2.FAILED_PRECONDITION
        details = _pack(error_details_pb2.PreconditionFailure(violations=[
            error_details_pb2.PreconditionFailure.Violation(
                type=error.kind, subject=error.subject, description=message)]))
    elif isinstance(error, ApiUnavailable):
        code = code_pb2.UNAVAILABLE
        details = _pack(error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(seconds=1)))
    elif isinstance(error, DeadlineExceeded):
        code = code_pb2.DEADLINE_EXCEEDED
    elif isinstance(error, ApiRejected):
        code = code_pb2.INTERNAL
    else:
        code = code_pb2.INTERNAL
    return rpc_status.to_status(status_pb2.Status(code=code, message=message, details=details))


def _resource(error: PodNotFound) -> error_details_pb2.ResourceInfo:
    return error_details_pb2.ResourceInfo(
        resource_type="Pod", resource_name=f"{error.namespace}/{error.name}",
        description=str(error))


def internal(message: str) -> grpc.Status:
    return rpc_status.to_status(status_pb2.Status(code=code_pb2.INTERNAL, message=message))


def unauthenticated(message: str) -> grpc.Status:
    return rpc_status.to_status(status_pb2.Status(code=code_pb2.UNAUTHENTICATED, message=message))
