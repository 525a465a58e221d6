"""`signing-keys generate --force` replaces both halves of the pair or neither: a failure on one
file leaves the old pair as it was (no private key whose public half the nodes lack), names the
file, and leaves no temporary file behind."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from kai_fractions.cli import main
from kai_fractions.cli import signing_keys as cli_keys
from kai_fractions.signing import load_ed25519


def generated(tmp_path: Path, capsys) -> tuple[Path, Path, Path]:
    keys = tmp_path / "keys"
    assert main(["signing-keys", "generate", str(keys)]) == 0
    capsys.readouterr()
    return keys, keys / "private" / "current", keys / "public" / "current"


def files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def matching(private: Path, public: Path) -> bool:
    return load_ed25519(private.read_bytes()).kid == load_ed25519(public.read_bytes()).kid


def test_a_public_file_that_is_a_directory_changes_nothing(tmp_path: Path, capsys):
    keys, _, public = generated(tmp_path, capsys)
    public.unlink()
    public.mkdir()  # e.g. a mount point
    before = files(keys)
    assert main(["signing-keys", "generate", "--force", str(keys)]) == 2
    assert capsys.readouterr().err == (f"kai-fractions signing-keys: {public}: not a regular "
                                       "file; nothing was written\n")
    assert files(keys) == before


def test_a_public_directory_that_cannot_be_made_changes_nothing(tmp_path: Path, capsys):
    keys, private, public = generated(tmp_path, capsys)
    old_private = private.read_bytes()
    for p in (public, public.parent):
        p.unlink() if p.is_file() else p.rmdir()
    public.parent.write_text("not a directory")
    assert main(["signing-keys", "generate", "--force", str(keys)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kai-fractions signing-keys: {public}: ") and \
        err.endswith("; nothing was replaced\n"), err
    assert private.read_bytes() == old_private
    assert sorted(p.name for p in private.parent.iterdir()) == ["current"]  # no temporary


def test_a_failed_private_rename_puts_the_old_public_key_back(tmp_path: Path, capsys,
                                                              monkeypatch):
    keys, private, public = generated(tmp_path, capsys)
    before = files(keys)
    real = os.replace

    def replace(src, dst):
        if Path(dst) == private:
            raise OSError(5, "Input/output error")
        return real(src, dst)

    monkeypatch.setattr(cli_keys.os, "replace", replace)
    assert main(["signing-keys", "generate", "--force", str(keys)]) == 2
    assert capsys.readouterr().err == (f"kai-fractions signing-keys: {private}: Input/output "
                                       "error; the old public key was put back\n")
    assert files(keys) == before and matching(private, public)


def test_a_forced_pair_replaces_both_with_their_modes(tmp_path: Path, capsys):
    keys, private, public = generated(tmp_path, capsys)
    old = files(keys)
    assert main(["signing-keys", "generate", "--force", str(keys)]) == 0
    new = files(keys)
    assert set(new) == set(old) and all(new[name] != old[name] for name in new)
    assert matching(private, public)
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    assert stat.S_IMODE(public.stat().st_mode) == 0o644

