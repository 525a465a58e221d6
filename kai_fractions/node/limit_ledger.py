"""Which cgroup GPU memory limits the node agent set: its claim on them, kept across restarts.

The engine's sweep clears a limit no plan names only where it is the agent's (a limit on any
other pod's cgroup may be NVIDIA's container toolkit's, set from the pod's env). Whether the
pod is fractional says so while the pod is there; for a pod that went while no agent ran, or a
pending pod that never got a marker, or a released one whose clear failed before a restart,
only a record on the host's disk can. A limit is recorded before it is written and dropped once
it is cleared or its cgroup is gone, so a crash in between leaves a claim, never a limit nobody
answers for.

`FileLimitLedger` is the real seam (a JSON file beside the markers, for this boot only: a
reboot takes the limits with it), which the node agent uses; `MemoryLimitLedger` keeps nothing
past the process (an engine given no ledger, as the engine's tests build it).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Set
from pathlib import Path
from typing import Protocol

from ..marker import TEMP_SUFFIX, write_atomically

log = logging.getLogger(__name__)

Entry = tuple[str, str]
"""(GPU UUID, cgroup path)."""
LEDGER_FILE = ".limits.json"
LEDGER_MODE = 0o600
LEDGER_NOT_WRITTEN = "LimitLedgerNotWritten"


class LimitLedger(Protocol):
    def load(self) -> set[Entry]: ...
    def save(self, entries: Set[Entry]) -> None:
        """Raises OSError when it cannot."""
        ...


class MemoryLimitLedger:
    def __init__(self) -> None:
        self.entries: set[Entry] = set()

    def load(self) -> set[Entry]:
        return set(self.entries)

    def save(self, entries: Set[Entry]) -> None:
        self.entries = set(entries)


class FileLimitLedger:
    """`<directory>/.limits.json`: {"boot_id": ..., "limits": [[gpu, path], ...]}."""

    def __init__(self, directory: str | os.PathLike[str], boot_id: str) -> None:
        self.path = Path(directory) / LEDGER_FILE
        self.boot_id = boot_id

    def load(self) -> set[Entry]:
        """Called as the agent starts, before any save: a temp file of a save that an earlier
        agent did not finish is removed."""
        for leftover in self.path.parent.glob(f".{LEDGER_FILE.lstrip('.')}.*{TEMP_SUFFIX}"):
            with contextlib.suppress(OSError):
                leftover.unlink()
        try:
            body = json.loads(self.path.read_bytes())
        except FileNotFoundError:
            return set()
        except (OSError, ValueError) as e:
            log.warning("the record of the limits this agent set (%s) cannot be read (%s); "
                        "starting without it: a limit of a pod that went while no agent ran "
                        "stays until its cgroup is removed", self.path, e)
            return set()
        if not isinstance(body, dict) or body.get("boot_id") != self.boot_id:
            return set()  # another boot's: its limits went with it
        limits = body.get("limits")
        return {(e[0], e[1]) for e in limits if isinstance(e, list) and len(e) == 2
                and all(isinstance(x, str) for x in e)} if isinstance(limits, list) else set()

    def save(self, entries: Set[Entry]) -> None:
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        body = {"boot_id": self.boot_id, "limits": sorted([gpu, path] for gpu, path in entries)}
        write_atomically(self.path, json.dumps(body).encode(), LEDGER_MODE)
