"""Bounded, jittered backoff that never sleeps past the caller's deadline."""

from __future__ import annotations

import asyncio
import random

import pytest

from kai_fractions.mirror.errors import ApiUnavailable, DeadlineExceeded
from kai_fractions.mirror.retry import Backoff, Transient, retrying, retrying_async
from kai_fractions.mirror.store import Deadline
from tests.support.clock import FakeClock


def run_async(call, **options):
    """`retrying_async` over the same blocking `call`, as a coroutine."""
    async def acall():
        return call()

    return asyncio.run(retrying_async(acall, **options))


# Every loop test runs both drivers: they share the bookkeeping and must not drift apart.
drivers = pytest.mark.parametrize("retrying", [retrying, run_async], ids=["sync", "async"])


def failing(times: int, result: str = "ok", retry_after: float | None = None):
    calls = []

    def call():
        calls.append(1)
        if len(calls) <= times:
            raise Transient("503 ServiceUnavailable: try later", retry_after)
        return result

    return call, calls


def test_delays_grow_exponentially_within_the_cap_and_jitter():
    backoff = Backoff(base=0.1, cap=1.0, jitter=0.5)
    rng = random.Random(7)
    for retry, top in enumerate([0.1, 0.2, 0.4, 0.8, 1.0, 1.0]):
        delay = backoff.delay(retry, rng)
        assert top * 0.5 <= delay <= top


def test_retry_after_hint_is_honoured_up_to_the_cap():
    backoff = Backoff(base=0.1, cap=2.0)
    assert backoff.delay(0, random.Random(1), hint=1.5) == 1.5
    assert backoff.delay(0, random.Random(1), hint=60) == 2.0


@drivers
def test_transient_failures_are_retried_then_succeed(retrying):
    clock = FakeClock()
    call, calls = failing(2)
    assert retrying(call, what="read pod", backoff=Backoff(attempts=5), deadline=Deadline(),
                    clock=clock, rng=random.Random(1)) == "ok"
    assert (len(calls), len(clock.sleeps)) == (3, 2)


@drivers
def test_attempts_are_bounded_then_unavailable(retrying):
    clock = FakeClock()
    call, calls = failing(99)
    with pytest.raises(ApiUnavailable) as e:
        retrying(call, what="read pod a/b", backoff=Backoff(attempts=4), deadline=Deadline(),
                 clock=clock, rng=random.Random(1))
    assert str(e.value) == ("read pod a/b: the Kubernetes API failed 4 time(s), last: 503 "
                            "ServiceUnavailable: try later; retry later")
    assert (len(calls), len(clock.sleeps)) == (4, 3)


@drivers
def test_a_sleep_never_runs_past_the_deadline(retrying):
    clock = FakeClock()
    call, calls = failing(99)
    deadline = Deadline(expires_at=0.25, clock=clock)
    with pytest.raises(DeadlineExceeded, match="read pod: the caller's deadline ran out"):
        retrying(call, what="read pod", backoff=Backoff(attempts=50, base=0.1, jitter=0),
                 deadline=deadline, clock=clock, rng=random.Random(1))
    assert clock.sleeps == [0.1]  # the next delay (0.2) would end after the deadline
    assert len(calls) == 2


@drivers
def test_an_expired_deadline_makes_no_call(retrying):
    clock = FakeClock()
    call, calls = failing(0)
    with pytest.raises(DeadlineExceeded):
        retrying(call, what="x", backoff=Backoff(), deadline=Deadline(expires_at=0, clock=clock),
                 clock=clock)
    assert calls == []


def test_deadline_caps_request_timeouts():
    clock = FakeClock()
    assert Deadline(clock=clock).timeout(10) == 10
    assert Deadline(expires_at=2.5, clock=clock).timeout(10) == 2.5
