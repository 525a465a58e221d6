"""List and watch KAI's BindRequests (scheduling.run.ai/v1alpha2) and hand each one to the
follower: the one list + watch loop of `kube.listwatch`, with BindRequest-specific handling.

Each fractional BindRequest is held as the follower's view of it (`BindRequestView`) from the
moment its list page or event is decoded, and every other one is dropped then
(`fractional_view`): KAI's scheduler creates one for EVERY pod it binds, CPU-only and whole-GPU
pods too (`Regular`), and keeps it for the pod's life, while the follower checks only the
fractional ones. A list holds the fractional BindRequests of the cluster until the last is
handled (one per bound fractional pod, 160,000 at 5,000 nodes; docs/scale.md); the decoded
object, managed fields and all, is about nine times the view, and another BindRequest costs
only its decoding, with its page. One an event shows as no longer fractional (which KAI does
not do after creating it) is forgotten as a deleted one.

Up to `concurrency` BindRequests are handled at once, those of one BindRequest one after the
other in the order seen; the loop reads on only when a place is free, so nothing piles up. With
an unmodified KAI every fractional pod waits for its check and signature, and a check waits on
the API server (about 4 requests): one at a time, a Job of thousands of pods bound at once
would be signed at the API server's latency, one request after another.

A list is replayed in the background, newest BindRequest first, while the watch is already
open, and the watch's events go first: a follower that takes over at 5,000 nodes (a rollout, a
lost Lease) checks 160,000 listed BindRequests for minutes, and a pod bound meanwhile must not
wait for its signature until they are done.

A handling that could not finish for a reason that passes by itself is handed over again by
the replay, ahead of the listed ones, after a bounded backoff (`rechecks`): the watch would
show that BindRequest again only when it changes, and the next list may come after the pod's
gate has given up.
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
from ..contract import keys as k
from ..kube.client import Kube
from ..kube.listwatch import RESYNC_SECONDS, WATCH_BACKOFF, Collection, list_watch
from ..kube.objects import namespaced_path
from ..kube.retry import Backoff
from .bindrequest_view import BindRequestView, fractional_view
from .errors import MirrorError
from .follower import GROUP, PLURAL, VERSION
from .rechecks import RECHECK_BACKOFF, Rechecks, wants_recheck

log = logging.getLogger(__name__)

__all__ = ["bindrequest_source", "follow"]

WHAT = "BindRequest(s)"
CONCURRENCY = 8
"""BindRequests handled at once by default (`--follow-concurrency`)."""
Handler = Callable[[BindRequestView], Awaitable[object]]


def bindrequest_source(kube: Kube, *, watch_seconds: int = 300, request_timeout: float = 30.0,
                       read_timeout: float | None = None) -> Collection:
    """Every namespace's fractional BindRequests, listed as views (each object dropped with its
    page; the others left out: `fractional_view`)."""
    return Collection(kube, namespaced_path(GROUP, VERSION, PLURAL, None), what=WHAT,
                      watch_seconds=watch_seconds, request_timeout=request_timeout,
                      read_timeout=read_timeout, keep=fractional_view)


def _fractional(obj: Mapping[str, Any] | BindRequestView) -> BindRequestView | None:
    """The view of `obj` when it is a fractional BindRequest, else None."""
    if isinstance(obj, BindRequestView):
        return obj if obj.resource_type == k.RESOURCE_TYPE_FRACTION else None
    return fractional_view(obj)


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
    recheck_backoff: Backoff = RECHECK_BACKOFF,
) -> NoReturn:
    """Level-triggered: every fractional BindRequest seen (listed, or ADDED or MODIFIED in the
    watch) goes to `handle`, up to `concurrency` at once, each BindRequest's in the order seen
    (a list's in the background, newest first, behind the watch's events: `_Replay`); `handle`
    must be idempotent. A watch only replays changes, so a handling that could not finish for
    a reason that passes by itself (`rechecks.wants_recheck`: the API server away through the
    store's retries, a result whose `recheck` says so) is handed over again after
    `recheck_backoff`, for as long as that goes on, until the BindRequest changes, is deleted
    or listed again; anything else that failed is retried by listing everything again once
    `resync_seconds` have passed, when the current watch stream ends. An error of one
    BindRequest is logged and the loop goes on. A deleted BindRequest goes to `forget`, and so
    does one an event shows as not fractional (any other is never handed over:
    `fractional_view`). Runs until cancelled (cancelling it cancels the handling in progress
    and every recheck)."""
    handling = _InFlight(handle, concurrency)
    replay = _Replay(handling, recheck_backoff, rng)
    handling.after = replay.after

    def gone(view: BindRequestView) -> None:
        replay.forget(view)
        if forget is not None:
            forget(view)

    async def on_list(items: list[Mapping[str, Any] | BindRequestView]) -> None:
        replay.restart(items)  # and the watch opens at once

    async def on_event(kind: str, obj: Mapping[str, Any]) -> None:
        if kind not in ("ADDED", "MODIFIED", "DELETED"):
            return  # a BOOKMARK carries a version, no BindRequest
        view = _fractional(obj)
        if view is None:
            # Nothing to check. Nothing is held of it unless it was fractional before (KAI
            # does not change that after creating it): then that goes, as for a deleted one,
            # after a handling of it in flight.
            kind, view = "DELETED", BindRequestView.from_object(obj)
        replay.supersede(view)
        if kind != "DELETED":
            await handling.start(view)
            return
        running = handling.latest.get((view.namespace, view.name))
        if running is None:
            gone(view)
        else:  # after it: what it remembers of the BindRequest (a recheck) goes too
            running.add_done_callback(lambda _task: gone(view))

    try:
        await list_watch(source, on_list, on_event, backoff=backoff, rng=rng,
                         resync_seconds=resync_seconds, monotonic=monotonic, clock=clock)
    finally:
        # Everything cancelled before the first wait: a second cancel cannot leave any
        # handling running after the follower has stopped (the Lease lost).
        replay.rechecks.close()
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
    the oldest), then newest first; the rechecks that fell due (`rechecks`: each one a
    BindRequest whose handling could not finish, fresh binds whose gates are waiting) go first,
    then turn about with the listed ones. One
    the watch shows meanwhile leaves the replay and loses its recheck (its event carried a newer
    version, or its deletion), also while it waits for its place; and once a newer version has
    been seen (an event, or a list entry), a handling of an older one still under way ends
    without one: the newer one's outcome decides."""

    def __init__(self, handling: _InFlight, backoff: Backoff,
                 rng: random.Random | None = None) -> None:
        self.handling = handling
        self.rechecks = Rechecks(self._fell_due, backoff, rng)
        self.due: dict[object, BindRequestView] = {}
        """Rechecks whose time came, in that order."""
        self.pending: dict[object, BindRequestView] = {}
        self.newest: dict[object, str] = {}
        """The resourceVersion of the newest version of a BindRequest seen (its event, its list
        entry) while one of its handlings may still end: an outcome of any other sets no
        recheck (`after`), nor does a recheck of it run (`_fell_due`). Dropped when the
        handling of that version ends, so it holds only BindRequests in flight or queued."""
        self.holding: object = None
        """The key of the BindRequest waiting for a place; None once it is dropped."""
        self.listed = asyncio.Event()
        self.task: asyncio.Task | None = None

    def restart(self, items: list[Mapping[str, Any] | BindRequestView]) -> None:
        # A Collection's `keep` left the others out already; any other source's go here.
        fractional = [br for br in map(_fractional, items) if br is not None]
        views = {_key(br): br for br in sorted(fractional, key=lambda br: br.created,
                                               reverse=True)}
        left = [key for key in self.pending if key in views]
        if self.holding is not None and self.holding in views:
            left.insert(0, self.holding)
        self.holding = None  # the new list has it, at its place
        self.rechecks.retain(views)  # the list hands each live one over again
        self.newest = {key: br.resource_version for key, br in views.items()}
        self.due.clear()
        self.pending = {key: views.pop(key) for key in left}
        self.pending.update(views)
        self._wake()

    def supersede(self, br: BindRequestView) -> None:
        """The watch shows `br` (a new version, or its deletion): whatever is queued of an
        older one leaves, and whatever of one still under way ends without a recheck."""
        key = _key(br)
        self.newest[key] = br.resource_version
        self.pending.pop(key, None)
        self.due.pop(key, None)
        self.rechecks.cancel(key)
        if self.holding == key:
            self.holding = None

    def forget(self, br: BindRequestView) -> None:
        """`br` was deleted: no recheck of it is left, nor what was counted for one."""
        self.supersede(br)
        self.newest.pop(_key(br), None)
        self.rechecks.forget(_key(br))

    def after(self, br: BindRequestView, outcome: object, last: bool) -> None:
        """A handling of `br` ended with `outcome` (what it returned or raised): a recheck is
        set when that may pass by itself, unless it is not the `last` handling of `br` queued,
        or a newer version of `br` has been seen meanwhile (its event may still wait for a
        place): that one's outcome decides; an exception is logged."""
        key = _key(br)
        newest = self.newest.get(key, br.resource_version)
        if newest == br.resource_version:
            self.newest.pop(key, None)
        last = last and newest == br.resource_version
        delay = (self.rechecks.after(key, br.resource_version, br, wants_recheck(outcome))
                 if last else None)
        again = ("checked again when it changes or at the next list" if last and delay is None
                 else f"checked again in {delay:.1f} s" if delay is not None
                 else "a later version of it is queued")
        if isinstance(outcome, MirrorError) and delay is not None:
            log.warning("BindRequest %s: check failed: %s; %s", br.ref, outcome, again)
        elif isinstance(outcome, Exception):
            log.error("BindRequest %s: check failed; %s", br.ref, again, exc_info=outcome)
        elif delay is not None and getattr(outcome, "waiting", False):
            # Every bind, for a moment: not worth a line at INFO per recheck.
            log.debug("BindRequest %s: waiting for KAI's binder; %s", br.ref, again)
        elif delay is not None:
            log.info("BindRequest %s: not complete; %s", br.ref, again)

    def _fell_due(self, br: BindRequestView) -> None:
        key = _key(br)
        if self.newest.get(key, br.resource_version) != br.resource_version:
            return  # a newer version was seen since: that one is checked, not this one
        # Listed again since its handling began: the list's version is the one to check.
        self.due[key] = self.pending.pop(key, br)
        self._wake()

    def _wake(self) -> None:
        self.listed.set()
        if self.task is None or self.task.done():
            self.task = asyncio.create_task(self._run(), name="bindrequest-replay")

    async def _run(self) -> None:
        while True:
            await self.listed.wait()
            self.listed.clear()
            began, started = time.monotonic(), 0
            listed = True
            while self.due or self.pending:
                # Turns while both wait: rechecks that keep falling due (a GPU never known,
                # at every backoff) must not hold the list's replay back for ever.
                listed = not self.due or (bool(self.pending) and not listed)
                queue = self.pending if listed else self.due
                key = next(iter(queue))
                br = queue.pop(key)
                if listed:
                    self.rechecks.cancel(key)  # handled again now: its recheck is moot
                self.holding = key
                try:
                    if await self.handling.start(br, replayed=self._still_holding):
                        started += listed
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
        self.after: Callable[[BindRequestView, object, bool], None] = _log_failure
        """Told what each handling returned or raised, and whether it was the last handling of
        that BindRequest queued."""
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
        outcome = await _handle(self.handle, br)
        self.after(br, outcome, self.latest.get((br.namespace, br.name)) is asyncio.current_task())

    def _done(self, key: tuple[str, str], replayed: bool, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if self.latest.get(key) is task:
            del self.latest[key]
        if replayed:
            self.replaying -= 1
        self._freed.set()


async def _handle(handle: Handler, br: BindRequestView) -> object:
    """What `handle` returned, or the exception it raised (not raised on: one bad object or a
    failed event must not stop the follower; `_InFlight.after` logs it)."""
    try:
        return await handle(br)
    except Exception as e:
        return e


def _log_failure(br: BindRequestView, outcome: object, _last: bool) -> None:
    if isinstance(outcome, Exception):
        log.error("BindRequest %s: check failed", br.ref, exc_info=outcome)
