"""The gate: the first init container of every fractional pod.

It blocks until the node agent's readiness marker says each fractional container's plan is
applied with the digest the pod's annotations give, so the workload (whose env the kubelet
resolves from those annotations when it starts) never runs without its limits. No Kubernetes
API credentials, standard library plus the pure contract package only, so it starts fast.
"""

from .check import Outcome, judge
from .downward import parse_annotations
from .run import GateOptions, observe, parse_names, run_gate

__all__ = [
    "GateOptions",
    "Outcome",
    "judge",
    "observe",
    "parse_annotations",
    "parse_names",
    "run_gate",
]
