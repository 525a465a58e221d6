"""`kai-fractions mirror` refuses, at start and before it writes anything to the cluster, what it
could not work with: object names the API server would refuse, durations that never end, a
signing key that cannot sign, a TLS key that is not its certificate's. Exit 2, one line that
names the flag and the rule."""

from __future__ import annotations

from pathlib import Path

import pytest

from kai_fractions.cli import main
from kai_fractions.mirror.leader import ElectionConfig

from .certs import CertificateAuthority

PUBLISH = ["--publish-public-key", "kai-fractions/kai-fractions-signing-public"]


def refusal(capsys, *argv: str) -> str:
    assert main(["mirror", "--kubeconfig", "/nonexistent/kubeconfig", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err.removeprefix("kai-fractions mirror: ").rstrip("\n")


NS_RULE = "not a namespace name (lower-case letters, digits and '-', at most 63)"
NAME_RULE = "not an object name (lower-case letters, digits, '-' and '.', at most 253)"


@pytest.mark.parametrize(("argv", "message"), [
    (["--node-agent-daemonset", "NS/x"],
     f"--node-agent-daemonset 'NS/x': the namespace 'NS': {NS_RULE}"),
    (["--node-agent-daemonset", "ns/Bad_Name"],
     f"--node-agent-daemonset 'ns/Bad_Name': the name 'Bad_Name': {NAME_RULE}"),
    (["--node-agent-daemonset", "a/b/c"], "--node-agent-daemonset must be NAMESPACE/NAME, got "
     "'a/b/c'"),
    (["--publish-public-key", "ns/Bad_Name"],
     f"--publish-public-key 'ns/Bad_Name': the name 'Bad_Name': {NAME_RULE}"),
    (["--publish-public-key", "kai fractions/x"],
     f"--publish-public-key 'kai fractions/x': the namespace 'kai fractions': {NS_RULE}"),
    (["--report-interval", "inf"], "--report-interval must be a positive, finite number of "
     "seconds, got inf"),
    (["--report-interval", "nan"], "--report-interval must be a positive, finite number of "
     "seconds, got nan"),
    (["--follow-bindrequests", "--mark-silent-nodes-after", "inf"], "--mark-silent-nodes-after "
     "inf: at least 120 seconds (twice the node agent's heartbeat) and finite, or 0 for off"),
    (["--follow-bindrequests", "--leader-elect", "--leader-elect-lease-namespace", "Bad NS"],
     "--leader-elect: lease namespace 'Bad NS' (--leader-elect-lease-namespace, else "
     f"$POD_NAMESPACE or the service account's): {NS_RULE}"),
    (["--follow-bindrequests", "--leader-elect", "--leader-elect-lease-namespace", "ns",
      "--leader-elect-lease-name", "Bad Name"],
     f"--leader-elect: lease name 'Bad Name' (--leader-elect-lease-name): {NAME_RULE}"),
])
def test_names_and_durations_are_checked(capsys, argv, message):
    assert refusal(capsys, *argv) == message


def test_any_holder_identity_is_taken():
    """holderIdentity is a free string to the API: the identity is not held to a name's rule."""
    assert ElectionConfig("ns", "lease", "Pod Name_1/x:y").problems() == []


def test_a_public_signing_key_is_refused_before_the_cluster(tmp_path: Path, capsys):
    assert main(["signing-keys", "generate", str(tmp_path / "k")]) == 0
    capsys.readouterr()
    for given in (tmp_path / "k" / "public" / "current", tmp_path / "k" / "public"):
        assert refusal(capsys, "--signing-key-file", str(given), *PUBLISH) == (
            f"--signing-key-file {tmp_path / 'k' / 'public' / 'current'}: a public key; the "
            "mirror needs the private key (the chart's Secret kai-fractions-signing-key, or "
            "DIR/private/current from `kai-fractions signing-keys generate DIR`); the public "
            "key is the node agents' --signing-key-file")


def test_the_private_key_gets_past_the_check(tmp_path: Path, capsys):
    """The kubeconfig is the next thing read: its error shows the key was accepted."""
    assert main(["signing-keys", "generate", str(tmp_path / "k")]) == 0
    capsys.readouterr()
    assert refusal(capsys, "--signing-key-file", str(tmp_path / "k" / "private"), *PUBLISH) == \
        "--kubeconfig /nonexistent/kubeconfig: no such file"


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, Path]:
    ca, other = CertificateAuthority(), CertificateAuthority("another CA")
    cert, key = ca.issue("mirror", server=True).write(tmp_path, "server")
    _, other_key = other.issue("mirror", server=True).write(tmp_path, "other")
    (tmp_path / "ca.crt").write_bytes(ca.pem)
    (tmp_path / "junk").write_text("not a PEM file\n")
    return {"cert": cert, "key": key, "other_key": other_key, "ca": tmp_path / "ca.crt",
            "junk": tmp_path / "junk"}


def test_a_key_that_is_not_the_certificates_is_refused(pki, capsys):
    assert refusal(capsys, "--tls-cert", str(pki["cert"]), "--tls-key", str(pki["other_key"])) \
        == (f"--tls-key {pki['other_key']}: not the private key of --tls-cert {pki['cert']} "
            "(key values mismatch)")


@pytest.mark.parametrize(("flag", "message"), [
    ("--tls-cert", "--tls-cert {junk}: no certificate (PEM) in it"),
    ("--tls-key", "--tls-key {junk}: no private key (PEM) in it"),
    ("--tls-client-ca", "--tls-client-ca {junk}: no CA certificate (PEM) in it (no certificate "
     "or crl found)"),
])
def test_a_file_without_pem_is_refused_naming_its_flag(pki, capsys, flag: str, message: str):
    files = {"--tls-cert": pki["cert"], "--tls-key": pki["key"], "--tls-client-ca": pki["ca"],
             flag: pki["junk"]}
    argv = [part for name, path in files.items() for part in (name, str(path))]
    assert refusal(capsys, *argv) == message.format(junk=pki["junk"])


def test_a_good_pair_gets_past_the_check(pki, capsys):
    assert refusal(capsys, "--tls-cert", str(pki["cert"]), "--tls-key", str(pki["key"]),
                   "--tls-client-ca", str(pki["ca"])) == \
        "--kubeconfig /nonexistent/kubeconfig: no such file"


@pytest.mark.integration
def test_a_bad_pair_writes_nothing_to_the_cluster(kube, pki, tmp_path: Path, capsys):
    """The public key's ConfigMap was written before the pair was first loaded."""
    assert main(["signing-keys", "generate", str(tmp_path / "k")]) == 0
    capsys.readouterr()
    kubeconfig = kube.write_kubeconfig(tmp_path / "kc")
    assert main(["mirror", "--kubeconfig", str(kubeconfig), "--no-pod-cache",
                 "--listen", "127.0.0.1:0", "--tls-cert", str(pki["cert"]),
                 "--tls-key", str(pki["other_key"]),
                 "--signing-key-file", str(tmp_path / "k" / "private"), *PUBLISH]) == 2
    assert "not the private key of --tls-cert" in capsys.readouterr().err
    assert [r for r in kube.requests() if r.method.value in ("POST", "PUT", "PATCH")] == []
    assert kube.get_object("v1/configmaps", "kai-fractions", "kai-fractions-signing-public") \
        is None
