"""Keeps the MPS logs bounded. The control daemon appends to `control.log` in its log directory
(`CUDA_MPS_LOG_DIRECTORY`, the agent's `--mps-log-dir`) at every control command, the agent's
own health check every 5 s included (megabytes a day), and to `server.log` for its MPS servers;
nothing else rotates them.

The daemon holds both files open with O_APPEND for its whole life (its /proc/<pid>/fdinfo
says so), so renaming one would leave it writing into the renamed
file. They are cut as logrotate's `copytruncate` does: once a file is over `max_bytes`, its
newest `max_bytes` (from a line start) are copied to `<name>.1`, replacing the one before, and
the file is truncated in place; the daemon's next line lands at its new start. A line written
between the copy and the truncation is lost: a few, at most, at one check every 5 s.
"""

from __future__ import annotations

import contextlib
import logging
import os

log = logging.getLogger(__name__)

LOG_FILES = ("control.log", "server.log")
DEFAULT_MAX_BYTES = 16 * 1024 * 1024
_CHUNK = 1024 * 1024


class LogCap:
    """Cuts each of `files` in `log_dir` once it is over `max_bytes` (`check`, at every look of
    the supervisor: a stat per file). Never raises: a file that cannot be cut is logged (a
    warning once, until a cut works again) and left as it is."""

    def __init__(self, log_dir: str, max_bytes: int = DEFAULT_MAX_BYTES,
                 files: tuple[str, ...] = LOG_FILES):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ValueError(f"max_bytes must be a whole number of bytes > 0, got {max_bytes!r}")
        self.log_dir = str(log_dir)
        self.max_bytes = max_bytes
        self.files = files
        self._failing: set[str] = set()

    def check(self) -> list[str]:
        """Cuts every file over the cap; returns the names cut."""
        cut = []
        for name in self.files:
            path = os.path.join(self.log_dir, name)
            size: int | str = "unknown"
            try:
                size = os.stat(path).st_size
                if size <= self.max_bytes:
                    self._failing.discard(name)
                    continue
                self._cut(path)
            except FileNotFoundError:
                continue  # not written yet (no daemon, no server)
            except OSError as err:
                if name not in self._failing:
                    log.warning("cannot cut the MPS log %s (%s bytes, cap %d): %s; it keeps "
                                "growing until this works", path, size, self.max_bytes, err)
                self._failing.add(name)
                continue
            self._failing.discard(name)
            log.info("MPS log %s was over %d bytes: its newest part is in %s.1, and it starts "
                     "over", path, self.max_bytes, name)
            cut.append(name)
        return cut

    def _cut(self, path: str) -> None:
        kept, temporary = path + ".1", path + ".1.tmp"
        with open(path, "rb") as src:
            mode = os.fstat(src.fileno()).st_mode & 0o777
            start = max(0, os.fstat(src.fileno()).st_size - self.max_bytes)
            src.seek(start)
            if start:
                src.readline()  # from the next line start: no half line at the top
            try:
                with open(temporary, "wb") as dst:
                    os.fchmod(dst.fileno(), mode)
                    while chunk := src.read(_CHUNK):  # to the end, lines written since too
                        dst.write(chunk)
                os.replace(temporary, kept)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(temporary)
                raise
        os.truncate(path, 0)
