"""Which cgroup GPU memory limits the node agent set, and which GPUs it put in
EXCLUSIVE_PROCESS: its claim on them, kept across restarts.

The engine's sweep clears a limit no plan names only where it is the agent's (a limit on any
other pod's cgroup may be NVIDIA's container toolkit's, set from the pod's env). Whether the
pod is fractional says so while the pod is there; for a pod that went while no agent ran, or a
pending pod that never got a marker, or a released one whose clear failed before a restart,
only a record on the host's disk can. A limit is recorded before it is written and dropped once
it is cleared or its cgroup is gone, so a crash in between leaves a claim, never a limit nobody
answers for.

A GPU the agent switched to EXCLUSIVE_PROCESS for sm-sharing is recorded the same way, with the
mode it found there, before the switch: once no fractional container is left on it, the engine
puts that mode back (a whole-GPU pod placed there next may open more than one CUDA context),
and only there (a mode an administrator chose is never the agent's to change back).

`FileLimitLedger` is the real seam (a JSON file beside the markers, for this boot only: a
reboot takes the limits with it), which the node agent uses; `MemoryLimitLedger` keeps nothing
past the process (an engine given no ledger, as the engine's tests build it).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Mapping, Set
from pathlib import Path
from typing import Protocol

from ..marker import TEMP_SUFFIX, write_atomically

log = logging.getLogger(__name__)

Entry = tuple[str, str]
"""(GPU UUID, cgroup path)."""
LEDGER_FILE = ".limits.json"
MODES_FILE = ".compute-modes.json"
LEDGER_MODE = 0o600
LEDGER_NOT_WRITTEN = "LimitLedgerNotWritten"


class LimitLedger(Protocol):
    def load(self) -> set[Entry]: ...
    def save(self, entries: Set[Entry]) -> None:
        """Raises OSError when it cannot."""
        ...
    def load_modes(self) -> dict[str, str]:
        """GPU UUID -> the name of the compute mode the agent found there before it set
        EXCLUSIVE_PROCESS (a `GpuComputeMode` name)."""
        ...
    def save_modes(self, switched: Mapping[str, str]) -> None:
        """Raises OSError when it cannot."""
        ...


class MemoryLimitLedger:
    def __init__(self) -> None:
        self.entries: set[Entry] = set()
        self.modes: dict[str, str] = {}

    def load(self) -> set[Entry]:
        return set(self.entries)

    def save(self, entries: Set[Entry]) -> None:
        self.entries = set(entries)

    def load_modes(self) -> dict[str, str]:
        return dict(self.modes)

    def save_modes(self, switched: Mapping[str, str]) -> None:
        self.modes = dict(switched)


class FileLimitLedger:
    """`<directory>/.limits.json`: {"boot_id": ..., "limits": [[gpu, path], ...]}, and
    `<directory>/.compute-modes.json`: {"boot_id": ..., "switched": {gpu: mode name}}."""

    def __init__(self, directory: str | os.PathLike[str], boot_id: str) -> None:
        self.path = Path(directory) / LEDGER_FILE
        self.modes_path = Path(directory) / MODES_FILE
        self.boot_id = boot_id

    def load(self) -> set[Entry]:
        """Called as the agent starts, before any save: a temp file of a save that an earlier
        agent did not finish is removed."""
        for leftover in self.path.parent.glob(f".*{TEMP_SUFFIX}"):
            if leftover.name.startswith((f"{LEDGER_FILE}.", f"{MODES_FILE}.")):
                with contextlib.suppress(OSError):
                    leftover.unlink()
        limits = self._read(self.path, "limits", "the limits this agent set", "a limit of a pod "
                            "that went while no agent ran stays until its cgroup is removed")
        return {(e[0], e[1]) for e in limits if isinstance(e, list) and len(e) == 2
                and all(isinstance(x, str) for x in e)} if isinstance(limits, list) else set()

    def save(self, entries: Set[Entry]) -> None:
        self._write(self.path, "limits", sorted([gpu, path] for gpu, path in entries))

    def load_modes(self) -> dict[str, str]:
        switched = self._read(self.modes_path, "switched", "the GPUs this agent put in "
                              "EXCLUSIVE_PROCESS", "such a GPU stays in that mode after its last "
                              "sm-sharing container")
        if not isinstance(switched, dict):
            return {}
        return {gpu: mode for gpu, mode in switched.items()
                if isinstance(gpu, str) and isinstance(mode, str)}

    def save_modes(self, switched: Mapping[str, str]) -> None:
        self._write(self.modes_path, "switched", dict(sorted(switched.items())))

    def _read(self, path: Path, field: str, what: str, without: str) -> object:
        """The file's `field`, or None: no file, another boot's, or one that cannot be read
        (logged: the agent starts without it, `without` says what that costs)."""
        try:
            body = json.loads(path.read_bytes())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            log.warning("the record of %s (%s) cannot be read (%s); starting without it: %s",
                        what, path, e, without)
            return None
        if not isinstance(body, dict) or body.get("boot_id") != self.boot_id:
            return None  # another boot's: what it recorded went with it
        return body.get(field)

    def _write(self, path: Path, field: str, value: object) -> None:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        body = {"boot_id": self.boot_id, field: value}
        write_atomically(path, json.dumps(body).encode(), LEDGER_MODE)
