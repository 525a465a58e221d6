"""KAI sees its NvFractions dependency met, read from the chart: the GpuFractioningConfig CRD
(crds/), the `default` object, the mirror's reporter wiring, and the refusal to install over the
upstream gpu-fractioning operator's CRD or object.

KAI's operator check is replayed as upstream KAI-Scheduler
`pkg/operator/operands/gpu_sharing/gpu_sharing.go` does it (messages as its
`gpu_sharing_test.go` pins them), against the rendered object with the status the reporter
(`kai_fractions.mirror.kai_dependency`) writes."""

from __future__ import annotations

import datetime
from typing import Any

import jsonschema
import pytest
import yaml

from kai_fractions.mirror.kai_dependency import Rollout, next_status, readiness

from .render import CHART, container, find, kube_validate, one, render, template_error

CRD_FILE = CHART / "crds" / "gpufractioningconfigs.yaml"
CRD_NAME = "gpufractioningconfigs.gpu-fractioning.kai.scheduler"
MIRROR = "kai-fractions-mirror"
DS = "kai-fractions/kai-fractions-node-agent"
NOW = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)
OURS = "gpuFractioningConfig.simulatedLookup.crd.metadata.labels.app\\.kubernetes\\.io/part-of"


def kai_missing_dependency(obj: dict[str, Any] | None) -> str:
    """KAI's operator, NvFractions mode: "" when GpuFractioningConfig `default` is Ready=True,
    else the message its Config's DependenciesFulfilled=False carries."""
    prefix = "Gpu Fractioning is not ready."
    if obj is None:
        return f"{prefix} GpuFractioningConfig not found"
    conditions = (obj.get("status") or {}).get("conditions")
    if not conditions:
        return f"{prefix} GpuFractioningConfig conditions not found" if conditions is None \
            else f"{prefix} Ready condition not found"
    ready = next((c for c in conditions if c["type"] == "Ready"), None)
    if ready is None:
        return f"{prefix} Ready condition not found"
    if ready["status"] == "True":
        return ""
    return (f"{prefix} Ready={ready['status']}, reason={ready['reason']}, "
            f"message={ready['message']}")


def _crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_FILE.read_text())


def _schema() -> dict[str, Any]:
    return _crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _object(docs: list[dict]) -> dict[str, Any]:
    return one(docs, "GpuFractioningConfig", "default")


def _with_status(obj: dict[str, Any], rollout: Rollout | None) -> dict[str, Any]:
    status = next_status(obj.get("status"), readiness(rollout, DS), 1, NOW)
    return {**obj, "status": status}


# -- the CRD -------------------------------------------------------------------------------------

def test_crd_is_what_kais_operator_reads():
    crd = _crd()
    assert kube_validate([crd], CRD_FILE.name) == []
    assert crd["metadata"]["name"] == CRD_NAME
    assert crd["metadata"]["labels"] == {"app.kubernetes.io/part-of": "kai-fractions"}
    spec = crd["spec"]
    assert (spec["group"], spec["scope"], spec["names"]["kind"], spec["names"]["plural"]) == (
        "gpu-fractioning.kai.scheduler", "Cluster", "GpuFractioningConfig",
        "gpufractioningconfigs")
    [version] = spec["versions"]
    assert (version["name"], version["served"], version["storage"]) == ("v1alpha1", True, True)
    assert version["subresources"] == {"status": {}}  # the reporter writes status only
    assert _schema()["x-kubernetes-validations"] == [{
        "rule": "self.metadata.name == 'default'",
        "message": "GpuFractioningConfig must be named 'default'"}]


def test_rendered_object_and_reported_status_fit_the_crd_schema():
    obj = _object(render())
    assert obj["spec"] == {"nodeSelector": {"nvidia.com/gpu.present": "true"}}
    jsonschema.validate(obj, _schema())
    for rollout in (Rollout(3, 3, 3), Rollout(3, 2, 3), Rollout(0, 0, 0), None):
        jsonschema.validate(_with_status(obj, rollout), _schema())
    # the status the upstream operator writes fits as well (KAI's gpu_sharing_test.go object)
    jsonschema.validate({**obj, "status": {"observedGeneration": 1, "conditions": [{
        "type": "Ready", "status": "True", "reason": "AllComponentsReady",
        "message": "all components are healthy",
        "lastTransitionTime": "2026-01-02T03:04:05Z"}]}}, _schema())
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**obj, "status": {"conditions": [{
            "type": "Ready", "status": "Yes", "reason": "R", "message": "",
            "lastTransitionTime": "2026-01-02T03:04:05Z"}]}}, _schema())


def test_node_selector_follows_the_node_agents():
    obj = _object(render(CHART / "ci" / "watchdog-kill-values.yaml"))
    assert obj["spec"]["nodeSelector"] == {"nvidia.com/gpu.present": "true",
                                           "nvidia.com/gpu.family": "volta"}


# -- KAI's operator check, replayed ------------------------------------------------------------

def test_kais_check_is_met_only_when_the_agents_are_ready():
    obj = _object(render())
    # just installed, before the mirror's first round: not ready, honestly
    assert kai_missing_dependency(obj) == \
        "Gpu Fractioning is not ready. GpuFractioningConfig conditions not found"
    assert kai_missing_dependency(None) == \
        "Gpu Fractioning is not ready. GpuFractioningConfig not found"
    assert kai_missing_dependency(_with_status(obj, Rollout(3, 2, 3))) == (
        "Gpu Fractioning is not ready. Ready=False, reason=NodeAgentsNotReady, "
        "message=2/3 node agents ready")
    assert kai_missing_dependency(_with_status(obj, Rollout(3, 3, 2))) == (
        "Gpu Fractioning is not ready. Ready=False, reason=RolloutInProgress, "
        "message=3/3 node agents ready, 2/3 updated")
    assert kai_missing_dependency(_with_status(obj, None)).startswith(
        "Gpu Fractioning is not ready. Ready=False, reason=NodeAgentDaemonSetMissing")
    assert kai_missing_dependency(_with_status(obj, Rollout(3, 3, 3))) == ""


def test_the_mirror_reports_the_node_agent_daemonset_it_renders():
    docs = render()
    args = container(one(docs, "Deployment", MIRROR), "mirror")["args"]
    assert "--report-gpu-fractioning-config" in args
    ds = one(docs, "DaemonSet", "kai-fractions-node-agent")
    assert f"--node-agent-daemonset={ds['metadata']['namespace']}/{ds['metadata']['name']}" \
        in args
    assert "--report-interval=10" in args


def test_disabled_means_no_object_no_reporter():
    docs = render(sets=("gpuFractioningConfig.enabled=false",))
    assert not find(docs, "GpuFractioningConfig")
    args = container(one(docs, "Deployment", MIRROR), "mirror")["args"]
    assert not [a for a in args if "report" in a or "node-agent-daemonset" in a]
    assert not find(docs, "Role", f"{MIRROR}-node-agent-status")
    rules = one(docs, "ClusterRole", MIRROR)["rules"]
    assert not [r for r in rules if "gpu-fractioning.kai.scheduler" in r["apiGroups"]]


def test_the_reporter_needs_the_mirror():
    err = template_error("mirror.enabled=false", "signing.enabled=false")
    assert "gpuFractioningConfig.enabled needs mirror.enabled" in err
    docs = render(sets=("mirror.enabled=false", "gpuFractioningConfig.enabled=false",
                        "signing.enabled=false"))
    assert not find(docs, "Deployment", MIRROR) and not find(docs, "GpuFractioningConfig")


def test_disabled_chart_renders_no_object():
    assert render(CHART / "ci" / "disabled-values.yaml") == []


# -- owning nothing the upstream operator owns ------------------------------------------------

def test_refuses_a_crd_it_did_not_install():
    upstream = ("gpuFractioningConfig.simulatedLookup.crd.metadata.name=" + CRD_NAME,
                "gpuFractioningConfig.simulatedLookup.crd.metadata.labels.app\\.kubernetes"
                "\\.io/name=gpu-fractioning")
    for extra in ((), ("gpuFractioningConfig.enabled=false",)):
        err = template_error(*upstream, *extra)
        assert (f"the CustomResourceDefinition {CRD_NAME} already exists and was not "
                "installed by kai-fractions") in err
        assert "global.nvFractions.set=true" in err and f"kubectl delete crd {CRD_NAME}" in err


@pytest.mark.parametrize("annotations", [
    {},  # the upstream chart's post-install hook object, or someone's own
    {"meta.helm.sh/release-name": "kai-scheduler",
     "meta.helm.sh/release-namespace": "kai-scheduler"},
    {"meta.helm.sh/release-name": "kf", "meta.helm.sh/release-namespace": "elsewhere"},
], ids=["unmanaged", "kai-release", "other-namespace"])
def test_refuses_a_default_object_another_owner_has(annotations: dict[str, str]):
    sets = [f"{OURS}=kai-fractions",
            "gpuFractioningConfig.simulatedLookup.object.metadata.name=default"]
    sets += [f"gpuFractioningConfig.simulatedLookup.object.metadata.annotations."
             f"{k.replace('.', chr(92) + '.')}={v}" for k, v in annotations.items()]
    err = template_error(*sets)
    assert "GpuFractioningConfig default already exists and is not managed by this release " \
        "(kai-fractions/kf)" in err
    assert "will not take it over" in err


def test_upgrades_its_own_crd_and_object():
    docs = render(sets=(
        f"{OURS}=kai-fractions",
        "gpuFractioningConfig.simulatedLookup.object.metadata.name=default",
        "gpuFractioningConfig.simulatedLookup.object.metadata.annotations."
        "meta\\.helm\\.sh/release-name=kf",
        "gpuFractioningConfig.simulatedLookup.object.metadata.annotations."
        "meta\\.helm\\.sh/release-namespace=kai-fractions"))
    assert _object(docs)["metadata"]["name"] == "default"


def test_simulated_lookup_is_checked_by_the_schema():
    err = template_error("gpuFractioningConfig.simulatedLookup.deployment.name=x")
    assert "additional properties 'deployment' not allowed" in err
