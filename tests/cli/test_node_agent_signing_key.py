"""`kai-fractions node-agent --signing-key-file`: the node takes the mirror's PUBLIC key (the
chart's ConfigMap kai-fractions-signing-public). A private key is refused at start, with the
flag, the file and the rule: a node that holds it could sign allocations."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kai_fractions.cli import main
from kai_fractions.signing import CURRENT, Ed25519Key

OPENSSH = (b"-----BEGIN OPENSSH PRIVATE KEY-----\n"
           b"b3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQAAAAAAAAABAAAAMwAAAAtzc2gtZW\n"
           b"-----END OPENSSH PRIVATE KEY-----\n")


def agent(*args: str) -> int:
    return main(["node-agent", "--node-name", "n1", "--kubeconfig", "/nonexistent", *args])


@pytest.mark.parametrize("layout", ["file", "directory"])
def test_the_mirrors_private_key_is_refused_and_nothing_derived_from_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture,
        layout: str) -> None:
    key = Ed25519Key.generate()
    if layout == "file":
        given = path = tmp_path / "private.pem"
    else:
        given = tmp_path / "signing"
        given.mkdir()
        path = given / CURRENT
    path.write_bytes(key.private_pem())
    with caplog.at_level(logging.INFO):
        assert agent("--signing-key-file", str(given)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kai-fractions node-agent: --signing-key-file {path}: a private "
                          "key; "), err
    assert "PUBLIC key" in err and "kai-fractions-signing-public" in err
    assert "only the mirror may hold one" in err
    # the key is not reduced to its public half: no key id, no "applying only signed"
    assert key.kid not in err and key.kid not in caplog.text
    assert "applying only signed allocations" not in caplog.text


def test_a_private_key_of_another_kind_is_not_taken_for_an_hmac_key(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "id_ed25519").write_bytes(OPENSSH)
    assert agent("--signing-key-file", str(tmp_path / "id_ed25519")) == 2
    assert "a private key; " in capsys.readouterr().err


def test_the_public_key_and_a_legacy_hmac_key_are_taken(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture) -> None:
    key = Ed25519Key.generate()
    (tmp_path / "public.pem").write_bytes(key.public_pem())
    (tmp_path / "hmac").write_bytes(b"k" * 32)
    with caplog.at_level(logging.INFO):
        # it gets past the keys and stops at the (missing) kubeconfig
        assert agent("--signing-key-file", str(tmp_path / "public.pem"),
                     "--signing-key-file", str(tmp_path / "hmac")) == 2
    assert "private key" not in capsys.readouterr().err
    assert f"applying only signed allocations (keys: {key.kid}, " in caplog.text


def test_the_help_names_the_public_key_and_the_configmap(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "10000")  # no wrapping, which breaks words at hyphens
    with pytest.raises(SystemExit):
        main(["node-agent", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    text = out[out.index("--signing-key-file FILE apply"):]
    text = text[:text.index("--signature-key-wait SECONDS")]
    assert "Ed25519 public key (PEM)" in text and "kai-fractions-signing-public" in text
    assert "A private key is refused" in text
    assert "raw key" not in text and "Secret" not in text
