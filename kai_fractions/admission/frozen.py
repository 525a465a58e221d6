"""User-owned NvFractions keys are frozen once the binder placed the pod.

After the bind, `.gpus.devices` says where the pod runs and the node enforces a plan computed
from every key together. A later edit of a user-owned key (request, limit, mode, the legacy
pod-level keys) would not move the pod, only make the node's plan disagree with the scheduler's:
the agent refuses the new plan, and a tenant could use that to step out of enforcement. So no
one may add, change or remove one once the old pod carries a `.gpus.devices` key.

The binder never needs to: KAI writes a missing request only together with the devices (the old
pod has none yet). The one exception is the mirror's own writing: keys the pod's
`kai-fractions.io/mirrored` record lists (a request the mirror filled in) may be replaced or
released by the identities allowed to write protected keys, as the mirror does on a rebind
(`replace`) or a release. The record itself is protected, so a user cannot widen the exception.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..contract import keys as k
from ..mirror.record import decode_record
from .config import AdmissionConfig


def devices_key(annotations: Mapping[str, str], keys: k.Keys) -> str | None:
    """The first `.gpus.devices` key on the pod (sorted), None before the bind."""
    for key in sorted(annotations):
        parts = keys.split(key)
        if parts is not None and parts[1] == k.DEVICES:
            return key
    return None


def _mirrors_own(old: Any, annotations: Mapping[str, str], user: str,
                 config: AdmissionConfig) -> set[str]:
    if user not in config.allowed_identities:
        return set()
    record = decode_record(annotations.get(k.MIRRORED_RECORD))
    metadata = old.get("metadata") if isinstance(old, Mapping) else None
    uid = str((metadata or {}).get("uid") or "")
    if record is None or not uid or record.pod_uid != uid:
        return set()  # no record, or a recreated pod's stale one: nothing is the mirror's
    return set(record.keys)


def frozen_changes(old: Any, old_annotations: Mapping[str, str],
                   new_annotations: Mapping[str, str], user: str,
                   config: AdmissionConfig) -> list[str]:
    """One line per user-owned key this UPDATE adds, changes or removes after the bind."""
    bound = devices_key(old_annotations, config.keys)
    if bound is None:
        return []
    exempt = _mirrors_own(old, old_annotations, user, config)
    return [f"{key}: is frozen once {bound} is set (the node enforces what the scheduler "
            "placed); create a new pod to change it"
            for key in sorted(set(old_annotations) | set(new_annotations))
            if config.keys.is_user_owned(key) and key not in exempt
            and old_annotations.get(key) != new_annotations.get(key)]
