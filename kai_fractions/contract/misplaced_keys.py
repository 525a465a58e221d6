"""GPU-sharing keys written where no pod reads them: on a workload's own metadata (its pods get
only the template's), or as a label (KAI and kai_fractions read annotations only).

Either key asks for nothing (the pods ask only for what their template's annotations say), and
nothing else says so: the manifest is valid
Kubernetes and the contract never sees the key. It is the most common mistake in a workload, so
`kai-fractions validate` and the workloads' validating webhook warn about it (a warning, not an
error: the object is what Kubernetes accepts). A key that is also where the pods read it (a
chart that copies its annotations to the workload and the template) is no mistake.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from .collector import MAX_LISTED_WARNINGS
from .errors import ContractError
from .keys import Keys
from .pod import PodView

OWN = "metadata.annotations"
"""The field path of a workload's own annotations in `PodSpecAt.owner_annotations`."""


def misplaced_keys(view: PodView, spec_path: str, owner_annotations: Mapping[str, Any],
                   keys: Keys) -> tuple[ContractError, ...]:
    """One warning per GPU-sharing key (`Keys.is_user_owned`) of a pod or template whose spec
    is at `spec_path` that no pod gets: on its workload's own `metadata.annotations`, or on
    the metadata of what the workload makes between it and its pods (a CronJob's
    `spec.jobTemplate`: `PodSpecAt.owner_annotations`, by field path) and not on the
    template's, or among its `metadata.labels`
    and not among its annotations. Each is keyed by the key's field path and says where the
    key belongs; past MAX_LISTED_WARNINGS the rest are counted in one line."""
    found = list(_found(view, spec_path.removesuffix("spec") + "metadata", owner_annotations,
                        keys))
    if len(found) <= MAX_LISTED_WARNINGS:
        return tuple(found)
    more = len(found) - MAX_LISTED_WARNINGS
    return (*found[:MAX_LISTED_WARNINGS], ContractError(
        found[MAX_LISTED_WARNINGS].key, f"and {more} more GPU-sharing key(s) where no pod "
        "reads them, not listed"))


def _found(view: PodView, metadata: str, owner_annotations: Mapping[str, Any],
           keys: Keys) -> Iterator[ContractError]:
    if view.kind != "Pod":
        for where, annotations in owner_annotations.items():
            whose = "own metadata" if where == OWN else f"{where.removesuffix('.annotations')}"
            for key in sorted(k for k in annotations if type(k) is str):
                if keys.is_user_owned(key) and key not in view.annotations:
                    yield ContractError(
                        f"{where}[{key!r}]", f"is on the {view.kind}'s {whose}, which no pod "
                        "gets, so it asks for nothing: put it on the annotations of the pod "
                        f"template whose pods are to ask for it ({metadata}.annotations for "
                        "this one)")
    for key in sorted(view.labels):
        if keys.is_user_owned(key) and key not in view.annotations:
            yield ContractError(
                f"{metadata}.labels[{key!r}]", "must be an annotation, not a label: GPU sharing "
                "is asked for with annotations only, so this key asks for nothing; put it on "
                f"{metadata}.annotations")
