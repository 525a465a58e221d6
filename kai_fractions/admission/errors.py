"""How the webhooks word a denial: one line per broken rule, straight from the contract."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..contract import ContractError
from .review import Decision, deny

MAX_VALUE = 200
"""Show the offending value when it is short; an annotation value may be up to 256 KiB."""
MAX_LISTED = 20
"""Problems a denial lists in full; a pod with thousands of volumes must not make a denial
(or the log line that records it) as large as the pod."""
MAX_LOGGED = 2000
"""Characters of a denial the webhook's log line keeps."""


def error_text(error: ContractError) -> str:
    if error.value is not None and len(error.value) > MAX_VALUE:
        return f"{error.key}: {error.rule}"
    return str(error)


def exact(value: Any) -> str:
    """`value` in full, as one comparable string (a problem's identity, never shown)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


@dataclass(frozen=True, slots=True)
class Problem:
    """One broken rule of a pod's spec. `text` is what the denial says, with long values cut;
    `value` is the offending value in full. On UPDATE a problem the old pod already had is not
    held against the change: that is decided on both, so two values that read the same once
    cut are still two problems. `hint` is said once, after the last problem that has it."""

    text: str
    value: str = ""
    hint: str = field(default="", compare=False)

    def __str__(self) -> str:
        return self.text


def clip(text: str, limit: int = MAX_LOGGED) -> str:
    """`text`, cut to `limit` characters with its full length said."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def hinted(problems: Sequence[Problem | str]) -> list[str]:
    """Each problem's text, a hint said once: after the last problem that has it."""
    texts = [str(p) for p in problems]
    last = {p.hint: i for i, p in enumerate(problems) if isinstance(p, Problem) and p.hint}
    for hint, i in last.items():
        texts[i] += f" ({hint})"
    return texts


def denial_text(problems: Sequence[Problem | str]) -> str:
    """The problems joined with `; `, at most MAX_LISTED of them, each hint said once."""
    texts = hinted(problems[:MAX_LISTED])
    if len(problems) > MAX_LISTED:
        texts.append(f"and {len(problems) - MAX_LISTED} more problem(s) of the same kinds")
    return "; ".join(texts)


def manifest_denial(error: ValueError) -> Decision:
    """The object has a field of the wrong shape (the API server normally refuses it first)."""
    return deny(str(error), code=400, reason="BadRequest")


def contract_denial(errors: Iterable[ContractError], warnings: tuple[str, ...] = ()) -> Decision:
    """422 Invalid listing the contract's errors, at most MAX_LISTED (as the validating
    webhook's denials: thousands of bad keys must not make a denial as large as the pod)."""
    return deny(denial_text([error_text(e) for e in errors]), code=422, reason="Invalid",
                warnings=warnings)
