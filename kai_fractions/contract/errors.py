"""Contract errors are values: each names the key (or request field), the offending value and the
rule in plain words, so every caller (CLI, webhook, gRPC, agent) can show the same sentence."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ContractError:
    key: str
    """Annotation key, or a request field path such as `received_gpu.portion`."""
    rule: str
    """What is wrong, in words a user can act on."""
    value: str | None = None
    """The offending value, verbatim (None when the key is missing)."""
    container: str | None = None

    def __str__(self) -> str:
        if self.value is None:
            return f"{self.key}: {self.rule}"
        return f"{self.key}: {self.rule} (got {shown(self.value)})"


SHOWN_VALUE = 80
"""Characters of an offending value that a message quotes: an annotation may hold 256 KiB, and
messages travel as events, gRPC status details and log lines."""


def shown(value: str) -> str:
    """`value` quoted, cut to SHOWN_VALUE characters with its full length said."""
    if len(value) <= SHOWN_VALUE:
        return repr(value)
    return f"{value[:SHOWN_VALUE]!r}... ({len(value)} characters)"


class ContractViolation(ValueError):
    """Raised by functions that cannot return a partial result; carries every error found."""

    def __init__(self, errors: Iterable[ContractError]):
        self.errors: tuple[ContractError, ...] = tuple(errors)
        if not self.errors:
            raise ValueError("ContractViolation needs at least one error")
        super().__init__("; ".join(str(e) for e in self.errors))
