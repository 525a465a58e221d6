"""How the webhooks word a denial: one line per broken rule, straight from the contract."""

from __future__ import annotations

from collections.abc import Iterable

from ..contract import ContractError
from .review import Decision, deny

MAX_VALUE = 200
"""Show the offending value when it is short; an annotation value may be up to 256 KiB."""


def error_text(error: ContractError) -> str:
    if error.value is not None and len(error.value) > MAX_VALUE:
        return f"{error.key}: {error.rule}"
    return str(error)


def manifest_denial(error: ValueError) -> Decision:
    """The object has a field of the wrong shape (the API server normally refuses it first)."""
    return deny(str(error), code=400, reason="BadRequest")


def contract_denial(errors: Iterable[ContractError], warnings: tuple[str, ...] = ()) -> Decision:
    return deny("; ".join(error_text(e) for e in errors), code=422, reason="Invalid",
                warnings=warnings)
