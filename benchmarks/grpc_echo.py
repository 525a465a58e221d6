"""The gRPC baselines of P1, each in its own process (`python -m benchmarks.grpc_echo`).

A server that serves the SAME method as the mirror, `kai_fractions.v1.AllocationMirror/
MirrorAllocation`: it parses the request and answers a canned response (`--response FILE`, a
serialized MirrorAllocationResponse taken from the real mirror), so client code, message sizes
and (de)serialisation match the real call and only the mirror's own work is missing.

``--server threads`` (default): a classic gRPC server with a pool of 16 worker threads, as the
mirror's was before it moved to grpc.aio; ``--server aio``: a grpc.aio server on one event
loop, as the mirror's is now.

With ``--patch-kubeconfig FILE --patch-annotations FILE`` each call first makes the pod PATCH
for the request's pod before it answers: with threads, the bare official-client PATCH of (b)
from the handler thread, baseline (d); on aio, the same merge patch through the mirror's own
event-loop store (`AsyncKubePodStore.patch_annotations`), baseline (d2). Either is the floor of
a Python gRPC service of that shape that writes one pod per call, with none of the mirror's own
work. Prints ``PORT <n>`` on stdout when it is listening.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import threading
from collections.abc import Awaitable, Callable
from concurrent import futures
from pathlib import Path

import grpc

from kai_fractions.api.v1 import allocation_pb2 as pb
from kai_fractions.mirror.servicer import SERVICE_NAME

WORKERS = 16


def _handlers(behaviour: Callable) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(SERVICE_NAME, {
        "MirrorAllocation": grpc.unary_unary_rpc_method_handler(
            behaviour, request_deserializer=pb.MirrorAllocationRequest.FromString,
            response_serializer=pb.MirrorAllocationResponse.SerializeToString)})


def serve(response: pb.MirrorAllocationResponse, port: int = 0,
          patch: Callable[[str, str, str], None] | None = None) -> tuple[grpc.Server, int]:
    """The thread-pool server; `patch(namespace, name, uid)` runs in the handler thread."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=WORKERS,
                                                    thread_name_prefix="echo-rpc"))

    def mirror_allocation(request: pb.MirrorAllocationRequest, context
                          ) -> pb.MirrorAllocationResponse:
        if patch is not None:
            pod = request.allocation.pod
            patch(pod.namespace, pod.name, pod.uid)
        return response

    server.add_generic_rpc_handlers((_handlers(mirror_allocation),))
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server, bound


async def serve_aio(response: pb.MirrorAllocationResponse,
                    patch: Callable[[str, str, str], Awaitable[object]] | None = None) -> None:
    """The grpc.aio server, until cancelled; `patch` is awaited on the loop."""
    server = grpc.aio.server()

    async def mirror_allocation(request: pb.MirrorAllocationRequest, context
                                ) -> pb.MirrorAllocationResponse:
        if patch is not None:
            pod = request.allocation.pod
            await patch(pod.namespace, pod.name, pod.uid)
        return response

    server.add_generic_rpc_handlers((_handlers(mirror_allocation),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"PORT {port}", flush=True)
    await server.wait_for_termination()


def _aio_patch(kubeconfig: Path, annotations: dict[str, str]
               ) -> Callable[[str, str, str], Awaitable[object]]:
    from kai_fractions.mirror.aio_store import AsyncKubePodStore
    from kai_fractions.mirror.kube_store import load_api_client

    store = AsyncKubePodStore(load_api_client(str(kubeconfig)))

    def patch(namespace: str, name: str, uid: str) -> Awaitable[object]:
        return store.patch_annotations(namespace, name, annotations, uid=uid,
                                       resource_version="")

    return patch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.grpc_echo")
    parser.add_argument("--response", required=True, metavar="FILE",
                        help="a serialized MirrorAllocationResponse")
    parser.add_argument("--server", choices=("threads", "aio"), default="threads")
    parser.add_argument("--patch-kubeconfig", metavar="FILE",
                        help="make the pod PATCH of the request's pod in every call")
    parser.add_argument("--patch-annotations", metavar="FILE",
                        help="the annotations it writes (a JSON object)")
    args = parser.parse_args(argv)
    with open(args.response, "rb") as f:
        response = pb.MirrorAllocationResponse.FromString(f.read())
    annotations: dict[str, str] = {}
    if args.patch_kubeconfig:
        with open(args.patch_annotations) as f:
            annotations = json.load(f)
    if args.server == "aio":
        patch = _aio_patch(Path(args.patch_kubeconfig), annotations) \
            if args.patch_kubeconfig else None
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(serve_aio(response, patch))
        return 0
    bare = None
    if args.patch_kubeconfig:
        from .bench_mirror import BarePatch

        bare = BarePatch(Path(args.patch_kubeconfig), annotations, read_first=False)
    server, port = serve(response, patch=(lambda ns, name, _uid: bare(ns, name))
                         if bare is not None else None)
    print(f"PORT {port}", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        threading.Event().wait()
    server.stop(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
