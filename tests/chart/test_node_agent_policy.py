"""The node agent may write only what it owns (issue 17, finding 7), read from the rendered
chart: its RBAC grants exactly the verbs its Kubernetes client calls (no `get pods`, no `patch
nodes` unless it publishes the GPU memory label), and the own-node ValidatingAdmissionPolicy,
evaluated here with a CEL interpreter on real updates (old and new object), lets it change only
its derived annotations on its own node's pods, only its readiness conditions in its Node's
status, and on the Node itself only the `nvidia.com/gpu.memory` label, and only when
`nodeAgent.publishGpuMemoryLabel` is on."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import celpy
import pytest

from kai_fractions.contract import keys as k
from kai_fractions.kube.objects import heartbeat_lease_name
from kai_fractions.node.agent import kube

from .render import CHART, NAMESPACE, find, one, render

AGENT = "kai-fractions-node-agent"
AGENT_USER = f"system:serviceaccount:{NAMESPACE}:{AGENT}"
NODE_KEY = "authentication.kubernetes.io/node-name"
NODE = "gpu-node-1"
WATCHDOG_KILL = CHART / "ci" / "watchdog-kill-values.yaml"  # publishGpuMemoryLabel: true
LABEL = ("nodeAgent.publishGpuMemoryLabel=true",)
_ENV = celpy.Environment()


def cel(expression: str, **activation: Any) -> Any:
    program = _ENV.program(_ENV.compile(expression))
    return program.evaluate({name: celpy.json_to_cel(value) for name, value in
                             activation.items()})


def policy(*sets: str) -> dict:
    return one(render(None, sets), "ValidatingAdmissionPolicy", f"{AGENT}-own-node")


def review(pol: dict, old: dict | None, new: dict, resource: str, *, user: str = AGENT_USER,
           node: str = NODE, operation: str = "UPDATE", group: str = "") -> list[str]:
    """The messages of the validations a write fails, evaluated like the API server:
    matchConstraints, matchConditions, variables in order, validations."""
    name, _, sub = resource.partition("/")
    rules = pol["spec"]["matchConstraints"]["resourceRules"]
    if not any(resource in r["resources"] and operation in r["operations"]
               and group in r["apiGroups"] for r in rules):
        return []
    request = {"operation": operation, "subResource": sub,
               "resource": {"group": group, "version": "v1", "resource": name},
               "userInfo": {"username": user, "extra": {NODE_KEY: [node]}}}
    spec = pol["spec"]
    if not all(cel(m["expression"], request=request) for m in spec["matchConditions"]):
        return []
    variables: dict[str, Any] = {}
    for v in spec.get("variables", []):
        try:  # the API server evaluates a variable only where a validation reads it
            variables[v["name"]] = cel(v["expression"], request=request, object=new,
                                       oldObject=old, variables=variables)
        except Exception:
            if operation != "CREATE" or "oldObject" not in v["expression"]:
                raise
            variables[v["name"]] = None  # oldObject is null on CREATE
    return [v.get("message") or str(cel(v["messageExpression"], variables=variables))
            for v in spec["validations"]
            if not cel(v["expression"], request=request, object=new, oldObject=old,
                       variables=variables)]


def pod(node: str = NODE) -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "train-0", "namespace": "team-a", "uid": "u-1",
                         "labels": {"app": "train"},
                         "annotations": {"nvidia.com/container.main.gpu-memory.request": "20Gi",
                                         "nvidia.com/container.main.gpus.devices": "GPU-1",
                                         "kai-fractions.io/container.main.signature": "v2;x"}},
            "spec": {"nodeName": node, "containers": [{"name": "main", "image": "app:1"}]}}


def node(name: str = NODE) -> dict:
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"nvidia.com/gpu.present": "true",
                                                  "kubernetes.io/hostname": name},
                         "annotations": {"node.alpha.kubernetes.io/ttl": "0"}},
            "spec": {"podCIDR": "10.0.0.0/24"},
            "status": {"capacity": {"nvidia.com/gpu": "4", "cpu": "64"},
                       "allocatable": {"nvidia.com/gpu": "4", "cpu": "63"},
                       "conditions": [
                           {"type": "Ready", "status": "True", "reason": "KubeletReady"},
                           {"type": k.NODE_CONDITION, "status": "False", "reason": "Starting"},
                           {"type": k.LEGACY_NODE_CONDITION, "status": "False",
                            "reason": "Starting"}],
                       "nodeInfo": {"kubeletVersion": "v1.31.0"}}}


def changed(obj: dict, edit) -> dict:
    new = copy.deepcopy(obj)
    edit(new)
    return new


def condition(obj: dict, kind: str) -> dict:
    return next(c for c in obj["status"]["conditions"] if c["type"] == kind)


POD_DENIED = ("the node agent may add, change or remove only its derived annotations "
              "kai-fractions.io/container.<container>.* on pods (not .signature or "
              ".mps-namespace, not any other key)")
POD_FIELDS = ("the node agent may change only annotations on pods, never their spec, labels, "
              "owner references or finalizers")
STATUS_ONLY = ("the node agent may update only its Node's status (nodes/status): "
               "nodeAgent.publishGpuMemoryLabel is off")
NO_LABELS = ("the node agent may not change its Node's labels "
             "(nodeAgent.publishGpuMemoryLabel is off)")
ONE_LABEL = ("the node agent may set only the label nvidia.com/gpu.memory on its Node (never "
             "remove it, never another label)")
NODE_SPEC = ("the node agent may not change its Node's spec (taints, unschedulable, ...), "
             "annotations, owner references or finalizers")


def status_only(conditions: str) -> str:
    return (f"the node agent may change only the conditions {conditions} of its Node's status "
            "(not the other conditions, capacity, allocatable or any other status field)")


BOTH_CONDITIONS = status_only(f"{k.NODE_CONDITION}, {k.LEGACY_NODE_CONDITION}")


# -- RBAC: exactly the verbs the agent's client calls -------------------------------------------

# Every request kai_fractions/node/agent/kube.py makes (verb, the kube.objects path helper, a
# subresource), and the (resource, verbs) it needs. A new request fails
# test_the_agent_calls_only_what_it_is_granted until it is listed here (and granted, or refused
# on purpose).
CALLS = {
    ("LIST", "pods_path", ""): ("pods", {"list", "watch"}),  # the Collection: list, then watch
    ("PATCH", "pod_path", ""): ("pods", {"patch"}),
    ("GET", "node_path", ""): ("nodes", {"get"}),
    ("PATCH", "node_path", "/status"): ("nodes/status", {"patch"}),
    ("PATCH", "node_path", ""): ("nodes", {"patch"}),  # the GPU memory label only
    ("POST", "events_path", ""): ("events", {"create"}),
    ("PATCH", "lease_path", ""): ("leases", {"patch"}),  # its heartbeat, renewed
    ("POST", "lease_path", ""): ("leases", {"create"}),  # the first time
}
REQUEST = re.compile(r'request\(\s*"(\w+)",\s*(\w+)\([^)]*\)(?:\s*\+\s*"(/\w+)")?')
COLLECTION = re.compile(r"Collection\(\s*self\.blocking\.kube,\s*(\w+)\(")


def agent_rules(*sets: str) -> dict[str, set[str]]:
    docs = render(None, sets)
    role = one(docs, "ClusterRole", AGENT)
    out: dict[str, set[str]] = {}
    for r in role["rules"]:
        assert r["apiGroups"] == [""], r
        assert "resourceNames" not in r, r
        for resource in r["resources"]:
            out.setdefault(resource, set()).update(r["verbs"])
    heartbeat = one(docs, "Role", f"{AGENT}-heartbeat")  # in the release namespace only
    assert heartbeat["metadata"]["namespace"] == NAMESPACE
    assert [r["apiGroups"] for r in heartbeat["rules"]] == [["coordination.k8s.io"]]
    out.setdefault("leases", set()).update(heartbeat["rules"][0]["verbs"])
    return out


def test_the_agent_calls_only_what_it_is_granted():
    source = Path(kube.__file__).read_text()
    called = {(verb, path, sub or "") for verb, path, sub in REQUEST.findall(source)}
    called |= {("LIST", path, "") for path in COLLECTION.findall(source)}
    assert called == set(CALLS), f"update CALLS: the agent now calls {sorted(called)}"
    with_label = agent_rules(*LABEL)
    for method, (resource, verbs) in CALLS.items():
        assert verbs <= with_label.get(resource, set()), method
    without = agent_rules()
    for method, (resource, verbs) in CALLS.items():
        if method != ("PATCH", "node_path", ""):
            assert verbs <= without.get(resource, set()), method


def test_the_agent_rbac_is_exactly_its_calls():
    leases = {"create", "patch"}
    assert agent_rules() == {"pods": {"list", "watch", "patch"}, "events": {"create"},
                             "nodes": {"get"}, "nodes/status": {"patch"}, "leases": leases}
    assert agent_rules(*LABEL) == {"pods": {"list", "watch", "patch"}, "events": {"create"},
                                   "nodes": {"get", "patch"}, "nodes/status": {"patch"},
                                   "leases": leases}
    role = one(render(WATCHDOG_KILL), "ClusterRole", AGENT)
    assert {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]} in role[
        "rules"]


# -- the policy: pods ----------------------------------------------------------------------------

def test_the_agent_may_write_its_derived_annotations_on_its_pods():
    pol = policy()
    old = pod()

    def add(p):
        p["metadata"]["annotations"].update({
            "kai-fractions.io/container.main.memory-request-mib": "20480",
            "kai-fractions.io/container.main.plan-digest": "sha256:abc"})
    assert review(pol, old, changed(old, add), "pods") == []
    with_derived = changed(old, add)
    assert review(pol, with_derived, changed(
        with_derived, lambda p: p["metadata"]["annotations"].pop(
            "kai-fractions.io/container.main.plan-digest")), "pods") == []
    # no annotations at all before
    bare = changed(old, lambda p: p["metadata"].pop("annotations"))
    assert review(pol, bare, changed(bare, lambda p: p["metadata"].update(annotations={
        "kai-fractions.io/container.main.memory-limit-mib": "30720"})), "pods") == []


@pytest.mark.parametrize("key", [
    "kai-fractions.io/container.main.signature",  # only the mirror signs
    "kai-fractions.io/container.main.mps-namespace",  # the admission webhook names it
    k.MIRRORED_RECORD,  # the mirror's record
    "nvidia.com/container.main.gpu-memory.request",  # binder-owned / user keys
    "nvidia.com/container.main.gpus.devices",
    "example.com/anything",
])
def test_the_agent_may_not_touch_any_other_annotation(key):
    pol = policy()
    old = pod()
    assert review(pol, old, changed(
        old, lambda p: p["metadata"]["annotations"].update({key: "forged"})), "pods") == [
        POD_DENIED]
    if key in old["metadata"]["annotations"]:
        assert review(pol, old, changed(
            old, lambda p: p["metadata"]["annotations"].pop(key)), "pods") == [POD_DENIED]


@pytest.mark.parametrize("edit", [
    lambda p: p["metadata"]["labels"].update(app="other"),
    lambda p: p["spec"]["containers"][0].update(image="evil:1"),
    lambda p: p["metadata"].update(finalizers=["example.com/keep"]),
    lambda p: p["metadata"].update(ownerReferences=[{"kind": "Job", "name": "j"}]),
], ids=["label", "spec", "finalizer", "owner"])
def test_the_agent_may_not_change_anything_else_of_a_pod(edit):
    old = pod()
    assert review(policy(), old, changed(old, edit), "pods") == [POD_FIELDS]


def test_pods_of_other_nodes_are_refused_whatever_changes():
    old = pod(node="gpu-node-2")
    new = changed(old, lambda p: p["metadata"]["annotations"].update({
        "kai-fractions.io/container.main.plan-digest": "x"}))
    assert review(policy(), old, new, "pods") == [
        "the node agent on gpu-node-1 may update only pods bound to that node"]


def test_other_users_are_not_this_policys_business():
    old = pod()
    new = changed(old, lambda p: p["metadata"]["annotations"].update({"x": "y"}))
    assert review(policy(), old, new, "pods",
                  user=f"system:serviceaccount:{NAMESPACE}:kai-fractions-mirror") == []


# -- the policy: its Node's status ---------------------------------------------------------------

def test_the_agent_may_publish_its_conditions():
    pol = policy()
    old = node()

    def ready(n):
        for kind in (k.NODE_CONDITION, k.LEGACY_NODE_CONDITION):
            condition(n, kind).update(status="True", reason="Ready")
    assert review(pol, old, changed(old, ready), "nodes/status") == []
    # the first publication adds them
    without = changed(old, lambda n: n["status"].update(
        conditions=[c for c in n["status"]["conditions"] if c["type"] == "Ready"]))
    assert review(pol, without, old, "nodes/status") == []


@pytest.mark.parametrize("edit", [
    lambda n: condition(n, "Ready").update(status="False"),  # the kubelet's condition
    lambda n: n["status"]["conditions"].append({"type": "DiskPressure", "status": "True"}),
    lambda n: n["status"]["capacity"].update({"nvidia.com/gpu": "8"}),  # advertise fake GPUs
    lambda n: n["status"]["allocatable"].update({"example.com/fpga": "1"}),
    lambda n: n["status"]["nodeInfo"].update(kubeletVersion="v9"),
], ids=["kubelet-condition", "new-condition", "capacity", "allocatable", "node-info"])
def test_the_agent_may_not_change_the_rest_of_its_nodes_status(edit):
    old = node()
    assert review(policy(), old, changed(old, edit), "nodes/status") == [BOTH_CONDITIONS]


def test_the_legacy_condition_is_the_agents_only_when_it_publishes_it():
    old = node()
    new = changed(old, lambda n: condition(n, k.LEGACY_NODE_CONDITION).update(status="True"))
    assert review(policy(), old, new, "nodes/status") == []
    assert review(policy("nodeCondition.legacy=false"), old, new, "nodes/status") == [
        status_only(k.NODE_CONDITION)]


def test_no_label_taint_or_annotation_through_the_status_either():
    old = node()
    pol = policy(*LABEL)
    label = changed(old, lambda n: n["metadata"]["labels"].update(
        {k.NODE_GPU_MEMORY_LABEL: "81920"}))
    assert review(pol, old, label, "nodes/status") == [ONE_LABEL]
    assert review(policy(), old, label, "nodes/status") == [NO_LABELS]
    taint = changed(old, lambda n: n["spec"].update(
        taints=[{"key": "x", "effect": "NoSchedule"}]))
    assert review(pol, old, taint, "nodes/status") == [NODE_SPEC]


# -- the policy: the Node itself (labels) --------------------------------------------------------

def test_without_the_label_option_the_node_itself_is_not_the_agents():
    old = node()
    new = changed(old, lambda n: n["metadata"]["labels"].update(
        {k.NODE_GPU_MEMORY_LABEL: "81920"}))
    assert review(policy(), old, new, "nodes") == [STATUS_ONLY, NO_LABELS]
    assert review(policy(), old, old, "nodes") == [STATUS_ONLY]


def test_with_the_label_option_only_the_gpu_memory_label():
    pol = policy(*LABEL)
    old = node()
    assert k.NODE_GPU_MEMORY_LABEL == "nvidia.com/gpu.memory"
    labelled = changed(old, lambda n: n["metadata"]["labels"].update(
        {k.NODE_GPU_MEMORY_LABEL: "81920"}))
    assert review(pol, old, labelled, "nodes") == []
    assert review(pol, labelled, changed(labelled, lambda n: n["metadata"]["labels"].update(
        {k.NODE_GPU_MEMORY_LABEL: "40960"})), "nodes") == []
    # never another label, never removing it, never a taint, an annotation or the spec
    assert review(pol, old, changed(old, lambda n: n["metadata"]["labels"].update(
        {"nvidia.com/gpu.present": "false"})), "nodes") == [ONE_LABEL]
    assert review(pol, labelled, changed(labelled, lambda n: n["metadata"]["labels"].pop(
        k.NODE_GPU_MEMORY_LABEL)), "nodes") == [ONE_LABEL]
    assert review(pol, old, changed(old, lambda n: n["spec"].update(
        taints=[{"key": "x", "effect": "NoSchedule"}])), "nodes") == [NODE_SPEC]
    assert review(pol, old, changed(old, lambda n: n["spec"].update(unschedulable=True)),
                  "nodes") == [NODE_SPEC]
    assert review(pol, old, changed(old, lambda n: n["metadata"]["annotations"].update(
        {"x": "y"})), "nodes") == [NODE_SPEC]
    # and still only its own Node
    other = node("gpu-node-2")
    assert review(pol, other, changed(other, lambda n: n["metadata"]["labels"].update(
        {k.NODE_GPU_MEMORY_LABEL: "81920"})), "nodes") == [
        "the node agent on gpu-node-1 may update only its own Node"]


# -- the policy: its heartbeat Lease -------------------------------------------------------------


def lease(name: str) -> dict:
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"holderIdentity": NODE, "renewTime": "2026-12-02T12:00:00.000000Z"}}


def test_the_agent_may_write_only_its_own_heartbeat_lease():
    pol = policy()
    own = lease(heartbeat_lease_name(NODE))
    renewed = changed(own, lambda le: le["spec"].update(renewTime="2026-12-02T12:01:00.000000Z"))
    leases = {"resource": "leases", "group": "coordination.k8s.io"}
    assert review(pol, None, own, **leases, operation="CREATE") == []
    assert review(pol, own, renewed, **leases) == []
    refused = [f"the node agent on {NODE} may write only its heartbeat Lease "
               f"kai-fractions-agent.{NODE}"]
    for name in (heartbeat_lease_name("gpu-node-2"), "kai-fractions-mirror-follower"):
        other = lease(name)
        assert review(pol, None, other, **leases, operation="CREATE") == refused
        assert review(pol, other, changed(other, lambda le: le["spec"].update(
            holderIdentity=NODE)), **leases) == refused
    # other users' Leases (the mirror's election, the kubelets') are not this policy's business
    assert review(pol, None, lease("kai-fractions-mirror-follower"), **leases,
                  operation="CREATE", user="system:serviceaccount:kf:kai-fractions-mirror") == []


def test_the_policy_is_bound_and_fails_closed():
    docs = render()
    pol = one(docs, "ValidatingAdmissionPolicy", f"{AGENT}-own-node")
    assert pol["spec"]["failurePolicy"] == "Fail"
    assert pol["spec"]["matchConstraints"]["resourceRules"] == [{
        "apiGroups": [""], "apiVersions": ["v1"], "operations": ["UPDATE"],
        "resources": ["pods", "nodes", "nodes/status"]}, {
        "apiGroups": ["coordination.k8s.io"], "apiVersions": ["v1"],
        "operations": ["CREATE", "UPDATE"], "resources": ["leases"]}]
    binding = one(docs, "ValidatingAdmissionPolicyBinding", f"{AGENT}-own-node")
    assert binding["spec"] == {"policyName": f"{AGENT}-own-node", "validationActions": ["Deny"]}


def test_without_the_policy_the_agent_gets_no_lease_and_beats_on_its_node():
    # The Role cannot name the Lease: without the policy an agent could write any Lease of the
    # release namespace (the mirror's election, another node's heartbeat).
    docs = render(None, ("nodeAgent.ownNodePolicy.enabled=false",))
    assert not find(docs, "ValidatingAdmissionPolicy", f"{AGENT}-own-node")
    assert not find(docs, "Role", f"{AGENT}-heartbeat")
    assert not find(docs, "RoleBinding", f"{AGENT}-heartbeat")
    args = one(docs, "DaemonSet", AGENT)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not any(a.startswith("--heartbeat-lease-namespace") for a in args)
    default = one(render(), "DaemonSet", AGENT)["spec"]["template"]["spec"]["containers"][0]
    assert f"--heartbeat-lease-namespace={NAMESPACE}" in default["args"]
