"""Transport-level API faults during MirrorAllocation that kmock cannot produce (timeouts,
connection resets, and a write that lands while its answer is lost), counted per pod at the API
server: PATCH requests received and writes applied. Extends tests/mirror/test_faults.py (HTTP
409/429/5xx answers, API down, deleted and recreated pods), which it does not repeat."""

from __future__ import annotations

import grpc
import pytest

from kai_fractions.mirror.record import MIRRORED_ANNOTATION
from kai_fractions.signing import Keyring
from tests.mirror.messages import allocation, mirror_request
from tests.security.allocations import plans_of
from tests.support.faults_api import Fault, PodStats

from .mirror_rig import SIGNING_KEY, mirror_over

pytestmark = [pytest.mark.faults, pytest.mark.integration]

NS, NAME = "team-a", "train-0"
POD = f"/api/v1/namespaces/{NS}/pods/{NAME}"
SIG = "kai-fractions.io/container.trainer.signature"


def assert_mirrored_once(api, stats: PodStats) -> None:
    obj = api.pod(NS, NAME)
    annotations = obj["metadata"]["annotations"]
    assert MIRRORED_ANNOTATION in annotations
    assert annotations["nvidia.com/container.trainer.gpu-memory.request"] == "20Gi"
    (plan,) = plans_of(obj)
    assert Keyring.of(SIGNING_KEY).verify(plan, annotations[SIG]).ok
    assert api.stats(NS, NAME) == stats


@pytest.mark.parametrize(("method", "fault"), [
    ("GET", Fault.TIMEOUT), ("GET", Fault.RESET), ("PATCH", Fault.TIMEOUT),
    ("PATCH", Fault.RESET), ("PATCH", Fault.THROTTLE),
])
def test_a_lost_request_is_retried_and_written_once(faulty_api, method, fault):
    pod = faulty_api.add_pod(NAME, {"gpu-fraction": "0.5"})
    rule = faulty_api.fail(method, POD, fault)
    with mirror_over(faulty_api) as rig:
        reply = rig.stub.MirrorAllocation(mirror_request(allocation(pod)), timeout=10)
    assert reply.changed and rule.hits == 1
    patches = 2 if method == "PATCH" else 1
    assert_mirrored_once(faulty_api, PodStats(gets=1 + (method == "GET"),
                                              patch_requests=patches, writes=1))


@pytest.mark.parametrize("fault", [Fault.TIMEOUT_AFTER_WRITE, Fault.RESET_AFTER_WRITE])
def test_a_write_whose_answer_is_lost_is_not_written_twice(faulty_api, fault):
    """The patch landed but the mirror never heard: its retry carries the old resourceVersion,
    the server refuses it (409), the mirror re-reads and finds its allocation already there."""
    pod = faulty_api.add_pod(NAME, {"gpu-fraction": "0.5"})
    faulty_api.fail("PATCH", POD, fault)
    with mirror_over(faulty_api) as rig:
        reply = rig.stub.MirrorAllocation(mirror_request(allocation(pod), key="bind/1"),
                                          timeout=10)
    # The retry met its own write's version (409) and the re-read finds all it wrote: the call
    # wrote it (changed), and once (writes=1).
    assert reply.changed is True
    assert reply.annotations[SIG] == faulty_api.pod(NS, NAME)["metadata"]["annotations"][SIG]
    assert_mirrored_once(faulty_api, PodStats(gets=2, patch_requests=2, writes=1))


def test_every_answer_lost_is_unavailable_and_the_scheduler_retry_finds_it_done(faulty_api):
    pod = faulty_api.add_pod(NAME, {"gpu-fraction": "0.5"})
    faulty_api.fail("PATCH", POD, Fault.RESET_AFTER_WRITE, times=None)
    with mirror_over(faulty_api) as rig:
        with pytest.raises(grpc.RpcError) as e:
            rig.stub.MirrorAllocation(mirror_request(allocation(pod), key="bind/1"), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert e.value.details().startswith(
            "patch pod team-a/train-0: the Kubernetes API failed 3 time(s), last: ")
        assert faulty_api.stats(NS, NAME).writes == 1  # the first try landed, unheard
        faulty_api.rules.clear()
        again = rig.stub.MirrorAllocation(mirror_request(allocation(pod), key="bind/1"),
                                          timeout=10)
    assert again.changed is False
    # The pod cache still held the pod as read before the write whose answer was lost (no
    # watch here): the retry's guarded PATCH is refused (409), then the pod is read again.
    assert_mirrored_once(faulty_api, PodStats(gets=2, patch_requests=4, writes=1))


@pytest.mark.parametrize("fault", [Fault.TIMEOUT, Fault.RESET])
def test_an_api_that_never_answers_is_unavailable_and_nothing_is_written(faulty_api, fault):
    pod = faulty_api.add_pod(NAME, {"gpu-fraction": "0.5"})
    faulty_api.fail("PATCH", POD, fault, times=None)
    with mirror_over(faulty_api) as rig, pytest.raises(grpc.RpcError) as e:
        rig.stub.MirrorAllocation(mirror_request(allocation(pod)), timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    stats = faulty_api.stats(NS, NAME)
    assert (stats.patch_requests, stats.writes) == (3, 0)
    assert MIRRORED_ANNOTATION not in faulty_api.pod(NS, NAME)["metadata"]["annotations"]


def test_timeouts_past_the_callers_deadline_are_deadline_exceeded(faulty_api):
    pod = faulty_api.add_pod(NAME, {"gpu-fraction": "0.5"})
    faulty_api.fail("GET", POD, Fault.TIMEOUT, times=None)
    with mirror_over(faulty_api) as rig, pytest.raises(grpc.RpcError) as e:
        rig.stub.MirrorAllocation(mirror_request(allocation(pod)), timeout=0.5)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert faulty_api.stats(NS, NAME).writes == 0


def test_a_conflict_then_a_reset_then_success_writes_once(faulty_api):
    pod = faulty_api.add_pod(NAME, {"gpu-fraction": "0.5"})
    faulty_api.fail("PATCH", POD, Fault.CONFLICT)
    faulty_api.fail("GET", POD, Fault.RESET)
    faulty_api.fail("PATCH", POD, Fault.UNAVAILABLE)
    with mirror_over(faulty_api) as rig:
        reply = rig.stub.MirrorAllocation(mirror_request(allocation(pod)), timeout=10)
    assert reply.changed
    # read, patch (409), read (reset), read, patch (503), patch
    assert_mirrored_once(faulty_api, PodStats(gets=3, patch_requests=3, writes=1))
