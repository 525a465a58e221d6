"""The clock seam: components take a `Clock` so tests can run time forward without sleeping."""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class AsyncClock(Protocol):
    """The clock of code that runs on an event loop (the mirror): its waits must not block."""

    def monotonic(self) -> float: ...

    async def asleep(self, seconds: float) -> None: ...


class SystemClock:
    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    async def asleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
