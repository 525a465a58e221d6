"""Bounded, jittered exponential backoff that respects the caller's deadline.

Used for transient Kubernetes API failures (429, 5xx, timeouts, refused or reset connections)
and, one level up, for re-reading a pod after a write conflict. Bounded twice: by a number of
tries (then UNAVAILABLE, retry later) and by the gRPC deadline (then DEADLINE_EXCEEDED); a sleep
never runs past the deadline.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from ..clock import AsyncClock, Clock, SystemClock
from .errors import ApiUnavailable, DeadlineExceeded
from .store import Deadline

T = TypeVar("T")


class Transient(Exception):
    """A failure worth retrying; `retry_after` is the server's hint in seconds, if any."""

    def __init__(self, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after


@dataclass(frozen=True, slots=True)
class Backoff:
    attempts: int = 5
    """Tries in all (the first one included)."""
    base: float = 0.1
    cap: float = 2.0
    jitter: float = 0.5
    """Fraction of each delay drawn at random, so replicas that failed together spread out."""

    def delay(self, retry: int, rng: random.Random, hint: float | None = None) -> float:
        delay = min(self.cap, self.base * (2 ** retry))
        delay *= 1 - self.jitter * rng.random()
        if hint is not None:
            delay = max(delay, min(hint, self.cap))
        return delay


class _Tries:
    """The bookkeeping of one bounded retry loop, shared by `retrying` and `retrying_async`
    (they differ only in how they wait)."""

    def __init__(self, what: str, backoff: Backoff, deadline: Deadline,
                 rng: random.Random | None) -> None:
        self.what, self.backoff, self.deadline = what, backoff, deadline
        self.rng = rng or random.Random()
        self.attempt = 0
        self.last: Transient | None = None

    def begin(self) -> None:
        """Before each try: raises DeadlineExceeded when the deadline has passed."""
        if self.deadline.expired:
            raise _deadline(self.what, self.attempt, self.last)

    def failed(self, error: Transient) -> float:
        """After a transient failure: the delay before the next try, or raises ApiUnavailable
        (tries used up) / DeadlineExceeded (the delay would outlast the deadline)."""
        self.last = error
        self.attempt += 1
        if self.attempt >= max(1, self.backoff.attempts):
            raise ApiUnavailable(f"{self.what}: the Kubernetes API failed "
                                 f"{self.backoff.attempts} time(s), last: {error}; retry later")
        delay = self.backoff.delay(self.attempt - 1, self.rng, error.retry_after)
        remaining = self.deadline.remaining()
        if remaining is not None and remaining <= delay:
            raise _deadline(self.what, self.attempt, error)
        return delay


def retrying(
    call: Callable[[], T],
    *,
    what: str,
    backoff: Backoff,
    deadline: Deadline,
    clock: Clock | None = None,
    rng: random.Random | None = None,
) -> T:
    """Run `call` until it returns or raises something other than Transient."""
    clock = clock or SystemClock()
    tries = _Tries(what, backoff, deadline, rng)
    while True:
        tries.begin()
        try:
            return call()
        except Transient as e:
            clock.sleep(tries.failed(e))


async def retrying_async(
    call: Callable[[], Awaitable[T]],
    *,
    what: str,
    backoff: Backoff,
    deadline: Deadline,
    clock: AsyncClock | None = None,
    rng: random.Random | None = None,
) -> T:
    """`retrying` for a coroutine: the waits between tries do not block the event loop."""
    clock = clock or SystemClock()
    tries = _Tries(what, backoff, deadline, rng)
    while True:
        tries.begin()
        try:
            return await call()
        except Transient as e:
            await clock.asleep(tries.failed(e))


def _deadline(what: str, tries: int, last: Transient | None) -> DeadlineExceeded:
    tail = f" ({tries} tries, last: {last})" if last is not None else ""
    return DeadlineExceeded(f"{what}: the caller's deadline ran out{tail}")
