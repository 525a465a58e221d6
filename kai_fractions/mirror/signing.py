"""The mirror's side of signed allocations: one signature annotation per planned container,
written in the same patch as the allocation (`MirrorService(extra_annotations=...)`), for the
node the allocation was made for (an Ed25519 signature binds it: `kai_fractions.signing`).

A signature already on the pod that is still valid for the new plan under any accepted key is
kept as it is, so a repeated call after a key rotation writes nothing. Signatures do not
identify the decision (see `compute.Outcome.digest`): re-signing the same allocation with a
rotated key is the same allocation, not a conflicting one.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..contract import ContainerPlan, Keys
from ..contract import keys as k
from ..signing import KeyringSource, signature_key
from .compute import ExtraAnnotations
from .store import PodSnapshot


def signing_annotations(source: KeyringSource, keys: Keys = k.DEFAULT_KEYS) -> ExtraAnnotations:
    def extra(pod: PodSnapshot, written: Mapping[str, str],
              plans: tuple[ContainerPlan, ...], node: str) -> dict[str, str]:
        keyring = source.current()
        out = {}
        for plan in plans:
            annotation = signature_key(plan, keys)
            existing = pod.annotations.get(annotation)
            if existing and keyring.verify(plan, existing, keys, node=node).ok:
                out[annotation] = existing
            else:
                out[annotation] = keyring.sign(plan, node=node)
        return out

    return extra
