"""The follower holds and hands to its check only fractional BindRequests: every other one is
dropped as its list page or watch event is decoded.

KAI's scheduler creates a BindRequest for EVERY pod it binds (KAI-Scheduler
pkg/scheduler/cache/cache.go, `Bind` -> `createBindRequest`), `Regular` for CPU-only and
whole-GPU pods (pkg/scheduler/api/node_info/node_info.go, `setAcceptedResources`), and keeps it
for as long as the pod lives (`cleanStaleBindRequest` deletes only failed ones). Held as views,
250,000 such pods at 5,000 nodes took some 220 MB more on the Lease holder, past the chart's
512Mi (the reviewer's probe p5_nonfraction_memory.py: 887 B per Regular view, and all of them
handed to the check). Counted here, not measured: what the list returns and the loop holds.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from kai_fractions.kube.retry import Backoff
from kai_fractions.mirror.bindrequest_view import BindRequestView, fractional_view
from kai_fractions.mirror.bindrequests import _InFlight, _Replay, bindrequest_source, follow
from kai_fractions.mirror.follower import Follower
from kai_fractions.mirror.rechecks import RECHECK_BACKOFF
from kai_fractions.signing import Keyring
from tests.support.fake_store import FakePodStore

from .test_follower import (
    BOUND,
    NS,
    SIGNATURE,
    Keys,
    bind_request,
    one_group_store,
    pod,
)
from .test_follower_rechecks import QueueSource, versioned

REGULAR = 1_200
FRACTIONAL = 5


def regular(i: int) -> dict[str, Any]:
    """A BindRequest of a CPU-only pod, as KAI's scheduler creates it."""
    name = f"cpu-job-worker-{i:06d}"
    return {"apiVersion": "scheduling.run.ai/v1alpha2", "kind": "BindRequest",
            "metadata": {"name": name, "namespace": "team-cpu", "uid": f"uid-r{i}",
                         "resourceVersion": str(1000 + i),
                         "creationTimestamp": "2026-01-01T00:00:00Z",
                         "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": name,
                                              "uid": f"pod-uid-r{i}"}]},
            "spec": {"podName": name, "selectedNode": f"cpu-node-{i % 50}",
                     "receivedResourceType": "Regular", "receivedGPU": {"portion": "0.00"}},
            "status": {"phase": "Succeeded"}}


def fractional(i: int) -> dict[str, Any]:
    return versioned(bind_request(f"frac-{i}", f"train-{i}"), str(5000 + i), uid=f"uid-f{i}")


def mixed() -> list[dict[str, Any]]:
    """Many Regular BindRequests with a few fractional ones among them."""
    items = [regular(i) for i in range(REGULAR)]
    for i in range(FRACTIONAL):
        items.insert(i * (REGULAR // FRACTIONAL), fractional(i))
    return items


class PagedKube:
    """The one call a Collection's list makes (`Kube.read`), answering `items` in pages as the
    API server does (limit, continue)."""

    def __init__(self, items: list[dict[str, Any]]) -> None:
        self.items = items
        self.pages = 0

    async def read(self, method: str, path: str, *, what: str, query=None, timeout=None,
                   **_: Any) -> bytes:
        assert method == "GET" and path == "/apis/scheduling.run.ai/v1alpha2/bindrequests"
        start = int(query.get("continue") or 0)
        end = start + int(query["limit"])
        more = end < len(self.items)
        self.pages += 1
        return json.dumps({"kind": "BindRequestList", "metadata": {
            "resourceVersion": "9000", **({"continue": str(end)} if more else {})},
            "items": self.items[start:end]}).encode()


async def test_a_list_holds_only_the_fractional_bind_requests():
    kube = PagedKube(mixed())
    items, version = await bindrequest_source(kube).list()  # type: ignore[arg-type]
    assert kube.pages == 3 and version == "9000"  # 1,205 in pages of 500
    assert all(isinstance(item, BindRequestView) for item in items)
    assert sorted(item.name for item in items) == [f"frac-{i}" for i in range(FRACTIONAL)]


def test_only_a_fraction_gets_a_view():
    assert fractional_view(regular(1)) is None
    assert fractional_view({"spec": {"receivedResourceType": "Fraction"}}) is not None
    for other in ({}, {"spec": "Fraction"}, {"spec": {"receivedResourceType": "fraction"}},
                  {"spec": {}}):
        assert fractional_view(other) is None


async def test_the_replay_holds_and_hands_over_only_the_fractional_ones():
    handed: list[str] = []

    async def handle(br: BindRequestView) -> None:
        handed.append(br.name)

    replay = _Replay(_InFlight(handle, 8), RECHECK_BACKOFF)
    try:
        replay.restart(mixed())  # as any source's list, objects not views
        assert len(replay.pending) == FRACTIONAL and len(replay.newest) == FRACTIONAL
        async with asyncio.timeout(10):
            while len(handed) < FRACTIONAL:
                await asyncio.sleep(0.002)
        await asyncio.sleep(0.05)
        assert sorted(handed) == [f"frac-{i}" for i in range(FRACTIONAL)]
    finally:
        replay.rechecks.close()
        if replay.task is not None:
            replay.task.cancel()
            await asyncio.gather(replay.task, return_exceptions=True)


@pytest.fixture
def store() -> FakePodStore:
    return one_group_store()


async def test_the_follow_loop_checks_only_fractional_ones_listed_or_watched(store):
    for i in range(FRACTIONAL):
        store.add_pod(pod(f"train-{i}", {"gpu-fraction": "0.5", **BOUND}))
    source = QueueSource(listed=mixed())
    follower = Follower(store, signer=Keys(Keyring.of(b"k" * 32)))
    handed: list[str] = []
    forgotten: list[str] = []

    async def handle(br: BindRequestView):
        handed.append(br.name)
        return await follower.follow_one(br)

    def forget(br: BindRequestView) -> None:
        forgotten.append(br.name)
        follower.forget(br)

    task = asyncio.create_task(follow(source, handle, forget=forget, concurrency=2,
                                      backoff=Backoff(base=0.001, cap=0.001)))
    try:
        async with asyncio.timeout(10):
            while len(handed) < FRACTIONAL:
                await asyncio.sleep(0.002)
            for i in range(3):
                source.events.put_nowait(("ADDED", regular(REGULAR + i)))
            source.events.put_nowait(("ADDED", fractional(FRACTIONAL)))
            while len(handed) < FRACTIONAL + 1:
                await asyncio.sleep(0.002)
        await asyncio.sleep(0.05)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert sorted(handed) == [f"frac-{i}" for i in range(FRACTIONAL + 1)]
    assert all(SIGNATURE in store.annotations(NS, f"train-{i}") for i in range(FRACTIONAL))
    assert len(follower._complete) == FRACTIONAL  # train-5 has no pod: not complete
    # A Regular event is forgotten as it comes: nothing is held of it, so nothing to drop.
    assert forgotten == [f"cpu-job-worker-{REGULAR + i:06d}" for i in range(3)]


async def test_a_bind_request_no_longer_fractional_is_forgotten(store):
    """KAI does not change a BindRequest's type after creating it; were it changed, what the
    follower holds of it (its complete check, a recheck) must go as for a deleted one."""
    store.add_pod(pod("train-0", {"gpu-fraction": "0.5", **BOUND}))
    store.add_pod(pod("train-1", {"gpu-fraction": "0.5", **BOUND}))
    complete = fractional(0)
    stuck = versioned(bind_request("frac-1", "train-1", groups=("group-gone",)), "7",
                      uid="uid-f1")  # its GPU never known: rechecked
    source = QueueSource(listed=[complete, stuck])
    follower = Follower(store, signer=Keys(Keyring.of(b"k" * 32)))
    handed: list[str] = []

    async def handle(br: BindRequestView):
        handed.append(br.name)
        return await follower.follow_one(br)

    task = asyncio.create_task(follow(
        source, handle, forget=follower.forget, concurrency=2,
        backoff=Backoff(base=0.001, cap=0.001),
        recheck_backoff=Backoff(attempts=1_000_000, base=0.005, cap=0.01)))
    try:
        async with asyncio.timeout(10):
            while handed.count("frac-1") < 3 or "uid-f0" not in follower._complete:
                await asyncio.sleep(0.002)
            for obj, rv in ((complete, "8"), (stuck, "9")):
                regular_now = versioned({**obj, "spec": {**obj["spec"],
                                                         "receivedResourceType": "Regular"}},
                                        rv, uid=obj["metadata"]["uid"])
                source.events.put_nowait(("MODIFIED", regular_now))
            while not source.events.empty():
                await asyncio.sleep(0.002)
        await asyncio.sleep(0.05)  # a check of frac-1 under way when its event came may end
        checks = len(handed)
        await asyncio.sleep(0.2)  # many backoffs
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert len(handed) == checks  # no recheck of frac-1 is left
    assert follower._complete == {} and follower._read_consistently == {}
