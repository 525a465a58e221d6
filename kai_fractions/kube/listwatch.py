"""List, then watch, forever: the one loop behind every cache of API objects here (the
mirror's pods and KAI's BindRequests, the node agent's pods).

`Collection` lists one collection in pages and watches it as a stream of events; `list_watch`
runs the loop: it resumes a watch from the last resourceVersion seen (bookmarks included), lists
again when the server says that version expired (410 Gone) or every `resync_seconds`, and backs
off (jittered, capped, never giving up) while the API server is away, or while it ends each
watch at once with nothing in it. It ends only when cancelled.
"""

from __future__ import annotations

import inspect
import json
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, NoReturn, Protocol

from ..clock import AsyncClock, SystemClock
from . import objects
from .client import Kube, decoded
from .errors import BadAnswer, Gone, KubeError, Transient, refused
from .retry import Backoff

log = logging.getLogger(__name__)

WATCH_BACKOFF = Backoff(attempts=1_000_000, base=0.5, cap=30.0)
"""Between failed lists or watches: a watcher never gives up, it only slows down."""
RESYNC_SECONDS = 600.0
"""Everything is listed again at least this often."""
PAGE_SIZE = 500
"""Objects per list page: a large collection comes in bounded pieces, not one huge body."""
WATCH_CACHE = "0"
"""A list's resourceVersion that lets the API server answer from its watch cache (cheap, maybe
a moment old) instead of a read of every object from etcd."""
SHORT_WATCH_SECONDS = 1.0
"""A watch that ends sooner than this with no event in it failed (client-go's reflector's rule):
a server or proxy that answers every watch with an empty 200 is backed off, not asked again
at once, for ever."""


def watch_event(line: str | bytes, what: str, skip: Callable[[Any], bool] | None = None
                ) -> tuple[str, Mapping[str, Any]] | None:
    """One line of a watch stream as (type, object); None for a blank line or one `skip`
    drops unparsed. An ERROR event raises its error (Gone for 410)."""
    if not line.strip() or (skip is not None and skip(line)):
        return None
    try:
        event = json.loads(line)
    except ValueError:
        raise BadAnswer(f"{what}: an event that is not JSON ({line[:60]!r})") from None
    obj = event.get("object") if isinstance(event, dict) else None
    if not isinstance(obj, dict):
        raise BadAnswer(f"{what}: an event that is not a watch event ({line[:60]!r})")
    kind = str(event.get("type") or "")
    if kind == "ERROR":
        code = obj.get("code")
        raise refused(what, code if isinstance(code, int) and code >= 400 else 500,
                      str(obj.get("reason") or ""), json.dumps(obj))
    return kind, obj


def list_page(body: Any, what: str) -> tuple[list[Any], str, str]:
    """A list page's items, resourceVersion and continue token ("" when it is the last).
    BadAnswer, naming what is missing, for a 2xx answer that is no list: a gateway's or auth
    proxy's `{"status": "ok"}`, or an answer from a wrong path prefix, taken for an empty list
    would empty a cache (the node agent would release the limits of every pod on its node)."""
    if not isinstance(body, dict):
        raise BadAnswer(f"{what}: the API server's answer is not a list ("
                        f"{'empty' if body is None else 'a JSON ' + type(body).__name__}); "
                        "check the server URL's path prefix and any proxy in between", 200)
    items = body.get("items", ...)
    meta = body.get("metadata")
    version = meta.get("resourceVersion") if isinstance(meta, dict) else None
    token = meta.get("continue") if isinstance(meta, dict) else None
    wrong = [problem for problem, bad in (
        # null is what the API server sends for no items.
        ("no `items`" if items is ... else f"`items` is a {type(items).__name__}",
         items is not None and not isinstance(items, list)),
        ("no `metadata.resourceVersion`", not isinstance(version, str) or not version),
        ("a `metadata.continue` that is not a string",
         token is not None and not isinstance(token, str))) if bad]
    if wrong:
        keys = ", ".join(sorted(map(str, body))[:8]) or "none"
        raise BadAnswer(f"{what}: the API server's answer is not a list: {' and '.join(wrong)} "
                        f"(kind {body.get('kind') or '-'}, keys: {keys}); check the server "
                        "URL's path prefix and any proxy in between", 200)
    return items or [], version, token or ""


class Source(Protocol):
    """What `list_watch` lists and watches: a `Collection`, or a test's scripted stand-in."""

    what: str

    async def list(self, resource_version: str = "") -> tuple[list[Any], str]: ...

    def watch(self, resource_version: str) -> AsyncIterator[tuple[str, Mapping[str, Any]]]: ...


class Collection:
    """One collection (`path`, with `params` such as a fieldSelector), listed and watched.
    Raises the errors of `errors` (Gone when a version or continue token expired)."""

    def __init__(self, kube: Kube, path: str, params: Mapping[str, str] | None = None, *,
                 what: str, watch_seconds: int = 300, request_timeout: float = 30.0,
                 read_timeout: float | None = None, page_size: int = PAGE_SIZE,
                 skip: Callable[[bytes], bool] | None = None,
                 keep: Callable[[Mapping[str, Any]], Any] | None = None,
                 pace: Callable[[], Awaitable[None]] | None = None) -> None:
        self.kube, self.path, self.params, self.what = kube, path, dict(params or {}), what
        self.watch_seconds = watch_seconds
        self.request_timeout = request_timeout
        # A server ends the stream after watch_seconds; the read timeout only catches one that
        # went silent (a dead connection), so it leaves the server some slack.
        self.read_timeout = watch_seconds + 30.0 if read_timeout is None else read_timeout
        self.page_size = page_size
        self.skip = skip
        """Called with each raw event line; True drops it unparsed (a cheap filter)."""
        self.keep = keep
        """Applied to each listed object as its page arrives: what the list returns instead
        of the objects (a cache's trimmed entries, so no page outlives its decoding); an
        object it makes None of is left out."""
        self.pace = pace
        """Awaited before each list page is decoded: a loop that also serves calls lets them
        go first (decoding a page, and `keep` on its objects, is work they would otherwise
        wait behind)."""

    async def list(self, resource_version: str = "") -> tuple[list[Any], str]:
        """Every object (or what `keep` made of it) and the list's resourceVersion."""
        items: list[Any] = []
        version, token = "", ""
        what = f"list {self.what}"
        while True:
            query = {**self.params, "limit": str(self.page_size)}
            if token:
                query["continue"] = token
            elif resource_version:
                query["resourceVersion"] = resource_version
            raw = await self.kube.read("GET", self.path, what=what, query=query,
                                       timeout=self.request_timeout)
            if self.pace is not None:
                await self.pace()
            body = decoded(raw, what)
            del raw
            page, page_version, token = list_page(body, what)
            if self.keep is None:
                items.extend(page)
            else:
                items.extend(kept for kept in map(self.keep, page) if kept is not None)
            # Every page of one list is the same snapshot: the first page's version is its.
            version = version or page_version
            # Let the page go before the next one is read: held until its successor was
            # decoded, it doubled what a list's pages take at a time.
            del body, page
            if not token:
                return items, version

    async def watch(self, resource_version: str) -> AsyncIterator[tuple[str, Mapping[str, Any]]]:
        """(event type, object) from `resource_version` on, until the server ends the stream."""
        query = {**self.params, "watch": "true", "allowWatchBookmarks": "true",
                 "timeoutSeconds": str(self.watch_seconds)}
        if resource_version:
            query["resourceVersion"] = resource_version
        what = f"watch {self.what}"
        async with self.kube.stream(self.path, what=what, query=query,
                                    timeout=self.request_timeout,
                                    idle_timeout=self.read_timeout) as lines:
            async for line in lines:
                event = watch_event(line, what, self.skip)
                if event is not None:
                    yield event


class Cycle:
    """The bookkeeping of one loop: where the watch resumes, when to list again, how long to
    wait after a failure."""

    def __init__(self, what: str, *, backoff: Backoff, rng: random.Random | None,
                 resync_seconds: float, monotonic: Callable[[], float],
                 relist_after_failure: bool, cached_lists: bool) -> None:
        self.what, self.backoff, self.resync_seconds = what, backoff, resync_seconds
        self.rng = rng or random.Random()
        self.monotonic = monotonic
        self.relist_after_failure = relist_after_failure
        self.cached_lists = cached_lists
        self.resource_version = ""
        self.failures = 0
        """Failures since the last watch that worked. A list that works resets it only after
        failed lists (the API server was away and is back: its first watch failure waits the
        shortest backoff); after a failed watch it does not (a server that answers lists but
        fails every watch must be backed off, not listed twice a second for ever)."""
        self.lists_failing = False
        self.expirations = 0
        self.listed_at = monotonic()
        self._consistent_next = False

    def list_version(self) -> str | None:
        """None when the next step is a watch; else the resourceVersion to list at ("" for a
        consistent read)."""
        if self.resource_version and self.monotonic() - self.listed_at >= self.resync_seconds:
            self.resource_version = ""  # periodic resync
        if self.resource_version:
            return None
        self.listed_at = self.monotonic()
        # After a 410 the next list stays a consistent read: a watch cache behind the expired
        # watch could otherwise send the loop round again (as client-go's reflector does).
        return WATCH_CACHE if self.cached_lists and not self._consistent_next else ""

    def listed(self, count: int, resource_version: str) -> None:
        self.resource_version = resource_version
        self._consistent_next = False
        if self.lists_failing:
            self.failures = self.expirations = 0
            self.lists_failing = False
        log.info("listed %d %s at resourceVersion %s", count, self.what,
                 resource_version or "-")

    def progressed(self, obj: Mapping[str, Any] | None = None) -> None:
        """A watch event (`obj`), or a watch that ended by its timeout: the watch works, and
        resumes after it."""
        if obj is not None:
            self.resource_version = objects.resource_version(obj) or self.resource_version
        self.failures = self.expirations = 0

    def expired(self, error: Exception) -> float:
        """The delay before the list again: none for the first 410 since the watch last
        worked (a version that expired while it was away), the failures' backoff for more in
        a row (a server or proxy that keeps answering 410 must not be listed in a hot loop)."""
        self.resource_version = ""
        self._consistent_next = True
        self.expirations += 1
        if self.expirations == 1:
            log.info("the %s watch expired (%s); listing again", self.what, error)
            return 0.0
        delay = self.backoff.delay(min(self.expirations - 2, 16), self.rng)
        log.warning("the %s watch expired again (%s, %d in a row); listing again in %.1fs",
                    self.what, error, self.expirations, delay)
        return delay

    def failed(self, error: Exception, listing: bool = False) -> float:
        """The delay before the next try (at least what a Retry-After asked, up to the cap);
        `listing`: the list failed (else the watch)."""
        delay = self.backoff.delay(min(self.failures, 16), self.rng,
                                   getattr(error, "retry_after", None))
        self.failures += 1
        self.lists_failing = listing
        if self.relist_after_failure:
            self.resource_version = ""
        log.warning("%s list/watch failed (%s); again in %.1fs", self.what, error, delay)
        return delay


async def list_watch(
    source: Source,
    on_list: Callable[[list[Any]], object | Awaitable[object]],
    on_event: Callable[[str, Mapping[str, Any]], object | Awaitable[object]],
    *,
    on_failure: Callable[[KubeError], object] | None = None,
    backoff: Backoff = WATCH_BACKOFF,
    rng: random.Random | None = None,
    resync_seconds: float = RESYNC_SECONDS,
    relist_after_failure: bool = False,
    cached_lists: bool = False,
    monotonic: Callable[[], float] = time.monotonic,
    clock: AsyncClock | None = None,
) -> NoReturn:
    """Hands every full list to `on_list` and every watch event (BOOKMARK included) to
    `on_event` until cancelled. A failing list or watch (one that ended within
    SHORT_WATCH_SECONDS with no events included) goes to `on_failure`, and is tried
    again after a backoff: resuming the watch, or with a fresh list when
    `relist_after_failure`. With `cached_lists`, lists are answered from the API server's watch
    cache. A handler may be a coroutine function: the loop then awaits each handling before it
    reads on, so it never runs ahead of its handlers. An exception from a handler is not
    caught: the handlers own their errors."""
    clock = clock or SystemClock()
    cycle = Cycle(source.what, backoff=backoff, rng=rng, resync_seconds=resync_seconds,
                  monotonic=monotonic, relist_after_failure=relist_after_failure,
                  cached_lists=cached_lists)
    while True:
        listing = False
        try:
            version = cycle.list_version()
            if version is not None:
                listing = True
                items, resource_version = await source.list(version)
                listing = False
                cycle.listed(len(items), resource_version)
                handling = on_list(items)
                # The handler owns the list now; held here, it would outlive a cache's merge
                # (and every listed object a newer write replaced) until the next list.
                del items
                await _handled(handling)
            started, events = monotonic(), 0
            async for kind, obj in source.watch(cycle.resource_version):
                events += 1
                await _handled(on_event(kind, obj))
                cycle.progressed(obj)
            if not events and monotonic() - started < SHORT_WATCH_SECONDS:
                raise Transient(f"watch {source.what}: the API server ended the watch at once, "
                                "with no events")
            cycle.progressed()  # a watch of a quiet collection, ended by its timeout
        except Gone as e:
            delay = cycle.expired(e)
            if delay:
                await clock.asleep(delay)
        except KubeError as e:
            if on_failure is not None:
                on_failure(e)
            await clock.asleep(cycle.failed(e, listing))


async def _handled(result: object) -> None:
    if inspect.isawaitable(result):
        await result
