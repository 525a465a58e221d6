"""A request that does not decode is answered by the servicer, not by gRPC.

gRPC decodes a request before the servicer runs. A DecodeError there (a string field that is
not UTF-8, a truncated message) never reaches the servicer: the caller gets UNKNOWN (grpc.aio)
or INTERNAL with protobuf's or gRPC's own text, naming no field, gRPC logs an ERROR with a
trace, and no metric counts the call. `add_service` registers a servicer as the generated
`add_*Servicer_to_server` does, through gRPC's own API, but with a request deserializer that
does not raise: a request that does not decode reaches the method as an `Undecodable`, which
the servicer refuses as INVALID_ARGUMENT naming `request`, like any other bad input. Used by
the mirror's AllocationMirror and the node agent's NodeEnforcer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError, Message
from google.protobuf.message_factory import GetMessageClass

REQUEST_FIELD = "request"
"""The field an undecodable request's refusal names: the request as a whole."""

MAX_REASON = 80
"""Characters of the parser's reason quoted (it is the protobuf runtime's, not the caller's,
text; the cut keeps a status and a log line short whatever a runtime says)."""


@dataclass(frozen=True, slots=True)
class Undecodable:
    """A request whose bytes did not decode: its message type's full name and why not."""

    message: str
    reason: str

    @property
    def rule(self) -> str:
        return (f"must be a valid protobuf encoding of {self.message} (string fields UTF-8): "
                f"{self.reason}")

    def __str__(self) -> str:
        return f"{REQUEST_FIELD}: {self.rule}"


def _reason(error: DecodeError) -> str:
    """The parser's reason without the type it names (the rule names it): upb says
    `Error parsing message with type '<type>': String field had bad UTF-8`."""
    text = str(error)
    _, sep, after = text.partition("': ")
    text = " ".join((after if sep else text).split())[:MAX_REASON]
    return text or "it does not decode"


def lenient(message_type: type[Message]) -> Callable[[bytes], Message | Undecodable]:
    """`message_type.FromString` that returns an `Undecodable` where that raises DecodeError."""
    name = message_type.DESCRIPTOR.full_name

    def decode(data: bytes) -> Message | Undecodable:
        try:
            return message_type.FromString(data)
        except DecodeError as e:
            return Undecodable(name, _reason(e))
    return decode


def add_service(server: Any, servicer: object, service: ServiceDescriptor) -> None:
    """Serves `service`'s methods (unary ones: the only kind kai_fractions declares) from
    `servicer`'s methods of the same names on `server` (grpc.Server or grpc.aio.Server), each
    request decoded by `lenient`: each method receives its request message or an
    `Undecodable`, and must refuse the latter."""
    handlers = {}
    for method in service.methods:
        if method.client_streaming or method.server_streaming:
            raise ValueError(f"{service.full_name}/{method.name}: a streaming method; "
                             "add_service serves unary methods only")
        handlers[method.name] = grpc.unary_unary_rpc_method_handler(
            getattr(servicer, method.name),
            request_deserializer=lenient(GetMessageClass(method.input_type)),
            response_serializer=GetMessageClass(method.output_type).SerializeToString)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)
