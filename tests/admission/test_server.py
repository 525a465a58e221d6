"""AdmissionReview fixtures through the real HTTPS server on 127.0.0.1.

Patches are judged by their effect: the JSONPatch is applied to the pod (the `jsonpatch`
package, an independent RFC 6902 implementation) and the PATCHED POD is compared with the
expected pod in tests/admission/data/, never the patch text.
"""

from __future__ import annotations

import base64
import copy
import json
import os
import re
import ssl
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonpatch
import kubernetes_validate
import pytest

from .certs import der_of, install, make_cert
from .conftest import GATE_IMAGE, Webhook, load

BINDER = "system:serviceaccount:kai-scheduler:binder"
MIRROR = "system:serviceaccount:kai-fractions:kai-fractions-mirror"
K8S_VERSION = "1.33"


FIXED_NAMESPACE = "kf_00000000000000000000"
"""What the expected pods say for the random MPS namespace name the webhook gives a pod."""


def patched(review: dict[str, Any], answer: dict[str, Any]) -> dict[str, Any]:
    response = answer["response"]
    assert response["allowed"] is True
    pod = copy.deepcopy(review["request"]["object"])
    if "patch" not in response:
        return pod
    assert response["patchType"] == "JSONPatch"
    ops = json.loads(base64.b64decode(response["patch"]))
    return jsonpatch.apply_patch(pod, ops)


def with_fixed_namespace(pod: dict[str, Any]) -> dict[str, Any]:
    """The pod with its MPS namespace name (checked for shape) spelled as the expected pods
    spell it."""
    name = pod["metadata"]["annotations"].get("kai-fractions.io/container.main.mps-namespace")
    if name is None:
        return pod
    assert re.fullmatch("kf_[0-9a-f]{20}", name)
    return json.loads(json.dumps(pod).replace(name, FIXED_NAMESPACE))


def assert_valid_pod(pod: dict[str, Any]) -> None:
    """kubernetes-validate --strict (its Python API raises; nothing is skipped)."""
    pod = copy.deepcopy(pod)
    pod["metadata"].setdefault("name", "generated-name")  # generateName is filled in later
    kubernetes_validate.validate(pod, K8S_VERSION, strict=True)


@pytest.mark.parametrize("name", ["pod-sm-sharing", "pod-time-slicing"])
def test_fractional_pod_is_allowed_with_a_patch_that_yields_the_expected_pod(
        webhook: Webhook, name: str) -> None:
    review = load(f"{name}.review.json")
    status, answer = webhook.post("/mutate", review)
    assert status == 200
    assert answer["apiVersion"] == "admission.k8s.io/v1"
    assert answer["kind"] == "AdmissionReview"
    assert answer["response"]["uid"] == review["request"]["uid"]
    assert with_fixed_namespace(patched(review, answer)) == load(f"{name}.patched.json")


@pytest.mark.parametrize("name", ["pod-sm-sharing", "pod-time-slicing"])
def test_patched_pods_pass_kubernetes_validate_strict(webhook: Webhook, name: str) -> None:
    review = load(f"{name}.review.json")
    _, answer = webhook.post("/mutate", review)
    pod = patched(review, answer)
    assert_valid_pod(pod)
    assert with_fixed_namespace(pod) == load(f"{name}.patched.json")


def test_strict_validation_really_checks(webhook: Webhook) -> None:
    """Guard against a validator that passes everything: a misspelt field must fail."""
    pod = load("pod-sm-sharing.patched.json")
    pod["spec"]["initContainers"][0]["securityContext"]["runAsNonroot"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        assert_valid_pod(pod)


@pytest.mark.parametrize("name", ["pod-sm-sharing", "pod-time-slicing"])
def test_mutating_the_patched_pod_changes_nothing(webhook: Webhook, name: str) -> None:
    review = load(f"{name}.review.json")
    _, answer = webhook.post("/mutate", review)
    again = copy.deepcopy(review)
    again["request"]["object"] = patched(review, answer)
    status, answer = webhook.post("/mutate", again)
    assert status == 200
    assert answer["response"] == {"uid": review["request"]["uid"], "allowed": True}


def test_preset_pinned_limit_is_replaced_in_every_container(webhook: Webhook) -> None:
    review = load("pod-sm-sharing.review.json")
    containers = review["request"]["object"]["spec"]["containers"]
    assert {"name": "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "value": "0=80G"} in containers[0]["env"]
    _, answer = webhook.post("/mutate", review)
    pod = patched(review, answer)
    main, metrics = pod["spec"]["containers"]
    pinned = [e for e in main["env"] if e["name"] == "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"]
    assert pinned == [{"name": "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "valueFrom": {"fieldRef": {
        "apiVersion": "v1",
        "fieldPath": "metadata.annotations['kai-fractions.io/container.main."
                     "mps-pinned-mem-limit']"}}}]
    # the sidecar's NVIDIA_VISIBLE_DEVICES=all and limit are gone; it sees no GPU (not even
    # through its image's own env)
    assert metrics["env"] == [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]


def test_the_patched_pod_passes_validation(webhook: Webhook) -> None:
    review = load("pod-sm-sharing.review.json")
    _, answer = webhook.post("/mutate", review)
    review["request"]["object"] = patched(review, answer)
    status, answer = webhook.post("/validate", review)
    assert status == 200
    assert answer["response"] == {"uid": review["request"]["uid"], "allowed": True}


@pytest.mark.parametrize("path", ["/validate", "/mutate"])
def test_non_fractional_pod_passes_untouched(webhook: Webhook, path: str) -> None:
    review = load("pod-plain.review.json")
    status, answer = webhook.post(path, review)
    assert status == 200
    assert answer["response"] == {"uid": review["request"]["uid"], "allowed": True}


@pytest.mark.parametrize("path", ["/validate", "/mutate"])
def test_invalid_pod_is_denied_with_the_contract_message(webhook: Webhook, path: str) -> None:
    review = load("pod-invalid.review.json")
    status, answer = webhook.post(path, review)
    assert status == 200
    assert answer["response"] == {
        "uid": review["request"]["uid"],
        "allowed": False,
        "status": {
            "code": 422,
            "reason": "Invalid",
            "message": "nvidia.com/container.main.gpu-memory.limit: must be greater than or "
                       "equal to the request '8Gi' (got '4Gi'); "
                       "nvidia.com/container.main.gpu-compute.mode: must be one of: "
                       "time-slicing, sm-sharing (got 'mps')",
        },
    }


def test_user_adding_devices_is_denied_naming_the_key_and_the_identities(
        webhook: Webhook) -> None:
    review = load("pod-update-add-devices.review.json")
    status, answer = webhook.post("/validate", review)
    assert status == 200
    assert answer["response"] == {
        "uid": review["request"]["uid"],
        "allowed": False,
        "status": {
            "code": 403,
            "reason": "Forbidden",
            "message": "nvidia.com/container.main.gpus.devices: is a protected key: only "
                       f"{BINDER}, {MIRROR} may create it, not alice",
        },
    }


@pytest.mark.parametrize("user", [BINDER, MIRROR])
def test_binder_and_mirror_may_add_devices(webhook: Webhook, user: str) -> None:
    review = load("pod-update-add-devices.review.json")
    review["request"]["userInfo"]["username"] = user
    status, answer = webhook.post("/validate", review)
    assert status == 200
    assert answer["response"] == {"uid": review["request"]["uid"], "allowed": True}


def test_workload_template_with_protected_keys_is_denied_even_for_the_binder(
        webhook: Webhook) -> None:
    review = load("deployment-protected.review.json")
    _, answer = webhook.post("/validate", review)
    assert answer["response"]["allowed"] is False
    assert answer["response"]["status"]["message"] == (
        "kai-fractions.io/container.main.memory-limit-mib: a pod template may not carry a "
        "protected key; the binder writes it on each pod after scheduling; "
        "nvidia.com/container.main.gpus.devices: a pod template may not carry a protected "
        "key; the binder writes it on each pod after scheduling")


def test_uid_is_echoed_and_the_mutating_webhook_leaves_workloads_alone(
        webhook: Webhook) -> None:
    review = load("deployment-protected.review.json")
    review["request"]["uid"] = "any-uid-42"
    _, answer = webhook.post("/mutate", review)
    assert answer["response"] == {"uid": "any-uid-42", "allowed": True}


@pytest.mark.parametrize(("body", "message"), [
    (b"{not json", "the request body is not valid JSON: Expecting property name enclosed in "
                   "double quotes: line 1 column 2 (char 1)\n"),
    (b"[]", "the request body must be a JSON object (an AdmissionReview)\n"),
    (b'{"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview", "request": {}}',
     "expected apiVersion admission.k8s.io/v1 kind AdmissionReview, got apiVersion "
     "'admission.k8s.io/v1beta1' kind 'AdmissionReview'\n"),
    (b'{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}',
     "the AdmissionReview has no request object\n"),
    (b'{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {}}',
     "the AdmissionReview request has no uid\n"),
])
def test_bad_request_body_is_a_400_with_a_clear_message(
        webhook: Webhook, body: bytes, message: str) -> None:
    status, text = webhook.post("/validate", body)
    assert (status, text) == (400, message)


def test_healthz_and_unknown_paths(webhook: Webhook) -> None:
    conn = webhook.connect()
    try:
        conn.request("GET", "/healthz")
        resp = conn.getresponse()
        assert (resp.status, resp.read()) == (200, b"ok\n")
        conn.request("GET", "/metrics")  # same connection: keep-alive works
        resp = conn.getresponse()
        assert resp.status == 404
        resp.read()
    finally:
        conn.close()
    status, _ = webhook.post("/nope", load("pod-plain.review.json"))
    assert status == 404


def _peer_der(webhook: Webhook, ca_file: Path) -> bytes:
    conn = webhook.connect(ca_file)
    try:
        conn.request("GET", "/healthz")
        conn.getresponse().read()
        assert conn.sock is not None
        return conn.sock.getpeercert(binary_form=True)
    finally:
        conn.close()


def test_certificate_is_reloaded_when_the_files_change(
        webhook: Webhook, tls_dir: Path, tmp_path: Path) -> None:
    old_ca = tmp_path / "old-ca.pem"
    old_ca.write_bytes((tls_dir / "tls.crt").read_bytes())
    assert _peer_der(webhook, old_ca) == der_of(old_ca.read_bytes())
    new_cert, new_key = make_cert("webhook-b")
    install(tls_dir, new_cert, new_key)
    new_ca = tmp_path / "new-ca.pem"
    new_ca.write_bytes(new_cert)
    assert _peer_der(webhook, new_ca) == der_of(new_cert)
    with pytest.raises(ssl.SSLCertVerificationError):
        _peer_der(webhook, old_ca)


def test_a_half_rotated_pair_keeps_the_old_certificate(
        webhook: Webhook, tls_dir: Path, tmp_path: Path) -> None:
    old_ca = tmp_path / "old-ca.pem"
    old_ca.write_bytes((tls_dir / "tls.crt").read_bytes())
    new_cert, _ = make_cert("webhook-c")
    (tls_dir / "tls.crt").write_bytes(new_cert)  # key not rotated yet: the pair mismatches
    assert _peer_der(webhook, old_ca) == der_of(old_ca.read_bytes())


def test_the_cli_serves_https_and_stops_on_sigterm(tls_dir: Path) -> None:
    cli = Path(sys.executable).parent / "kai-fractions"
    proc = subprocess.Popen(
        [str(cli), "admission", "--listen", "127.0.0.1:0", "--tls-cert",
         str(tls_dir / "tls.crt"), "--tls-key", str(tls_dir / "tls.key"),
         "--gate-image", GATE_IMAGE],
        stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        assert "serving /validate, /mutate and /healthz on https://127.0.0.1:" in line, line
        port = int(line.rsplit(":", 1)[1])
        server = type("S", (), {"port": port})()
        hook = Webhook(server, tls_dir / "tls.crt")  # type: ignore[arg-type]
        status, answer = hook.post("/mutate", load("pod-time-slicing.review.json"))
        assert status == 200 and answer["response"]["allowed"] is True
        proc.terminate()
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_cli_refuses_to_start_without_a_readable_certificate(tmp_path: Path) -> None:
    cli = Path(sys.executable).parent / "kai-fractions"
    result = subprocess.run(
        [str(cli), "admission", "--listen", "127.0.0.1:0", "--tls-cert",
         str(tmp_path / "missing.crt"), "--tls-key", str(tmp_path / "missing.key"),
         "--gate-image", GATE_IMAGE], capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert result.stderr == (f"kai-fractions admission: cannot read TLS files "
                             f"{tmp_path}/missing.crt, {tmp_path}/missing.key: "
                             "No such file or directory\n")


def test_the_cli_refuses_a_runtime_class_that_cannot_be_one(tls_dir: Path, capsys) -> None:
    from kai_fractions.cli import main

    assert main(["admission", "--listen", "127.0.0.1:0", "--tls-cert", str(tls_dir / "tls.crt"),
                 "--tls-key", str(tls_dir / "tls.key"), "--gate-image", GATE_IMAGE,
                 "--runtime-class", "NVIDIA runtime"]) == 2
    assert capsys.readouterr().err == (
        "kai-fractions admission: --runtime-class: 'NVIDIA runtime' is not a RuntimeClass "
        "name (lower-case letters, digits, '-' and '.')\n")
