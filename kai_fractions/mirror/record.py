"""What the mirror wrote on a pod: the `kai-fractions.io/mirrored` record.

Why it exists: after the first mirror the pod carries a `.gpu-memory.request` that the MIRROR
wrote. Read back naively it looks user-given, and a user-given request is never overwritten, so a
rebind to another portion would keep the old memory. The record lists every key the mirror owns on
the pod, so a recomputation first strips exactly those keys and sees the pod as the user wrote it.
It also carries the pod UID it was written for (a recreated pod's stale record is ignored), the
digest of the written allocation (an identical repeat is a no-op, a different one is a conflict),
the caller's idempotency key, the keys of later calls that repeated the same allocation (each
was answered OK for it), and the keys of the allocations it replaced (a late retry of one must
not put a superseded decision back). It is written in the same merge patch as the keys it
lists.

A release leaves a `ReleasedRecord` in its place (`"released": true`, no keys): the release's
own key and the keys spent so far, the released allocation's among them. The next allocation's
record carries them on as spent, so a late retry of the release, or of the released decision,
is refused instead of stripping (or putting back) an allocation made after it. To
`decode_record` (and to a mirror of an earlier version: it has no `keys`) it is no record: the
pod carries no allocation.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass

from ..contract import keys as k

MIRRORED_ANNOTATION = k.MIRRORED_RECORD  # the record's key, protected by admission
RECORD_VERSION = 1
SPENT_KEPT = 8
"""Idempotency keys of replaced allocations a record keeps (the latest): a retry comes within
a call's deadline, while a few rebinds at most happen to one pod."""


_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"))
"""One encoder for both encodings below: `json.dumps` with these options builds a new one per
call, a sizeable part of the mirror's own work per allocation (benchmarks/, P1)."""


def allocation_digest(annotations: Mapping[str, str]) -> str:
    """Identifies what an allocation writes (every owned key and value, order-free)."""
    canonical = _CANONICAL.encode(dict(annotations))
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class MirrorRecord:
    pod_uid: str
    container: str
    """The fractional container the allocation is for ("" for a whole-GPU bind)."""
    keys: tuple[str, ...]
    """Every annotation key the mirror wrote (sorted), the record itself excluded."""
    digest: str
    idempotency_key: str = ""
    spent: tuple[str, ...] = ()
    """Idempotency keys of the allocations this one replaced, oldest first (at most
    SPENT_KEPT): their calls are over, and a late retry of one is refused."""
    aliases: tuple[str, ...] = ()
    """Keys of later calls that repeated this allocation under a new key (answered OK),
    oldest first (at most SPENT_KEPT): they are spent with `idempotency_key` when this
    allocation is replaced or released, so a late retry of any of them is refused too."""

    def encode(self) -> str:
        record = {"v": RECORD_VERSION, "uid": self.pod_uid, "container": self.container,
                  "keys": sorted(self.keys), "digest": self.digest,
                  "idempotencyKey": self.idempotency_key}
        if self.spent:  # absent until a replace: a record as the mirror wrote it before
            record["spentKeys"] = list(self.spent)
        if self.aliases:  # absent until a repeat under a new key, likewise
            record["aliasKeys"] = list(self.aliases)
        return _CANONICAL.encode(record)

    def owns_key(self, key: str) -> bool:
        """Whether a call with `key` was answered OK for this allocation."""
        return bool(key) and (key == self.idempotency_key or key in self.aliases)

    def repeated_by(self, new: MirrorRecord, key: str) -> MirrorRecord:
        """This allocation again (`new` has its digest), called with `key`: `new`'s pod, container
        and annotation keys (a hook's, the signatures, come and go with --signing-key-file;
        they are no part of the allocation), and this record's idempotency, spent and alias
        keys, `key` an alias when it is new here. Equal to this record when nothing changed.
        Starting afresh would forget the keys answered OK for this allocation, and their late
        retry after a rebind would put it back."""
        aliases = self.aliases
        if key and not self.owns_key(key) and key not in self.spent:
            aliases = spent_keys(aliases, key)
        return MirrorRecord(new.pod_uid, new.container, new.keys, self.digest,
                            self.idempotency_key, self.spent, aliases)

    def replaced_by(self, new: MirrorRecord) -> MirrorRecord:
        """`new`, which replaces this allocation, keeping this one's keys as spent."""
        return MirrorRecord(new.pod_uid, new.container, new.keys, new.digest,
                            new.idempotency_key, spent_keys(
                                self.spent, self.idempotency_key, self.aliases))

    def released(self, key: str) -> ReleasedRecord:
        """What a release with `key` leaves: this allocation's keys spent, `key` the latest."""
        return ReleasedRecord(self.pod_uid, key, spent_keys(
            self.spent, self.idempotency_key, self.aliases, but=key))


def spent_keys(*groups: str | tuple[str, ...], but: str = "") -> tuple[str, ...]:
    """The keys of `groups` in order, each once, without "" and `but`; the last SPENT_KEPT."""
    out: dict[str, None] = {}
    for group in groups:
        for key in (group,) if isinstance(group, str) else group:
            if key and key != but:
                out.pop(key, None)  # a key spent again counts from its latest place
                out[key] = None
    return tuple(out)[-SPENT_KEPT:]


@dataclass(frozen=True, slots=True)
class ReleasedRecord:
    """What ReleaseAllocation leaves in the record's place: no allocation, only the keys of
    the calls that are over, so that a late retry of one is recognised."""

    pod_uid: str
    idempotency_key: str = ""
    """The release's own key ("" none): its retry is a no-op, not a superseded call."""
    spent: tuple[str, ...] = ()
    """Keys of the calls before it (the released allocation's among them), oldest first."""

    def encode(self) -> str:
        return _CANONICAL.encode({"v": RECORD_VERSION, "released": True, "uid": self.pod_uid,
                                  "idempotencyKey": self.idempotency_key,
                                  "spentKeys": list(self.spent)})

    def spends(self, key: str) -> bool:
        """Whether a call with `key` came before a later one (never the release's own)."""
        return bool(key) and key in self.spent and key != self.idempotency_key

    def released(self, key: str) -> ReleasedRecord:
        """What a further release with `key` leaves (this one's key spent)."""
        if key == self.idempotency_key or not key:
            return self
        return ReleasedRecord(self.pod_uid, key, spent_keys(
            self.spent, self.idempotency_key, but=key))

    def followed_by(self, new: MirrorRecord) -> MirrorRecord:
        """`new`, the allocation mirrored after this release, carrying the spent keys on."""
        return MirrorRecord(new.pod_uid, new.container, new.keys, new.digest,
                            new.idempotency_key, spent_keys(
                                self.spent, self.idempotency_key, new.spent,
                                but=new.idempotency_key), new.aliases)


def _decoded(value: str | None) -> dict | None:
    if not value:
        return None
    try:
        raw = json.loads(value)
    except ValueError:
        return None
    if not isinstance(raw, dict) or raw.get("v") != RECORD_VERSION:
        return None
    return raw


def decode_released(value: str | None) -> ReleasedRecord | None:
    """The record a release left, or None when `value` is not one."""
    raw = _decoded(value)
    if raw is None or raw.get("released") is not True:
        return None
    uid, key, spent = raw.get("uid"), raw.get("idempotencyKey", ""), raw.get("spentKeys", [])
    if not isinstance(spent, list) or not all(isinstance(x, str) for x in (uid, key, *spent)):
        return None
    return ReleasedRecord(pod_uid=uid, idempotency_key=key, spent=tuple(spent))


def decode_record(value: str | None) -> MirrorRecord | None:
    """The record, or None when absent or unreadable (then nothing is known to be the mirror's:
    every key on the pod is treated as the user's, binder-owned and derived keys excepted), or
    when a release left it (`decode_released`: no allocation, nothing is the mirror's)."""
    raw = _decoded(value)
    if raw is None or raw.get("released"):
        return None
    keys, spent, aliases = raw.get("keys"), raw.get("spentKeys", []), raw.get("aliasKeys", [])
    fields = (raw.get("uid"), raw.get("container"), raw.get("digest"),
              raw.get("idempotencyKey", ""))
    if not all(isinstance(x, list) for x in (keys, spent, aliases)) or not all(
            isinstance(x, str) for x in (*keys, *spent, *aliases, *fields)):
        return None
    uid, container, digest, key = fields
    return MirrorRecord(pod_uid=uid, container=container, keys=tuple(sorted(keys)),
                        digest=digest, idempotency_key=key, spent=tuple(spent),
                        aliases=tuple(aliases))
