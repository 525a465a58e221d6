"""P7 the BindRequest follower during a wave of binds: how soon every pod of a Job is checked
and signed.

With an unmodified KAI (`--follow-bindrequests`, the chart's default) every fractional pod waits
for the follower's check and signature before its node agent applies it, and a check waits on
the API server: a GET of the pod, a LIST of the GPU group's reservation pod, then the signing
PATCH. So what bounds a wave is the API server's latency times the requests in a row, divided by
the BindRequests checked at once (`--follow-concurrency`).

In one process: the real follow loop (`mirror.bindrequests.follow`) and `Follower` with an
HMAC signing key, fed a list of `PODS` Succeeded BindRequests as KAI's binder leaves them (two
pods per GPU group, each pod carrying what upstream KAI main's binder writes for
gpu-fraction 0.5), over the tests' in-memory store behind a fixed round trip per request
(`LATENCIES_S`, as from an API server that far away; the store's own work is microseconds).
Per latency and concurrency (1, then the default): seconds until the last pod is signed, and
BindRequests per second. Each run checks that every pod was signed once.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from collections.abc import Mapping
from typing import Any

from kai_fractions.kube.retry import NO_DEADLINE, Deadline
from kai_fractions.mirror.bindrequests import CONCURRENCY, follow
from kai_fractions.mirror.follower import BindRequestView, Follower
from kai_fractions.mirror.store import PodSnapshot
from kai_fractions.signing import Keyring, KeyringSource
from tests.support.fake_store import FakePodStore

from .harness import Result, print_table

PODS = 200
LATENCIES_S = (0.001, 0.005)
NAMESPACE = "team-a"
NODE = "gpu-node-1"
CONTAINER = "nvidia.com/container.trainer"
SIGNATURE = "kai-fractions.io/container.trainer.signature"


class DistantStore:
    """A PodStore `latency` seconds away: each request waits that long (without holding the
    loop), then the in-memory store answers."""

    def __init__(self, store: FakePodStore, latency: float) -> None:
        self.store, self.latency = store, latency
        self.requests = 0

    async def _away(self) -> None:
        self.requests += 1
        await asyncio.sleep(self.latency)

    async def get_pod(self, namespace: str, name: str, deadline: Deadline = NO_DEADLINE
                      ) -> PodSnapshot:
        await self._away()
        return await self.store.get_pod(namespace, name, deadline)

    async def list_pods(self, namespace: str, labels: Mapping[str, str],
                        deadline: Deadline = NO_DEADLINE) -> list[PodSnapshot]:
        await self._away()
        return await self.store.list_pods(namespace, labels, deadline)

    async def node_labels(self, node: str, deadline: Deadline = NO_DEADLINE
                          ) -> Mapping[str, str]:
        await self._away()
        return await self.store.node_labels(node, deadline)

    async def patch_annotations(self, namespace: str, name: str,
                                changes: Mapping[str, str | None], *, uid: str,
                                resource_version: str, deadline: Deadline = NO_DEADLINE
                                ) -> PodSnapshot:
        await self._away()
        return await self.store.patch_annotations(namespace, name, changes, uid=uid,
                                                  resource_version=resource_version,
                                                  deadline=deadline)

    async def emit_event(self, pod: PodSnapshot, event_type: str, reason: str, message: str,
                         deadline: Deadline = NO_DEADLINE) -> None:
        await self._away()
        await self.store.emit_event(pod, event_type, reason, message, deadline)


def gpu(group: int) -> str:
    return f"GPU-{uuid.UUID(int=group + 1)}"


def wave(pods: int) -> tuple[FakePodStore, list[dict[str, Any]]]:
    """The store after KAI bound `pods` fractional pods (two per GPU group), and their
    BindRequests."""
    store = FakePodStore()
    store.nodes[NODE] = {"nvidia.com/gpu.memory": "40960"}
    bind_requests = []
    for i in range(pods):
        group = f"group-{i // 2}"
        if i % 2 == 0:
            store.add_pod({"metadata": {
                "name": f"gpu-reservation-{group}", "namespace": "kai-resource-reservation",
                "labels": {"runai-gpu-group": group},
                "annotations": {"run.ai/reserve_for_gpu_index": gpu(i // 2)}},
                "spec": {"containers": [{"name": "reserve"}]}})
        store.add_pod({"metadata": {"name": f"train-{i}", "namespace": NAMESPACE, "annotations": {
            "gpu-fraction": "0.5", f"{CONTAINER}.gpu-memory.request": "20Gi",
            f"{CONTAINER}.gpus.devices": gpu(i // 2), "received-resource-type": "Fraction"}},
            "spec": {"containers": [{"name": "trainer"}], "nodeName": NODE}})
        bind_requests.append({
            "metadata": {"name": f"train-{i}", "namespace": NAMESPACE,
                         "uid": str(uuid.UUID(int=10**6 + i)), "resourceVersion": str(i + 1)},
            "spec": {"podName": f"train-{i}", "selectedNode": NODE,
                     "receivedResourceType": "Fraction",
                     "receivedGPU": {"count": 1, "portion": "0.5"},
                     "selectedFractionalGpuGroups": [{"id": group, "computeSharingMode": ""}]},
            "status": {"phase": "Succeeded"}})
    return store, bind_requests


class Listed:
    """The follow loop's source: one list of the wave, then a watch with nothing more."""

    what = "BindRequest(s)"

    def __init__(self, items: list[dict[str, Any]]) -> None:
        self.items = items

    async def list(self, resource_version: str = "") -> tuple[list[Any], str]:
        return self.items, str(len(self.items))

    async def watch(self, resource_version: str):
        await asyncio.Event().wait()
        yield  # pragma: no cover - an async generator that never yields


async def one_wave(pods: int, latency: float, concurrency: int) -> tuple[float, int]:
    """(seconds until the last pod is signed, API requests made)."""
    memory, bind_requests = wave(pods)
    store = DistantStore(memory, latency)
    keys = KeyringSource.fixed(Keyring.of(b"p7" * 16))
    follower = Follower(store, signer=keys)  # type: ignore[arg-type]
    handled = 0
    done = asyncio.Event()

    async def handle(obj: Mapping[str, Any]) -> None:
        nonlocal handled
        await follower.follow_one(BindRequestView.from_object(obj))
        handled += 1
        if handled == pods:
            done.set()

    began = time.perf_counter()
    task = asyncio.create_task(follow(Listed(bind_requests), handle,  # type: ignore[arg-type]
                                      concurrency=concurrency))
    try:
        await asyncio.wait_for(done.wait(), timeout=600)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    took = time.perf_counter() - began
    unsigned = [key for key, obj in memory.pods.items() if key[0] == NAMESPACE
                and SIGNATURE not in (obj["metadata"].get("annotations") or {})]
    if unsigned or len(memory.patches) != pods:
        raise RuntimeError(f"P7: {len(unsigned)} pod(s) unsigned, {len(memory.patches)} "
                           f"patch(es) for {pods} pods")
    return took, store.requests


def run(quick: bool = False, smoke: bool = False) -> Result:
    """`quick`/`smoke`: a smaller wave (the harness's own test)."""
    result = Result("P7", "the BindRequest follower during a wave of binds: every pod checked "
                    "and signed")
    pods = 20 if smoke else 100 if quick else PODS
    for latency in LATENCIES_S:
        ms = f"{latency * 1000:g} ms"
        took: dict[int, float] = {}
        for concurrency in sorted({1, CONCURRENCY}):
            took[concurrency], requests = asyncio.run(one_wave(pods, latency, concurrency))
            result.add(f"API {ms} away, concurrency {concurrency}: all {pods} signed in",
                       round(took[concurrency], 3), "s")
            result.add(f"API {ms} away, concurrency {concurrency}: BindRequests per second",
                       round(pods / took[concurrency]), "/s")
        result.add(f"API {ms} away: concurrency {CONCURRENCY} / 1, time to sign the wave",
                   round(took[CONCURRENCY] / took[1], 2), "x")
        result.notes.append(f"API {ms} away: {requests / pods:.1f} requests per BindRequest")
    result.notes.append(f"{pods} fractional pods bound at once, two per GPU group; the follower "
                        "and the in-memory store in one process, each request delayed by the "
                        "latency given")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_follower",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    print_table([run(quick=args.quick)])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
