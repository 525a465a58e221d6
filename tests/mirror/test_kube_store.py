"""KubePodStore over a scripted Kube: what a request's answer means to the mirror."""

from __future__ import annotations

import json
import random

import pytest

from kai_fractions.kube import errors as kerr
from kai_fractions.kube.retry import Backoff, Deadline
from kai_fractions.mirror.errors import DeadlineExceeded
from kai_fractions.mirror.kube_store import MIN_WRITE_BUDGET, KubePodStore
from kai_fractions.mirror.store import PodSnapshot
from tests.support.clock import FakeClock


class EventsKube:
    """Stores POSTed events by name as an API server does (409 AlreadyExists for a name it
    has); the answer to the first POST is lost after it landed."""

    def __init__(self) -> None:
        self.events: dict[str, dict] = {}
        self.posts = 0

    async def request(self, method, path, *, what, body=None, timeout=None, **_):
        self.posts += 1
        name = body["metadata"]["name"]
        if name in self.events:
            raise kerr.refused(what, 409, "Conflict", b'{"reason":"AlreadyExists"}')
        self.events[name] = body
        if self.posts == 1:
            raise kerr.unreachable(what, TimeoutError())
        return body

    async def close(self) -> None:
        pass


def store_over(kube, clock: FakeClock | None = None) -> KubePodStore:
    return KubePodStore(kube, backoff=Backoff(attempts=3, base=0.001),
                        clock=clock or FakeClock(), rng=random.Random(0))


POD = PodSnapshot.from_object({"metadata": {"name": "p", "namespace": "ns", "uid": "u",
                                            "resourceVersion": "3"}})


async def test_an_event_whose_answer_was_lost_is_recorded_once_and_not_an_error():
    kube = EventsKube()
    await store_over(kube).emit_event(POD, "Warning", "Unsigned", "not signed")
    assert (len(kube.events), kube.posts) == (1, 2)  # the retry met it: 409, success


class NodeKube:
    async def request(self, method, path, *, what, timeout=None, **_):
        assert (method, path) == ("GET", "/api/v1/nodes/node-1")
        return {"metadata": {"name": "node-1", "uid": "node-uid-1",
                             "labels": {"nvidia.com/gpu.memory": 40960}}}

    async def close(self) -> None:
        pass


async def test_a_nodes_labels_come_with_its_uid():
    labels = await store_over(NodeKube()).node_labels("node-1")
    assert labels == {"nvidia.com/gpu.memory": "40960"} and labels.uid == "node-uid-1"


class PatchKube:
    """Answers each PATCH after `takes` seconds of the fake clock, the first `failures` of them
    with a 503; records the timeout each was sent with."""

    def __init__(self, clock: FakeClock, *, takes: float = 0.0, failures: int = 0) -> None:
        self.clock, self.takes, self.failures = clock, takes, failures
        self.timeouts: list[float] = []

    async def request(self, method, path, *, what, body=None, timeout=None, **_):
        assert method == "PATCH"
        self.timeouts.append(timeout)
        self.clock.now += self.takes
        if len(self.timeouts) <= self.failures:
            raise kerr.refused(what, 503, "ServiceUnavailable", b'{"message": "later"}')
        sent = json.loads(body)["metadata"]["annotations"]  # the body goes as JSON bytes
        return {"metadata": {**POD.metadata, "annotations": sent}}

    async def close(self) -> None:
        pass


async def patch_within(store: KubePodStore, clock: FakeClock, seconds: float) -> PodSnapshot:
    return await store.patch_annotations(
        "ns", "p", {"a": "1"}, uid="u", resource_version="3",
        deadline=Deadline(expires_at=clock.now + seconds, clock=clock))


async def test_a_write_is_not_sent_with_less_of_the_deadline_left_than_it_needs():
    """Sent with 1 ms to go, a PATCH timed out here while the API server applied it: the
    caller heard DEADLINE_EXCEEDED for a write that landed. Now it is not sent at all."""
    clock = FakeClock()
    kube = PatchKube(clock)
    store = store_over(kube, clock)
    with pytest.raises(DeadlineExceeded) as e:
        await patch_within(store, clock, MIN_WRITE_BUDGET - 0.001)
    assert str(e.value) == ("patch pod ns/p: the caller's deadline leaves 99 ms, less than the "
                            "100 ms a write needs: not sent, nothing written")
    assert kube.timeouts == []
    written = await patch_within(store, clock, MIN_WRITE_BUDGET)
    assert written.annotations == {"a": "1"} and kube.timeouts == [MIN_WRITE_BUDGET]
    await store.patch_annotations("ns", "p", {"a": "1"}, uid="u", resource_version="3")
    assert kube.timeouts[-1] == store.request_timeout  # no deadline: no minimum either


async def test_a_write_retried_after_a_failure_needs_the_same_budget():
    clock = FakeClock()
    kube = PatchKube(clock, takes=0.3, failures=1)
    store = store_over(kube, clock)
    with pytest.raises(DeadlineExceeded, match="not sent, nothing written"):
        await patch_within(store, clock, 0.35)  # 50 ms left after the first one's 503
    assert len(kube.timeouts) == 1
    kube.timeouts.clear()
    await patch_within(store, clock, 0.5)  # 200 ms left: the retry goes and lands
    assert len(kube.timeouts) == 2
