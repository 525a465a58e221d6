"""The mirror's requests to the Kubernetes API, whatever carries them: the paths, the one
guarded merge patch, and what each refusal means. Both pod stores use it: `KubePodStore` (the
official client, in threads) and `AsyncKubePodStore` (the event loop's own connections).

A write is ONE JSON merge patch of `metadata.annotations` that carries `metadata.uid` and
`metadata.resourceVersion`: a real API server refuses it when the pod was recreated (uid is
immutable: 422) or changed since it was read (409), so a set of keys is never half-written and
never lands on the wrong pod.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from ..kubeconfig import status_message
from .errors import ApiRejected, PodNotFound
from .retry import Transient
from .store import NodeNotFound, WriteConflict, WriteInvalid

MERGE_PATCH = "application/merge-patch+json"
TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})


def pod_path(namespace: str, name: str) -> str:
    return f"/api/v1/namespaces/{quote(namespace, safe='')}/pods/{quote(name, safe='')}"


def node_path(node: str) -> str:
    return f"/api/v1/nodes/{quote(node, safe='')}"


def annotation_patch(changes: Mapping[str, str | None], *, uid: str, resource_version: str
                     ) -> bytes:
    """The merge patch body: the changes (None deletes a key) and the preconditions."""
    metadata: dict[str, Any] = {"annotations": dict(changes)}
    if uid:
        metadata["uid"] = uid
    if resource_version:
        metadata["resourceVersion"] = resource_version
    return json.dumps({"metadata": metadata}, separators=(",", ":")).encode()


@dataclass(frozen=True, slots=True)
class Refusal:
    """A non-2xx answer of the API server."""

    status: int
    message: str
    """`409 Conflict: <the Status message>`."""
    retry_after: float | None = None

    @classmethod
    def of(cls, status: int, reason: str | None, body: str | bytes | None,
           retry_after: str | None = None) -> Refusal:
        try:
            hint = float(retry_after) if retry_after is not None else None
        except ValueError:
            hint = None
        return cls(status, status_message(status, reason, body), hint)


def decoded(what: str, body: bytes | None) -> Any:
    """The JSON of a 2xx answer; ApiRejected when it is not JSON (a proxy's or a gateway's
    page, say): retrying would read the same page again."""
    try:
        return json.loads(body or b"null")
    except ValueError:
        raise ApiRejected(f"{what}: the API server's answer is not JSON "
                          f"({(body or b'')[:60]!r})") from None


def failure(what: str, refusal: Refusal) -> Exception:
    """What a refusal no caller-specific rule claimed means: Transient where retrying may
    help (throttling, timeouts, 5xx), else ApiRejected, naming RBAC for 401/403."""
    if refusal.status in TRANSIENT_STATUS or refusal.status >= 500:
        return Transient(refusal.message, refusal.retry_after)
    if refusal.status in (401, 403):
        return ApiRejected(f"{what}: the API server refused the mirror's identity "
                           f"({refusal.message}); check its RBAC")
    return ApiRejected(f"{what}: {refusal.message}")


def read_refusal(namespace: str, name: str, refusal: Refusal) -> Exception | None:
    return PodNotFound(namespace, name) if refusal.status == 404 else None


def patch_refusal(namespace: str, name: str, refusal: Refusal) -> Exception | None:
    if refusal.status == 404:
        return PodNotFound(namespace, name)
    if refusal.status == 409:
        return WriteConflict(refusal.message)
    if refusal.status == 422:
        return WriteInvalid(refusal.message)
    return None


def node_refusal(node: str, refusal: Refusal) -> Exception | None:
    return NodeNotFound(node) if refusal.status == 404 else None


IMPERSONATE_USER = "Impersonate-User"


def write_as_headers(write_as: str) -> dict[str, str]:
    """Headers that make a pod write carry `write_as`'s identity (Kubernetes impersonation).

    KAI's own NvFractions webhook lets exactly one username create or change `.gpus.devices`:
    its binder's service account. A mirror that writes them on the binder's behalf must carry
    that name; RBAC `impersonate` on exactly that service account is what allows it."""
    return {IMPERSONATE_USER: write_as} if write_as else {}
