"""The simulated API server refuses annotation keys Kubernetes refuses, as the API server does
(422 Invalid, its words), on create and on every kind of patch, and changes nothing: code that
builds a key too long for a real cluster fails its tests here."""

from __future__ import annotations

import json

import pytest
from kubernetes.client.exceptions import ApiException

from kai_fractions.sim.annotation_keys import key_problems
from tests.support.kube import pod_manifest

NAME_64 = "kai-fractions.io/container." + "c" * 25 + ".mps-active-thread-percentage"
"""`container.` (10), 25 characters, the suffix (29): a name part of 64."""
TOO_LONG = 'name part must be no more than 63 characters'


def _refusal(e: pytest.ExceptionInfo[ApiException]) -> dict:
    assert e.value.status == 422, e.value
    body = json.loads(e.value.body)
    assert body["reason"] == "Invalid"
    return body


def test_the_key_rule_is_the_api_servers():
    assert len(NAME_64.partition("/")[2]) == 64
    assert key_problems(NAME_64) == [TOO_LONG]
    assert key_problems("kai-fractions.io/container." + "c" * 24
                        + ".mps-active-thread-percentage") == []
    assert key_problems("Example.COM/Upper_Case.ok") == []  # the key is checked lower-cased
    assert key_problems("a/b/c")[0].startswith("a qualified name must consist of")
    assert key_problems("/x") == ["prefix part must be non-empty"]
    assert key_problems("x/") == ["name part must be non-empty", key_problems("x/")[1]]
    assert key_problems("ex_ample.com/x")[0].startswith(
        "prefix part a lowercase RFC 1123 subdomain must consist of")
    assert key_problems("example.com/-x")[0].startswith("name part must consist of")


def test_a_create_with_a_key_over_63_is_refused_as_the_api_server_words_it(kube):
    body = pod_manifest("p", annotations={NAME_64: "1", "fine": "2"})
    with pytest.raises(ApiException) as e:
        kube.core.create_namespaced_pod("default", body)
    status = _refusal(e)
    assert status["message"] == (
        f'Pod "p" is invalid: metadata.annotations: Invalid value: "{NAME_64}": {TOO_LONG}')
    assert status["details"]["causes"] == [{
        "reason": "FieldValueInvalid", "field": "metadata.annotations",
        "message": f'Invalid value: "{NAME_64}": {TOO_LONG}'}]
    assert kube.get_object("v1/pods", "default", "p") is None


def test_a_merge_patch_adding_such_a_key_is_refused_and_changes_nothing(kube):
    kube.core.create_namespaced_pod("default", pod_manifest("p", annotations={"a": "1"}))
    before = kube.get_object("v1/pods", "default", "p")
    with pytest.raises(ApiException) as e:
        kube.core.patch_namespaced_pod("p", "default", {"metadata": {"annotations": {
            NAME_64: "1", "b": "2"}}})
    assert NAME_64 in _refusal(e)["message"]
    assert kube.get_object("v1/pods", "default", "p") == before
    assert kube.revision == int(before["metadata"]["resourceVersion"])


def test_a_json_patch_adding_such_a_key_is_refused_and_changes_nothing(kube):
    kube.core.create_namespaced_pod("default", pod_manifest("p", annotations={"a": "1"}))
    before = kube.get_object("v1/pods", "default", "p")
    key = NAME_64.replace("/", "~1")
    with pytest.raises(ApiException) as e:
        kube.core.patch_namespaced_pod("p", "default", [
            {"op": "add", "path": f"/metadata/annotations/{key}", "value": "1"}])
    assert NAME_64 in _refusal(e)["message"]
    assert kube.get_object("v1/pods", "default", "p") == before


def test_a_patch_that_removes_an_invalid_key_put_in_the_store_passes(kube):
    """The API server checks the object it would store: removing a bad key is fine, and a
    patch that keeps one is not."""
    kube.core.create_namespaced_pod("default", pod_manifest("p"))
    stored = kube.objects["v1/pods", "default", "p"]
    stored["metadata"] = {**stored["metadata"], "annotations": {NAME_64: "x"}}
    with pytest.raises(ApiException):
        kube.core.patch_namespaced_pod("p", "default", {"metadata": {"annotations": {"a": "1"}}})
    kube.core.patch_namespaced_pod("p", "default", {"metadata": {"annotations": {NAME_64: None}}})
    assert NAME_64 not in (kube.get_object("v1/pods", "default", "p")["metadata"]
                           .get("annotations") or {})


def test_keys_of_63_pass(kube):
    key = "kai-fractions.io/container." + "c" * 24 + ".mps-active-thread-percentage"
    kube.core.create_namespaced_pod("default", pod_manifest("p", annotations={key: "1"}))
    assert kube.get_object("v1/pods", "default", "p")["metadata"]["annotations"] == {key: "1"}
