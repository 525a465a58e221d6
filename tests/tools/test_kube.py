"""The official kubernetes client (sync) against kmock (tests/support/kube.py)."""

from __future__ import annotations

import re

import pytest
from kubernetes.client import ApiException, V1DeleteOptions, V1Preconditions

from tests.support.kube import KubeServer, pod_manifest

POD_PATH = "/api/v1/namespaces/default/pods/p1"
MERGE = "application/merge-patch+json"


def _merge_patch(kube: KubeServer, body: object, name: str = "p1") -> object:
    return kube.core.patch_namespaced_pod(name, "default", body, _content_type=MERGE)


def test_create_merge_patch_read(kube: KubeServer) -> None:
    created = kube.core.create_namespaced_pod("default", pod_manifest("p1", labels={"a": "b"}))
    assert created.metadata.uid
    assert created.metadata.resource_version == "1"
    assert created.metadata.creation_timestamp is not None

    patched = _merge_patch(kube, {"metadata": {"annotations": {"kai.scheduler/x": "1"}}})
    assert patched.metadata.annotations == {"kai.scheduler/x": "1"}
    assert patched.metadata.labels == {"a": "b"}
    assert patched.metadata.resource_version == "2"
    assert patched.metadata.uid == created.metadata.uid

    read = kube.core.read_namespaced_pod("p1", "default")
    assert read.metadata.annotations == {"kai.scheduler/x": "1"}
    assert read.metadata.resource_version == "2"

    patches = kube.requests("PATCH", POD_PATH)
    assert len(patches) == 1
    assert patches[0].headers["Content-Type"] == MERGE
    # the recorded request is what the client sent, not the server-stamped body
    assert patches[0].data == {"metadata": {"annotations": {"kai.scheduler/x": "1"}}}
    assert kube.get_object("v1/pods", "default", "p1")["metadata"]["resourceVersion"] == "2"
    pods = kube.core.list_namespaced_pod("default")
    assert [p.metadata.name for p in pods.items] == ["p1"]
    assert pods.metadata.resource_version == "2"


def test_stale_resource_version_is_a_conflict(kube: KubeServer) -> None:
    kube.core.create_namespaced_pod("default", pod_manifest("p1"))
    _merge_patch(kube, {"metadata": {"resourceVersion": "1", "labels": {"step": "1"}}})
    with pytest.raises(ApiException) as err:
        _merge_patch(kube, {"metadata": {"resourceVersion": "1", "labels": {"step": "2"}}})
    assert err.value.status == 409
    assert "the object has been modified" in err.value.body
    assert kube.get_object("v1/pods", "default", "p1")["metadata"]["labels"] == {"step": "1"}

    # JSON patch with a failing "test" op is 422, a passing one applies
    with pytest.raises(ApiException) as err:
        kube.core.patch_namespaced_pod(
            "p1",
            "default",
            [
                {"op": "test", "path": "/metadata/resourceVersion", "value": "1"},
                {"op": "add", "path": "/metadata/labels/step", "value": "3"},
            ],
        )
    assert err.value.status == 422
    done = kube.core.patch_namespaced_pod(
        "p1",
        "default",
        [
            {"op": "test", "path": "/metadata/resourceVersion", "value": "2"},
            {"op": "add", "path": "/metadata/labels/step", "value": "3"},
        ],
    )
    assert (done.metadata.labels, done.metadata.resource_version) == ({"step": "3"}, "3")

    with pytest.raises(ApiException) as err:
        kube.core.delete_namespaced_pod(
            "p1",
            "default",
            body=V1DeleteOptions(preconditions=V1Preconditions(resource_version="2")),
        )
    assert err.value.status == 409
    kube.core.delete_namespaced_pod(
        "p1", "default", body=V1DeleteOptions(preconditions=V1Preconditions(resource_version="3"))
    )
    assert kube.get_object("v1/pods", "default", "p1") is None


def test_injected_conflict_once_leaves_state_untouched(kube: KubeServer) -> None:
    kube.core.create_namespaced_pod("default", pod_manifest("p1"))
    fault = kube.fail("PATCH", POD_PATH, 409, times=1)
    with pytest.raises(ApiException) as err:
        _merge_patch(kube, {"metadata": {"labels": {"try": "1"}}})
    assert err.value.status == 409
    assert '"reason":"Conflict"' in err.value.body.replace(" ", "")
    assert kube.get_object("v1/pods", "default", "p1")["metadata"].get("labels") is None

    retried = _merge_patch(kube, {"metadata": {"labels": {"try": "2"}}})
    assert retried.metadata.labels == {"try": "2"}
    assert fault.hits == 1
    assert kube.count("PATCH", POD_PATH) == 2

    kube.fail(None, re.compile(r"/api/v1/namespaces/default/pods.*"), 500, times=1)
    with pytest.raises(ApiException) as err:
        kube.core.read_namespaced_pod("p1", "default")
    assert err.value.status == 500
    assert kube.core.read_namespaced_pod("p1", "default").metadata.labels == {"try": "2"}


def test_raw_kmock_reaction_409_once(kube: KubeServer) -> None:
    kube.core.create_namespaced_pod("default", pod_manifest("p1"))
    _merge_patch(kube, {"metadata": {"labels": {"n": "0"}}})
    kube.next_requests("PATCH", POD_PATH) << 409
    with pytest.raises(ApiException) as err:
        _merge_patch(kube, {"metadata": {"labels": {"n": "1"}}})
    assert err.value.status == 409
    # kmock's reactions answer after its store changed: the "refused" patch was applied.
    assert kube.get_object("v1/pods", "default", "p1")["metadata"]["labels"] == {"n": "1"}
    assert _merge_patch(kube, {"metadata": {"labels": {"n": "2"}}}).metadata.labels == {"n": "2"}


def test_generate_name_and_namespace(kube: KubeServer) -> None:
    body = pod_manifest("", generateName="worker-")
    del body["metadata"]["name"]
    del body["metadata"]["namespace"]
    pod = kube.core.create_namespaced_pod("default", body)
    assert re.fullmatch(r"worker-[a-z0-9]{5}", pod.metadata.name)
    assert pod.metadata.namespace == "default"
    with pytest.raises(ApiException) as err:
        kube.core.create_namespaced_pod("default", pod_manifest("p2", namespace="other"))
    assert err.value.status == 400
