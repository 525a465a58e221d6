"""The API server's rule for annotation keys (apimachinery ValidateAnnotations: each key, lower-
cased, a qualified name), with its words, for the simulated API server: a write whose object
would carry a key Kubernetes refuses is refused here too (422 Invalid), so code that builds a
key too long for a real cluster fails its tests.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

MAX_NAME_PART = 63
MAX_PREFIX_PART = 253
_NAME_FORMAT = "([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]"
_NAME = re.compile(_NAME_FORMAT)
_SUBDOMAIN_FORMAT = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
_SUBDOMAIN = re.compile(_SUBDOMAIN_FORMAT)
_NAME_RULE = ("must consist of alphanumeric characters, '-', '_' or '.', and must start and end "
              "with an alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', "
              f"regex used for validation is '{_NAME_FORMAT}')")
_SUBDOMAIN_RULE = ("a lowercase RFC 1123 subdomain must consist of lower case alphanumeric "
                   "characters, '-' or '.', and must start and end with an alphanumeric "
                   "character (e.g. 'example.com', regex used for validation is "
                   f"'{_SUBDOMAIN_FORMAT}')")


def key_problems(key: str) -> list[str]:
    """apimachinery IsQualifiedName of the lower-cased key: what is wrong with it, as the API
    server words it (empty: Kubernetes accepts it)."""
    parts = key.lower().split("/")
    if len(parts) > 2:
        return [f"a qualified name {_NAME_RULE} with an optional DNS subdomain prefix and '/' "
                "(e.g. 'example.com/MyName')"]
    out = []
    if len(parts) == 2:
        prefix = parts[0]
        if not prefix:
            out.append("prefix part must be non-empty")
        else:
            if len(prefix) > MAX_PREFIX_PART:
                out.append(f"prefix part must be no more than {MAX_PREFIX_PART} characters")
            if not _SUBDOMAIN.fullmatch(prefix):
                out.append(f"prefix part {_SUBDOMAIN_RULE}")
    name = parts[-1]
    if not name:
        out.append("name part must be non-empty")
    elif len(name) > MAX_NAME_PART:
        out.append(f"name part must be no more than {MAX_NAME_PART} characters")
    if not _NAME.fullmatch(name):
        out.append(f"name part {_NAME_RULE}")
    return out


def invalid_annotations(annotations: Iterable[str]) -> list[tuple[str, str]]:
    """(key, problem) for each problem of each key, sorted by key."""
    return [(key, problem) for key in sorted(annotations) for problem in key_problems(key)]


def qualified_kind(obj: Mapping[str, Any], fallback: str) -> str:
    """`Pod`, or `BindRequest.scheduling.run.ai` for a kind with a group, as the API server
    names it in an Invalid error."""
    kind = obj.get("kind") or fallback
    group, slash, _ = str(obj.get("apiVersion") or "").rpartition("/")
    return f"{kind}.{group}" if slash and group else str(kind)


def invalid_message(kind: str, name: str, problems: list[tuple[str, str]]) -> str:
    """`Pod "p" is invalid: metadata.annotations: Invalid value: "<key>": <problem>`; several
    problems in brackets, comma-separated, as the API server joins them."""
    causes = [f'metadata.annotations: Invalid value: "{key}": {problem}'
              for key, problem in problems]
    joined = causes[0] if len(causes) == 1 else "[" + ", ".join(causes) + "]"
    return f'{kind} "{name}" is invalid: {joined}'


def causes(problems: list[tuple[str, str]]) -> list[dict[str, str]]:
    """The Status details' causes, one per problem."""
    return [{"reason": "FieldValueInvalid", "message": f'Invalid value: "{key}": {problem}',
             "field": "metadata.annotations"} for key, problem in problems]
