"""List and watch KAI's BindRequests (scheduling.run.ai/v1alpha2) and hand each one to the
follower: the one list + watch loop of `kube.listwatch`, with BindRequest-specific handling.

`list_watch` hands what it reads to plain callbacks; the follower's handler is a coroutine (it
reads and writes pods). The callbacks only queue each BindRequest, and the loop's next step
(its next list, the opening of a watch, the next event of a watch) first awaits the handling of
everything queued, in order, one at a time. So the loop never runs ahead of the follower, as
when the handler was called in the loop itself: nothing piles up, a watch resumes after what
was handled, and the resync period is measured in the same steps.
"""

from __future__ import annotations

import collections
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, NoReturn

from ..clock import AsyncClock
from ..kube.client import Kube
from ..kube.listwatch import RESYNC_SECONDS, WATCH_BACKOFF, Collection, list_watch
from ..kube.objects import namespaced_path
from ..kube.retry import Backoff
from .follower import GROUP, PLURAL, VERSION

log = logging.getLogger(__name__)

__all__ = ["bindrequest_source", "follow"]

WHAT = "BindRequest(s)"
Handler = Callable[[Mapping[str, Any]], Awaitable[object]]


def bindrequest_source(kube: Kube, *, watch_seconds: int = 300, request_timeout: float = 30.0,
                       read_timeout: float | None = None) -> Collection:
    """Every namespace's BindRequests."""
    return Collection(kube, namespaced_path(GROUP, VERSION, PLURAL, None), what=WHAT,
                      watch_seconds=watch_seconds, request_timeout=request_timeout,
                      read_timeout=read_timeout)


async def follow(
    source: Collection,
    handle: Handler,
    *,
    backoff: Backoff = WATCH_BACKOFF,
    rng: random.Random | None = None,
    resync_seconds: float = RESYNC_SECONDS,
    monotonic: Callable[[], float] = time.monotonic,
    clock: AsyncClock | None = None,
) -> NoReturn:
    """Level-triggered: every BindRequest seen (listed, or ADDED or MODIFIED in the watch) is
    awaited in `handle`, in the order seen, one at a time; `handle` must be idempotent. A
    watch only replays changes, so a handling that failed for a reason of its own (a conflict
    while signing, the API briefly away) is retried by listing everything again once
    `resync_seconds` have passed, when the current watch stream ends. An error of one
    BindRequest is logged and the loop goes on. Runs until cancelled (cancelling it cancels
    the handling in progress)."""
    queued: collections.deque[Mapping[str, Any]] = collections.deque()

    async def drain() -> None:
        while queued:
            await _handle(handle, queued.popleft())

    def on_event(kind: str, obj: Mapping[str, Any]) -> None:
        if kind in ("ADDED", "MODIFIED"):
            queued.append(obj)

    await list_watch(_Handled(source, drain), queued.extend, on_event, backoff=backoff,
                     rng=rng, resync_seconds=resync_seconds, monotonic=monotonic, clock=clock)


class _Handled:
    """`source`, each of whose steps first awaits `drain` (the handling of what the loop's
    callbacks queued)."""

    def __init__(self, source: Collection, drain: Callable[[], Awaitable[None]]) -> None:
        self.source, self.drain, self.what = source, drain, source.what

    async def list(self, resource_version: str = "") -> tuple[list[Any], str]:
        await self.drain()
        return await self.source.list(resource_version)

    async def watch(self, resource_version: str
                    ) -> AsyncIterator[tuple[str, Mapping[str, Any]]]:
        await self.drain()  # the list before this watch
        async for event in self.source.watch(resource_version):
            yield event
            await self.drain()  # the event just yielded, before the next is read


async def _handle(handle: Handler, obj: Mapping[str, Any]) -> None:
    try:
        await handle(obj)
    except Exception:
        # One bad object or a failed event must not stop the follower.
        meta = obj.get("metadata") or {}
        log.exception("BindRequest %s/%s: check failed", meta.get("namespace"),
                      meta.get("name"))
