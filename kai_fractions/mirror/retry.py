"""Bounded, jittered exponential backoff that respects the caller's deadline.

Used for transient Kubernetes API failures (429, 5xx, timeouts, refused or reset connections)
and, one level up, for re-reading a pod after a write conflict. Bounded twice: by a number of
tries (then UNAVAILABLE, retry later) and by the gRPC deadline (then DEADLINE_EXCEEDED); a sleep
never runs past the deadline.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from .errors import ApiUnavailable, DeadlineExceeded
from .store import Clock, Deadline, SystemClock

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
    rng = rng or random.Random()
    last: Transient | None = None
    for attempt in range(max(1, backoff.attempts)):
        if deadline.expired:
            raise _deadline(what, attempt, last)
        try:
            return call()
        except Transient as e:
            last = e
        if attempt + 1 >= backoff.attempts:
            break
        delay = backoff.delay(attempt, rng, last.retry_after)
        remaining = deadline.remaining()
        if remaining is not None and remaining <= delay:
            raise _deadline(what, attempt + 1, last)
        clock.sleep(delay)
    raise ApiUnavailable(f"{what}: the Kubernetes API failed {backoff.attempts} time(s), "
                         f"last: {last}; retry later")


def _deadline(what: str, tries: int, last: Transient | None) -> DeadlineExceeded:
    tail = f" ({tries} tries, last: {last})" if last is not None else ""
    return DeadlineExceeded(f"{what}: the caller's deadline ran out{tail}")
