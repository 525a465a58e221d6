"""List and watch KAI's BindRequests (scheduling.run.ai/v1alpha2) and hand each one to the
follower: the one list + watch loop of `kube.listwatch`, with BindRequest-specific handling.

The loop awaits each handling before it reads on: BindRequests are handled in the order seen,
one at a time, nothing piles up, and a watch resumes after what was handled.
"""

from __future__ import annotations

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
    forget: Callable[[Mapping[str, Any]], object] | None = None,
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
    BindRequest is logged and the loop goes on. A deleted BindRequest goes to `forget`. Runs
    until cancelled (cancelling it cancels the handling in progress)."""
    async def on_list(items: list[Mapping[str, Any]]) -> None:
        for obj in items:
            await _handle(handle, obj)

    async def on_event(kind: str, obj: Mapping[str, Any]) -> None:
        if kind in ("ADDED", "MODIFIED"):
            await _handle(handle, obj)
        elif kind == "DELETED" and forget is not None:
            forget(obj)

    await list_watch(source, on_list, on_event, backoff=backoff, rng=rng,
                     resync_seconds=resync_seconds, monotonic=monotonic, clock=clock)


async def _handle(handle: Handler, obj: Mapping[str, Any]) -> None:
    try:
        await handle(obj)
    except Exception:
        # One bad object or a failed event must not stop the follower.
        meta = obj.get("metadata") or {}
        log.exception("BindRequest %s/%s: check failed", meta.get("namespace"),
                      meta.get("name"))
