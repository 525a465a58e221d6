"""The release namespace must be one of its own: the webhooks leave it out (its pods serve them, and
the node agent's pods mount the host paths the guard refuses elsewhere), so nothing there is
reviewed. A release in `default`, `kube-system` or KAI's reservation namespace would silently
switch every webhook off for that namespace's pods: the render refuses it, unless
webhook.allowSharedReleaseNamespace says the risk is taken."""

from __future__ import annotations

import pytest

from .render import REPO, one, render, template_error
from .test_webhooks import ADMISSION, hooks, matches, pod

HOST_PATH_POD = {**pod(), "spec": {"containers": [{"name": "main", "image": "busybox"}],
                                   "volumes": [{"name": "h", "hostPath": {"path": "/run"}}]}}


@pytest.mark.parametrize(("namespace", "why"), [
    ("default", "is where pods land when their manifest names no namespace"),
    ("kube-system", "is the cluster's own system namespace"),
    ("kai-resource-reservation",
     "is KAI's reservation namespace (kaiScheduler.reservationNamespace)"),
])
def test_a_shared_release_namespace_is_refused_with_the_reason(namespace: str, why: str):
    error = template_error(namespace=namespace)
    assert f"release namespace {namespace} {why}" in error, error
    assert "a pod with a hostPath volume there is never reviewed" in error
    assert "a fractional pod there gets no gate and no checks" in error
    assert "--namespace kai-fractions --create-namespace" in error
    assert "webhook.allowSharedReleaseNamespace=true" in error
    # whatever excludeSystemNamespaces says: the release namespace is never host-path reviewed
    assert "release namespace" in template_error("webhook.excludeSystemNamespaces=false",
                                                 namespace=namespace)


def test_the_reservation_namespace_is_the_configured_one():
    error = template_error("kaiScheduler.reservationNamespace=gpu-reservations",
                           namespace="gpu-reservations")
    assert "release namespace gpu-reservations is KAI's reservation namespace" in error
    # KAI's default reservation namespace is an ordinary one once KAI uses another
    assert render(sets=("kaiScheduler.reservationNamespace=gpu-reservations",),
                  namespace="kai-resource-reservation")


def test_the_risk_can_be_taken_explicitly_and_then_is_what_it_says():
    docs = render(sets=("webhook.allowSharedReleaseNamespace=true",), namespace="default")
    validating = hooks(docs, "ValidatingWebhookConfiguration")["pods.validate.kai-fractions.io"]
    # default is left out by the namespace selector: nothing there is sent to the webhook
    [system] = [e for e in validating["namespaceSelector"]["matchExpressions"]
                if e["key"] == "kubernetes.io/metadata.name"]
    assert "default" in system["values"]
    # and with every namespace selected, a hostPath pod in the release namespace is still exempt
    docs = render(sets=("webhook.allowSharedReleaseNamespace=true",
                        "webhook.excludeSystemNamespaces=false"), namespace="default")
    validating = hooks(docs, "ValidatingWebhookConfiguration")["pods.validate.kai-fractions.io"]
    assert not matches(validating, HOST_PATH_POD, namespace="default")
    assert matches(validating, HOST_PATH_POD, namespace="team-a")


def test_a_dedicated_namespace_renders_and_nothing_renders_with_gpu_sharing_disabled():
    assert one(render(namespace="gpu-sharing"), "Deployment", ADMISSION)
    # Disabled registers no webhook at all: nothing to switch off, so nothing to refuse
    assert render(sets=("gpuSharing=Disabled",), namespace="default") == []


def test_docs_say_the_release_namespace_must_be_dedicated_and_admin_only():
    doc = " ".join((REPO / "docs" / "chart.md").read_text().split())
    assert ("**The release namespace must be dedicated to this chart, and only cluster admins "
            "may create pods in it.**") in doc
    assert "| `webhook.allowSharedReleaseNamespace` | `false` |" in doc
