"""What keeps the mirror's PodCache fed: a list + watch of the scheduler's Pending pods
(`kube.listwatch`), on the event loop that serves MirrorAllocation, for as long as it serves.

The list comes in small pages, each decoded in a gap between the calls the loop serves
(`foreground`), trimmed as it arrives (`PodCache.keep`) and merged in slices
(`PodCache.merge_soon`); the mirror's own writes coming back on the watch are skipped unparsed
(`PodCache.is_echo`).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from ..kube.client import Kube
from ..kube.listwatch import Collection, list_watch
from ..kube.objects import pods_path
from .pod_cache import PodCache

LIST_PAGE_SIZE = 25
"""Pods per page of the list on the serving loop. Small, because a page is decoded and trimmed
in one go and the calls waiting on the loop wait for it; the price is more list requests
(benchmarks/README.md, round five, has the side-by-side runs of 100, 50 and 25)."""

Feed = Callable[[], Coroutine[Any, Any, None]]
"""Work for the mirror server's event loop for as long as it serves (MirrorServer's `tasks`)."""


def pod_selector(scheduler_name: str = "") -> str:
    """The pods worth caching: Pending ones (a scheduler binds a pod before it runs; a pod that
    starts leaves the watch as a DELETED event), of `scheduler_name` when given. A field
    selector, so the API server filters and the mirror never holds the others: the cache stays
    as large as the queue of pods waiting to start, not as the cluster."""
    terms = [f"spec.schedulerName={scheduler_name}"] if scheduler_name else []
    return ",".join([*terms, "status.phase=Pending"])


def pod_collection(kube: Kube, cache: PodCache, scheduler_name: str = "") -> Collection:
    what = f"pod(s) of {scheduler_name}" if scheduler_name else "pod(s)"
    return Collection(kube, pods_path(), {"fieldSelector": pod_selector(scheduler_name)},
                      what=what, skip=cache.is_echo, keep=cache.keep,
                      page_size=LIST_PAGE_SIZE, pace=cache.foreground.gap)


def pod_feed(kube: Kube, cache: PodCache, scheduler_name: str = "", **options: Any) -> Feed:
    """`options` go to the list + watch loop (backoff, resync_seconds)."""

    async def feed() -> None:
        try:
            await list_watch(pod_collection(kube, cache, scheduler_name), cache.merge_soon,
                             cache.event_soon, **options)
        finally:
            cache.cancel_merge()

    return feed
