"""P7 the BindRequest follower during a wave of binds: how soon every pod of a Job is checked
and signed.

With an unmodified KAI (`--follow-bindrequests`, the chart's default) every fractional pod waits
for the follower's check and signature before its node agent applies it, and a check waits on
the API server: a GET of the pod, a LIST of the GPU group's reservation pod, then the signing
PATCH. So what bounds a wave is the API server's latency times the requests in a row, divided by
the BindRequests checked at once (`--follow-concurrency`).

The real follow loop (`mirror.bindrequests.follow`) and `Follower` with an HMAC signing key are
fed a list of `PODS` Succeeded BindRequests as KAI's binder leaves them (two pods per GPU
group, each pod carrying what upstream KAI main's binder writes for gpu-fraction 0.5), over:
* the tests' in-memory store behind a fixed round trip per request (`LATENCIES_S`, as from an
  API server that far away; the store's own work is microseconds): the follower's concurrency
  alone;
* the mirror's own store (`KubePodStore`, aiohttp) against the stub API server answering each
  request `HTTP_LATENCY_MS` later (`--latency-ms`): the same through the real client, and the
  follower's CPU per BindRequest (this process's; the stub runs in its own).
Per latency and concurrency (1, then the default): seconds until the last pod is signed, and
BindRequests per second. Each run checks that every pod was signed once.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kai_fractions.kube.client import Kube
from kai_fractions.kube.config import load_api_client
from kai_fractions.kube.retry import NO_DEADLINE, Deadline
from kai_fractions.mirror.bindrequest_view import BindRequestView
from kai_fractions.mirror.bindrequests import CONCURRENCY, follow
from kai_fractions.mirror.follower import Follower
from kai_fractions.mirror.kube_store import KubePodStore
from kai_fractions.mirror.store import PodSnapshot
from kai_fractions.signing import Keyring, KeyringSource
from tests.support.fake_store import FakePodStore

from .harness import Result, print_table
from .stub_apiserver import kubeconfig, running, seed

PODS = 200
LATENCIES_S = (0.001, 0.005)
HTTP_LATENCY_MS = 5.0
WARM_UP = 16
NAMESPACE = "team-a"
NODE = "gpu-node-1"
GPU_MIB = 40960
RESERVATIONS = "kai-resource-reservation"
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
                        deadline: Deadline = NO_DEADLINE, *, cached: bool = False
                        ) -> list[PodSnapshot]:
        await self._away()
        return await self.store.list_pods(namespace, labels, deadline, cached=cached)

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


def bound(group: int) -> dict[str, str]:
    """What upstream KAI main's binder writes on a gpu-fraction 0.5 pod of GPU group `group`
    (40960 MiB GPUs), besides the user's own key."""
    return {"gpu-fraction": "0.5", f"{CONTAINER}.gpu-memory.request": "20Gi",
            f"{CONTAINER}.gpus.devices": gpu(group), "received-resource-type": "Fraction"}


def reservation(group: int) -> tuple[dict[str, str], dict[str, str]]:
    """The labels and annotations of GPU group `group`'s reservation pod."""
    return ({"runai-gpu-group": f"group-{group}"},
            {"run.ai/reserve_for_gpu_index": gpu(group)})


def bind_requests_of(pods: int, first: int = 0) -> list[dict[str, Any]]:
    """The BindRequests KAI leaves for pods train-`first` .. (`pods` of them) bound two per GPU
    group, Succeeded."""
    return [{
        "metadata": {"name": f"train-{i}", "namespace": NAMESPACE,
                     "uid": str(uuid.UUID(int=10**6 + i)), "resourceVersion": str(i + 1)},
        "spec": {"podName": f"train-{i}", "selectedNode": NODE,
                 "receivedResourceType": "Fraction", "receivedGPU": {"count": 1, "portion": "0.5"},
                 "selectedFractionalGpuGroups": [{"id": f"group-{i // 2}",
                                                  "computeSharingMode": ""}]},
        "status": {"phase": "Succeeded"}} for i in range(first, first + pods)]


def wave(pods: int) -> tuple[FakePodStore, list[dict[str, Any]]]:
    """The in-memory store after KAI bound `pods` fractional pods, and their BindRequests."""
    store = FakePodStore()
    store.nodes[NODE] = {"nvidia.com/gpu.memory": str(GPU_MIB)}
    for i in range(pods):
        if i % 2 == 0:
            labels, annotations = reservation(i // 2)
            store.add_pod({"metadata": {
                "name": f"gpu-reservation-group-{i // 2}", "namespace": RESERVATIONS,
                "labels": labels, "annotations": annotations},
                "spec": {"containers": [{"name": "reserve"}]}})
        store.add_pod({"metadata": {"name": f"train-{i}", "namespace": NAMESPACE,
                                    "annotations": bound(i // 2)},
                       "spec": {"containers": [{"name": "trainer"}], "nodeName": NODE}})
    return store, bind_requests_of(pods)


class Arriving:
    """The follow loop's source: an empty list, then the wave as the watch brings a real one,
    an ADDED event per BindRequest (a list is replayed behind the watch's events, with one
    place fewer: not a wave's path)."""

    what = "BindRequest(s)"

    def __init__(self, items: list[dict[str, Any]]) -> None:
        self.items = items

    async def list(self, resource_version: str = "") -> tuple[list[Any], str]:
        return [], "1"

    async def watch(self, resource_version: str):
        for item in self.items:
            yield "ADDED", item
        await asyncio.Event().wait()


async def _follow(store: Any, bind_requests: list[dict[str, Any]], concurrency: int) -> float:
    """Seconds until the follow loop over `store` has handled every BindRequest once."""
    follower = Follower(store, signer=KeyringSource.fixed(Keyring.of(b"p7" * 16)))
    handled = 0
    done = asyncio.Event()

    async def handle(br: BindRequestView) -> None:
        nonlocal handled
        await follower.follow_one(br)
        handled += 1
        if handled == len(bind_requests):
            done.set()

    began = time.perf_counter()
    task = asyncio.create_task(follow(Arriving(bind_requests), handle,  # type: ignore[arg-type]
                                      concurrency=concurrency))
    try:
        await asyncio.wait_for(done.wait(), timeout=600)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return time.perf_counter() - began


def _check_signed(annotations: list[Mapping[str, str]], patches: int | None = None) -> None:
    """Raises unless every pod carries its signature (and, where counted, was patched once)."""
    unsigned = sum(SIGNATURE not in a for a in annotations)
    if unsigned or (patches is not None and patches != len(annotations)):
        raise RuntimeError(f"P7: {unsigned} pod(s) unsigned, {patches} patch(es) for "
                           f"{len(annotations)} pods")


async def one_wave(pods: int, latency: float, concurrency: int) -> tuple[float, int]:
    """In memory: (seconds until the last pod is signed, API requests made)."""
    memory, bind_requests = wave(pods)
    store = DistantStore(memory, latency)
    took = await _follow(store, bind_requests, concurrency)
    _check_signed([memory.annotations(NAMESPACE, f"train-{i}") for i in range(pods)],
                  len(memory.patches))
    return took, store.requests


def http_wave(pods: int, latency_ms: float, concurrency: int) -> tuple[float, float]:
    """Through KubePodStore and the stub: (seconds until the last pod is signed, this
    process's CPU seconds per BindRequest). A wave of `WARM_UP` pods goes first (the first
    requests' one-time costs: the connections, what is imported on first use)."""
    template = {"apiVersion": "v1", "kind": "Pod", "metadata": {},
                "spec": {"containers": [{"name": "trainer"}], "nodeName": NODE}}
    with tempfile.TemporaryDirectory(prefix="kf-p7-") as tmp, \
            running(template, GPU_MIB, latency_ms=latency_ms) as url:
        total = pods + WARM_UP  # pods and WARM_UP are even: two per GPU group
        for group in range(total // 2):
            labels, annotations = reservation(group)
            seed(url, RESERVATIONS, [f"gpu-reservation-group-{group}"], labels=labels,
                 annotations=annotations)
            seed(url, NAMESPACE, [f"train-{2 * group}", f"train-{2 * group + 1}"],
                 annotations=bound(group))
        api_client = load_api_client(str(kubeconfig(url, Path(tmp) / "kubeconfig")))

        async def main() -> tuple[float, float, list[Mapping[str, str]]]:
            store = KubePodStore(Kube(api_client))
            try:
                await _follow(store, bind_requests_of(WARM_UP, first=pods), concurrency)
                cpu = time.process_time()
                took = await _follow(store, bind_requests_of(pods), concurrency)
                cpu = time.process_time() - cpu
                listed = await store.list_pods(NAMESPACE, {})
                return took, cpu, [pod.annotations for pod in listed]
            finally:
                await store.close()

        try:
            took, cpu, annotations = asyncio.run(main())
        finally:
            api_client.close()
    _check_signed(annotations)
    return took, cpu / pods


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
            _add_wave(result, f"API {ms} away", concurrency, pods, took[concurrency])
        result.add(f"API {ms} away: concurrency {CONCURRENCY} / 1, time to sign the wave",
                   round(took[CONCURRENCY] / took[1], 2), "x")
        result.notes.append(f"API {ms} away: {requests / pods:.1f} requests per BindRequest")
    label = f"HTTP, the stub {HTTP_LATENCY_MS:g} ms away"
    for concurrency in sorted({1, CONCURRENCY}):
        took_http, cpu = http_wave(pods, HTTP_LATENCY_MS, concurrency)
        _add_wave(result, label, concurrency, pods, took_http)
        result.add(f"{label}, concurrency {concurrency}: follower CPU per BindRequest",
                   round(cpu * 1e3, 3), "ms")
    result.notes.append(f"{pods} fractional pods bound at once, two per GPU group; in memory: "
                        "the follower and the tests' store in one process, each request "
                        "delayed by the latency given; HTTP: KubePodStore (aiohttp) against "
                        "the stub API server in its own process")
    return result


def _add_wave(result: Result, label: str, concurrency: int, pods: int, took: float) -> None:
    result.add(f"{label}, concurrency {concurrency}: all {pods} signed in", round(took, 3), "s")
    result.add(f"{label}, concurrency {concurrency}: BindRequests per second",
               round(pods / took), "/s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_follower",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    print_table([run(quick=args.quick)])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
