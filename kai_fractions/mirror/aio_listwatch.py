"""List, then watch, on the event loop: the mirror's pod cache is fed on the loop that serves
from it. Each of the mirror's writes comes back on this watch; read in a thread of its own, each
echo also cost a handoff of the GIL between that thread and the loop (benchmarks/README.md,
round three, has what it measured). The loop logic is `listwatch.Cycle`'s, shared with the
threaded `list_watch`.
"""

from __future__ import annotations

import random
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, NoReturn
from urllib.parse import urlencode

from ..clock import AsyncClock, SystemClock
from .aio_api import AsyncKubeApi
from .errors import MirrorError
from .kube_api import Refusal, decoded, failure
from .listwatch import PAGE_SIZE, RESYNC_SECONDS, WATCH_BACKOFF, Cycle, Gone, watch_event
from .retry import Backoff, Transient


class AsyncListWatch:
    """The list and the watch of one collection (`path`, with `params` such as a
    fieldSelector), through an AsyncKubeApi: the list in pages, the watch as a stream of
    events. Raises Gone when the server says a version expired (410), else Transient or
    ApiRejected (kube_api) for a refusal, OSError for the transport."""

    def __init__(self, api: AsyncKubeApi, path: str, params: Mapping[str, str], *,
                 what: str, watch_seconds: int = 300, request_timeout: float = 30.0,
                 read_timeout: float | None = None, page_size: int = PAGE_SIZE,
                 skip: Callable[[bytes], bool] | None = None,
                 keep: Callable[[Mapping[str, Any]], Any] | None = None) -> None:
        self.api, self.path, self.params, self.what = api, path, dict(params), what
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
        of the objects (the pod cache's trimmed entries, so no page outlives its decoding)."""

    async def list(self) -> tuple[list[Mapping[str, Any]], str]:
        items: list[Mapping[str, Any]] = []
        resource_version, token = "", ""
        while True:
            query = {**self.params, "limit": str(self.page_size)}
            if token:
                query["continue"] = token
            response = await self.api.request("GET", self.path, query=urlencode(query),
                                              timeout=self.request_timeout)
            if not 200 <= response.status <= 299:
                raise self._refused(Refusal.of(response.status, response.reason,
                                               response.body))
            body = decoded(f"list {self.what}", response.body) or {}
            page = body.get("items") or []
            items.extend(page if self.keep is None else map(self.keep, page))
            meta = body.get("metadata") or {}
            # Every page of one list is the same snapshot: the first page's version is its.
            resource_version = resource_version or str(meta.get("resourceVersion") or "")
            token = str(meta.get("continue") or "")
            if not token:
                return items, resource_version

    async def watch(self, resource_version: str
                    ) -> AsyncIterator[tuple[str, Mapping[str, Any]]]:
        query = {**self.params, "watch": "true", "allowWatchBookmarks": "true",
                 "timeoutSeconds": str(self.watch_seconds)}
        if resource_version:
            query["resourceVersion"] = resource_version
        async with self.api.stream(self.path, urlencode(query), timeout=self.request_timeout,
                                   idle_timeout=self.read_timeout) as stream:
            if not 200 <= stream.status <= 299:
                raise self._refused(Refusal.of(stream.status, stream.reason,
                                               await stream.read()))
            async for line in stream.lines():
                event = watch_event(line, self.skip)
                if event is None:
                    continue
                kind, obj = event
                if kind == "ERROR":
                    raise self._refused(Refusal(int(obj.get("code") or 500),
                                                str(obj.get("message") or "watch error")))
                yield kind, obj

    def _refused(self, refusal: Refusal) -> Exception:
        if refusal.status == 410:  # a list page's continue token, or a watch's version
            return Gone(refusal.message)
        return failure(f"list/watch {self.what}", refusal)


async def list_watch_async(
    source: AsyncListWatch,
    on_list: Callable[[list[Mapping[str, Any]]], object],
    on_event: Callable[[str, Mapping[str, Any]], object],
    *,
    backoff: Backoff = WATCH_BACKOFF,
    rng: random.Random | None = None,
    resync_seconds: float = RESYNC_SECONDS,
    monotonic: Callable[[], float] = time.monotonic,
    clock: AsyncClock | None = None,
) -> NoReturn:
    """`listwatch.list_watch` on the event loop, until cancelled: every full list to
    `on_list`, every watch event (BOOKMARK included) to `on_event`; a failing list or watch
    is tried again after a backoff, forever. An exception from a handler is not caught."""
    clock = clock or SystemClock()
    cycle = Cycle(source.what, backoff=backoff, rng=rng, resync_seconds=resync_seconds,
                  monotonic=monotonic)
    while True:
        try:
            if cycle.must_list():
                items, resource_version = await source.list()
                cycle.listed(len(items), resource_version)
                on_list(items)
                cycle.progressed()
            async for kind, obj in source.watch(cycle.resource_version):
                on_event(kind, obj)
                cycle.progressed(obj)
        except Gone as e:
            cycle.expired(e)
        except (MirrorError, Transient, OSError, ValueError) as e:
            await clock.asleep(cycle.failed(e))
