"""A BindRequest KAI's binder carried out but left Pending: its pod is checked and signed once it
is bound to the selected node, without a read of the pod while the BindRequest is fresh.

KAI-Scheduler pkg/binder/controllers/bindrequest_controller.go: `UpdateStatus` only logs a
status patch that fails and returns nil (the request is not queued again), and
`shouldEnqueueBindRequestUpdate` queues an update only on a new generation, so a lost update to
Succeeded leaves the BindRequest Pending until the binder restarts, while its pod is bound and
annotated. pkg/binder/binding/binder.go, `Bind`: the binder patches the pod's annotations once,
then creates the binding, so a bound pod's binder keys are final. Before this fix the follower
skipped such a BindRequest at every event and list, and the node agent held the pod
(SignatureMissing) until its gate failed it (the reviewer's probe p6_bound_but_pending.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

import pytest

from kai_fractions.kube.objects import epoch_seconds
from kai_fractions.kube.retry import Backoff
from kai_fractions.mirror.bindrequest_view import BindRequestView
from kai_fractions.mirror.bindrequests import follow
from kai_fractions.mirror.follower import PENDING_GRACE, Follower
from kai_fractions.signing import Keyring
from tests.support.fake_store import FakePodStore

from .test_follower import (
    BOUND,
    NS,
    SIGNATURE,
    Keys,
    bind_request,
    one_group_store,
    owned_by,
    pod,
    requests_of,
)
from .test_follower_rechecks import QueueSource, versioned

CREATED = "2026-12-02T10:00:00Z"
FAST = Backoff(attempts=1_000_000, base=0.005, cap=0.02)


def at(seconds: float) -> float:
    """The follower's clock `seconds` after the BindRequests' creation."""
    return epoch_seconds(CREATED) + seconds


class Clock:
    def __init__(self, seconds: float) -> None:
        self.now = at(seconds)

    def __call__(self) -> float:
        return self.now


def signer() -> Keys:
    return Keys(Keyring.of(b"k" * 32))


@pytest.fixture
def store() -> FakePodStore:
    return one_group_store()


def bound_pod(name: str, node: str | None = "gpu-node-1") -> dict:
    """A pod KAI's binder annotated (and, with a `node`, bound there)."""
    obj = pod(name, {"gpu-fraction": "0.5", **BOUND})
    if node:
        obj["spec"]["nodeName"] = node
    obj["status"] = {"phase": "Pending", "conditions": [
        {"type": "PodBound", "status": "True", "reason": "Bound"}]}
    return obj


def still_pending(pod_uid: str, name: str = "br-1", pod_name: str = "train-0",
                  phase: str = "Pending", rv: str = "2") -> dict:
    """A BindRequest as KAI's scheduler created it (owned by its pod), never marked Succeeded."""
    br = owned_by(bind_request(name, pod_name, phase=phase), pod_uid)
    br["metadata"]["creationTimestamp"] = CREATED
    return versioned(br, rv)


def signing_patches(store: FakePodStore) -> list:
    return [p for p in store.patches if SIGNATURE in p[2]]


@pytest.mark.parametrize("phase", ["Pending", ""])
async def test_a_bound_pod_whose_bind_request_stayed_pending_is_checked_and_signed(
        store, phase, caplog):
    created = store.add_pod(bound_pod("train-0"))
    follower = Follower(store, signer=signer(), now=Clock(PENDING_GRACE))
    view = BindRequestView.from_object(still_pending(created.uid, phase=phase))
    with caplog.at_level(logging.INFO, logger="kai_fractions.mirror.follower"):
        result = await follower.follow_one(view)
        assert result is not None and result.complete and result.signed == (SIGNATURE,)
        assert await follower.follow_one(view) is None  # complete: a list replays nothing
        assert (await follower.verify(view)).complete  # checked again: the same, unsigned
    assert store.events == [] and len(signing_patches(store)) == 1
    said = [r.getMessage() for r in caplog.records if "still Pending" in r.getMessage()]
    assert said == [f"BindRequest {NS}/br-1 (created {CREATED}) still Pending, its pod "
                    f"{NS}/train-0 bound to gpu-node-1: checked anyway (KAI's binder binds a "
                    "pod only after writing its annotations; its update of the BindRequest's "
                    "status was lost or is late)"]


async def test_a_fresh_pending_bind_request_reads_nothing_and_is_checked_again(store):
    created = store.add_pod(bound_pod("train-0"))
    requests = requests_of(store)
    follower = Follower(store, signer=signer(), now=Clock(PENDING_GRACE - 1))
    result = await follower.follow_one(BindRequestView.from_object(still_pending(created.uid)))
    assert result is not None and result.skipped == "phase Pending" and result.recheck
    assert requests == [] and store.lists == []


@pytest.mark.parametrize(("node", "skipped", "recheck"), [
    (None, f"phase Pending: pod {NS}/train-0 is not bound yet", True),
    ("gpu-node-2", f"phase Pending: pod {NS}/train-0 is bound to node gpu-node-2, not to the "
                   "node the BindRequest selected (gpu-node-1)", False),
])
async def test_a_pending_bind_request_whose_pod_is_not_bound_there_is_not_signed(
        store, node, skipped, recheck):
    created = store.add_pod(bound_pod("train-0", node))
    follower = Follower(store, signer=signer(), now=Clock(PENDING_GRACE + 5))
    result = await follower.verify(BindRequestView.from_object(still_pending(created.uid)))
    assert (result.skipped, result.recheck, result.signed) == (skipped, recheck, ())
    assert store.patches == []
    # Not bound yet: the usual moment of a bind, no event. Bound by something else than KAI's
    # binder: the node agent holds it unsigned, so its event says why.
    assert [e.message for e in store.events] == ([] if node is None else [
        f"not signed: its BindRequest {NS}/br-1 is still Pending and the pod is bound to node "
        "gpu-node-2, not to the node KAI selected (gpu-node-1): something other than KAI's "
        "binder bound it"])


@pytest.mark.parametrize("status", [{"failedAttempts": 3}, {"failedAttempts": 4}])
async def test_a_bind_request_failed_for_good_is_not_read(store, status):
    """No attempts left (KAI's binder gave up): tests/mirror/test_follower_failed_retries.py
    has those with attempts left, and one without a backoffLimit."""
    created = store.add_pod(bound_pod("train-0"))
    requests = requests_of(store)
    follower = Follower(store, signer=signer(), now=Clock(3600))
    failed = still_pending(created.uid, phase="Failed")  # backoffLimit 3
    failed["status"].update(status)
    result = await follower.verify(BindRequestView.from_object(failed))
    assert (result.skipped, result.recheck, requests) == ("phase Failed", False, [])


async def test_a_pending_bind_request_of_another_pod_of_that_name_is_not_signed(store):
    store.add_pod(bound_pod("train-0"))
    follower = Follower(store, signer=signer(), now=Clock(3600))
    result = await follower.verify(BindRequestView.from_object(still_pending("another-uid")))
    assert "is not the pod BindRequest" in result.skipped and not result.recheck
    assert store.patches == []


async def test_the_follow_loop_signs_it_without_a_succeeded_event_nor_a_list(store):
    """The probe's situation end to end: listed Pending long after its creation (a follower
    that took over), the pod bound: signed by the first check. The Succeeded event that comes
    when KAI's binder restarts is checked again, and finds the signature there: one patch."""
    created = store.add_pod(bound_pod("train-0"))
    source = QueueSource(listed=[still_pending(created.uid)])
    follower = Follower(store, signer=signer(), now=Clock(600))
    following = Following(source, follower)
    await following.until(lambda: SIGNATURE in store.annotations(NS, "train-0"))
    succeeded = still_pending(created.uid, phase="Succeeded", rv="3")
    source.events.put_nowait(("MODIFIED", succeeded))
    await following.until(lambda: following.count("br-1") == 2)
    await following.stop()
    assert following.results == [(True, (SIGNATURE,)), (True, ())]
    assert len(signing_patches(store)) == 1 and source.lists == 1 and store.events == []


async def test_a_fresh_pending_one_is_checked_again_reading_the_pod_only_after_the_grace(store):
    """While fresh: rechecked with the backoff, no read. After PENDING_GRACE, not bound yet:
    read and rechecked. Once bound: signed, and the rechecks stop."""
    created = store.add_pod(bound_pod("train-0", node=None))
    reads = requests_of(store)
    clock = Clock(0)
    source = QueueSource(listed=[still_pending(created.uid)])
    following = Following(source, Follower(store, signer=signer(), now=clock),
                          recheck_backoff=FAST)
    await following.until(lambda: following.count("br-1") >= 4)
    assert reads == []
    clock.now = at(PENDING_GRACE)
    await following.until(lambda: reads.count("get") >= 3)
    assert signing_patches(store) == []
    store.pods[(NS, "train-0")]["spec"]["nodeName"] = "gpu-node-1"  # KAI's binder binds it
    await following.until(lambda: SIGNATURE in store.annotations(NS, "train-0"))
    handled = following.count("br-1")
    await following.settle()
    await following.stop()
    assert following.count("br-1") == handled and len(signing_patches(store)) == 1


async def test_succeeded_arriving_while_pending_is_rechecked_is_signed_once(store):
    """The usual bind: Pending, then Succeeded a moment later. The fresh Pending version is
    not read; the Succeeded version is checked and signed, once."""
    created = store.add_pod(bound_pod("train-0"))
    source = QueueSource()
    following = Following(source, Follower(store, signer=signer(), now=Clock(1)),
                          recheck_backoff=Backoff(attempts=1_000_000, base=60.0, cap=60.0))
    source.events.put_nowait(("ADDED", still_pending(created.uid, rv="2")))
    await following.until(lambda: following.count("br-1") == 1)
    source.events.put_nowait(("MODIFIED", still_pending(created.uid, phase="Succeeded",
                                                        rv="3")))
    await following.until(lambda: SIGNATURE in store.annotations(NS, "train-0"))
    await following.settle()
    await following.stop()
    assert following.versions == ["2", "3"] and len(signing_patches(store)) == 1


def test_the_docs_name_the_grace():
    doc = " ".join((Path(__file__).resolve().parents[2] / "docs" / "mirror.md").read_text()
                   .split())
    assert (f"From {PENDING_GRACE:g} s after its `creationTimestamp` or after this follower "
            "first saw it") in doc
    assert f"attempts left) {PENDING_GRACE:g} s after it was created or first seen" in doc


class Following:
    """`follow` over `source`, its handle the follower's `follow_one` as the mirror wires it,
    recording each handling's BindRequest and version, and each result (complete, signed)."""

    def __init__(self, source: QueueSource, follower: Follower, **options) -> None:
        self.source = source
        self.handled: list[str] = []
        self.versions: list[str] = []
        self.results: list[tuple[bool, tuple[str, ...]]] = []

        async def handle(br: BindRequestView):
            self.handled.append(br.name)
            self.versions.append(br.resource_version)
            result = await follower.follow_one(br)
            if result is not None:
                self.results.append((result.complete, result.signed))
            return result

        self.task = asyncio.create_task(follow(source, handle, forget=follower.forget,
                                               concurrency=2,
                                               backoff=Backoff(base=0.001, cap=0.001),
                                               **options))

    def count(self, name: str) -> int:
        return self.handled.count(name)

    async def until(self, predicate: Callable[[], bool]) -> None:
        async with asyncio.timeout(10):
            while not predicate():
                assert not self.task.done(), self.task.exception()
                await asyncio.sleep(0.002)

    async def settle(self) -> None:
        """Time for several rechecks at FAST's pace, should any be left."""
        await asyncio.sleep(0.2)

    async def stop(self) -> None:
        self.task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await self.task
