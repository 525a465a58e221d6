"""The admission webhooks fail closed, but only for pods with NvFractions keys: the rendered
matchConditions (CEL) are evaluated here on real objects with a CEL interpreter. The node agent's
own-node ValidatingAdmissionPolicy is evaluated the same way."""

from __future__ import annotations

import copy
from typing import Any

import celpy
import pytest
import yaml

from kai_fractions.admission.config import (
    DEFAULT_MARKER_HOST_DIR,
    MARKER_VOLUME,
    AdmissionConfig,
)
from kai_fractions.admission.validate import validate
from kai_fractions.contract import keys as k

from .render import CHART, EXAMPLES, NAMESPACE, one, render, template_error, yaml_files

ADMISSION = "kai-fractions-admission"
AGENT = "kai-fractions-node-agent"
AGENT_USER = f"system:serviceaccount:{NAMESPACE}:{AGENT}"
NODE_KEY = "authentication.kubernetes.io/node-name"
_ENV = celpy.Environment()


def cel(expression: str, **activation: Any) -> Any:
    program = _ENV.program(_ENV.compile(expression))
    return program.evaluate({name: celpy.json_to_cel(value) for name, value in
                             activation.items()})


def hooks(docs, kind: str) -> dict[str, dict]:
    return {h["name"]: h for h in one(docs, kind, ADMISSION)["webhooks"]}


def condition(hook: dict) -> str:
    [mc] = hook["matchConditions"]
    return mc["expression"]


def pod(annotations: dict[str, str] | None = None) -> dict:
    meta: dict[str, Any] = {"name": "p", "namespace": "team-a"}
    if annotations is not None:
        meta["annotations"] = annotations
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
            "spec": {"containers": [{"name": "main", "image": "busybox"}]}}


def matches(hook: dict, obj: dict, old: dict | None = None, operation: str = "CREATE",
            namespace: str = "team-a", subresource: str = "") -> bool:
    # As the API server hands `request` to CEL: an AdmissionRequest made unstructured, so an
    # empty subResource (omitempty) is absent rather than "".
    request = {"operation": operation, "namespace": namespace}
    if subresource:
        request["subResource"] = subresource
    return bool(cel(condition(hook), object=obj, oldObject=old, request=request))


def example_objects() -> list[dict]:
    docs = []
    for path in yaml_files(EXAMPLES):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


# keys that make a pod fractional, built from the contract package (never re-typed here)
FRACTION_KEYS = [
    k.DEFAULT_KEYS.container("main", k.MEMORY_REQUEST),
    k.DEFAULT_KEYS.container("main", k.MEMORY_LIMIT),
    k.DEFAULT_KEYS.container("main", k.COMPUTE_MODE),
    k.DEFAULT_KEYS.container("main", k.DEVICES),  # forged binder key: must be checked
    k.DEFAULT_KEYS.derived("main", k.DERIVED_PLAN_DIGEST),  # forged derived key too
    k.DEFAULT_KEYS.portion_limit("main"),
    *k.LEGACY_POD_KEYS,
]


@pytest.fixture(scope="module")
def docs():
    return render()


def test_pod_webhooks_fail_closed_and_are_safe_to_reinvoke(docs):
    mutating = hooks(docs, "MutatingWebhookConfiguration")["pods.mutate.kai-fractions.io"]
    validating = hooks(docs, "ValidatingWebhookConfiguration")["pods.validate.kai-fractions.io"]
    for hook in (mutating, validating):
        assert hook["failurePolicy"] == "Fail"
        assert hook["sideEffects"] == "None"
        assert hook["admissionReviewVersions"] == ["v1"]
        assert hook["clientConfig"]["service"]["name"] == ADMISSION
        assert hook["clientConfig"]["service"]["namespace"] == NAMESPACE
        assert hook["clientConfig"]["service"]["port"] == 443
        assert hook["timeoutSeconds"] == 10
        # opt-out by a namespace label; kube-system and our own namespace never wait on it, nor
        # do KAI's reservation pods (upstream KAI-Scheduler pkg/binder/binding/
        # resourcereservation/resource_reservation.go gives them a .gpu-compute.mode key)
        assert hook["namespaceSelector"] == {"matchExpressions": [
            {"key": "kai-fractions.io/webhook", "operator": "NotIn", "values": ["disabled"]},
            {"key": "kubernetes.io/metadata.name", "operator": "NotIn",
             "values": ["kube-system", NAMESPACE, "kai-resource-reservation"]}]}
    assert mutating["reinvocationPolicy"] == "IfNeeded"
    assert mutating["clientConfig"]["service"]["path"] == "/mutate"
    assert validating["clientConfig"]["service"]["path"] == "/validate"
    # pods are wired at creation; an ephemeral container added later gets NVIDIA_VISIBLE_DEVICES
    # =void like the pod's other containers without the fraction
    assert mutating["rules"] == [{"apiGroups": [""], "apiVersions": ["v1"],
                                  "operations": ["CREATE"], "resources": ["pods"],
                                  "scope": "Namespaced"},
                                 {"apiGroups": [""], "apiVersions": ["v1"],
                                  "operations": ["UPDATE"],
                                  "resources": ["pods/ephemeralcontainers"],
                                  "scope": "Namespaced"}]
    # status updates can change annotations, a Binding's annotations land on its pod (through
    # pods/binding or the legacy bindings resource, which a pods/binding rule does not match),
    # and an ephemeral container could mount the marker root: all reviewed, fail closed
    assert validating["rules"] == [{
        "apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE"],
        "resources": ["pods", "pods/status", "pods/ephemeralcontainers", "pods/binding"],
        "scope": "Namespaced"}, {
        "apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"],
        "resources": ["bindings"], "scope": "Namespaced"}]


def test_workload_webhook_gives_early_feedback_without_blocking(docs):
    hook = hooks(docs, "ValidatingWebhookConfiguration")["workloads.validate.kai-fractions.io"]
    assert hook["failurePolicy"] == "Ignore"  # the pods themselves are checked, fail closed
    assert {r["apiGroups"][0]: sorted(r["resources"]) for r in hook["rules"]} == {
        "apps": ["daemonsets", "deployments", "replicasets", "statefulsets"],
        "batch": ["cronjobs", "jobs"]}


@pytest.mark.parametrize("key", FRACTION_KEYS)
def test_pods_with_any_nvfractions_key_are_intercepted(docs, key):
    mutating = hooks(docs, "MutatingWebhookConfiguration")["pods.mutate.kai-fractions.io"]
    validating = hooks(docs, "ValidatingWebhookConfiguration")["pods.validate.kai-fractions.io"]
    assert matches(mutating, pod({key: "1"}))
    assert matches(validating, pod({key: "1"}))


def test_other_pods_are_not_intercepted(docs):
    mutating = hooks(docs, "MutatingWebhookConfiguration")["pods.mutate.kai-fractions.io"]
    validating = hooks(docs, "ValidatingWebhookConfiguration")["pods.validate.kai-fractions.io"]
    for other in (pod(), pod({}), pod({"prometheus.io/scrape": "true",
                                      "nvidia.com/gpu.memory": "81920",
                                      "kai.scheduler/queue": "team-a"})):
        assert not matches(mutating, other)
        assert not matches(validating, other)
        assert not matches(validating, other, other, "UPDATE")


def host_path_pod(path: str, annotations: dict[str, str] | None = None) -> dict:
    obj = pod(annotations)
    obj["spec"]["volumes"] = [{"name": "cache", "emptyDir": {}},
                              {"name": "host", "hostPath": {"path": path}}]
    return obj


@pytest.mark.parametrize("path", ["/var/lib/kai-fractions", "/run", "/var/log"])
def test_every_pod_with_a_host_path_is_validated(docs, path):
    """No hostPath may reach the agent's directories, so a pod without NvFractions keys but with
    a hostPath volume is reviewed too, when it is created and when an ephemeral container (which
    may mount one of its volumes) is added; the mutating webhook leaves it alone."""
    mutating = hooks(docs, "MutatingWebhookConfiguration")["pods.mutate.kai-fractions.io"]
    validating = hooks(docs, "ValidatingWebhookConfiguration")["pods.validate.kai-fractions.io"]
    obj = host_path_pod(path)
    assert matches(validating, obj)
    assert matches(validating, obj, obj, "UPDATE", subresource="ephemeralcontainers")
    assert not matches(mutating, obj)
    no_host = pod({"team": "a"})
    no_host["spec"]["volumes"] = [{"name": "cache", "emptyDir": {}}]
    assert not matches(validating, no_host)
    assert not matches(validating, no_host, no_host, "UPDATE",
                       subresource="ephemeralcontainers")


@pytest.mark.parametrize("subresource", ["", "status"])
def test_status_and_other_updates_of_a_host_path_pod_without_fraction_keys_are_not_sent(
        docs, subresource):
    """Every kubelet status write of every node-level pod (exporters, CNI/CSI plugins, GPU
    operator parts) would otherwise wait on the webhook, fail closed: refused while it is down or
    not yet ready. Nothing is lost: spec.volumes and the mounts never change after creation, and
    the validator refuses on UPDATE only what the change introduces (checked below on its own
    verdict). A pod with NvFractions keys (or one that had them) is still sent on every
    operation."""
    validating = hooks(docs, "ValidatingWebhookConfiguration")["pods.validate.kai-fractions.io"]
    exporter = host_path_pod("/")  # reaches every kai-fractions directory
    status = copy.deepcopy(exporter)
    status["status"] = {"phase": "Running"}
    assert not matches(validating, status, exporter, "UPDATE", subresource=subresource)
    # the validator itself lets such an update through: sending it would only risk a refusal
    config = AdmissionConfig(gate_image="registry.example.com/kai-fractions:test")
    review = {"uid": "1", "kind": {"group": "", "version": "v1", "kind": "Pod"},
              "resource": {"group": "", "version": "v1", "resource": "pods"},
              "operation": "UPDATE", "namespace": "team-a", "object": status,
              "oldObject": exporter, "userInfo": {"username": "system:node:gpu-node-1"}}
    if subresource:
        review["subResource"] = subresource
    assert validate(review, config).allowed
    assert not validate({**review, "operation": "CREATE", "oldObject": None}, config).allowed
    # fractional pods, and pods that had NvFractions keys, keep every operation but a status
    # write that changes nothing the validator judges (the next test)
    fractional = host_path_pod("/", {k.DEFAULT_KEYS.container("main", k.MEMORY_REQUEST): "8Gi"})
    assert matches(validating, fractional, fractional, "UPDATE",
                   subresource=subresource) is (subresource != "status")
    assert matches(validating, exporter, fractional, "UPDATE", subresource=subresource)


def _status_write(obj: dict, phase: str = "Running") -> dict:
    """`obj` as the kubelet's pods/status write leaves it: the API server keeps the old spec
    (the status strategy), the kubelet changes the status only."""
    new = copy.deepcopy(obj)
    new["status"] = {"phase": phase, "conditions": [
        {"type": "Ready", "status": "True" if phase == "Running" else "False"}]}
    return new


def _pod_review(new: dict, old: dict, subresource: str, user: str) -> dict:
    review = {"uid": "1", "kind": {"group": "", "version": "v1", "kind": "Pod"},
              "resource": {"group": "", "version": "v1", "resource": "pods"},
              "operation": "UPDATE", "namespace": "team-a", "object": new, "oldObject": old,
              "userInfo": {"username": user}}
    if subresource:
        review["subResource"] = subresource
    return review


@pytest.mark.parametrize("sets", [(), ("webhook.guardFailurePolicy=Ignore",)],
                         ids=["one webhook", "guard apart"])
def test_a_fractional_pods_status_writes_that_change_nothing_judged_are_not_sent(sets):
    """Before, every pods/status UPDATE of a pod with NvFractions keys was sent, fail closed:
    with no admission replica answering, the kubelet could write no status of any running
    fractional pod (readiness, restarts, a Job pod's Succeeded, the final status before it
    deletes a terminating pod, which then stays Terminating). On pods/status the validator
    judges only the annotations and the spec (the labels it never reads for a pod), and a
    status write cannot change the spec (the API server keeps the old one): a status write
    whose annotations equal oldObject's can change no verdict (the validator allows it, checked
    below), so it is not sent. A status write that adds, changes or removes an annotation is,
    and so is every other UPDATE of a fractional pod, the pod itself included."""
    validating = hooks(render(sets=sets), "ValidatingWebhookConfiguration")[
        "pods.validate.kai-fractions.io"]
    config = AdmissionConfig(gate_image="registry.example.com/kai-fractions:test")
    request = k.DEFAULT_KEYS.container("main", k.MEMORY_REQUEST)
    devices = k.DEFAULT_KEYS.container("main", k.DEVICES)
    running = host_path_pod("/var/lib/kai-fractions/markers",
                            {request: "8Gi", devices: "GPU-1", "team": "a"})
    running["spec"]["nodeName"] = "gpu-node-1"
    running["metadata"]["labels"] = {"app": "train"}
    kubelet = "system:node:gpu-node-1"
    for phase in ("Running", "Succeeded"):
        new = _status_write(running, phase)
        assert not matches(validating, new, running, "UPDATE", subresource="status"), phase
        assert validate(_pod_review(new, running, "status", kubelet), config).allowed
        # a label is never judged on a pod: a status write changing one is not sent either
        new["metadata"]["labels"] = {"app": "train", "restarted": "1"}
        assert not matches(validating, new, running, "UPDATE", subresource="status"), phase
        assert validate(_pod_review(new, running, "status", "alice"), config).allowed
    # the same write on the pod itself (not its status) is still sent
    assert matches(validating, _status_write(running), running, "UPDATE")
    # a status write that changes, adds or removes an annotation is sent, and judged
    changed = _status_write(running)
    changed["metadata"]["annotations"][request] = "16Gi"
    assert matches(validating, changed, running, "UPDATE", subresource="status")
    assert not validate(_pod_review(changed, running, "status", "alice"), config).allowed
    added = _status_write(running)
    added["metadata"]["annotations"]["team-b"] = "x"  # not a key: sent all the same
    assert matches(validating, added, running, "UPDATE", subresource="status")
    for gone in ({}, None):  # every annotation removed; `annotations` absent (has(): no error)
        removed = _status_write(running)
        if gone is None:
            del removed["metadata"]["annotations"]
        else:
            removed["metadata"]["annotations"] = gone
        assert matches(validating, removed, running, "UPDATE", subresource="status"), gone
        assert not validate(_pod_review(removed, running, "status", "alice"), config).allowed
    # keys brought by a status write onto a pod that had no annotations at all
    bare = host_path_pod("/var/lib/kai-fractions/markers")  # no `annotations` field
    assert matches(validating, _status_write(running), bare, "UPDATE", subresource="status")


def test_an_ephemeral_container_on_a_host_path_pod_is_still_validated(docs):
    """An ephemeral container cannot add a volume but can mount one the pod has: a pod without
    NvFractions keys that carries the marker volume (admitted: nothing mounted it) must not get
    one that mounts it, so that UPDATE is still sent, and refused."""
    validating = hooks(docs, "ValidatingWebhookConfiguration")["pods.validate.kai-fractions.io"]
    before = pod({"team": "a"})
    before["spec"]["volumes"] = [{"name": MARKER_VOLUME,
                                  "hostPath": {"path": DEFAULT_MARKER_HOST_DIR}}]
    after = copy.deepcopy(before)
    after["spec"]["ephemeralContainers"] = [{
        "name": "debug", "image": "busybox",
        "volumeMounts": [{"name": MARKER_VOLUME, "mountPath": "/markers"}]}]
    assert matches(validating, after, before, "UPDATE", subresource="ephemeralcontainers")
    config = AdmissionConfig(gate_image="registry.example.com/kai-fractions:test")
    review = {"uid": "1", "kind": {"group": "", "version": "v1", "kind": "Pod"},
              "resource": {"group": "", "version": "v1", "resource": "pods"},
              "subResource": "ephemeralcontainers", "operation": "UPDATE",
              "namespace": "team-a", "object": after, "oldObject": before,
              "userInfo": {"username": "alice"}}
    assert validate({**review, "operation": "CREATE", "object": before, "oldObject": None},
                    config).allowed
    decision = validate(review, config)
    assert not decision.allowed and "only the kai-fractions-gate init container" in \
        decision.message


def _agent_pod(docs: list[dict]) -> dict:
    """A pod of the chart's node agent DaemonSet, as its controller creates it."""
    template = one(docs, "DaemonSet", AGENT)["spec"]["template"]
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"{AGENT}-x1", "namespace": NAMESPACE,
                         **copy.deepcopy(template["metadata"])},
            "spec": copy.deepcopy(template["spec"])}


@pytest.mark.parametrize("exempt", [(), ("webhook.hostPathExemptNamespaces={monitoring}",)])
def test_the_node_agents_own_pods_are_never_reviewed_for_host_paths(exempt):
    """The agent's pods mount /proc, the marker root and the socket directory, which the
    validator refuses in any pod. The namespace selector leaves the release namespace out by
    default; with webhook.excludeSystemNamespaces=false the host-path clause still does, or no
    node agent could start. Other namespaces, and fractional pods there, are still matched."""
    docs = render(sets=("webhook.excludeSystemNamespaces=false", *exempt))
    validating = hooks(docs, "ValidatingWebhookConfiguration")["pods.validate.kai-fractions.io"]
    assert "namespaceSelector" not in validating or all(
        e["key"] != "kubernetes.io/metadata.name"
        for e in validating["namespaceSelector"].get("matchExpressions", []))
    agent = _agent_pod(docs)
    config = AdmissionConfig(gate_image="registry.example.com/kai-fractions:test")
    review = {"uid": "1", "kind": {"group": "", "version": "v1", "kind": "Pod"},
              "resource": {"group": "", "version": "v1", "resource": "pods"},
              "operation": "CREATE", "namespace": NAMESPACE, "object": agent,
              "userInfo": {"username": "system:serviceaccount:kube-system:daemon-set-controller"}}
    assert not validate(review, config).allowed  # so it must never be sent
    assert not matches(validating, agent, namespace=NAMESPACE)
    assert matches(validating, agent, namespace="team-a")
    if exempt:
        assert not matches(validating, agent, namespace="monitoring")
    fractional = host_path_pod("/", {k.DEFAULT_KEYS.container("main", k.MEMORY_REQUEST): "8Gi"})
    assert matches(validating, fractional, namespace=NAMESPACE)


def test_host_path_exempt_namespaces_lift_only_the_host_path_clause():
    """webhook.hostPathExemptNamespaces: trusted host agents (node exporters, GPU operator parts
    that mount `/` or `/run`) there are not reviewed for their hostPath volumes; the same pod
    anywhere else is, and a fractional pod in the exempt namespace still is."""
    docs = render(sets=("webhook.hostPathExemptNamespaces={monitoring,gpu-operator}",))
    validating = hooks(docs, "ValidatingWebhookConfiguration")["pods.validate.kai-fractions.io"]
    agent = host_path_pod("/")
    for namespace in ("monitoring", "gpu-operator"):
        assert not matches(validating, agent, namespace=namespace)
        assert not matches(validating, agent, agent, "UPDATE", namespace=namespace)
    assert matches(validating, agent, namespace="team-a")
    assert matches(validating, agent, namespace="monitoring-2")
    # a request without a namespace is never taken for an exempt one (fail closed)
    assert cel(condition(validating), object=agent, oldObject=None,
               request={"operation": "CREATE"})
    fractional = host_path_pod("/", {k.DEFAULT_KEYS.container("main", k.MEMORY_REQUEST): "8Gi"})
    assert matches(validating, fractional, namespace="monitoring")
    # removing NvFractions keys there is still checked too
    assert matches(validating, agent, fractional, "UPDATE", namespace="monitoring")
    # the mutating webhook and the rest of the validating one are as without the value (but
    # for the caBundle: every render generates a new CA)
    default = render()

    def others(rendered: list[dict], kind: str) -> list[dict]:
        out = []
        for hook in copy.deepcopy(one(rendered, kind, ADMISSION)["webhooks"]):
            hook["clientConfig"].pop("caBundle", None)
            if hook["name"] != "pods.validate.kai-fractions.io":
                out.append(hook)
        return out

    for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
        assert others(docs, kind) == others(default, kind)
    # empty (the default): no namespace is exempt, and the expression does not mention one
    default_hook = hooks(default, "ValidatingWebhookConfiguration")[
        "pods.validate.kai-fractions.io"]
    assert "request.namespace" not in condition(default_hook)
    assert matches(default_hook, agent, namespace="monitoring")


def test_host_path_exempt_namespaces_must_be_namespace_names():
    error = template_error("webhook.hostPathExemptNamespaces={Monitoring}")
    assert "hostPathExemptNamespaces" in error


def test_removing_protected_keys_is_still_validated(docs):
    validating = hooks(docs, "ValidatingWebhookConfiguration")["pods.validate.kai-fractions.io"]
    devices = k.DEFAULT_KEYS.container("main", k.DEVICES)
    before = pod({devices: "GPU-1"})
    after = pod({})
    assert matches(validating, after, before, "UPDATE")


@pytest.mark.parametrize("key", [*FRACTION_KEYS, k.MIRRORED_RECORD])
def test_a_binding_with_any_nvfractions_key_is_intercepted(docs, key):
    """A Binding's annotations are copied onto its pod without pod admission: one carrying any
    key the webhook guards (the mirror's protected record included) is reviewed."""
    validating = hooks(docs, "ValidatingWebhookConfiguration")["pods.validate.kai-fractions.io"]
    binding = {"apiVersion": "v1", "kind": "Binding",
               "metadata": {"name": "p", "annotations": {key: "1"}},
               "target": {"kind": "Node", "name": "gpu-node-1"}}
    assert matches(validating, binding)
    binding["metadata"] = {"name": "p", "annotations": {"team": "a"}}
    assert not matches(validating, binding)
    binding["metadata"] = {"name": "p"}
    assert not matches(validating, binding)


def test_the_webhook_port_is_open_to_the_api_server_and_can_be_narrowed():
    """The API server's address differs per cluster: by default every source may reach the
    webhook's HTTPS port; webhook.networkPolicy.from narrows it (and only it: the metrics port
    has webhook.networkPolicy.metricsFrom, tests/chart/test_metrics_scrape.py)."""
    default = one(render(), "NetworkPolicy", ADMISSION)
    deployment = one(render(), "Deployment", ADMISSION)
    assert default["spec"]["podSelector"]["matchLabels"] == \
        deployment["spec"]["selector"]["matchLabels"]
    assert [p["name"] for p in deployment["spec"]["template"]["spec"]["containers"][0][
        "ports"]] == ["https", "metrics"]
    assert default["spec"]["policyTypes"] == ["Ingress"]
    metrics = {"ports": [{"port": "metrics", "protocol": "TCP"}]}
    assert default["spec"]["ingress"] == [{"ports": [{"port": "https", "protocol": "TCP"}]},
                                          metrics]
    narrowed = one(render(sets=("webhook.networkPolicy.from[0].ipBlock.cidr=10.0.0.0/24",)),
                   "NetworkPolicy", ADMISSION)
    assert narrowed["spec"]["ingress"] == [{"ports": [{"port": "https", "protocol": "TCP"}],
                                            "from": [{"ipBlock": {"cidr": "10.0.0.0/24"}}]},
                                           metrics]
    off = render(sets=("webhook.networkPolicy.enabled=false",))
    assert not [d for d in off if d["kind"] == "NetworkPolicy"
                and d["metadata"]["name"] == ADMISSION]


def test_every_example_is_intercepted(docs):
    mutating = hooks(docs, "MutatingWebhookConfiguration")["pods.mutate.kai-fractions.io"]
    workloads = hooks(docs, "ValidatingWebhookConfiguration")[
        "workloads.validate.kai-fractions.io"]
    seen = 0
    for obj in example_objects():
        if obj["kind"] == "Pod":
            assert matches(mutating, obj), obj["metadata"]["name"]
            seen += 1
        elif obj["kind"] in ("Deployment", "Job"):
            assert matches(workloads, obj), obj["metadata"]["name"]
            assert matches(mutating, {"metadata": obj["spec"]["template"]["metadata"]})
            seen += 1
    assert seen == 7


def test_cronjob_templates_are_checked_and_plain_workloads_are_not(docs):
    workloads = hooks(docs, "ValidatingWebhookConfiguration")[
        "workloads.validate.kai-fractions.io"]
    template = {"metadata": {"annotations": {k.GPU_FRACTION: "0.5"}},
                "spec": {"containers": [{"name": "main", "image": "busybox"}]}}
    cronjob = {"kind": "CronJob", "metadata": {"name": "c"},
               "spec": {"schedule": "@daily", "jobTemplate": {"spec": {"template": template}}}}
    assert matches(workloads, cronjob)
    plain = copy.deepcopy(cronjob)
    plain["spec"]["jobTemplate"]["spec"]["template"]["metadata"] = {}
    assert not matches(workloads, plain)
    assert not matches(workloads, {"kind": "Deployment", "metadata": {"name": "d"},
                                   "spec": {"template": {"metadata": {"labels": {"a": "b"}}}}})


def test_match_conditions_follow_the_annotation_prefix():
    docs = render(CHART / "ci" / "time-slicing-only-values.yaml",
                  ("annotationPrefix=gpus.example.com/c.",))
    mutating = hooks(docs, "MutatingWebhookConfiguration")["pods.mutate.kai-fractions.io"]
    custom = k.Keys(prefix="gpus.example.com/c.")
    assert matches(mutating, pod({custom.container("main", k.MEMORY_REQUEST): "1Gi"}))
    assert not matches(mutating, pod({"gpus.example.com/other": "x"}))


def test_provided_secret_and_cert_manager():
    docs = render(CHART / "ci" / "provided-tls-values.yaml")
    ca = "LS0tLS1CRUdJTiBDRVJUSUZJQ0FURS0tLS0tCk1JSUJlekNDQVNDZ0F3SUJBZ0lVRXhhbXBsZQotLS0tLUVORCBDRVJUSUZJQ0FURS0tLS0tCg=="  # noqa: E501
    for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
        for hook in one(docs, kind, ADMISSION)["webhooks"]:
            assert hook["clientConfig"]["caBundle"] == ca
    docs = render(CHART / "ci" / "provided-tls-values.yaml",
                  ("webhook.tls.caBundle=", "webhook.tls.certManagerInjectFrom=kf/admission"))
    for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
        config = one(docs, kind, ADMISSION)
        assert config["metadata"]["annotations"] == {"cert-manager.io/inject-ca-from":
                                                     "kf/admission"}
        assert all("caBundle" not in h["clientConfig"] for h in config["webhooks"])


def test_cert_manager_injection_needs_the_secret_it_issues():
    """certManagerInjectFrom alone: the chart would generate and serve its own certificate while
    cert-manager overwrites the caBundle with another CA, so no handshake succeeds and every
    fractional pod is refused. The render fails, naming both values."""
    error = template_error("webhook.tls.certManagerInjectFrom=kai-fractions/admission")
    assert "webhook.tls.certManagerInjectFrom=kai-fractions/admission needs " \
        "webhook.tls.secretName" in error
    assert "kai-fractions-admission-tls" in error
    # with the Secret the Certificate writes, it renders (test_provided_secret_and_cert_manager)
    docs = render(sets=("webhook.tls.certManagerInjectFrom=kai-fractions/admission",
                        "webhook.tls.secretName=admission-cert"))
    assert not [d for d in docs if d["kind"] == "Secret"
                and d["metadata"]["name"] == f"{ADMISSION}-tls"]


# -- the node agent's own-node policy -------------------------------------------------------

def policy_allows(policy: dict, obj: dict, resource: str, user: str = AGENT_USER,
                  node: str | None = "gpu-node-1", old: dict | None = None
                  ) -> tuple[bool, list[str]]:
    """Evaluates the policy like the API server: matchConditions, variables, validations.
    `resource` may name a subresource (`nodes/status`); `old` defaults to `obj` (an update that
    changes nothing; test_node_agent_policy.py covers what may change)."""
    extra = {NODE_KEY: [node]} if node else {}
    resource, _, subresource = resource.partition("/")
    request = {"operation": "UPDATE", "resource": {"group": "", "version": "v1",
                                                   "resource": resource},
               "subResource": subresource,
               "userInfo": {"username": user, "extra": extra}}
    objects = {"object": obj, "oldObject": obj if old is None else old}
    spec = policy["spec"]
    if not all(cel(m["expression"], request=request) for m in spec["matchConditions"]):
        return True, []
    variables: dict[str, Any] = {}
    for v in spec["variables"]:
        variables[v["name"]] = cel(v["expression"], request=request, variables=variables,
                                   **objects)
    failed = [v.get("message") or str(cel(v["messageExpression"], variables=variables))
              for v in spec["validations"]
              if not cel(v["expression"], request=request, variables=variables, **objects)]
    return not failed, failed


def test_node_agent_may_update_only_its_own_node_and_its_pods(docs):
    policy = one(docs, "ValidatingAdmissionPolicy", f"{AGENT}-own-node")
    binding = one(docs, "ValidatingAdmissionPolicyBinding", f"{AGENT}-own-node")
    assert binding["spec"] == {"policyName": f"{AGENT}-own-node", "validationActions": ["Deny"]}
    assert policy["spec"]["failurePolicy"] == "Fail"
    own_pod = {"metadata": {"name": "p"}, "spec": {"nodeName": "gpu-node-1"}}
    other_pod = {"metadata": {"name": "p"}, "spec": {"nodeName": "gpu-node-2"}}
    assert policy_allows(policy, own_pod, "pods") == (True, [])
    assert policy_allows(policy, other_pod, "pods") == (
        False, ["the node agent on gpu-node-1 may update only pods bound to that node"])
    assert policy_allows(policy, {"metadata": {"name": "gpu-node-1"}}, "nodes/status") == (
        True, [])
    assert policy_allows(policy, {"metadata": {"name": "gpu-node-2"}}, "nodes/status") == (
        False, ["the node agent on gpu-node-1 may update only its own Node"])
    allowed, why = policy_allows(policy, own_pod, "pods", node=None)
    assert not allowed and "carries no node name" in why[0]
    # anyone else is not this policy's business
    assert policy_allows(policy, other_pod, "pods",
                         user=f"system:serviceaccount:{NAMESPACE}:kai-fractions-mirror") == (
        True, [])


def test_only_an_exec_or_attach_into_the_gate_is_sent(docs):
    """`kubectl exec -c kai-fractions-gate` would run a process in the gate's process namespace
    as its user (ptrace could make it exit 0 before the limits are in force): such CONNECTs
    are sent to the validating webhook, fail closed, and no other exec waits on it."""
    from kai_fractions.admission.config import GATE_CONTAINER

    hook = hooks(docs, "ValidatingWebhookConfiguration")["gate-exec.validate.kai-fractions.io"]
    assert hook["failurePolicy"] == "Fail"
    assert hook["rules"] == [{"apiGroups": [""], "apiVersions": ["v1"],
                              "operations": ["CONNECT"],
                              "resources": ["pods/exec", "pods/attach"],
                              "scope": "Namespaced"}]
    assert "objectSelector" not in hook  # a CONNECT's object (the options) has no labels
    pods_hook = hooks(docs, "ValidatingWebhookConfiguration")["pods.validate.kai-fractions.io"]
    assert hook["namespaceSelector"] == pods_hook["namespaceSelector"]
    assert hook["clientConfig"] == pods_hook["clientConfig"]
    for container, sent in ((GATE_CONTAINER, True), ("main", False), (None, False)):
        options = {"kind": "PodExecOptions", "apiVersion": "v1", "command": ["sh"]}
        if container is not None:
            options["container"] = container
        assert matches(hook, options, operation="CONNECT", subresource="exec") is sent
    # and what is sent is refused
    review = {"uid": "u", "kind": {"group": "", "version": "v1", "kind": "PodExecOptions"},
              "operation": "CONNECT", "subResource": "exec", "namespace": "team-a",
              "name": "p", "userInfo": {"username": "alice"},
              "object": {"kind": "PodExecOptions", "container": GATE_CONTAINER}}
    assert validate(review, AdmissionConfig(gate_image="img")).allowed is False


def section(path, start: str, end: str) -> str:
    text = path.read_text()
    text = text[text.index(start):]
    return text[:text.index(end)]


def test_the_docs_name_every_webhook_the_chart_registers(docs):
    """Whoever registers the webhooks by hand from docs/admission.md must not leave one out
    (without gate-exec, `kubectl exec` joins a waiting gate), and docs/chart.md counts them."""
    rendered = [h for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration")
                for h in one(docs, kind, ADMISSION)["webhooks"]]
    table = section(CHART.parent.parent / "docs" / "admission.md", "**What to register:**",
                    "Use `sideEffects")
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) - 1 == len(rendered)  # less the header
    for hook in rendered:
        for rule in hook["rules"]:
            for resource in rule["resources"]:
                assert f"`{resource}`" in table, (hook["name"], resource)
            for operation in rule["operations"]:
                assert operation in table, (hook["name"], operation)
    scoping = section(CHART.parent.parent / "docs" / "chart.md", "### Webhook scoping",
                      "\n### ")
    words = {3: "three", 4: "four", 5: "five"}
    assert f"registers {words[len(rendered)]} webhooks" in scoping
    for name in ("gate-exec.validate.kai-fractions.io", "workloads.validate.kai-fractions.io"):
        assert f"`{name}`" in scoping
    assert "`pods/exec`" in scoping and "`pods/attach`" in scoping


def test_an_object_selector_never_narrows_the_validating_pod_webhook(tmp_path):
    """webhook.objectSelector narrows the mutating and workloads webhooks only: the validating
    pod webhook must see every pod with a hostPath (none may reach the agent's socket) and every
    Binding (which carries no labels). A fractional pod the selector keeps from the mutating
    webhook is then refused for the gate it lacks (chart review, session 22)."""
    values = tmp_path / "values.yaml"
    selector = {"matchExpressions": [{"key": "kai.scheduler/queue", "operator": "Exists"}]}
    values.write_text(yaml.safe_dump({"webhook": {"objectSelector": selector}}))
    docs = render(values)
    mutating = hooks(docs, "MutatingWebhookConfiguration")["pods.mutate.kai-fractions.io"]
    validating = hooks(docs, "ValidatingWebhookConfiguration")
    assert mutating["objectSelector"] == selector
    assert validating["workloads.validate.kai-fractions.io"]["objectSelector"] == selector
    assert "objectSelector" not in validating["pods.validate.kai-fractions.io"]
    # a pod without the label, so never wired: refused, not run without its gate
    unlabelled = pod({k.DEFAULT_KEYS.container("main", k.MEMORY_REQUEST): "8Gi"})
    assert matches(validating["pods.validate.kai-fractions.io"], unlabelled)
    d = validate({"uid": "u", "kind": {"group": "", "version": "v1", "kind": "Pod"},
                  "operation": "CREATE", "namespace": "team-a",
                  "userInfo": {"username": "alice"}, "object": unlabelled},
                 AdmissionConfig(gate_image="img"))
    assert not d.allowed and "kai-fractions-gate" in d.message


def _selects(selector: dict, labels: dict[str, str]) -> bool:
    """A namespaceSelector, as the API server applies it to a namespace's labels."""
    if any(labels.get(key) != value for key, value in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        present, value = e["key"] in labels, labels.get(e["key"])
        if not {"In": present and value in e.get("values", []),
                "NotIn": not present or value not in e["values"],
                "Exists": present, "DoesNotExist": not present}[e["operator"]]:
            return False
    return True


def _sent_on_create(docs: list[dict], obj: dict, namespace: str,
                    labels: dict[str, str] | None = None) -> set[str]:
    """The validating webhooks a pod CREATE in `namespace` (with these labels) is sent to."""
    labels = {"kubernetes.io/metadata.name": namespace, **(labels or {})}
    sent = set()
    for name, hook in hooks(docs, "ValidatingWebhookConfiguration").items():
        creates_pods = any("pods" in r["resources"] and "CREATE" in r["operations"]
                           for r in hook["rules"])
        if (creates_pods and _selects(hook.get("namespaceSelector", {}), labels)
                and matches(hook, obj, namespace=namespace)):
            sent.add(name)
    return sent


@pytest.mark.parametrize("values", [
    # --set merges it with the default opt-out expression
    {"matchLabels": {"kai-fractions.io/enforce": "true"}},
    # a values file that replaces the selector outright
    {"matchExpressions": [{"key": "kai-fractions.io/enforce", "operator": "In",
                           "values": ["true"]}]},
], ids=["merged", "replaced"])
def test_an_opt_in_namespace_selector_never_narrows_the_host_path_guard(tmp_path, values):
    """webhook.namespaceSelector scopes the fractional pods' checks only: with an opt-in label,
    a pod with a hostPath volume in any other namespace must still be reviewed (it could mount
    the node agent's socket and release any pod's limits), by the guard on its own webhook.
    Only the opt-out label and the system namespaces lift the guard, as with the default."""
    file = tmp_path / "values.yaml"
    file.write_text(yaml.safe_dump({"webhook": {"namespaceSelector": values}}))
    docs = render(file)
    guard = "hostpaths.validate.kai-fractions.io"
    socket_pod = host_path_pod("/run/kai-fractions")
    assert _sent_on_create(docs, socket_pod, "team-b") == {guard}
    opted_in = {"kai-fractions.io/enforce": "true"}
    assert _sent_on_create(docs, socket_pod, "team-a", opted_in) == {guard}
    assert _sent_on_create(docs, socket_pod, "team-c", {"kai-fractions.io/webhook": "disabled"}) \
        == set()
    assert _sent_on_create(docs, _agent_pod(docs), NAMESPACE) == set()
    # the fractional pods' checks follow the selector: opted-in namespaces only
    fractional = pod({k.DEFAULT_KEYS.container("main", k.MEMORY_REQUEST): "8Gi"})
    assert _sent_on_create(docs, fractional, "team-a", opted_in) == {
        "pods.validate.kai-fractions.io"}
    assert _sent_on_create(docs, fractional, "team-b") == set()
    # the default selector keeps one webhook for both, as before
    assert guard not in hooks(render(), "ValidatingWebhookConfiguration")
