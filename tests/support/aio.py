"""Waiting, inside a test's event loop, for what tasks of their own do."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def until(predicate: Callable[[], object], what: str = "the condition",
                timeout: float = 5.0) -> None:
    """Returns once `predicate()` is true; fails naming `what` after `timeout` seconds."""
    try:
        async with asyncio.timeout(timeout):
            while not predicate():
                await asyncio.sleep(0.01)
    except TimeoutError:
        raise AssertionError(f"{what}: not within {timeout} s") from None
