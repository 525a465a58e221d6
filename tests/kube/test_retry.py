"""kube.retry: bounded, jittered backoff within the caller's deadline, on a fake clock; and
`retrying` over a real Kube against kmock's and FaultyApi's failures."""

from __future__ import annotations

import random
import time
from collections.abc import AsyncIterator

import pytest
from kubernetes import client as k8s

from kai_fractions.kube import (
    MERGE_PATCH,
    BadAnswer,
    Conflict,
    DeadlineExceeded,
    Kube,
    NotFound,
    Transient,
    Unavailable,
    objects,
)
from kai_fractions.kube.errors import refused
from kai_fractions.kube.retry import Backoff, Deadline, retrying
from tests.support.clock import FakeClock
from tests.support.faults_api import Fault, FaultyApi

from .standin import Answer, StandIn, status

NS, NAME = "team-a", "train-0"
POD_PATH = objects.pod_path(NS, NAME)
FAST = Backoff(attempts=3, base=0.001, cap=0.005)


def failing(times: int, error: Exception | None = None, result: str = "ok"):
    """A call that raises `error` (a 503 by default) `times` times, then returns `result`; and
    the timeouts it was given."""
    timeouts: list[float] = []

    async def call(timeout: float) -> str:
        timeouts.append(timeout)
        if len(timeouts) <= times:
            raise error or refused("read pod a/b", 503, "ServiceUnavailable",
                                   '{"message": "try later"}')
        return result

    return call, timeouts


def test_delays_grow_exponentially_within_the_cap_and_jitter():
    backoff = Backoff(base=0.1, cap=1.0, jitter=0.5)
    rng = random.Random(7)
    for retry, top in enumerate([0.1, 0.2, 0.4, 0.8, 1.0, 1.0]):
        assert top * 0.5 <= backoff.delay(retry, rng) <= top


def test_a_huge_retry_number_stays_at_the_cap():
    assert Backoff(base=0.1, cap=2.0, jitter=0).delay(10_000, random.Random(1)) == 2.0


def test_retry_after_is_the_least_delay_up_to_the_cap():
    backoff = Backoff(base=0.1, cap=2.0)
    assert backoff.delay(0, random.Random(1), hint=1.5) == 1.5
    assert backoff.delay(0, random.Random(1), hint=60) == 2.0
    assert backoff.delay(0, random.Random(1), hint=0) <= 0.1  # a smaller hint adds nothing


async def test_transient_failures_are_retried_then_succeed():
    clock = FakeClock()
    call, timeouts = failing(2)
    assert await retrying(call, what="read pod a/b", backoff=Backoff(attempts=5), clock=clock,
                          rng=random.Random(1)) == "ok"
    assert (len(timeouts), len(clock.sleeps)) == (3, 2)


async def test_attempts_are_bounded_then_unavailable_naming_the_last_failure():
    clock = FakeClock()
    call, timeouts = failing(99)
    with pytest.raises(Unavailable) as raised:
        await retrying(call, what="read pod a/b", backoff=Backoff(attempts=4), clock=clock,
                       rng=random.Random(1))
    assert str(raised.value) == ("read pod a/b: the Kubernetes API failed 4 time(s), last: 503 "
                                 "ServiceUnavailable: try later; retry later")
    assert raised.value.status == 503
    assert (len(timeouts), len(clock.sleeps)) == (4, 3)


@pytest.mark.parametrize("attempts", [1, 0], ids=["one", "none-means-one"])
async def test_a_single_attempt_is_not_retried(attempts):
    clock = FakeClock()
    call, timeouts = failing(1)
    with pytest.raises(Unavailable):
        await retrying(call, what="x", backoff=Backoff(attempts=attempts), clock=clock)
    assert (len(timeouts), clock.sleeps) == (1, [])


@pytest.mark.parametrize("error", [
    NotFound("x: 404", 404), Conflict("x: 409", 409), BadAnswer("x: not JSON", 200),
    ValueError("a bug"),
], ids=["not-found", "conflict", "bad-answer", "not-a-kube-error"])
async def test_anything_but_transient_passes_through_untried(error):
    clock = FakeClock()
    call, timeouts = failing(1, error)
    with pytest.raises(type(error)) as raised:
        await retrying(call, what="x", backoff=Backoff(), clock=clock)
    assert raised.value is error
    assert (len(timeouts), clock.sleeps) == (1, [])


async def test_the_retry_after_of_a_failure_is_the_least_wait_before_the_next_try():
    clock = FakeClock()
    call, _ = failing(1, Transient("x: 429 TooManyRequests: slow down", 429, retry_after=3.0))
    await retrying(call, what="x", backoff=Backoff(base=0.001, cap=10.0), clock=clock)
    assert clock.sleeps == [3.0]


async def test_a_wait_never_runs_past_the_deadline():
    clock = FakeClock()
    call, timeouts = failing(99)
    deadline = Deadline(expires_at=0.25, clock=clock)
    with pytest.raises(DeadlineExceeded) as raised:
        await retrying(call, what="read pod", backoff=Backoff(attempts=50, base=0.1, jitter=0),
                       deadline=deadline, clock=clock, rng=random.Random(1))
    assert str(raised.value).startswith("read pod: the caller's deadline ran out (2 tries")
    assert clock.sleeps == [0.1]  # the next delay (0.2) would end after the deadline
    assert len(timeouts) == 2


async def test_a_retry_that_would_not_have_its_budget_after_the_wait_is_not_waited_for():
    """A try that needs `try_budget` of the deadline (a pod write: 100 ms) was retried after
    a wait that left it less: the wait was slept, only for the try to be refused after it."""
    clock = FakeClock()
    call, timeouts = failing(99)
    deadline = Deadline(expires_at=0.25, clock=clock)
    with pytest.raises(DeadlineExceeded) as raised:
        await retrying(call, what="patch pod", backoff=Backoff(attempts=50, base=0.1, jitter=0),
                       deadline=deadline, clock=clock, rng=random.Random(1), try_budget=0.2)
    assert str(raised.value) == (
        "patch pod: the caller's deadline leaves 250 ms, less than the 100 ms wait before a "
        "retry and the 200 ms a try needs: not retried (1 tries, last: 503 "
        "ServiceUnavailable: try later)")
    assert (clock.sleeps, len(timeouts)) == ([], 1)
    # With the budget there after the wait, the retry goes: 0.35 - 0.1 leaves 0.25.
    clock, (call, timeouts) = FakeClock(), failing(1)
    assert await retrying(call, what="patch pod", backoff=Backoff(base=0.1, jitter=0),
                          deadline=Deadline(expires_at=0.35, clock=clock), clock=clock,
                          try_budget=0.2) == "ok"
    assert (clock.sleeps, len(timeouts)) == ([0.1], 2)


async def test_an_expired_deadline_makes_no_call():
    clock = FakeClock()
    call, timeouts = failing(0)
    with pytest.raises(DeadlineExceeded) as raised:
        await retrying(call, what="read pod", backoff=Backoff(),
                       deadline=Deadline(expires_at=0, clock=clock), clock=clock)
    assert str(raised.value) == "read pod: the caller's deadline ran out"
    assert timeouts == []


async def test_each_try_is_given_the_request_timeout_or_the_time_left_when_nearer():
    clock = FakeClock()
    call, timeouts = failing(2)
    await retrying(call, what="x", backoff=Backoff(base=1.0, cap=1.0, jitter=0),
                   deadline=Deadline(expires_at=4.5, clock=clock), request_timeout=3.0,
                   clock=clock)
    assert timeouts == [3.0, 3.0, 2.5]


def test_a_deadline_caps_request_timeouts_and_none_is_no_deadline():
    clock = FakeClock()
    assert Deadline(clock=clock).timeout(10) == 10
    assert Deadline(clock=clock).remaining() is None and not Deadline(clock=clock).expired
    assert Deadline(expires_at=2.5, clock=clock).timeout(10) == 2.5
    assert Deadline.after(1.0, clock).expires_at == 1.0
    assert Deadline.after(None, clock).expires_at is None
    clock.now = 5
    assert Deadline(expires_at=2.5, clock=clock).expired
    assert Deadline(expires_at=2.5, clock=clock).timeout(10) == 0.001


# -- over a real Kube ---------------------------------------------------------------------------

@pytest.fixture
async def faulty_kube(faulty_api: FaultyApi) -> AsyncIterator[Kube]:
    kube = Kube(faulty_api.api_client(), request_timeout=0.2)  # FaultyApi holds for 1 s
    yield kube
    await kube.close()


def patch(kube: Kube, changes: dict[str, str], **guard: str):
    body = objects.annotation_patch(changes, **guard)

    async def call(timeout: float):
        return await kube.request("PATCH", POD_PATH, what="patch pod", body=body,
                                  content_type=MERGE_PATCH, timeout=timeout)

    return call


@pytest.mark.integration
@pytest.mark.parametrize("code", [429, 500, 503])
async def test_a_write_throttled_or_failed_once_is_retried_and_lands(kube, code):
    kube.core.create_namespaced_pod(NS, {"metadata": {"name": NAME},
                                         "spec": {"containers": [{"name": "m", "image": "i"}]}})
    kube.fail("PATCH", POD_PATH, code, times=1)
    client = Kube(kube.api_client)
    try:
        written = await retrying(patch(client, {"a": "1"}), what="patch pod", backoff=FAST)
    finally:
        await client.close()
    assert written["metadata"]["annotations"] == {"a": "1"}
    assert kube.count("PATCH", POD_PATH) == 2


@pytest.mark.integration
@pytest.mark.parametrize("fault", [Fault.RESET, Fault.TIMEOUT])
@pytest.mark.parametrize("method", ["GET", "PATCH"])
async def test_a_reset_or_unanswered_request_is_tried_again_and_succeeds(
        faulty_api, faulty_kube, method, fault):
    meta = faulty_api.add_pod(NAME, {}, namespace=NS)["metadata"]
    faulty_api.fail(method, POD_PATH, fault)

    async def get(timeout: float):
        return await faulty_kube.request("GET", POD_PATH, what="read pod", timeout=timeout)

    call = get if method == "GET" else patch(faulty_kube, {"a": "1"}, uid=meta["uid"],
                                             resource_version=meta["resourceVersion"])
    pod = await retrying(call, what="x", backoff=FAST, request_timeout=0.2)
    assert pod["metadata"]["uid"] == meta["uid"]
    stats = faulty_api.stats(NS, NAME)
    assert (stats.gets, stats.patch_requests, stats.writes) == {
        "GET": (2, 0, 0), "PATCH": (0, 2, 1)}[method]


@pytest.mark.integration
@pytest.mark.parametrize("fault", [Fault.RESET_AFTER_WRITE, Fault.TIMEOUT_AFTER_WRITE])
async def test_a_guarded_write_whose_answer_was_lost_is_never_applied_twice(
        faulty_api, faulty_kube, fault):
    """The retry carries the resourceVersion the lost write already moved past: refused."""
    meta = faulty_api.add_pod(NAME, {}, namespace=NS)["metadata"]
    faulty_api.fail("PATCH", POD_PATH, fault)
    with pytest.raises(Conflict):
        await retrying(patch(faulty_kube, {"a": "1"}, uid=meta["uid"],
                             resource_version=meta["resourceVersion"]),
                       what="patch pod", backoff=FAST, request_timeout=0.2)
    stats = faulty_api.stats(NS, NAME)
    assert (stats.patch_requests, stats.writes) == (2, 1)
    assert faulty_api.pod(NS, NAME)["metadata"]["annotations"] == {"a": "1"}


@pytest.mark.integration
async def test_the_deadline_bounds_the_wait_for_an_answer(faulty_api, faulty_kube):
    faulty_api.add_pod(NAME, {}, namespace=NS)
    faulty_api.fail("GET", POD_PATH, Fault.TIMEOUT, times=None)

    async def get(timeout: float):
        return await faulty_kube.request("GET", POD_PATH, what="read pod", timeout=timeout)

    started = time.monotonic()
    with pytest.raises((DeadlineExceeded, Unavailable)):
        await retrying(get, what="read pod", backoff=FAST, deadline=Deadline.after(0.2),
                       request_timeout=5.0)
    assert time.monotonic() - started < 0.9


@pytest.mark.integration
async def test_an_api_that_refuses_connections_is_unavailable_after_the_tries():
    clock = FakeClock()
    async with StandIn() as api:
        url = api.url
    kube = Kube(k8s.ApiClient(k8s.Configuration(host=url)))

    async def get(timeout: float):
        return await kube.request("GET", POD_PATH, what="read pod", timeout=timeout)

    try:
        with pytest.raises(Unavailable, match=r"^read pod: the Kubernetes API failed 3 "
                                              r"time\(s\), last: ClientConnectorError"):
            await retrying(get, what="read pod", backoff=FAST, clock=clock)
    finally:
        await kube.close()
    assert len(clock.sleeps) == FAST.attempts - 1


@pytest.mark.integration
@pytest.mark.parametrize(("retry_after", "delay"), [("2", 2.0), ("30", 10.0)],
                         ids=["honoured", "capped-by-the-backoff"])
async def test_a_429s_retry_after_is_the_least_wait_before_the_next_try(retry_after, delay):
    throttled = Answer(429, status(429, "TooManyRequests", "slow down"),
                       {"Retry-After": retry_after})
    clock = FakeClock()
    async with StandIn(throttled, Answer(200, {"kind": "Pod"})) as api:
        kube = Kube(k8s.ApiClient(k8s.Configuration(host=api.url)))

        async def get(timeout: float):
            return await kube.request("GET", POD_PATH, what="read pod", timeout=timeout)

        try:
            assert await retrying(get, what="read pod", clock=clock,
                                  backoff=Backoff(attempts=3, base=0.001, cap=10.0)) == {
                "kind": "Pod"}
        finally:
            await kube.close()
    assert clock.sleeps == [delay]
    assert len(api.seen) == 2
