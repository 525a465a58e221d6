"""Bounded, jittered exponential backoff that respects the caller's deadline.

A request that failed transiently (`errors.Transient`) is tried again, bounded twice: by a
number of tries (then `Unavailable`: retry later) and by the caller's deadline (then
`DeadlineExceeded`); a wait never runs past the deadline, nor, for a request that needs some
of the deadline to be worth sending (`try_budget`), into that time. Jitter spreads replicas
that failed together.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from ..clock import AsyncClock, Clock, SystemClock
from .errors import DeadlineExceeded, Transient, Unavailable

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Backoff:
    attempts: int = 5
    """Tries in all (the first one included)."""
    base: float = 0.1
    cap: float = 2.0
    jitter: float = 0.5
    """Fraction of each delay drawn at random."""

    def delay(self, retry: int, rng: random.Random, hint: float | None = None) -> float:
        delay = min(self.cap, self.base * (2 ** min(retry, 32)))
        delay *= 1 - self.jitter * rng.random()
        if hint is not None:
            delay = max(delay, min(hint, self.cap))
        return delay


@dataclass(frozen=True, slots=True)
class Deadline:
    """When the caller stops waiting (a gRPC deadline); `expires_at` None = no deadline."""

    expires_at: float | None = None
    clock: Clock = field(default_factory=SystemClock)

    @classmethod
    def after(cls, seconds: float | None, clock: Clock | None = None) -> Deadline:
        clock = clock or SystemClock()
        return cls(None if seconds is None else clock.monotonic() + seconds, clock)

    def remaining(self) -> float | None:
        if self.expires_at is None:
            return None
        return max(0.0, self.expires_at - self.clock.monotonic())

    @property
    def expired(self) -> bool:
        remaining = self.remaining()
        return remaining is not None and remaining <= 0

    def timeout(self, cap: float) -> float:
        """A per-request timeout: `cap`, or less when the deadline is nearer."""
        remaining = self.remaining()
        return cap if remaining is None else max(0.001, min(cap, remaining))


NO_DEADLINE = Deadline()


async def retrying(
    call: Callable[[float], Awaitable[T]],
    *,
    what: str,
    backoff: Backoff,
    deadline: Deadline = NO_DEADLINE,
    request_timeout: float = 10.0,
    clock: AsyncClock | None = None,
    rng: random.Random | None = None,
    try_budget: float = 0.0,
) -> T:
    """`await call(timeout)` until it returns or raises anything but Transient; `timeout` is
    `request_timeout`, or less when the deadline is nearer. `try_budget`: seconds of the
    deadline a try needs left to be sent at all (a pod write's: kube_store.MIN_WRITE_BUDGET);
    a retry whose wait would leave less is given up before the wait, not after it
    (DeadlineExceeded at once). 0: only a wait that would outlast the deadline is."""
    clock = clock or SystemClock()
    rng = rng or random.Random()
    attempt, last = 0, None
    while True:
        if deadline.expired:
            raise _deadline(what, attempt, last)
        try:
            return await call(deadline.timeout(request_timeout))
        except Transient as e:
            last = e
            attempt += 1
            if attempt >= max(1, backoff.attempts):
                answer = (f"the Kubernetes API failed {attempt} time(s), last: {e.answer}; "
                          "retry later")
                raise Unavailable(f"{what}: {answer}", e.status, answer=answer) from None
            delay = backoff.delay(attempt - 1, rng, e.retry_after)
            remaining = deadline.remaining()
            if remaining is not None and remaining <= delay:
                raise _deadline(what, attempt, e) from None
            if remaining is not None and remaining - delay < try_budget:
                raise _deadline(what, attempt, e, short=(
                    f"the caller's deadline leaves {remaining * 1000:.0f} ms, less than the "
                    f"{delay * 1000:.0f} ms wait before a retry and the "
                    f"{try_budget * 1000:.0f} ms a try needs: not retried")) from None
            await clock.asleep(delay)


def _deadline(what: str, tries: int, last: Transient | None, *,
              short: str = "the caller's deadline ran out") -> DeadlineExceeded:
    tail = f" ({tries} tries, last: {last.answer})" if last is not None else ""
    answer = f"{short}{tail}"
    return DeadlineExceeded(f"{what}: {answer}", answer=answer)
