"""The allocation signing keys: an HMAC-SHA256 key (v1) and an Ed25519 key (v2).

Separate from `signing` (what is signed, the annotation's format, the keyring that signs and
verifies) and from `signing_key_files` (reading a key from a file): a key is the same object
whichever file it came from, and signs or checks bytes without knowing what they claim.

Two kinds of key, told apart by the key file:
- Ed25519 (v2, the default): the mirror holds the private key (PEM, `PRIVATE KEY`); nodes hold
  only the public key (PEM, `PUBLIC KEY`). A node, or anyone who can read what nodes hold,
  can check signatures but cannot make one.
- HMAC-SHA256 (v1, raw bytes): every holder can sign. Still verified for one release so that
  pods signed before an upgrade keep running; new signatures are v2 once the mirror has an
  Ed25519 key.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric import ed25519

V1, V2 = "v1", "v2"
MIN_KEY_BYTES = 16
"""HMAC-SHA256 keys shorter than this are refused."""


class SigningConfigError(Exception):
    """A key file that cannot be used; one line for the user (the CLI exits 2)."""


def digest(material: bytes) -> str:
    """What tells two keys apart; `kid` is its first 8 digits, which two keys may share."""
    return hashlib.sha256(material).hexdigest()


@dataclass(frozen=True, slots=True)
class SigningKey:
    """An HMAC-SHA256 key (v1): signs and verifies. Kept for one release of upgrades."""

    secret: bytes = field(repr=False)
    source: str = ""
    """Where it was read from (for messages; never the key itself)."""
    kid: str = field(init=False, default="")
    """Computed once: every verification looks the key up by it."""
    fingerprint: str = field(init=False, default="", repr=False)
    version = V1

    def __post_init__(self) -> None:
        if len(self.secret) < MIN_KEY_BYTES:
            raise SigningConfigError(
                f"signing key {self.source or '(inline)'}: {len(self.secret)} byte(s); an "
                f"HMAC-SHA256 key needs at least {MIN_KEY_BYTES} (better: an Ed25519 key "
                "pair from `kai-fractions signing-keys`)")
        object.__setattr__(self, "fingerprint", digest(self.secret))
        object.__setattr__(self, "kid", self.fingerprint[:8])

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
    fingerprint: str = field(init=False, default="", repr=False)
    version = V2

    def __post_init__(self) -> None:
        from cryptography.hazmat.primitives import serialization

        object.__setattr__(self, "fingerprint", digest(self.public.public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw)))
        object.__setattr__(self, "kid", self.fingerprint[:8])

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
