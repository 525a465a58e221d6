"""The validating webhook as a pure function: contract, protected keys, gate integrity."""

from __future__ import annotations

import copy
import dataclasses
import re
from typing import Any

import jsonpatch
import pytest

from kai_fractions.admission import hostpaths
from kai_fractions.admission.config import AdmissionConfig
from kai_fractions.admission.errors import MAX_LISTED
from kai_fractions.admission.mutate import mutate
from kai_fractions.admission.validate import validate
from kai_fractions.contract import derived_annotations, parse_pod, plan_pod, view_from_pod_spec
from kai_fractions.contract.request import MAX_LISTED_WARNINGS

from .reviews import BINDER, CONFIG, GPU, MIRROR, SM, TS, pod, request

DEVICES = "nvidia.com/container.main.gpus.devices"
PORTION = "nvidia.com/container.main.gpu-compute.portion"
DERIVED = "kai-fractions.io/container.main.memory-limit-mib"
IDS = f"{BINDER}, {MIRROR}"


def mutated(obj: dict[str, Any], config: AdmissionConfig = CONFIG) -> dict[str, Any]:
    decision = mutate(request(obj), config)
    return jsonpatch.apply_patch(copy.deepcopy(obj), list(decision.patch))


@pytest.mark.parametrize(("old", "new", "action"), [
    ({}, {DEVICES: GPU}, "create"),
    ({DEVICES: GPU}, {DEVICES: GPU + ",GPU-ff"}, "change"),
    ({DEVICES: GPU}, {}, "remove"),
])
def test_protected_keys_are_the_binders_alone(old: dict, new: dict, action: str) -> None:
    d = validate(request(pod({**TS, **new}), old=pod({**TS, **old})), CONFIG)
    assert (d.allowed, d.code, d.message) == (False, 403, (
        f"{DEVICES}: is a protected key: only {IDS} may {action} it, not alice"))
    d = validate(request(pod({**TS, **new}), old=pod({**TS, **old}), user=BINDER), CONFIG)
    assert d.allowed


def test_every_protected_key_is_named_and_derived_keys_are_protected_too() -> None:
    d = validate(request(mutated(pod({**TS, DEVICES: GPU, PORTION: "0.5", DERIVED: "99999"}))),
                 CONFIG)
    assert d.message == "; ".join(
        f"{key}: is a protected key: only {IDS} may create it, not alice"
        for key in (DERIVED, PORTION, DEVICES))


def test_unchanged_protected_keys_pass_for_anyone() -> None:
    bound = {**TS, DEVICES: GPU, PORTION: "0.5"}
    old = pod(bound)
    new = pod(bound)
    new["metadata"]["labels"] = {"team": "a"}
    assert validate(request(new, old=old), CONFIG).allowed


def test_the_allowed_identities_are_configurable() -> None:
    config = AdmissionConfig(gate_image="img", allowed_identities=("system:serviceaccount:x:y",))
    d = validate(request(mutated(pod({**TS, DEVICES: GPU}), config), user=BINDER), config)
    assert d.message == (f"{DEVICES}: is a protected key: only system:serviceaccount:x:y may "
                         f"create it, not {BINDER}")


def test_an_anonymous_request_is_named_as_such() -> None:
    req = request(mutated(pod({**TS, DEVICES: GPU})))
    del req["userInfo"]
    assert validate(req, CONFIG).message.endswith("may create it, not an anonymous user")


def test_status_updates_cannot_smuggle_protected_keys() -> None:
    """pods/status may change metadata.annotations: it is reviewed like the pod."""
    d = validate(request(pod({**TS, DEVICES: GPU}), old=pod(TS), sub="status"), CONFIG)
    assert not d.allowed and d.message.startswith(f"{DEVICES}: is a protected key")


def test_a_binding_cannot_smuggle_protected_keys() -> None:
    """A Binding's annotations are copied onto the pod."""
    binding = {"apiVersion": "v1", "kind": "Binding",
               "metadata": {"name": "p", "annotations": {DEVICES: GPU}},
               "target": {"kind": "Node", "name": "n1"}}
    d = validate(request(binding, kind="Binding", sub="binding"), CONFIG)
    assert (d.allowed, d.message) == (False, (
        f"{DEVICES}: is a protected key: only {IDS} may create it, not alice"))
    assert validate(request(binding, kind="Binding", sub="binding", user=BINDER), CONFIG).allowed


def test_a_binding_never_carries_an_mps_namespace_whoever_binds() -> None:
    """The API server copies a Binding's annotations onto the pod without pod admission: a
    name there would part the pod's plans from the mount it was created with."""
    key = "kai-fractions.io/container.main.mps-namespace"
    binding = {"apiVersion": "v1", "kind": "Binding",
               "metadata": {"name": "p", "annotations": {key: "kf_" + "ee" * 10}},
               "target": {"kind": "Node", "name": "n1"}}
    for user in (BINDER, "alice"):
        d = validate(request(binding, kind="Binding", sub="binding", user=user), CONFIG)
        assert not d.allowed
        assert d.message.startswith(f"{key}: the MPS namespace is named once, when the pod is "
                                    "created; a Binding may not carry it")


BINDING_USER_KEYS = [
    ("nvidia.com/container.main.gpu-memory.request", "80Gi"),
    ("nvidia.com/container.main.gpu-memory.limit", "80Gi"),
    ("nvidia.com/container.main.gpu-compute.mode", "sm-sharing"),
    ("gpu-fraction", "0.9"), ("gpu-fraction.limit", "1"), ("gpu-memory", "81920"),
    ("gpu-memory.limit", "81920"), ("gpu-fraction-num-devices", "2"),
    ("gpu-fraction-container-name", "main"),
    ("kai.scheduler/container.main.gpu-memory.portion.limit", "1"),
]


@pytest.mark.parametrize(("key", "value"), BINDING_USER_KEYS,
                         ids=[key for key, _ in BINDING_USER_KEYS])
@pytest.mark.parametrize("sub", ["binding", ""], ids=["pods/binding", "bindings"])
def test_a_binding_may_not_change_user_owned_keys(key: str, value: str, sub: str) -> None:
    """The API server copies a Binding's annotations onto the pod without pod admission, and
    the review holds no pod to compare with, so no freeze or contract check can apply: only
    the allowed identities may bind with any NvFractions key (KAI's binder binds with
    annotations). The legacy `bindings` resource makes the same Binding, without a
    subresource."""
    binding = {"apiVersion": "v1", "kind": "Binding",
               "metadata": {"name": "p", "namespace": "ns", "annotations": {key: value}},
               "target": {"kind": "Node", "name": "n1"}}
    d = validate(request(binding, kind="Binding", sub=sub), CONFIG)
    assert (d.allowed, d.code, d.message) == (False, 403, (
        f"{key}: a Binding's annotations reach the pod without pod admission: only {IDS} may "
        "bind with an NvFractions key, not alice"))
    for user in (BINDER, MIRROR):
        assert validate(request(binding, kind="Binding", sub=sub, user=user), CONFIG).allowed
    binding["metadata"]["annotations"] = {"team": "a"}
    assert validate(request(binding, kind="Binding", sub=sub), CONFIG).allowed


def test_an_update_is_judged_by_the_errors_it_introduces() -> None:
    broken = pod({"nvidia.com/container.ghost.gpu-memory.request": "1Gi"})
    relabelled = copy.deepcopy(broken)
    relabelled["metadata"]["labels"] = {"x": "y"}
    assert validate(request(relabelled, old=broken), CONFIG).allowed
    worse = copy.deepcopy(broken)
    worse["metadata"]["annotations"]["gpu-fraction"] = "2"
    d = validate(request(worse, old=broken), CONFIG)
    assert (d.allowed, d.code, d.message) == (False, 422, (
        "gpu-fraction: must be a portion of one GPU, 0 < x < 1 (got '2')"))


def test_an_update_to_another_long_invalid_value_is_a_new_error() -> None:
    """Errors compare on their full value, not on their text, which leaves a long value out:
    a pod admitted with one invalid value may not take another."""
    before = pod({**TS, "gpu-fraction": "0." + "1" * 300})
    after = copy.deepcopy(before)
    after["metadata"]["annotations"]["gpu-fraction"] = "0." + "2" * 300
    relabelled = copy.deepcopy(before)
    relabelled["metadata"]["labels"] = {"x": "y"}
    assert validate(request(relabelled, old=before), CONFIG).allowed
    d = validate(request(after, old=before), CONFIG)
    assert (d.allowed, d.code) == (False, 422)
    assert d.message.startswith("gpu-fraction: ")


def test_delete_and_connect_are_allowed() -> None:
    for op in ("DELETE", "CONNECT"):
        req = request(pod({DEVICES: "junk"}))
        req["operation"] = op
        assert validate(req, CONFIG).allowed


def test_the_compute_mode_is_fixed_once_the_pod_exists() -> None:
    d = validate(request(pod(SM), old=pod(TS)), CONFIG)
    # (what sm-sharing wires that the pod lacks is named first: its env and mounts cannot
    # change after creation)
    assert d.message.startswith("spec.containers[0].env: container 'main' has the GPU fraction "
                                "but no CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
    assert d.message.endswith("; nvidia.com/container.main.gpu-compute.mode: the compute mode "
                              "is fixed once the pod exists (its env and mounts were wired "
                              "from it); create a new pod to change it")


def test_a_fraction_cannot_be_added_to_an_existing_pod() -> None:
    d = validate(request(pod(TS), old=pod({})), CONFIG)
    # (the pod has no gate either: its init containers cannot change after creation)
    assert d.message.startswith("spec.initContainers[0]: the first init container of a "
                                "fractional pod must be kai-fractions-gate")
    assert d.message.endswith("; nvidia.com/container.main.gpu-memory.request: "
                              "whether container "
                         "'main' has a GPU fraction is fixed once the pod exists (the admission "
                         "webhook wired its env and gate at creation); create a new pod instead")


def test_contract_warnings_are_passed_on() -> None:
    d = validate(request(mutated(pod({**TS, "kai.scheduler/gpu-compute-sharing-mode": "mps"}))),
                 CONFIG)
    assert d.allowed
    assert d.warnings == ("kai.scheduler/gpu-compute-sharing-mode: is ignored by KAI and by "
                          "kai_fractions; set nvidia.com/container.<container>.gpu-compute.mode "
                          "instead (got 'mps')",)


@pytest.mark.parametrize("annotations", [
    {"gpu-fraction-container-name": ""},
    {"gpu-fraction-container-name": "ghost"},
    {"nvidia.com/container.ghost.gpu-compute.mode": "time-slicing"},
], ids=["empty-name", "missing-name", "missing-mode"])
def test_a_pod_without_a_fraction_is_admitted_with_a_warning_as_kai_admits_it(
        annotations: dict[str, str]) -> None:
    """KAI's admission looks these keys up only for a pod that asks for a fraction (upstream
    KAI-Scheduler pkg/admission/webhook/v1alpha2/nvfractions/mutation.go, Mutate returns first
    unless RequestsGPUFraction, kai-scheduler/api utilities/resources/gpu_sharing.go), so both
    webhooks let an unchanged KAI manifest through, untouched, and say the key does nothing.
    Beside a fraction they are refused, as KAI refuses them."""
    [key] = annotations
    review = request(pod(annotations))
    for decision in (mutate(review, CONFIG), validate(review, CONFIG)):
        assert decision.allowed, decision.message
        assert decision.patch == ()
        [warning] = decision.warnings
        assert warning.startswith(f"{key}: ")
        assert "has no effect" in warning
    review = request(pod({**annotations, "gpu-fraction": "0.5"}))
    for decision in (mutate(review, CONFIG), validate(review, CONFIG)):
        assert not decision.allowed
        assert decision.message.startswith(f"{key}: ")



def test_the_warnings_of_a_pod_of_many_stray_keys_are_capped() -> None:
    """Thousands of keys that have no effect are admitted, as KAI admits them, but the review
    does not carry a warning each: MAX_LISTED_WARNINGS of them and one line counting the rest,
    on CREATE and on an UPDATE (pods/status) of the same pod."""
    stray = {f"nvidia.com/container.g{i}.gpu-compute.mode": "time-slicing" for i in range(500)}
    obj = pod(stray)
    for decision in (mutate(request(obj), CONFIG), validate(request(obj), CONFIG),
                     validate(request(obj, old=obj, sub="status"), CONFIG)):
        assert decision.allowed, decision.message
        assert decision.patch == ()
        assert len(decision.warnings) == MAX_LISTED_WARNINGS + 1
        assert all(w.startswith(f"nvidia.com/container.g{i}.gpu-compute.mode: has no effect")
                   for i, w in enumerate(decision.warnings[:-1]))
        assert decision.warnings[-1].startswith(
            "nvidia.com/container.<container>.gpu-compute.mode: and 480 more warning(s) of the "
            "same kind, not listed")


def test_a_refusal_of_many_bad_keys_lists_twenty_in_both_webhooks() -> None:
    """The same pod asking for a fraction makes each stray key an error: both webhooks list
    MAX_LISTED of them and count the rest (the mutating one joined all of them, 605 KB for a
    pod near the annotations' size limit)."""
    stray = {f"nvidia.com/container.g{i}.gpu-compute.mode": "time-slicing" for i in range(500)}
    obj = pod({**stray, "gpu-fraction": "0.5"})
    for decision in (mutate(request(obj), CONFIG), validate(request(obj), CONFIG)):
        assert not decision.allowed
        assert decision.message.count("gpu-compute.mode: ") == MAX_LISTED
        assert decision.message.endswith("and 480 more problem(s) of the same kinds")
        assert len(decision.message) < 10_000


def test_a_mutated_pod_passes() -> None:
    assert validate(request(mutated(pod(SM, containers=("main", "side")))), CONFIG).allowed


def test_only_the_gate_may_mount_the_marker_root() -> None:
    obj = mutated(pod(SM, containers=("main", "side")))
    obj["spec"]["containers"][1]["volumeMounts"] = [
        {"name": "kai-fractions-marker", "mountPath": "/forge"}]
    d = validate(request(obj), CONFIG)
    assert (d.allowed, d.code, d.message) == (False, 403, (
        "spec.containers[1].volumeMounts[0]: only the kai-fractions-gate init container may "
        "mount kai-fractions-marker"))


def test_the_gate_mounts_only_its_own_directory_read_only() -> None:
    obj = mutated(pod(SM))
    mount = obj["spec"]["initContainers"][0]["volumeMounts"][0]
    mount["readOnly"] = False
    d = validate(request(obj), CONFIG)
    # the gate differs from the injected one, and its mount is named
    assert d.message.startswith("spec.initContainers[0].volumeMounts: must be exactly what the "
                                "admission webhook injects into kai-fractions-gate")
    assert d.message.endswith("spec.initContainers[0].volumeMounts[0]: kai-fractions-gate must "
                              "mount kai-fractions-marker read-only with subPathExpr $(POD_UID)")


def test_only_the_sm_sharing_container_may_mount_the_mps_pipes() -> None:
    obj = mutated(pod(SM, containers=("main", "side")))
    obj["spec"]["containers"][1]["volumeMounts"] = [
        {"name": "kai-fractions-mps", "mountPath": "/run/kai-fractions/mps"}]
    d = validate(request(obj), CONFIG)
    assert d.message == ("spec.containers[1].volumeMounts[0]: only the sm-sharing container "
                         "of this pod may mount kai-fractions-mps")


def test_an_ephemeral_container_may_not_mount_the_marker_root() -> None:
    old = mutated(pod(SM))
    new = copy.deepcopy(old)
    new["spec"]["ephemeralContainers"] = [{
        "name": "debug", "image": "busybox",
        "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}],
        "volumeMounts": [{"name": "kai-fractions-marker", "mountPath": "/m"}]}]
    d = validate(request(new, old=old, sub="ephemeralcontainers"), CONFIG)
    assert d.message == ("spec.ephemeralContainers[0].volumeMounts[0]: only the "
                         "kai-fractions-gate init container may mount kai-fractions-marker")


@pytest.mark.parametrize("path", ["/", "/var/lib", "/var/lib/kai-fractions/markers/",
                                  "/var/lib/kai-fractions/markers/some-uid",
                                  # /proc/net -> self/net: `..` climbs to the process, whose
                                  # root is the host's
                                  "/proc/net/../root/var/lib/kai-fractions/markers"])
def test_no_other_host_path_may_reach_the_marker_root(path: str) -> None:
    obj = mutated(pod(TS))
    obj["spec"]["volumes"].append({"name": "host", "hostPath": {"path": path}})
    d = validate(request(obj), CONFIG)
    assert not d.allowed
    assert d.message.startswith(
        f"spec.volumes[2].hostPath.path: {path!r} reaches the kai-fractions directory "
        "'/var/lib/kai-fractions/markers'; only the webhook's own volume "
        "'kai-fractions-marker' may")


def test_the_reserved_volumes_point_at_the_configured_directories() -> None:
    obj = mutated(pod(TS))
    obj["spec"]["volumes"][0]["hostPath"]["path"] = "/tmp"
    d = validate(request(obj), CONFIG)
    assert d.message == ("spec.volumes[0].hostPath.path: volume 'kai-fractions-marker' must be "
                         "the host directory '/var/lib/kai-fractions/markers', not '/tmp'")


def test_the_mps_volume_is_the_server_directory_not_the_pipe_root() -> None:
    """The pipe root holds a v3 daemon's control socket: a new sm-sharing pod mounts only
    `<root>/shared`, its namespaces; a pod wired before that (the root) can still be updated."""
    obj = mutated(pod(SM))
    mps = next(v for v in obj["spec"]["volumes"] if v["name"] == "kai-fractions-mps")
    assert mps["hostPath"]["path"] == "/run/kai-fractions/mps/shared"
    older = copy.deepcopy(obj)
    next(v for v in older["spec"]["volumes"]
         if v["name"] == "kai-fractions-mps")["hostPath"]["path"] = "/run/kai-fractions/mps"
    d = validate(request(older), CONFIG)
    assert d.message == ("spec.volumes[2].hostPath.path: volume 'kai-fractions-mps' must be "
                         "the host directory '/run/kai-fractions/mps/shared', not "
                         "'/run/kai-fractions/mps'")
    relabelled = copy.deepcopy(older)
    relabelled["metadata"].setdefault("labels", {})["team"] = "b"
    assert validate(request(relabelled, old=older), CONFIG).allowed


def test_host_paths_elsewhere_pass_and_non_fractional_pods_are_checked_too() -> None:
    obj = mutated(pod(TS))
    obj["spec"]["volumes"].append({"name": "logs", "hostPath": {"path": "/var/log"}})
    assert validate(request(obj), CONFIG).allowed
    # Any pod in a namespace the webhook covers: the node agent's own pod lives in the
    # release's namespace, which the chart leaves out of the webhook.
    other = pod({}, volumes=[{"name": "m", "hostPath": {"path": "/var/lib/kai-fractions"}}])
    d = validate(request(other), CONFIG)
    assert (d.allowed, d.message) == (False, (
        "spec.volumes[0].hostPath.path: '/var/lib/kai-fractions' reaches the kai-fractions "
        "directory '/var/lib/kai-fractions/markers'; only the webhook's own volume "
        "'kai-fractions-marker' may (to admit a trusted host agent without NvFractions keys, "
        "exempt its namespace: the label kai-fractions.io/webhook=disabled, or the chart's "
        "webhook.hostPathExemptNamespaces)"))


def test_a_host_path_refusal_ends_with_the_exemption_hint_once() -> None:
    """A host agent mounting `/` reaches all three directories: one hint, at the very end."""
    agent = pod({}, volumes=[{"name": "root", "hostPath": {"path": "/"}},
                             {"name": "proc", "hostPath": {"path": "/proc"}}])
    d = validate(request(agent), CONFIG)
    assert not d.allowed
    assert d.message.count("reaches the kai-fractions directory") == 6  # 3 each
    assert d.message.count("webhook.hostPathExemptNamespaces") == 1
    assert d.message.endswith("the label kai-fractions.io/webhook=disabled, or the chart's "
                              "webhook.hostPathExemptNamespaces)")


def test_a_host_path_longer_than_path_max_is_refused_before_it_is_resolved() -> None:
    """The kernel opens no path of PATH_MAX (4096) bytes or more: such a path is refused up
    front, quoted cut, whatever it would resolve to."""
    path = "/var/run" + "/a" * 600_000
    d = validate(request(pod({}, volumes=[{"name": "x", "hostPath": {"path": path}}])), CONFIG)
    assert (d.allowed, d.message) == (False, (
        "spec.volumes[0].hostPath.path: must be shorter than PATH_MAX (4096 bytes), the longest "
        f"path the kernel opens (got {path[:80]!r}... ({len(path)} characters))"))
    # counted in bytes, as the kernel does
    wide = "/" + "\u00e9" * 2048
    d = validate(request(pod({}, volumes=[{"name": "x", "hostPath": {"path": wide}}])), CONFIG)
    assert "must be shorter than PATH_MAX" in d.message
    assert validate(request(pod({}, volumes=[{"name": "x", "hostPath": {
        "path": "/data" + "/a" * 2045}}])), CONFIG).allowed  # 4095 bytes


def test_each_host_path_is_resolved_once(monkeypatch: pytest.MonkeyPatch) -> None:
    resolved: list[str] = []
    real = hostpaths.canonical

    def counting(path: str) -> str:
        resolved.append(path)
        return real(path)

    monkeypatch.setattr(hostpaths, "canonical", counting)
    obj = pod({}, volumes=[{"name": "x", "hostPath": {"path": "/var/run/x/../y"}},
                           {"name": "y", "hostPath": {"path": "/"}}])
    assert not validate(request(obj), CONFIG).allowed
    assert resolved.count("/var/run/x/../y") == 1
    assert resolved.count("/") == 1


def test_a_long_path_is_quoted_cut_in_every_problem_it_causes() -> None:
    path = "/" + "a/../" * 800  # 4001 characters, resolves to `/`: four problems
    d = validate(request(pod({}, volumes=[{"name": "x", "hostPath": {"path": path}}])), CONFIG)
    assert d.message.count("reaches the kai-fractions directory") == 3
    assert d.message.count("reaches the kubelet's pods directory") == 1
    assert d.message.count(f"{path[:80]!r}... ({len(path)} characters)") == 4
    assert len(d.message) < 1600  # the 4001 characters are never repeated


def test_a_denial_lists_at_most_twenty_problems() -> None:
    volumes = [{"name": f"v{i}", "hostPath": {"path": "/"}} for i in range(100)]
    d = validate(request(pod({}, volumes=volumes)), CONFIG)
    assert d.message.count("reaches the kai-fractions directory") == 15
    assert d.message.count("reaches the kubelet's pods directory") == 5
    assert d.message.endswith("spec.volumes[4].hostPath.path: '/' reaches the kubelet's pods "
                              "directory '/var/lib/kubelet/pods'; no volume may: the kubelet "
                              "mounts every pod's subPath volumes read-write under it, the gate's "
                              "marker directory and the MPS namespaces included (to admit a "
                              "trusted host agent without NvFractions keys, exempt its "
                              "namespace: the label kai-fractions.io/webhook=disabled, or the "
                              "chart's webhook.hostPathExemptNamespaces); and 380 more "
                              "problem(s) of the same kinds")


def test_a_gate_image_that_reads_the_same_once_cut_is_still_another_image() -> None:
    """A problem the old pod already had is not held against an update: compared on the full
    value, so a gate image of 120 characters or more cannot be swapped for another one that
    shares its first 119 (`kubectl set image` on a pod admitted by an older release)."""
    registry = ("123456789012.dkr.ecr.eu-central-1.amazonaws.com/platform-mirror/ghcr.io/"
                "example-org/gpu/accelerators/")
    before = dataclasses.replace(CONFIG, gate_image=registry + "kai-fractions/gate:0.3.0")
    now = dataclasses.replace(CONFIG, gate_image=registry + "kai-fractions/gate:0.4.0")
    old = mutated(pod(TS), before)
    old["metadata"]["annotations"].update({DEVICES: GPU, PORTION: "0.25"})
    relabelled = copy.deepcopy(old)
    relabelled["metadata"]["labels"] = {"team": "a"}
    assert validate(request(relabelled, old=old), now).allowed
    swapped = copy.deepcopy(old)
    image = old["spec"]["initContainers"][0]["image"]
    assert len(image) >= 120
    evil = image[:119] + "x" * (len(image) - 119)  # as long, so it reads the same once cut
    swapped["spec"]["initContainers"][0]["image"] = evil
    d = validate(request(swapped, old=old), now)
    assert not d.allowed
    assert d.message.startswith("spec.initContainers[0].image: must be exactly what the "
                                "admission webhook injects into kai-fractions-gate")


def in_template(template: dict[str, Any]) -> dict[str, Any]:
    return {"template": template}


def in_job_template(template: dict[str, Any]) -> dict[str, Any]:
    return {"jobTemplate": {"spec": {"template": template}}}


@pytest.mark.parametrize(("kind", "group", "spec_of"), [
    ("Deployment", "apps", in_template),
    ("StatefulSet", "apps", in_template),
    ("DaemonSet", "apps", in_template),
    ("ReplicaSet", "apps", in_template),
    ("Job", "batch", in_template),
    ("CronJob", "batch", in_job_template),
])
def test_workload_templates_get_early_feedback(kind: str, group: str, spec_of: Any) -> None:
    def workload(annotations: dict[str, str]) -> dict[str, Any]:
        template = {"metadata": {"annotations": annotations},
                    "spec": {"containers": [{"name": "main", "image": "img"}]}}
        return {"apiVersion": f"{group}/v1", "kind": kind,
                "metadata": {"name": "w", "namespace": "ns"}, "spec": spec_of(template)}

    assert validate(request(workload(TS), kind=kind, group=group), CONFIG).allowed
    d = validate(request(workload({"nvidia.com/container.main.gpu-memory.request": "0"}),
                         kind=kind, group=group), CONFIG)
    assert (d.allowed, d.code) == (False, 422)
    assert d.message.startswith("nvidia.com/container.main.gpu-memory.request: ")
    d = validate(request(workload({**TS, DEVICES: GPU}), kind=kind, group=group, user=BINDER),
                 CONFIG)
    assert d.message == (f"{DEVICES}: a pod template may not carry a protected key; the "
                         "binder writes it on each pod after scheduling")


def test_a_workload_that_already_carried_a_protected_key_can_still_be_updated() -> None:
    template = {"metadata": {"annotations": {**TS, DEVICES: GPU}},
                "spec": {"containers": [{"name": "main", "image": "img"}]}}
    old = {"apiVersion": "apps/v1", "kind": "Deployment",
           "metadata": {"name": "w", "namespace": "ns"}, "spec": {"template": template}}
    new = copy.deepcopy(old)
    new["metadata"]["finalizers"] = []
    assert validate(request(new, old=old, kind="Deployment", group="apps"), CONFIG).allowed


def test_a_malformed_object_is_a_bad_request_not_a_crash() -> None:
    obj = pod(TS)
    obj["metadata"]["annotations"] = ["not", "a", "map"]
    d = validate(request(obj), CONFIG)
    assert (d.allowed, d.code, d.reason) == (False, 400, "BadRequest")
    assert d.message == "metadata.annotations: must be a mapping, got list"


def test_other_kinds_pass() -> None:
    assert validate(request({"kind": "ConfigMap"}, kind="ConfigMap"), CONFIG).allowed


# -- the container's own MPS namespace --------------------------------------------------------

NS_KEY = "kai-fractions.io/container.main.mps-namespace"


def own_mount(obj: dict[str, Any]) -> dict[str, Any]:
    return next(m for m in obj["spec"]["containers"][0]["volumeMounts"]
                if m["name"] == "kai-fractions-mps")


def test_the_creator_may_bring_the_namespace_the_mutating_webhook_named() -> None:
    """The webhook writes the protected key on the creator's behalf, at CREATE only."""
    obj = mutated(pod(SM))
    assert validate(request(obj), CONFIG).allowed
    later = copy.deepcopy(obj)
    later["metadata"]["annotations"][NS_KEY] = "kf_" + "ee" * 10
    d = validate(request(later, old=obj), CONFIG)
    assert d.message.startswith(f"{NS_KEY}: is a protected key: only ")
    assert "may change it, not alice; " in d.message  # and the mount no longer matches it


def test_the_namespace_key_stays_protected_on_a_time_slicing_pod() -> None:
    """It names nothing there, so nothing wrote it on the creator's behalf."""
    obj = mutated(pod({**TS, NS_KEY: "kf_" + "ee" * 10}))
    d = validate(request(obj), CONFIG)
    assert d.message.startswith(f"{NS_KEY}: is a protected key: only ")


@pytest.mark.parametrize(("field", "value"), [
    ("subPath", None),  # the whole server directory: every namespace of the node
    ("subPath", "kf_" + "ee" * 10),  # another namespace
    ("subPath", "legacy"),  # a legacy daemon's own directory
    ("mountPath", "/run/kai-fractions/mps/shared"),
    ("subPathExpr", "$(NS)"),
])
def test_a_new_sm_sharing_pod_mounts_only_its_own_namespace(field: str, value: Any) -> None:
    obj = mutated(pod(SM))
    mount = own_mount(obj)
    ns = mount["subPath"]
    if value is None:
        del mount[field]
    else:
        mount[field] = value
    d = validate(request(obj), CONFIG)
    assert d.message == (
        "spec.containers[0].volumeMounts[0]: must mount only the container's own MPS "
        f"namespace, read-write, exactly {{'name': 'kai-fractions-mps', 'mountPath': "
        f"'/run/kai-fractions/mps/shared/{ns}', 'subPath': '{ns}'}}")


def test_an_sm_sharing_pod_the_mutating_webhook_did_not_name_is_refused() -> None:
    obj = mutated(pod(SM))
    del obj["metadata"]["annotations"][NS_KEY]
    d = validate(request(obj), CONFIG)
    assert d.message == (
        "spec.containers[0].volumeMounts[0]: the container has no MPS namespace of its own "
        f"({NS_KEY} is missing; the mutating webhook names one when the pod is created)")


def test_a_pod_wired_to_the_whole_server_directory_before_can_still_be_updated() -> None:
    """Pods admitted by an older webhook keep their mount of every namespace (and the agent
    keeps their UID-derived namespace) until they are recreated."""
    obj = mutated(pod(SM))
    del obj["metadata"]["annotations"][NS_KEY]
    mount = own_mount(obj)
    del mount["subPath"]
    mount["mountPath"] = "/run/kai-fractions/mps/shared"
    relabelled = copy.deepcopy(obj)
    relabelled["metadata"].setdefault("labels", {})["team"] = "b"
    assert validate(request(relabelled, old=obj), CONFIG).allowed


def test_a_fractional_container_with_the_gates_name_is_refused_here_too() -> None:
    key = "nvidia.com/container.kai-fractions-gate.gpu-memory.request"
    obj = pod({key: "8Gi"}, initContainers=[{"name": "kai-fractions-gate", "image": "train"}])
    d = validate(request(obj), CONFIG)
    assert not d.allowed
    assert (f"{key}: names container 'kai-fractions-gate', the name of the init container the "
            "admission webhook injects (its gate)") in d.message


def test_a_fractional_pods_host_path_refusal_names_no_exemption_that_cannot_apply() -> None:
    """The namespace exemptions (chart: webhook.hostPathExemptNamespaces) lift the host-path
    rule only for pods without NvFractions keys: a fractional pod's refusal says so, instead of
    pointing at an exemption that would change nothing for it."""
    obj = mutated(pod(TS))
    obj["spec"]["volumes"].append({"name": "k", "hostPath": {"path": "/var/lib/kubelet"}})
    d = validate(request(obj), CONFIG)
    assert not d.allowed
    assert "webhook.hostPathExemptNamespaces" not in d.message
    assert d.message.endswith(
        "(no namespace exemption lifts this for a pod with NvFractions keys: mount a narrower "
        "host directory, or run the host agent as a pod of its own without them)")
    # a KAI-dialect key counts too
    kai = pod({"gpu-fraction": "0.5"}, volumes=[{"name": "r", "hostPath": {"path": "/run"}}])
    assert "no namespace exemption lifts this" in validate(request(kai), CONFIG).message


def test_a_volume_name_of_the_wrong_shape_is_a_bad_request() -> None:
    """A volume named by a list (the API server decodes no such pod, but the webhook must not
    raise on one: a TypeError here was a 500 for the request) is refused for its shape, as
    every field the webhooks read is (tests/admission/test_shapes.py)."""
    obj = pod({}, volumes=[{"name": "ok"}, {"name": {"a": 1}}])
    d = validate(request(obj), CONFIG)
    assert (d.allowed, d.code, d.reason, d.message) == (
        False, 400, "BadRequest", "spec.volumes[1].name: must be a string, got dict")


@pytest.mark.parametrize("sub", ["exec", "attach"])
def test_no_process_may_join_the_gate(sub: str) -> None:
    """A process in the gate's process namespace, as its user, can make it exit 0 before the
    node agent applied the limits (ptrace): exec and attach into it are refused, as an
    ephemeral container targeting it is (`isolation`); into any other container they pass."""
    def connect(container: str | None, subresource: str = sub) -> dict[str, Any]:
        options: dict[str, Any] = {"kind": "PodExecOptions", "apiVersion": "v1"}
        if container is not None:
            options["container"] = container
        return {"uid": "u", "kind": {"group": "", "version": "v1", "kind": "PodExecOptions"},
                "operation": "CONNECT", "subResource": subresource, "namespace": "ns",
                "name": "p", "userInfo": {"username": BINDER}, "object": options}

    d = validate(connect("kai-fractions-gate"), CONFIG)
    assert (d.allowed, d.code, d.message) == (False, 403, (
        f"pods/{sub}: container 'kai-fractions-gate' is kai-fractions' gate: no process may "
        "join it while it waits for the node agent (one could make it exit before the pod's "
        "GPU limits are in force); its outcome is in `kubectl logs -c kai-fractions-gate` and "
        "the pod's status"))
    assert validate(connect("main"), CONFIG).allowed
    assert validate(connect(None), CONFIG).allowed
    assert validate(connect("kai-fractions-gate", "portforward"), CONFIG).allowed


# -- a pod the mutating webhook did not see ---------------------------------------------------
# The chart's webhook.objectSelector matches the pod's own labels, which its author writes: a
# pod can skip the mutating webhook and come to this one wired by hand (from `kubectl create
# --dry-run=server -o yaml`). What enforces its limits must then be checked here, on its own.

ANN = "kai-fractions.io/container.main"
SOURCES = {  # each enforced variable of `main` and the annotation it reads
    "NVIDIA_VISIBLE_DEVICES": DEVICES,
    "NVIDIA_GPU_MEMORY_REQUEST": f"{ANN}.memory-request-mib",
    "NVIDIA_GPU_MEMORY_LIMIT": f"{ANN}.memory-limit-mib",
    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"{ANN}.mps-pinned-mem-limit",
    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": f"{ANN}.mps-active-thread-percentage",
    "CUDA_MPS_PIPE_DIRECTORY": f"{ANN}.mps-pipe-directory",
}
ALL = {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}


def hand_wired(annotations: dict[str, str], **kw: Any) -> dict[str, Any]:
    """What a tenant pastes from a server-side dry run, labelled to skip the mutating webhook."""
    obj = mutated(pod(annotations, **kw))
    obj["metadata"]["labels"] = {"skip-mutation": "yes"}
    return obj


def main_env(obj: dict[str, Any]) -> list[dict[str, Any]]:
    return obj["spec"]["containers"][0]["env"]


def refusal(obj: dict[str, Any], **kw: Any) -> list[str]:
    d = validate(request(obj, **kw), CONFIG)
    assert not d.allowed
    assert d.code == 403
    return re.split(r"; (?=spec\.)", d.message)  # one problem each, as listed


def test_the_injected_env_reads_the_annotations_the_rules_name() -> None:
    """What the rules below compare with: each variable a fieldRef to its annotation."""
    for keys, names in ((TS, list(SOURCES)[:4]), (SM, list(SOURCES))):
        assert main_env(mutated(pod(keys))) == [
            {"name": name, "valueFrom": {"fieldRef": {
                "apiVersion": "v1", "fieldPath": f"metadata.annotations['{SOURCES[name]}']"}}}
            for name in names]


@pytest.mark.parametrize("annotations", [TS, SM], ids=["time-slicing", "sm-sharing"])
def test_the_fractional_container_may_not_see_every_gpu(annotations: dict[str, str]) -> None:
    """The reviewer's attack: the fractional container sets its own GPU env; the other
    containers are void and the gate is exact, so only this rule stands in the way."""
    obj = hand_wired(annotations, containers=("main", "side"))
    main_env(obj)[0] = ALL
    assert refusal(obj) == [
        "spec.containers[0].env[0]: NVIDIA_VISIBLE_DEVICES of container 'main', which has the "
        "GPU fraction, must be read from valueFrom.fieldRef.fieldPath "
        f"metadata.annotations['{DEVICES}'], as the admission webhook injects it: the node "
        "agent applies the pod's limits to what that annotation says (got "
        '{"name":"NVIDIA_VISIBLE_DEVICES","value":"all"})']


@pytest.mark.parametrize("annotations", [TS, SM], ids=["time-slicing", "sm-sharing"])
def test_the_fractional_container_may_not_drop_its_limits_env(
        annotations: dict[str, str]) -> None:
    obj = hand_wired(annotations)
    obj["spec"]["containers"][0]["env"] = [ALL]
    names = list(SOURCES) if annotations is SM else list(SOURCES)[:4]
    assert refusal(obj)[1:len(names)] == [
        f"spec.containers[0].env: container 'main' has the GPU fraction but no {name}: the "
        "admission webhook sets it from valueFrom.fieldRef.fieldPath "
        f"metadata.annotations['{SOURCES[name]}']" for name in names[1:]]


@pytest.mark.parametrize(("edit", "problem"), [
    # a second entry after the injected one: the last one wins
    (lambda env: env.append(ALL),
     "spec.containers[0].env[4]: NVIDIA_VISIBLE_DEVICES is set twice in container 'main' (the "
     "last one wins): only the entry the admission webhook injects may set it"),
    # an annotation the tenant writes instead of the binder's
    (lambda env: env[0]["valueFrom"]["fieldRef"].update(
        fieldPath="metadata.annotations['example.com/gpus']"),
     "spec.containers[0].env[0]: NVIDIA_VISIBLE_DEVICES of container 'main', which has the GPU "
     "fraction, must be read from valueFrom.fieldRef.fieldPath "
     f"metadata.annotations['{DEVICES}']"),
    (lambda env: env[2].update(valueFrom={"fieldRef": {"apiVersion": "v1",
                                                       "fieldPath": "metadata.name"}}),
     "spec.containers[0].env[2]: NVIDIA_GPU_MEMORY_LIMIT of container 'main', which has the "
     "GPU fraction, must be read from valueFrom.fieldRef.fieldPath "
     f"metadata.annotations['{SOURCES['NVIDIA_GPU_MEMORY_LIMIT']}']"),
    # the MPS variables are no time-slicing container's
    (lambda env: env.append({"name": "CUDA_MPS_PIPE_DIRECTORY", "value": "/tmp/mps"}),
     "spec.containers[0].env[4]: container 'main' (time-slicing) may not set "
     "CUDA_MPS_PIPE_DIRECTORY: the admission webhook sets only NVIDIA_VISIBLE_DEVICES, "
     "NVIDIA_GPU_MEMORY_REQUEST, NVIDIA_GPU_MEMORY_LIMIT, CUDA_MPS_PINNED_DEVICE_MEM_LIMIT there "
     '(got {"name":"CUDA_MPS_PIPE_DIRECTORY","value":"/tmp/mps"})'),
], ids=["twice", "another-annotation", "another-field", "mps-in-time-slicing"])
def test_the_fractional_containers_enforced_env_is_exactly_the_injected_one(
        edit: Any, problem: str) -> None:
    obj = hand_wired(TS)
    edit(main_env(obj))
    [message] = refusal(obj)
    assert message.startswith(problem)


def test_an_sm_sharing_container_keeps_its_mps_env() -> None:
    obj = hand_wired(SM)
    env = main_env(obj)
    env[5] = {"name": "CUDA_MPS_PIPE_DIRECTORY", "value": "/tmp/elsewhere"}
    del env[4]  # CUDA_MPS_ACTIVE_THREAD_PERCENTAGE: its compute cap
    assert refusal(obj) == [
        "spec.containers[0].env[4]: CUDA_MPS_PIPE_DIRECTORY of container 'main', which has the "
        "GPU fraction, must be read from valueFrom.fieldRef.fieldPath "
        f"metadata.annotations['{SOURCES['CUDA_MPS_PIPE_DIRECTORY']}'], as the admission "
        "webhook injects it: the node agent applies the pod's limits to what that annotation "
        'says (got {"name":"CUDA_MPS_PIPE_DIRECTORY","value":"/tmp/elsewhere"})',
        "spec.containers[0].env: container 'main' has the GPU fraction but no "
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE: the admission webhook sets it from "
        "valueFrom.fieldRef.fieldPath "
        f"metadata.annotations['{SOURCES['CUDA_MPS_ACTIVE_THREAD_PERCENTAGE']}']"]


def test_the_pods_own_env_of_other_names_stays_allowed() -> None:
    """Only the enforced names are the webhook's: the pod's own variables, before or after
    them, and ones that refer to them, pass wired by hand or by the mutating webhook."""
    own = [{"name": "CUDA_VISIBLE_DEVICES", "value": "0"},
           {"name": "MY_GPUS", "value": "$(NVIDIA_VISIBLE_DEVICES)"},
           {"name": "NVIDIA_DRIVER_CAPABILITIES", "value": "compute,utility"}]
    for keys in (TS, SM):
        obj = hand_wired(keys)
        obj["spec"]["containers"][0]["env"] = [own[0], *main_env(obj), *own[1:]]
        assert validate(request(obj), CONFIG).allowed
        brought = pod(keys)
        brought["spec"]["containers"][0]["env"] = [*own, ALL]
        assert validate(request(mutated(brought)), CONFIG).allowed


def test_the_fractional_init_container_is_held_to_the_same_env() -> None:
    key = "nvidia.com/container.prep.gpu-memory.request"
    obj = mutated(pod({key: "8Gi"}, initContainers=[{"name": "prep", "image": "img"}]))
    assert validate(request(obj), CONFIG).allowed
    prep = obj["spec"]["initContainers"][1]
    assert prep["name"] == "prep"
    prep["env"][0] = ALL
    assert refusal(obj)[0].startswith(
        "spec.initContainers[1].env[0]: NVIDIA_VISIBLE_DEVICES of container 'prep', which has "
        "the GPU fraction, must be read from")


def test_an_sm_sharing_container_must_mount_its_own_namespace() -> None:
    """Without it CUDA_MPS_PIPE_DIRECTORY leads nowhere: the container runs outside the MPS
    server and its compute cap never applies. The reviewer's probe dropped the env too."""
    obj = hand_wired(SM)
    ns = own_mount(obj)["subPath"]
    del obj["spec"]["containers"][0]["volumeMounts"]
    assert refusal(obj) == [
        "spec.containers[0].volumeMounts: sm-sharing container 'main' must mount its own MPS "
        f"namespace, exactly {{'name': 'kai-fractions-mps', 'mountPath': "
        f"'/run/kai-fractions/mps/shared/{ns}', 'subPath': '{ns}'}}, as the admission webhook "
        "injects it: without it the container runs outside the MPS server and its compute cap "
        "never applies"]
    main_env(obj)[:] = [ALL]
    assert len(refusal(obj)) == 7  # the six variables and the mount
    # nor read-only: an MPS client writes into its pipes
    read_only = hand_wired(SM)
    own_mount(read_only)["readOnly"] = True
    ns = own_mount(read_only)["subPath"]
    assert refusal(read_only) == [
        "spec.containers[0].volumeMounts[0]: must mount only the container's own MPS namespace, "
        f"read-write, exactly {{'name': 'kai-fractions-mps', 'mountPath': "
        f"'/run/kai-fractions/mps/shared/{ns}', 'subPath': '{ns}'}}"]
    # and with no namespace named, it has nothing to mount
    unnamed = hand_wired(SM)
    del unnamed["metadata"]["annotations"][NS_KEY]
    del unnamed["spec"]["containers"][0]["volumeMounts"]
    assert refusal(unnamed) == [
        "spec.containers[0].volumeMounts: sm-sharing container 'main' must mount its own MPS "
        f"namespace (kai-fractions-mps), and it has none ({NS_KEY} is missing; the mutating "
        "webhook names one when the pod is created)"]


TENANT_SOURCES = [{"nfs": {"server": "nfs.example.com", "path": "/m"}},
                  {"persistentVolumeClaim": {"claimName": "rwx"}},
                  {"emptyDir": {}}]


@pytest.mark.parametrize("source", TENANT_SOURCES, ids=lambda s: next(iter(s)))
@pytest.mark.parametrize(("name", "directory"), [
    ("kai-fractions-marker", "/var/lib/kai-fractions/markers"),
    ("kai-fractions-mps", "/run/kai-fractions/mps/shared"),
])
def test_the_marker_and_mps_volumes_are_the_host_directories(
        name: str, directory: str, source: dict[str, Any]) -> None:
    """A marker volume the tenant writes lets it write its own marker (it carries no secret:
    a digest of the annotations, the pod UID and the node's boot id) and release the gate."""
    obj = hand_wired(SM)
    volumes = obj["spec"]["volumes"]
    i = next(i for i, v in enumerate(volumes) if v["name"] == name)
    volumes[i] = {"name": name, **source}
    role = ("the gate releases the workload on the node agent's marker there, which only the "
            "node agent may write" if name == "kai-fractions-marker" else
            "the MPS server's pipes, where the container's compute cap is enforced")
    assert refusal(obj) == [
        f"spec.volumes[{i}]: volume {name!r} must be a hostPath volume of the host directory "
        f"{directory!r}, as the admission webhook injects it ({role}), not {next(iter(source))}"]
    # a second source beside the hostPath (the API server refuses it; this webhook too)
    both = hand_wired(SM)
    both["spec"]["volumes"][i].update(source)
    assert refusal(both)[0].endswith(f"not {' and '.join(sorted(['hostPath', *source]))}")


@pytest.mark.parametrize("podinfo", [
    {"configMap": {"name": "forged"}},
    {"downwardAPI": {"items": [{"path": "annotations", "fieldRef": {
        "apiVersion": "v1", "fieldPath": "metadata.labels"}}]}},
    {"projected": {"sources": [{"configMap": {"name": "forged"}}]}},
], ids=["configMap", "labels", "projected"])
def test_the_podinfo_volume_is_the_pods_own_annotations(podinfo: dict[str, Any]) -> None:
    obj = hand_wired(TS)
    obj["spec"]["volumes"][1] = {"name": "kai-fractions-podinfo", **podinfo}
    [message] = refusal(obj)
    assert message.startswith(
        "spec.volumes[1]: volume 'kai-fractions-podinfo' must be the downward API volume of the "
        "pod's annotations the admission webhook injects (the gate checks the marker against "
        'the pod\'s annotations there), {"defaultMode":420,"items":[{"fieldRef":'
        '{"apiVersion":"v1","fieldPath":"metadata.annotations"},"path":"annotations"}]} (got ')


def test_the_reserved_volumes_must_be_there() -> None:
    obj = hand_wired(SM)
    obj["spec"]["volumes"] = []
    assert refusal(obj) == [
        f"spec.volumes: a fractional pod must have volume {name!r} as the admission webhook "
        f"injects it ({role})" for name, role in (
            ("kai-fractions-marker", "the gate releases the workload on the node agent's "
             "marker there, which only the node agent may write"),
            ("kai-fractions-podinfo", "the gate checks the marker against the pod's "
             "annotations there"),
            ("kai-fractions-mps", "the MPS server's pipes, where the container's compute cap "
             "is enforced"))]


def test_a_pod_without_a_fraction_may_name_a_volume_so() -> None:
    """The rules are a wired pod's: another pod's volume of that name gates nothing."""
    plain = pod({}, volumes=[{"name": "kai-fractions-marker", "emptyDir": {}}])
    assert validate(request(plain), CONFIG).allowed


def bind(obj: dict[str, Any]) -> dict[str, Any]:
    """`obj` as KAI's binder leaves it: the devices and portion on it."""
    out = copy.deepcopy(obj)
    out["metadata"]["annotations"].update({DEVICES: GPU, PORTION: "0.5"})
    return out


def derive(obj: dict[str, Any]) -> dict[str, Any]:
    """`obj` with the derived annotations the mirror writes once it is bound."""
    out = copy.deepcopy(obj)
    view = view_from_pod_spec({**out["metadata"], "uid": "u-1"}, out["spec"], namespace="ns")
    [plan] = plan_pod(parse_pod(view))
    out["metadata"]["annotations"].update(derived_annotations(plan))
    return out


@pytest.mark.parametrize("annotations", [TS, SM], ids=["time-slicing", "sm-sharing"])
def test_a_wired_pod_passes_every_update_of_its_life(annotations: dict[str, str]) -> None:
    """Created through both webhooks, bound by KAI's binder, derived by the mirror, its
    status written by the kubelet: each request passes."""
    created = mutated(pod(annotations, containers=("main", "side")))
    assert validate(request(created), CONFIG).allowed
    bound = bind(created)
    assert validate(request(bound, old=created, user=BINDER), CONFIG).allowed
    derived = derive(bound)
    assert validate(request(derived, old=bound, user=MIRROR), CONFIG).allowed
    running = copy.deepcopy(derived)
    running["status"] = {"phase": "Running"}
    assert validate(request(running, old=derived, user="system:node:n1", sub="status"),
                    CONFIG).allowed


@pytest.mark.parametrize("sub", ["", "status"])
def test_an_update_is_held_to_the_wiring_too(sub: str) -> None:
    """The API server keeps a pod's env and volumes as created, but this webhook does not count
    on it: an update that brings a hand-wired spec is refused like a creation."""
    old = bind(mutated(pod(TS)))
    new = copy.deepcopy(old)
    main_env(new)[0] = ALL
    new["spec"]["volumes"][0] = {"name": "kai-fractions-marker", "emptyDir": {}}
    assert [m.split(":")[0] for m in refusal(new, old=old, user=BINDER, sub=sub)] == [
        "spec.containers[0].env[0]", "spec.volumes[0]"]
