"""The MPS enforcer: a runner seam for `nvidia-cuda-mps-control`, the control commands (legacy
and v3 namespaces), a supervisor for the control daemon, and an in-memory fake."""

from .control import MpsClient, MpsControl, displayed_mem_limit, parse_mem_limit
from .daemon import MpsDaemon, SystemClock
from .errors import MpsError
from .fake import FakeMpsControl
from .runner import (
    CommandNotFound,
    CommandResult,
    CommandRunner,
    CommandTimeout,
    RecordingRunner,
    SubprocessRunner,
)

__all__ = [
    "CommandNotFound",
    "CommandResult",
    "CommandRunner",
    "CommandTimeout",
    "FakeMpsControl",
    "MpsClient",
    "MpsControl",
    "MpsDaemon",
    "MpsError",
    "RecordingRunner",
    "SubprocessRunner",
    "SystemClock",
    "displayed_mem_limit",
    "parse_mem_limit",
]
