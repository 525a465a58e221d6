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

A list is replayed in the background, newest BindRequest first, while the watch is already
open, and the watch's events go first: a follower that takes over at 5,000 nodes (a rollout, a
lost Lease) checks 160,000 listed BindRequests for minutes, and a pod bound meanwhile must not
wait for its signature until they are done.
"""

from __future__ import annotations

import asyncio
import collections
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
    `handle`, up to `concurrency` at once, each BindRequest's in the order seen (a list's in the
    background, newest first, behind the watch's events: `_Replay`); `handle` must be
    idempotent. A watch only replays changes, so a handling that failed for a reason of its
    own (a conflict while signing, the API briefly away) is retried by listing everything again
    once `resync_seconds` have passed, when the current watch stream ends. An error of one
    BindRequest is logged and the loop goes on. A deleted BindRequest goes to `forget`. Runs
    until cancelled (cancelling it cancels the handling in progress)."""
    handling = _InFlight(handle, concurrency)
    replay = _Replay(handling)

    async def on_list(items: list[Mapping[str, Any] | BindRequestView]) -> None:
        replay.restart(items)  # and the watch opens at once

    async def on_event(kind: str, obj: Mapping[str, Any]) -> None:
        view = _view(obj)
        replay.supersede(view)
        if kind in ("ADDED", "MODIFIED"):
            await handling.start(view)
        elif kind == "DELETED" and forget is not None:
            forget(view)

    try:
        await list_watch(source, on_list, on_event, backoff=backoff, rng=rng,
                         resync_seconds=resync_seconds, monotonic=monotonic, clock=clock)
    finally:
        await replay.stop()
        await handling.stop()


class _Replay:
    """The last list's BindRequests, newest first, handed to `handling` in a task of their own
    as places free, one place kept for the watch's events; a BindRequest the watch has shown
    since the list is skipped (its event carried a newer version, or its deletion)."""

    def __init__(self, handling: _InFlight) -> None:
        self.handling = handling
        self.pending: collections.deque[BindRequestView] = collections.deque()
        self.superseded: set[tuple[str, str]] = set()
        self.listed = asyncio.Event()
        self.task: asyncio.Task | None = None

    def restart(self, items: list[Mapping[str, Any] | BindRequestView]) -> None:
        views = sorted(map(_view, items), key=lambda br: br.created, reverse=True)
        self.pending = collections.deque(views)
        self.superseded.clear()
        self.listed.set()
        if self.task is None:
            self.task = asyncio.create_task(self._run(), name="bindrequest-replay")

    def supersede(self, br: BindRequestView) -> None:
        if self.pending:  # none is kept once the replay is done
            self.superseded.add((br.namespace, br.name))

    async def _run(self) -> None:
        while True:
            await self.listed.wait()
            self.listed.clear()
            began, started = time.monotonic(), 0
            while self.pending:
                br = self.pending.popleft()
                key = (br.namespace, br.name)
                if key not in self.superseded:
                    # Wanted still once a place is free: the watch may show it meanwhile.
                    await self.handling.start(br, replayed=functools.partial(self._wanted, key))
                    started += 1
            self.superseded.clear()
            if started:
                log.info("the listed BindRequests are all under way: %d in %.1f s (those the "
                         "watch showed since, as it did)", started, time.monotonic() - began)

    def _wanted(self, key: tuple[str, str]) -> bool:
        return key not in self.superseded

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)


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
        self.waiting = 0
        """Watch events waiting for a place: the replay lets them go first."""
        self._freed = asyncio.Event()

    async def start(self, br: BindRequestView, *,
                    replayed: Callable[[], bool] | None = None) -> None:
        """Starts handling `br` once a place is free, and returns once one is free again (the
        loop reads on). `replayed` (a listed BindRequest, still wanted while it says True)
        leaves one place to the watch's events, unless there is only one, and lets any event
        waiting for a place go first."""
        if replayed is not None:
            spare = 1 if self.limit > 1 else 0
            while len(self.tasks) >= self.limit - spare or self.waiting:
                await self._place()
            if not replayed():
                return
        else:
            self.waiting += 1
            try:
                while len(self.tasks) >= self.limit:
                    await self._place()
            finally:
                self.waiting -= 1
        key = (br.namespace, br.name)
        task = asyncio.create_task(self._run(self.latest.get(key), br))
        self.tasks.add(task)
        self.latest[key] = task
        task.add_done_callback(functools.partial(self._done, key))
        while replayed is None and len(self.tasks) >= self.limit:
            await self._place()

    async def _place(self) -> None:
        self._freed.clear()
        await self._freed.wait()

    async def _run(self, before: asyncio.Task | None, br: BindRequestView) -> None:
        if before is not None:
            await asyncio.wait([before])
        await _handle(self.handle, br)

    def _done(self, key: tuple[str, str], task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if self.latest.get(key) is task:
            del self.latest[key]
        self._freed.set()

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
