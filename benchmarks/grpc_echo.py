"""The gRPC baselines of P1, each in its own process (`python -m benchmarks.grpc_echo`).

A grpc.aio server on one event loop, the kind the mirror runs, that serves the SAME method as
the mirror, `kai_fractions.v1.AllocationMirror/MirrorAllocation`: it parses the request and
answers a canned response (`--response FILE`, a serialized MirrorAllocationResponse taken from
the real mirror), so client code, message sizes and (de)serialisation match the real call and
only the mirror's own work is missing: baseline (a2).

With ``--patch-kubeconfig FILE --patch-annotations FILE`` each call first makes the pod PATCH
for the request's pod before it answers, through the mirror's own store
(`KubePodStore(Kube(...)).patch_annotations`: the same aiohttp client, retries and error
mapping): baseline (d2), the floor of the mirror's design with none of its own work (contract,
cache, records, logging). With ``--bare`` as well, that PATCH is (b)'s, aiohttp used directly
with no code of this project in the call's path: baseline (d3), what the two libraries cost
composed in one process on one loop, the floor of any design a user could write with them.
Prints ``PORT <n>`` on stdout when it is listening.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc

from kai_fractions.api.v1 import allocation_pb2 as pb
from kai_fractions.mirror.grpc.servicer import SERVICE_NAME


def _handlers(behaviour: Callable) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(SERVICE_NAME, {
        "MirrorAllocation": grpc.unary_unary_rpc_method_handler(
            behaviour, request_deserializer=pb.MirrorAllocationRequest.FromString,
            response_serializer=pb.MirrorAllocationResponse.SerializeToString)})


async def serve_aio(response: pb.MirrorAllocationResponse,
                    patch: Callable[[str, str, str], Awaitable[object]] | None = None) -> None:
    """The grpc.aio server, until cancelled; `patch(namespace, name, uid)` is awaited on the
    loop before each answer."""
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


def mirror_store_patch(kubeconfig: Path, annotations: dict[str, str]
                       ) -> Callable[[str, str, str], Awaitable[object]]:
    """The uid-guarded merge patch of `annotations`, through the mirror's store."""
    from kai_fractions.kube.client import Kube
    from kai_fractions.kube.config import load_api_client
    from kai_fractions.mirror.kube_store import KubePodStore

    store = KubePodStore(Kube(load_api_client(str(kubeconfig))))

    def patch(namespace: str, name: str, uid: str) -> Awaitable[object]:
        return store.patch_annotations(namespace, name, annotations, uid=uid,
                                       resource_version="")

    return patch


def bare_patch(kubeconfig: Path, annotations: dict[str, str]
               ) -> Callable[[str, str, str], Awaitable[object]]:
    """The same PATCH as (b) makes it (`bench_mirror.BarePatch`), on the server's loop."""
    from .bench_mirror import BarePatch

    bare = BarePatch(kubeconfig, annotations, read_first=False)

    def patch(namespace: str, name: str, uid: str) -> Awaitable[object]:
        return bare.patch(namespace, name)  # (b)'s body carries the uid it knows the pod by

    return patch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.grpc_echo")
    parser.add_argument("--response", required=True, metavar="FILE",
                        help="a serialized MirrorAllocationResponse")
    parser.add_argument("--patch-kubeconfig", metavar="FILE",
                        help="make the pod PATCH of the request's pod in every call")
    parser.add_argument("--patch-annotations", metavar="FILE",
                        help="the annotations it writes (a JSON object)")
    parser.add_argument("--bare", action="store_true",
                        help="make that PATCH with aiohttp directly, as (b) does")
    args = parser.parse_args(argv)
    with open(args.response, "rb") as f:
        response = pb.MirrorAllocationResponse.FromString(f.read())
    patch = None
    if args.patch_kubeconfig:
        with open(args.patch_annotations) as f:
            make = bare_patch if args.bare else mirror_store_patch
            patch = make(Path(args.patch_kubeconfig), json.load(f))
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve_aio(response, patch))
    return 0


if __name__ == "__main__":
    sys.exit(main())
