"""The webhooks' caBundle is never silently missing (unless webhook.tls.useSystemTrustRoots says
the API server's system trust roots verify a provided certificate), and a rotation of the chart's
generated CA does not make every review fail while the admission pods still serve the old
certificate.

`helm template` has no cluster, so `lookup` finds nothing here; webhook.tls.simulatedLookup (tests
and dry runs only, like signing.simulatedLookup) stands in for what it would find: the generated
TLS Secret's data and the two webhook configurations. The real `lookup` calls are the same
template's other branch (kf.tls.generate, kf.admission.rotationCaBundle); only one test installs
into a cluster (kmock, tests.chart.live_cluster)."""

from __future__ import annotations

import base64
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.kube import KubeServer

from .live_cluster import live_cluster
from .render import NAMESPACE, chart_notes, install_in_cluster, one, render, template_error
from .tls_memory import handshake

ADMISSION = "kai-fractions-admission"
KINDS = ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration")
HOST = f"{ADMISSION}.{NAMESPACE}.svc"
PEM = re.compile(r"-----BEGIN CERTIFICATE-----.*?-----END CERTIFICATE-----", re.S)


def _bundles(docs: list[dict[str, Any]]) -> set[str]:
    return {h["clientConfig"].get("caBundle", "") for kind in KINDS
            for h in one(docs, kind, ADMISSION)["webhooks"]}


def _certs(b64: str) -> list[str]:
    return PEM.findall(base64.b64decode(b64).decode())


def _simulated(tmp_path: Path, name: str, lookup: dict[str, Any]) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"webhook": {"tls": {"simulatedLookup": lookup}}}))
    return path


# -- a provided Secret without a CA the chart can trust -------------------------------------

def test_a_provided_secret_without_a_ca_bundle_is_refused_naming_the_values():
    """Under `helm template` (or before the Secret exists) the chart cannot read its ca.crt:
    webhooks without a caBundle would refuse every fractional pod, every hostPath pod reviewed
    and every exec into a gate. The render fails, naming the values that fix it."""
    error = template_error("webhook.tls.secretName=my-admission-certs")
    assert "webhook.tls.secretName=my-admission-certs without webhook.tls.caBundle" in error
    assert "webhook.tls.caBundle" in error
    assert "webhook.tls.certManagerInjectFrom=<namespace>/<certificate>" in error
    assert "helm template" in error
    # what an empty caBundle would mean, and the way out for a publicly signed certificate
    assert ("the API server would verify the certificate with its system trust roots alone: "
            "unless a CA there (a public CA) signed it, every review would fail") in error
    assert ("when a CA the API server's system trust roots hold signed it, "
            "webhook.tls.useSystemTrustRoots=true (no caBundle)") in error
    # either value renders
    ca = base64.b64encode(b"-----BEGIN CERTIFICATE-----\nx\n-----END CERTIFICATE-----\n")
    docs = render(sets=("webhook.tls.secretName=my-admission-certs",
                        f"webhook.tls.caBundle={ca.decode()}"))
    assert _bundles(docs) == {ca.decode()}
    docs = render(sets=("webhook.tls.secretName=my-admission-certs",
                        "webhook.tls.certManagerInjectFrom=kai-fractions/admission"))
    assert _bundles(docs) == {""}  # cert-manager's injector fills it


def test_a_provided_secret_signed_by_a_ca_the_api_server_trusts_renders_without_a_ca_bundle():
    """`kubectl create secret tls` from a public CA: no ca.crt, and none needed, since a
    webhook without a caBundle is verified with the API server's system trust roots. It
    rendered before the refusal; webhook.tls.useSystemTrustRoots says so explicitly."""
    docs = render(sets=("webhook.tls.secretName=public-certs",
                        "webhook.tls.useSystemTrustRoots=true"))
    assert _bundles(docs) == {""}  # every webhook, both configurations
    admission = one(docs, "Deployment", ADMISSION)
    [volume] = [v for v in admission["spec"]["template"]["spec"]["volumes"]
                if v["name"] == "tls"]
    assert volume["secret"]["secretName"] == "public-certs"
    notes = chart_notes("webhook.tls.secretName=public-certs",
                        "webhook.tls.useSystemTrustRoots=true")
    assert ("NOTE: webhook.tls.useSystemTrustRoots=true: the webhooks have no caBundle, so the "
            "API server\nverifies the certificate in Secret public-certs with its system trust "
            "roots.") in notes
    assert "without webhook.tls.caBundle" not in notes


@pytest.mark.parametrize(("sets", "expected"), [
    ((), "webhook.tls.useSystemTrustRoots=true needs webhook.tls.secretName: the chart's own "
         "generated certificate (kai-fractions-admission-tls) is signed by a CA of its own, "
         "which no system trust root holds"),
    (("webhook.tls.secretName=public-certs", "webhook.tls.caBundle=QUJD"),
     "webhook.tls.useSystemTrustRoots=true with webhook.tls.caBundle: the webhooks would trust "
     "that CA bundle, not the API server's system trust roots"),
    (("webhook.tls.secretName=public-certs", "webhook.tls.certManagerInjectFrom=cm/admission"),
     "webhook.tls.useSystemTrustRoots=true with webhook.tls.certManagerInjectFrom: the webhooks "
     "would trust the CA cert-manager injects"),
], ids=["generated certificate", "with caBundle", "with cert-manager"])
def test_system_trust_roots_contradicted_by_another_trust_are_refused(sets, expected):
    assert expected in template_error("webhook.tls.useSystemTrustRoots=true", *sets)


def test_system_trust_roots_need_no_lookup_of_the_secret(kube: KubeServer, tmp_path: Path):
    """Installed into a cluster, the choice is the value's, not what the Secret holds: the
    Secret is not read, and the webhooks have no caBundle whatever it holds."""
    config = live_cluster(kube, tmp_path)
    proc = install_in_cluster(config, "webhook.tls.secretName=public-certs",
                              "webhook.tls.useSystemTrustRoots=true",
                              cache=tmp_path / "kube-cache")
    assert proc.returncode == 0, proc.stderr
    assert kube.count("GET", f"/api/v1/namespaces/{NAMESPACE}/secrets/public-certs") == 0
    manifest = [d for d in yaml.safe_load_all(
        proc.stdout.split("MANIFEST:", 1)[1].split("NOTES:", 1)[0]) if d]
    assert _bundles(manifest) == {""}


# -- CA rotation ------------------------------------------------------------------------------

def test_a_new_ca_is_trusted_beside_the_one_the_webhooks_trust_until_the_next_upgrade(tmp_path):
    """"Delete the Secret, helm upgrade": the render makes a new CA, while the admission pods
    serve the old certificate until the kubelet syncs their Secret volume. The webhooks trust
    both meanwhile (new first), and the upgrade after it (the Secret found) only the new one."""
    before = render()
    old = one(before, "Secret", f"{ADMISSION}-tls")["data"]
    assert _bundles(before) == {old["ca.crt"]}  # a first install: its one CA
    configs = {"mutating": one(before, KINDS[0], ADMISSION),
               "validating": one(before, KINDS[1], ADMISSION)}

    rotated = render(_simulated(tmp_path, "rotate", {"secret": {}, **configs}))
    new = one(rotated, "Secret", f"{ADMISSION}-tls")["data"]
    assert new["ca.crt"] != old["ca.crt"]
    [bundle] = _bundles(rotated)  # every webhook, both configurations
    assert _certs(bundle) == [*_certs(new["ca.crt"]), *_certs(old["ca.crt"])]
    # the API server completes its handshake with either certificate the pods may serve
    assert handshake(old, bundle, HOST) is None
    assert handshake(new, bundle, HOST) is None
    assert handshake(old, new["ca.crt"], HOST) is not None  # what the bundle alone would do

    settled = render(_simulated(tmp_path, "settled", {
        "secret": new, "mutating": one(rotated, KINDS[0], ADMISSION),
        "validating": one(rotated, KINDS[1], ADMISSION)}))
    assert one(settled, "Secret", f"{ADMISSION}-tls")["data"] == new  # kept, not regenerated
    assert _bundles(settled) == {new["ca.crt"]}


def test_a_rotation_keeps_each_old_ca_once_and_never_the_new_one_twice(tmp_path):
    first = render()
    a = one(first, "Secret", f"{ADMISSION}-tls")["data"]["ca.crt"]
    second = render(_simulated(tmp_path, "b", {"secret": {}, "mutating": one(
        first, KINDS[0], ADMISSION), "validating": one(first, KINDS[1], ADMISSION)}))
    b = one(second, "Secret", f"{ADMISSION}-tls")["data"]["ca.crt"]
    # a second rotation before the settling upgrade: the mutating configuration still holds
    # B+A, the validating one A; each old certificate once, after the newest
    third = render(_simulated(tmp_path, "c", {"secret": {}, "mutating": one(
        second, KINDS[0], ADMISSION), "validating": one(first, KINDS[1], ADMISSION)}))
    c = one(third, "Secret", f"{ADMISSION}-tls")["data"]["ca.crt"]
    [bundle] = _bundles(third)
    assert _certs(bundle) == [*_certs(c), *_certs(b), *_certs(a)]


def test_nothing_to_keep_renders_the_new_ca_alone(tmp_path):
    """A first install (no webhook configuration yet), or configurations that trust no other CA
    (or none at all, as with a caBundle cert-manager never filled)."""
    docs = render(_simulated(tmp_path, "empty", {"secret": {}, "mutating": {},
                                                 "validating": {"webhooks": [
                                                     {"name": "x", "clientConfig": {}}]}}))
    ca = one(docs, "Secret", f"{ADMISSION}-tls")["data"]["ca.crt"]
    assert _bundles(docs) == {ca}


def test_the_schema_keeps_the_simulated_lookup_to_its_shape():
    error = template_error("webhook.tls.simulatedLookup.secret.tls\\.crt=not base64!")
    assert "/webhook/tls/simulatedLookup/secret" in error
    error = template_error("webhook.tls.simulatedLookup.cluster=x")
    assert "additional properties 'cluster' not allowed" in error
