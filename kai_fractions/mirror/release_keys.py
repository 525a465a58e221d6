"""What a release leaves on a pod, and which idempotency keys it spends: a late retry of a call
that a later one came after must never undo the later one's work.

Apart from the service because these rules read only the pod's record (`record`), and the
service's operations only ask them.
"""

from __future__ import annotations

from .compute import current_record
from .errors import AllocationConflict
from .record import MIRRORED_ANNOTATION, ReleasedRecord, decode_released
from .store import PodSnapshot


def released_here(pod: PodSnapshot) -> ReleasedRecord | None:
    """The record a release left on THIS pod (a recreated pod's is ignored), else None."""
    released = decode_released(pod.annotations.get(MIRRORED_ANNOTATION))
    if released is None or (pod.uid and released.pod_uid != pod.uid):
        return None
    return released


def superseded(pod: PodSnapshot, key: str, latest: str) -> AllocationConflict:
    ref = f"{pod.namespace}/{pod.name}"
    return AllocationConflict(ref, (
        f"idempotency key {key!r} names a call on pod {ref} that a later call came after "
        f"(key {latest or '-'}): a late retry of it is not applied; drop it"),
        kind="IDEMPOTENCY_KEY_SUPERSEDED")


def check_key_after_release(pod: PodSnapshot, released: ReleasedRecord, key: str) -> None:
    """A MirrorAllocation on a released pod: refused when its key is one of a call the release
    came after (the released decision's late retry), or the release's own."""
    if released.spends(key):
        raise superseded(pod, key, released.idempotency_key)
    if key and key == released.idempotency_key:
        ref = f"{pod.namespace}/{pod.name}"
        raise AllocationConflict(ref, (
            f"idempotency key {key!r} was already used on pod {ref} to release its "
            "allocation; a new decision needs a new key"), kind="IDEMPOTENCY_KEY_REUSED")


def retry_of_release(pod: PodSnapshot, key: str) -> bool:
    """Whether the release with `key` is the pod's last call: the record is the one it left.
    Never for a release without a key (it cannot be told from a new one)."""
    released = released_here(pod)
    return bool(key) and released is not None and released.idempotency_key == key


def released_record(pod: PodSnapshot, key: str) -> ReleasedRecord | None:
    """What a release with `key` leaves in the record's place; None when there is nothing to
    remember (no key, and no record with one). Raises AllocationConflict for a key a later
    call superseded: the late retry of a release must not strip what was written after it."""
    released = released_here(pod)
    record = current_record(pod)
    if released is not None:
        if released.spends(key):
            raise superseded(pod, key, released.idempotency_key)
        return released.released(key)
    if record is not None:
        if key and key in record.spent:
            raise superseded(pod, key, record.idempotency_key)
        left = record.released(key)
    else:
        left = ReleasedRecord(pod.uid, key)
    return left if left.idempotency_key or left.spent else None
