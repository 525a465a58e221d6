"""Signed allocations: the mirror signs what a node will enforce; the node agent checks it.

Why: admission is the only thing that keeps users from writing the annotations a node enforces,
and a webhook with `failurePolicy: Ignore` (or one that is down, or a user key such as
`.gpu-memory.limit` edited on a running pod) lets a forged or edited allocation through. With
signing, the node agent applies an allocation only when the mirror's signature over it holds.

The keys themselves (HMAC-SHA256 for v1, Ed25519 for v2, and who holds which) are
`signing_key_types`'s; reading them from key files, `signing_key_files`'s. This module owns what
is signed, the annotation that carries it, and the keyring that signs and verifies with those
keys (loaded from the key files, and reloaded when they change).

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
import json
import logging
import os
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from .contract import ContainerPlan, Keys
from .contract import keys as k
from .signing_key_files import (  # noqa: F401  (_private_key_form: re-exported for the tests)
    CURRENT,
    PREVIOUS,
    KeyFile,
    _entries,
    _private_key_form,
    _read_key,
    load_ed25519,
)
from .signing_key_types import V1, V2, AnyKey, Ed25519Key, SigningConfigError, SigningKey

# The key types and the key file names and loader are re-exported: the mirror, the node agent,
# the CLI and the tests import them from here.
__all__ = [
    "CURRENT",
    "PREVIOUS",
    "V1",
    "V2",
    "AnyKey",
    "Ed25519Key",
    "Keyring",
    "KeyringSource",
    "Reason",
    "Signature",
    "SignatureFormatError",
    "SigningConfigError",
    "SigningKey",
    "Verification",
    "allocation_claims",
    "load_ed25519",
    "load_keyring",
    "parse_signature",
    "signature_key",
]

log = logging.getLogger(__name__)

VERSION = V2
CLAIMS_DOMAIN = "kai-fractions.io/allocation"
MAC_BYTES = 32
ED25519_BYTES = 64
_KID = re.compile(r"[0-9a-f]{8}")
_B64URL = {V1: re.compile(r"[A-Za-z0-9_-]{43}"), V2: re.compile(r"[A-Za-z0-9_-]{86}")}
_SIG_BYTES = {V1: MAC_BYTES, V2: ED25519_BYTES}
_ALGORITHM = {V1: "HMAC-SHA256", V2: "Ed25519"}
MAX_SIGNATURE_LENGTH = 128


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


# -- the annotation ----------------------------------------------------------------------------


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
        # The same key given twice counts once (the first: a private key before its public
        # half). Two different keys whose `kid`s collide both stay: verify tries each.
        unique: dict[tuple[str, str], AnyKey] = {}
        for key in self.keys:
            unique.setdefault((key.version, key.fingerprint), key)
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
        named = [key for key in self.keys
                 if key.kid == signature.kid and key.version == signature.version]
        if not named:
            return Verification(False, Reason.KEY_UNKNOWN, (
                f"annotation {annotation} was signed with {signature.version} key "
                f"{signature.kid}, which this node does not hold (it holds "
                f"{', '.join(self.kids)}): after a key rotation the mirror's new public key "
                "reaches the nodes within minutes (ConfigMap kai-fractions-signing-public, "
                "as the kubelet syncs it); if it never does, the key was rotated without "
                "keeping the old one as `previous`, or the mirror and the node agent use "
                "different keys"), signature.kid)
        claims = allocation_claims(plan, node if signature.version == V2 else None)
        if not any(key.verifies(claims, signature.mac) for key in named):
            where = f" for node {node}" if signature.version == V2 else ""
            return Verification(False, Reason.INVALID,
                                f"annotation {annotation} does not match the allocation"
                                f"{where}: {_EDITED}", signature.kid)
        return Verification(True, kid=signature.kid)


# -- the keyring from key files ----------------------------------------------------------------


def load_keyring(paths: Sequence[str], *, verify_only: bool = False,
                 hmac_paths: Sequence[str] = ()) -> Keyring:
    """Keys from `--signing-key-file` values (`paths`), then from `--signing-hmac-key-file`
    values (`hmac_paths`), in order: the first key found signs, every key verifies.

    With `verify_only` (the node agent) a private key of any kind is refused, not reduced to
    its public half, and `paths` hold PEM public keys only: anything else there is refused,
    never read as an HMAC key (the public-key ConfigMap is no Secret). HMAC keys come only from
    `hmac_paths`, which hold raw HMAC bytes only. Raises SigningConfigError."""
    if not paths and not hmac_paths:
        raise SigningConfigError("--signing-key-file: no key file given")
    keys = KeyFile.PUBLIC if verify_only else KeyFile.ANY
    given = [(path, keys) for path in paths] + [(path, KeyFile.HMAC) for path in hmac_paths]
    return Keyring(tuple(_read_key(entry, verify_only=verify_only, kind=kind)
                         for path, kind in given for entry in _entries(path, kind.flag)))


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

    def __init__(self, paths: Sequence[str], *, verify_only: bool = False,
                 hmac_paths: Sequence[str] = ()) -> None:
        self.paths = tuple(paths)
        self.hmac_paths = tuple(hmac_paths)
        """`load_keyring`'s: the legacy HMAC keys' files (`--signing-hmac-key-file`)."""
        self.verify_only = verify_only
        """`load_keyring`'s: a private key, or anything but a PEM public key in `paths`, put
        in the files later is refused too."""
        self._lock = threading.Lock()
        # fail at start, not at the first call
        self._keyring = self._load()
        self._stamp = _stamp(self._watched)
        self._refused: tuple[tuple, str] | None = None
        """The files' stamp and the message of the last refused reload: logged once."""

    @classmethod
    def fixed(cls, keyring: Keyring) -> KeyringSource:
        """A source that never reloads (tests, embedding)."""
        source = cls.__new__(cls)
        source.paths = source.hmac_paths = ()
        source.verify_only = False
        source._lock = threading.Lock()
        source._keyring = keyring
        source._stamp = ()
        source._refused = None
        return source

    @property
    def _watched(self) -> tuple[str, ...]:
        return self.paths + self.hmac_paths

    def _load(self) -> Keyring:
        return load_keyring(self.paths, verify_only=self.verify_only, hmac_paths=self.hmac_paths)

    def current(self) -> Keyring:
        if not self._watched:
            return self._keyring
        stamp = _stamp(self._watched)
        with self._lock:
            if stamp != self._stamp:
                try:
                    keyring = self._load()
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
