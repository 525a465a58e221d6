"""`kai-fractions mirror --signing-key-file`: refusals, and a real process that signs what it
writes through the Kubernetes API (kmock) with the key from a Secret-shaped directory."""

from __future__ import annotations

import hashlib

import pytest

from kai_fractions.cli import build_parser, main
from kai_fractions.signing import Keyring
from tests.support.mirror_kube import run_mirror_process

from .allocations import KEY_A, KEY_B, plans_of

KID_A = hashlib.sha256(KEY_A).hexdigest()[:8]
KID_B = hashlib.sha256(KEY_B).hexdigest()[:8]


def test_the_flag_is_repeatable_and_off_by_default():
    parser = build_parser()
    assert parser.parse_args(["mirror"]).signing_key_file == []
    args = parser.parse_args(["mirror", "--signing-key-file", "/a", "--signing-key-file", "/b"])
    assert args.signing_key_file == ["/a", "/b"]


@pytest.mark.parametrize(("setup", "message"), [
    ("missing", "--signing-key-file {d}/missing: no such file or directory"),
    ("empty-dir", "--signing-key-file {d}/empty-dir: a key directory needs a file named "
     "'current' (and may have 'previous')"),
    ("short", "signing key {d}/short: 5 byte(s); an HMAC-SHA256 key needs at least 16 "
     "(better: an Ed25519 key pair from `kai-fractions signing-keys`)"),
])
def test_unusable_keys_are_refused_before_the_cluster_is_touched(tmp_path, capsys, setup,
                                                                 message):
    (tmp_path / "empty-dir").mkdir()
    (tmp_path / "short").write_bytes(b"short")
    code = main(["mirror", "--signing-key-file", str(tmp_path / setup),
                 "--kubeconfig", "/nonexistent/kubeconfig"])
    assert code == 2
    assert capsys.readouterr().err == \
        f"kai-fractions mirror: {message.format(d=tmp_path)}\n"


@pytest.mark.integration
def test_a_real_mirror_signs_what_it_writes(kube, tmp_path):
    keys = tmp_path / "signing"
    keys.mkdir()
    (keys / "current").write_bytes(KEY_B)
    (keys / "previous").write_bytes(KEY_A)
    run = run_mirror_process(kube, tmp_path, "--signing-key-file", str(keys))
    err, reply = run.err, run.reply
    assert run.returncode == 0, err
    assert f"signing allocations with key {KID_B} (accepted: {KID_B}, {KID_A})" in err
    obj = kube.core.api_client.sanitize_for_serialization(
        kube.core.read_namespaced_pod("train-0", "team-a"))
    signature = obj["metadata"]["annotations"]["kai-fractions.io/container.trainer.signature"]
    assert signature.startswith(f"v1;kid={KID_B};sig=")
    assert reply.annotations["kai-fractions.io/container.trainer.signature"] == signature
    (plan,) = plans_of(obj)
    assert Keyring.of(KEY_B).verify(plan, signature).ok
