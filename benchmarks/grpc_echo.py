"""The gRPC baseline of P1, in its own process (`python -m benchmarks.grpc_echo`).

A server built like the mirror's (same ThreadPoolExecutor size, no interceptors, plaintext)
that serves the SAME method, `kai_fractions.v1.AllocationMirror/MirrorAllocation`: it parses
the request and answers a canned response (`--response FILE`, a serialized
MirrorAllocationResponse taken from the real mirror), so client code, message sizes and
(de)serialisation match the real call and only the mirror's own work is missing.

With ``--patch-kubeconfig FILE --patch-annotations FILE`` each call first makes the bare pod
PATCH of (b) for the request's pod (the official client, the same annotations), from the
handler thread: baseline (d), the floor of ANY Python gRPC service that writes one pod per call
(a and b composed in one process, thread handoffs and GIL included), with none of the mirror's
own work. Prints ``PORT <n>`` on stdout when it is listening.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import threading
from collections.abc import Callable
from concurrent import futures
from pathlib import Path

import grpc

from kai_fractions.api.v1 import allocation_pb2 as pb
from kai_fractions.mirror.server import ServerOptions
from kai_fractions.mirror.servicer import SERVICE_NAME


def serve(response: pb.MirrorAllocationResponse, port: int = 0,
          patch: Callable[[str, str], None] | None = None) -> tuple[grpc.Server, int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=ServerOptions().max_workers,
                                                    thread_name_prefix="echo-rpc"))

    def mirror_allocation(request: pb.MirrorAllocationRequest, context
                          ) -> pb.MirrorAllocationResponse:
        if patch is not None:
            pod = request.allocation.pod
            patch(pod.namespace, pod.name)
        return response

    handler = grpc.method_handlers_generic_handler(SERVICE_NAME, {
        "MirrorAllocation": grpc.unary_unary_rpc_method_handler(
            mirror_allocation, request_deserializer=pb.MirrorAllocationRequest.FromString,
            response_serializer=pb.MirrorAllocationResponse.SerializeToString)})
    server.add_generic_rpc_handlers((handler,))
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server, bound


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.grpc_echo")
    parser.add_argument("--response", required=True, metavar="FILE",
                        help="a serialized MirrorAllocationResponse")
    parser.add_argument("--patch-kubeconfig", metavar="FILE",
                        help="make (b)'s bare PATCH of the request's pod in every call")
    parser.add_argument("--patch-annotations", metavar="FILE",
                        help="the annotations it writes (a JSON object)")
    args = parser.parse_args(argv)
    with open(args.response, "rb") as f:
        response = pb.MirrorAllocationResponse.FromString(f.read())
    patch = None
    if args.patch_kubeconfig:
        from .bench_mirror import BarePatch

        with open(args.patch_annotations) as f:
            patch = BarePatch(Path(args.patch_kubeconfig), json.load(f), read_first=False)
    server, port = serve(response, patch=patch)
    print(f"PORT {port}", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        threading.Event().wait()
    server.stop(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
