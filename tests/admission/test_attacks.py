"""The security review's attacks on admission (issue 17, findings 2, 3, 4 and 6), each played
through the real HTTPS webhook server: a pod is created and wired by POST /mutate, then the
attacker's CREATE or UPDATE goes to POST /validate (or /mutate) as the API server would send it.
"""

from __future__ import annotations

import base64
import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonpatch
import pytest

from kai_fractions.admission.podspec import namespace_tag
from kai_fractions.contract import is_mps_namespace_name
from kai_fractions.contract import keys as k

from .conftest import GATE_IMAGE, Webhook
from .reviews import ALICE, BINDER, GPU, MIRROR, pod, request

KEYS = k.DEFAULT_KEYS
DEVICES = KEYS.container("main", k.DEVICES)
PORTION = KEYS.container("main", k.COMPUTE_PORTION)
REQUEST = KEYS.container("main", k.MEMORY_REQUEST)
LIMIT = KEYS.container("main", k.MEMORY_LIMIT)
MODE = KEYS.container("main", k.COMPUTE_MODE)
VOID = {"name": k.ENV_VISIBLE_DEVICES, "value": "void"}


def in_namespace(req: dict[str, Any], namespace: str | None) -> dict[str, Any]:
    """`req` (from `request`, namespace `ns`) as the API server sends it for a pod of
    Kubernetes namespace `namespace`, when one is given."""
    if namespace is not None:
        req["namespace"] = namespace
        req["object"]["metadata"]["namespace"] = namespace
    return req


def mutated(webhook: Webhook, obj: dict[str, Any], *, old: dict[str, Any] | None = None,
            sub: str = "", namespace: str | None = None) -> dict[str, Any]:
    """The mutating webhook's answer for `obj` (asserting it was allowed)."""
    status, answer = webhook.post("/mutate", {
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": in_namespace(request(obj, old=old, sub=sub), namespace)})
    assert status == 200
    response = answer["response"]
    assert response["allowed"] is True, response
    return response


def wired(webhook: Webhook, obj: dict[str, Any], *, old: dict[str, Any] | None = None,
          sub: str = "", namespace: str | None = None) -> dict[str, Any]:
    """`obj` after the mutating webhook's patch (asserting it was allowed)."""
    response = mutated(webhook, obj, old=old, sub=sub, namespace=namespace)
    if "patch" not in response:
        return copy.deepcopy(obj)
    return jsonpatch.apply_patch(copy.deepcopy(obj), json.loads(base64.b64decode(
        response["patch"])))


def review(webhook: Webhook, obj: dict[str, Any], *, old: dict[str, Any] | None = None,
           user: str = ALICE, sub: str = "", namespace: str | None = None) -> dict[str, Any]:
    status, answer = webhook.post("/validate", {
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": in_namespace(request(obj, old=old, user=user, sub=sub), namespace)})
    assert status == 200
    return answer["response"]


def bound_pod(webhook: Webhook, annotations: dict[str, str], **kw: Any) -> dict[str, Any]:
    """A wired pod with the binder's keys on it, as it runs on its node."""
    obj = wired(webhook, pod(annotations, **kw))
    obj["metadata"]["annotations"].update({DEVICES: GPU, PORTION: "0.25"})
    return obj


# -- finding 2: a tenant edits its own user-owned keys after the bind -------------------------

USER_KEYS = [
    (LIMIT, "8Gi", "80Gi"),
    (REQUEST, "8Gi", "1Gi"),
    (MODE, "time-slicing", "sm-sharing"),
    (k.GPU_FRACTION, "0.25", "1"),
    (k.GPU_FRACTION_LIMIT, "0.5", "1"),
    (k.GPU_MEMORY, "8192", "81920"),
    (k.GPU_MEMORY_LIMIT, "8192", "81920"),
    (k.GPU_FRACTION_NUM_DEVICES, "1", "2"),
    (k.GPU_FRACTION_CONTAINER_NAME, "main", "side"),
    (KEYS.portion_limit("main"), "0.5", "1"),
]


@pytest.mark.parametrize(("key", "before", "after"), USER_KEYS,
                         ids=[key for key, _, _ in USER_KEYS])
def test_a_user_owned_key_is_frozen_once_the_binder_set_the_devices(
        webhook: Webhook, key: str, before: str, after: str) -> None:
    base = {REQUEST: "8Gi", LIMIT: "8Gi"}
    if key == MODE:
        base[key] = before
    if key == KEYS.portion_limit("main"):  # KAI takes a portion limit beside gpu-fraction only
        base = {k.GPU_FRACTION: "0.25", key: before}
    old = bound_pod(webhook, base, containers=("main", "side"))
    old["metadata"]["annotations"][key] = before
    frozen = f"{key}: is frozen once {DEVICES} is set"
    for change in ("change", "remove"):
        new = copy.deepcopy(old)
        if change == "change":
            new["metadata"]["annotations"][key] = after
        else:
            del new["metadata"]["annotations"][key]
        for user in (ALICE, BINDER):  # nobody changes a user's key after the bind
            response = review(webhook, new, old=old, user=user)
            assert response["allowed"] is False, (key, change, user)
            assert response["status"]["code"] == 403
            assert frozen in response["status"]["message"]
    # adding one is a change too
    added = copy.deepcopy(old)
    del added["metadata"]["annotations"][key]
    response = review(webhook, old, old=added)
    assert response["allowed"] is False and frozen in response["status"]["message"]


def test_the_freeze_names_the_key_and_what_to_do(webhook: Webhook) -> None:
    old = bound_pod(webhook, {REQUEST: "8Gi", LIMIT: "8Gi"})
    new = copy.deepcopy(old)
    new["metadata"]["annotations"][LIMIT] = "80Gi"
    response = review(webhook, new, old=old)
    assert response["status"]["message"] == (
        f"{LIMIT}: is frozen once {DEVICES} is set (the node enforces what the scheduler "
        "placed); create a new pod to change it")


def test_the_status_subresource_cannot_unfreeze_a_key(webhook: Webhook) -> None:
    old = bound_pod(webhook, {REQUEST: "8Gi", LIMIT: "8Gi"})
    new = copy.deepcopy(old)
    new["metadata"]["annotations"][LIMIT] = "80Gi"
    assert review(webhook, new, old=old, sub="status")["allowed"] is False


def test_before_the_bind_user_keys_may_change_and_the_binder_adds_a_missing_request(
        webhook: Webhook) -> None:
    old = wired(webhook, pod({k.GPU_FRACTION: "0.25"}))
    new = copy.deepcopy(old)
    new["metadata"]["annotations"][k.GPU_FRACTION] = "0.5"
    assert review(webhook, new, old=old)["allowed"] is True
    # KAI writes the request it computed together with the devices, in one patch
    bound = copy.deepcopy(old)
    bound["metadata"]["annotations"].update({DEVICES: GPU, PORTION: "0.25", REQUEST: "20133Mi"})
    assert review(webhook, bound, old=old, user=BINDER)["allowed"] is True
    # the rest of the pod stays editable after the bind
    relabelled = copy.deepcopy(bound)
    relabelled["metadata"]["labels"] = {"team": "a"}
    relabelled["metadata"]["annotations"]["example.com/note"] = "x"
    assert review(webhook, relabelled, old=bound)["allowed"] is True


def test_the_mirror_may_replace_or_release_a_request_it_wrote_itself(webhook: Webhook) -> None:
    old = wired(webhook, pod({k.GPU_FRACTION: "0.25"}))
    old["metadata"]["uid"] = "uid-1"
    record = json.dumps({"v": 1, "uid": "uid-1", "container": "main",
                         "keys": sorted([DEVICES, PORTION, REQUEST]),
                         "digest": "sha256:" + "0" * 64, "idempotencyKey": ""})
    old["metadata"]["annotations"].update({DEVICES: GPU, PORTION: "0.25", REQUEST: "20133Mi",
                                           k.MIRRORED_RECORD: record})
    released = copy.deepcopy(old)
    for key in (DEVICES, PORTION, REQUEST, k.MIRRORED_RECORD):
        del released["metadata"]["annotations"][key]
    assert review(webhook, released, old=old, user=MIRROR)["allowed"] is True
    assert review(webhook, released, old=old, user=ALICE)["allowed"] is False
    # a record for another pod (a recreated one) exempts nothing
    stale = copy.deepcopy(old)
    stale["metadata"]["uid"] = "uid-2"
    released["metadata"]["uid"] = "uid-2"
    response = review(webhook, released, old=stale, user=MIRROR)
    assert response["allowed"] is False
    assert f"{REQUEST}: is frozen once {DEVICES} is set" in response["status"]["message"]


# -- finding 3: the gate swapped on UPDATE ------------------------------------------------------

GATE_EDITS = [
    ("image", lambda g: g.update(image="registry.example.com/not-the-gate:1")),
    ("command", lambda g: g.update(command=["sh", "-c", "exit 0"])),
    ("args", lambda g: g.update(args=["--timeout", "0"])),
    ("env", lambda g: g["env"].append({"name": "PYTHONPATH", "value": "/x"})),
    ("envFrom", lambda g: g.update(envFrom=[{"configMapRef": {"name": "x"}}])),
    ("volumeMounts", lambda g: g["volumeMounts"].append(
        {"name": "kai-fractions-podinfo", "mountPath": "/tmp"})),
    ("securityContext", lambda g: g["securityContext"].update(runAsUser=0)),
    ("restartPolicy", lambda g: g.update(restartPolicy="Always")),  # a sidecar blocks nothing
    # The kubelet mounts a writable (0666) host file at the termination message path: at the
    # marker's path it would hide the agent's marker under one an exec could forge (session
    # 22's security review).
    ("terminationMessagePath", lambda g: g.update(
        terminationMessagePath="/kai-fractions/marker/marker.json")),
]


@pytest.mark.parametrize(("field", "edit"), GATE_EDITS, ids=[f for f, _ in GATE_EDITS])
def test_the_gate_cannot_be_changed_on_create_or_update(webhook: Webhook, field: str,
                                                        edit: Any) -> None:
    old = bound_pod(webhook, {REQUEST: "8Gi"})
    new = copy.deepcopy(old)
    edit(new["spec"]["initContainers"][0])
    response = review(webhook, new, old=old)
    assert response["allowed"] is False, field
    assert f"spec.initContainers[0].{field}: " in response["status"]["message"]
    created = copy.deepcopy(new)
    for key in (DEVICES, PORTION):
        del created["metadata"]["annotations"][key]
    response = review(webhook, created)
    assert response["allowed"] is False, field
    assert f"spec.initContainers[0].{field}: " in response["status"]["message"]


def test_the_gate_must_come_first(webhook: Webhook) -> None:
    obj = wired(webhook, pod({REQUEST: "8Gi"}, initContainers=[
        {"name": "fetch", "image": "busybox"}]))
    assert obj["spec"]["initContainers"][0]["name"] == "kai-fractions-gate"
    obj["spec"]["initContainers"].reverse()
    response = review(webhook, obj)
    assert response["allowed"] is False
    assert response["status"]["message"].startswith(
        "spec.initContainers[0]: the first init container of a fractional pod must be "
        "kai-fractions-gate")
    obj["spec"]["initContainers"] = obj["spec"]["initContainers"][:1]  # no gate at all
    assert review(webhook, obj)["allowed"] is False


def test_the_wired_gate_passes_and_the_image_is_the_configured_one(webhook: Webhook) -> None:
    obj = bound_pod(webhook, {REQUEST: "8Gi"})
    assert obj["spec"]["initContainers"][0]["image"] == GATE_IMAGE
    new = copy.deepcopy(obj)
    new["spec"]["containers"][0]["image"] = "img:2"  # a workload's image may change
    assert review(webhook, new, old=obj)["allowed"] is True


# -- finding 4: host paths spelled another way, and pods without NvFractions keys --------------

SPELLINGS = [
    "//var/lib/kai-fractions/markers", "/var//lib/kai-fractions", "/var/lib/./kai-fractions",
    "/var/log/../lib/kai-fractions/markers", "/proc/1/root/var/lib/kai-fractions",
    "/proc/self/root/var/lib", "/proc/1/cwd", "/proc", "/var/run/kai-fractions",
    "/var/run/kai-fractions/agent.sock", "/run/kai-fractions/agent.sock", "/run",
    "/var/run", "/proc/1/root/var/run/../run/kai-fractions",
]


@pytest.mark.parametrize("path", SPELLINGS)
def test_host_paths_are_compared_after_normalisation(webhook: Webhook, path: str) -> None:
    obj = wired(webhook, pod({REQUEST: "8Gi"}))
    obj["spec"]["volumes"].append({"name": "host", "hostPath": {"path": path}})
    response = review(webhook, obj)
    assert response["allowed"] is False, path
    assert f"{path!r} reaches the kai-fractions directory" in response["status"]["message"]


@pytest.mark.parametrize("path", ["/var/lib/kai-fractions/markers", "/run/kai-fractions",
                                  "/var/run/kai-fractions", "/", "/proc/1/root/run"])
def test_pods_without_nvfractions_keys_may_not_reach_them_either(webhook: Webhook,
                                                                 path: str) -> None:
    plain = pod({}, volumes=[{"name": "host", "hostPath": {"path": path}}])
    response = review(webhook, plain)
    assert response["allowed"] is False, path
    assert response["status"]["message"].startswith(
        f"spec.volumes[0].hostPath.path: {path!r} reaches the kai-fractions directory")


KUBELET = "/var/lib/kubelet"
KUBELET_RULE = (f"reaches the kubelet's pods directory '{KUBELET}/pods'; no volume may: the "
                "kubelet mounts every pod's subPath volumes read-write under it, the gate's "
                "marker directory and the MPS namespaces included")


@pytest.mark.parametrize("path", [
    KUBELET, "/var/lib/kubelet/", "/var/lib/kubelet/pods",
    "/var/lib/kubelet/pods/uid-1/volume-subpaths/kai-fractions-marker",
    "//var/lib/./kubelet/pods", "/var/log/../lib/kubelet", "/proc/1/root/var/lib/kubelet/pods",
    "/var/lib", "/var", "/", "/proc/1/cwd",  # its parents (they reach the markers too)
])
@pytest.mark.parametrize("fractional", [False, True], ids=["plain", "fractional"])
def test_no_pod_may_reach_the_kubelets_directory(webhook: Webhook, path: str,
                                                  fractional: bool) -> None:
    """The kubelet bind-mounts each subPath read-write under `<root>/pods/<uid>/volume-subpaths/`:
    the gate's marker directory, every sm-sharing container's MPS namespace. A pod reaching it
    could forge a marker (no secret in it: its digest comes from the annotations, its boot ID is
    the host's) and start without limits, or join another tenant's MPS namespace."""
    obj = wired(webhook, pod({REQUEST: "8Gi"})) if fractional else pod({}, volumes=[])
    obj["spec"]["volumes"].append({"name": "host", "hostPath": {"path": path}})
    response = review(webhook, obj)
    assert response["allowed"] is False, path
    where = f"spec.volumes[{len(obj['spec']['volumes']) - 1}].hostPath.path"
    assert f"{where}: {path!r} {KUBELET_RULE}" in response["status"]["message"]


@pytest.mark.parametrize("path", ["/var/log", "/run/containerd", "/var/lib/kubelet-plugins",
                                  "/var/run-other", "/proc/meminfo", "/var/lib/kai",
                                  "/var/lib/kubelet/device-plugins",
                                  "/var/lib/kubelet/plugins_registry"])
def test_other_host_paths_pass(webhook: Webhook, path: str) -> None:
    plain = pod({}, volumes=[{"name": "host", "hostPath": {"path": path}}])
    assert review(webhook, plain)["allowed"] is True, path
    obj = wired(webhook, pod({REQUEST: "8Gi"}))
    obj["spec"]["volumes"].append({"name": "host", "hostPath": {"path": path}})
    assert review(webhook, obj)["allowed"] is True, path


# -- finding 6: GPU env outside the fractional container ---------------------------------------

def test_every_other_container_gets_visible_devices_void(webhook: Webhook) -> None:
    obj = wired(webhook, pod({REQUEST: "8Gi"}, containers=("main", "side"), initContainers=[
        {"name": "fetch", "image": "busybox",
         "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]}]))
    side = obj["spec"]["containers"][1]
    fetch = obj["spec"]["initContainers"][1]
    gate = obj["spec"]["initContainers"][0]
    for c in (side, fetch, gate):
        assert [e for e in c["env"] if e["name"] in k.ENFORCED_ENV] == [VOID], c["name"]
    assert review(webhook, obj)["allowed"] is True
    assert wired(webhook, obj) == obj  # idempotent


@pytest.mark.parametrize("env", [
    [],
    [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}],
    [VOID, {"name": "CUDA_MPS_PIPE_DIRECTORY", "value": "/tmp"}],
    [{"name": "NVIDIA_VISIBLE_DEVICES", "valueFrom": {"fieldRef": {
        "fieldPath": f"metadata.annotations['{DEVICES}']"}}}],
])
def test_a_sidecar_without_void_is_denied(webhook: Webhook, env: list) -> None:
    obj = wired(webhook, pod({REQUEST: "8Gi"}, containers=("main", "side")))
    obj["spec"]["containers"][1]["env"] = env
    response = review(webhook, obj)
    assert response["allowed"] is False
    assert response["status"]["message"] == (
        "spec.containers[1].env: container 'side' has no GPU fraction: it must set "
        "NVIDIA_VISIBLE_DEVICES=void and none of NVIDIA_GPU_MEMORY_REQUEST, "
        "NVIDIA_GPU_MEMORY_LIMIT, CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, "
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, CUDA_MPS_PIPE_DIRECTORY")


def debug_container(env: list | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"name": "debug", "image": "busybox", "targetContainerName": "main"}
    if env is not None:
        out["env"] = env
    return out


def test_an_ephemeral_container_is_wired_and_validated_like_the_others(webhook: Webhook) -> None:
    old = bound_pod(webhook, {REQUEST: "8Gi"})
    new = copy.deepcopy(old)
    new["spec"]["ephemeralContainers"] = [debug_container(
        [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"},
         {"name": "NVIDIA_GPU_MEMORY_LIMIT", "value": "80000"}])]
    # as the user sent it: GPU env of its own
    response = review(webhook, new, old=old, sub="ephemeralcontainers")
    assert response["allowed"] is False
    assert response["status"]["message"].startswith(
        "spec.ephemeralContainers[0].env: container 'debug' has no GPU fraction")
    # the mutating webhook replaces it with void, and then it passes
    fixed = wired(webhook, new, old=old, sub="ephemeralcontainers")
    assert fixed["spec"]["ephemeralContainers"][0]["env"] == [VOID]
    assert fixed["spec"]["containers"] == old["spec"]["containers"]
    assert fixed["spec"]["initContainers"] == old["spec"]["initContainers"]
    assert review(webhook, fixed, old=old, sub="ephemeralcontainers")["allowed"] is True
    assert wired(webhook, fixed, old=old, sub="ephemeralcontainers") == fixed


def test_an_ephemeral_container_may_not_reach_the_agent(webhook: Webhook) -> None:
    old = bound_pod(webhook, {REQUEST: "8Gi"})
    new = copy.deepcopy(old)
    debug = debug_container([VOID])
    debug["volumeMounts"] = [{"name": "kai-fractions-marker", "mountPath": "/m"}]
    new["spec"]["ephemeralContainers"] = [debug]
    response = review(webhook, new, old=old, sub="ephemeralcontainers")
    assert response["allowed"] is False
    assert "spec.ephemeralContainers[0].volumeMounts[0]: only the kai-fractions-gate" in \
        response["status"]["message"]


def test_pods_created_before_these_rules_can_still_be_updated(webhook: Webhook) -> None:
    """A pod wired by an older webhook (sidecar without void) keeps working: only what an
    update introduces is judged."""
    old = bound_pod(webhook, {REQUEST: "8Gi"}, containers=("main", "side"))
    old["spec"]["containers"][1]["env"] = []
    new = copy.deepcopy(old)
    new["metadata"]["labels"] = {"team": "a"}
    assert review(webhook, new, old=old)["allowed"] is True


def test_the_admission_process_guards_the_configured_socket_directory(tls_dir: Path) -> None:
    """`kai-fractions admission --agent-socket-dir --kubelet-root-dir`: a plain pod's hostPath
    to the agent's socket, spelled through /var/run, or into the kubelet's directory, is refused
    by the real process."""
    cli = Path(sys.executable).parent / "kai-fractions"
    proc = subprocess.Popen(
        [str(cli), "admission", "--listen", "127.0.0.1:0", "--tls-cert",
         str(tls_dir / "tls.crt"), "--tls-key", str(tls_dir / "tls.key"),
         "--gate-image", GATE_IMAGE, "--agent-socket-dir", "/run/gpu-agent",
         "--kubelet-root-dir", "/srv/kubelet"],
        stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        assert "serving /validate, /mutate and /healthz on https://127.0.0.1:" in line, line
        server = type("S", (), {"port": int(line.rsplit(":", 1)[1])})()
        hook = Webhook(server, tls_dir / "tls.crt")  # type: ignore[arg-type]
        sneaky = pod({}, volumes=[{"name": "s", "hostPath": {
            "path": "/var/run//gpu-agent/./agent.sock", "type": "Socket"}}])
        response = review(hook, sneaky)
        assert response["allowed"] is False
        assert response["status"]["message"] == (
            "spec.volumes[0].hostPath.path: '/var/run//gpu-agent/./agent.sock' reaches the "
            "kai-fractions directory '/run/gpu-agent'; no volume may: whoever reaches the node "
            "agent's socket can release any pod's limits (to admit a trusted host agent without "
            "NvFractions keys, exempt its namespace: the label kai-fractions.io/webhook=disabled, "
            "or the chart's webhook.hostPathExemptNamespaces)")
        elsewhere = pod({}, volumes=[{"name": "s", "hostPath": {"path": "/run/gpu-agent-2"}}])
        assert review(hook, elsewhere)["allowed"] is True
        # --kubelet-root-dir: the configured kubelet directory is guarded, not the default one
        kubelet = pod({}, volumes=[{"name": "k", "hostPath": {"path": "/srv/kubelet/pods"}}])
        assert review(hook, kubelet)["status"]["message"].startswith(
            "spec.volumes[0].hostPath.path: '/srv/kubelet/pods' reaches the kubelet's pods "
            "directory '/srv/kubelet/pods'; no volume may")
        default = pod({}, volumes=[{"name": "k", "hostPath": {"path": KUBELET}}])
        assert review(hook, default)["allowed"] is True
        proc.terminate()
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- another container's MPS namespace (docs/admission.md, "The MPS pipe mount") --------------

NS_KEY = KEYS.derived("main", k.ADMITTED_MPS_NAMESPACE)


def test_a_running_pod_cannot_move_to_another_mps_namespace(webhook: Webhook) -> None:
    """Its mount was made from the name at creation; a new name would point the container's
    CUDA_MPS_PIPE_DIRECTORY at another namespace, so no one but the binder and the mirror may
    change the key, and they never do."""
    obj = bound_pod(webhook, {REQUEST: "8Gi", MODE: "sm-sharing"})
    own = obj["metadata"]["annotations"][NS_KEY]
    mount = next(m for m in obj["spec"]["containers"][0]["volumeMounts"]
                 if m["name"] == "kai-fractions-mps")
    assert mount == {"name": "kai-fractions-mps", "subPath": own,
                     "mountPath": f"/run/kai-fractions/mps/shared/{own}"}
    relabelled = copy.deepcopy(obj)
    relabelled["metadata"].setdefault("labels", {})["team"] = "b"
    assert review(webhook, relabelled, old=obj)["allowed"] is True
    moved = copy.deepcopy(obj)
    moved["metadata"]["annotations"][NS_KEY] = "kf_" + "ee" * 10
    response = review(webhook, moved, old=obj)
    assert response["allowed"] is False
    assert response["status"]["message"].startswith(
        f"{NS_KEY}: is a protected key: only {BINDER}, {MIRROR} may change it, not {ALICE}")


SM = {REQUEST: "8Gi", MODE: "sm-sharing"}


def in_ns(namespace: str, obj: dict[str, Any]) -> dict[str, Any]:
    """`obj`, a pod of Kubernetes namespace `namespace`."""
    out = copy.deepcopy(obj)
    out["metadata"]["namespace"] = namespace
    return out


def mps_name_and_subpath(obj: dict[str, Any]) -> tuple[str, str]:
    mount = next(m for m in obj["spec"]["containers"][0]["volumeMounts"]
                 if m["name"] == "kai-fractions-mps")
    return obj["metadata"]["annotations"][NS_KEY], mount["subPath"]


def not_named_here(name: str, namespace: str) -> str:
    return (f"{NS_KEY}: {name!r} was not named for a pod of Kubernetes namespace "
            f"{namespace!r} (a new pod's MPS namespace name must start with "
            f"kf_{namespace_tag(namespace)}, the tag of its namespace, so that no pod can take "
            "another namespace's); remove the annotation: the admission webhook names the MPS "
            "namespace itself")


def test_a_name_copied_from_another_namespace_is_replaced_or_refused_at_create(
        webhook: Webhook) -> None:
    """Anyone who can read a pending pod (cluster-wide `view`) sees its MPS namespace name; a
    pod of theirs naming it, applied first on a node, would have the node agent refuse the
    victim there (MpsNamespaceTaken). The name carries the tag of the pod's Kubernetes
    namespace: the mutating webhook replaces a foreign one (its mount follows), and the
    validating one refuses it, whoever creates the pod, where the mutating one did not run."""
    victim = wired(webhook, in_ns("team-a", pod(SM)), namespace="team-a")
    name, subpath = mps_name_and_subpath(victim)
    assert name == subpath and is_mps_namespace_name(name)
    assert name.startswith("kf_" + namespace_tag("team-a"))
    # created as the API server does (mutated, then validated): a small pod of its own naming
    # the victim's namespace, and the victim's manifest whole
    copier = in_ns("team-b", pod({REQUEST: "1Gi", MODE: "sm-sharing", NS_KEY: name}))
    copied = in_ns("team-b", victim)
    for attempt in (copier, copied):
        out = wired(webhook, attempt, namespace="team-b")
        own, subpath = mps_name_and_subpath(out)
        assert own == subpath != name
        assert is_mps_namespace_name(own) and own.startswith("kf_" + namespace_tag("team-b"))
        assert review(webhook, out, namespace="team-b")["allowed"] is True
    # the victim's manifest past the mutating webhook (webhook.objectSelector): only its name
    # is wrong, and it is refused whoever creates the pod
    for user in (ALICE, BINDER):
        response = review(webhook, copied, user=user, namespace="team-b")
        assert (response["allowed"], response["status"]["message"]) == (
            False, not_named_here(name, "team-b"))


def test_a_manifest_copied_from_a_pod_named_before_the_tag_is_renamed_or_refused(
        webhook: Webhook) -> None:
    """Pods created before names carried a tag keep theirs (they are never created again, and
    an update may not touch the key); a manifest copied from one (`kubectl get -o yaml |
    kubectl create -f -`) gets a new name from the mutating webhook, and is refused by the
    validating one where the mutating one did not run (webhook.objectSelector)."""
    untagged = "kf_" + "ee" * 10
    fresh = wired(webhook, pod(SM))
    old = json.loads(json.dumps(fresh).replace(fresh["metadata"]["annotations"][NS_KEY],
                                               untagged))
    assert mps_name_and_subpath(old) == (untagged, untagged)
    relabelled = copy.deepcopy(old)
    relabelled["metadata"]["labels"] = {"team": "b"}
    assert review(webhook, relabelled, old=old)["allowed"] is True
    refused = review(webhook, old)
    assert refused["allowed"] is False
    assert refused["status"]["message"] == not_named_here(untagged, "ns")
    renamed = wired(webhook, old)
    own, subpath = mps_name_and_subpath(renamed)
    assert own == subpath != untagged and own.startswith("kf_" + namespace_tag("ns"))
    assert review(webhook, renamed)["allowed"] is True


def test_a_name_of_the_pods_own_namespace_is_kept_on_reinvocation(webhook: Webhook) -> None:
    """The mutating webhook may run again on its own output: a name with the tag of the pod's
    namespace is kept, so the second run patches nothing; the name keeps the format the node
    agent checks (`kf_` and 20 lowercase hex digits: the 8 of the tag, 12 random)."""
    out = wired(webhook, pod(SM))
    name, subpath = mps_name_and_subpath(out)
    assert name == subpath and is_mps_namespace_name(name)
    assert name.startswith("kf_" + namespace_tag("ns"))
    assert "patch" not in mutated(webhook, out)
    assert review(webhook, out)["allowed"] is True
    mine = "kf_" + namespace_tag("ns") + "12" * 6
    assert mps_name_and_subpath(wired(webhook, pod({**SM, NS_KEY: mine}))) == (mine, mine)


def test_a_new_pod_cannot_mount_every_namespace(webhook: Webhook) -> None:
    """What the mutating webhook wired, changed afterwards (by another mutating webhook, say):
    the whole server directory, where any namespace of the node is in reach."""
    obj = wired(webhook, pod({REQUEST: "8Gi", MODE: "sm-sharing"}))
    mount = next(m for m in obj["spec"]["containers"][0]["volumeMounts"]
                 if m["name"] == "kai-fractions-mps")
    del mount["subPath"]
    mount["mountPath"] = "/run/kai-fractions/mps/shared"
    response = review(webhook, obj)
    assert response["allowed"] is False
    assert "must mount only the container's own MPS namespace" in response["status"]["message"]


# -- session 22's security review: a process joining the waiting gate -------------------------

def test_no_exec_or_attach_may_join_the_gate_through_the_server(webhook: Webhook) -> None:
    """`kubectl exec -c kai-fractions-gate` runs a process in the gate's process namespace as
    its user: ptrace makes the gate exit 0 before the limits are in force. The chart sends such
    CONNECTs (tests/chart/test_webhooks.py); the server refuses them, and other execs pass."""
    def connect(container: str, sub: str = "exec") -> dict[str, Any]:
        status, answer = webhook.post("/validate", {
            "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": "u-1", "kind": {"group": "", "version": "v1",
                                               "kind": "PodExecOptions"},
                        "resource": {"group": "", "version": "v1", "resource": "pods"},
                        "subResource": sub, "name": "p", "namespace": "ns",
                        "operation": "CONNECT", "userInfo": {"username": ALICE},
                        "object": {"kind": "PodExecOptions", "apiVersion": "v1",
                                   "container": container, "command": ["sh"]}}})
        assert status == 200
        return answer["response"]

    for sub in ("exec", "attach"):
        refused = connect("kai-fractions-gate", sub)
        assert refused["allowed"] is False
        assert refused["status"]["message"].startswith(
            f"pods/{sub}: container 'kai-fractions-gate' is kai-fractions' gate")
    assert connect("main")["allowed"] is True


def test_a_gate_brought_with_its_termination_log_over_the_marker_is_replaced(
        webhook: Webhook) -> None:
    gate = wired(webhook, pod({REQUEST: "8Gi"}))["spec"]["initContainers"][0]
    assert gate["terminationMessagePath"] == "/dev/termination-log"
    brought = {**copy.deepcopy(gate), "terminationMessagePath": "/kai-fractions/marker/marker.json"}
    out = wired(webhook, pod({REQUEST: "8Gi"}, initContainers=[brought]))
    assert out["spec"]["initContainers"] == [gate]


# -- a pod kept from the mutating webhook (webhook.objectSelector), wired by hand --------------

def _drop_main_wiring(obj: dict[str, Any]) -> None:
    """Every GPU of the node, no limits env, no MPS mount: the container runs uncapped."""
    main = obj["spec"]["containers"][0]
    main["env"] = [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]
    main.pop("volumeMounts", None)


def _swap_volume(name: str, source: dict[str, Any]) -> Any:
    def edit(obj: dict[str, Any]) -> None:
        obj["spec"]["volumes"] = [{"name": name, **source} if v["name"] == name else v
                                  for v in obj["spec"]["volumes"]]
    return edit


HAND_WIRINGS = [
    ("own-gpu-env", _drop_main_wiring, "spec.containers[0].env[0]: NVIDIA_VISIBLE_DEVICES of "
     "container 'main', which has the GPU fraction, must be read from"),
    ("marker-nfs", _swap_volume("kai-fractions-marker", {"nfs": {"server": "evil.example.com",
                                                                "path": "/m"}}),
     "volume 'kai-fractions-marker' must be a hostPath volume of the host directory "
     "'/var/lib/kai-fractions/markers'"),
    ("marker-pvc", _swap_volume("kai-fractions-marker",
                                {"persistentVolumeClaim": {"claimName": "rwx"}}),
     "volume 'kai-fractions-marker' must be a hostPath volume"),
    ("marker-emptydir", _swap_volume("kai-fractions-marker", {"emptyDir": {}}),
     "volume 'kai-fractions-marker' must be a hostPath volume"),
    ("mps-emptydir", _swap_volume("kai-fractions-mps", {"emptyDir": {}}),
     "volume 'kai-fractions-mps' must be a hostPath volume of the host directory "
     "'/run/kai-fractions/mps/shared'"),
    ("podinfo-configmap", _swap_volume("kai-fractions-podinfo", {"configMap": {"name": "f"}}),
     "volume 'kai-fractions-podinfo' must be the downward API volume of the pod's annotations"),
]


@pytest.mark.parametrize(("edit", "problem"), [(e, p) for _, e, p in HAND_WIRINGS],
                         ids=[i for i, _, _ in HAND_WIRINGS])
def test_a_pod_wired_by_hand_is_refused_without_the_mutating_webhook(
        webhook: Webhook, edit: Any, problem: str) -> None:
    """The chart's webhook.objectSelector matches the pod's own labels: a tenant copies the
    wiring from a server-side dry run, changes what enforces its limits, and labels the pod
    past the mutating webhook. Only /validate sees it, on its creation and on the binder's
    bind after it; an unchanged copy passes both."""
    copied = wired(webhook, pod({REQUEST: "8Gi", MODE: "sm-sharing"}, containers=("main", "side")))
    copied["metadata"]["labels"] = {"skip-mutation": "yes"}
    assert review(webhook, copied)["allowed"] is True
    assert review(webhook, _bound(copied), old=copied, user=BINDER)["allowed"] is True
    forged = copy.deepcopy(copied)
    edit(forged)
    response = review(webhook, forged)
    assert response["allowed"] is False
    assert response["status"]["code"] == 403
    assert problem in response["status"]["message"]


def _bound(obj: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(obj)
    out["metadata"]["annotations"].update({DEVICES: GPU, PORTION: "0.25"})
    return out
