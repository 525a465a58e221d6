"""kai_fractions.v1.AllocationMirror over MirrorService: protobuf in, protobuf or a status out.
The methods are coroutines of the grpc.aio server (`server`); the service decides and writes,
this module only translates its values and errors. A request whose bytes did not decode
arrives as an `Undecodable` (`grpc_decode`) and is refused like any other bad request."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

from ...api.v1 import allocation_pb2 as pb
from ...api.v1 import allocation_pb2_grpc as pb_grpc
from ...contract import ContractError
from ...contract.names import pod_ref_problems
from ...grpc_decode import REQUEST_FIELD, Undecodable
from ..decision import idempotency_key_problems
from ..errors import InvalidAllocation, MirrorError
from ..service import MirrorService
from ..store import Deadline
from .proto import allocation_from_proto, plan_to_proto
from .status import internal, to_status

log = logging.getLogger(__name__)
T = TypeVar("T")
CallObserver = Callable[[str, str, float | None], object]
"""Told of every call answered: method, status code name, seconds (MirrorMetrics.call); None
for a call refused before it ran (no bearer token)."""

SERVICE = pb.DESCRIPTOR.services_by_name["AllocationMirror"]
SERVICE_NAME = SERVICE.full_name
# Answer a little before the caller's deadline, so it gets our status rather than its own.
DEADLINE_MARGIN_S = 0.05


def deadline_of(context: grpc.aio.ServicerContext) -> Deadline:
    remaining = context.time_remaining()
    return Deadline.after(None if remaining is None else max(0.0, remaining - DEADLINE_MARGIN_S))


class AllocationMirrorServicer(pb_grpc.AllocationMirrorServicer):
    def __init__(self, service: MirrorService, observe: CallObserver | None = None) -> None:
        self.service = service
        self.observe = observe

    async def _run(self, context: grpc.aio.ServicerContext, method: str, request: object,
                   fn: Callable[[], Awaitable[T]], field_prefix: str = "allocation.") -> T:
        """`fn()`'s answer, or the status of its error; `request` refused unread when it did
        not decode. Every call is counted (`observe`) with its code."""
        began = time.perf_counter()
        code = grpc.StatusCode.OK
        try:
            if isinstance(request, Undecodable):
                raise InvalidAllocation([ContractError(REQUEST_FIELD, request.rule)])
            return await fn()
        except MirrorError as e:
            status = to_status(e, field_prefix=field_prefix)
            code = status.code
            log.info("%s refused: %s: %s", method, status.code.name, status.details)
            await context.abort_with_status(status)
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED  # the caller went away, or the server stops
            raise
        except Exception:
            # The trace stays in our log; the caller gets a status it can act on.
            code = grpc.StatusCode.INTERNAL
            log.exception("%s failed unexpectedly", method)
            await context.abort_with_status(internal(f"{method}: internal error in the "
                                                     "mirror; see its log"))
        finally:
            if self.observe is not None:
                self.observe(method, code.name, time.perf_counter() - began)
        raise AssertionError("unreachable")  # abort_with_status raises

    async def MirrorAllocation(self, request: pb.MirrorAllocationRequest | Undecodable,
                               context: grpc.aio.ServicerContext
                               ) -> pb.MirrorAllocationResponse:
        async def run() -> pb.MirrorAllocationResponse:
            result = await self.service.mirror(
                allocation_from_proto(request.allocation),
                idempotency_key=request.idempotency_key, replace=request.replace,
                deadline=deadline_of(context))
            return pb.MirrorAllocationResponse(
                annotations=result.annotations,
                containers=[plan_to_proto(p) for p in result.plans],
                changed=result.changed, resource_version=result.resource_version)
        return await self._run(context, "MirrorAllocation", request, run)

    async def PreviewAllocation(self, request: pb.PreviewAllocationRequest | Undecodable,
                                context: grpc.aio.ServicerContext
                                ) -> pb.PreviewAllocationResponse:
        async def run() -> pb.PreviewAllocationResponse:
            result = await self.service.preview(allocation_from_proto(request.allocation),
                                                check_conflict=request.check_conflict,
                                                deadline=deadline_of(context))
            return pb.PreviewAllocationResponse(
                annotations=result.annotations,
                containers=[plan_to_proto(p) for p in result.plans])
        return await self._run(context, "PreviewAllocation", request, run)

    async def ReleaseAllocation(self, request: pb.ReleaseAllocationRequest | Undecodable,
                                context: grpc.aio.ServicerContext
                                ) -> pb.ReleaseAllocationResponse:
        async def run() -> pb.ReleaseAllocationResponse:
            problems = [ContractError(f"pod.{f}", "is required")
                        for f in ("namespace", "name") if not getattr(request.pod, f)]
            problems += pod_ref_problems(request.pod.namespace, request.pod.name,
                                         request.pod.uid)
            problems += idempotency_key_problems(request.idempotency_key)
            if problems:
                raise InvalidAllocation(problems)
            result = await self.service.release(request.pod.namespace, request.pod.name,
                                                request.pod.uid,
                                                idempotency_key=request.idempotency_key,
                                                deadline=deadline_of(context))
            return pb.ReleaseAllocationResponse(removed_keys=list(result.removed_keys),
                                                changed=result.changed)
        return await self._run(context, "ReleaseAllocation", request, run,
                               field_prefix="")

