"""The MPS enforcer: a runner seam for `nvidia-cuda-mps-control`, the control commands (legacy
and v3 namespaces), and a supervisor for the control daemon. The simulated daemon the demo
runs is `kai_fractions.sim.mps`."""

from .daemon import MpsDaemon
from .errors import MpsError
from .runner import SubprocessRunner

__all__ = ["MpsDaemon", "MpsError", "SubprocessRunner"]
