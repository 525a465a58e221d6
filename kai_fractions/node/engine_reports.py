"""The reports of the node engine: what `Engine.apply` and `Engine.release` say they did.

Their own module because every reader of a pass (the agent's reconciler, its markers, metrics
and gRPC service) needs the types, never the engine's steps. A container is `applied` only when
everything its plan needs is in force; one pending because something its plan needs is KNOWN not
in force (`ContainerResult.not_in_force`) has a reason of its own (NOT_IN_FORCE_REASONS): no
readiness marker may vouch for it then. `kai_fractions.node.engine` re-exports them all.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from .config import Mechanism
from .desired import ComputeEnforcement, ContainerKey, LimitTarget
from .errors import NodeError
from .memory_limits import MEMORY_LIMIT_NOT_IN_FORCE, LimitWrite
from .mps_caps import CAP_NOT_IN_FORCE_REASONS
from .nvml import GpuComputeMode

WATCHDOG_BLIND = "WatchdogBlind"
"""The reason of a container pending with `ContainerResult.watchdog_blind`, and only of such a
container: the kill-policy watchdog is its only GPU memory tier on a GPU (no cgroup limit, no
MPS pinned limit there), and the watchdog cannot see that GPU's usage (NVML cannot list its
processes, lists them without their memory, shows none of its containers' while memory is in
use, or lists one whose container cannot be told: `node.agent.usage`), so nothing would stop a
process over the cap. Set by the agent's pass (`UsageCheck.blind_results`), not by the engine;
the message names the GPU, what the watchdog cannot see there and what to do."""

COMPUTE_MODE_NOT_IN_FORCE = "ComputeModeNotInForce"
"""The reason of an sm-sharing container pending because a GPU of its reads back a compute mode
other than EXCLUSIVE_PROCESS and the set failed (`Engine._wrong_mode`): there a process that
does not go through MPS opens a context of its own, outside every MPS cap, so it counts as an
MPS cap not in force (`ContainerResult.mps_cap_missing`). The message names the GPU, the modes,
NVML's error and what to do."""

NOT_IN_FORCE_REASONS = CAP_NOT_IN_FORCE_REASONS | {MEMORY_LIMIT_NOT_IN_FORCE, WATCHDOG_BLIND,
                                                   COMPUTE_MODE_NOT_IN_FORCE}
"""The reasons of a container pending with `ContainerResult.not_in_force`, and only of such a
container: CAP_NOT_IN_FORCE_REASONS for an MPS cap (`mps_cap_missing`), COMPUTE_MODE_NOT_IN_FORCE
for its GPU's compute mode, which every MPS cap needs (`mps_cap_missing` too),
MEMORY_LIMIT_NOT_IN_FORCE for its pod slice's memory limit (`limit_missing`), WATCHDOG_BLIND
for a watchdog that is its only memory tier and cannot see its GPU (`watchdog_blind`)."""


class ContainerState(StrEnum):
    APPLIED = "applied"
    REFUSED = "refused"
    PENDING = "pending"


@dataclass(frozen=True, slots=True)
class ContainerResult:
    key: ContainerKey
    ref: str
    """namespace/pod/container, for messages."""
    state: ContainerState
    reason: str | None = None
    message: str | None = None
    plan_digest: str | None = None
    mechanisms: frozenset[Mechanism] = frozenset()
    compute: ComputeEnforcement | None = None
    mps_namespace: str | None = None
    limits: tuple[LimitTarget, ...] = ()
    """The cgroup limits verified in force for this container (its pod slice and, once it
    exists, its own cgroup)."""
    container_limit_pending: bool = False
    """Its own cgroup is not there yet (or its ID is unknown); the pod slice carries the cap."""
    mps_cap_missing: bool = False
    """An MPS cap the container relies on is known not to be in force: its MPS namespace does
    not hold the plan's active-thread percentage (not there: not made, or deleted because its
    percentage could not be set; or there without it: set failed, or not verified:
    `Engine._fresh`, NamespaceCapUnverified; known until put right, whatever a later pass
    fails at first: `Engine._uncapped`), or its GPU's default pinned device memory limit
    (mps-pinned) reads back lost and is not set again since, or its namespace was there while
    that limit was lost (`PinnedLimits.suspect`), or the MPS control daemon is not running
    (`Engine.apply`'s `mps_not_running`: every cap that relies on it went with it), or a GPU
    of this sm-sharing container reads back a compute mode other than EXCLUSIVE_PROCESS and
    could not be set (`Engine._wrong_mode`: a process that leaves MPS runs outside every MPS
    cap). A client attaching meanwhile may run uncapped, so no readiness marker may vouch for
    the container; other pending reasons (NVML down, a busy daemon, one that runs but does not
    answer, a read that failed) say nothing of what is in force. Its reason
    is then one of CAP_NOT_IN_FORCE_REASONS (the message names the daemon's own error), or
    COMPUTE_MODE_NOT_IN_FORCE for the compute mode (NVML's error), and those reasons mean
    this."""
    limit_missing: bool = False
    """The GPU memory limit on its pod's slice, on one of its GPUs, is known not to be in force:
    read back absent or other than the plan's, and not set since (`Engine._unlimited`: known
    until a set succeeds or it is read back in force, whatever a later pass fails at first).
    The slice caps every container of the pod (the limit is hierarchical), so a process of it
    may use more than its cap, and no readiness marker may vouch for the container. A read that
    failed proves nothing (a pod pending for it keeps its marker), nor does a missing limit on
    the container's own cgroup while the slice's is in force (the slice still caps it). Its
    reason is then MEMORY_LIMIT_NOT_IN_FORCE (unless an MPS cap is missing too: then one of
    CAP_NOT_IN_FORCE_REASONS), the message naming NVML's own error."""
    watchdog_blind: bool = False
    """Its GPU memory cap rests on the kill-policy watchdog alone on one of its GPUs (neither
    the cgroup tier nor mps-pinned holds it there), and the watchdog cannot see that GPU's
    usage now (`node.agent.usage`: its processes cannot be listed, or are listed without
    their memory, or not at all while memory is in use, or one of them cannot be placed): a
    process of it may use more than its cap and nothing stops it, so no readiness marker may
    vouch for the container. Known from the watchdog's last check, until a check sees the GPU
    again. Its reason is then WATCHDOG_BLIND (unless an MPS cap is missing too: then one of
    CAP_NOT_IN_FORCE_REASONS)."""

    @property
    def not_in_force(self) -> bool:
        """Something the plan needs is known not in force (`mps_cap_missing`, `limit_missing`,
        `watchdog_blind`): no readiness marker may vouch for the container. Its reason is then
        one of NOT_IN_FORCE_REASONS."""
        return self.mps_cap_missing or self.limit_missing or self.watchdog_blind


@dataclass(frozen=True, slots=True)
class GpuResult:
    uuid: str
    compute_mode: GpuComputeMode | None
    """The mode in force after this apply (None when it could not be read)."""
    changed: bool = False
    error: NodeError | None = None


@dataclass(frozen=True, slots=True)
class Issue:
    """Something that went wrong outside any one container (cleanup, a GPU, the daemon)."""

    reason: str
    message: str


@dataclass(frozen=True, slots=True)
class ApplyReport:
    at: float
    containers: Mapping[ContainerKey, ContainerResult]
    gpus: tuple[GpuResult, ...] = ()
    writes: tuple[LimitWrite, ...] = ()
    """Every memory-limit write of this apply, clears included (empty when converged)."""
    cleared: tuple[tuple[str, str], ...] = ()
    """(gpu uuid, cgroup path) of the stale limits cleared."""
    namespaces_created: tuple[str, ...] = ()
    namespaces_deleted: tuple[str, ...] = ()
    compute_modes_set: tuple[tuple[str, GpuComputeMode], ...] = ()
    issues: tuple[Issue, ...] = ()

    @property
    def converged(self) -> bool:
        """Nothing pending and nothing left to retry."""
        return not self.issues and all(r.state is not ContainerState.PENDING
                                       for r in self.containers.values())


@dataclass(frozen=True, slots=True)
class ReleaseReport:
    pod_uid: str
    container: str | None
    cleared: tuple[tuple[str, str], ...] = ()
    namespaces_deleted: tuple[str, ...] = ()
    issues: tuple[Issue, ...] = ()

    @property
    def complete(self) -> bool:
        return not self.issues


def _issue(e: NodeError) -> Issue:
    return Issue(e.reason, e.message)
