"""KubePodStore over a scripted Kube: what a request's answer means to the mirror."""

from __future__ import annotations

import json
import random

import grpc
import pytest

from kai_fractions.kube import errors as kerr
from kai_fractions.kube.retry import Backoff, Deadline
from kai_fractions.mirror.errors import ApiRejected, ApiUnavailable, DeadlineExceeded
from kai_fractions.mirror.grpc.status import to_status
from kai_fractions.mirror.kube_store import MAY_HAVE_LANDED, MIN_WRITE_BUDGET, KubePodStore
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
    with pytest.raises(DeadlineExceeded) as e:
        await patch_within(store, clock, 0.35)  # 50 ms left after the first one's 503
    assert "nothing written" not in str(e.value)  # a PATCH went out: it may have landed
    assert len(kube.timeouts) == 1 and clock.sleeps == []
    kube.timeouts.clear()
    await patch_within(store, clock, 0.5)  # 200 ms left: the retry goes and lands
    assert len(kube.timeouts) == 2


class LandsThenTimesOut:
    """An API server that applies every PATCH, its answer lost (a timeout at this end)."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock, self.applied = clock, []

    async def request(self, method, path, *, what, body=None, timeout=None, **_):
        self.applied.append(json.loads(body)["metadata"]["annotations"])
        self.clock.now += timeout
        raise kerr.unreachable(what, TimeoutError())

    async def close(self) -> None:
        pass


async def test_a_retry_refused_for_its_budget_says_the_first_write_may_have_landed():
    """The first PATCH landed and its answer timed out; the retry was refused for the 100 ms
    budget, after sleeping its backoff, with "not sent, nothing written": a caller told so
    abandons the decision while the pod carries it. It is refused before any wait, and says
    that the write may have landed, with the first try's error; still DEADLINE_EXCEEDED."""
    clock = FakeClock()
    kube = LandsThenTimesOut(clock)
    store = KubePodStore(kube, backoff=Backoff(attempts=5, base=0.1), clock=clock,
                         rng=random.Random(0), request_timeout=0.25)
    with pytest.raises(DeadlineExceeded) as e:
        await patch_within(store, clock, 0.4)  # 150 ms left after the first try's 250 ms
    assert str(e.value).startswith(
        "patch pod ns/p: the caller's deadline leaves 150 ms, less than the ")
    assert "the 100 ms a try needs: not retried (1 tries, last: no answer in time); the " \
        "write tried before may have landed" in str(e.value)
    assert "nothing written" not in str(e.value)
    assert kube.applied == [{"a": "1"}] and clock.sleeps == []
    assert to_status(e.value).code == grpc.StatusCode.DEADLINE_EXCEEDED


class LateClock(FakeClock):
    """A wait that runs `late` seconds past what was asked (a busy event loop)."""

    late = 0.0

    async def asleep(self, seconds: float) -> None:
        self.sleep(seconds + self.late)


async def test_a_retry_whose_wait_ran_late_is_not_sent_and_says_the_first_may_have_landed():
    clock = LateClock()
    clock.late = 0.21
    kube = PatchKube(clock, takes=0.05, failures=1)
    store = KubePodStore(kube, backoff=Backoff(attempts=5, base=0.05, jitter=0), clock=clock,
                         rng=random.Random(0))
    with pytest.raises(DeadlineExceeded) as e:
        await patch_within(store, clock, 0.4)  # 350 ms left, then a 260 ms wait: 90 ms
    assert str(e.value).startswith(
        "patch pod ns/p: the caller's deadline leaves 90 ms, less than the 100 ms a write "
        "needs: the retry not sent (1 tries, last: 503 ServiceUnavailable: later); the write "
        "tried before may have landed")
    assert len(kube.timeouts) == 1


async def test_a_write_that_kept_failing_is_unavailable_and_says_it_may_have_landed():
    clock = FakeClock()
    kube = PatchKube(clock, failures=99)
    with pytest.raises(ApiUnavailable) as e:
        await store_over(kube, clock).patch_annotations("ns", "p", {"a": "1"}, uid="u",
                                                        resource_version="3")
    assert str(e.value).startswith("patch pod ns/p: the Kubernetes API failed 3 time(s)")
    assert str(e.value).endswith(MAY_HAVE_LANDED)
    assert to_status(e.value).code == grpc.StatusCode.UNAVAILABLE


class KaiWebhookKube:
    """Refuses every pod PATCH as upstream KAI's NvFractions webhook refuses a write of the
    binder-owned `.gpus.devices` by any other identity (tests/mirror/test_kai_webhook_identity.py
    replays that rule)."""

    async def request(self, method, path, *, what, **_):
        # The API server answers a webhook's denial 403 unless the webhook names a code.
        raise kerr.refused(what, 403, "Forbidden", json.dumps({
            "message": "admission webhook denied the request: .gpus.devices annotations may "
                       "only be modified by system:serviceaccount:kai-scheduler:binder"}))

    async def close(self) -> None:
        pass


@pytest.mark.parametrize("write_as", ["", "system:serviceaccount:kai-scheduler:binder"])
async def test_kais_binder_only_refusal_says_to_write_as_the_binder_unless_it_does(write_as):
    store = KubePodStore(KaiWebhookKube(), backoff=Backoff(attempts=1, base=0.001),
                         clock=FakeClock(), rng=random.Random(0), write_as=write_as)
    with pytest.raises(ApiRejected) as e:
        await store.patch_annotations("ns", "p", {"a": "1"}, uid="u", resource_version="3")
    assert ("mirror.writeAsBinder: true" in str(e.value)) == (not write_as)
