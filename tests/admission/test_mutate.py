"""The mutating webhook as a pure function: what it wires, what it replaces, idempotency."""

from __future__ import annotations

import copy
import dataclasses
import re
from typing import Any

import jsonpatch
import pytest

from kai_fractions.admission.config import AdmissionConfig
from kai_fractions.admission.mutate import mutate
from kai_fractions.admission.podspec import namespace_tag
from kai_fractions.contract import Keys

from .reviews import CONFIG, SM, TS, pod, request

RANDOM = "ab" * 6
NS = "kf_" + namespace_tag("ns") + RANDOM
"""The MPS namespace name `apply` has the webhook give a pod of namespace `ns` (the tag of `ns`,
then the random part it draws)."""
OWN_MOUNT = {"name": "kai-fractions-mps", "mountPath": f"/run/kai-fractions/mps/shared/{NS}",
             "subPath": NS}


def apply(obj: dict[str, Any], config: AdmissionConfig = CONFIG) -> dict[str, Any]:
    decision = mutate(request(obj), config, new_namespace=lambda: RANDOM)
    assert decision.allowed, decision.message
    return jsonpatch.apply_patch(copy.deepcopy(obj), list(decision.patch))


def names(items: list[dict[str, Any]]) -> list[str]:
    return [i["name"] for i in items]


def test_non_fractional_pods_are_never_touched() -> None:
    obj = pod({}, containers=("a", "b"))
    obj["spec"]["containers"][0]["env"] = [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]
    assert mutate(request(obj), CONFIG).patch == ()


def test_updates_and_subresources_are_not_mutated() -> None:
    assert mutate(request(pod(SM), old=pod(SM)), CONFIG).patch == ()
    assert mutate(request(pod(SM), sub="status"), CONFIG).patch == ()
    assert mutate(request({"kind": "Deployment"}, kind="Deployment"), CONFIG).patch == ()


def test_an_invalid_pod_is_denied_here_too_with_the_contract_message() -> None:
    d = mutate(request(pod({"nvidia.com/container.main.gpu-memory.request": "500m"})), CONFIG)
    assert (d.allowed, d.code, d.message) == (False, 422, (
        "nvidia.com/container.main.gpu-memory.request: GPU memory must be at least 1 MiB "
        "(1Mi) (got '500m')"))


@pytest.mark.parametrize(("fraction", "wired"), [
    ("0.99999999999999999", False), ("1e-400", False), ("5e-0001", True)])
def test_gpu_fraction_is_judged_as_kai_reads_it(fraction: str, wired: bool) -> None:
    """KAI reads gpu-fraction with strconv.ParseFloat and refuses `<= 0 || >= 1` (upstream
    kai-scheduler/api utilities/resources/gpu_sharing.go, parseGpuFractionalPortion): the first
    two are 1 and 0 there, the third one half (any number of exponent digits)."""
    d = mutate(request(pod({"gpu-fraction": fraction})), CONFIG)
    assert d.allowed is wired
    if wired:
        assert d.patch
    else:
        assert (d.code, d.message) == (422, "gpu-fraction: must be a portion of one GPU, "
                                            f"0 < x < 1 (got {fraction!r})")


def test_the_patch_touches_only_what_differs() -> None:
    obj = pod(TS, containers=("main", "side"))
    obj["spec"]["containers"][1]["env"] = [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]
    decision = mutate(request(obj), CONFIG)
    assert [(op["op"], op["path"]) for op in decision.patch] == [
        ("replace", "/spec/containers/0"), ("add", "/spec/initContainers"),
        ("add", "/spec/volumes")]


def test_enforced_env_comes_first_and_the_pods_own_values_are_gone() -> None:
    obj = pod(SM)
    obj["spec"]["containers"][0]["env"] = [
        {"name": "A", "value": "1"},
        {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"},
        {"name": "SHOW", "value": "$(NVIDIA_VISIBLE_DEVICES)"},
        {"name": "CUDA_MPS_PIPE_DIRECTORY", "valueFrom": {"configMapKeyRef": {
            "name": "c", "key": "k"}}},
    ]
    env = apply(obj)["spec"]["containers"][0]["env"]
    assert names(env) == ["NVIDIA_VISIBLE_DEVICES", "NVIDIA_GPU_MEMORY_REQUEST",
                          "NVIDIA_GPU_MEMORY_LIMIT", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
                          "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "CUDA_MPS_PIPE_DIRECTORY",
                          "A", "SHOW"]
    assert all("valueFrom" in e and "fieldRef" in e["valueFrom"] for e in env[:6])


def test_a_time_slicing_container_gets_no_mps_settings_even_if_it_set_them() -> None:
    obj = pod(TS)
    obj["spec"]["containers"][0]["env"] = [
        {"name": "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "value": "100"}]
    out = apply(obj)
    assert names(out["spec"]["containers"][0]["env"]) == [
        "NVIDIA_VISIBLE_DEVICES", "NVIDIA_GPU_MEMORY_REQUEST", "NVIDIA_GPU_MEMORY_LIMIT",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"]
    assert "volumeMounts" not in out["spec"]["containers"][0]
    assert names(out["spec"]["volumes"]) == ["kai-fractions-marker", "kai-fractions-podinfo"]


def test_a_fractional_init_container_is_wired_and_the_gate_still_runs_first() -> None:
    obj = pod({"nvidia.com/container.warmup.gpu-memory.request": "1Gi",
               "nvidia.com/container.warmup.gpu-compute.mode": "sm-sharing"},
              initContainers=[{"name": "warmup", "image": "img"}])
    out = apply(obj)
    gate, warmup = out["spec"]["initContainers"]
    assert gate["name"] == "kai-fractions-gate"
    assert gate["command"][-4:] == ["--containers", "main", "--init-containers", "warmup"]
    assert warmup["env"][0]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.annotations['nvidia.com/container.warmup.gpus.devices']")
    assert warmup["volumeMounts"] == [OWN_MOUNT]


def test_reserved_names_the_pod_brought_are_replaced() -> None:
    obj = pod(SM, initContainers=[
        {"name": "setup", "image": "img"},
        {"name": "kai-fractions-gate", "image": "evil", "command": ["true"]},
    ], volumes=[{"name": "kai-fractions-marker", "emptyDir": {}}])
    obj["spec"]["containers"][0]["volumeMounts"] = [
        {"name": "scratch", "mountPath": "/run/kai-fractions/mps"}]
    out = apply(obj)
    assert names(out["spec"]["initContainers"]) == ["kai-fractions-gate", "setup"]
    assert out["spec"]["initContainers"][0]["image"] == CONFIG.gate_image
    assert out["spec"]["volumes"][0]["hostPath"]["path"] == "/var/lib/kai-fractions/markers"
    assert names(out["spec"]["volumes"]) == ["kai-fractions-marker", "kai-fractions-podinfo",
                                             "kai-fractions-mps"]
    assert out["spec"]["containers"][0]["volumeMounts"] == [
        OWN_MOUNT]


def test_thousands_of_reserved_mounts_all_go_and_the_pods_own_stay_in_order() -> None:
    """Admission sees a pod before the API server's limits apply: one container may bring
    thousands of mounts (a review found the removal quadratic, 25 s of CPU for one pod); every
    mount of the reserved volume or path goes, the others stay as they were."""
    mounts = []
    for i in range(3000):
        mounts.append({"name": "kai-fractions-mps", "mountPath": f"/m/{i}"})
        mounts.append({"name": f"data-{i}", "mountPath": f"/data/{i}"})
    obj = pod(SM)
    obj["spec"]["containers"][0]["volumeMounts"] = mounts
    out = apply(obj)
    assert out["spec"]["containers"][0]["volumeMounts"] == [
        m for m in mounts if m["name"] != "kai-fractions-mps"] + [OWN_MOUNT]


@pytest.mark.parametrize("extra", [{"args": ["--timeout", "0"]}, {"restartPolicy": "Always"},
                                   {"envFrom": [{"configMapRef": {"name": "x"}}]}])
def test_a_gate_the_pod_brought_with_more_in_it_is_replaced(extra: dict[str, Any]) -> None:
    """The injected gate plus a field of the pod's own is not the gate: replaced here, so a
    pod does not start with it even if only this webhook ran (the validating one refuses it
    too)."""
    gate = apply(pod(TS))["spec"]["initContainers"][0]
    out = apply(pod(TS, initContainers=[{**copy.deepcopy(gate), **extra}]))
    assert out["spec"]["initContainers"] == [gate]


def test_a_fractional_container_with_the_gates_name_is_refused() -> None:
    """The webhook replaces every init container named like its gate: a workload of that
    name would be dropped without a word, and the pod fail once bound."""
    key = "nvidia.com/container.kai-fractions-gate.gpu-memory.request"
    obj = pod({key: "8Gi"}, initContainers=[{"name": "kai-fractions-gate", "image": "train"}])
    d = mutate(request(obj), CONFIG)
    assert (d.allowed, d.code) == (False, 422)
    assert d.message == (
        f"{key}: names container 'kai-fractions-gate', the name of the init container the "
        "admission webhook injects (its gate); give the container another name")


def with_api_server_defaults(obj: dict[str, Any]) -> dict[str, Any]:
    """What the API server adds when it stores the pod (a representative subset)."""
    obj = copy.deepcopy(obj)
    spec = obj["spec"]
    spec.update(restartPolicy="Always", dnsPolicy="ClusterFirst", schedulerName="default",
                terminationGracePeriodSeconds=30, securityContext={}, enableServiceLinks=True,
                preemptionPolicy="PreemptLowerPriority", priority=0)
    for c in spec["containers"] + spec["initContainers"]:
        c.setdefault("imagePullPolicy", "IfNotPresent")
        c.setdefault("terminationMessagePath", "/dev/termination-log")
        c.setdefault("terminationMessagePolicy", "File")
        c.setdefault("resources", {})
    for v in spec["volumes"]:
        if "hostPath" in v:
            v["hostPath"].setdefault("type", "")
    spec["volumes"].append({"name": "kube-api-access-x", "projected": {"sources": []}})
    spec["containers"][0].setdefault("volumeMounts", []).append(
        {"name": "kube-api-access-x", "mountPath": "/var/run/secrets/kubernetes.io"})
    return obj


def test_reinvocation_after_api_server_defaulting_changes_nothing() -> None:
    for wanted in (SM, TS):
        once = apply(pod(wanted, containers=("main", "side")))
        stored = with_api_server_defaults(once)
        assert mutate(request(stored), CONFIG).patch == ()


def test_annotation_prefix_and_host_directories_follow_the_configuration() -> None:
    config = AdmissionConfig(gate_image="img", keys=Keys(prefix="example.com/container."),
                             marker_host_dir="/data/markers", mps_pipe_host_dir="/data/mps")
    out = apply(pod({"example.com/container.main.gpu-memory.request": "1Gi",
                     "example.com/container.main.gpu-compute.mode": "sm-sharing"}), config)
    gate = out["spec"]["initContainers"][0]
    assert gate["command"][gate["command"].index("--annotation-prefix") + 1] == (
        "example.com/container.")
    assert out["spec"]["containers"][0]["env"][0]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.annotations['example.com/container.main.gpus.devices']")
    # the MPS server directory only: the daemon's control socket, in the root, stays out
    assert [v.get("hostPath", {}).get("path") for v in out["spec"]["volumes"]] == [
        "/data/markers", None, "/data/mps/shared"]


@pytest.mark.parametrize("scheduler", [None, "default-scheduler"])
def test_a_fractional_pod_of_another_scheduler_is_admitted_with_a_warning(scheduler) -> None:
    """Only KAI binds a fraction: its admission skips other schedulers' pods and no BindRequest
    is made (upstream KAI-Scheduler pkg/admission/webhook/v1alpha2/podhooks/pod_validator.go),
    so such a pod would wait in its gate for ever. Wired all the same (the gate holds it)."""
    obj = pod(TS)
    if scheduler is None:
        del obj["spec"]["schedulerName"]
    else:
        obj["spec"]["schedulerName"] = scheduler
    decision = mutate(request(obj), CONFIG)
    assert decision.allowed and decision.patch
    said = "absent, so the default scheduler places the pod" if scheduler is None else (
        f"'{scheduler}' names another scheduler")
    assert decision.warnings == (
        f"spec.schedulerName: {said}, and only kai-scheduler binds a GPU fraction (KAI skips "
        "the pods of other schedulers): the pod would never be released from its gate; set "
        "spec.schedulerName: kai-scheduler",)
    renamed = dataclasses.replace(CONFIG, scheduler_name=scheduler or "kai")
    assert mutate(request(obj), dataclasses.replace(CONFIG, scheduler_name="")).warnings == ()
    assert (mutate(request(obj), renamed).warnings == ()) is (scheduler is not None)
    plain = pod({})
    del plain["spec"]["schedulerName"]
    assert mutate(request(plain), CONFIG).warnings == ()  # not fractional: not ours to say


def test_a_fractional_pod_gets_the_nvidia_runtime_class_when_configured() -> None:
    """Its container reaches its GPU through the NVIDIA runtime (NVIDIA_VISIBLE_DEVICES); where
    the node offers it only as a RuntimeClass, a manifest written for KAI names none."""
    config = dataclasses.replace(CONFIG, runtime_class="nvidia")
    out = apply(pod(TS), config)
    assert out["spec"]["runtimeClassName"] == "nvidia"
    assert mutate(request(out), config).patch == ()  # once is enough
    assert "runtimeClassName" not in apply(pod(TS))  # not configured: the node's default
    assert mutate(request(pod({})), config).patch == ()  # not fractional: untouched

    own = pod(TS)
    own["spec"]["runtimeClassName"] = "kata"
    decision = mutate(request(own), config)
    assert "/spec/runtimeClassName" not in [op["path"] for op in decision.patch]  # kept
    [warning] = decision.warnings
    assert warning.startswith("spec.runtimeClassName: 'kata' is kept, but container 'main' "
                              "reaches its GPU through the NVIDIA runtime ('nvidia')")


def test_a_runtime_class_that_cannot_be_one_is_refused() -> None:
    with pytest.raises(ValueError, match="runtime_class: 'NVIDIA runtime' is not a "
                                         "RuntimeClass name"):
        AdmissionConfig(gate_image="img", runtime_class="NVIDIA runtime")


# -- the container's own MPS namespace --------------------------------------------------------

NS_KEY = "kai-fractions.io/container.main.mps-namespace"


def test_an_sm_sharing_container_gets_a_namespace_of_its_own_and_mounts_only_it() -> None:
    """The pod has no UID yet, so the webhook names the namespace (its Kubernetes namespace's
    tag, then random) and mounts only that directory of the MPS server's; the contract's
    CUDA_MPS_PIPE_DIRECTORY names it."""
    out = apply(pod(SM))
    assert out["metadata"]["annotations"][NS_KEY] == NS
    assert out["spec"]["containers"][0]["volumeMounts"] == [OWN_MOUNT]
    assert mutate(request(out), CONFIG, new_namespace=lambda: "cd" * 6).patch == ()


def test_each_pod_gets_a_different_namespace() -> None:
    names = {mutate(request(pod(SM)), CONFIG).patch[-1]["value"] for _ in range(20)}
    assert len(names) == 20
    assert all(re.fullmatch("kf_[0-9a-f]{20}", n) for n in names)


def test_a_namespace_the_pod_already_names_is_kept() -> None:
    """The webhook may run again on its own output (reinvocation); a name a user of the pod's
    namespace wrote is theirs, and the node agent refuses it if another container already has
    it. One of another namespace is replaced (tests/admission/test_attacks.py)."""
    mine = "kf_" + namespace_tag("ns") + "12" * 6
    out = apply(pod({**SM, NS_KEY: mine}))
    assert out["metadata"]["annotations"][NS_KEY] == mine
    assert out["spec"]["containers"][0]["volumeMounts"][0]["subPath"] == mine


def test_a_malformed_namespace_is_refused_with_the_rule() -> None:
    d = mutate(request(pod({**SM, NS_KEY: "../legacy"})), CONFIG)
    assert (d.allowed, d.message) == (False, (
        "kai-fractions.io/container.main.mps-namespace: must be kf_ and 20 lowercase hex "
        "digits, as the admission webhook names an MPS namespace (got '../legacy')"))


def test_a_time_slicing_container_gets_no_namespace() -> None:
    out = apply(pod(TS))
    assert NS_KEY not in out["metadata"]["annotations"]
    assert "volumeMounts" not in out["spec"]["containers"][0]


LIMIT_KEY = "nvidia.com/container.main.gpu-memory.limit"
REQUEST_KEY = "nvidia.com/container.main.gpu-memory.request"


def test_a_container_that_gives_only_a_limit_gets_it_as_its_request() -> None:
    # Upstream KAI main reads such a pod as request := limit (pkg/common/resources,
    # ExtractNvFractionsData: defaultRequestFromLimit) and schedules it with the portion
    # ceil(limit / M * 100) / 100 (node_info.go, getGpuMemoryFractionalOnNode); its binder then
    # writes a missing request as uint64(M * portion) (pkg/binder/plugins/nvfractions,
    # setNvFractionsMemoryAnnotation): 10240Mi for a 10000Mi limit on a 40960 MiB GPU, above
    # the limit. Written here, the request keeps the binder from writing one.
    out = apply(pod({LIMIT_KEY: "10000Mi"}))
    assert out["metadata"]["annotations"][REQUEST_KEY] == "10000Mi"
    assert mutate(request(out), CONFIG).patch == ()  # reinvocation: nothing more


def test_gpu_memory_beside_a_limit_alone_is_written_as_kai_writes_it() -> None:
    """KAI's admission writes gpu-memory 2000 as the request `2000Mi` and refuses other text
    (KAI-Scheduler pkg/admission/webhook/v1alpha2/nvfractions/mutation.go,
    translateLegacyMemory): the request written here is that text, not the limit, so the pod
    is the same whichever webhook runs first."""
    out = apply(pod({"gpu-memory": "2000", "gpu-memory.limit": "4Gi", LIMIT_KEY: "4Gi"}))
    assert out["metadata"]["annotations"][REQUEST_KEY] == "2000Mi"
    assert mutate(request(out), CONFIG).patch == ()


def test_a_request_the_pod_gives_is_never_rewritten() -> None:
    out = apply(pod({REQUEST_KEY: "8Gi", LIMIT_KEY: "10Gi"}))
    assert (out["metadata"]["annotations"][REQUEST_KEY],
            out["metadata"]["annotations"][LIMIT_KEY]) == ("8Gi", "10Gi")
    assert REQUEST_KEY not in apply(pod({"gpu-fraction": "0.5"}))["metadata"]["annotations"]
