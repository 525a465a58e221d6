"""`kai-fractions signing-keys`: make an Ed25519 key pair for signed allocations, or print the
public half of a private key (what nodes hold)."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from pathlib import Path

from . import EXIT_USAGE


def register(sub) -> None:
    p = sub.add_parser(
        "signing-keys", help="make an Ed25519 key pair for signed allocations",
        description="Signed allocations (--signing-key-file): the mirror signs with the "
        "private key, node agents verify with the public key and cannot sign. `generate` "
        "writes DIR/private/current (mode 0600; the mirror's Secret) and DIR/public/current "
        "(the node agents'); `public FILE` prints the public key of a private key file. For "
        "a rotation, keep the old files as `previous` beside the new `current`. Exit codes: "
        "0 done, 2 usage error or an unusable file.")
    actions = p.add_subparsers(dest="action", metavar="<action>", required=True)
    generate = actions.add_parser("generate", help="write a new key pair under DIR")
    generate.add_argument("dir", metavar="DIR", help="directory to write into (created)")
    generate.add_argument("--force", action="store_true",
                          help="replace an existing DIR/*/current")
    public = actions.add_parser("public", help="print the public key of a private key file")
    public.add_argument("file", metavar="FILE", help="an Ed25519 private key (PEM)")
    p.set_defaults(func=run)


def _fail(message: str) -> int:
    print(f"kai-fractions signing-keys: {message}", file=sys.stderr)
    return EXIT_USAGE


def run(args: argparse.Namespace) -> int:
    from ..signing import Ed25519Key, SigningConfigError, load_ed25519

    if args.action == "public":
        try:
            key = load_ed25519(Path(args.file).read_bytes(), args.file, what=args.file)
        except OSError as e:
            return _fail(f"{args.file}: {e.strerror or e}")
        except SigningConfigError as e:
            return _fail(str(e))
        sys.stdout.write(key.public_pem().decode())
        return 0
    root = Path(args.dir)
    private, public = root / "private" / "current", root / "public" / "current"
    if not args.force and (private.exists() or public.exists()):
        return _fail(f"{root}: a key pair is there already (pass --force to replace it)")
    for path in (private, public):
        if os.path.lexists(path) and not os.path.isfile(path):
            return _fail(f"{path}: not a regular file; nothing was written")
    key = Ed25519Key.generate()
    try:
        write_pair(private, key.private_pem(), public, key.public_pem())
    except PairError as e:
        return _fail(str(e))
    print(f"key {key.kid}: {private} (the mirror's), {public} (the node agents')")
    return 0


class PairError(Exception):
    """The pair could not be written (the message names the file); the old pair, if any, is
    left as it was."""


def write_pair(private: Path, private_pem: bytes, public: Path, public_pem: bytes) -> None:
    """Replaces both files, or neither: each is written to a temporary file beside it first,
    then both are renamed, the public half first. A private key whose public half is not in
    place would sign what no node can verify, and the mirror reads its file as soon as it
    changes; a new public key alone signs nothing. Should the private key's rename still fail,
    the old public key is put back."""
    temps: list[str] = []
    try:
        for path, data, mode in ((private, private_pem, 0o600), (public, public_pem, 0o644)):
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                temps.append(_temporary(path, data, mode))
            except OSError as e:
                raise PairError(f"{path}: {e.strerror or e}; nothing was replaced") from None
        private_tmp, public_tmp = temps
        old_public = _read_if_any(public)
        try:
            os.replace(public_tmp, public)
        except OSError as e:
            raise PairError(f"{public}: {e.strerror or e}; nothing was replaced") from None
        try:
            os.replace(private_tmp, private)
        except OSError as e:
            restored = _restore(public, old_public)
            raise PairError(f"{private}: {e.strerror or e}; " + (
                "the old public key was put back" if restored else
                f"{public} now holds the new public key, without its private half")) from None
    finally:
        for tmp in temps:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)


def _temporary(target: Path, data: bytes, mode: int) -> str:
    """`data` in a new file beside `target` (the same file system: the rename is atomic)."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "wb") as out:
            os.fchmod(out.fileno(), mode)  # mkstemp makes it 0600, whatever the mode
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return tmp


def _read_if_any(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise PairError(f"{path}: {e.strerror or e}; nothing was replaced") from None


def _restore(path: Path, old: bytes | None) -> bool:
    """Puts `old` back at `path` (removes it when there was none); False when that failed."""
    try:
        if old is None:
            path.unlink()
        else:
            os.replace(_temporary(path, old, 0o644), path)
    except OSError:
        return False
    return True
