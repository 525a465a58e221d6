"""The admission webhooks as the API server would call them for a pod CREATE: mutating first (its
JSON patch applied to the pod), then validating on the mutated pod. The pure review functions
of `kai_fractions.admission` decide; only the HTTPS transport is left out."""

from __future__ import annotations

import copy
import uuid as uuid_mod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jsonpatch

from .. import __version__
from ..admission.config import GATE_CONTAINER, AdmissionConfig
from ..admission.mutate import mutate
from ..admission.review import Decision
from ..admission.validate import validate
from ..contract import Keys

USER = "kubernetes-admin"
"""Who creates the demo's pods (a cluster user, not the binder or the mirror)."""
GATE_IMAGE = f"ghcr.io/kai-fractions/kai-fractions:{__version__}"


@dataclass(frozen=True, slots=True)
class Admitted:
    pod: dict[str, Any] | None
    """The pod as stored after mutation; None when refused."""
    decision: Decision
    """The refusing decision, or the validating webhook's allow."""
    wired: tuple[str, ...] = ()
    """What the mutating webhook wired, in words (for progress lines)."""
    warnings: tuple[str, ...] = ()
    """Both webhooks' warnings, each once: the API server returns them all to the pod's
    creator (kubectl prints each)."""

    @property
    def allowed(self) -> bool:
        return self.pod is not None


def admission_config(keys: Keys) -> AdmissionConfig:
    return AdmissionConfig(gate_image=GATE_IMAGE, keys=keys)


def _review(pod: Mapping[str, Any], user: str) -> dict[str, Any]:
    meta = pod.get("metadata") or {}
    return {
        "uid": str(uuid_mod.uuid4()),
        "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "resource": {"group": "", "version": "v1", "resource": "pods"},
        "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
        "operation": "CREATE",
        "namespace": meta.get("namespace") or "default",
        "name": meta.get("name") or "",
        "object": pod,
        "userInfo": {"username": user, "groups": ["system:masters", "system:authenticated"]},
        "dryRun": False,
    }


def _changes(pod: Mapping[str, Any]) -> tuple[str, ...]:
    """What the mutating webhook wired, in words: the gate, and per container the env it reads
    from the pod's annotations."""
    spec = pod.get("spec") or {}
    out = []
    if any(c.get("name") == GATE_CONTAINER for c in spec.get("initContainers") or []):
        out.append(f"init container {GATE_CONTAINER}")
    for c in spec.get("containers") or []:
        wired = [e["name"] for e in c.get("env") or []
                 if isinstance(e, Mapping) and "fieldRef" in (e.get("valueFrom") or {})]
        if wired:
            out.append(f"{c.get('name')}: {len(wired)} env vars from annotations")
    return tuple(out)


def admit(pod: Mapping[str, Any], config: AdmissionConfig, user: str = USER) -> Admitted:
    request = _review(pod, user)
    mutated = mutate(request, config)
    if not mutated.allowed:
        return Admitted(None, mutated)
    new = jsonpatch.apply_patch(copy.deepcopy(dict(pod)), list(mutated.patch)) \
        if mutated.patch else copy.deepcopy(dict(pod))
    checked = validate({**request, "object": new}, config)
    warnings = tuple(dict.fromkeys((*mutated.warnings, *checked.warnings)))
    if not checked.allowed:
        return Admitted(None, checked, warnings=warnings)
    return Admitted(new, checked, _changes(new), warnings)
