"""The grace before a BindRequest not Succeeded yet has its pod read lasts at most PENDING_GRACE
from the follower's first sight of it, whatever the mirror's wall clock says.

The grace compared the mirror's clock with the API server's creationTimestamp alone, so a
mirror whose clock is behind waited for as long as it is behind before the first read (the
reviewer's probe p1_pending_gaps.py (a): 600 s behind, nothing read 300 s after creation). The
age is now the larger of the clock's and the time since first sight, by the follower's own
monotonic clock (its `monotonic` seam).
"""

from __future__ import annotations

import pytest

from kai_fractions.mirror.bindrequest_view import BindRequestView
from kai_fractions.mirror.follower import PENDING_GRACE, Follower
from tests.support.fake_store import FakePodStore

from .test_follower import NS, SIGNATURE, failed_for_good, one_group_store, requests_of
from .test_follower_pending import Clock, bound_pod, signer, still_pending

BEHIND = 600.0
"""How far the mirror's wall clock is behind the API server's."""


class Monotonic:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def store() -> FakePodStore:
    return one_group_store()


def view(pod_uid: str, phase: str = "Pending", name: str = "br-1", uid: str = "br-uid-1",
         pod_name: str = "train-0") -> BindRequestView:
    br = still_pending(pod_uid, name=name, pod_name=pod_name, phase=phase)
    return BindRequestView.from_object({**br, "metadata": {**br["metadata"], "uid": uid}})


def skewed(store: FakePodStore, monotonic: Monotonic, **kw) -> Follower:
    """A follower whose wall clock reads 300 s after the BindRequests' creation, by the API
    server's clock, minus BEHIND."""
    return Follower(store, signer=signer(), now=Clock(300 - BEHIND), monotonic=monotonic, **kw)


async def test_a_clock_behind_the_api_servers_waits_the_grace_from_first_sight_only(store):
    created = store.add_pod(bound_pod("train-0"))
    reads = requests_of(store)
    monotonic = Monotonic()
    follower = skewed(store, monotonic)
    first = await follower.verify(view(created.uid))
    assert (first.waiting, reads) == (True, [])
    monotonic.now += PENDING_GRACE - 1
    assert (await follower.verify(view(created.uid))).waiting and reads == []
    monotonic.now += 1
    result = await follower.verify(view(created.uid))
    assert result.complete and result.signed == (SIGNATURE,)


async def test_a_clock_that_is_right_needs_no_first_sight(store):
    """A follower that takes over lists BindRequests long Pending: read at their first check."""
    created = store.add_pod(bound_pod("train-0"))
    follower = Follower(store, signer=signer(), now=Clock(PENDING_GRACE), monotonic=Monotonic())
    assert (await follower.verify(view(created.uid))).signed == (SIGNATURE,)


@pytest.mark.parametrize("gone", ["deleted", "Succeeded", "failed for good"])
async def test_first_sight_is_forgotten_with_the_bind_request(store, gone):
    """Deleted (`forget`), Succeeded or failed for good: seen Pending again (a BindRequest of
    that uid never is, but a relist of a stale cache may show it), the grace starts again."""
    created = store.add_pod(bound_pod("train-0", node=None))
    monotonic = Monotonic()
    follower = skewed(store, monotonic)
    assert (await follower.verify(view(created.uid))).waiting
    monotonic.now += PENDING_GRACE
    if gone == "deleted":
        follower.forget(view(created.uid))
    elif gone == "Succeeded":
        await follower.verify(view(created.uid, phase="Succeeded"))
    else:
        br = still_pending(created.uid, phase="Failed")
        await follower.verify(BindRequestView.from_object(
            failed_for_good({**br, "metadata": {**br["metadata"], "uid": "br-uid-1"}})))
    assert (await follower.verify(view(created.uid))).waiting


async def test_first_sight_is_kept_for_so_many_bind_requests_at_most(store):
    monotonic = Monotonic()
    follower = skewed(store, monotonic)
    follower.complete_kept = 2
    for i in range(3):
        created = store.add_pod(bound_pod(f"train-{i}", node=None))
        assert (await follower.verify(view(created.uid, name=f"br-{i}", uid=f"u{i}",
                                           pod_name=f"train-{i}"))).waiting
    assert len(follower._first_seen) == 2
    monotonic.now += PENDING_GRACE
    # The oldest sight went first: that BindRequest waits again; the others are read.
    oldest = store.pods[(NS, "train-0")]
    assert (await follower.verify(view(oldest["metadata"]["uid"], name="br-0", uid="u0",
                                       pod_name="train-0"))).waiting
    newest = store.pods[(NS, "train-2")]
    result = await follower.verify(view(newest["metadata"]["uid"], name="br-2", uid="u2",
                                        pod_name="train-2"))
    assert not result.waiting and result.recheck and "is not bound yet" in result.skipped
