"""List and watch KAI's BindRequests (scheduling.run.ai/v1alpha2) and hand each one to the
follower: the one list + watch loop of `kube.listwatch`, with BindRequest-specific handling.

Each BindRequest is held as the follower's view of it (`BindRequestView`) from the moment its
list page or event is decoded: a list holds every BindRequest of the cluster until the last is
handled (one per bound fractional pod, 160,000 at 5,000 nodes; docs/scale.md), and the decoded
object, managed fields and all, is about nine times the view.

Up to `concurrency` BindRequests are handled at once, those of one BindRequest one after the
other in the order seen; the loop reads on only when a place is free, so nothing piles up. With
an unmodified KAI every fractional pod waits for its check and signature, and a check waits on
the API server (about 4 requests): one at a time, a Job of thousands of pods bound at once
would be signed at the API server's latency, one request after another.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, NoReturn

from ..clock import AsyncClock
from ..kube.client import Kube
from ..kube.listwatch import RESYNC_SECONDS, WATCH_BACKOFF, Collection, list_watch
from ..kube.objects import namespaced_path
from ..kube.retry import Backoff
from .follower import GROUP, PLURAL, VERSION, BindRequestView

log = logging.getLogger(__name__)

__all__ = ["bindrequest_source", "follow"]

WHAT = "BindRequest(s)"
CONCURRENCY = 8
"""BindRequests handled at once by default (`--follow-concurrency`)."""
Handler = Callable[[BindRequestView], Awaitable[object]]


def bindrequest_source(kube: Kube, *, watch_seconds: int = 300, request_timeout: float = 30.0,
                       read_timeout: float | None = None) -> Collection:
    """Every namespace's BindRequests, listed as views (each object dropped with its page)."""
    return Collection(kube, namespaced_path(GROUP, VERSION, PLURAL, None), what=WHAT,
                      watch_seconds=watch_seconds, request_timeout=request_timeout,
                      read_timeout=read_timeout, keep=BindRequestView.from_object)


def _view(obj: Mapping[str, Any] | BindRequestView) -> BindRequestView:
    return obj if isinstance(obj, BindRequestView) else BindRequestView.from_object(obj)


async def follow(
    source: Collection,
    handle: Handler,
    *,
    forget: Callable[[BindRequestView], object] | None = None,
    concurrency: int = CONCURRENCY,
    backoff: Backoff = WATCH_BACKOFF,
    rng: random.Random | None = None,
    resync_seconds: float = RESYNC_SECONDS,
    monotonic: Callable[[], float] = time.monotonic,
    clock: AsyncClock | None = None,
) -> NoReturn:
    """Level-triggered: every BindRequest seen (listed, or ADDED or MODIFIED in the watch) goes to
    `handle`, up to `concurrency` at once, each BindRequest's in the order seen; `handle` must
    be idempotent. A watch only replays changes, so a handling that failed for a reason of its
    own (a conflict while signing, the API briefly away) is retried by listing everything again
    once `resync_seconds` have passed, when the current watch stream ends. An error of one
    BindRequest is logged and the loop goes on. A deleted BindRequest goes to `forget`. Runs
    until cancelled (cancelling it cancels the handling in progress)."""
    handling = _InFlight(handle, concurrency)

    async def on_list(items: list[Mapping[str, Any] | BindRequestView]) -> None:
        for obj in items:
            await handling.start(_view(obj))

    async def on_event(kind: str, obj: Mapping[str, Any]) -> None:
        if kind in ("ADDED", "MODIFIED"):
            await handling.start(_view(obj))
        elif kind == "DELETED" and forget is not None:
            forget(_view(obj))

    try:
        await list_watch(source, on_list, on_event, backoff=backoff, rng=rng,
                         resync_seconds=resync_seconds, monotonic=monotonic, clock=clock)
    finally:
        await handling.stop()


class _InFlight:
    """The handlings in progress: the loop reads on once fewer than `limit` are (with a limit of
    1, once the last one is done), and one BindRequest's run one after the other."""

    def __init__(self, handle: Handler, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"concurrency {limit}: at least 1")
        self.handle = handle
        self.limit = limit
        self.tasks: set[asyncio.Task] = set()
        self.latest: dict[tuple[str, str], asyncio.Task] = {}  # BindRequest -> its last

    async def start(self, br: BindRequestView) -> None:
        key = (br.namespace, br.name)
        task = asyncio.create_task(self._run(self.latest.get(key), br))
        self.tasks.add(task)
        self.latest[key] = task
        task.add_done_callback(functools.partial(self._done, key))
        while len(self.tasks) >= self.limit:
            await asyncio.wait(self.tasks, return_when=asyncio.FIRST_COMPLETED)

    async def _run(self, before: asyncio.Task | None, br: BindRequestView) -> None:
        if before is not None:
            await asyncio.wait([before])
        await _handle(self.handle, br)

    def _done(self, key: tuple[str, str], task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if self.latest.get(key) is task:
            del self.latest[key]

    async def stop(self) -> None:
        """Cancels what is in progress (the follower stops: shutdown, or the Lease lost)."""
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def _handle(handle: Handler, br: BindRequestView) -> None:
    try:
        await handle(br)
    except Exception:
        # One bad object or a failed event must not stop the follower.
        log.exception("BindRequest %s: check failed", br.ref)
