"""A pod with a GPU fraction may not reach past its containers (docs/admission.md, "What the
validating webhook refuses"): the namespaces that run fractions need Pod Security `privileged`
for the gate's hostPath, so the webhook refuses the rest of what that level allows itself.
"""

from __future__ import annotations

import copy
from typing import Any

import jsonpatch
import pytest

from kai_fractions.admission.mutate import mutate
from kai_fractions.admission.validate import validate

from .reviews import CONFIG, GPU, TS, pod, request

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
                  # the node's clock is not namespaced: setting it breaks TLS and Leases
                  # node-wide (second review, R7-2)
                  "SYS_TIME", "cap_sys_time",
                  "CAP_SYS_ADMIN", "sys_ptrace", "all")],  # as the runtimes read them too
    # The toolkit's device list as volume mounts (nvidia-container-toolkit internal/config/
    # image, DeviceListAsVolumeMountsRoot): a /dev/null there names a GPU, before the env.
    *[pytest.param(lambda o, c=c, at=at: device_list_mount(o, c, at),
                   f"spec.containers[{c}].volumeMounts[0].mountPath: {at!r} may not be mounted "
                   + RULE + ": the NVIDIA container toolkit can read mounts whose path starts "
                   "with /var/run/nvidia-container-devices as the container's GPUs",
                   id=f"device-list-{c}-{at}")
      for c, at in ((0, "/var/run/nvidia-container-devices/GPU-ffffffff-0000-0000-0000-"
                        "000000000000"),
                    (1, "/var/run/nvidia-container-devices/all"),
                    (1, "/run/nvidia-container-devices"),
                    (0, "//var/run/./nvidia-container-devices/x/../all"),
                    # the toolkit compares strings: this names device `all` (second review)
                    (0, "/var/run/nvidia-container-devicesall"),
                    (1, "/var/run/nvidia-container-devices/../nvidia-container-devices0"))],
]


def device_list_mount(obj: dict[str, Any], container: int, at: str) -> dict[str, Any]:
    obj["spec"].setdefault("volumes", []).append(
        {"name": "null", "hostPath": {"path": "/dev/null", "type": "CharDevice"}})
    obj["spec"]["containers"][container]["volumeMounts"] = [{"name": "null", "mountPath": at}]
    return obj


@pytest.mark.parametrize(("change", "message"), REFUSED)
def test_a_fractional_pod_may_not_reach_past_its_containers(change, message: str) -> None:
    obj = wired(change(fractional(("main", "side"))))
    d = validate(request(obj), CONFIG)
    assert (d.allowed, d.code) == (False, 403)
    assert d.message.startswith(message), d.message


def test_what_gpu_training_pods_carry_stays_allowed() -> None:
    """A manifest written for upstream KAI keeps working: RDMA's IPC_LOCK, the node's network,
    shared memory with the MPS server, explicit safe defaults."""
    obj = fractional(("main", "side"), hostNetwork=True, hostIPC=True,
                     shareProcessNamespace=False, hostPID=False)
    context(obj, "containers", 0, privileged=False, allowPrivilegeEscalation=False,
            procMount="Default", capabilities={
                "add": ["IPC_LOCK", "NET_ADMIN", "NET_RAW", "SYS_NICE", "SYS_RESOURCE"],
                "drop": ["ALL"]})
    obj["spec"]["volumes"] = [{"name": "run", "emptyDir": {}}]
    obj["spec"]["containers"][1]["volumeMounts"] = [  # beside the device-list root
        {"name": "run", "mountPath": "/var/run/nvidia-container-toolkit"}]
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
