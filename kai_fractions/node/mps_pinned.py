"""The MPS daemon's default pinned device memory limit per GPU (the mps-pinned tier): how the
engine sets it, and what it knows of it between passes.

MPS gives a server the default pinned limit in force when the server starts (a client's first
attach; with v3, in a namespace), and the server keeps it for its lifetime. A restarted daemon
forgets the default. Reads of it can fail (a busy daemon) in any pass, so what a pass found
lost is remembered until a set succeeds, never until a read merely fails: a read that fails
after a loss says nothing of a set since.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from .errors import NodeError
from .mps.control import displayed_mem_limit
from .mps.errors import NOT_APPLIED, MpsError

MPS_PINNED_LIMIT_LOST = "MpsPinnedLimitLost"
"""The MPS daemon does not hold a GPU's default pinned device memory limit (a restarted daemon
forgot it; the set's own readback shows another value) and it could not be set again: an MPS
server started for a client now would run without it. The GPU's namespaces are not made until
it is. Also a namespace that was there while the limit was lost (`PinnedLimits.suspect`): a
server started in it then runs without it."""


DAEMON_NOT_RUNNING = ("the MPS control daemon was found not running, and a daemon's default "
                      "pinned limits go with it")
DAEMON_STARTED = ("the MPS control daemon was started since it was set (a restart, or this "
                  "agent's first start), and a new daemon holds no default pinned limit until "
                  "one is set on it")
"""Why a GPU's limit is lost with the daemon (`PinnedLimits.daemon_gone`), as its message says."""


class PinnedControl(Protocol):
    def set_default_pinned_mem_limit(self, device_index: int, mib: int) -> str: ...
    def get_default_pinned_mem_limit(self, device_index: int) -> str: ...


@dataclass(frozen=True, slots=True)
class _Loss:
    """Why a GPU's limit is known lost, as the pass that found it saw it."""

    uuid: str
    mib: int
    cause: str
    unset: bool
    """The daemon held no limit at all: a server started meanwhile has none."""

    def error(self, index: int, since: NodeError | None = None) -> MpsError:
        """MpsPinnedLimitLost; `since`: what kept a later pass from setting it."""
        cause = self.cause if since is None else (
            f"{self.cause}; it is not known set since ({since.reason}: {since.message})")
        return MpsError(MPS_PINNED_LIMIT_LOST, (
            f"the MPS daemon's default pinned device memory limit of GPU {index} ({self.uuid}) "
            f"is not the plan's {self.mib} MiB ({displayed_mem_limit(self.mib)}): {cause}. An "
            "MPS server started for a client now would run without it, so the GPU's MPS "
            "namespaces are not made until it is set; the container stays pending, and its "
            "readiness marker set aside, until then (the agent retries every pass; if this "
            "persists, check the MPS control daemon and its log)"))


class PinnedLimits:
    """What the engine knows of the daemon's default pinned limits (one per engine)."""

    def __init__(self) -> None:
        self.written: dict[int, int] = {}
        """MiB this engine wrote per GPU index: the daemon reads back whole GiB only, so a
        change within the same GiB is seen here. A read cache (`forget`)."""
        self.lost: dict[int, _Loss] = {}
        """GPU indexes whose limit a pass found lost (read back another value, or the set's
        own readback did) and that no set has succeeded on since. Not a cache."""
        self.exposed: set[str] = set()
        """MPS namespaces of a GPU's mps-pinned containers while the daemon held no limit for
        it, whether they are there or not: the next namespace list (`confirm`) tells."""
        self.suspect: set[str] = set()
        """Those of `exposed` that are there: a server started in one while the daemon held
        no limit keeps running without it, and nothing tells such a server apart, so each is
        made again once the limit is back (nobody attached) before its container is vouched
        for. Not a cache."""

    def forget(self) -> None:
        """Drops the read cache: the next pass writes every limit again."""
        self.written.clear()

    def confirm(self, existing: Iterable[str]) -> None:
        """`existing`: every namespace the daemon lists now. Those of `exposed` are `suspect`;
        the others hold no server (a namespace is made only while the limit is in force)."""
        self.suspect.update(self.exposed.intersection(existing))
        self.exposed.clear()

    def gone(self, name: str) -> None:
        """`name` was deleted, is not there, or was made while the limit is in force."""
        self.exposed.discard(name)
        self.suspect.discard(name)

    def keep_only(self, names: Iterable[str]) -> None:
        """Forgets the namespaces of containers that went."""
        names = set(names)
        self.exposed.intersection_update(names)
        self.suspect.intersection_update(names)

    def daemon_gone(self, index: int, uuid: str, mib: int, cause: str = DAEMON_NOT_RUNNING
                    ) -> None:
        """The daemon holds no limit for GPU `index` (`mib` MiB), for `cause`: it is not
        running (a daemon forgets its limits when it exits), or it was started since the
        limit was set (DAEMON_STARTED: a new daemon holds none). Lost until a set succeeds;
        the next `ensure` writes it again whatever it reads back."""
        self.written.pop(index, None)
        self.lost[index] = _Loss(uuid, mib, cause, unset=True)

    def lost_error(self, index: int, since: NodeError | None = None) -> MpsError | None:
        """MpsPinnedLimitLost while GPU `index`'s limit is known lost, else None."""
        loss = self.lost.get(index)
        return None if loss is None else loss.error(index, since)

    def ensure(self, mps: PinnedControl, index: int, uuid: str, mib: int,
               namespaces: Iterable[str]) -> None:
        """GPU `index`'s (`uuid`) limit, `mib` MiB: read back, and set unless this engine
        wrote it. `namespaces`: those of its mps-pinned containers (`exposed` while it holds
        none). Raises the read's or the set's error, as MpsPinnedLimitLost while the limit is
        known lost (`lost`)."""
        try:
            self._ensure(mps, index, uuid, mib, namespaces)
        except NodeError as e:
            loss = self.lost.get(index)
            if loss is None:
                raise
            if loss.unset:
                self.exposed.update(namespaces)  # a server may start without it meanwhile
            raise (e if e.reason == MPS_PINNED_LIMIT_LOST else loss.error(index, e)) from None

    def _ensure(self, mps: PinnedControl, index: int, uuid: str, mib: int,
                namespaces: Iterable[str]) -> None:
        # The readback shows whole GiB only: it tells a daemon that lost the value apart, and
        # what this engine wrote the exact MiB.
        held = mps.get_default_pinned_mem_limit(index)
        differs = held != displayed_mem_limit(mib)
        if not held.strip():
            self.exposed.update(namespaces)  # servers started until the set have no limit
        if not differs and self.written.get(index) == mib:
            return
        self.written.pop(index, None)
        try:
            mps.set_default_pinned_mem_limit(index, mib)  # reads back, or raises NotApplied
        except NodeError as e:
            if differs or e.reason == NOT_APPLIED:  # the set's own readback: not the plan's
                self.lost[index] = _lost(uuid, mib, held if differs else None, e)
                raise self.lost[index].error(index) from None
            raise
        self.written[index] = mib
        self.lost.pop(index, None)


def _lost(uuid: str, mib: int, held: str | None, error: NodeError) -> _Loss:
    """The limit is not the plan's `mib` (`held`: what the daemon read back; None: the set's
    own readback said so) and could not be set (`error`)."""
    if held is None:
        cause = f"a set of it read back another value ({error.reason}: {error.message})"
    else:
        cause = (f"it reads back {held or 'no limit'} (a restarted daemon forgets it), and it "
                 f"could not be set again ({error.reason}: {error.message})")
    return _Loss(uuid, mib, cause, unset=held is not None and not held.strip())


def suspect_error(name: str, *, pids: Iterable[int] = (), error: NodeError | None = None
                  ) -> MpsError:
    """`name` is `suspect` and could not be made again yet: clients (`pids`) are attached, or
    `error` kept it from being checked or deleted."""
    pids = list(pids)
    if pids:
        now = (f"clients (pids {', '.join(map(str, pids))}) are attached, which may run on "
               "such a server: the container stays pending until they have exited (restart "
               "the container's GPU processes, or recreate the pod)")
    else:
        why = f" ({error.reason}: {error.message})" if error is not None else ""
        now = (f"that could not be done yet{why}: the container stays pending until it is "
               "(the agent retries every pass)")
    return MpsError(MPS_PINNED_LIMIT_LOST, (
        f"MPS namespace {name} was there while the default pinned device memory limit of its "
        "GPU was lost: an MPS server started in it then (a client attaching) runs without the "
        "limit for its lifetime, and nothing tells such a server apart. The limit is set "
        "again; the namespace is made again once nobody is attached, and the container's "
        f"readiness marker is set aside until then; {now}"))
