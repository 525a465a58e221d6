"""The real AllocationMirror gRPC server and its KubePodStore over the FaultyApi, fast
retries."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import grpc

from kai_fractions.api.v1 import allocation_pb2_grpc as pb_grpc
from kai_fractions.kube.client import Kube
from kai_fractions.kube.retry import Backoff
from kai_fractions.mirror.grpc.server import MirrorServer, ServerOptions
from kai_fractions.mirror.kube_store import KubePodStore
from kai_fractions.mirror.pod_cache import PodCache
from kai_fractions.mirror.service import MirrorService
from kai_fractions.signing import Keyring, KeyringSource
from tests.support.faults_api import FaultyApi

STORE_BACKOFF = Backoff(attempts=3, base=0.01, cap=0.05)
CONFLICT_BACKOFF = Backoff(attempts=4, base=0.01, cap=0.05)
REQUEST_TIMEOUT = 0.3
"""Seconds the store waits for one API answer (FaultyApi holds a timed-out one longer)."""
SIGNING_KEY = bytes(range(32))


@dataclass
class Rig:
    api: FaultyApi
    service: MirrorService
    server: MirrorServer
    channel: grpc.Channel
    stub: pb_grpc.AllocationMirrorStub


@contextmanager
def mirror_over(api: FaultyApi, *, signed: bool = True,
                store_backoff: Backoff = STORE_BACKOFF, pod_cache: bool = True
                ) -> Iterator[Rig]:
    """The mirror over `api`, with its pod cache as deployed (fed here by reads and by what
    writes return: FaultyApi serves no watch), so faults also hit the cached path."""
    client = api.api_client()
    store = KubePodStore(Kube(client), backoff=store_backoff, request_timeout=REQUEST_TIMEOUT)
    extra = None
    if signed:
        from kai_fractions.mirror.signing import signing_annotations
        extra = signing_annotations(KeyringSource.fixed(Keyring.of(SIGNING_KEY)))
    service = MirrorService(store, conflict_backoff=CONFLICT_BACKOFF, extra_annotations=extra,
                            cache=PodCache() if pod_cache else None)
    server = MirrorServer(service, ServerOptions(listen="127.0.0.1:0"))
    server.start()
    channel = grpc.insecure_channel(server.address)
    try:
        yield Rig(api, service, server, channel, pb_grpc.AllocationMirrorStub(channel))
    finally:
        channel.close()
        server.stop(grace=0)
        client.close()
