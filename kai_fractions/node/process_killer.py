"""How the watchdog stops a process: the `Killer` seam it stops processes through, and
`SignalKiller`, which signals a process through a pidfd (SIGTERM, then SIGKILL once the grace
period has passed; reported unkillable when it still runs some time after SIGKILL).

Kept apart from `kai_fractions.node.watchdog`: the watchdog decides whom to stop; this is the
mechanism, and the demo's simulated node puts another in its place
(`kai_fractions.sim.killer.RecordingKiller`).
"""

from __future__ import annotations

import errno
import logging
import os
import signal
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from ..clock import Clock, SystemClock
from .procfs import PidfdPin
from .watchdog_types import (
    ESCALATED,
    FAILED,
    GONE,
    KILLED,
    SIGNALLED,
    SKIPPED,
    TERMINATED,
    UNKILLABLE,
)

# The watchdog's logger, as before this module was split out of it (log configurations and
# the `%(name)s` of its lines name the watchdog).
log = logging.getLogger("kai_fractions.node.watchdog")


class Killer(Protocol):
    def terminate(self, pid: int, still_ours: Callable[[], bool]) -> str:
        """Starts stopping `pid` if `still_ours()` (checked once the process is pinned), without
        waiting for it; returns one of SIGNALLED (in progress), TERMINATED, KILLED, GONE,
        SKIPPED, FAILED."""
        ...

    def progress(self) -> Iterable[tuple[int, str]]:
        """Moves every stop in progress on (escalation after the grace period) and returns
        (pid, outcome) for those whose state changed: ESCALATED, TERMINATED, KILLED,
        UNKILLABLE, FAILED (SIGKILL could not be sent: the stop is dropped)."""
        ...


def _why_failed(killer: Killer, pid: int) -> str:
    """Why the killer's last step for `pid` FAILED, when it says (`SignalKiller.why`)."""
    why = getattr(killer, "why", None)
    return why(pid) if callable(why) else ""


@dataclass(slots=True)
class _Stop:
    pin: PidfdPin
    deadline: float
    """Monotonic: SIGKILL is due (after SIGTERM), or the process counts as unkillable."""
    killed: bool = False
    reported: bool = False


class SignalKiller:
    """SIGTERM now; SIGKILL once `grace` seconds have passed; UNKILLABLE when the process still
    runs `kill_bound` seconds after that. Nothing waits: `progress()` (every watchdog check)
    moves each stop on. Through a pidfd: the process is pinned before its ownership is
    re-checked, and held until it exits, so a pid reused meanwhile is never signalled."""

    def __init__(self, clock: Clock | None = None, grace: float = 5.0,
                 kill_bound: float = 10.0, *, same_pid_namespace: bool = True):
        self.clock: Clock = clock or SystemClock()
        self.grace = grace
        self.kill_bound = kill_bound
        self.same_pid_namespace = same_pid_namespace
        """Whether the pids it is given (NVML's, read against the agent's /proc root) are this
        process's: when the root is another namespace's /proc, a pid here names some other
        process, and nothing is signalled."""
        self._stops: dict[int, _Stop] = {}
        self._why: dict[int, str] = {}
        """pid -> why its last step FAILED, until `why` is asked."""
        self._logged: dict[int, str] = {}
        """pid -> the failure last logged for it: the same one again is not (every check
        retries a stop that failed)."""

    @property
    def in_progress(self) -> frozenset[int]:
        return frozenset(self._stops)

    def terminate(self, pid: int, still_ours: Callable[[], bool]) -> str:
        if pid <= 1 or pid == os.getpid():
            return SKIPPED
        if pid in self._stops:  # already being stopped: never signalled twice
            stop = self._stops[pid]
            return UNKILLABLE if stop.reported else ESCALATED if stop.killed else SIGNALLED
        if not self.same_pid_namespace:
            return self._failed(
                pid, "the agent's /proc root is not of its own pid namespace, so that pid may "
                "name another process here (run the agent with hostPID, as the chart does)")
        try:
            pin = PidfdPin(os.pidfd_open(pid))
        except ProcessLookupError:
            self._logged.pop(pid, None)
            return GONE
        except OSError as exc:
            return self._failed(pid, f"pidfd_open: {_errno(exc)}")
        if not still_ours():
            pin.close()
            return SKIPPED
        error = self._signal(pin.fd, signal.SIGTERM)
        if error is not None:
            pin.close()
            if isinstance(error, ProcessLookupError):
                return GONE
            return self._failed(pid, f"SIGTERM: {_errno(error)}")
        self._logged.pop(pid, None)
        self._stops[pid] = _Stop(pin, self.clock.monotonic() + self.grace)
        return SIGNALLED

    def why(self, pid: int) -> str:
        """Why the last step for `pid` FAILED (once: it is forgotten as it is read)."""
        return self._why.pop(pid, "")

    def _failed(self, pid: int, why: str) -> str:
        """A step that could not be done: logged the first time it fails so (a stop that failed
        is tried again at every check), kept for `why`, reported FAILED."""
        if self._logged.get(pid) != why:
            log.warning("cannot stop pid %d: %s", pid, why)
            self._logged[pid] = why
            while len(self._logged) > 4096:  # pids that failed once and went: the oldest go
                del self._logged[next(iter(self._logged))]
        else:
            log.debug("cannot stop pid %d (again): %s", pid, why)
        self._why[pid] = why
        while len(self._why) > 4096:
            del self._why[next(iter(self._why))]
        return FAILED

    def progress(self) -> list[tuple[int, str]]:
        now = self.clock.monotonic()
        changed: list[tuple[int, str]] = []
        for pid, stop in list(self._stops.items()):
            if stop.pin.exited():
                changed.append((pid, KILLED if stop.killed else TERMINATED))
                self._drop(pid)
            elif now < stop.deadline:
                continue
            elif not stop.killed:
                error = self._signal(stop.pin.fd, signal.SIGKILL)
                if isinstance(error, ProcessLookupError):
                    changed.append((pid, TERMINATED))  # exited just now
                    self._drop(pid)
                    continue
                if error is not None:
                    # Not signalled: the stop is over, FAILED; a check that still sees the
                    # process over its cap starts another.
                    changed.append((pid, self._failed(pid, f"SIGKILL: {_errno(error)}")))
                    self._drop(pid)
                    continue
                stop.killed, stop.deadline = True, now + self.kill_bound
                changed.append((pid, ESCALATED))
            elif not stop.reported:
                # Kept (pinned) until it exits: then reported KILLED, and never signalled again.
                stop.reported = True
                changed.append((pid, UNKILLABLE))
        return changed

    def _drop(self, pid: int) -> None:
        self._stops.pop(pid).pin.close()

    @staticmethod
    def _signal(fd: int, sig: int) -> OSError | None:
        """None when sent; the error otherwise: ProcessLookupError (it exited), or any other
        (a PermissionError from an LSM such as AppArmor or SELinux), which fails the step."""
        try:
            signal.pidfd_send_signal(fd, sig)
        except OSError as exc:
            return exc
        return None


def _errno(exc: OSError) -> str:
    """`EPERM (Operation not permitted)`: the errno's name, and what it says."""
    name = errno.errorcode.get(exc.errno, str(exc.errno)) if exc.errno is not None else \
        type(exc).__name__
    return f"{name} ({exc.strerror or exc})"
