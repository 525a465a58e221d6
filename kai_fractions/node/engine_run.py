"""The state of one apply (`kai_fractions.node.engine`), shared by its steps.

Each step of an apply (the MPS namespaces and pinned limits, the cgroup limits) lives in a
module of its own as a subclass of `RunState`, and the engine's `_Run` combines them: a step
reads the desired state, records what it wrote and what failed here, and the report is built
from it once every step ran.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from .desired import ContainerKey, DesiredState, LimitTarget
from .engine_reports import GpuResult, Issue
from .errors import NodeError, NvmlError
from .memory_limits import LimitWrite
from .nvml import DeviceInfo, GpuComputeMode

if TYPE_CHECKING:
    from .engine import Engine


class RunState:
    """One apply's state: collects per-container failures and what was written."""

    def __init__(self, engine: Engine, desired: DesiredState, mps_down: NodeError | None = None,
                 *, mps_not_running: bool = False):
        self.e = engine
        self.d = desired
        self.mps_down = mps_down
        self.mps_gone = mps_down is not None and mps_not_running
        """The MPS control daemon is not running this pass (`Engine.apply`'s
        `mps_not_running`): every cap that relies on it is known not in force."""
        self.at = engine.clock()
        self.failed: dict[ContainerKey, NodeError] = {}
        self.issues: list[Issue] = []
        self.writes: list[LimitWrite] = []
        self.cleared: list[tuple[str, str]] = []
        self.created: list[str] = []
        self.deleted: list[str] = []
        self.modes_set: list[tuple[str, GpuComputeMode]] = []
        self.gpu_results: list[GpuResult] = []
        self.in_force: dict[ContainerKey, list[LimitTarget]] = {}
        self.unset: dict[LimitTarget, NvmlError] = {}
        """Pod-slice targets whose set failed in this pass (read back other than the target)."""
        self.leaf_pending: set[ContainerKey] = set()
        self.devices: dict[str, DeviceInfo] = {}
        self.unpinned: set[ContainerKey] = set()
        """mps-pinned containers whose GPU's default pinned limit this pass could not read back
        or set: no namespace of theirs is made or touched (a client attaching would start an
        MPS server that may lack it)."""

    def fail(self, keys: Iterable[ContainerKey], error: NodeError) -> None:
        for key in keys:
            self.failed.setdefault(key, error)  # the first error is the one to fix first
