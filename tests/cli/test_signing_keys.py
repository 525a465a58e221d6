"""`kai-fractions signing-keys`: a key pair for signed allocations, and the public half of a
private key, with clear errors that name the file (this command has no --signing-key-file)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from kai_fractions.cli import main
from kai_fractions.signing import load_ed25519


def test_generate_writes_a_private_key_only_its_owner_reads_and_its_public_half(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["signing-keys", "generate", str(tmp_path / "keys")]) == 0
    private, public = tmp_path / "keys/private/current", tmp_path / "keys/public/current"
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    signer, verifier = load_ed25519(private.read_bytes()), load_ed25519(public.read_bytes())
    assert signer.kid == verifier.kid and signer.kid in capsys.readouterr().out
    # what `public` prints of the private key is the public file, byte for byte
    assert main(["signing-keys", "public", str(private)]) == 0
    assert capsys.readouterr().out.encode() == public.read_bytes()


def test_generate_keeps_an_existing_pair_unless_forced(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    keys = tmp_path / "keys"
    assert main(["signing-keys", "generate", str(keys)]) == 0
    first = (keys / "private/current").read_bytes()
    assert main(["signing-keys", "generate", str(keys)]) == 2
    assert f"{keys}: a key pair is there already (pass --force" in capsys.readouterr().err
    assert (keys / "private/current").read_bytes() == first
    assert main(["signing-keys", "generate", "--force", str(keys)]) == 0
    assert (keys / "private/current").read_bytes() != first


@pytest.mark.parametrize(("content", "message"), [
    (None, "No such file or directory"),
    (b"not a key\n", "not a usable PEM key"),
])
def test_public_names_the_file_it_cannot_use(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes | None,
        message: str) -> None:
    path = tmp_path / "key.pem"
    if content is not None:
        path.write_bytes(content)
    assert main(["signing-keys", "public", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kai-fractions signing-keys: {path}: ") and message in err, err
    assert "--signing-key-file" not in err
