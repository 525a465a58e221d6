"""Objects of the wrong shape: a review of one is a clear denial (400, naming the JSON path and
the type expected), never an internal error. The API server decodes typed objects before
admission, so only a direct caller can send these; each internal error fires
KaiFractionsAdmissionInternalErrors.

The property: in a valid fractional pod (wired, every kind of container, reserved and plain
volumes, security contexts) and in its AdmissionReview, each field in turn replaced by a
number, a boolean, a string, a list, an object and null, reviewed by both webhooks on CREATE
and UPDATE (the change in the new object, or in the old one): no review raises."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonpatch
import pytest

from kai_fractions.admission.mutate import mutate
from kai_fractions.admission.review import Decision
from kai_fractions.admission.validate import manifest_problems, validate
from kai_fractions.contract import parse_pod, view_from_pod_spec

from .reviews import CONFIG, SM, pod, request

RANDOM = "cd" * 6
"""The random part of the MPS namespace name the webhook draws (`podspec.new_mps_namespace`)."""
VOID = {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}
WRONG: tuple[Any, ...] = (7, True, "x", [1], {"a": 1}, None)
"""A number, a boolean, a string, a list, an object, null."""


def _valid_pod() -> dict[str, Any]:
    """A wired sm-sharing pod with a sidecar, an init container, an ephemeral container,
    security contexts, resources, labels and a plain hostPath and emptyDir volume: both
    webhooks allow it and the mutating one changes nothing."""
    obj = pod(SM, containers=("main", "side"), initContainers=[{"name": "setup", "image": "i"}],
              volumes=[{"name": "data", "hostPath": {"path": "/data", "type": "Directory"}},
                       {"name": "scratch", "emptyDir": {}}])
    obj["metadata"]["labels"] = {"team": "a"}
    main, side = obj["spec"]["containers"]
    main["env"] = [{"name": "A", "value": "1"}]
    main["envFrom"] = [{"configMapRef": {"name": "c"}}]
    main["resources"] = {"limits": {"cpu": "1"}, "requests": {"cpu": "1"}}
    main["securityContext"] = {"privileged": False, "procMount": "Default",
                               "capabilities": {"add": ["NET_ADMIN"], "drop": ["ALL"]}}
    side["volumeMounts"] = [{"name": "data", "mountPath": "/data", "readOnly": True,
                             "subPath": "d"}]
    decision = mutate(request(obj), CONFIG, new_namespace=lambda: RANDOM)
    assert decision.allowed, decision.message
    obj = jsonpatch.apply_patch(obj, list(decision.patch))
    obj["spec"]["ephemeralContainers"] = [{
        "name": "debug", "image": "busybox", "targetContainerName": "side", "env": [VOID],
        "volumeMounts": [{"name": "scratch", "mountPath": "/s"}],
        "securityContext": {"capabilities": {"add": ["NET_RAW"]}}}]
    return obj


VALID = _valid_pod()


def _paths(value: Any, at: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every field and list item under `value`, as a path of keys and indexes."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield (*at, key)
            yield from _paths(item, (*at, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield (*at, i)
            yield from _paths(item, (*at, i))


def _replaced(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    out = copy.deepcopy(value)
    parent = out
    for step in path[:-1]:
        parent = parent[step]
    parent[path[-1]] = new
    return out


def _reviews() -> Iterator[tuple[str, dict[str, Any]]]:
    """(what was replaced, the request) for each field and each wrong value."""
    create = request(VALID)
    update = request(VALID, old=VALID)
    ephemeral = request(VALID, old=VALID, sub="ephemeralcontainers")
    for path in _paths(VALID):
        for wrong in WRONG:
            broken = _replaced(VALID, path, wrong)
            shown = f"{'.'.join(map(str, path))}={wrong!r}"
            yield f"CREATE object.{shown}", {**create, "object": broken}
            yield f"UPDATE object.{shown}", {**update, "object": broken}
            yield f"UPDATE oldObject.{shown}", {**update, "oldObject": broken}
            yield f"UPDATE/ephemeralcontainers object.{shown}", {**ephemeral, "object": broken}
    for base in (create, update, ephemeral):
        for path in _paths({k: v for k, v in base.items() if k not in ("object", "oldObject")}):
            for wrong in WRONG:
                yield f"{base['operation']} request.{path}={wrong!r}", _replaced(base, path, wrong)
        for field in ("object", "oldObject"):
            for wrong in WRONG:
                yield f"{base['operation']} request.{field}={wrong!r}", {**base, field: wrong}


Reviewer = Callable[..., Decision]


def test_the_valid_pod_passes_both_webhooks_unchanged() -> None:
    """Else the property would test denials only."""
    for req in (request(VALID), request(VALID, old=VALID),
                request(VALID, old=VALID, sub="ephemeralcontainers")):
        assert validate(req, CONFIG).allowed, validate(req, CONFIG).message
        decision = mutate(req, CONFIG)
        assert decision.allowed and decision.patch == (), decision


@pytest.mark.parametrize("reviewer", [validate, mutate], ids=["validate", "mutate"])
def test_no_field_of_the_wrong_shape_makes_a_review_raise(reviewer: Reviewer) -> None:
    raised: list[str] = []
    denied = 0
    for what, req in _reviews():
        try:
            decision = reviewer(req, CONFIG)
        except Exception as e:  # what the server answers as an internal error
            raised.append(f"{what}: {type(e).__name__}: {e}")
            continue
        if decision.allowed:
            continue
        denied += 1
        assert 400 <= decision.code < 500 and decision.message, (what, decision)
        if decision.code == 400:
            assert decision.reason == "BadRequest" and ": must be " in decision.message, \
                (what, decision)
    assert raised == [], f"{len(raised)} reviews raised:\n" + "\n".join(raised[:40])
    assert denied  # the property reached the checks


# -- the denials, word for word ----------------------------------------------------------------


def _denial(reviewer: Reviewer, req: dict[str, Any]) -> str:
    decision = reviewer(req, CONFIG)
    assert (decision.allowed, decision.code, decision.reason) == (False, 400, "BadRequest"), \
        decision
    assert decision.patch == ()
    return decision.message


@pytest.mark.parametrize("volumes", [5, True, "x", {"a": 1}])
def test_volumes_that_are_no_list_are_a_bad_request(volumes: Any) -> None:
    """/validate raised a TypeError on a number or a boolean (an internal error)."""
    obj = pod({}, volumes=volumes)
    assert _denial(validate, request(obj)) == (
        f"spec.volumes: must be a list, got {type(volumes).__name__}")
    # in the old object of an UPDATE too, named as such
    assert _denial(validate, request(pod({}), old=obj)) == (
        f"request.oldObject.spec.volumes: must be a list, got {type(volumes).__name__}")


@pytest.mark.parametrize("env", [5, True, "NVIDIA_VISIBLE_DEVICES=all", {"a": 1}])
def test_env_that_is_no_list_is_a_bad_request(env: Any) -> None:
    """/mutate raised a TypeError on a number in a fractional pod's container (an internal
    error); a string or an object were read as a list of their characters or keys."""
    obj = pod(SM)
    obj["spec"]["containers"][0]["env"] = env
    for reviewer in (mutate, validate):
        assert _denial(reviewer, request(obj)) == (
            f"spec.containers[0].env: must be a list, got {type(env).__name__}")


@pytest.mark.parametrize(("where", "value", "message"), [
    (("spec", "containers", 0, "env", 0), 3,
     "spec.containers[0].env[0]: must be a mapping, got int"),
    (("spec", "containers", 0, "env", 0, "name"), ["A"],
     "spec.containers[0].env[0].name: must be a string, got list"),
    (("spec", "containers", 1, "volumeMounts"), 1,
     "spec.containers[1].volumeMounts: must be a list, got int"),
    (("spec", "containers", 1, "volumeMounts", 0, "readOnly"), "true",
     "spec.containers[1].volumeMounts[0].readOnly: must be a boolean, got str"),
    (("spec", "containers", 0, "securityContext"), [],
     "spec.containers[0].securityContext: must be a mapping, got list"),
    (("spec", "containers", 0, "securityContext", "capabilities", "add"), "SYS_ADMIN",
     "spec.containers[0].securityContext.capabilities.add: must be a list, got str"),
    (("spec", "ephemeralContainers"), 1, "spec.ephemeralContainers: must be a list, got int"),
    (("spec", "ephemeralContainers", 0, "env"), 1,
     "spec.ephemeralContainers[0].env: must be a list, got int"),
    (("spec", "volumes", 0, "hostPath", "path"), ["/"],
     "spec.volumes[0].hostPath.path: must be a string, got list"),
    (("spec", "hostPID"), "true", "spec.hostPID: must be a boolean, got str"),
    (("metadata", "labels", "team"), 1,
     "metadata.labels['team']: must be a string, got 1 (int); quote the value in YAML"),
])
def test_each_wrong_shape_is_named_by_its_path_and_type(where: tuple[Any, ...], value: Any,
                                                        message: str) -> None:
    req = request(_replaced(VALID, where, value), old=VALID, sub="ephemeralcontainers")
    for reviewer in (validate, mutate):
        assert _denial(reviewer, req) == message


@pytest.mark.parametrize(("field", "value", "message"), [
    ("userInfo", "alice", "request.userInfo: must be a mapping, got str"),
    ("userInfo", {"username": ["alice"]},
     "request.userInfo.username: must be a string, got list"),
    ("object", 5, "request.object: must be a mapping, got int"),
    ("oldObject", [], "request.oldObject: must be a mapping, got list"),
    ("kind", "Pod", "request.kind: must be a mapping, got str"),
    ("operation", 1, "request.operation: must be a string, got int"),
    ("namespace", {"a": 1}, "request.namespace: must be a string, got dict"),
    ("subResource", ["status"], "request.subResource: must be a string, got list"),
])
def test_the_review_request_of_the_wrong_shape_is_a_bad_request(field: str, value: Any,
                                                               message: str) -> None:
    req = {**request(VALID, old=VALID), field: value}
    for reviewer in (validate, mutate):
        assert _denial(reviewer, req) == message


def test_a_workload_and_a_binding_of_the_wrong_shape_are_bad_requests() -> None:
    """Their metadata was read before any check (a number there raised)."""
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": 5,
                  "spec": {"template": {"spec": {"containers": []}}}}
    assert _denial(validate, request(deployment, kind="Deployment", group="apps")) == (
        "metadata: must be a mapping, got int")
    old = {**deployment, "metadata": {"name": "w"},
           "spec": {"template": {"metadata": {"annotations": []}}}}
    assert _denial(validate, request({**old}, old={**old}, kind="Deployment", group="apps")) == (
        "spec.template.metadata.annotations must be a mapping, got list")
    binding = {"apiVersion": "v1", "kind": "Binding", "metadata": {"annotations": {"a": 1}}}
    assert _denial(validate, request(binding, kind="Binding")) == (
        "metadata.annotations['a']: must be a string, got 1 (int); quote the value in YAML")


def test_offline_a_spec_of_the_wrong_shape_is_the_one_problem(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str],
                                                              ) -> None:
    """`kai-fractions validate` reads manifests no API server decoded, through the same
    `manifest_problems`: it raised a TypeError on `volumes: 5`; now the field is reported."""
    obj = pod(SM, volumes=5)
    obj["spec"]["containers"][0]["env"] = [{"name": "A", "value": "1"}]
    assert [p.text for p in manifest_problems(obj["spec"], parse_pod(
        view_from_pod_spec(obj["metadata"], obj["spec"]), CONFIG.keys), CONFIG)] == [
        "spec.volumes: must be a list, got int"]
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment",
                  "metadata": {"name": "w", "namespace": "ns"},
                  "spec": {"template": {"metadata": obj["metadata"], "spec": obj["spec"]}}}
    manifest = tmp_path / "pods.yaml"
    manifest.write_text(json.dumps(deployment))
    from kai_fractions.cli import main

    assert main(["validate", "-f", str(manifest)]) == 1
    assert capsys.readouterr().out == (
        f"{manifest}:1: Deployment/ns/w: spec.template.spec.volumes: must be a list, "
        "got int\n")
