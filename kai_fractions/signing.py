"""Signed allocations: the mirror signs what a node will enforce; the node agent checks it.

Why: admission is the only thing that keeps users from writing the annotations a node enforces,
and a webhook with `failurePolicy: Ignore` (or one that is down, or a user key such as
`.gpu-memory.limit` edited on a running pod) lets a forged or edited allocation through. With
signing, the node agent applies an allocation only when the mirror's signature over it holds.

Two kinds of key, told apart by the key file:
- Ed25519 (v2, the default): the mirror holds the private key (PEM, `PRIVATE KEY`); nodes hold
  only the public key (PEM, `PUBLIC KEY`). A node, or anyone who can read what nodes hold,
  can check signatures but cannot make one.
- HMAC-SHA256 (v1, raw bytes): every holder can sign. Still verified for one release so that
  pods signed before an upgrade keep running; new signatures are v2 once the mirror has an
  Ed25519 key.

What is signed, per fractional container: the values the node enforces, taken from the
contract's `ContainerPlan` (the same function of the annotations on both sides), and in v2 the
node the allocation was made for:

    v2: ["kai-fractions.io/allocation", 2, <node>, <pod UID>, <container>, <devices, verbatim>,
         <compute mode>, <request MiB>, <limit MiB>, <active-thread percentage or null>]
    v1: the same without the node, with version 1

as compact JSON (an array: no key order to agree on, no separator a value could fake). A v2
signature made for one node does not verify on another.

The annotation (`kai-fractions.io/container.<c>.signature`, `keys.DERIVED_SIGNATURE`):

    v2;kid=<first 8 hex digits of sha256(raw public key)>;sig=<Ed25519, base64url, no padding>
    v1;kid=<first 8 hex digits of sha256(key)>;sig=<HMAC-SHA256, base64url, no padding>

Rotation with two keys active: sign with `current`; accept `current` or `previous`. `kid` only
picks the key to try; it is not trusted for anything else.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import logging
import os
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING

from .contract import ContainerPlan, Keys
from .contract import keys as k

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric import ed25519

log = logging.getLogger(__name__)

V1, V2 = "v1", "v2"
VERSION = V2
CLAIMS_DOMAIN = "kai-fractions.io/allocation"
MIN_KEY_BYTES = 16
"""HMAC-SHA256 keys shorter than this are refused."""
CURRENT, PREVIOUS = "current", "previous"
"""File names inside a `--signing-key-file` directory (the data keys of the Secret)."""
MAC_BYTES = 32
ED25519_BYTES = 64
_KID = re.compile(r"[0-9a-f]{8}")
_B64URL = {V1: re.compile(r"[A-Za-z0-9_-]{43}"), V2: re.compile(r"[A-Za-z0-9_-]{86}")}
_SIG_BYTES = {V1: MAC_BYTES, V2: ED25519_BYTES}
_ALGORITHM = {V1: "HMAC-SHA256", V2: "Ed25519"}
MAX_SIGNATURE_LENGTH = 128
_PRIVATE_PEM = b"-----BEGIN PRIVATE KEY-----"
_PUBLIC_PEM = b"-----BEGIN PUBLIC KEY-----"


class SigningConfigError(Exception):
    """A key file that cannot be used; one line for the user (the CLI exits 2)."""


class SignatureFormatError(ValueError):
    """The signature annotation is not `v2|v1;kid=<8 hex>;sig=<base64url>`; says what is
    wrong."""


class Reason(StrEnum):
    """Refusal reasons (marker, events): a missing signature is told apart from a bad one."""

    MISSING = "SignatureMissing"
    INVALID = "SignatureInvalid"
    KEY_UNKNOWN = "SignatureKeyUnknown"
    """Signed with a key this node does not hold (yet): right after a rotation the mirror signs
    with its new key a minute or two before the node agents have its public half."""


# -- what is signed ----------------------------------------------------------------------------


def allocation_claims(plan: ContainerPlan, node: str | None = None) -> bytes:
    """The canonical bytes a signature covers (see the module docstring): v2 with a node,
    v1 (HMAC, no node) without one."""
    head: list = [CLAIMS_DOMAIN, 1] if node is None else [CLAIMS_DOMAIN, 2, node]
    return json.dumps(
        [*head, plan.pod_identity, plan.container, plan.devices_value,
         plan.compute_mode.value, plan.request_mib, plan.limit_mib,
         plan.active_thread_percentage],
        separators=(",", ":"), ensure_ascii=True,
    ).encode()


def signature_key(plan: ContainerPlan, keys: Keys = k.DEFAULT_KEYS) -> str:
    """The annotation that carries `plan`'s signature."""
    return keys.derived(plan.container, k.DERIVED_SIGNATURE)


# -- keys --------------------------------------------------------------------------------------


def key_id(material: bytes) -> str:
    return hashlib.sha256(material).hexdigest()[:8]


@dataclass(frozen=True, slots=True)
class SigningKey:
    """An HMAC-SHA256 key (v1): signs and verifies. Kept for one release of upgrades."""

    secret: bytes = field(repr=False)
    source: str = ""
    """Where it was read from (for messages; never the key itself)."""
    kid: str = field(init=False, default="")
    """Computed once: every verification looks the key up by it."""
    version = V1

    def __post_init__(self) -> None:
        if len(self.secret) < MIN_KEY_BYTES:
            raise SigningConfigError(
                f"signing key {self.source or '(inline)'}: {len(self.secret)} byte(s); an "
                f"HMAC-SHA256 key needs at least {MIN_KEY_BYTES} (better: an Ed25519 key "
                "pair from `kai-fractions signing-keys`)")
        object.__setattr__(self, "kid", key_id(self.secret))

    @property
    def can_sign(self) -> bool:
        return True

    def mac(self, claims: bytes) -> bytes:
        return hmac.new(self.secret, claims, hashlib.sha256).digest()

    def sign(self, claims: bytes) -> bytes:
        return self.mac(claims)

    def verifies(self, claims: bytes, signature: bytes) -> bool:
        return hmac.compare_digest(self.mac(claims), signature)


@dataclass(frozen=True, slots=True)
class Ed25519Key:
    """An Ed25519 key (v2): the private one signs (the mirror), the public one verifies
    (nodes)."""

    public: ed25519.Ed25519PublicKey = field(repr=False)
    private: ed25519.Ed25519PrivateKey | None = field(default=None, repr=False)
    source: str = ""
    kid: str = field(init=False, default="")
    """Computed once: every verification looks the key up by it."""
    version = V2

    def __post_init__(self) -> None:
        from cryptography.hazmat.primitives import serialization

        object.__setattr__(self, "kid", key_id(self.public.public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw)))

    @classmethod
    def generate(cls) -> Ed25519Key:
        from cryptography.hazmat.primitives.asymmetric import ed25519

        private = ed25519.Ed25519PrivateKey.generate()
        return cls(private.public_key(), private)

    @property
    def can_sign(self) -> bool:
        return self.private is not None

    def sign(self, claims: bytes) -> bytes:
        if self.private is None:
            raise SigningConfigError(f"signing key {self.kid} is a public key: only the "
                                     "mirror, which holds the private key, signs")
        return self.private.sign(claims)

    def verifies(self, claims: bytes, signature: bytes) -> bool:
        from cryptography.exceptions import InvalidSignature

        try:
            self.public.verify(signature, claims)
        except InvalidSignature:
            return False
        return True

    def public_pem(self) -> bytes:
        from cryptography.hazmat.primitives import serialization

        return self.public.public_bytes(serialization.Encoding.PEM,
                                        serialization.PublicFormat.SubjectPublicKeyInfo)

    def private_pem(self) -> bytes:
        if self.private is None:
            raise SigningConfigError(f"key {self.kid} has no private half")
        from cryptography.hazmat.primitives import serialization

        return self.private.private_bytes(serialization.Encoding.PEM,
                                          serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption())


AnyKey = SigningKey | Ed25519Key


@dataclass(frozen=True, slots=True)
class Signature:
    kid: str
    mac: bytes = field(repr=False)
    version: str = V1

    def encode(self) -> str:
        sig = base64.urlsafe_b64encode(self.mac).rstrip(b"=").decode()
        return f"{self.version};kid={self.kid};sig={sig}"


def parse_signature(value: str) -> Signature:
    """`v2|v1;kid=<8 hex>;sig=<base64url>` -> Signature; raises SignatureFormatError."""
    if not isinstance(value, str):
        raise SignatureFormatError("must be a string")
    if len(value) > MAX_SIGNATURE_LENGTH:
        raise SignatureFormatError(f"is {len(value)} characters long; a signature has "
                                   f"at most {MAX_SIGNATURE_LENGTH}")
    parts = value.split(";")
    if len(parts) != 3:
        raise SignatureFormatError(f"expected {VERSION};kid=<key id>;sig=<signature> "
                                   f"(3 fields separated by ';'), got {len(parts)} field(s)")
    version, kid_field, sig_field = parts
    if version not in _B64URL:
        raise SignatureFormatError(f"version {version!r} is not {V2!r} (or {V1!r})")
    name, eq, kid = kid_field.partition("=")
    if name != "kid" or not eq or not _KID.fullmatch(kid):
        raise SignatureFormatError("the second field must be kid=<8 lowercase hex digits>")
    name, eq, sig = sig_field.partition("=")
    size = _SIG_BYTES[version]
    if name != "sig" or not eq or not _B64URL[version].fullmatch(sig):
        raise SignatureFormatError(f"the third field must be sig=<{len(_b64(bytes(size)))} "
                                   f"base64url characters ({_ALGORITHM[version]}, no padding)>")
    try:
        mac = base64.urlsafe_b64decode(sig + "=" * (-len(sig) % 4))
    except (binascii.Error, ValueError):  # pragma: no cover - the pattern admits only valid
        raise SignatureFormatError("sig is not base64url") from None
    if len(mac) != size or _b64(mac) != sig:
        # The last character carries spare bits that must be zero, so that one signature has
        # exactly one spelling.
        raise SignatureFormatError(f"sig is not the canonical base64url of {size} bytes")
    return Signature(kid, mac, version)


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


# -- verdicts ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Verification:
    ok: bool
    reason: str = ""
    """"" when ok, else a `Reason` value."""
    message: str = ""
    """One sentence a user can act on (empty when ok)."""
    kid: str = ""


_EDITED = ("the pod's GPU annotations (devices, memory request or limit, compute mode or "
           "portion) were changed after the kai-fractions mirror signed them, or were written "
           "by someone else; nothing is applied: delete the pod so the scheduler binds it again")


@dataclass(frozen=True, slots=True)
class Keyring:
    """The signing key (`current`) first, then every other key still accepted (`previous`)."""

    keys: tuple[AnyKey, ...]

    def __post_init__(self) -> None:
        if not self.keys:
            raise SigningConfigError("no signing key")
        unique: dict[str, AnyKey] = {}
        for key in self.keys:
            unique.setdefault(key.kid, key)
        object.__setattr__(self, "keys", tuple(unique.values()))

    @classmethod
    def of(cls, *keys: bytes | AnyKey) -> Keyring:
        """Raw bytes are HMAC keys (v1); key objects are taken as they are."""
        return cls(tuple(SigningKey(x) if isinstance(x, bytes) else x for x in keys))

    @property
    def current(self) -> AnyKey:
        return self.keys[0]

    @property
    def kids(self) -> tuple[str, ...]:
        return tuple(key.kid for key in self.keys)

    def sign(self, plan: ContainerPlan, node: str = "") -> str:
        """The signature annotation for `plan` on `node`: v2 with an Ed25519 key (the node is
        part of what is signed), v1 with an HMAC key."""
        key = self.current
        claims = allocation_claims(plan, node if key.version == V2 else None)
        return Signature(key.kid, key.sign(claims), key.version).encode()

    def verify(self, plan: ContainerPlan, value: str | None,
               keys: Keys = k.DEFAULT_KEYS, node: str = "") -> Verification:
        """Whether `value` signs `plan` for `node` under one of these keys."""
        annotation = signature_key(plan, keys)
        if value is None or value == "":
            return Verification(False, Reason.MISSING, (
                f"annotation {annotation} is missing: this node applies only allocations "
                "signed by the kai-fractions mirror, and waits for it (with an unmodified KAI "
                "the mirror's BindRequest follower signs once it has checked the binder's "
                "annotations); if it never comes, look for NvFractionsMismatch events on the "
                "pod and check that the mirror runs with --signing-key-file (and "
                "--follow-bindrequests for an unmodified KAI)"))
        try:
            signature = parse_signature(value)
        except SignatureFormatError as e:
            return Verification(False, Reason.INVALID,
                                f"annotation {annotation} is malformed ({e}); {_EDITED}")
        key = next((key for key in self.keys if key.kid == signature.kid
                    and key.version == signature.version), None)
        if key is None:
            return Verification(False, Reason.KEY_UNKNOWN, (
                f"annotation {annotation} was signed with {signature.version} key "
                f"{signature.kid}, which this node does not hold (it holds "
                f"{', '.join(self.kids)}): after a key rotation the mirror's new public key "
                "reaches the nodes within minutes (ConfigMap kai-fractions-signing-public, "
                "as the kubelet syncs it); if it never does, the key was rotated without "
                "keeping the old one as `previous`, or the mirror and the node agent use "
                "different keys"), signature.kid)
        claims = allocation_claims(plan, node if signature.version == V2 else None)
        if not key.verifies(claims, signature.mac):
            where = f" for node {node}" if signature.version == V2 else ""
            return Verification(False, Reason.INVALID,
                                f"annotation {annotation} does not match the allocation"
                                f"{where}: {_EDITED}", signature.kid)
        return Verification(True, kid=signature.kid)


# -- key files ---------------------------------------------------------------------------------


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


def _read_key(path: Path, *, verify_only: bool = False) -> AnyKey:
    try:
        material = path.read_bytes()
    except OSError as e:
        raise SigningConfigError(f"--signing-key-file {path}: {e.strerror or e}") from None
    if verify_only:
        form = _private_key_form(material)
        if form is not None:
            # Refused before it is parsed: nothing (not even its key id) is derived from it.
            shown = "" if form == "PEM" else f" ({form})"
            raise SigningConfigError(f"--signing-key-file {path}: a private key{shown}; "
                                     f"{_PRIVATE_REFUSAL}")
    if material.removeprefix(_BOM).lstrip().startswith((_PRIVATE_PEM, _PUBLIC_PEM)):
        return load_ed25519(material, str(path))
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


def _entries(path: str) -> list[Path]:
    """The key files one `--signing-key-file` names: the file, or a directory's `current`
    (required) and `previous` (optional)."""
    p = Path(path)
    if p.is_dir():
        current, previous = p / CURRENT, p / PREVIOUS
        if not current.exists():
            raise SigningConfigError(f"--signing-key-file {path}: a key directory needs a "
                                     f"file named {CURRENT!r} (and may have {PREVIOUS!r})")
        return [current, previous] if previous.exists() else [current]
    if not p.exists():
        raise SigningConfigError(f"--signing-key-file {path}: no such file or directory")
    return [p]


def load_keyring(paths: Sequence[str], *, verify_only: bool = False) -> Keyring:
    """Keys from `--signing-key-file` values, in order: the first key found signs, every key
    verifies. With `verify_only` (the node agent) a private key of any kind is refused, not
    reduced to its public half. Raises SigningConfigError."""
    if not paths:
        raise SigningConfigError("--signing-key-file: no key file given")
    return Keyring(tuple(_read_key(entry, verify_only=verify_only)
                         for path in paths for entry in _entries(path)))


def _stamp(paths: Sequence[str]) -> tuple:
    out = []
    for path in paths:
        for name in ("", CURRENT, PREVIOUS):
            target = os.path.join(path, name) if name else path
            try:
                st = os.stat(target)  # follows the Secret volume's ..data symlinks
            except OSError:
                out.append(None)
                continue
            out.append((st.st_ino, st.st_mtime_ns, st.st_size))
    return tuple(out)


class KeyringSource:
    """The keyring from key files, re-read when they change (a rotated Secret takes effect
    without a restart). A broken update keeps the last good keyring and logs why: a Secret
    volume caught mid-update must not stop signing or verifying."""

    def __init__(self, paths: Sequence[str], *, verify_only: bool = False) -> None:
        self.paths = tuple(paths)
        self.verify_only = verify_only
        """`load_keyring`'s: a private key put in the files later is refused too."""
        self._lock = threading.Lock()
        # fail at start, not at the first call
        self._keyring = load_keyring(self.paths, verify_only=verify_only)
        self._stamp = _stamp(self.paths)
        self._refused: tuple[tuple, str] | None = None
        """The files' stamp and the message of the last refused reload: logged once."""

    @classmethod
    def fixed(cls, keyring: Keyring) -> KeyringSource:
        """A source that never reloads (tests, embedding)."""
        source = cls.__new__(cls)
        source.paths = ()
        source.verify_only = False
        source._lock = threading.Lock()
        source._keyring = keyring
        source._stamp = ()
        source._refused = None
        return source

    def current(self) -> Keyring:
        if not self.paths:
            return self._keyring
        stamp = _stamp(self.paths)
        with self._lock:
            if stamp != self._stamp:
                try:
                    keyring = load_keyring(self.paths, verify_only=self.verify_only)
                except SigningConfigError as e:
                    # The stamp stays old: the next call tries again (a read that raced the
                    # kubelet's update succeeds then). Logged once per files' state and reason,
                    # not on every call (every plan pass) while the files stay so.
                    if self._refused != (stamp, str(e)):
                        self._refused = (stamp, str(e))
                        log.warning("keeping the previous signing keys: %s", e)
                    return self._keyring
                if keyring.kids != self._keyring.kids:
                    log.info("signing keys reloaded: %s", ", ".join(keyring.kids))
                self._keyring, self._stamp, self._refused = keyring, stamp, None
            return self._keyring
