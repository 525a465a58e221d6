"""The argument checks of MPS control commands: names, percentages, pids and device indexes.

Separate from `control` because the simulated control client (`kai_fractions.sim.mps`) checks
its arguments the same way: both reject what the real command would, before anything runs.
"""

from __future__ import annotations

import re

from kai_fractions.contract import MAX_PIPE_DIRECTORY

from . import errors as e
from .errors import MpsError

NAME_RE = re.compile(r"[a-z0-9_]+")
"""MPS v3 server and namespace names."""


def check_namespace(pipe_dir: str, server: str, name: str) -> None:
    """A valid namespace name whose pipe directory still fits a unix socket path."""
    check_namespace_name(name)
    directory = f"{pipe_dir.rstrip('/')}/{server}/{name}"
    if len(directory.encode()) > MAX_PIPE_DIRECTORY:
        raise MpsError(
            e.INVALID_ARGUMENT,
            f"MPS pipe directory {directory!r} is longer than {MAX_PIPE_DIRECTORY} bytes "
            "(unix socket paths are at most 107): use a shorter --mps-pipe-dir")


def check_namespace_name(name: object) -> None:
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise MpsError(e.INVALID_ARGUMENT,
                       f"MPS namespace name {name!r} must match [a-z0-9_]+")


def check_pct(pct: object) -> None:
    if isinstance(pct, bool) or not isinstance(pct, int) or not 1 <= pct <= 100:
        raise MpsError(e.INVALID_ARGUMENT,
                       f"active thread percentage must be a whole number 1..100, got {pct!r}")


def check_positive(value: object, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise MpsError(e.INVALID_ARGUMENT, f"{what} must be a whole number > 0, got {value!r}")


def check_index(value: object, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise MpsError(e.INVALID_ARGUMENT, f"{what} must be a whole number >= 0, got {value!r}")
