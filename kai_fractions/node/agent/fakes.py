"""In-memory stand-ins for the agent's MPS supervision (the daemon supervisor's shape over
`FakeMpsControl`), for unit tests and simulated nodes."""

from __future__ import annotations

from typing import Any

from ..mps import errors as mps_errors
from ..mps.errors import MpsError
from ..mps.fake import FakeMpsControl


class FakeMpsSupervisor:
    """`MpsDaemon`'s interface over a `FakeMpsControl`: `control.kill()` makes the daemon die,
    `can_start=False` makes every (re)start fail."""

    def __init__(self, control: FakeMpsControl | None = None, *, can_start: bool = True):
        self.control = control or FakeMpsControl()
        self.can_start = can_start
        self.restarts = 0
        self.starts = 0
        self.last_error: MpsError | None = None
        self.on_restart: Any = None
        self.stopped = False
        self._seen_running = False

    def healthy(self) -> bool:
        return self.control.running

    def ensure_running(self) -> bool:
        if self.control.running:
            self._seen_running = True
            self.last_error = None
            return True
        if not self.can_start:
            self.last_error = MpsError(mps_errors.MPS_DAEMON_UNREACHABLE,
                                       f"no MPS control daemon answers on "
                                       f"{self.control.pipe_dir} and it cannot be started")
            return False
        self.control.start()
        self.starts += 1
        if self._seen_running:
            self.restarts += 1
        self._seen_running = True
        if self.on_restart is not None:
            self.on_restart(self.control)
        self.last_error = None
        return True

    def stop(self, grace: float | None = None) -> bool:
        self.control.kill()
        self.stopped = True
        return True
