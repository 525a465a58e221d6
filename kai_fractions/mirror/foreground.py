"""Calls first, the cache's work after: the one priority rule of the mirror's serving loop.

asyncio runs what is ready in turn, with no priorities. The pod cache's work (decoding a list
page, trimming and merging its pods; the watch's events when many come at once, as when a Job of
thousands of pods is created) runs on the loop that serves MirrorAllocation, in chunks of about
a millisecond at most (`Slices`). Run flat out between calls, it makes every call wait: for the
chunk the loop is in when the call arrives, and for the CPU the list takes from the API server
and the caller on the same cores. So while calls come, the cache's work rests `rest` seconds
between chunks and runs each in a gap between calls (no call in flight, and a turn of the loop
with nothing else to run); with no calls, it runs flat out. A call waiting on the API server
counts as in flight, so under a load that leaves no gap (many callers, or a slow API server) it
still runs one chunk every `max_wait` seconds: the cache fills slowly, and never starves.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator

BUSY_SECONDS = 0.0002
"""A yield to the loop that takes longer than this ran other work (a call's step): the loop may
have more, so the cache's work yields again."""
REST_SECONDS = 0.003
"""While calls come, the least time between two chunks of the cache's work."""
CALLS_COME_SECONDS = 0.1
"""Calls "come" while the last one started less than this long ago."""
MAX_WAIT_SECONDS = 0.01
"""The longest the cache's work waits for a gap before it runs a chunk anyway."""


class Foreground:
    """The calls in flight on one event loop, and the wait for a gap between them. Used on
    that loop only (its wait is an asyncio.Event of that loop)."""

    def __init__(self, *, rest: float = REST_SECONDS, max_wait: float = MAX_WAIT_SECONDS,
                 busy_seconds: float = BUSY_SECONDS,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.rest = rest
        self.max_wait = max_wait
        self.busy_seconds = busy_seconds
        self._clock = clock
        self.in_flight = 0
        self._last_call = -CALLS_COME_SECONDS  # when the last call started (clock)
        self._quiet: asyncio.Event | None = None  # made on the loop that waits on it

    @contextlib.contextmanager
    def call(self) -> Iterator[None]:
        """Marks one call in flight for as long as the block runs."""
        self.in_flight += 1
        self._last_call = self._clock()
        try:
            yield
        finally:
            self.in_flight -= 1
            if not self.in_flight and self._quiet is not None:
                self._quiet.set()

    async def gap(self) -> None:
        """Returns when the cache's work may run its next chunk: once no call is in flight
        and a turn of the loop ran nothing else, no sooner than `rest` seconds from now while
        calls come, and `max_wait` seconds from now at the latest (`rest` included)."""
        clock = self._clock
        deadline = clock() + self.max_wait
        if self.in_flight or clock() - self._last_call < CALLS_COME_SECONDS:
            await asyncio.sleep(self.rest)
        while True:
            if self.in_flight:
                if self._quiet is None:
                    self._quiet = asyncio.Event()
                self._quiet.clear()
                try:
                    async with asyncio.timeout(max(0.0, deadline - clock())):
                        await self._quiet.wait()
                except TimeoutError:
                    break
            began = clock()
            await asyncio.sleep(0)
            if (clock() - began <= self.busy_seconds and not self.in_flight) \
                    or clock() >= deadline:
                break


class Slices:
    """Work on the serving loop in slices of at most `seconds`, each followed by a gap between
    the calls: the unit of work (a pod, an event) calls `step` when it is done."""

    def __init__(self, foreground: Foreground, seconds: float,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.foreground = foreground
        self.seconds = seconds
        self._clock = clock
        self._began = clock()

    async def step(self) -> None:
        """Waits for a gap (Foreground.gap) once the slice since the last one is spent. Work
        that comes alone after a quiet while (one watch event) finds its slice spent, and costs
        a gap: a turn of the loop with no call in flight, a rest while calls come."""
        if self._clock() - self._began > self.seconds:
            await self.foreground.gap()
            self._began = self._clock()
