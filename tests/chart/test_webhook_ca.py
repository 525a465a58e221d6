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

from .live_cluster import holds, live_cluster
from .render import (
    NAMESPACE,
    RELEASE,
    chart_notes,
    install_in_cluster,
    one,
    render,
    template_error,
)
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


# -- switching to a provided Secret -----------------------------------------------------------

def _configs(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """The two webhook configurations of a render, as webhook.tls.simulatedLookup takes them."""
    return {"mutating": one(docs, KINDS[0], ADMISSION),
            "validating": one(docs, KINDS[1], ADMISSION)}


def _provided(tmp_path: Path, name: str) -> dict[str, str]:
    """A TLS Secret of the user's for the webhook's Service (tls.crt, tls.key, ca.crt: base64),
    signed by a CA of its own: the chart's generator, in a render of its own."""
    docs = render(_simulated(tmp_path, f"{name}-source", {"secret": {}}))
    return one(docs, "Secret", f"{ADMISSION}-tls")["data"]


def _provided_sets(secret: dict[str, str], name: str = "my-webhook-tls") -> tuple[str, ...]:
    return (f"webhook.tls.secretName={name}", f"webhook.tls.caBundle={secret['ca.crt']}")


def test_switching_to_a_provided_secret_trusts_both_cas_for_that_one_upgrade(tmp_path):
    """docs/chart.md tells Argo CD users to move the webhook from the generated certificate to a
    Secret of their own. Before, that upgrade made every webhook trust the new CA alone at once,
    while the admission pods of the old revision, until the rollout replaced them, still served
    the generated certificate: every review they answered failed (x509), fail closed. Now the
    upgrade that switches keeps the CA(s) the webhook configurations trust as they are (here
    the generated one) after the new CA, in every webhook's caBundle; the upgrade after it,
    whose configurations trust the new CA already, renders it alone, as a fresh install does."""
    before = render()
    generated = one(before, "Secret", f"{ADMISSION}-tls")["data"]
    provided = _provided(tmp_path, "mine")
    sets = _provided_sets(provided)

    switch = render(_simulated(tmp_path, "switch", {"secret": generated, **_configs(before)}),
                    sets)
    assert not [d for d in switch if d["kind"] == "Secret"
                and d["metadata"]["name"] == f"{ADMISSION}-tls"]  # no longer rendered
    [bundle] = _bundles(switch)  # every webhook, both configurations
    assert _certs(bundle) == [*_certs(provided["ca.crt"]), *_certs(generated["ca.crt"])]
    # the API server completes its handshake with the old pods and with the new ones
    assert handshake(generated, bundle, HOST) is None
    assert handshake(provided, bundle, HOST) is None
    assert handshake(generated, provided["ca.crt"], HOST) is not None  # the new CA alone

    later = render(_simulated(tmp_path, "later", {"secret": {}, **_configs(switch)}), sets)
    assert _bundles(later) == {provided["ca.crt"]}
    fresh = render(_simulated(tmp_path, "fresh", {"secret": {}, "mutating": {},
                                                  "validating": {}}), sets)
    assert _bundles(fresh) == {provided["ca.crt"]}
    assert _bundles(render(sets=sets)) == {provided["ca.crt"]}  # no cluster: helm template


def test_a_provided_secret_signed_by_another_ca_is_switched_to_the_same_way(tmp_path):
    """From one provided Secret to another whose CA differs: the same window, the same
    answer (the old CA trusted for the upgrade that switches, then the new one alone). A
    provided Secret renewed under the same CA changes nothing."""
    first, second = _provided(tmp_path, "first"), _provided(tmp_path, "second")
    installed = render(sets=_provided_sets(first, "first-tls"))
    sets = _provided_sets(second, "second-tls")
    switch = render(_simulated(tmp_path, "switch", {"secret": {}, **_configs(installed)}), sets)
    [bundle] = _bundles(switch)
    assert _certs(bundle) == [*_certs(second["ca.crt"]), *_certs(first["ca.crt"])]
    assert handshake(first, bundle, HOST) is None and handshake(second, bundle, HOST) is None
    later = render(_simulated(tmp_path, "later", {"secret": {}, **_configs(switch)}), sets)
    assert _bundles(later) == {second["ca.crt"]}
    same_ca = render(_simulated(tmp_path, "renewed", {"secret": {}, **_configs(installed)}),
                     _provided_sets(first, "renewed-tls"))
    assert _bundles(same_ca) == {first["ca.crt"]}


def test_a_secret_found_that_the_webhooks_do_not_trust_yet_is_trusted_beside_theirs(tmp_path):
    """Back to the generated certificate while its Secret is still there (it was never deleted):
    the chart reuses it, but the webhooks trust the provided CA the running pods serve. Both
    are trusted for that upgrade, as on any switch, then the generated CA alone."""
    provided = _provided(tmp_path, "mine")
    installed = render(sets=_provided_sets(provided))
    kept = _provided(tmp_path, "left-behind")  # the generated Secret an earlier release left
    back = render(_simulated(tmp_path, "back", {"secret": kept, **_configs(installed)}))
    assert one(back, "Secret", f"{ADMISSION}-tls")["data"] == kept  # reused
    [bundle] = _bundles(back)
    assert _certs(bundle) == [*_certs(kept["ca.crt"]), *_certs(provided["ca.crt"])]
    settled = render(_simulated(tmp_path, "settled", {"secret": kept, **_configs(back)}))
    assert _bundles(settled) == {kept["ca.crt"]}


@pytest.mark.parametrize("upgrade", ["switch", "later"])
def test_the_switch_reads_the_cluster_in_a_real_upgrade(kube: KubeServer, tmp_path: Path,
                                                       upgrade: str):
    """The same through `lookup`, as `helm upgrade` renders it: the webhook configurations in
    the cluster, and the provided Secret, whose ca.crt the chart reads when webhook.tls.caBundle
    is not set. On the switch (configurations of the generated certificate) both CAs are
    trusted; on the upgrade after it (configurations that trust both) the provided one alone."""
    before = render()
    generated = one(before, "Secret", f"{ADMISSION}-tls")["data"]
    provided = _provided(tmp_path, "mine")
    bundle = generated["ca.crt"]
    if upgrade == "later":
        both = [*_certs(provided["ca.crt"]), *_certs(generated["ca.crt"])]
        bundle = base64.b64encode(("\n".join(both) + "\n").encode()).decode()
    config = live_cluster(kube, tmp_path)
    holds(kube, f"/api/v1/namespaces/{NAMESPACE}/secrets/my-webhook-tls",
          {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
           "metadata": {"name": "my-webhook-tls", "namespace": NAMESPACE}, "data": provided})
    for kind in KINDS:
        obj = one(before, kind, ADMISSION)
        # the release's own (`helm install` may take them over), trusting `bundle`
        holds(kube, f"/apis/admissionregistration.k8s.io/v1/{kind.lower()}s/{ADMISSION}", {
            **obj, "metadata": {
                **obj["metadata"],
                "labels": {**obj["metadata"]["labels"], "app.kubernetes.io/managed-by": "Helm"},
                "annotations": {"meta.helm.sh/release-name": RELEASE,
                                "meta.helm.sh/release-namespace": NAMESPACE}},
            "webhooks": [{**h, "clientConfig": {**h["clientConfig"], "caBundle": bundle}}
                         for h in obj["webhooks"]]})
    proc = install_in_cluster(config, "webhook.tls.secretName=my-webhook-tls",
                              cache=tmp_path / "kube-cache")
    assert proc.returncode == 0, proc.stderr
    [rendered] = _bundles([d for d in yaml.safe_load_all(
        proc.stdout.split("MANIFEST:", 1)[1].split("NOTES:", 1)[0]) if d])
    if upgrade == "switch":
        assert _certs(rendered) == [*_certs(provided["ca.crt"]), *_certs(generated["ca.crt"])]
    else:
        assert rendered == provided["ca.crt"]
