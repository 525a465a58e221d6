"""AdmissionReview fixtures through the real HTTPS server on 127.0.0.1.

Patches are judged by their effect: the JSONPatch is applied to the pod (the `jsonpatch`
package, an independent RFC 6902 implementation) and the PATCHED POD is compared with the
expected pod in tests/admission/data/, never the patch text.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import ctypes
import json
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonpatch
import kubernetes_validate
import pytest

from .certs import der_of, install, make_cert
from .conftest import GATE_IMAGE, Webhook, load
from .test_server_bounds import _answer_status

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


@contextlib.contextmanager
def cli_server(tls_dir: Path, *flags: str) -> Iterator[tuple[subprocess.Popen[str], Webhook]]:
    """`kai-fractions admission` on a free port of 127.0.0.1; killed if still running after."""
    cli = Path(sys.executable).parent / "kai-fractions"
    proc = subprocess.Popen(
        [str(cli), "admission", "--listen", "127.0.0.1:0", "--tls-cert",
         str(tls_dir / "tls.crt"), "--tls-key", str(tls_dir / "tls.key"),
         "--gate-image", GATE_IMAGE, *flags],
        stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        assert "serving /validate, /mutate and /healthz on https://127.0.0.1:" in line, line
        port = int(line.rsplit(":", 1)[1])
        server = type("S", (), {"port": port})()
        yield proc, Webhook(server, tls_dir / "tls.crt")  # type: ignore[arg-type]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _healthz(hook: Webhook) -> int:
    conn = hook.connect()
    try:
        conn.request("GET", "/healthz")
        return conn.getresponse().status
    finally:
        conn.close()


def _begin_review(hook: Webhook, body: bytes, sent: int) -> ssl.SSLSocket:
    """A POST /mutate whose headers and first `sent` bytes of body are on their way."""
    context = ssl.create_default_context(cafile=str(hook.ca_file))
    sock = context.wrap_socket(socket.create_connection(("127.0.0.1", hook.port), timeout=10),
                               server_hostname="127.0.0.1")
    sock.sendall(b"POST /mutate HTTP/1.1\r\nHost: w\r\nContent-Length: %d\r\n\r\n"
                 % len(body) + body[:sent])
    return sock


def _end_review(sock: ssl.SSLSocket, body: bytes, sent: int) -> int:
    sock.sendall(body[sent:])
    return _answer_status(sock)


def test_a_draining_webhook_is_not_ready_and_closes_each_connection_after_its_answer(
        webhook: Webhook) -> None:
    webhook.server.draining = True
    conn = webhook.connect()
    try:
        conn.request("GET", "/healthz")
        response = conn.getresponse()
        assert (response.status, response.read(), response.getheader("Connection")) == \
            (503, b"shutting down\n", "close")
    finally:
        conn.close()
    status, answer = webhook.post("/mutate", load("pod-time-slicing.review.json"))
    assert status == 200 and answer["response"]["allowed"] is True


def test_drain_stops_accepting_and_closes_idle_keep_alives(webhook: Webhook) -> None:
    conn = webhook.connect()
    try:
        conn.request("GET", "/healthz")
        conn.getresponse().read()
        _wait_until(lambda: [s for s, _ in webhook.server.connections._open.values()] ==
                    ["idle"])
        assert webhook.server.drain(timeout=5) is True
        assert conn.sock is not None and conn.sock.recv(1) == b""
        assert not _listening(webhook)
    finally:
        conn.close()


def test_the_cli_serves_https_and_stops_on_sigterm(tls_dir: Path) -> None:
    with cli_server(tls_dir, "--shutdown-delay", "0") as (proc, hook):
        status, answer = hook.post("/mutate", load("pod-time-slicing.review.json"))
        assert status == 200 and answer["response"]["allowed"] is True
        proc.terminate()
        assert proc.wait(timeout=10) == 0


def test_on_sigterm_the_cli_finishes_the_review_in_flight(tls_dir: Path) -> None:
    """It stops accepting, but answers the review it is reading before it exits (its
    connection was closed unanswered: "Remote end closed connection without response")."""
    # 2 MB (padded): it may take 3 s to come whole, time enough to send the rest after.
    body = json.dumps({**load("pod-sm-sharing.review.json"), "padding": "x" * 2_000_000}).encode()
    with cli_server(tls_dir, "--shutdown-delay", "0") as (proc, hook):
        in_flight = _begin_review(hook, body, 100)
        proc.terminate()
        _wait_until(lambda: not _listening(hook))  # the listening socket is closed
        assert proc.poll() is None  # still answering the one in flight
        assert _end_review(in_flight, body, 100) == 200
        in_flight.close()
        assert proc.wait(timeout=10) == 0


def test_on_sigterm_the_cli_serves_on_for_the_shutdown_delay_as_not_ready(
        tls_dir: Path) -> None:
    """The API server sends reviews until the pod leaves the endpoints: for --shutdown-delay
    they are answered, each on a connection then closed, while /healthz says 503 (the
    process exited at once, and new connections were refused)."""
    review = load("pod-sm-sharing.review.json")
    with cli_server(tls_dir, "--shutdown-delay", "1.5") as (proc, hook):
        assert _healthz(hook) == 200
        proc.terminate()
        _wait_until(lambda: _healthz(hook) == 503)
        conn = hook.connect()
        try:
            conn.request("POST", "/mutate", body=json.dumps(review).encode())
            response = conn.getresponse()
            assert response.status == 200 and response.getheader("Connection") == "close"
            response.read()
        finally:
            conn.close()
        assert proc.wait(timeout=20) == 0
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", hook.port), timeout=5).close()


def test_a_second_signal_skips_the_shutdown_delay(tls_dir: Path) -> None:
    with cli_server(tls_dir, "--shutdown-delay", "60") as (proc, hook):
        proc.terminate()
        _wait_until(lambda: _healthz(hook) == 503)
        proc.terminate()
        assert proc.wait(timeout=20) == 0


def test_the_shutdown_delay_is_a_number_of_seconds(tls_dir: Path, capsys) -> None:
    from kai_fractions.cli import main

    with pytest.raises(SystemExit):
        main(["admission", "--tls-cert", str(tls_dir / "tls.crt"), "--tls-key",
              str(tls_dir / "tls.key"), "--gate-image", GATE_IMAGE, "--shutdown-delay", "-1"])
    assert "--shutdown-delay: must be a number of seconds from 0 to 3600, got '-1'" in \
        capsys.readouterr().err


def _signal_another_thread(proc: subprocess.Popen[str], sig: int) -> None:
    """Gives `sig` to a thread of `proc` other than its main one, as the kernel may for a
    signal sent to the process (it picks any thread that does not block it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    for tid in sorted(int(t) for t in os.listdir(f"/proc/{proc.pid}/task")):
        if tid != proc.pid and libc.tgkill(proc.pid, tid, sig) == 0:
            return
    raise AssertionError(f"no thread of {proc.pid} but its main one took signal {sig}")


def test_a_signal_the_kernel_gives_another_thread_stops_the_cli_all_the_same(
        tls_dir: Path) -> None:
    """A signal handler runs in the main thread, which only sees it when it wakes: the main
    thread waited with no timeout, so a SIGTERM given to the serving thread was never handled
    (the pod served on, ready, until the kubelet's SIGKILL)."""
    with cli_server(tls_dir, "--shutdown-delay", "60") as (proc, hook):
        assert _healthz(hook) == 200
        _signal_another_thread(proc, signal.SIGTERM)
        _wait_until(lambda: _healthz(hook) == 503)
        assert _healthz(hook) == 503
        _signal_another_thread(proc, signal.SIGTERM)  # the second skips the delay
        assert proc.wait(timeout=20) == 0


def _listening(hook: Webhook) -> bool:
    try:
        socket.create_connection(("127.0.0.1", hook.port), timeout=5).close()
    except (ConnectionRefusedError, ConnectionResetError):
        # Reset: the probe was in the listen backlog when the listener closed.
        return False
    return True


def _wait_until(condition: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return
        time.sleep(0.02)


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
