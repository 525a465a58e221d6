"""The shapes the webhooks read, checked before they read them.

The API server decodes typed objects before admission, so it never sends a pod whose
`spec.volumes` is a number; a direct caller (any pod that reaches the Service) can. Such a
review must be a clear denial, never an internal error (each of which fires
KaiFractionsAdmissionInternalErrors): the review's request and every part of a pod the
webhooks read (metadata, containers of the three lists, their env, mounts, resources and
security context, volumes) are checked here first, against `REQUEST` and `POD`, and a field of
the wrong shape raises the contract's ManifestError naming its JSON path and the type expected,
which the webhooks answer 400 BadRequest (`errors.manifest_denial`). Past these checks the
webhooks' code may take the shapes for granted.

A field may be absent or null anywhere (the API server reads null as the zero value); an item
of a list may not be null. Only what the webhooks read is checked: a field they never read
(`envFrom`, `nodeSelector`) is the API server's to refuse.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..contract import ManifestError
from .errors import clip

STRINGS = "strings"
"""A mapping of strings (or nulls): annotations, labels."""

Shape = Any
"""`str` or `bool` (a scalar of that type), STRINGS, a dict (a mapping: the shape of each
field it names, other fields unchecked) or a one-item list (a list: the shape of each item)."""

_MOUNT = {"name": str, "mountPath": str, "subPath": str, "subPathExpr": str, "readOnly": bool}
_CONTAINER = {
    "name": str,
    "env": [{"name": str}],
    "volumeMounts": [_MOUNT],
    "resources": {"limits": {}, "requests": {}},
    "securityContext": {"privileged": bool, "procMount": str,
                        "capabilities": {"add": [str]}},
    "targetContainerName": str,
}
METADATA = {"annotations": STRINGS, "labels": STRINGS}
POD: Shape = {
    "metadata": METADATA,
    "spec": {
        "containers": [_CONTAINER],
        "initContainers": [_CONTAINER],
        "ephemeralContainers": [_CONTAINER],
        "volumes": [{"name": str, "hostPath": {"path": str}}],
        "hostPID": bool,
        "shareProcessNamespace": bool,
        "runtimeClassName": str,
    },
}
"""What the webhooks read of a pod."""
REQUEST: Shape = {
    "kind": {"kind": str},
    "operation": str,
    "namespace": str,
    "name": str,
    "subResource": str,
    "userInfo": {"username": str},
    "object": {},
    "oldObject": {},
}
"""What the webhooks read of an AdmissionReview's request."""

_NAMES = {str: "a string", bool: "a boolean"}


Path = Any
"""Where a value is: a string, or (its parent's Path, a field name or a list index); joined
into text only for an error (most reviews have none, and a pod may bring 10,000 env vars)."""


def check(value: Any, shape: Shape, at: Path) -> None:
    """Raises ManifestError naming the first field of `value` (at `at`) not of `shape`."""
    if value is None:
        return
    if type(shape) is dict:
        if not isinstance(value, Mapping):
            raise _wrong(at, "a mapping", value)
        for field, inner in shape.items():
            item = value.get(field)
            if item is not None:
                check(item, inner, (at, field))
    elif type(shape) is list:
        if type(value) is not list:
            raise _wrong(at, "a list", value)
        [inner] = shape
        for i, item in enumerate(value):
            if item is None:
                raise _wrong((at, i), _expected(inner), item)
            check(item, inner, (at, i))
    elif shape is STRINGS:
        _strings(value, at)
    elif not isinstance(value, shape):
        raise _wrong(at, _NAMES[shape], value)


def _text(at: Path) -> str:
    steps: list[str] = []
    while isinstance(at, tuple):
        at, step = at
        steps.append(f"[{step}]" if isinstance(step, int) else f".{step}")
    return (at + "".join(reversed(steps))).lstrip(".")


def check_request(request: Mapping[str, Any]) -> None:
    """The review's request as the webhooks read it (`REQUEST`); its object's shape is the
    reviewer's to check, by kind."""
    check(request, REQUEST, "request")


def check_pod(obj: Any, old: bool = False) -> None:
    """A pod as the webhooks read it (`POD`): the request's object (paths from the object:
    `spec.volumes`), or with `old` its oldObject (`request.oldObject.spec.volumes`)."""
    check(obj, POD, "request.oldObject" if old else "")


def check_spec(spec: Any, path: str = "spec") -> None:
    """A pod's spec as the validating webhook's `manifest_problems` reads it (also offline, from
    manifests no API server decoded)."""
    check(spec, POD["spec"], path)


def check_metadata(obj: Any) -> None:
    """The object's metadata, its annotations and labels strings (any kind)."""
    check(obj, {"metadata": METADATA}, "")


def _expected(shape: Shape) -> str:
    if isinstance(shape, dict) or shape is STRINGS:
        return "a mapping"
    return "a list" if isinstance(shape, list) else _NAMES[shape]


def _strings(value: Any, at: Path) -> None:
    """In the contract's words (`contract.pod`), which the CLI reports offline too."""
    if not isinstance(value, Mapping):
        raise _wrong(at, "a mapping", value)
    for key, item in value.items():
        if not (item is None or isinstance(item, str)):
            raise ManifestError(f"{_text(at)}[{str(key)!r}]: must be a string, got "
                                f"{clip(repr(item), 80)} ({type(item).__name__}); quote the "
                                "value in YAML")


def _wrong(at: Path, expected: str, value: Any) -> ManifestError:
    # The contract's words for a field of the wrong shape (`contract.pod._mapping`).
    return ManifestError(f"{_text(at) or 'the object'}: must be {expected}, got "
                         f"{type(value).__name__}")
