"""AdmissionReview v1 in and out: parse a request body, build the response.

Decisions are plain values (`Decision`); this module turns them into the wire format so the
webhook logic never deals with base64 or uids.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

API_VERSION = "admission.k8s.io/v1"
KIND = "AdmissionReview"


class ReviewError(ValueError):
    """The body is not an AdmissionReview v1 request (HTTP 400); the message says why."""


class TooManyOpenings(ReviewError):
    """A body refused unparsed for opening more than MAX_OPENINGS arrays and objects (the
    server counts it apart from malformed JSON)."""


@dataclass(frozen=True, slots=True)
class Decision:
    allowed: bool
    message: str = ""
    code: int = 200
    reason: str = ""
    patch: tuple[dict[str, Any], ...] = ()
    """RFC 6902 operations; empty means no change."""
    warnings: tuple[str, ...] = field(default=())


def allow(*, patch: tuple[dict[str, Any], ...] = (), warnings: tuple[str, ...] = ()) -> Decision:
    return Decision(True, patch=patch, warnings=warnings)


def deny(message: str, *, code: int = 403, reason: str = "Forbidden",
         warnings: tuple[str, ...] = ()) -> Decision:
    return Decision(False, message=message, code=code, reason=reason, warnings=warnings)


MAX_OPENINGS = 200_000
"""The most arrays and objects (`[` and `{` outside strings, as json.loads reads them) a
review may open. Parsed, each costs about 100 bytes (a list) to 330 (a dict with a key) where
its 2 to 5 bytes of JSON would otherwise cost 25 to 60: a 3 MiB body of nested arrays parses to
42 times its size, and mutate's review of it peaked at 418 MB (tracemalloc). Within this bound
the costliest review peaks at 120 MB (a 3 MiB body of 200,000 nested one-key objects and short
strings, for /mutate; 53 to 66 MB with no brackets at all): see the server's MAX_REVIEWS.
Brackets inside strings cost nothing of that kind, and a real pod may hold many there: an env
value of JSON (600 KB of `[[0,0],...]` opens 100,000), twice in an UPDATE.

Real reviews open one per 21 to 26 bytes at their densest: a pod of 10,000 env vars, or of 100
containers of 100 env vars and 10 mounts each and 1,000 volumes, or of 1,000 containers, with
its managedFields, its status and a kubectl last-applied-configuration annotation opens 68,000
to 123,000 in 1.4 to 2.8 MiB, and an UPDATE (two objects) of the first 136,000 in 2.8 MiB
(counted with the brackets inside strings, the annotation's among them). At that density a
review filling all of the server's MAX_BODY would open 150,000. Pods as the test data has them
open one per 55 to 75 bytes."""

_ESCAPE = re.compile(rb"\\.", re.DOTALL)
_STRING = re.compile(rb'"[^"]*"')


def openings(body: bytes) -> int:
    """The arrays and objects `body` opens: its `[` and `{` outside JSON strings. Linear in the
    body whatever it holds (no backtracking: escapes go first, then the strings, each a run of
    anything but a quote). Where the body is not JSON, the count agrees with the parser's up to
    its first error, and the parser builds nothing past it. Only UTF-8 is read so (the API
    server sends nothing else); in UTF-16 or UTF-32 a character's bytes may be a quote's, so
    every bracket counts."""
    if json.detect_encoding(body) not in ("utf-8", "utf-8-sig"):
        return body.count(b"[") + body.count(b"{")
    outside = _STRING.sub(b"", _ESCAPE.sub(b"", body))
    return outside.count(b"[") + outside.count(b"{")


def parse_review(body: bytes) -> dict[str, Any]:
    """The `request` of an AdmissionReview v1 body; raises ReviewError."""
    opened = openings(body)
    if opened > MAX_OPENINGS:
        raise TooManyOpenings(f"the request body opens {opened} arrays and objects ('[' "
                              f"and '{{' outside strings), more than the {MAX_OPENINGS} any "
                              "AdmissionReview of a real object does; refused unparsed, as "
                              "each takes memory")
    try:
        review = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise ReviewError(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise ReviewError("the request body is not an AdmissionReview: it nests deeper than "
                          "any Kubernetes object") from None
    if not isinstance(review, dict):
        raise ReviewError("the request body must be a JSON object (an AdmissionReview)")
    if review.get("apiVersion") != API_VERSION or review.get("kind") != KIND:
        raise ReviewError(f"expected apiVersion {API_VERSION} kind {KIND}, got apiVersion "
                          f"{review.get('apiVersion')!r} kind {review.get('kind')!r}")
    request = review.get("request")
    if not isinstance(request, dict):
        raise ReviewError("the AdmissionReview has no request object")
    if not isinstance(request.get("uid"), str) or not request["uid"]:
        raise ReviewError("the AdmissionReview request has no uid")
    return request


def response(uid: str, decision: Decision) -> dict[str, Any]:
    body: dict[str, Any] = {"uid": uid, "allowed": decision.allowed}
    if not decision.allowed:
        status: dict[str, Any] = {"code": decision.code, "message": decision.message}
        if decision.reason:
            status["reason"] = decision.reason
        body["status"] = status
    if decision.patch:
        body["patchType"] = "JSONPatch"
        body["patch"] = base64.b64encode(
            json.dumps(list(decision.patch), separators=(",", ":")).encode()).decode()
    if decision.warnings:
        body["warnings"] = list(decision.warnings)
    return {"apiVersion": API_VERSION, "kind": KIND, "response": body}


def user_of(request: Mapping[str, Any]) -> str:
    info = request.get("userInfo")
    return str(info.get("username") or "") if isinstance(info, Mapping) else ""


def kind_of(request: Mapping[str, Any]) -> str:
    kind = request.get("kind")
    return str(kind.get("kind") or "") if isinstance(kind, Mapping) else ""


def annotations_of(obj: Any) -> dict[str, str]:
    if not isinstance(obj, Mapping):
        return {}
    meta = obj.get("metadata")
    ann = meta.get("annotations") if isinstance(meta, Mapping) else None
    if not isinstance(ann, Mapping):
        return {}
    return {str(a): "" if b is None else str(b) for a, b in ann.items()}
