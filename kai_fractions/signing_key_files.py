"""Reading allocation signing keys from files: which files one `--signing-key-file` names, what
kind of key a file holds (PEM Ed25519, raw HMAC bytes), and the refusal of a private key on a
node agent whatever form it comes in (PEM, DER, JWK, or any of them in base64).

What a file may hold depends on where it comes from (`KeyFile`), never on its content alone: a
node agent's `--signing-key-file` is the mirror's public-key ConfigMap, where only PEM public
keys belong, and text found there is refused rather than read as an HMAC key (whoever can write
that ConfigMap would otherwise choose the secret the agent verifies with). The legacy HMAC key
comes only from its own flag, `--signing-hmac-key-file` (the chart's HMAC Secret).

Separate from `signing_key_types` (the keys themselves) and from `signing` (the keyring that
these keys make, `load_keyring`, and its reload, `KeyringSource`): the file formats and their
pitfalls are a concern of their own.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from enum import StrEnum
from pathlib import Path

from .signing_key_types import AnyKey, Ed25519Key, SigningConfigError, SigningKey

CURRENT, PREVIOUS = "current", "previous"
"""File names inside a `--signing-key-file` directory (the data keys of the Secret)."""
KEY_FLAG, HMAC_FLAG = "--signing-key-file", "--signing-hmac-key-file"


class KeyFile(StrEnum):
    """What a key file may hold, by the flag that gave it (never guessed from its content)."""

    ANY = "any"
    """The mirror's `--signing-key-file` (its Secret): a PEM Ed25519 key, or the raw bytes of
    an HMAC key."""
    PUBLIC = "public"
    """A node agent's `--signing-key-file` (the ConfigMap kai-fractions-signing-public): PEM
    Ed25519 public keys only."""
    HMAC = "hmac"
    """A node agent's `--signing-hmac-key-file` (the legacy HMAC Secret): the raw bytes of an
    HMAC key."""

    @property
    def flag(self) -> str:
        return HMAC_FLAG if self is KeyFile.HMAC else KEY_FLAG


_PRIVATE_PEM = b"-----BEGIN PRIVATE KEY-----"
_PUBLIC_PEM = b"-----BEGIN PUBLIC KEY-----"
_PEM_BEGIN = b"-----BEGIN"

_ANY_PRIVATE_PEM = re.compile(rb"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----", re.IGNORECASE)
"""A PEM private key of any kind (PKCS8, OpenSSH, EC, RSA, encrypted), in any letter case and
anywhere in the file (after a byte order mark, blank lines or text)."""
_BOM = b"\xef\xbb\xbf"
"""A UTF-8 byte order mark, which some editors put before a PEM key they save."""
_BASE64 = re.compile(rb"[A-Za-z0-9+/_-]+={0,2}")
_PRIVATE_REFUSAL = (
    "a node agent only verifies signatures and takes the mirror's Ed25519 PUBLIC key (PEM "
    "`PUBLIC KEY`: the chart's ConfigMap kai-fractions-signing-public, or `kai-fractions "
    "signing-keys public FILE`). A private key on a node could sign allocations, and only the "
    "mirror may hold one: remove it from this node")


def _der_private_key(der: bytes) -> bool:
    """Whether `der` is a DER private key (PKCS8, encrypted PKCS8, or a traditional RSA, EC or
    DSA key) as `cryptography` reads one. Only ValueError means "not a private key": a
    structure that parses as one but is encrypted or of an unsupported type counts as one."""
    if not der.startswith(b"\x30"):
        # Each of them is a DER SEQUENCE; this spares an agent that holds only HMAC keys the
        # library (see load_ed25519).
        return False
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization

    try:
        serialization.load_der_private_key(der, password=None)
    except ValueError:
        return False
    except TypeError as e:  # "Password was not given but private key is encrypted"
        return "encrypted" in str(e).lower()
    except UnsupportedAlgorithm:
        return True
    return True


def _jwk_private_key(material: bytes) -> bool:
    """Whether `material` is a JSON Web Key (or a key set) with a private member `d`."""
    try:
        value = json.loads(material.decode("utf-8-sig"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return False
    keys = value.get("keys") if isinstance(value, dict) else None
    candidates = [value, *keys] if isinstance(keys, list) else [value]
    return any(isinstance(key, dict) and "d" in key for key in candidates)


def _private_key_form(material: bytes, *, decoded: bool = False) -> str | None:
    """How `material` holds a private key ("PEM", "DER", "JWK"; "base64 ..." when it does so
    after a base64 decode of its text), or None. Not told apart: a raw 32-byte Ed25519 seed,
    which is as random as an HMAC key."""
    if _ANY_PRIVATE_PEM.search(material):
        return "PEM"
    if _jwk_private_key(material):
        return "JWK"
    if _der_private_key(material):
        return "DER"
    if decoded:
        return None
    # The text of a DER key in base64 (a PEM body without its lines, a Secret's `data` value):
    # decoded once, the same checks. Random bytes, or the base64 of random bytes (a printable
    # HMAC key), do not decode to any of these.
    compact = re.sub(rb"\s+", b"", material.removeprefix(_BOM))
    if compact.startswith(b"-----") or not _BASE64.fullmatch(compact):  # PEM, or not base64
        return None
    text = compact.rstrip(b"=").replace(b"-", b"+").replace(b"_", b"/")
    try:
        raw = base64.b64decode(text + b"=" * (-len(text) % 4), validate=True)
    except (binascii.Error, ValueError):
        return None
    form = _private_key_form(raw, decoded=True)
    return f"base64 {form}" if form else None


_EXPECTED = {
    KeyFile.ANY: (
        f"a signing key is an Ed25519 key in PEM ({_PRIVATE_PEM.decode()} on the mirror, "
        f"{_PUBLIC_PEM.decode()} on nodes: `kai-fractions signing-keys`) or the raw bytes of "
        "an HMAC key"),
    KeyFile.PUBLIC: (
        "a node agent's --signing-key-file holds only the mirror's Ed25519 public keys (PEM "
        f"{_PUBLIC_PEM.decode()}: the chart's ConfigMap kai-fractions-signing-public, or "
        "`kai-fractions signing-keys public FILE`), never an HMAC key: text put there would "
        "become a key that whoever wrote it could sign allocations with. A legacy HMAC key (the "
        f"Secret of the releases that signed with HMAC) is given with {HMAC_FLAG}"),
    KeyFile.HMAC: (
        f"{HMAC_FLAG} takes the raw bytes of a legacy HMAC key (the Secret of the releases "
        f"that signed with HMAC); an Ed25519 public key is given with {KEY_FLAG}"),
}
"""What a file given by each flag must hold, for the refusal of one that does not."""


def _read_key(path: Path, *, verify_only: bool = False, kind: KeyFile = KeyFile.ANY) -> AnyKey:
    """The key in `path`, as the flag that gave it (`kind`) allows. Raises SigningConfigError
    naming the flag, the file and the rule."""
    where = f"{kind.flag} {path}"
    try:
        material = path.read_bytes()
    except OSError as e:
        raise SigningConfigError(f"{where}: {e.strerror or e}") from None
    if verify_only:
        form = _private_key_form(material)
        if form is not None:
            # Refused before it is parsed: nothing (not even its key id) is derived from it.
            shown = "" if form == "PEM" else f" ({form})"
            raise SigningConfigError(f"{where}: a private key{shown}; {_PRIVATE_REFUSAL}")
    text = material.removeprefix(_BOM).lstrip()
    if text.startswith((_PRIVATE_PEM, _PUBLIC_PEM)) and kind is not KeyFile.HMAC:
        return load_ed25519(material, str(path))
    if text[:len(_PEM_BEGIN)].upper() == _PEM_BEGIN:
        # Any other PEM (an RSA or EC key, a certificate, a header in lower case) was once
        # taken as the raw bytes of an HMAC key: the mirror signed v1 with the PEM's text and
        # no node could verify it. A PEM header is never secret, so it is shown.
        header = text.split(b"\n", 1)[0].strip()[:80].decode("ascii", "replace")
        raise SigningConfigError(f"{where}: a PEM file that starts {header!r}; "
                                 f"{_EXPECTED[kind]}")
    if kind is KeyFile.PUBLIC:
        # Never read as an HMAC key, whatever its size: the ConfigMap is no Secret, and its
        # content is not shown (it may be a secret put in the wrong place).
        raise SigningConfigError(f"{where}: not a PEM public key ({len(material)} byte(s), "
                                 f"not shown); {_EXPECTED[kind]}")
    # Raw bytes, verbatim: an HMAC key (a trailing newline is key material too; both sides
    # read the same bytes).
    return SigningKey(material, str(path))


def load_ed25519(pem: bytes, source: str = "", *, what: str = "") -> Ed25519Key:
    """An Ed25519 key from PEM: a private key (PKCS8) signs and verifies, a public key
    (SubjectPublicKeyInfo) only verifies. Raises SigningConfigError."""
    # Imported here: an agent without Ed25519 keys (HMAC, or no signing) does not load the
    # library (several MB of memory).
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    where = what or (f"--signing-key-file {source}" if source else "signing key")
    pem = pem.removeprefix(_BOM)  # saved by an editor that writes one
    blocks = pem.count(b"-----BEGIN ")
    if blocks > 1:
        # The PEM reader takes the first block and drops the rest unseen: a key appended by hand
        # (a "rotation" by concatenation) would be missing, and its pods refused, with no word.
        raise SigningConfigError(f"{where}: holds {blocks} PEM blocks; one key per file (in a "
                                 "rotation the old key goes in `previous`)")
    try:
        if pem.lstrip().startswith(_PRIVATE_PEM):
            private = serialization.load_pem_private_key(pem, password=None)
            if not isinstance(private, ed25519.Ed25519PrivateKey):
                raise SigningConfigError(f"{where}: a {type(private).__name__}; an Ed25519 "
                                         "key is needed (`kai-fractions signing-keys`)")
            return Ed25519Key(private.public_key(), private, source)
        public = serialization.load_pem_public_key(pem)
    except (ValueError, TypeError) as e:
        raise SigningConfigError(f"{where}: not a usable PEM key ({e})") from None
    if not isinstance(public, ed25519.Ed25519PublicKey):
        raise SigningConfigError(f"{where}: a {type(public).__name__}; an Ed25519 key is "
                                 "needed (`kai-fractions signing-keys`)")
    return Ed25519Key(public, None, source)


def _entries(path: str, flag: str = KEY_FLAG) -> list[Path]:
    """The key files one `--signing-key-file` (or `flag`) names: the file, or a directory's
    `current` (required) and `previous` (optional)."""
    p = Path(path)
    if p.is_dir():
        current, previous = p / CURRENT, p / PREVIOUS
        if not current.exists():
            raise SigningConfigError(f"{flag} {path}: a key directory needs a file named "
                                     f"{CURRENT!r} (and may have {PREVIOUS!r})")
        return [current, previous] if previous.exists() else [current]
    if not p.exists():
        raise SigningConfigError(f"{flag} {path}: no such file or directory")
    return [p]
