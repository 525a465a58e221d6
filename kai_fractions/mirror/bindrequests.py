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
        if kind not in ("ADDED", "MODIFIED", "DELETED"):
            return  # a BOOKMARK carries a version, no BindRequest
        view = _view(obj)
        replay.supersede(view)
        if kind != "DELETED":
            await handling.start(view)
        elif forget is not None:
            running = handling.latest.get((view.namespace, view.name))
            if running is None:
                forget(view)
            else:  # after it: what it remembers of the BindRequest is forgotten too
                running.add_done_callback(lambda _task: forget(view))

    try:
        await list_watch(source, on_list, on_event, backoff=backoff, rng=rng,
                         resync_seconds=resync_seconds, monotonic=monotonic, clock=clock)
    finally:
        # Everything cancelled before the first wait: a second cancel cannot leave any
        # handling running after the follower has stopped (the Lease lost).
        tasks = [*handling.tasks, *([replay.task] if replay.task is not None else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _key(br: BindRequestView) -> object:
    """One BindRequest across its list entry and its events: its uid (a recreated one of the
    same name is another), else its name."""
    return br.uid or (br.namespace, br.name)


class _Replay:
    """The last list's BindRequests, handed to `handling` by a task of their own: first those a
    previous list left unstarted (a relist must not start over from the newest and never reach
    the oldest), then newest first. One the watch shows meanwhile leaves the replay (its event
    carried a newer version, or its deletion), also while it waits for its place."""

    def __init__(self, handling: _InFlight) -> None:
        self.handling = handling
        self.pending: dict[object, BindRequestView] = {}
        self.holding: object = None
        """The key of the BindRequest waiting for a place; None once it is dropped."""
        self.listed = asyncio.Event()
        self.task: asyncio.Task | None = None

    def restart(self, items: list[Mapping[str, Any] | BindRequestView]) -> None:
        views = {_key(br): br for br in sorted(map(_view, items), key=lambda br: br.created,
                                                 reverse=True)}
        left = [key for key in self.pending if key in views]
        if self.holding is not None and self.holding in views:
            left.insert(0, self.holding)
        self.holding = None  # the new list has it, at its place
        self.pending = {key: views.pop(key) for key in left}
        self.pending.update(views)
        self.listed.set()
        if self.task is None or self.task.done():
            self.task = asyncio.create_task(self._run(), name="bindrequest-replay")

    def supersede(self, br: BindRequestView) -> None:
        key = _key(br)
        self.pending.pop(key, None)
        if self.holding == key:
            self.holding = None

    async def _run(self) -> None:
        while True:
            await self.listed.wait()
            self.listed.clear()
            began, started = time.monotonic(), 0
            while self.pending:
                key = next(iter(self.pending))
                br = self.pending.pop(key)
                self.holding = key
                try:
                    if await self.handling.start(br, replayed=self._still_holding):
                        started += 1
                except Exception:  # never seen; a dead replay would leave the rest unchecked
                    log.exception("BindRequest %s: the replay failed to start it", br.ref)
                finally:
                    self.holding = None
            if started:
                log.info("the listed BindRequests are all under way: %d in %.1f s", started,
                         time.monotonic() - began)

    def _still_holding(self) -> bool:
        return self.holding is not None


class _InFlight:
    """The handlings in progress, at most `limit`, one BindRequest's one after the other. The
    watch loop reads on once a place is free (with a limit of 1, once the last one is done). A
    list's replay always gets one place, and more only while one stays free for the watch's
    events, which go first when both wait: a wave of binds does not stop the replay, and the
    replay does not hold up the wave. With a limit of 1 the two take turns."""

    def __init__(self, handle: Handler, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"concurrency {limit}: at least 1")
        self.handle = handle
        self.limit = limit
        self.tasks: set[asyncio.Task] = set()
        self.latest: dict[tuple[str, str], asyncio.Task] = {}  # BindRequest -> its last
        self.replaying = 0
        """Handlings the replay started, still running."""
        self.waiting = 0
        """Watch events waiting for a place."""
        self.replay_waiting = False
        self.replay_owed = False
        """With one place: an event went while the replay waited; the replay goes next."""
        self._freed = asyncio.Event()

    async def start(self, br: BindRequestView, *,
                    replayed: Callable[[], bool] | None = None) -> bool:
        """Starts handling `br` once a place is free (a listed one: once the replay may take
        one, and only if `replayed()` still says it is wanted); True when it did. An event's
        returns once a place is free again."""
        if replayed is not None:
            self.replay_waiting = True
            try:
                while not self._replay_may_start():
                    await self._place()
            finally:
                self.replay_waiting = False
                self._freed.set()  # an event held back for the replay's place goes on
            if not replayed():
                return False
            self.replaying += 1
            self.replay_owed = False
        else:
            self.waiting += 1
            try:
                while not self._event_may_start():
                    await self._place()
            finally:
                self.waiting -= 1
                self._freed.set()  # a replay held back for this event may go on
            if self.replay_waiting and not self.replaying:
                self.replay_owed = True
        key = (br.namespace, br.name)
        task = asyncio.create_task(self._run(self.latest.get(key), br))
        self.tasks.add(task)
        self.latest[key] = task
        task.add_done_callback(functools.partial(self._done, key, replayed is not None))
        while replayed is None and len(self.tasks) >= self.limit:
            await self._place()
        return True

    def _event_may_start(self) -> bool:
        if self.limit == 1:  # turns with a waiting replay
            return not self.tasks and not (self.replay_waiting and self.replay_owed)
        if self.replay_waiting and not self.replaying:  # the replay's one place
            return len(self.tasks) < self.limit - 1
        return len(self.tasks) < self.limit

    def _replay_may_start(self) -> bool:
        if len(self.tasks) >= self.limit:
            return False
        if self.limit == 1:  # turns: after an event, or when none waits
            return not self.waiting or self.replay_owed
        if not self.replaying:
            return True  # its one place, events waiting or not
        return not self.waiting and len(self.tasks) < self.limit - 1

    async def _place(self) -> None:
        self._freed.clear()
        await self._freed.wait()

    async def _run(self, before: asyncio.Task | None, br: BindRequestView) -> None:
        if before is not None:
            await asyncio.wait([before])
        await _handle(self.handle, br)

    def _done(self, key: tuple[str, str], replayed: bool, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if self.latest.get(key) is task:
            del self.latest[key]
        if replayed:
            self.replaying -= 1
        self._freed.set()


async def _handle(handle: Handler, br: BindRequestView) -> None:
    try:
        await handle(br)
    except Exception:
        # One bad object or a failed event must not stop the follower.
        log.exception("BindRequest %s: check failed", br.ref)
