"""Mirror replicas' /metrics for the `inspect mirror` tests, made by the mirror's own
`MirrorMetrics` (so the parser reads what a replica really serves): calls, API requests, a pod
cache, the Lease's word, and checks whose signatures waited a given time."""

from __future__ import annotations

import asyncio
import datetime

from prometheus_client import generate_latest

from kai_fractions.mirror.bindrequest_view import BindRequestView
from kai_fractions.mirror.metrics import MirrorMetrics
from kai_fractions.mirror.pod_cache import PodCache
from kai_fractions.mirror.verification import Verification
from tests.mirror.test_follower import bind_request


def created_ago(seconds: float) -> BindRequestView:
    then = datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=seconds)
    br = bind_request(f"br-{seconds}", "p")
    br["metadata"]["creationTimestamp"] = then.strftime("%Y-%m-%dT%H:%M:%SZ")
    return BindRequestView.from_object(br)


def mirror_metrics(*, leading: bool | None = True, cached: int | None = 3, synced: bool = True,
                   ok: int = 4, invalid: int = 1, signed_after: tuple[float, ...] = (3, 100),
                   skipped: int = 1) -> MirrorMetrics:
    """A replica that answered `ok` + `invalid` calls (10 ms each), wrote a pod per OK call,
    holds `cached` pods (None: no cache), and checked BindRequests: one per `signed_after`
    (signed that many seconds after its creation) and `skipped` with nothing to check."""
    metrics = MirrorMetrics()
    for code, n in (("OK", ok), ("INVALID_ARGUMENT", invalid)):
        for _ in range(n):
            metrics.call("MirrorAllocation", code, 0.01)
    for _ in range(ok):
        metrics.api_request("PATCH", "200")
    metrics.api_request("WATCH", "200")
    if cached is not None:
        cache = PodCache()
        pods = [{"metadata": {"name": f"p{i}", "namespace": "ns", "uid": f"u{i}",
                              "resourceVersion": "1"}} for i in range(cached)]
        if synced:
            cache.replace(pods)
        else:
            for pod in pods:
                cache.event("ADDED", pod)
        cache.lookup("ns", "p0")
        metrics.watch_pod_cache(cache)
    if leading is not None:
        metrics.watch_leading(lambda: leading)

    async def signed(_view: BindRequestView) -> Verification:
        return Verification("ns/br", "ns/p", signed=("sig",))

    async def nothing(_view: BindRequestView) -> Verification:
        return Verification("ns/br", "ns/p", skipped="phase Pending")

    async def checks() -> None:
        for seconds in signed_after:
            await metrics.check(signed, created_ago(seconds))
        for _ in range(skipped):
            await metrics.check(nothing, created_ago(0))

    asyncio.run(checks())
    return metrics


def scrape(metrics: MirrorMetrics) -> str:
    return generate_latest(metrics.registry).decode()
