"""A pod with a GPU fraction may not reach past its containers (docs/admission.md, "What the
validating webhook refuses"): the namespaces that run fractions need Pod Security `privileged`
for the gate's hostPath, so the webhook refuses the rest of what that level allows itself.
"""

from __future__ import annotations

import copy
from typing import Any

import jsonpatch
import pytest

from kai_fractions.admission.config import AdmissionConfig
from kai_fractions.admission.mutate import mutate
from kai_fractions.admission.validate import validate

from .reviews import BINDER, CONFIG, GPU, SM, TS, pod, request

DEVICES = "nvidia.com/container.main.gpus.devices"
RULE = "in a pod with a GPU fraction"


def wired(obj: dict[str, Any], *, old: dict[str, Any] | None = None,
          sub: str = "") -> dict[str, Any]:
    decision = mutate(request(obj, old=old, sub=sub), CONFIG)
    assert decision.allowed, decision
    return jsonpatch.apply_patch(copy.deepcopy(obj), list(decision.patch))


def fractional(containers: tuple[str, ...] = ("main",), **spec: Any) -> dict[str, Any]:
    obj = pod(dict(TS), containers=containers, **spec)
    obj["spec"]["initContainers"] = [{"name": "fetch", "image": "img"}]
    return obj


def bound(obj: dict[str, Any]) -> dict[str, Any]:
    """`obj` wired and bound, as it runs on its node."""
    out = wired(obj)
    out["metadata"]["uid"] = "uid-1"
    out["metadata"]["annotations"][DEVICES] = GPU
    return out


def context(obj: dict[str, Any], field: str, index: int, **security: Any) -> dict[str, Any]:
    """`obj` with a security context on one container (before wiring: the gate comes first
    after it)."""
    obj["spec"][field][index]["securityContext"] = security
    return obj


def spec(**fields: Any):
    """A change setting pod-level spec fields."""
    return lambda o: {**o, "spec": {**o["spec"], **fields}}


def mounted(path: str, propagation: str | None = None, field: str = "containers",
            index: int = 0):
    """A change adding a hostPath volume `path`, mounted by one container."""
    def change(o: dict[str, Any]) -> dict[str, Any]:
        o["spec"].setdefault("volumes", []).append({"name": "host", "hostPath": {"path": path}})
        mount = {"name": "host", "mountPath": "/host"}
        if propagation is not None:
            mount["mountPropagation"] = propagation
        o["spec"][field][index].setdefault("volumeMounts", []).append(mount)
        return o
    return change


def propagating(value: str, field: str = "containers", index: int = 0):
    """A change mounting an emptyDir with `mountPropagation: value` in one container."""
    def change(o: dict[str, Any]) -> dict[str, Any]:
        o["spec"].setdefault("volumes", []).append({"name": "scratch", "emptyDir": {}})
        o["spec"][field][index]["volumeMounts"] = [
            {"name": "scratch", "mountPath": "/scratch", "mountPropagation": value}]
        return o
    return change


HOST_PATH_RULE = (" may not be mounted " + RULE + ": a host path reaches past the container "
                  "(the runtime's socket is node root, /sys/fs/cgroup holds other pods' "
                  "limits); only the webhook's own volumes and the host paths the administrator "
                  "trusts (--trusted-host-path, the chart's webhook.trustedHostPaths) may be")
PROPAGATION_RULE = ("): mounts made on the host later, other pods' volumes among them, would "
                    "appear in the container, and with Bidirectional its own would reach the "
                    "host")
TENANT_HOST_PATHS = ["/run/containerd/containerd.sock", "/var/run/containerd/containerd.sock",
                     "/sys/fs/cgroup", "/etc", "/dev", "/var/lib/containerd", "/var/log",
                     "/tmp", "/proc/meminfo", "/mnt/datasets"]

REFUSED = [
    pytest.param(lambda o: context(o, "containers", 0, privileged=True),
                 "spec.containers[0].securityContext.privileged: must not be true " + RULE +
                 ": a privileged container gets every GPU of the node, whatever "
                 "NVIDIA_VISIBLE_DEVICES says", id="privileged"),
    pytest.param(lambda o: context(o, "containers", 1, privileged=True),
                 "spec.containers[1].securityContext.privileged: must not be true " + RULE,
                 id="privileged-sidecar"),
    pytest.param(lambda o: context(o, "initContainers", 0, privileged=True),
                 "spec.initContainers[1].securityContext.privileged: must not be true " + RULE,
                 id="privileged-init"),
    pytest.param(lambda o: {**o, "spec": {**o["spec"], "hostPID": True}},
                 "spec.hostPID: must not be true " + RULE + ": its processes would see the "
                 "host's, the gate of every pod on the node included", id="hostPID"),
    pytest.param(lambda o: {**o, "spec": {**o["spec"], "shareProcessNamespace": True}},
                 "spec.shareProcessNamespace: must not be true " + RULE + ": its containers "
                 "would see the kai-fractions-gate process and could make it exit before the "
                 "node agent applied the pod's limits", id="shareProcessNamespace"),
    pytest.param(lambda o: context(o, "containers", 0, procMount="Unmasked"),
                 "spec.containers[0].securityContext.procMount: must not be Unmasked " + RULE +
                 ": an unmasked /proc exposes the host's kernel interfaces", id="procMount"),
    *[pytest.param(lambda o, cap=cap: context(o, "containers", 0, capabilities={
        "add": ["IPC_LOCK", cap]}),
        f"spec.containers[0].securityContext.capabilities.add[1]: {cap!r} may not be added "
        + RULE, id=cap)
      for cap in ("ALL", "SYS_ADMIN", "SYS_PTRACE", "SYS_MODULE", "SYS_RAWIO", "BPF",
                  "PERFMON", "DAC_READ_SEARCH",
                  "CAP_SYS_ADMIN", "sys_ptrace", "all")],  # as the runtimes read them too
    pytest.param(spec(hostIPC=True),
                 "spec.hostIPC: must not be true " + RULE + ": its processes would share the "
                 "host's IPC namespace, with the shared memory of the MPS servers (the host's "
                 "/dev/shm) and of every other process there", id="hostIPC"),
    pytest.param(spec(hostNetwork=True),
                 "spec.hostNetwork: must not be true " + RULE + ": its processes would share "
                 "the node's network namespace, every service listening on the node's loopback "
                 "included, where no NetworkPolicy applies", id="hostNetwork"),
    *[pytest.param(propagating(value, field, index),
                   f"spec.{field}[{shown}].volumeMounts[0].mountPropagation: must be None or "
                   f"unset {RULE} (got {value!r}" + PROPAGATION_RULE, id=f"{value}-{field}")
      for value in ("HostToContainer", "Bidirectional")
      for field, index, shown in (("containers", 0, 0), ("containers", 1, 1),
                                  ("initContainers", 0, 1))],
    *[pytest.param(mounted(path), f"spec.volumes[0].hostPath.path: {path!r}" + HOST_PATH_RULE,
                   id=path) for path in TENANT_HOST_PATHS],
    pytest.param(mounted("/etc", field="containers", index=1),
                 "spec.volumes[0].hostPath.path: '/etc'" + HOST_PATH_RULE, id="sidecar-etc"),
]


@pytest.mark.parametrize(("change", "message"), REFUSED)
def test_a_fractional_pod_may_not_reach_past_its_containers(change, message: str) -> None:
    obj = wired(change(fractional(("main", "side"))))
    d = validate(request(obj), CONFIG)
    assert (d.allowed, d.code) == (False, 403)
    assert d.message.startswith(message), d.message


def test_what_gpu_training_pods_carry_stays_allowed() -> None:
    """A manifest written for upstream KAI keeps working: RDMA's IPC_LOCK, volumes that are not
    host paths (a large /dev/shm, a PVC, a ConfigMap), explicit safe defaults."""
    obj = fractional(("main", "side"), hostNetwork=False, hostIPC=False,
                     shareProcessNamespace=False, hostPID=False, volumes=[
                         {"name": "shm", "emptyDir": {"medium": "Memory"}},
                         {"name": "data", "persistentVolumeClaim": {"claimName": "data"}},
                         {"name": "conf", "configMap": {"name": "conf"}}])
    obj["spec"]["containers"][0]["volumeMounts"] = [
        {"name": "shm", "mountPath": "/dev/shm", "mountPropagation": "None"},
        {"name": "data", "mountPath": "/data"}, {"name": "conf", "mountPath": "/conf"}]
    context(obj, "containers", 0, privileged=False, allowPrivilegeEscalation=False,
            procMount="Default", capabilities={
                "add": ["IPC_LOCK", "NET_ADMIN", "NET_RAW", "SYS_NICE", "SYS_RESOURCE"],
                "drop": ["ALL"]})
    d = validate(request(wired(obj)), CONFIG)
    assert d.allowed, d.message
    # and the line is drawn inside that same pod
    obj["spec"]["containers"][0]["securityContext"]["capabilities"]["add"].append("SYS_ADMIN")
    d = validate(request(wired(obj)), CONFIG)
    assert d.message.startswith("spec.containers[0].securityContext.capabilities.add[5]: "
                                "'SYS_ADMIN' may not be added"), d.message


def test_a_pod_carrying_a_reserved_volume_is_held_to_it_too() -> None:
    """A pod without NvFractions keys that brings the webhook's marker volume: the host-path
    rule and the mount rule see to the volume, this one to a privileged container beside it."""
    obj = pod({}, volumes=[{"name": "kai-fractions-marker", "hostPath": {
        "path": "/var/lib/kai-fractions/markers"}}])
    context(obj, "containers", 0, privileged=True)
    d = validate(request(obj), CONFIG)
    assert not d.allowed
    assert "spec.containers[0].securityContext.privileged: must not be true" in d.message
    # a plain pod is Pod Security's business, not this webhook's
    plain = context(pod({}), "containers", 0, privileged=True)
    assert validate(request(plain), CONFIG).allowed


def test_an_ephemeral_container_may_not_be_privileged_or_trace() -> None:
    old = bound(fractional())
    for security, field in (({"privileged": True}, "privileged"),
                            ({"capabilities": {"add": ["SYS_PTRACE"]}}, "capabilities.add[0]")):
        new = copy.deepcopy(old)
        new["spec"]["ephemeralContainers"] = [{"name": "debug", "image": "busybox",
                                               "targetContainerName": "main",
                                               "securityContext": security}]
        new = wired(new, old=old, sub="ephemeralcontainers")
        d = validate(request(new, old=old, sub="ephemeralcontainers"), CONFIG)
        assert not d.allowed
        assert d.message.startswith(
            f"spec.ephemeralContainers[0].securityContext.{field}: "), d.message


def test_an_ephemeral_container_may_not_join_the_gates_process_namespace() -> None:
    """Sharing the gate's process namespace, a process of its user (`nobody`) could make it exit
    0 before the node agent applied the limits; `kubectl debug --target` on the workload stays
    allowed."""
    old = bound(fractional())
    new = copy.deepcopy(old)
    new["spec"]["ephemeralContainers"] = [{
        "name": "debug", "image": "busybox", "targetContainerName": "kai-fractions-gate",
        "securityContext": {"runAsUser": 65534}}]
    new = wired(new, old=old, sub="ephemeralcontainers")
    d = validate(request(new, old=old, sub="ephemeralcontainers"), CONFIG)
    assert (d.allowed, d.message) == (False, (
        "spec.ephemeralContainers[0].targetContainerName: must not be kai-fractions-gate: a "
        "container in the gate's process namespace could make it exit before the node agent "
        "applied the pod's limits"))
    new["spec"]["ephemeralContainers"][0]["targetContainerName"] = "main"
    assert validate(request(new, old=old, sub="ephemeralcontainers"), CONFIG).allowed


def test_a_pod_admitted_privileged_before_this_rule_can_still_be_updated() -> None:
    """Only what an update introduces is refused: such a pod can be relabelled and deleted."""
    created = wired(context(fractional(), "containers", 0, privileged=True))
    assert not validate(request(created), CONFIG).allowed
    old = bound(created)
    relabelled = copy.deepcopy(old)
    relabelled["metadata"]["labels"] = {"team": "a"}
    assert validate(request(relabelled, old=old), CONFIG).allowed


# -- host paths, and the administrator's trusted ones ---------------------------------------

@pytest.mark.parametrize("annotations", [TS, SM], ids=["time-slicing", "sm-sharing"])
def test_the_webhooks_own_host_paths_pass(annotations: dict[str, str]) -> None:
    """The gate's marker root and an sm-sharing container's MPS namespace are host paths the
    webhook injects itself: a wired pod, created and bound, passes."""
    obj = wired(pod(dict(annotations), containers=("main", "side")))
    paths = {v["name"]: v["hostPath"]["path"] for v in obj["spec"]["volumes"] if "hostPath" in v}
    assert paths.pop("kai-fractions-marker") == "/var/lib/kai-fractions/markers"
    assert paths == ({"kai-fractions-mps": "/run/kai-fractions/mps/shared"}
                     if annotations is SM else {})
    d = validate(request(obj), CONFIG)
    assert d.allowed, d.message
    running = copy.deepcopy(obj)
    running["metadata"]["uid"] = "uid-1"
    running["metadata"]["annotations"][DEVICES] = GPU
    assert validate(request(running, old=obj, user=BINDER), CONFIG).allowed


def trusted() -> AdmissionConfig:
    """The administrator trusts /mnt/datasets and /var/lib (a parent of guarded directories)."""
    return AdmissionConfig(gate_image=CONFIG.gate_image,
                           trusted_host_paths=("/mnt/datasets", "/var/lib"))


@pytest.mark.parametrize("path", ["/mnt/datasets", "/mnt/datasets/imagenet", "/mnt//datasets/.",
                                  "/var/lib/containerd"])
def test_a_trusted_host_path_passes(path: str) -> None:
    """`--trusted-host-path`: the administrator's host paths, and what is under them."""
    obj = wired(mounted(path)(fractional()))
    assert not validate(request(obj), CONFIG).allowed
    d = validate(request(obj), trusted())
    assert d.allowed, d.message


@pytest.mark.parametrize(("path", "rule"), [
    ("/mnt/datasets/../../etc", HOST_PATH_RULE), ("/mnt/datasets-2", HOST_PATH_RULE),
    ("/mnt", HOST_PATH_RULE),
    # trusting a parent never lets kai-fractions' directories or the kubelet's through
    ("/var/lib/kubelet/pods", " reaches the kubelet's pods directory '/var/lib/kubelet/pods'"),
    ("/var/lib", " reaches the kai-fractions directory '/var/lib/kai-fractions/markers'"),
])
def test_only_what_is_trusted_passes(path: str, rule: str) -> None:
    obj = wired(mounted(path)(fractional()))
    d = validate(request(obj), trusted())
    assert d.message.startswith(f"spec.volumes[0].hostPath.path: {path!r}{rule}"), d.message
    assert HOST_PATH_RULE not in d.message or rule == HOST_PATH_RULE  # one problem per path


@pytest.mark.parametrize("path", ["/", "/proc", "/proc/1/cwd", "mnt/datasets", "",
                                  "/" + "a" * 4096])
def test_a_trusted_host_path_must_be_one(path: str) -> None:
    with pytest.raises(ValueError, match=r"trusted_host_paths: .* must be an absolute host path"):
        AdmissionConfig(gate_image=CONFIG.gate_image, trusted_host_paths=(path,))


def test_a_plain_pod_is_left_to_pod_security_but_the_kubelets_directory() -> None:
    """Without NvFractions keys: host namespaces, propagation and other host paths are Pod
    Security's or a policy engine's (the namespace may be `privileged` for good reasons);
    kai-fractions' directories and the kubelet's are refused in every pod."""
    plain = mounted("/run/containerd/containerd.sock", "HostToContainer")(
        pod({}, hostIPC=True, hostNetwork=True))
    assert validate(request(plain), CONFIG).allowed
    kubelet = mounted("/var/lib/kubelet/pods", "HostToContainer")(pod({}))
    assert not validate(request(kubelet), CONFIG).allowed


def test_kais_reservation_pods_are_unaffected() -> None:
    """KAI's binder creates them (upstream pkg/binder/binding/resourcereservation) in a
    namespace the chart's webhooks skip; reviewed anyway, nothing in them is refused."""
    reservation = pod({"run.ai/reserve_for_gpu_index": GPU,
                       "nvidia.com/container.resource-reservation.gpu-compute.mode":
                           "sm-sharing"}, containers=("resource-reservation",),
                      nodeName="node-a", runtimeClassName="nvidia",
                      serviceAccountName="kai-resource-reservation")
    reservation["spec"]["containers"][0].update({
        "resources": {"limits": {"nvidia.com/gpu": "1", "cpu": "1m", "memory": "10Mi"}},
        "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "POD_NAMESPACE",
                 "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}]})
    assert validate(request(reservation), CONFIG).allowed
    assert mutate(request(reservation), CONFIG).patch == ()


def test_a_pod_admitted_with_host_ipc_before_this_rule_can_still_be_updated() -> None:
    created = wired(mounted("/etc", "HostToContainer")(fractional(hostIPC=True)))
    d = validate(request(created), CONFIG)
    fields = ("spec.volumes[0].hostPath.path: '/etc' may not be mounted", "; spec.hostIPC: ",
              "; spec.containers[0].volumeMounts[0].mountPropagation: ")
    assert d.message.startswith(fields[0])
    assert 0 < d.message.index(fields[1]) < d.message.index(fields[2])
    old = bound(created)
    relabelled = copy.deepcopy(old)
    relabelled["metadata"]["labels"] = {"team": "a"}
    assert validate(request(relabelled, old=old), CONFIG).allowed
