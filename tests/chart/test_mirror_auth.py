"""The mirror authenticates its gRPC callers by default (issue 17, finding 1): mutual TLS with a
client certificate the chart generates from the same CA as the server's; a generated (or your)
bearer token as the alternative; running unauthenticated takes an explicit `mirror.auth: none`,
which NOTES.txt shouts about. Contradictory values are refused with the field and the rule."""

from __future__ import annotations

import base64
import ssl
import string

import pytest

from kai_fractions.cli import build_parser

from .render import (
    NAMESPACE,
    chart_notes,
    container,
    find,
    kube_validate,
    one,
    render,
    template_error,
)
from .tls_memory import handshake

MIRROR = "kai-fractions-mirror"
CLIENT = f"{MIRROR}-client-tls"
TOKEN = f"{MIRROR}-token"
CLIENT_CA = "--tls-client-ca=/etc/kai-fractions/tls/ca.crt"
TOKEN_FILE = "--token-file=/etc/kai-fractions/token/token"


def mirror(*sets: str) -> tuple[list[dict], dict, dict]:
    docs = render(None, sets)
    dep = one(docs, "Deployment", MIRROR)
    return docs, dep["spec"]["template"]["spec"], container(dep, "mirror")


def auth_args(c: dict) -> list[str]:
    return [a for a in c["args"] if a.startswith(("--tls-", "--token-file", "--insecure"))]


def test_the_default_is_mutual_tls_with_a_generated_client_certificate():
    docs, pod, c = mirror()
    assert auth_args(c) == ["--tls-cert=/etc/kai-fractions/tls/tls.crt",
                            "--tls-key=/etc/kai-fractions/tls/tls.key", CLIENT_CA]
    args = build_parser().parse_args(c["args"])
    assert args.tls_client_ca == "/etc/kai-fractions/tls/ca.crt" and not args.insecure
    assert args.token_file is None
    assert "token" not in {v["name"] for v in pod["volumes"]}
    server = one(docs, "Secret", f"{MIRROR}-tls")["data"]
    client = one(docs, "Secret", CLIENT)
    assert client["type"] == "kubernetes.io/tls"
    assert client["data"]["ca.crt"] == server["ca.crt"]
    assert not find(docs, "Secret", TOKEN)
    # the server, requiring a client certificate from its CA, accepts the generated one...
    assert mutual_handshake(server, client["data"]) is None
    # ...and refuses a client certificate from another CA (another render's)
    stranger = one(render(None, ("mirror.auth=mutualTLSAndToken",)), "Secret", CLIENT)["data"]
    assert mutual_handshake(server, stranger) is not None


def test_token_auth_with_a_generated_token():
    docs, pod, c = mirror("mirror.auth=token")
    assert TOKEN_FILE in c["args"] and CLIENT_CA not in c["args"]
    assert "--insecure" not in c["args"]  # the token never crosses the network in the clear
    assert build_parser().parse_args(c["args"]).token_file == "/etc/kai-fractions/token/token"
    secret = one(docs, "Secret", TOKEN)
    token = base64.b64decode(secret["data"]["token"]).decode()
    assert len(token) == 48 and set(token) <= set(string.ascii_letters + string.digits)
    assert next(v for v in pod["volumes"] if v["name"] == "token") == {
        "name": "token", "secret": {"secretName": TOKEN, "defaultMode": 0o440}}
    assert {"name": "token", "mountPath": "/etc/kai-fractions/token", "readOnly": True} in c[
        "volumeMounts"]
    assert not find(docs, "Secret", CLIENT)


def test_both_and_a_token_secret_of_your_own():
    docs, pod, c = mirror("mirror.auth=mutualTLSAndToken", "mirror.tokenSecretName=my-token")
    assert CLIENT_CA in c["args"] and TOKEN_FILE in c["args"]
    assert next(v for v in pod["volumes"] if v["name"] == "token")["secret"][
        "secretName"] == "my-token"
    assert not find(docs, "Secret", TOKEN) and not find(docs, "Secret", "my-token")
    assert find(docs, "Secret", CLIENT)


def test_provided_certificates_check_client_certificates_against_their_ca():
    docs, pod, c = mirror("mirror.tls.secretName=my-mirror-certs")
    assert CLIENT_CA in c["args"]
    assert next(v for v in pod["volumes"] if v["name"] == "tls")["secret"][
        "secretName"] == "my-mirror-certs"
    assert not find(docs, "Secret", CLIENT)  # you issue client certificates from your CA


def test_unauthenticated_only_when_asked_for_explicitly():
    docs, _pod, c = mirror("mirror.auth=none")
    assert auth_args(c) == ["--tls-cert=/etc/kai-fractions/tls/tls.crt",
                            "--tls-key=/etc/kai-fractions/tls/tls.key"]
    assert not find(docs, "Secret", CLIENT) and not find(docs, "Secret", TOKEN)
    _docs, _pod, c = mirror("mirror.auth=none", "mirror.tls.enabled=false")
    assert auth_args(c) == ["--insecure"]
    build_parser().parse_args(c["args"])


@pytest.mark.parametrize(("sets", "message"), [
    (("mirror.tls.enabled=false",),
     "mirror.auth=mutualTLS needs mirror.tls.enabled=true (client certificates are checked "
     "in the TLS handshake); set mirror.auth=none"),
    (("mirror.tls.enabled=false", "mirror.auth=token"),
     "mirror.auth=token needs mirror.tls.enabled=true (without TLS the bearer token would "
     "cross the network in the clear)"),
    (("mirror.tls.clientAuth=false",),
     "mirror.tls.clientAuth was replaced by mirror.auth: mutualTLS"),
    (("mirror.tls.clientAuth=true",),
     "mirror.tls.clientAuth was replaced by mirror.auth"),
    (("mirror.tokenSecretName=my-token",),
     "mirror.tokenSecretName=my-token is set but mirror.auth=mutualTLS checks no token"),
    (("mirror.auth=None",), "/mirror/auth"),
    (("mirror.auth=",), "/mirror/auth"),
])
def test_contradictions_are_refused_with_the_field_and_the_rule(sets, message):
    assert message in template_error(*sets)


def test_notes_say_how_a_caller_gets_its_credentials():
    text = chart_notes()
    assert "authenticates its callers (mirror.auth=mutualTLS)" in text
    assert (f"kubectl -n {NAMESPACE} get secret {CLIENT} -o jsonpath='{{.data.tls\\.crt}}'"
            in text)
    assert f"kubectl -n kai-scheduler create secret generic {CLIENT}" in text
    assert "WARNING" not in text
    text = chart_notes("mirror.auth=token")
    assert (f"kubectl -n {NAMESPACE} get secret {TOKEN} -o jsonpath='{{.data.token}}' | "
            "base64 -d") in text
    assert CLIENT not in text


def test_notes_shout_when_nobody_is_authenticated():
    text = chart_notes("mirror.auth=none")
    assert "WARNING: mirror.auth=none: THE MIRROR AUTHENTICATES NOBODY" in text
    assert "Only its NetworkPolicy limits who can reach it." in text
    assert "plaintext" not in text
    text = chart_notes("mirror.auth=none", "mirror.tls.enabled=false",
                       "mirror.networkPolicy.enabled=false")
    assert "every pod in the cluster can reach it" in text
    assert "It also serves plaintext gRPC" in text


# -- helpers --------------------------------------------------------------------------------

def mutual_handshake(server_data: dict, client_data: dict) -> ssl.SSLError | None:
    """The mirror (its server pair, requiring a client certificate signed by its `ca.crt`, as
    `--tls-client-ca` does) and a caller presenting `client_data`'s pair: None when the
    handshake completes, else the error."""
    return handshake(server_data, server_data["ca.crt"], f"{MIRROR}.{NAMESPACE}.svc",
                     client=client_data)


@pytest.mark.parametrize("sets", [
    ("mirror.auth=token",),
    ("mirror.auth=mutualTLSAndToken", "mirror.tokenSecretName=my-token"),
    ("mirror.auth=none", "mirror.tls.enabled=false"),
    ("signing.legacyHmac.enabled=true", "signing.legacyHmac.create=false",
     "nodeAgent.publishGpuMemoryLabel=true"),
], ids=["token", "both", "none", "legacy-hmac-and-label"])
def test_these_renders_are_valid_kubernetes(sets):
    assert kube_validate(render(None, sets), ",".join(sets)) == []
