"""AdmissionReview input at random (random annotations, random shapes, random users and
operations) through the validating and mutating webhooks: always a well-formed AdmissionReview
response, never an exception; an allowed mutation is a JSON patch that applies to the object,
and re-reviewing the patched pod changes nothing more."""

from __future__ import annotations

import base64
import json

import jsonpatch
from hypothesis import event, given
from hypothesis import strategies as st

from kai_fractions.admission.config import DEFAULT_ALLOWED_IDENTITIES, AdmissionConfig
from kai_fractions.admission.mutate import mutate
from kai_fractions.admission.review import ReviewError, parse_review, response
from kai_fractions.admission.validate import validate

from .strategies import FUZZ, annotations, containers, json_values

CONFIG = AdmissionConfig(gate_image="registry.invalid/kai-fractions:test")
users = st.one_of(st.sampled_from([*DEFAULT_ALLOWED_IDENTITIES, "alice", ""]),
                  st.text(max_size=20))
# Weighted towards what the webhooks act on (a Pod CREATE/UPDATE); the rest still appears.
operations = st.one_of(st.just("CREATE"), st.just("UPDATE"),
                       st.sampled_from(["CREATE", "UPDATE", "DELETE", "CONNECT"]),
                       st.text(max_size=8))
kinds = st.one_of(st.just("Pod"), st.just("Pod"),
                  st.sampled_from(["Pod", "Binding", "Deployment", "Job", "CronJob",
                                   "PodTemplate"]), st.text(max_size=10))
volumes = st.lists(st.one_of(
    st.builds(lambda name, path: {"name": name, "hostPath": {"path": path}},
              st.sampled_from(["kai-fractions-marker", "kai-fractions-mps", "data"]),
              st.sampled_from(["/var/lib/kai-fractions/markers", "/run/kai-fractions/mps",
                               "/var/lib", "/", "/data"])),
    st.builds(lambda name: {"name": name, "emptyDir": {}}, st.text(max_size=10)),
    json_values), max_size=3)


def pod(anns, cs, vols, env, init_gate: bool) -> dict:
    cs = [dict(c) for c in cs]
    if cs and env:
        cs[0]["env"] = [{"name": "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "value": "0=99999M"}]
    spec: dict = {"containers": cs, "volumes": vols}
    if init_gate:
        spec["initContainers"] = [{"name": "kai-fractions-gate", "image": "x",
                                   "volumeMounts": [{"name": "kai-fractions-marker",
                                                     "mountPath": "/m"}]}]
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "fuzz", "namespace": "team-a", "annotations": anns},
            "spec": spec}


pods = st.builds(pod, annotations, containers, volumes, st.booleans(), st.booleans())
_FRACTIONAL = [
    {"gpu-fraction": "0.5"},
    {"nvidia.com/container.main.gpu-memory.request": "10Gi"},
    {"nvidia.com/container.main.gpu-memory.limit": "12Gi",
     "nvidia.com/container.main.gpu-compute.mode": "sm-sharing"},
    {"gpu-memory": "8192"},
]
# Mostly valid fractional pods (plus noise), so the mutating webhook's patch path is reached.
fractional_pods = st.builds(
    pod,
    st.one_of(st.sampled_from(_FRACTIONAL),
              st.builds(lambda a, b: {**a, **b}, st.sampled_from(_FRACTIONAL), annotations)),
    st.builds(lambda extra: [{"name": "main", "image": "registry.invalid/app:1"}, *extra],
              containers),
    st.one_of(st.just([]), volumes), st.booleans(), st.booleans())
objects = st.one_of(fractional_pods, fractional_pods, pods, json_values)


def workload(obj):
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "w"},
            "spec": {"template": obj if isinstance(obj, dict) else {}}}


@st.composite
def reviews(draw) -> dict:
    if draw(st.booleans()):  # half: a fractional pod being created, what the webhooks are for
        return _review("Pod", "CREATE", draw(fractional_pods), None, draw)
    return _review(draw(kinds), draw(operations), draw(objects),
                   draw(st.one_of(st.none(), objects)), draw, sub=True)


def _review(kind, operation, obj, old, draw, sub: bool = False) -> dict:
    if kind in ("Deployment", "Job") and draw(st.booleans()):
        obj, old = workload(obj), workload(old) if old is not None else None
    request = {"uid": draw(st.text(min_size=1, max_size=12)),
               "kind": {"group": "", "version": "v1", "kind": kind},
               "operation": operation, "namespace": "team-a",
               "userInfo": {"username": draw(users)}, "object": obj}
    if old is not None:
        request["oldObject"] = old
    if sub and draw(st.integers(0, 3)) == 0:
        request["subResource"] = draw(st.sampled_from(["status", "binding", "ephemeralcontainers"]))
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}


def well_formed(review: dict, reviewer) -> dict:
    request = parse_review(json.dumps(review).encode())
    decision = reviewer(request, CONFIG)
    out = json.loads(json.dumps(response(request["uid"], decision)))
    assert out["apiVersion"] == "admission.k8s.io/v1" and out["kind"] == "AdmissionReview"
    body = out["response"]
    assert body["uid"] == request["uid"] and isinstance(body["allowed"], bool)
    if not body["allowed"]:
        assert isinstance(body["status"]["code"], int) and 400 <= body["status"]["code"] < 500
        assert isinstance(body["status"]["message"], str) and body["status"]["message"]
    if "patch" in body:
        assert body["allowed"] and body["patchType"] == "JSONPatch"
        assert isinstance(json.loads(base64.b64decode(body["patch"])), list)
    for warning in body.get("warnings", []):
        assert isinstance(warning, str)
    event(f"{reviewer.__name__}: {'allowed' if body['allowed'] else 'denied'}"
          f"{' with a patch' if 'patch' in body else ''}")
    return body


@FUZZ
@given(reviews())
def test_validating_reviews_are_well_formed(review):
    well_formed(review, validate)


@FUZZ
@given(reviews())
def test_mutating_reviews_are_well_formed_and_patches_apply_once(review):
    body = well_formed(review, mutate)
    if "patch" not in body:
        return
    patch = json.loads(base64.b64decode(body["patch"]))
    patched = jsonpatch.apply_patch(review["request"]["object"], patch)
    again = {**review, "request": {**review["request"], "object": patched}}
    assert "patch" not in well_formed(again, mutate)  # reinvocation changes nothing


@FUZZ
@given(st.sampled_from(["Pod"]), st.one_of(fractional_pods, pods), st.sampled_from(["CREATE"]))
def test_pod_creations_are_well_formed(kind, obj, operation):
    review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
              "request": {"uid": "u-1", "kind": {"kind": kind}, "operation": operation,
                          "namespace": "team-a", "userInfo": {"username": "alice"},
                          "object": obj}}
    for reviewer in (validate, mutate):
        well_formed(review, reviewer)


@FUZZ
@given(st.one_of(st.binary(max_size=200), json_values.map(lambda v: json.dumps(v).encode()),
                 st.builds(lambda r: json.dumps({"apiVersion": "admission.k8s.io/v1",
                                                 "kind": "AdmissionReview",
                                                 "request": r}).encode(), json_values)))
def test_bodies_are_a_request_or_a_review_error(body):
    try:
        request = parse_review(body)
    except ReviewError as e:
        assert str(e)
    else:
        assert isinstance(request, dict) and request["uid"]
        for reviewer in (validate, mutate):
            reviewer(request, CONFIG)
