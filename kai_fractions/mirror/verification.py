"""What the follower's check of one BindRequest found: the differences, the contract errors,
what it signed or why not, and whether it is worth checking again by itself."""

from __future__ import annotations

from dataclasses import dataclass

from ..contract import ContractError


class TermEnded(Exception):
    """This replica's term as the follower ended before a write: the write was not sent."""


@dataclass(frozen=True, slots=True)
class Mismatch:
    key: str
    expected: str | None
    actual: str | None
    rule: str = ""
    """The rule the found value breaks, where it could have been accepted otherwise."""

    @property
    def message(self) -> str:
        found = "nothing" if self.actual is None else repr(self.actual)
        want = "nothing" if self.expected is None else repr(self.expected)
        rule = f": {self.rule}" if self.rule else ""
        return f"annotation {self.key}: expected {want}, found {found}{rule}"


@dataclass(frozen=True, slots=True)
class Verification:
    bind_request: str
    pod: str
    mismatches: tuple[Mismatch, ...] = ()
    errors: tuple[ContractError, ...] = ()
    skipped: str = ""
    """Why nothing was checked (not fractional, not bound yet, reservation unknown...)."""
    signed: tuple[str, ...] = ()
    """The signature annotations this check wrote (none when already signed, or unsigned)."""
    unsigned: str = ""
    """Why a matching pod was left unsigned ("" when signed, or signing is off)."""
    resigned: bool = False
    """The signatures written replace ones that no longer verify (their key was retired):
    the pod was not waiting for them."""
    recheck: bool = False
    """Incomplete for a reason that may pass by itself, with nothing changing on the
    BindRequest (the reserved GPU not known yet, the pod written to under every signing
    attempt): the follow loop checks it again after a backoff (`rechecks`). A finding, an
    invalid decision or another pod of that name waits for a change instead."""
    waiting: bool = False
    """Not checked yet, as every bind is for a moment: its BindRequest is not Succeeded yet
    and within the follower's PENDING_GRACE (`skipped` says so, and `recheck` is set).
    Counted and logged apart from an incomplete check: a normal bind is no problem."""

    @property
    def complete(self) -> bool:
        """Checked, matching, and signed where signing is on: nothing left to do."""
        return not (self.skipped or self.errors or self.mismatches or self.unsigned)
