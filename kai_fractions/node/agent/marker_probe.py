"""Whether the readiness marker directory still takes a file, looked at every `PROBE_SECONDS`
from the worker (`MarkerDirProbe`).

The agent checks the directory once at its start (`cli.node_agent.marker_dir_problem`), but a
disk that fills up or a host path remounted read-only later makes every marker write fail while
the node condition still says ready: KAI would go on placing fractional pods there, each to wait
in its gate until its timeout. A failed marker write only says so for one pod, and a node with no
fractional pod writes none, so the directory is probed on its own: a small file written, synced
and removed. While the probe fails the node condition is False (`MARKER_DIR_NOT_WRITABLE`,
`condition.evaluate`); the first probe that succeeds makes it ready again.

The probe runs on a thread of its own (`MarkerDirProbe.run`), never on the worker: on a file
system that hangs (a stale network mount) a write may never return, and the worker's watchdog
checks and gRPC calls must go on. A probe that has not returned within `HANG_SECONDS` counts as
failed while it hangs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path

from ...marker import ROOT_MODE, _remove

log = logging.getLogger(__name__)

PROBE_FILE = ".write-probe"
"""Beside the pods' directories; not a pod UID, so no tidy and no gate ever reads it."""
PROBE_SECONDS = 10.0
"""Between two probes (and at once after a pass whose marker write failed)."""
HANG_SECONDS = 5.0
"""A probe still in its write or sync this long after it started counts as failed (a local
write and sync take milliseconds)."""
MARKER_DIR_NOT_WRITABLE = "MarkerDirectoryNotWritable"
"""The node condition's reason while the probe fails."""


def probe_writable(root: str | os.PathLike[str]) -> str | None:
    """None when a file can be written (and synced) in `root`; else why not, naming the path.
    The file is removed again whether or not its write succeeded. A missing `root` is made, as
    the next marker write would make it."""
    path = Path(root) / PROBE_FILE
    try:
        with contextlib.suppress(FileExistsError):  # not a directory: the open says so
            Path(root).mkdir(mode=ROOT_MODE, parents=True, exist_ok=True)
        if not stat.S_ISREG(os.lstat(path).st_mode):
            _remove(path)  # a symlink or a directory in its place: never followed, removed
    except FileNotFoundError:
        pass  # no leftover: the usual case
    except OSError as e:
        return f"{root}: {e.strerror or e}"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
    except OSError as e:
        return f"{path}: {e.strerror or e}"
    try:
        os.write(fd, b"kai-fractions node agent: marker directory probe\n")
        os.fsync(fd)  # a full disk may only say so here
    except OSError as e:
        return f"{path}: {e.strerror or e}"
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):  # the next probe truncates it; it is no pod's
            os.unlink(path)
    return None


class MarkerDirProbe:
    """The last probe's answer (`error`), read by the node condition from any thread; the
    probes run on the thread that calls `run`."""

    def __init__(self, root: str | os.PathLike[str], monotonic: Callable[[], float],
                 interval: float = PROBE_SECONDS, hang_after: float = HANG_SECONDS,
                 probe: Callable[[str | os.PathLike[str]], str | None] = probe_writable):
        self.root = root
        self.monotonic = monotonic
        self.interval = interval
        self.hang_after = hang_after
        self._probe = probe
        self._error: str | None = None
        self._since: float | None = None
        """When the probe in progress started; None between probes."""
        self._wake = threading.Event()

    @property
    def error(self) -> str | None:
        """Why the directory cannot be written, as the last probe found, or as the one in
        progress shows by hanging; None when the last probe could write."""
        since = self._since
        if since is not None and self.monotonic() - since >= self.hang_after:
            return (f"{self.root}: a write and sync there has not returned for "
                    f"{self.hang_after:g} s or more (a hung file system?)")
        return self._error

    def soon(self) -> None:
        """Probe now, not at the end of the interval: a marker write just failed, and the
        condition must say whether the directory itself is the cause."""
        self._wake.set()

    def check(self) -> None:
        """One probe; logs when the answer changes."""
        self._since = self.monotonic()
        try:
            error = self._probe(self.root)
        finally:
            self._since = None
        if error is not None and self._error is None:
            log.error("the readiness marker directory cannot be written (%s): the node is not "
                      "ready for fractional pods (%s) until a probe writes there again",
                      error, MARKER_DIR_NOT_WRITABLE)
        elif error is None and self._error is not None:
            log.info("the readiness marker directory can be written again")
        self._error = error

    def run(self, stop: threading.Event) -> None:
        """Probes every `interval` (and when asked: `soon`) until `stop` is set. A probe that
        raises (a bug, or what no file system error covers: a directory planted in the probe's
        place too deep to remove) counts as failed, and the probes go on: a thread that died
        would leave its last answer standing for the agent's life."""
        while not stop.is_set():
            try:
                self.check()
            except Exception as e:  # any: see the docstring
                error = f"{self.root}: the probe failed ({type(e).__name__})"
                if error != self._error:  # logged once while it lasts
                    log.exception("the readiness marker directory's probe failed")
                self._error = error
            self._wake.wait(self.interval)
            self._wake.clear()
