"""webhook.failurePolicy sets the fractional pods' webhooks only: the host-path guard (no pod's
hostPath may reach the node agent's socket) and the gate-exec webhook are security checks, pinned
to webhook.guardFailurePolicy (Fail), so that `failurePolicy: Ignore` never makes them fail open.
When the two differ, the guard is a webhook of its own; the rendered matchConditions are
evaluated with a CEL interpreter, as in test_webhooks.py."""

from __future__ import annotations

import pytest

from kai_fractions.contract import keys as k

from .render import CHART, chart_notes, kube_validate, render
from .test_webhooks import hooks, matches, pod

MUTATE, VALIDATE = "pods.mutate.kai-fractions.io", "pods.validate.kai-fractions.io"
GUARD, EXEC = "hostpaths.validate.kai-fractions.io", "gate-exec.validate.kai-fractions.io"
WORKLOADS = "workloads.validate.kai-fractions.io"
FRACTIONAL = pod({k.DEFAULT_KEYS.container("main", k.MEMORY_REQUEST): "8Gi"})


def with_host_path(p: dict, path: str = "/run") -> dict:
    return {**p, "spec": {**p["spec"], "volumes": [{"name": "h", "hostPath": {"path": path}}]}}


def policies(*sets: str) -> dict[str, str]:
    docs = render(sets=sets)
    out = {}
    for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
        out.update({name: h["failurePolicy"] for name, h in hooks(docs, kind).items()})
    return out


def test_by_default_everything_fails_closed_in_four_webhooks():
    assert policies() == {MUTATE: "Fail", VALIDATE: "Fail", EXEC: "Fail", WORKLOADS: "Ignore"}


def test_ignore_for_fractional_pods_leaves_the_security_webhooks_failing_closed():
    assert policies("webhook.failurePolicy=Ignore") == {
        MUTATE: "Ignore", VALIDATE: "Ignore", GUARD: "Fail", EXEC: "Fail", WORKLOADS: "Ignore"}
    docs = render(sets=("webhook.failurePolicy=Ignore",))
    validating = hooks(docs, "ValidatingWebhookConfiguration")
    plain = with_host_path(pod())
    # a pod with a hostPath and no NvFractions keys: only the guard, which fails closed
    assert matches(validating[GUARD], plain)
    assert not matches(validating[VALIDATE], plain)
    # a fractional pod with a hostPath (the gate's): both, so its host paths are still
    # reviewed fail closed while its other checks fail open
    assert matches(validating[GUARD], with_host_path(FRACTIONAL))
    assert matches(validating[VALIDATE], with_host_path(FRACTIONAL))
    # a fractional pod without one, and the removal of NvFractions keys: the fractional webhook
    assert matches(validating[VALIDATE], FRACTIONAL)
    assert not matches(validating[GUARD], FRACTIONAL)
    assert matches(validating[VALIDATE], pod(), old=FRACTIONAL, operation="UPDATE")
    # as in the combined webhook: only where host paths come in or come into reach
    assert not matches(validating[GUARD], plain, old=plain, operation="UPDATE",
                       subresource="status")
    assert matches(validating[GUARD], plain, old=plain, operation="UPDATE",
                   subresource="ephemeralcontainers")
    assert validating[GUARD]["rules"] == [
        {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"],
         "resources": ["pods"], "scope": "Namespaced"},
        {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["UPDATE"],
         "resources": ["pods/ephemeralcontainers"], "scope": "Namespaced"}]
    assert validating[GUARD]["namespaceSelector"] == validating[VALIDATE]["namespaceSelector"]
    assert validating[GUARD]["clientConfig"] == validating[VALIDATE]["clientConfig"]
    assert "objectSelector" not in validating[GUARD]
    # hostPathExemptNamespaces lifts the guard there, as it lifts the combined clause
    exempt = hooks(render(sets=("webhook.failurePolicy=Ignore",
                                "webhook.hostPathExemptNamespaces={monitoring}")),
                   "ValidatingWebhookConfiguration")[GUARD]
    assert not matches(exempt, plain, namespace="monitoring")
    assert matches(exempt, plain, namespace="team-a")
    assert kube_validate(docs, "failurePolicy=Ignore") == []


def test_the_guard_fails_open_only_when_its_own_value_says_so():
    assert policies("webhook.guardFailurePolicy=Ignore") == {
        MUTATE: "Fail", VALIDATE: "Fail", GUARD: "Ignore", EXEC: "Ignore", WORKLOADS: "Ignore"}
    # the same policy everywhere: one validating pod webhook again, each pod reviewed once
    assert policies("webhook.failurePolicy=Ignore", "webhook.guardFailurePolicy=Ignore") == {
        MUTATE: "Ignore", VALIDATE: "Ignore", EXEC: "Ignore", WORKLOADS: "Ignore"}


@pytest.mark.parametrize("value", ["fail", "Open", ""])
def test_schema_refuses_other_guard_policies(value: str):
    from .render import template_error
    error = template_error(f"webhook.guardFailurePolicy={value}")
    assert "/webhook/guardFailurePolicy" in error


def test_notes_warn_when_a_webhook_fails_open():
    assert "WARNING: webhook." not in chart_notes()
    notes = chart_notes("webhook.failurePolicy=Ignore")
    assert "WARNING: webhook.failurePolicy=Ignore" in notes
    assert "admitted unchecked" in notes
    assert "guardFailurePolicy" not in notes
    notes = chart_notes("webhook.guardFailurePolicy=Ignore")
    assert "WARNING: webhook.guardFailurePolicy=Ignore" in notes
    assert "pods with hostPath volumes are created unreviewed" in notes


def test_docs_document_both_policies():
    doc = " ".join((CHART.parent.parent / "docs" / "chart.md").read_text().split())
    assert "| `webhook.guardFailurePolicy` | `Fail` |" in doc
    assert f"`{GUARD}`" in doc
