"""The gRPC baseline of P1, in its own process (`python -m benchmarks.grpc_echo`).

A server built like the mirror's (same ThreadPoolExecutor size, no interceptors, plaintext)
that serves the SAME method, `kai_fractions.v1.AllocationMirror/MirrorAllocation`: it parses
the request and answers a canned response (`--response FILE`, a serialized
MirrorAllocationResponse taken from the real mirror), so client code, message sizes and
(de)serialisation match the real call and only the mirror's own work is missing.
Prints ``PORT <n>`` on stdout when it is listening.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
from concurrent import futures

import grpc

from kai_fractions.api.v1 import allocation_pb2 as pb
from kai_fractions.mirror.server import ServerOptions
from kai_fractions.mirror.servicer import SERVICE_NAME


def serve(response: pb.MirrorAllocationResponse, port: int = 0) -> tuple[grpc.Server, int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=ServerOptions().max_workers,
                                                    thread_name_prefix="echo-rpc"))

    def mirror_allocation(request: pb.MirrorAllocationRequest, context
                          ) -> pb.MirrorAllocationResponse:
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
    args = parser.parse_args(argv)
    with open(args.response, "rb") as f:
        response = pb.MirrorAllocationResponse.FromString(f.read())
    server, port = serve(response)
    print(f"PORT {port}", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        threading.Event().wait()
    server.stop(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
