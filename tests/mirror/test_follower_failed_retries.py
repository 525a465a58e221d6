"""A BindRequest left Failed while KAI's binder still has attempts left is followed as a Pending
one: a retry that bound the pod may have lost its update to Succeeded.

KAI-Scheduler pkg/binder/controllers/bindrequest_controller.go: `UpdateStatus` marks an attempt
that erred `Failed` and, while `spec.backoffLimit` is above `status.failedAttempts`, counts it
and queues the BindRequest again after a backoff (`isActionableBindRequest` takes a Failed one
only then); a retry that binds the pod patches Failed -> Succeeded, and a patch that fails is
only logged. KAI's scheduler keeps such a BindRequest (pkg/scheduler/api/bindrequest_info,
`IsFailed`: Failed with no backoffLimit, or failedAttempts at or past it) and deletes only the
failed ones (pkg/scheduler/cache/cache.go, `cleanStaleBindRequest`). The fields and their
absence (a nil `*int32`, an omitted `int32`): pkg/apis/scheduling/v1alpha2/bindrequest_types.go
(kai-scheduler/api scheduling/v1alpha2/bindrequest_types.go). Before this, the follower skipped
every Failed BindRequest, and such a pod waited unsigned in its gate until it failed (the
reviewer's probe p1_pending_gaps.py (b)).
"""

from __future__ import annotations

import pytest

from kai_fractions.mirror.bindrequest_view import BindRequestView
from kai_fractions.mirror.follower import PENDING_GRACE, Follower
from tests.support.fake_store import FakePodStore

from .test_follower import NS, SIGNATURE, one_group_store, requests_of
from .test_follower_pending import Clock, bound_pod, signer, signing_patches, still_pending

RETRYING = "phase Failed (1 of 3 bind attempts failed; KAI's binder tries again)"


@pytest.fixture
def store() -> FakePodStore:
    return one_group_store()


def failed(pod_uid: str, status: dict | None = None, **spec) -> BindRequestView:
    """A BindRequest (backoffLimit 3 unless `spec` says otherwise) left Failed."""
    br = still_pending(pod_uid, phase="Failed")
    br["spec"].update(spec)
    br["status"].update({"failedAttempts": 1, "reason": "timeout"} if status is None
                        else status)
    br["spec"] = {key: value for key, value in br["spec"].items() if value is not None}
    return BindRequestView.from_object(br)


@pytest.mark.parametrize(("spec", "status", "limit", "attempts", "retrying"), [
    ({"backoffLimit": 3}, {"phase": "Failed", "failedAttempts": 2}, 3, 2, True),
    ({"backoffLimit": 3}, {"phase": "Failed", "failedAttempts": 3}, 3, 3, False),
    ({"backoffLimit": 3}, {"phase": "Failed"}, 3, 0, True),  # failedAttempts omitted: 0
    ({}, {"phase": "Failed"}, None, 0, False),  # no backoffLimit: the binder does not retry
    ({"backoffLimit": 0}, {"phase": "Failed"}, 0, 0, False),
    ({"backoffLimit": 3}, {"phase": "Pending", "failedAttempts": 1}, 3, 1, False),
    ({"backoffLimit": "3"}, {"phase": "Failed", "failedAttempts": True}, None, 0, False),
])
def test_the_view_reads_the_limit_and_the_attempts_as_kai_does(spec, status, limit, attempts,
                                                              retrying):
    view = BindRequestView.from_object({"metadata": {"name": "br"}, "spec": spec,
                                        "status": status})
    assert (view.backoff_limit, view.failed_attempts, view.retrying) == \
        (limit, attempts, retrying)


async def test_a_failed_one_with_attempts_left_whose_pod_is_bound_there_is_signed(store):
    created = store.add_pod(bound_pod("train-0"))
    follower = Follower(store, signer=signer(), now=Clock(3600))
    result = await follower.verify(failed(created.uid))
    assert result.complete and result.signed == (SIGNATURE,)
    assert store.events == [] and len(signing_patches(store)) == 1


async def test_a_failed_one_with_attempts_left_whose_pod_is_not_bound_is_checked_again(store):
    created = store.add_pod(bound_pod("train-0", node=None))
    follower = Follower(store, signer=signer(), now=Clock(3600))
    result = await follower.verify(failed(created.uid))
    assert (result.skipped, result.recheck) == \
        (f"{RETRYING}: pod {NS}/train-0 is not bound yet", True)
    assert store.patches == [] and store.events == []


async def test_a_fresh_failed_one_with_attempts_left_waits_without_a_read(store):
    created = store.add_pod(bound_pod("train-0"))
    reads = requests_of(store)
    follower = Follower(store, signer=signer(), now=Clock(PENDING_GRACE - 1))
    result = await follower.verify(failed(created.uid))
    assert (result.skipped, result.recheck, result.waiting, reads) == (RETRYING, True, True, [])


async def test_one_bound_to_another_node_is_reported_naming_its_attempts(store):
    created = store.add_pod(bound_pod("train-0", node="gpu-node-2"))
    follower = Follower(store, signer=signer(), now=Clock(3600))
    result = await follower.verify(failed(created.uid))
    assert not result.recheck and store.patches == []
    assert [e.message for e in store.events] == [
        f"not signed: its BindRequest {NS}/br-1 is still Failed (1 of 3 bind attempts failed; "
        "KAI's binder tries again) and the pod is bound to node gpu-node-2, not to the node KAI "
        "selected (gpu-node-1): something other than KAI's binder bound it"]


@pytest.mark.parametrize(("spec", "status"), [
    ({"backoffLimit": 3}, {"failedAttempts": 3}),  # the last attempt failed: rolled back
    ({"backoffLimit": None}, {}),  # no backoffLimit: failed for good at its first error
])
async def test_one_failed_for_good_is_not_read(store, spec, status):
    created = store.add_pod(bound_pod("train-0"))
    reads = requests_of(store)
    follower = Follower(store, signer=signer(), now=Clock(3600))
    result = await follower.verify(failed(created.uid, status, **spec))
    assert (result.skipped, result.recheck, reads) == ("phase Failed", False, [])
