"""The reconcile API of the node engine: `apply(desired)` and `release(pod)`.

Level-triggered and idempotent: every call reads what the GPU, the cgroup tree and the MPS
daemon say now and writes only the difference, so an engine started over any state (an agent
restart, a crash between two writes) converges to the desired state, and a second `apply` of
the same state writes nothing. The little private state it keeps (which cgroups are known
clean, which MPS namespace caps and pinned limits it set) only saves reads, except facts no
read gives back, which keep their containers pending: which MPS namespaces it created whose cap
is not verified in force yet (a client may have attached before it was set: `Engine._fresh`),
and which GPUs' default pinned limits it found lost and has not set since, and which namespaces
were there while they were (`Engine.pins`, `kai_fractions.node.mps_pinned`), and which pod
slices' GPU memory limits it read back missing and could not set (`Engine._unlimited`).

A container is reported `applied` only when everything its plan needs is in force: its GPUs'
compute mode, its MPS namespace and pinned limit, and the cgroup limit on its pod's slice
(the container's own cgroup gets its limit too once the runtime has created it). Any error
leaves it `pending` with the reason, and the next `apply` tries again. A container pending
because something its plan needs is KNOWN not in force (`ContainerResult.not_in_force`: an MPS
cap, including every one that went with an MPS control daemon that is not running, or its pod
slice's memory limit) says so, under a reason of its own (NOT_IN_FORCE_REASONS):
no readiness marker may vouch for it then; any other pending reason (a failed call, a read that
failed) says nothing of what is in force.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType
from typing import Protocol

from ..contract import is_mps_namespace_name, mps_namespace_name
from .cgroups import CgroupFs
from .config import Mechanism, NodeConfig
from .desired import (
    ComputeEnforcement,
    ContainerDesired,
    ContainerKey,
    DesiredState,
    LimitTarget,
)
from .errors import NodeError, NvmlError
from .limit_ledger import LEDGER_NOT_WRITTEN, LimitLedger, MemoryLimitLedger
from .memory_limits import (
    MEMORY_LIMIT_NOT_IN_FORCE,
    LimitNotSet,
    LimitWrite,
    MemoryLimitEnforcer,
    limit_not_in_force,
)
from .mps.errors import NAMESPACE_BUSY, NAMESPACE_EXISTS, MpsError
from .mps_caps import (
    CAP_NOT_IN_FORCE_REASONS,
    NAMESPACE_CAP_NOT_SET,
    NAMESPACE_CAP_UNVERIFIED,
    SET_REFUSED,
    MpsClientLike,
    attached_pids,
    cap_gone_with_daemon,
    cap_not_held,
    cap_not_held_by_clients,
    cap_not_made,
    cap_not_set,
    cap_not_set_attached,
    cap_not_set_deleted,
    cap_not_verified,
    cap_unverified,
    namespace_busy,
)
from .mps_pinned import PinnedLimits, suspect_error
from .nvml import DeviceInfo, GpuComputeMode, MemoryLimits, Nvml

log = logging.getLogger(__name__)

# -- the MPS control seam as the engine uses it (kai_fractions.node.mps.control.MpsControl and
# kai_fractions.sim.mps.FakeMpsControl both fit) ------------------------------------------------


class MpsControlLike(Protocol):
    def set_default_pinned_mem_limit(self, device_index: int, mib: int) -> str: ...
    def get_default_pinned_mem_limit(self, device_index: int) -> str: ...
    def namespace_create(self, name: str, *, exist_ok: bool = False) -> None: ...
    def namespace_set_active_thread_percentage(self, name: str, pct: int) -> None: ...
    def namespace_delete(self, name: str, *, missing_ok: bool = False) -> None: ...
    def namespace_list(self) -> list[str]: ...
    def client_list(self) -> list[MpsClientLike]: ...
    def namespace_get_active_thread_percentage(self, name: str) -> float | None: ...


# Reasons the engine itself gives (NVML and MPS errors bring their own).
CGROUP_NOT_FOUND = "CgroupNotFound"
MPS_UNAVAILABLE = "MPSUnavailable"

NOT_IN_FORCE_REASONS = CAP_NOT_IN_FORCE_REASONS | {MEMORY_LIMIT_NOT_IN_FORCE}
"""The reasons of a container pending with `ContainerResult.not_in_force`, and only of such a
container: CAP_NOT_IN_FORCE_REASONS for an MPS cap (`mps_cap_missing`),
MEMORY_LIMIT_NOT_IN_FORCE for its pod slice's memory limit (`limit_missing`)."""


def relies_on_mps(c: ContainerDesired) -> bool:
    """Whether what `c`'s plan needs in force relies on the node's MPS control daemon: an
    sm-sharing container (its processes are MPS clients, its share of the SMs is an MPS
    server's, even where no namespace or pinned limit is applied for it: a driver without
    namespaces caps it by its client env alone), one with an MPS namespace, or an mps-pinned
    one. When the daemon is not running, none of that is in force."""
    return (c.compute is not ComputeEnforcement.TIME_SLICING or bool(c.mps_namespace)
            or Mechanism.MPS_PINNED in c.mechanisms)


def is_our_namespace(name: str) -> bool:
    """Only namespaces the contract's naming makes are ours to delete, never an operator's."""
    return is_mps_namespace_name(name)


# -- reports --------------------------------------------------------------------------------


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
    (`Engine.apply`'s `mps_not_running`: every cap that relies on it went with it). A client
    attaching meanwhile may run uncapped, so no readiness marker may vouch for the container;
    other pending reasons (NVML down, a busy daemon, one that runs but does not answer, a read
    that failed) say nothing of what is in force. Its reason
    is then one of CAP_NOT_IN_FORCE_REASONS (the message names the daemon's own error), and
    those reasons mean this."""
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

    @property
    def not_in_force(self) -> bool:
        """Something the plan needs is known not in force (`mps_cap_missing`, `limit_missing`):
        no readiness marker may vouch for the container. Its reason is then one of
        NOT_IN_FORCE_REASONS."""
        return self.mps_cap_missing or self.limit_missing


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


# -- the engine -----------------------------------------------------------------------------


def _issue(e: NodeError) -> Issue:
    return Issue(e.reason, e.message)


def _has_namespaces(mps: MpsControlLike) -> bool:
    """Whether the daemon speaks the v3 protocol (namespaces); assumed when it cannot say."""
    probe = getattr(mps, "supports_protocol_v3", None)
    return True if probe is None else bool(probe())


class Engine:
    def __init__(
        self,
        nvml: Nvml,
        cgroup_fs: CgroupFs,
        mps_control: MpsControlLike | None,
        clock: Callable[[], float] = time.time,
        config: NodeConfig | None = None,
        ledger: LimitLedger | None = None,
    ):
        self.nvml = nvml
        self.cgroup_fs = cgroup_fs
        self.mps = mps_control
        self.clock = clock
        self.config = config or NodeConfig()
        self.layout = self.config.layout
        self.limits = MemoryLimitEnforcer(nvml)
        self._clean: set[tuple[str, str]] = set()
        """(gpu, cgroup path) read back without a limit since the last write there: skipped by
        the stale-limit sweep (a pure read cache; `forget()` drops it)."""
        self.ledger = ledger or MemoryLimitLedger()
        self._limited: set[tuple[str, str]] = self.ledger.load()
        """(gpu, cgroup path) where the agent put a limit, or was about to, until it is cleared
        or its cgroup is gone (`kai_fractions.node.limit_ledger`, saved before each write):
        the sweep's proof of ownership for a pod no longer in `DesiredState.owned_pods`. Not
        a cache: `forget()` keeps it."""
        self._saved = frozenset(self._limited)
        """What the ledger holds: a save that failed is tried again at the next change or pass."""
        self._atp: dict[str, int] = {}
        """Active-thread percentage this engine set per MPS namespace. MPS fixes it when the
        first client attaches, so with clients attached it is the one in force: kept by
        `forget()`, dropped with the namespace (deleted, or created again after a daemon
        restart)."""
        self._atp_checked: set[str] = set()
        """Namespaces whose percentage was set or found in force since the last `forget()`
        (saves re-setting it)."""
        self._fresh: set[str] = set()
        """MPS namespaces this engine created whose percentage is not yet known to be in force
        for every client: it is set right after the create, and verified only by a client list
        read after that set which shows none of them attached (a client that attached in
        between, e.g. a running container's process reconnecting after a daemon restart, may
        run uncapped). Not a cache: `forget()` keeps it; it goes with the namespace."""
        self._uncapped: set[str] = set()
        """MPS namespaces known not to hold their plan's percentage, beyond the unverified ones
        (`_fresh`): deleted because it could not be set, not made, left without it. Kept
        until a percentage is set or verified there, or their container goes, so that a pass
        failing before it reaches them (a busy namespace list, the daemon down) still reports
        the cap missing (`ContainerResult.mps_cap_missing`). Not a cache: `forget()` keeps it,
        and a delete does not end it."""
        self._unlimited: dict[LimitTarget, MemoryLimits] = {}
        """Pod-slice memory limits known not in force: target -> what was read back (absent,
        or another limit) before the set that failed. Kept until the target is set or read
        back in force, or no longer desired, so that a pass failing before it reaches the
        cgroup (NVML down, a read that fails) still reports the limit missing
        (`ContainerResult.limit_missing`). Not a cache: `forget()` keeps it."""
        self.pins = PinnedLimits()
        """The MPS default pinned device memory limits: MiB written (a cache), GPUs whose limit
        is known lost and namespaces that may hold a server started without it (not caches)."""
        self._last: DesiredState | None = None

    def _save_ledger(self) -> list[Issue]:
        """Saves the claims when they differ from what the ledger holds."""
        if self._saved == self._limited:
            return []
        try:
            self.ledger.save(self._limited)
        except OSError as e:
            return [Issue(LEDGER_NOT_WRITTEN, f"could not record which GPU memory limits the "
                          f"agent set ({e}); after a restart, one of a pod that went meanwhile "
                          "stays until its cgroup is removed")]
        self._saved = frozenset(self._limited)
        return []

    def forget(self) -> None:
        """Drop the read caches: the next apply re-reads every cgroup and re-sets every MPS
        namespace's percentage it can (a periodic resync)."""
        self._clean.clear()
        self._atp_checked.clear()
        self.pins.forget()

    def _namespace_gone(self, name: str) -> None:
        self._atp.pop(name, None)
        self._atp_checked.discard(name)
        self._fresh.discard(name)
        self.pins.gone(name)  # deleted, or made while the pinned limit is in force

    # -- apply ------------------------------------------------------------------------------

    def apply(self, desired: DesiredState, *, mps_down: NodeError | None = None,
              mps_not_running: bool = False) -> ApplyReport:
        """`mps_down`: why the node's MPS control daemon is unusable this pass (the agent's
        health check), if it is: every sm-sharing container then stays pending.
        `mps_not_running` (with `mps_down`): it is unusable because none runs (its process is
        gone, or the one running was started since and knows nothing: `MpsHealth.not_running`),
        not because one that may still hold its namespaces does not answer. Its namespaces,
        their percentages and its default pinned limits are then gone with it: each container
        that relies on it (`relies_on_mps`) is pending with its MPS cap known not in force
        (`ContainerResult.mps_cap_missing`), its namespace known without its percentage
        (`_uncapped`) and its GPUs' pinned limits lost (`PinnedLimits.daemon_gone`) until a
        pass with a daemon that runs has put them back and verified them."""
        self._uncapped.intersection_update(desired.mps_namespaces)  # their containers went
        targets = set(desired.limits)  # a target gone: its pod went, or its plan changed
        self._unlimited = {t: b for t, b in self._unlimited.items() if t in targets}
        self.pins.keep_only(desired.mps_namespaces)
        run = _Run(self, desired, mps_down, mps_not_running=mps_not_running)
        run.go()
        self._last = desired
        return run.report()

    # -- release ----------------------------------------------------------------------------

    def release(self, pod_uid: str, container: str | None = None, *,
                container_names: Iterable[str] = ()) -> ReleaseReport:
        """Remove what is enforced for a pod (or one container of it): its cgroup limits on every
        GPU and its MPS namespaces. Idempotent; reads before it writes.

        `container_names` (the pod's fractional containers, when the caller knows them) names
        MPS namespaces this engine did not apply itself, e.g. after a restart; without it the
        next apply's sweep deletes them. The agent must also drop the pod from its desired
        state, or the next apply puts everything back (that is what level-triggered means)."""
        issues: list[Issue] = []
        cleared: list[tuple[str, str]] = []
        deleted: list[str] = []
        last = self._last or DesiredState()
        mine = [c for c in last.containers if c.key.pod_uid == pod_uid
                and (container is None or c.key.container == container)]
        others = [c for c in last.containers if c.key.pod_uid == pod_uid and c not in mine]
        paths: list[str] = []
        if container is None:
            for pc in self.layout.scan(self.cgroup_fs):
                if pc.uid == pod_uid:
                    paths += [pc.path, *pc.children]
            paths += [c.pod_cgroup for c in mine] + [c.container_cgroup for c in mine
                                                      if c.container_cgroup]
        else:
            paths += [c.container_cgroup for c in mine if c.container_cgroup]
            if not any(Mechanism.CGROUP in c.mechanisms for c in others):
                paths += [c.pod_cgroup for c in mine]
        try:
            supported = self.limits.supported()
            uuids = ([d.uuid for d in self.nvml.devices() if not d.mig_enabled]
                     if supported else [])
        except NvmlError as e:
            supported, uuids = False, []
            issues.append(_issue(e))
        for path in dict.fromkeys(paths):
            if not self.cgroup_fs.exists(path):
                continue  # a removed cgroup takes its limits with it
            for uuid in uuids:
                try:
                    if self.limits.clear(uuid, path) is not None:
                        cleared.append((uuid, path))
                    self._clean.add((uuid, path))
                    self._limited.discard((uuid, path))
                except NvmlError as e:
                    self._limited.add((uuid, path))  # the passes after clear it
                    issues.append(_issue(e))
        for issue in self._save_ledger():  # the limits are gone: the next pass saves again
            log.warning("%s", issue.message)
        # What this engine applied (the webhook's names among them), and the names derived from
        # the pod UID; an admitted name it never applied is left to the next apply's sweep.
        names = [c.mps_namespace for c in mine if c.mps_namespace]
        names += [mps_namespace_name(pod_uid, n)
                  for n in ([container] if container is not None else container_names)]
        if self.mps is not None and names:
            try:
                existing = set(self.mps.namespace_list()) if _has_namespaces(self.mps) else set()
            except NodeError as e:
                existing = set()
                issues.append(_issue(e))
            for name in dict.fromkeys(n for n in names if n in existing):
                try:
                    self.mps.namespace_delete(name, missing_ok=True)
                    deleted.append(name)
                    self._namespace_gone(name)
                except NodeError as e:
                    issues.append(_issue(e))
        return ReleaseReport(pod_uid=pod_uid, container=container, cleared=tuple(cleared),
                             namespaces_deleted=tuple(deleted), issues=tuple(issues))


class _Run:
    """One apply: collects per-container failures, then builds the report."""

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

    def go(self) -> None:
        try:
            self.devices = {d.uuid: d for d in self.e.nvml.devices()}
        except NvmlError as e:
            # NVML is down: nothing can be verified, so nothing is applied (and nothing is
            # cleaned up: a stale limit is safer than a guess).
            self.fail((c.key for c in self.d.containers), e)
            self.issues.append(_issue(e))
            return
        self.compute_modes()
        self.mps()
        self.cgroup_limits()
        self.sweep_limits()
        self.sweep_namespaces()

    # compute modes ----------------------------------------------------------------------------

    def compute_modes(self) -> None:
        for g in self.d.gpus:
            device = self.devices.get(g.uuid)
            if device is None:
                continue  # the plan refused its containers (DeviceNotOnNode)
            mode, changed, error = device.compute_mode, False, None
            if (g.compute_mode is not None and self.e.config.sm_sharing
                    and device.compute_mode != g.compute_mode):
                try:
                    self.e.nvml.set_compute_mode(g.uuid, g.compute_mode)
                    mode, changed = g.compute_mode, True
                    self.modes_set.append((g.uuid, g.compute_mode))
                except NvmlError as e:
                    error = e
                    self.fail(g.containers, e)
            self.gpu_results.append(GpuResult(g.uuid, mode, changed, error))

    # MPS ----------------------------------------------------------------------------------------

    def mps(self) -> None:
        # Every sm-sharing container: its processes are clients of the node's MPS server, even
        # where no namespace or pinned limit is applied for it (a driver without namespaces
        # caps it by its client env alone), so without a daemon no share is enforced.
        needs_mps = [c for c in self.d.containers if relies_on_mps(c)]
        if not needs_mps:
            return
        mps = self.e.mps
        if mps is None:
            self.fail((c.key for c in needs_mps), NodeError(
                "the MPS control daemon is not available on this node (the agent runs without "
                "MPS control): sm-sharing cannot be enforced; check the agent's MPS settings",
                reason=MPS_UNAVAILABLE))
            return
        if self.mps_down is not None:
            if self.mps_gone:
                self.daemon_gone(needs_mps)
            self.fail((c.key for c in needs_mps), self.mps_down)
            return
        self.pinned_limits(mps, needs_mps)
        # A namespace is where a client attaches and an MPS server starts for it: made while
        # the pinned limit is not known in force, it may let a server start without it.
        wanted = [c for c in needs_mps if c.mps_namespace and c.key not in self.unpinned]
        if not wanted:
            return
        try:
            existing = set(mps.namespace_list())
        except NodeError as e:
            self.fail((c.key for c in wanted), e)
            return
        self.namespaces(mps, wanted, existing)
        if self.created:
            self.pinned_limits(mps, needs_mps, made=set(self.created))

    def daemon_gone(self, needs_mps: list[ContainerDesired]) -> None:
        """The MPS control daemon is not running (`mps_gone`): the namespaces of `needs_mps`
        are known without their percentage (`_uncapped`, until one is made again and
        verified), and the default pinned limits of their mps-pinned containers' GPUs lost
        (`PinnedLimits.lost`, until a set succeeds)."""
        for c in needs_mps:
            if c.mps_namespace:
                self._uncap(c.mps_namespace)
        for g in self.d.gpus:
            if g.mps_pinned_mib is not None and any(
                    Mechanism.MPS_PINNED in c.mechanisms and g.uuid in c.plan.device_uuids
                    for c in needs_mps):
                self.e.pins.daemon_gone(g.index, g.uuid, g.mps_pinned_mib)

    def pinned_limits(self, mps: MpsControlLike, needs_mps: list[ContainerDesired],
                      made: set[str] | None = None) -> None:
        """Each GPU's default pinned limit (`PinnedLimits.ensure`): its mps-pinned containers
        are `unpinned` while it is not known in force. `made`: only the GPUs of the namespaces
        this pass made, read back after the creates: a daemon someone else restarted in
        between (the agent's own restarts come between passes) holds none, and a server
        started in one would have none; those are made again (`_repin`) by a later pass."""
        for g in self.d.gpus:
            users = [c for c in needs_mps if Mechanism.MPS_PINNED in c.mechanisms
                     and g.uuid in c.plan.device_uuids
                     and (made is None or c.mps_namespace in made)]
            if g.mps_pinned_mib is None or (made is not None and not users):
                continue
            try:
                self.e.pins.ensure(mps, g.index, g.uuid, g.mps_pinned_mib,
                                   [c.mps_namespace for c in users if c.mps_namespace])
            except NodeError as e:
                self.fail((c.key for c in users), e)
                self.unpinned.update(c.key for c in users)
            if made is None:
                continue
            self.e.pins.confirm(made)  # just made: there
            for c in users:
                if c.mps_namespace in self.e.pins.suspect:
                    self.fail([c.key], suspect_error(c.mps_namespace or ""))

    def namespaces(self, mps: MpsControlLike, wanted: list[ContainerDesired],
                   existing: set[str]) -> None:
        """Each container's MPS namespace, with its active-thread percentage in force.

        MPS fixes a namespace's percentage when its first client attaches, so a namespace
        created here gets its percentage right after the create, and counts as applied only
        once a client list read after that set shows no client attached (`Engine._fresh`);
        one with clients by then stays pending until they exit."""
        fresh = self.e._fresh
        set_now: set[str] = set()
        """Fresh namespaces whose percentage was set in this pass before the next client list."""
        before = set(self.failed)

        def broken(key: ContainerKey) -> bool:
            """A step of this method failed for the container (not an earlier one)."""
            return key in self.failed and key not in before

        self._repin(mps, wanted, existing)
        for c in wanted:
            name, pct = c.mps_namespace, c.active_thread_percentage
            assert name is not None and pct is not None
            if name not in existing:
                self._make(mps, c, name, pct, set_now)
        clients: list[MpsClientLike] | None = None
        # Fresh namespaces of earlier passes: set again once nobody is attached, then verified by
        # the client list below.
        again = [c for c in wanted if c.mps_namespace in fresh
                 and c.mps_namespace not in set_now and not broken(c.key)]
        if again:
            try:
                clients = list(mps.client_list())
            except NodeError as e:
                self.fail((c.key for c in again), e)
            else:
                sets = len(set_now)
                for c in again:
                    name, pct = c.mps_namespace, c.active_thread_percentage
                    assert name is not None and pct is not None
                    if not attached_pids(clients, name):
                        self._set_fresh(mps, c, name, pct, set_now)
                if len(set_now) > sets:
                    clients = None  # the verification needs a list read after the sets
        for c in wanted:
            name, pct = c.mps_namespace, c.active_thread_percentage
            assert name is not None and pct is not None
            if broken(c.key):
                continue
            try:
                in_force = self.e._atp.get(name)
                if name not in fresh and in_force == pct and name in self.e._atp_checked:
                    continue
                if clients is None:
                    clients = list(mps.client_list())
                attached = attached_pids(clients, name)
                if name in fresh:
                    if name in set_now and not attached:
                        # Set before this list, and nobody attached: every client from now on
                        # attaches under the cap.
                        self._verified(name, pct)
                    else:
                        self.fail([c.key], cap_unverified(name, pct, attached))
                    continue
                if attached:
                    # MPS fixed the cap when the first client attached: a new percentage
                    # cannot take effect until they exit.
                    if in_force is not None and in_force != pct:
                        self.fail([c.key], namespace_busy(
                            name, f"{in_force} set before they attached", pct))
                    elif in_force is not None:
                        self.e._atp_checked.add(name)
                    else:
                        self._adopt(mps, c, name, pct, attached)
                    continue
                # Nobody attached: the namespace holds the plan's percentage already (a
                # resync, an agent restart), or takes it now, made again if clients that have
                # left fixed another.
                if (mps.namespace_get_active_thread_percentage(name) != float(pct)
                        and self._reset(mps, name, pct)):
                    clients = list(mps.client_list())  # read after the set
                    attached = attached_pids(clients, name)
                    if attached:  # they may have attached before the set
                        self.fail([c.key], cap_unverified(name, pct, attached))
                        continue
                self._verified(name, pct)
            except NodeError as e:
                self.fail([c.key], e)
        for c in wanted:  # not made again this pass (`_repin`): a server in it may lack the limit
            if c.mps_namespace is not None and c.mps_namespace in self.e.pins.suspect:
                self.fail([c.key], suspect_error(c.mps_namespace))

    def _repin(self, mps: MpsControlLike, wanted: list[ContainerDesired],
               existing: set[str]) -> None:
        """Namespaces that were there while their GPU's default pinned limit was lost
        (`PinnedLimits.suspect`), now that it is in force again: each nobody is attached to is
        deleted (and dropped from `existing`), for `_make` to make it again, so a server
        started in it from now on gets the limit. One with clients attached stays, its
        container pending until they exit. One not there holds no server: `_make` makes it."""
        self.e.pins.confirm(existing)
        stale = [c for c in wanted
                 if c.mps_namespace in existing and c.mps_namespace in self.e.pins.suspect]
        if not stale:
            return
        try:
            clients = list(mps.client_list())
        except NodeError as e:
            self.fail((c.key for c in stale), e)
            return
        for c in stale:
            name = c.mps_namespace
            assert name is not None
            attached = attached_pids(clients, name)
            if attached:
                self.fail([c.key], suspect_error(name, pids=attached))
                continue
            try:
                mps.namespace_delete(name)
            except NodeError as e:
                self.fail([c.key], e)  # a client attached in between, or a busy daemon
                continue
            self.deleted.append(name)
            self.e._namespace_gone(name)
            existing.discard(name)

    def _verified(self, name: str, pct: int) -> None:
        """`name` holds `pct` for every client attached to it now and from now on."""
        self.e._fresh.discard(name)
        self.e._uncapped.discard(name)
        self.e._atp[name] = pct
        self.e._atp_checked.add(name)

    def _uncap(self, name: str) -> None:
        """`name` is known not to hold its percentage (`Engine._uncapped`): whatever this engine
        set there is not what it holds."""
        self.e._uncapped.add(name)
        self.e._atp.pop(name, None)
        self.e._atp_checked.discard(name)

    def _make(self, mps: MpsControlLike, c: ContainerDesired, name: str, pct: int,
              set_now: set[str]) -> None:
        """Creates `name`, which the daemon's list left out, and sets its percentage at once.
        One the daemon says exists after all (a list answer that left it out) is not fresh: it
        is read back below like every existing namespace, so a healthy one's clients are not
        taken for clients that attached before its percentage was set."""
        try:
            mps.namespace_create(name)
        except NodeError as e:
            if e.reason != NAMESPACE_EXISTS:
                self._uncap(name)  # not there: nothing in force
                self.e.pins.gone(name)  # nor a server started without the limit
                self.fail([c.key], cap_not_made(name, pct, e))
            return
        self.created.append(name)
        self.e._namespace_gone(name)
        self.e._fresh.add(name)
        self._set_fresh(mps, c, name, pct, set_now)

    def _adopt(self, mps: MpsControlLike, c: ContainerDesired, name: str, pct: int,
               attached: list[int]) -> None:
        """A namespace with clients that this engine never set (an agent restart): they
        attached on the percentage set then (the gate let no client start before the namespace
        was applied, and a running container's plan is held). Where the daemon can say which
        percentage the namespace holds: it must be the plan's (an earlier agent may have left
        it `fresh`, a client attached before its set)."""
        held = mps.namespace_get_active_thread_percentage(name)
        if held is None:
            self._uncap(name)
            self.fail([c.key], cap_not_held_by_clients(name, pct, attached))
        elif held != float(pct):
            self.fail([c.key], namespace_busy(name, f"{held:g} the namespace holds", pct))
        else:
            self._verified(name, pct)

    def _set_fresh(self, mps: MpsControlLike, c: ContainerDesired, name: str, pct: int,
                   set_now: set[str]) -> None:
        """The percentage of a fresh namespace nobody was seen attached to; a daemon refusing
        it because clients are attached already means they may run uncapped."""
        try:
            self._set_or_remake(mps, name, pct)
        except NodeError as e:
            self.fail([c.key], self._not_set(mps, name, pct, e))
            return
        self.e._uncapped.discard(name)  # holds it now; fresh until a client list verifies it
        set_now.add(name)

    def _reset(self, mps: MpsControlLike, name: str, pct: int) -> bool:
        """`_set_or_remake` for a namespace read back without the plan's percentage, nobody
        attached: until a set succeeds, what a client attaching gets is not the plan's cap. It
        need not be `fresh` here (an agent restarted since made it, e.g. one left
        NamespaceCapNotSet), so a set that fails outright (a busy daemon, a timeout) deletes
        it as the fresh path does (`_unmake_if_unattached`)."""
        self._uncap(name)
        try:
            refused = self._set(mps, name, pct)
        except NodeError as e:
            raise self._unmake_if_unattached(mps, name, pct, e) from None
        if refused is not None:
            self._remake(mps, name, pct, refused)
        self.e._uncapped.discard(name)  # holds it: verified by a client list like a new one
        return refused is not None

    def _unmake_if_unattached(self, mps: MpsControlLike, name: str, pct: int, error: NodeError
                           ) -> NodeError:
        """`name`, whose set failed (`error`), deleted if a client list read now shows nobody
        attached (a client that did fixed what it holds: the next pass reads it back); the
        error to report. One whose clients cannot be listed stays, as it was."""
        try:
            attached = attached_pids(mps.client_list(), name)
        except NodeError:
            return error
        if attached:
            return cap_not_set_attached(name, pct, error, pids=attached)
        return self._unmake(mps, name, pct, error)

    def _not_set(self, mps: MpsControlLike, name: str, pct: int, error: NodeError
                 ) -> NodeError:
        """Why a fresh namespace's percentage is not in force, once the namespace is made safe.
        The daemon refusing the set for clients attached: they attached first, uncapped. Any
        other failure (a busy daemon, a timeout) leaves a namespace nobody is attached to yet
        and that holds no percentage, which the first client to attach would fix as "no cap"
        for its lifetime (MPS fixes it at the first attach): it is deleted now, and made again
        by the next pass."""
        if error.reason == NAMESPACE_BUSY:
            error = cap_unverified(name, pct, [], said=error.message)
        self._uncap(name)
        if error.reason in (NAMESPACE_CAP_UNVERIFIED, NAMESPACE_CAP_NOT_SET) \
                or name not in self.e._fresh:
            return error  # clients attached, or already deleted (or undeletable) by the remake
        return self._unmake(mps, name, pct, error)

    def _unmake(self, mps: MpsControlLike, name: str, pct: int, error: NodeError
                ) -> NodeError:
        """Deletes `name`, which nobody was seen attached to and whose percentage could not be
        set (`error`); the error to report: `NamespaceCapNotSet`, saying whether it went. One
        that cannot be deleted stays (fresh if it was): the next pass sets its percentage once
        nobody is attached. A delete the daemon refuses because a client has attached since
        (NamespaceBusy) is `NamespaceCapUnverified`: that client runs without the cap."""
        try:
            mps.namespace_delete(name, missing_ok=True)
        except NodeError as e:
            if e.reason == NAMESPACE_BUSY:
                return cap_not_set_attached(name, pct, error, delete_error=e)
            return cap_not_set(name, pct, error, e)
        self.deleted.append(name)
        self.e._namespace_gone(name)
        return cap_not_set_deleted(name, pct, error)

    def _set_or_remake(self, mps: MpsControlLike, name: str, pct: int) -> bool:
        """Sets the percentage of `name`, which no client is attached to; True when the
        namespace had to be made again for it. MPS fixes a namespace's percentage at its first
        attach, for good: once its clients have come and gone, the daemon refuses another (or
        keeps the old one, read back), and only a namespace of the same name made again takes
        it. Raises NamespaceBusy when a client is attached (the namespace stays), and
        NamespaceCapUnverified when one attached to the namespace made again before its set."""
        refused = self._set(mps, name, pct)
        if refused is not None:
            self._remake(mps, name, pct, refused)
        return refused is not None

    def _set(self, mps: MpsControlLike, name: str, pct: int) -> MpsError | None:
        """Sets the percentage of `name`: None when it took, the daemon's refusal when it turns
        away another than the one MPS fixed (`SET_REFUSED`). Raises any other failure, which
        leaves the namespace holding what it held."""
        try:
            mps.namespace_set_active_thread_percentage(name, pct)
        except MpsError as e:
            if e.reason not in SET_REFUSED:
                raise
            return e
        return None

    def _remake(self, mps: MpsControlLike, name: str, pct: int, refused: MpsError) -> None:
        """Deletes `name` and makes it again to take `pct`, which the daemon `refused`."""
        try:
            mps.namespace_delete(name)
        except MpsError as e:
            # clients attached: the set's own refusal says so best, when it did
            raise refused if e.reason == refused.reason == NAMESPACE_BUSY else e from None
        self.deleted.append(name)
        self.e._namespace_gone(name)
        mps.namespace_create(name)
        self.created.append(name)
        self.e._fresh.add(name)  # verified like every namespace made here
        try:
            mps.namespace_set_active_thread_percentage(name, pct)
        except NodeError as e:
            raise self._not_set(mps, name, pct, e) from None

    # cgroup limits -----------------------------------------------------------------------------

    def _owners(self, target: LimitTarget) -> list[ContainerDesired]:
        return [c for c in self.d.containers if c.key.pod_uid == target.pod_uid
                and Mechanism.CGROUP in c.mechanisms
                and (target.container is None or c.key.container == target.container)
                and target.gpu_uuid in c.plan.device_uuids]

    def cgroup_limits(self) -> None:
        for c in self.d.containers:
            if Mechanism.CGROUP in c.mechanisms and c.container_cgroup is None:
                self.leaf_pending.add(c.key)
        ready: list[tuple[LimitTarget, list[ContainerKey]]] = []
        for t in self.d.limits:
            keys = [c.key for c in self._owners(t)]
            if not self.e.cgroup_fs.exists(t.path):
                if t.container is None:
                    self.fail(keys, NodeError(
                        f"the pod's cgroup {t.path} does not exist yet (kubelet creates it when "
                        "the pod starts on this node); the limits are applied as soon as it "
                        "does. If it never appears, check --cgroup-root and --cgroup-driver "
                        "against the kubelet's configuration", reason=CGROUP_NOT_FOUND))
                else:
                    self.leaf_pending.update(keys)
                continue
            ready.append((t, keys))
        # Claimed before written: a crash in between leaves a claim, not a stray limit. A
        # target no container applies (a refused pod's limit kept as the kernel holds it) is
        # not claimed: the agent may not have set it.
        self.e._limited.update((t.gpu_uuid, t.path) for t, keys in ready if keys)
        self.save_ledger()
        for t, keys in ready:
            try:
                write = self.e.limits.ensure(t)
            except LimitNotSet as err:
                if self._slice_owners(t):
                    # Read back without the plan's limit, and not set: known not in force.
                    self.e._unlimited[t] = err.before
                    self.unset[t] = err.cause
                    self.fail(keys, limit_not_in_force(t, err.before, err.cause))
                else:
                    # A container's own cgroup: the pod slice still caps it (the limit is
                    # hierarchical), so this says nothing against its marker. (Or a target no
                    # container of the pod's slice applies: a refused pod's kept limit.)
                    self.fail(keys, err)
                continue
            except NvmlError as err:
                # The read failed: that proves nothing of the limit in force (it may well be
                # there, as the last pass left it), so the container is pending for it and its
                # marker kept, unless an earlier pass knew the limit missing (`_unlimited`).
                self.fail(keys, err)
                continue
            self.e._unlimited.pop(t, None)  # read back in force, or set now
            self.e._clean.discard((t.gpu_uuid, t.path))
            if write is not None:
                self.writes.append(write)
            for k in keys:
                self.in_force.setdefault(k, []).append(t)

    def _slice_owners(self, t: LimitTarget) -> list[ContainerDesired]:
        """The containers `t` caps as their pod's slice: every cgroup-limited container of the
        pod on its GPU (empty for a container's own cgroup, or a refused pod's kept limit)."""
        if t.container is not None:
            return []
        return [c for c in self._owners(t) if c.pod_cgroup == t.path]

    def limit_missing(self, c: ContainerDesired) -> tuple[LimitTarget, MemoryLimits] | None:
        """A slice limit of `c`'s known not in force (`Engine._unlimited`), and what was read
        back there; this pass's or an earlier one's."""
        if Mechanism.CGROUP not in c.mechanisms:
            return None
        for t, before in self.e._unlimited.items():
            if t.container is None and t.path == c.pod_cgroup \
                    and t.gpu_uuid in c.plan.device_uuids:
                return t, before
        return None

    def limit_error(self, missing: tuple[LimitTarget, MemoryLimits], error: NodeError
                    ) -> NodeError:
        """The error to report for a container whose slice limit is known not in force
        (`limit_missing`): MEMORY_LIMIT_NOT_IN_FORCE, whatever failed first in this pass (it
        is named in the message), so that its reason alone tells it from one pending for a
        reason that keeps its marker."""
        if error.reason == MEMORY_LIMIT_NOT_IN_FORCE:
            return error
        t, before = missing
        cause = self.unset.get(t)
        if cause is not None:
            return limit_not_in_force(t, before, cause)
        return limit_not_in_force(t, before, error, now=False)

    def sweep_limits(self) -> None:
        """Clear limits on the cgroups (and below) of our pods that no desired target names.
        Ours: `DesiredState.owned_pods`, or a cgroup this engine limited; any other pod's
        limit is left as it is (someone else set it)."""
        if not any(Mechanism.CGROUP in c.mechanisms for c in self.d.containers):
            try:
                if not self.e.limits.supported():
                    return
            except NvmlError as e:
                self.issues.append(_issue(e))
                return
        wanted = {(t.gpu_uuid, t.path) for t in self.d.limits}
        gpus = [d.uuid for d in self.devices.values() if not d.mig_enabled]  # MIG: no limits
        limited = self.e._limited
        seen: set[str] = set()
        for pc in self.e.layout.scan(self.e.cgroup_fs):
            owned = pc.uid in self.d.owned_pods
            for path in (pc.path, *pc.children):
                seen.add(path)
                for uuid in gpus:
                    key = (uuid, path)
                    if key in wanted or key in self.d.unread or key in self.e._clean \
                            or not (owned or key in limited):
                        continue
                    try:
                        write = self.e.limits.clear(uuid, path)
                    except NvmlError as e:
                        limited.add(key)  # ours (a marker may go before the next pass)
                        self.issues.append(Issue(e.reason, f"could not clear the stale GPU "
                                                 f"memory limit on {path}: {e.message}"))
                        continue
                    self.e._clean.add(key)
                    limited.discard(key)
                    if write is not None:
                        self.writes.append(write)
                        self.cleared.append(key)
        # A removed cgroup took its limits with it.
        limited.difference_update([key for key in limited if key[1] not in seen])
        self.save_ledger()

    def save_ledger(self) -> None:
        self.issues.extend(i for i in self.e._save_ledger() if i not in self.issues)

    def sweep_namespaces(self) -> None:
        """Delete MPS namespaces this engine made (by their name's shape) that no desired
        container names. A namespace with clients attached stays until they exit."""
        mps = self.e.mps
        if mps is None:
            return
        try:
            if not _has_namespaces(mps):
                return
            existing = mps.namespace_list()
        except NodeError as e:
            self.issues.append(_issue(e))
            return
        keep = self.d.mps_namespaces
        for name in existing:
            if not is_our_namespace(name) or name in keep:
                continue
            try:
                mps.namespace_delete(name, missing_ok=True)
                self.deleted.append(name)
                self.e._namespace_gone(name)
            except NodeError as e:
                self.issues.append(Issue(e.reason, f"could not delete the stale MPS namespace "
                                         f"{name}: {e.message}"))

    # report ----------------------------------------------------------------------------------

    def cap_missing(self, c: ContainerDesired) -> bool:
        """What the engine knows, not only this pass: a pass failing before it reaches the
        namespace or the pinned limit learns nothing that puts them right."""
        name = c.mps_namespace
        return (self.mps_gone and relies_on_mps(c)) or self.pin_lost(c) is not None or (
            name is not None and (name in self.e._uncapped or name in self.e._fresh
                                  or name in self.e.pins.suspect))

    def pin_lost(self, c: ContainerDesired, since: NodeError | None = None
                 ) -> MpsError | None:
        """MpsPinnedLimitLost while a GPU of the mps-pinned container `c` is known to lack its
        default pinned limit (`PinnedLimits.lost`); `since`: this pass's failure."""
        if Mechanism.MPS_PINNED not in c.mechanisms:
            return None
        for g in self.d.gpus:
            if g.uuid in c.plan.device_uuids and g.mps_pinned_mib is not None:
                lost = self.e.pins.lost_error(g.index, since)
                if lost is not None:
                    return lost
        return None

    def pinned_gpus(self, c: ContainerDesired) -> list[int]:
        """The indexes of the GPUs whose default pinned limit the mps-pinned container `c`
        relies on."""
        if Mechanism.MPS_PINNED not in c.mechanisms:
            return []
        return [g.index for g in self.d.gpus
                if g.uuid in c.plan.device_uuids and g.mps_pinned_mib is not None]

    def cap_error(self, c: ContainerDesired, error: NodeError) -> NodeError:
        """The error to report for a container whose MPS cap is known not in force
        (`cap_missing`): one of CAP_NOT_IN_FORCE_REASONS, so that its reason alone tells it
        from one pending for a reason that keeps its marker. Where the step that failed first
        was not about the cap (a client list, the daemon down), the cap's reason names it.
        While the daemon is not running (`mps_gone`), that is what the message says."""
        if self.mps_gone and self.mps_down is not None:  # the daemon, and the caps with it
            return cap_gone_with_daemon(c.mps_namespace, c.active_thread_percentage,
                                        self.mps_down, pinned=self.pinned_gpus(c))
        if error.reason in CAP_NOT_IN_FORCE_REASONS:
            return error
        lost = self.pin_lost(c, error)
        if lost is not None:
            return lost
        name, pct = c.mps_namespace or "", c.active_thread_percentage or 0
        if name in self.e.pins.suspect:
            return suspect_error(name, error=error)
        if error.reason == NAMESPACE_BUSY:  # the daemon says clients are attached: uncapped
            return cap_not_set_attached(name, pct, error)
        if name in self.e._uncapped:
            return cap_not_held(name, pct, error)
        return cap_not_verified(name, pct, error)

    def report(self) -> ApplyReport:
        results: dict[ContainerKey, ContainerResult] = {}
        for r in self.d.refusals:
            results[r.key] = ContainerResult(
                key=r.key, ref=r.ref,
                state=ContainerState.REFUSED if r.final else ContainerState.PENDING,
                reason=r.reason.value, message=r.message, plan_digest=r.plan_digest or None)
        for c in self.d.containers:
            error = self.failed.get(c.key)
            common = dict(key=c.key, ref=c.ref, plan_digest=c.plan.digest,
                          mechanisms=c.mechanisms, compute=c.compute,
                          mps_namespace=c.mps_namespace,
                          limits=tuple(self.in_force.get(c.key, ())),
                          container_limit_pending=c.key in self.leaf_pending)
            if error is not None:
                missing = self.cap_missing(c)
                unlimited = self.limit_missing(c)
                if missing:  # an MPS cap's reason first: its event and message say what to do
                    error = self.cap_error(c, error)
                elif unlimited is not None:
                    error = self.limit_error(unlimited, error)
                results[c.key] = ContainerResult(state=ContainerState.PENDING,
                                                 reason=error.reason, message=error.message,
                                                 mps_cap_missing=missing,
                                                 limit_missing=unlimited is not None, **common)
            else:
                results[c.key] = ContainerResult(state=ContainerState.APPLIED, **common)
        return ApplyReport(
            at=self.at, containers=MappingProxyType(results), gpus=tuple(self.gpu_results),
            writes=tuple(self.writes), cleared=tuple(self.cleared),
            namespaces_created=tuple(self.created), namespaces_deleted=tuple(self.deleted),
            compute_modes_set=tuple(self.modes_set), issues=tuple(self.issues))
