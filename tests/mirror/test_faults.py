"""Faults between the mirror and the API server: conflicts, throttling, 5xx, an unreachable API,
pods deleted or recreated, duplicates, deadlines. Counted in PATCH requests kmock received."""

from __future__ import annotations

import asyncio
import socket
import threading

import grpc
import pytest
from google.rpc import error_details_pb2
from kubernetes import client as k8s

from kai_fractions.api.v1 import allocation_pb2 as pb
from kai_fractions.api.v1 import allocation_pb2_grpc as pb_grpc
from kai_fractions.kube.client import Kube
from kai_fractions.kube.retry import Backoff
from kai_fractions.mirror.errors import PodNotFound
from kai_fractions.mirror.grpc.server import MirrorServer, ServerOptions
from kai_fractions.mirror.grpc.servicer import DEADLINE_MARGIN_S
from kai_fractions.mirror.kube_store import KubePodStore
from kai_fractions.mirror.record import MIRRORED_ANNOTATION
from kai_fractions.mirror.service import MirrorService
from kai_fractions.mirror.store import WriteConflict
from tests.support.mirror_kube import pod_path

from .messages import allocation, detail, mirror_request

pytestmark = [pytest.mark.integration, pytest.mark.faults]

NS, NAME = "team-a", "train-0"
PATH = pod_path(NS, NAME)


def test_conflict_then_success_rereads_and_writes_once(mirror_tcp):
    pod = mirror_tcp.create_pod(NAME, {"gpu-fraction": "0.5"})
    fault = mirror_tcp.kube.fail("PATCH", PATH, 409, times=1)
    response = mirror_tcp.stub.MirrorAllocation(mirror_request(allocation(pod)), timeout=10)
    assert response.changed
    assert fault.hits == 1
    assert mirror_tcp.patches(NS, NAME) == 2  # the refused one and the one that landed
    assert mirror_tcp.kube.count("GET", PATH) == 2  # read, conflict, read again
    assert MIRRORED_ANNOTATION in mirror_tcp.annotations(NS, NAME)


def test_a_real_resource_version_conflict_is_recomputed(mirror_tcp):
    """Another writer changes the pod between our read and our write: the server refuses the
    stale resourceVersion (409) and the mirror recomputes from the new pod."""
    pod = mirror_tcp.create_pod(NAME, {"gpu-fraction": "0.5"})
    original = mirror_tcp.store.get_pod
    raced = []

    async def get_then_race(namespace, name, deadline):
        snapshot = await original(namespace, name, deadline)
        if not raced:
            raced.append(True)
            mirror_tcp.kube.core.patch_namespaced_pod(
                name, namespace, {"metadata": {"labels": {"touched": "yes"}}})
        return snapshot

    mirror_tcp.store.get_pod = get_then_race
    response = mirror_tcp.stub.MirrorAllocation(mirror_request(allocation(pod)), timeout=10)
    assert response.changed
    after = mirror_tcp.pod(NS, NAME)
    assert after["metadata"]["labels"] == {"touched": "yes"}
    assert MIRRORED_ANNOTATION in after["metadata"]["annotations"]
    assert mirror_tcp.patches(NS, NAME) == 3  # the other writer's, our refused one, ours


@pytest.mark.parametrize("status", [500, 429, 503])
def test_server_errors_then_success(mirror_tcp, status):
    pod = mirror_tcp.create_pod(NAME, {"gpu-fraction": "0.5"})
    mirror_tcp.kube.fail("PATCH", PATH, status, times=1)
    response = mirror_tcp.stub.MirrorAllocation(mirror_request(allocation(pod)), timeout=10)
    assert response.changed
    assert mirror_tcp.patches(NS, NAME) == 2
    assert MIRRORED_ANNOTATION in mirror_tcp.annotations(NS, NAME)


def test_read_errors_then_success(mirror_tcp):
    pod = mirror_tcp.create_pod(NAME, {"gpu-fraction": "0.5"})
    mirror_tcp.kube.fail("GET", PATH, 500, times=2)
    response = mirror_tcp.stub.MirrorAllocation(mirror_request(allocation(pod)), timeout=10)
    assert response.changed
    assert mirror_tcp.patches(NS, NAME) == 1


def test_api_that_keeps_failing_is_unavailable_and_nothing_is_written(mirror_tcp):
    pod = mirror_tcp.create_pod(NAME, {"gpu-fraction": "0.5"})
    mirror_tcp.kube.fail("PATCH", PATH, 503, times=None)
    with pytest.raises(grpc.RpcError) as e:
        mirror_tcp.stub.MirrorAllocation(mirror_request(allocation(pod)), timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert e.value.details().startswith(
        "patch pod team-a/train-0: the Kubernetes API failed 3 time(s), last: 503 "
        "ServiceUnavailable: injected 503")
    assert detail(e.value, error_details_pb2.RetryInfo).retry_delay.seconds == 1
    assert MIRRORED_ANNOTATION not in mirror_tcp.annotations(NS, NAME)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_api_down_is_unavailable_and_nothing_is_written(kube):
    """The API server cannot be reached at all (connection refused)."""
    configuration = k8s.Configuration(host=f"http://127.0.0.1:{_closed_port()}")
    configuration.retries = False
    store = KubePodStore(Kube(k8s.ApiClient(configuration)),
                         backoff=Backoff(attempts=3, base=0.01, cap=0.02))
    server = MirrorServer(MirrorService(store), ServerOptions(listen="127.0.0.1:0")).start()
    try:
        with grpc.insecure_channel(server.address) as channel:
            pod = {"metadata": {"namespace": NS, "name": NAME, "uid": "u-1"}}
            with pytest.raises(grpc.RpcError) as e:
                pb_grpc.AllocationMirrorStub(channel).MirrorAllocation(
                    mirror_request(allocation(pod)), timeout=10)
    finally:
        server.stop(grace=0)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    # The node is read first (every fractional allocation's node must exist).
    assert e.value.details().startswith("read node gpu-node-1: the Kubernetes API failed 3 "
                                        "time(s), last: ")
    assert kube.count("PATCH") == 0


def test_deleted_pod_is_not_found(mirror_tcp):
    pod = mirror_tcp.create_pod(NAME, {"gpu-fraction": "0.5"})
    mirror_tcp.kube.core.delete_namespaced_pod(NAME, NS)
    with pytest.raises(grpc.RpcError) as e:
        mirror_tcp.stub.MirrorAllocation(mirror_request(allocation(pod)), timeout=10)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert e.value.details() == "pod team-a/train-0 not found"
    info = detail(e.value, error_details_pb2.ResourceInfo)
    assert (info.resource_type, info.resource_name) == ("Pod", "team-a/train-0")
    with pytest.raises(grpc.RpcError) as e:
        mirror_tcp.stub.ReleaseAllocation(pb.ReleaseAllocationRequest(pod=pb.PodRef(
            namespace=NS, name=NAME)), timeout=10)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert mirror_tcp.patches(NS, NAME) == 0


def test_recreated_pod_with_another_uid_is_refused_as_not_found(mirror_tcp):
    old = mirror_tcp.create_pod(NAME, {"gpu-fraction": "0.5"})
    mirror_tcp.kube.core.delete_namespaced_pod(NAME, NS)
    new = mirror_tcp.create_pod(NAME, {"gpu-fraction": "0.5"})
    with pytest.raises(grpc.RpcError) as e:
        mirror_tcp.stub.MirrorAllocation(mirror_request(allocation(old)), timeout=10)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    old_uid, new_uid = old["metadata"]["uid"], new["metadata"]["uid"]
    assert e.value.details() == (
        f"pod team-a/train-0 has uid {new_uid}, not {old_uid}: the pod the decision was made "
        "for was deleted and recreated; nothing was written")
    info = detail(e.value, error_details_pb2.ErrorInfo)
    assert (info.reason, info.domain, dict(info.metadata)) == (
        "POD_REPLACED", "kai-fractions.io", {"expected_uid": old_uid, "actual_uid": new_uid})
    assert mirror_tcp.patches(NS, NAME) == 0
    assert mirror_tcp.annotations(NS, NAME) == {"gpu-fraction": "0.5"}


def test_duplicate_calls_write_once(mirror_tcp):
    pod = mirror_tcp.create_pod(NAME, {"gpu-fraction": "0.5"})
    request = mirror_request(allocation(pod), key="bind/1")
    first = mirror_tcp.stub.MirrorAllocation(request, timeout=10)
    second = mirror_tcp.stub.MirrorAllocation(request, timeout=10)
    without_key = mirror_tcp.stub.MirrorAllocation(mirror_request(allocation(pod)), timeout=10)
    assert (first.changed, second.changed, without_key.changed) == (True, False, False)
    assert second.annotations == first.annotations
    assert second.resource_version == first.resource_version
    assert mirror_tcp.patches(NS, NAME) == 1


def test_concurrent_duplicates_write_once(mirror_tcp):
    pod = mirror_tcp.create_pod(NAME, {"gpu-fraction": "0.5"})
    request = mirror_request(allocation(pod), key="bind/1")
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(
        mirror_tcp.stub.MirrorAllocation(request, timeout=10).changed)) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [False] * 5 + [True]
    assert mirror_tcp.patches(NS, NAME) == 1


def test_conflicting_decision_is_failed_precondition(mirror_tcp):
    pod = mirror_tcp.create_pod(NAME, {"gpu-fraction": "0.5"})
    mirror_tcp.stub.MirrorAllocation(mirror_request(allocation(pod), key="a"), timeout=10)
    with pytest.raises(grpc.RpcError) as e:
        mirror_tcp.stub.MirrorAllocation(mirror_request(allocation(pod, portion="0.25"),
                                                        key="b"), timeout=10)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    violation = detail(e.value, error_details_pb2.PreconditionFailure).violations[0]
    assert (violation.type, violation.subject) == ("ALLOCATION_CONFLICT", "team-a/train-0")
    assert mirror_tcp.patches(NS, NAME) == 1


def test_deadline_is_respected_in_the_retry_loop(mirror_factory):
    slow = mirror_factory(store_backoff=Backoff(attempts=50, base=0.2, cap=0.2, jitter=0))
    pod = slow.create_pod(NAME, {"gpu-fraction": "0.5"})
    slow.kube.fail("GET", PATH, 503, times=None)
    with pytest.raises(grpc.RpcError) as e:
        slow.stub.MirrorAllocation(mirror_request(allocation(pod)), timeout=0.6)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # Normally the mirror's own answer; the client's if the machine is too busy to beat it.
    assert e.value.details().startswith(
        "read pod team-a/train-0: the caller's deadline ran out") or \
        e.value.details() == "Deadline Exceeded"
    assert slow.kube.count("GET", PATH) < 50
    assert slow.patches(NS, NAME) == 0


def test_a_write_is_not_started_without_the_time_it_needs(mirror_tcp):
    """A PATCH sent with the last milliseconds of a call timed out at the mirror after the API
    server applied it (DEADLINE_EXCEEDED, yet written). A call whose deadline leaves less than
    MIN_WRITE_BUDGET after the servicer's margin writes nothing, however fast the machine."""
    pod = mirror_tcp.create_pod(NAME, {"gpu-fraction": "0.5"})
    request = mirror_request(allocation(pod), key="bind-1")
    with pytest.raises(grpc.RpcError) as e:
        mirror_tcp.stub.MirrorAllocation(request, timeout=DEADLINE_MARGIN_S + 0.07)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert mirror_tcp.patches(NS, NAME) == 0
    # The retry with the same key writes it (and the pod's lock has seen the first call out).
    assert mirror_tcp.stub.MirrorAllocation(request, timeout=10).changed
    assert mirror_tcp.patches(NS, NAME) == 1


def test_forbidden_is_internal_and_names_rbac(mirror_tcp):
    pod = mirror_tcp.create_pod(NAME, {"gpu-fraction": "0.5"})
    mirror_tcp.kube.fail("PATCH", PATH, 403, times=1)
    with pytest.raises(grpc.RpcError) as e:
        mirror_tcp.stub.MirrorAllocation(mirror_request(allocation(pod)), timeout=10)
    assert e.value.code() == grpc.StatusCode.INTERNAL
    assert e.value.details() == (
        "patch pod team-a/train-0: the API server refused this component's identity (403 "
        "Forbidden: "
        "injected 403 Forbidden for PATCH /api/v1/namespaces/team-a/pods/train-0); check its "
        "RBAC")
    assert mirror_tcp.patches(NS, NAME) == 1  # not retried
    assert MIRRORED_ANNOTATION not in mirror_tcp.annotations(NS, NAME)


def test_an_invalid_patch_on_the_same_pod_is_internal(mirror_tcp):
    pod = mirror_tcp.create_pod(NAME, {"gpu-fraction": "0.5"})
    mirror_tcp.kube.fail("PATCH", PATH, 422, times=1)
    with pytest.raises(grpc.RpcError) as e:
        mirror_tcp.stub.MirrorAllocation(mirror_request(allocation(pod)), timeout=10)
    assert e.value.code() == grpc.StatusCode.INTERNAL
    assert e.value.details() == (
        "the API server refused the patch of pod team-a/train-0: 422 Invalid: injected 422 "
        "Invalid for PATCH /api/v1/namespaces/team-a/pods/train-0")
    assert mirror_tcp.kube.count("GET", PATH) == 2  # re-read: still the same pod


def test_the_stores_patch_is_the_generated_clients_request_with_its_credentials(kube):
    """KubePodStore's pod PATCH is what `patch_namespaced_pod` sends: same path, headers,
    token and body; and its refusals are the mirror's errors."""
    configuration = kube.configuration()
    configuration.api_key = {"authorization": "rotating-token"}
    configuration.api_key_prefix = {"authorization": "Bearer"}
    api_client = k8s.ApiClient(configuration)
    kube.core.create_namespaced_pod(NS, {"metadata": {"name": "train-x", "namespace": NS},
                                         "spec": {"containers": [{"name": "c"}]}})
    path = pod_path(NS, "train-x")
    changes = {"kai": "1"}
    store = KubePodStore(Kube(api_client), backoff=Backoff(attempts=1))

    async def patch(name: str) -> None:
        await store.patch_annotations(NS, name, changes, uid="", resource_version="")

    async def scenario() -> None:
        try:
            await patch("train-x")
            body = {"metadata": {"annotations": changes}}
            await asyncio.to_thread(
                k8s.CoreV1Api(api_client).patch_namespaced_pod, "train-x", NS, body,
                _content_type="application/merge-patch+json")
            ours, generated = kube.requests("PATCH", path)[-2:]
            for request in (ours, generated):
                assert request.headers["Authorization"] == "Bearer rotating-token"
                assert request.headers["Content-Type"] == "application/merge-patch+json"
                assert request.headers["Accept"] == "application/json"
                assert request.headers["User-Agent"] == api_client.user_agent
                assert request.data == body
            kube.fail("PATCH", path, 409, times=1)
            with pytest.raises(WriteConflict):
                await patch("train-x")
            with pytest.raises(PodNotFound):
                await patch("gone")
        finally:
            await store.close()
            api_client.close()

    asyncio.run(scenario())
