"""kube.errors (reading an answer into an error) and kube.objects (paths and shapes)."""

from __future__ import annotations

import datetime
import json

import pytest

from kai_fractions.kube import (
    Conflict,
    Forbidden,
    Gone,
    Invalid,
    KubeError,
    NotFound,
    Transient,
    objects,
)
from kai_fractions.kube.errors import refused, status_message, unreachable

STATUS = json.dumps({"kind": "Status", "code": 409, "reason": "Conflict",
                     "message": 'pods "p" is being modified'})


@pytest.mark.parametrize(("body", "expected"), [
    (STATUS, '409 Conflict: pods "p" is being modified'),
    (STATUS.encode(), '409 Conflict: pods "p" is being modified'),
    (json.dumps({"message": "no reason given"}), "409 Conflict: no reason given"),
    (json.dumps({"reason": "Conflict"}), "409 Conflict"),
    ("<html>proxy</html>", "409 Conflict"),
    (json.dumps(["a", "list"]), "409 Conflict"),
    ("", "409 Conflict"),
    (None, "409 Conflict"),
], ids=["status", "bytes", "no-reason", "no-message", "html", "not-an-object", "empty", "none"])
def test_status_message_is_the_servers_message_else_the_code_and_reason(body, expected):
    assert status_message(409, "Conflict", body) == expected


def test_status_message_without_a_reason_is_the_code():
    assert status_message(502, None, None) == "502"


@pytest.mark.parametrize(("code", "error"), [
    (404, NotFound), (409, Conflict), (410, Gone), (422, Invalid), (401, Forbidden),
    (403, Forbidden), (408, Transient), (429, Transient), (500, Transient), (502, Transient),
    (503, Transient), (504, Transient), (400, KubeError), (405, KubeError), (415, KubeError),
    (302, KubeError),
])
def test_refused_maps_each_status_to_its_error(code, error):
    e = refused("patch pod ns/p", code, "Why", json.dumps({"message": "because"}))
    assert type(e) is error
    assert (e.status, e.retry_after) == (code, None)
    assert str(e).startswith("patch pod ns/p: ") and "because" in str(e)
    assert ("RBAC" in str(e)) == (code == 403)  # a refused identity says where to look
    assert ("credentials" in str(e)) == (code == 401)  # a 401 is authentication, not RBAC


@pytest.mark.parametrize(("header", "hint"), [("7", 7.0), ("1.5", 1.5), ("soon", None),
                                               (None, None)])
def test_refused_reads_retry_after_as_seconds(header, hint):
    assert refused("x", 429, "TooManyRequests", None, header).retry_after == hint


def test_each_error_has_a_reason_word():
    assert [cls.reason for cls in (KubeError, NotFound, Conflict, Gone, Invalid, Forbidden,
                                   Transient)] == [
        "APIError", "NotFound", "Conflict", "Expired", "Invalid", "Forbidden", "Unavailable"]


def test_unreachable_is_transient_and_says_what_happened():
    assert str(unreachable("read pod", TimeoutError())) == "read pod: no answer in time"
    error = unreachable("read pod", ConnectionResetError("reset by peer"))
    assert (type(error), str(error), error.status) == (
        Transient, "read pod: ConnectionResetError: reset by peer", None)


# -- objects ---------------------------------------------------------------------------------------

def test_paths_quote_each_name():
    assert objects.pod_path("team a", "p/1?x") == "/api/v1/namespaces/team%20a/pods/p%2F1%3Fx"
    assert objects.pods_path() == "/api/v1/pods"
    assert objects.pods_path("ns") == "/api/v1/namespaces/ns/pods"
    assert objects.node_path("node#1") == "/api/v1/nodes/node%231"
    assert objects.events_path("ns") == "/api/v1/namespaces/ns/events"
    assert objects.namespaced_path("coordination.k8s.io", "v1", "leases", "kai", "lead/er") == (
        "/apis/coordination.k8s.io/v1/namespaces/kai/leases/lead%2Fer")
    assert objects.namespaced_path("scheduling.run.ai", "v1alpha2", "bindrequests", None) == (
        "/apis/scheduling.run.ai/v1alpha2/bindrequests")


def test_meta_uid_and_resource_version_read_an_object_or_nothing():
    obj = {"metadata": {"uid": "u", "resourceVersion": 7}}
    assert (objects.uid_of(obj), objects.resource_version(obj)) == ("u", "7")
    assert (objects.uid_of({}), objects.resource_version({"metadata": None})) == ("", "")


@pytest.mark.parametrize(("guard", "metadata"), [
    ({}, {}),
    ({"uid": "u-1"}, {"uid": "u-1"}),
    ({"resource_version": "7"}, {"resourceVersion": "7"}),
    ({"uid": "u-1", "resource_version": "7"}, {"uid": "u-1", "resourceVersion": "7"}),
    ({"uid": "", "resource_version": ""}, {}),
], ids=["none", "uid", "resource-version", "both", "empty"])
def test_the_annotation_patch_carries_the_uid_and_version_only_when_given(guard, metadata):
    patch = objects.annotation_patch({"set": "1", "drop": None}, **guard)
    assert json.loads(patch) == {"metadata": {"annotations": {"set": "1", "drop": None},
                                              **metadata}}
    assert b" " not in patch  # compact


def test_a_pod_event_names_the_pod_its_source_and_its_time():
    now = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)
    event = objects.pod_event("ns", "p", "u-1", event_type="Warning", reason="Failed",
                              message="m" * 2000, component="kai-agent", host="node-1",
                              resource_version="9", now=now)
    name = event["metadata"].pop("name")
    assert name.startswith("p.") and len(name) == len("p.") + 16
    assert event == {
        "apiVersion": "v1", "kind": "Event", "metadata": {"namespace": "ns"},
        "involvedObject": {"apiVersion": "v1", "kind": "Pod", "namespace": "ns", "name": "p",
                           "uid": "u-1", "resourceVersion": "9"},
        "reason": "Failed", "message": "m" * objects.MAX_EVENT_MESSAGE, "type": "Warning",
        "source": {"component": "kai-agent", "host": "node-1"},
        "reportingComponent": "kai-agent", "reportingInstance": "node-1",
        "firstTimestamp": "2026-01-02T03:04:05Z", "lastTimestamp": "2026-01-02T03:04:05Z",
        "count": 1}


def test_a_pod_event_without_uid_host_or_version_leaves_them_out_and_names_are_unique():
    first = objects.pod_event("ns", "p", "", event_type="Normal", reason="R", message="m",
                              component="c")
    second = objects.pod_event("ns", "p", "", event_type="Normal", reason="R", message="m",
                               component="c")
    assert "uid" not in first["involvedObject"]
    assert "resourceVersion" not in first["involvedObject"]
    assert first["source"] == {"component": "c"} and "reportingInstance" not in first
    assert first["metadata"]["name"] != second["metadata"]["name"]
