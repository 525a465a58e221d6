"""A simulated process killer, for the demo's simulated node (and tests).

The demo's GPU processes are entries in the simulated NVML and a temporary /proc, not processes
of this host (their pids may well belong to real ones), so the watchdog must not send signals.
`RecordingKiller` has the `Killer` interface, records what it was asked to stop and answers an
outcome chosen by the caller.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from ..node.watchdog import KILLED, SKIPPED, TERMINATED


class RecordingKiller:
    """A `Killer` that signals nothing: records each pid it was asked to stop (in `calls`, and
    in a shared `journal` when given, to pin the order against MPS drains) and answers `outcome`
    (or `outcomes[pid]`). It honours `still_ours` like the real one."""

    def __init__(self, outcome: str = TERMINATED, outcomes: Mapping[int, str] | None = None,
                 journal: list | None = None):
        self.outcome = outcome
        self.outcomes = dict(outcomes or {})
        self.journal = journal
        self.calls: list[int] = []
        self.killed: list[int] = []

    def terminate(self, pid: int, still_ours: Callable[[], bool]) -> str:
        self.calls.append(pid)
        if not still_ours():
            return SKIPPED
        if self.journal is not None:
            self.journal.append(("terminate", (pid,)))
        outcome = self.outcomes.get(pid, self.outcome)
        if outcome in (TERMINATED, KILLED):
            self.killed.append(pid)
        return outcome

    def progress(self) -> list[tuple[int, str]]:
        """Its outcomes are final at once: no stop is ever in progress."""
        return []
