"""`kai-fractions signing-keys`: make an Ed25519 key pair for signed allocations, or print the
public half of a private key (what nodes hold)."""

from __future__ import annotations

import argparse
import os
import sys
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
    key = Ed25519Key.generate()
    try:
        private.parent.mkdir(parents=True, exist_ok=True)
        public.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(private, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(key.private_pem())
        public.write_bytes(key.public_pem())
    except OSError as e:
        return _fail(f"{root}: {e.strerror or e}")
    print(f"key {key.kid}: {private} (the mirror's), {public} (the node agents')")
    return 0
