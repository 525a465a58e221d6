"""Signed allocations: the mirror signs what a node will enforce; the node agent checks it.

Why: admission is the only thing that keeps users from writing the annotations a node enforces,
and a webhook with `failurePolicy: Ignore` (or one that is down, or a user key such as
`.gpu-memory.limit` edited on a running pod) lets a forged or edited allocation through. With
signing, the node agent applies an allocation only when the mirror's HMAC over it is valid.

What is signed, per fractional container: the values the node enforces, taken from the
contract's `ContainerPlan` (the same function of the annotations on both sides):

    ["kai-fractions.io/allocation", 1, <pod UID>, <container>, <devices, verbatim>,
     <compute mode>, <request MiB>, <limit MiB>, <active-thread percentage or null>]

as compact JSON (an array: no key order to agree on, no separator a value could fake). The
compute portion enters as the active-thread percentage the node enforces (round(portion x 100));
memory as the whole MiB the limits and env carry. Two sets of annotations that sign the same
are enforced identically.

The annotation (`kai-fractions.io/container.<c>.signature`, `keys.DERIVED_SIGNATURE`):

    v1;kid=<first 8 hex digits of sha256(key)>;sig=<HMAC-SHA256, base64url without padding>

Keys: raw bytes (the chart's Secret `kai-fractions-signing` holds 32 random bytes under
`current`). Rotation with two keys active: sign with `current`; accept `current` or `previous`.
`kid` only picks the key to try; it is not trusted for anything else.
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

from .contract import ContainerPlan, Keys
from .contract import keys as k

log = logging.getLogger(__name__)

VERSION = "v1"
CLAIMS_DOMAIN = "kai-fractions.io/allocation"
CLAIMS_VERSION = 1
MIN_KEY_BYTES = 16
"""HMAC-SHA256 keys shorter than this are refused (the chart generates 32 bytes)."""
CURRENT, PREVIOUS = "current", "previous"
"""File names inside a `--signing-key-file` directory (the data keys of the Secret)."""
MAC_BYTES = 32
_KID = re.compile(r"[0-9a-f]{8}")
_B64URL = re.compile(r"[A-Za-z0-9_-]{43}")  # 32 bytes, unpadded
MAX_SIGNATURE_LENGTH = 128


class SigningConfigError(Exception):
    """A key file that cannot be used; one line for the user (the CLI exits 2)."""


class SignatureFormatError(ValueError):
    """The signature annotation is not `v1;kid=<8 hex>;sig=<base64url>`; says what is wrong."""


class Reason(StrEnum):
    """Refusal reasons (marker, events): a missing signature is told apart from a bad one."""

    MISSING = "SignatureMissing"
    INVALID = "SignatureInvalid"


# -- what is signed ----------------------------------------------------------------------------


def allocation_claims(plan: ContainerPlan) -> bytes:
    """The canonical bytes the HMAC covers (see the module docstring)."""
    return json.dumps(
        [CLAIMS_DOMAIN, CLAIMS_VERSION, plan.pod_identity, plan.container, plan.devices_value,
         plan.compute_mode.value, plan.request_mib, plan.limit_mib,
         plan.active_thread_percentage],
        separators=(",", ":"), ensure_ascii=True,
    ).encode()


def signature_key(plan: ContainerPlan, keys: Keys = k.DEFAULT_KEYS) -> str:
    """The annotation that carries `plan`'s signature."""
    return keys.derived(plan.container, k.DERIVED_SIGNATURE)


# -- keys --------------------------------------------------------------------------------------


def key_id(secret: bytes) -> str:
    return hashlib.sha256(secret).hexdigest()[:8]


@dataclass(frozen=True, slots=True)
class SigningKey:
    secret: bytes = field(repr=False)
    source: str = ""
    """Where it was read from (for messages; never the key itself)."""

    def __post_init__(self) -> None:
        if len(self.secret) < MIN_KEY_BYTES:
            raise SigningConfigError(
                f"signing key {self.source or '(inline)'}: {len(self.secret)} byte(s); an "
                f"HMAC-SHA256 key needs at least {MIN_KEY_BYTES} (the chart makes 32 random "
                "bytes)")

    @property
    def kid(self) -> str:
        return key_id(self.secret)

    def mac(self, claims: bytes) -> bytes:
        return hmac.new(self.secret, claims, hashlib.sha256).digest()


@dataclass(frozen=True, slots=True)
class Signature:
    kid: str
    mac: bytes = field(repr=False)

    def encode(self) -> str:
        sig = base64.urlsafe_b64encode(self.mac).rstrip(b"=").decode()
        return f"{VERSION};kid={self.kid};sig={sig}"


def parse_signature(value: str) -> Signature:
    """`v1;kid=<8 hex>;sig=<43 base64url chars>` -> Signature; raises SignatureFormatError."""
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
    if version != VERSION:
        raise SignatureFormatError(f"version {version!r} is not {VERSION!r}")
    name, eq, kid = kid_field.partition("=")
    if name != "kid" or not eq or not _KID.fullmatch(kid):
        raise SignatureFormatError("the second field must be kid=<8 lowercase hex digits>")
    name, eq, sig = sig_field.partition("=")
    if name != "sig" or not eq or not _B64URL.fullmatch(sig):
        raise SignatureFormatError("the third field must be sig=<43 base64url characters "
                                   "(HMAC-SHA256, no padding)>")
    try:
        mac = base64.urlsafe_b64decode(sig + "=")
    except (binascii.Error, ValueError):  # pragma: no cover - the pattern admits only valid
        raise SignatureFormatError("sig is not base64url") from None
    if len(mac) != MAC_BYTES or base64.urlsafe_b64encode(mac).rstrip(b"=").decode() != sig:
        # 43 characters carry 258 bits: the last one must leave the 2 spare bits zero, so that
        # one signature has exactly one spelling.
        raise SignatureFormatError("sig is not the canonical base64url of 32 bytes")
    return Signature(kid, mac)


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

    keys: tuple[SigningKey, ...]

    def __post_init__(self) -> None:
        if not self.keys:
            raise SigningConfigError("no signing key")
        unique: dict[str, SigningKey] = {}
        for key in self.keys:
            unique.setdefault(key.kid, key)
        object.__setattr__(self, "keys", tuple(unique.values()))

    @classmethod
    def of(cls, *secrets: bytes) -> Keyring:
        return cls(tuple(SigningKey(s) for s in secrets))

    @property
    def current(self) -> SigningKey:
        return self.keys[0]

    @property
    def kids(self) -> tuple[str, ...]:
        return tuple(key.kid for key in self.keys)

    def sign(self, plan: ContainerPlan) -> str:
        key = self.current
        return Signature(key.kid, key.mac(allocation_claims(plan))).encode()

    def verify(self, plan: ContainerPlan, value: str | None,
               keys: Keys = k.DEFAULT_KEYS) -> Verification:
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
        key = next((key for key in self.keys if key.kid == signature.kid), None)
        if key is None:
            return Verification(False, Reason.INVALID, (
                f"annotation {annotation} was signed with key {signature.kid}, which this node "
                f"does not hold (it holds {', '.join(self.kids)}): the signing key was rotated "
                "without keeping the old one as `previous`, or the mirror and the node agent "
                "use different keys"), signature.kid)
        if not hmac.compare_digest(key.mac(allocation_claims(plan)), signature.mac):
            return Verification(False, Reason.INVALID,
                                f"annotation {annotation} does not match the allocation: "
                                f"{_EDITED}", signature.kid)
        return Verification(True, kid=signature.kid)


# -- key files ---------------------------------------------------------------------------------


def _read_key(path: Path) -> SigningKey:
    try:
        secret = path.read_bytes()
    except OSError as e:
        raise SigningConfigError(f"--signing-key-file {path}: {e.strerror or e}") from None
    # Raw bytes, verbatim: the Secret's value is the key (a trailing newline is key material
    # too; both sides read the same bytes).
    return SigningKey(secret, str(path))


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


def load_keyring(paths: Sequence[str]) -> Keyring:
    """Keys from `--signing-key-file` values, in order: the first key found signs, every key
    verifies. Raises SigningConfigError."""
    if not paths:
        raise SigningConfigError("--signing-key-file: no key file given")
    return Keyring(tuple(_read_key(entry) for path in paths for entry in _entries(path)))


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

    def __init__(self, paths: Sequence[str]) -> None:
        self.paths = tuple(paths)
        self._lock = threading.Lock()
        self._keyring = load_keyring(self.paths)  # fail at start, not at the first call
        self._stamp = _stamp(self.paths)

    @classmethod
    def fixed(cls, keyring: Keyring) -> KeyringSource:
        """A source that never reloads (tests, embedding)."""
        source = cls.__new__(cls)
        source.paths = ()
        source._lock = threading.Lock()
        source._keyring = keyring
        source._stamp = ()
        return source

    def current(self) -> Keyring:
        if not self.paths:
            return self._keyring
        stamp = _stamp(self.paths)
        with self._lock:
            if stamp != self._stamp:
                try:
                    keyring = load_keyring(self.paths)
                except SigningConfigError as e:
                    # The stamp stays old: the next call tries again (a read that raced the
                    # kubelet's update succeeds then).
                    log.warning("keeping the previous signing keys: %s", e)
                    return self._keyring
                if keyring.kids != self._keyring.kids:
                    log.info("signing keys reloaded: %s", ", ".join(keyring.kids))
                self._keyring, self._stamp = keyring, stamp
            return self._keyring
