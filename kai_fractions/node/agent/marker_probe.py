"""Whether the readiness marker directory still takes a file, looked at every `PROBE_SECONDS`
from the worker (`MarkerDirProbe`).

The agent checks the directory once at its start (`cli.node_agent.marker_dir_problem`), but a
disk that fills up or a host path remounted read-only later makes every marker write fail while
the node condition still says ready: KAI would go on placing fractional pods there, each to wait
in its gate until its timeout. A failed marker write only says so for one pod, and a node with no
fractional pod writes none, so the directory is probed on its own: a small file written, synced
and removed. While the probe fails the node condition is False (`MARKER_DIR_NOT_WRITABLE`,
`condition.evaluate`); the first probe that succeeds makes it ready again.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from pathlib import Path

from ...marker import ROOT_MODE

log = logging.getLogger(__name__)

PROBE_FILE = ".write-probe"
"""Beside the pods' directories; not a pod UID, so no tidy and no gate ever reads it."""
PROBE_SECONDS = 10.0
"""Between two probes (and at once after a pass whose marker write failed)."""
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
    """The last probe's answer (`error`), read by the node condition from any thread."""

    def __init__(self, root: str | os.PathLike[str], monotonic: Callable[[], float],
                 interval: float = PROBE_SECONDS,
                 probe: Callable[[str | os.PathLike[str]], str | None] = probe_writable):
        self.root = root
        self.monotonic = monotonic
        self.interval = interval
        self._probe = probe
        self.error: str | None = None
        """Why the last probe could not write in the directory; None when it could."""
        self.next_due = monotonic()  # the worker's first step probes

    def soon(self) -> None:
        """Probe at the next step: a marker write just failed, and the condition must say
        whether the directory itself is the cause, not wait for the interval."""
        self.next_due = min(self.next_due, self.monotonic())

    def check_if_due(self) -> None:
        now = self.monotonic()
        if now < self.next_due:
            return
        self.next_due = now + self.interval
        error = self._probe(self.root)
        if error is not None and self.error is None:
            log.error("the readiness marker directory cannot be written (%s): the node is not "
                      "ready for fractional pods (%s) until a probe writes there again",
                      error, MARKER_DIR_NOT_WRITABLE)
        elif error is None and self.error is not None:
            log.info("the readiness marker directory can be written again")
        self.error = error
