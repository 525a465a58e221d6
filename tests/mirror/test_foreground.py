"""Calls first, the cache's work after (`mirror.foreground`): the pod cache's list work on the
serving loop waits for a gap between calls, rests between chunks while calls come, and never
starves; work in slices (`Slices`) waits only once its slice is spent. Waits are measured on
the loop's own clock, in tens of milliseconds at most."""

from __future__ import annotations

import asyncio
import time

import pytest

from kai_fractions.mirror.foreground import Foreground, Slices
from kai_fractions.mirror.pod_cache import PodCache
from kai_fractions.mirror.service import MirrorService
from tests.support.fake_store import FakePodStore

from .test_service import NS, POD, SINGLE, allocation, pod

LONG = 10.0  # a wait no test reaches


async def held_call(foreground: Foreground, release: asyncio.Event) -> None:
    with foreground.call():
        await release.wait()


async def test_with_no_call_the_cache_work_goes_after_one_quiet_turn_of_the_loop():
    foreground = Foreground(rest=LONG, max_wait=LONG)
    async with asyncio.timeout(1.0):  # neither the rest nor the wait applies
        await foreground.gap()


async def test_the_cache_work_waits_for_the_call_in_flight_to_end():
    foreground = Foreground(rest=0.02, max_wait=LONG)
    release = asyncio.Event()
    call = asyncio.create_task(held_call(foreground, release))
    await asyncio.sleep(0)
    assert foreground.in_flight == 1
    gap = asyncio.create_task(foreground.gap())
    await asyncio.sleep(0.05)  # well past the rest: the call holds the cache's work back
    assert not gap.done()
    release.set()
    await call
    assert foreground.in_flight == 0
    async with asyncio.timeout(1.0):
        await gap


async def test_while_calls_come_two_chunks_are_at_least_the_rest_apart():
    foreground = Foreground(rest=0.03, max_wait=LONG)
    with foreground.call():
        pass  # a call came and went
    began = time.perf_counter()
    await foreground.gap()
    assert time.perf_counter() - began >= 0.029  # the loop's timers may fire a hair early


async def test_under_calls_that_never_end_the_cache_work_still_runs_after_max_wait():
    foreground = Foreground(rest=0.01, max_wait=0.03)  # the rest is part of the wait
    release = asyncio.Event()
    call = asyncio.create_task(held_call(foreground, release))
    await asyncio.sleep(0)
    began = time.perf_counter()
    async with asyncio.timeout(1.0):
        await foreground.gap()
    assert foreground.in_flight == 1 and time.perf_counter() - began >= 0.029
    release.set()
    await call


async def test_a_cancelled_call_and_a_cancelled_wait_leave_nothing_behind():
    foreground = Foreground(rest=0.0, max_wait=LONG)
    call = asyncio.create_task(held_call(foreground, asyncio.Event()))
    await asyncio.sleep(0)
    gap = asyncio.create_task(foreground.gap())
    await asyncio.sleep(0.01)
    gap.cancel()  # the cache's feed stopped (a newer list, or the server's end)
    with pytest.raises(asyncio.CancelledError):
        await gap
    call.cancel()  # the caller went away
    with pytest.raises(asyncio.CancelledError):
        await call
    assert foreground.in_flight == 0
    async with asyncio.timeout(1.0):
        await foreground.gap()


async def test_a_call_that_fails_is_no_longer_in_flight():
    foreground = Foreground()
    with pytest.raises(RuntimeError), foreground.call():
        raise RuntimeError("the call failed")
    assert foreground.in_flight == 0


@pytest.mark.parametrize("cached", [True, False])
async def test_the_service_marks_each_call_in_flight_on_its_caches_foreground(cached):
    seen: list[tuple[str, int]] = []
    cache = PodCache() if cached else None
    store = FakePodStore(nodes={"node-1": {}})
    store.add_pod(pod({"gpu-fraction": "0.5"}))
    service = MirrorService(store, cache=cache)
    if cache is not None:
        assert service.foreground is cache.foreground  # the cache's list work waits on it
    store.faults.append(lambda operation, *_: seen.append((
        operation, service.foreground.in_flight)))
    result = await service.mirror(allocation())
    assert dict(result.annotations) == SINGLE
    await service.preview(allocation())
    await service.release(NS, POD)
    assert {in_flight for _, in_flight in seen} == {1}  # every API request of each call
    assert {operation for operation, _ in seen} >= {"get", "patch"}
    assert service.foreground.in_flight == 0


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_slices_wait_for_a_gap_only_once_a_slice_of_work_is_spent():
    clock = Clock()
    foreground = Foreground(rest=0.0, max_wait=LONG)
    slices = Slices(foreground, 0.5, clock)
    release = asyncio.Event()
    call = asyncio.create_task(held_call(foreground, release))
    await asyncio.sleep(0)
    clock.now = 0.4
    async with asyncio.timeout(1.0):  # within the slice: no wait, the call in flight or not
        await slices.step()
    clock.now = 0.6
    step = asyncio.create_task(slices.step())
    await asyncio.sleep(0.02)
    assert not step.done()  # the slice is spent: the call in flight goes first
    release.set()
    await call
    async with asyncio.timeout(1.0):
        await step
    clock.now = 1.0  # a new slice began after the gap
    async with asyncio.timeout(1.0):
        await slices.step()
