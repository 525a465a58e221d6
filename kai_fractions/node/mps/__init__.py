"""The MPS enforcer: a runner seam for `nvidia-cuda-mps-control`, the control commands (legacy
and v3 namespaces), and a supervisor for the control daemon. The simulated daemon the demo
runs is `kai_fractions.sim.mps`."""

from .control import MpsClient, MpsControl, displayed_mem_limit, parse_mem_limit
from .daemon import MpsDaemon, SystemClock
from .errors import MpsError
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
