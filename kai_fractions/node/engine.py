"""The reconcile API of the node engine: `apply(desired)` and `release(pod)`.

Level-triggered and idempotent: every call reads what the GPU, the cgroup tree and the MPS
daemon say now and writes only the difference, so an engine started over any state (an agent
restart, a crash between two writes) converges to the desired state, and a second `apply` of
the same state writes nothing. The little private state it keeps (which cgroups are known
clean, which MPS namespace caps and pinned limits it set) only saves reads, except facts no
read gives back, which keep their containers pending: which MPS namespaces it created whose cap
is not verified in force yet (a client may have attached before it was set: `Engine._fresh`),
and which GPUs' default pinned limits it found lost and has not set since, and which namespaces
were there while they were (`Engine.pins`, `kai_fractions.node.mps_pinned`), which pod
slices' GPU memory limits it read back missing and could not set (`Engine._unlimited`), and
which GPUs sm-sharing needs in EXCLUSIVE_PROCESS it read back in another compute mode and could
not set (`Engine._wrong_mode`).

A container is reported `applied` only when everything its plan needs is in force: its GPUs'
compute mode, its MPS namespace and pinned limit, and the cgroup limit on its pod's slice
(the container's own cgroup gets its limit too once the runtime has created it). Any error
leaves it `pending` with the reason, and the next `apply` tries again. A container pending
because something its plan needs is KNOWN not in force (`ContainerResult.not_in_force`: an MPS
cap, including every one that went with an MPS control daemon that is not running or that its
GPU's compute mode does not hold, or its pod slice's memory limit) says so, under a reason of
its own (NOT_IN_FORCE_REASONS): no readiness marker may vouch for it then; any other pending
reason (a failed call, a read that failed) says nothing of what is in force.

One apply is a `_Run`: the order of its steps, the compute modes and the report stay here; its
state is `engine_run.RunState`, and its other steps, subclasses of it, have modules of their
own: the MPS daemon's in `engine_mps` (its namespaces in `engine_mps_namespaces`), the cgroup
memory limits in `engine_cgroup_limits`. The report types are `engine_reports`'s, re-exported
here for the engine's users.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType

from ..contract import mps_namespace_name
from .cgroups import CgroupFs
from .config import Mechanism, NodeConfig
from .desired import (
    ComputeEnforcement,
    ContainerDesired,
    ContainerKey,
    DesiredState,
    LimitTarget,
)
from .engine_cgroup_limits import CGROUP_NOT_FOUND, CgroupLimitStep, UnsettableGpus
from .engine_compute_modes import ComputeModeStep
from .engine_mps import (
    MPS_UNAVAILABLE,
    MpsControlLike,
    MpsStep,
    _has_namespaces,
    is_our_namespace,
    relies_on_mps,
)
from .engine_reports import (
    COMPUTE_MODE_NOT_IN_FORCE,
    NOT_IN_FORCE_REASONS,
    ApplyReport,
    ContainerResult,
    ContainerState,
    GpuResult,
    Issue,
    ReleaseReport,
    _issue,
)
from .errors import NodeError, NvmlCgroupUnavailable, NvmlError
from .limit_ledger import LEDGER_NOT_WRITTEN, LimitLedger, MemoryLimitLedger
from .memory_limits import MemoryLimitEnforcer
from .mps_caps import CAP_NOT_IN_FORCE_REASONS
from .mps_pinned import PinnedLimits
from .nvml import GpuComputeMode, MemoryLimits, Nvml

__all__ = [  # the engine's API, and what its users import from here (the reports, the reasons)
    "CAP_NOT_IN_FORCE_REASONS",
    "CGROUP_NOT_FOUND",
    "COMPUTE_MODE_NOT_IN_FORCE",
    "MPS_UNAVAILABLE",
    "NOT_IN_FORCE_REASONS",
    "ApplyReport",
    "ContainerResult",
    "ContainerState",
    "Engine",
    "GpuResult",
    "Issue",
    "MpsControlLike",
    "ReleaseReport",
    "is_our_namespace",
    "relies_on_mps",
]

log = logging.getLogger(__name__)

# -- the engine -----------------------------------------------------------------------------


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
        self._switched: dict[str, GpuComputeMode] = {
            uuid: GpuComputeMode[name] for uuid, name in self.ledger.load_modes().items()
            if name in GpuComputeMode.__members__}
        """GPUs this agent put in EXCLUSIVE_PROCESS -> the mode it found there, given back once
        no fractional container is left (`engine_compute_modes`; saved in the ledger before
        each switch). Not a cache: `forget()` keeps it."""
        self._unrecorded_exclusive: set[str] = set()
        """GPUs found in EXCLUSIVE_PROCESS with no fractional container and no `_switched`
        record, logged once as left as they are (`engine_compute_modes`)."""
        self._wrong_mode: dict[str, tuple[GpuComputeMode, NvmlError]] = {}
        """GPUs an sm-sharing plan needs in EXCLUSIVE_PROCESS that read back another compute
        mode and could not be set: uuid -> (the mode read back, the set's error). There a
        process that leaves MPS opens a context of its own, outside every MPS cap. Kept until
        the mode is set or read back in force, or no plan needs it, so that a pass failing
        before it reads the mode (NVML down) still reports it (`ContainerResult.mps_cap_missing`,
        COMPUTE_MODE_NOT_IN_FORCE). Not a cache: `forget()` keeps it."""
        self._limits_not_settable = UnsettableGpus()
        """GPUs on which no cgroup memory limit can be put in force -> the last failure: in
        NOT_SETTABLE_PASSES passes in a row that said something of the GPU, a set on a pod
        slice there failed (`LimitNotSet`), or a slice's read failed NotSupported or
        NoPermission, and no set there succeeded. Only sets count: a slice limit read back in
        force (an earlier agent's, one with root) does not hide new pods' sets that fail; a
        container's own cgroup does not count (the slice caps it); one failed pass (a transient
        NVML error) reports nothing. Forgotten once a set there succeeds or every target there
        reads back in force, or no target is left on it; kept through a pass that says nothing
        of it (`engine_cgroup_limits.UnsettableGpus`). Not a cache: `forget()` keeps it."""
        self.pins = PinnedLimits()
        """The MPS default pinned device memory limits: MiB written (a cache), GPUs whose limit
        is known lost and namespaces that may hold a server started without it (not caches)."""
        self._last: DesiredState | None = None

    @property
    def wrong_mode(self) -> Mapping[str, tuple[GpuComputeMode, NvmlError]]:
        """A read-only copy of `_wrong_mode`: the node condition names these GPUs
        (`agent.condition`, ComputeModeNotInForce), since KAI would otherwise keep placing
        sm-sharing pods there that can only wait."""
        return MappingProxyType(dict(self._wrong_mode))

    @property
    def limits_not_settable(self) -> Mapping[str, NvmlError]:
        """A read-only copy of `_limits_not_settable`: the node condition names these GPUs
        (`agent.condition`, MemoryLimitsNotSettable), since KAI would otherwise keep placing
        fractional pods there that can only wait."""
        return MappingProxyType(dict(self._limits_not_settable))

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

    def cgroup_went(self, error: NvmlError, path: str) -> bool:
        """Whether `error` is NVML failing to open cgroup `path` (NvmlCgroupUnavailable)
        because it is gone since it was checked (the pod is going): its limits went with it
        (nvml.h), so nothing of ours is missing or left there."""
        return isinstance(error, NvmlCgroupUnavailable) and not self.cgroup_fs.exists(path)

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
        exclusive = {g.uuid for g in desired.gpus
                     if g.compute_mode is GpuComputeMode.EXCLUSIVE_PROCESS}
        self._wrong_mode = {u: w for u, w in self._wrong_mode.items() if u in exclusive}
        self.pins.keep_only(desired.mps_namespaces)
        run = _Run(self, desired, mps_down, mps_not_running=mps_not_running)
        run.go()
        self._last = desired
        return run.report()

    # -- release ----------------------------------------------------------------------------

    def release(self, pod_uid: str, container: str | None = None, *,
                container_names: Iterable[str] = ()) -> ReleaseReport:
        """Remove what is enforced for a pod (or one container of it): its cgroup limits on every
        GPU and its MPS namespaces. Idempotent; reads before it writes. A cgroup that is not
        there, or that goes before its clear, is not an issue: its limits went with it.

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
                # A removed cgroup takes its limits with it: nothing of ours is left there.
                self._limited.difference_update([k for k in self._limited if k[1] == path])
                continue
            for uuid in uuids:
                try:
                    if self.limits.clear(uuid, path) is not None:
                        cleared.append((uuid, path))
                    self._clean.add((uuid, path))
                    self._limited.discard((uuid, path))
                except NvmlError as e:
                    if self.cgroup_went(e, path):  # since the check above: nothing is left
                        self._limited.discard((uuid, path))
                        continue
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


class _Run(ComputeModeStep, MpsStep, CgroupLimitStep):
    """One apply: its steps in order (`go`), then the report (state: `engine_run.RunState`)."""

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

    def mode_missing(self, c: ContainerDesired
                     ) -> tuple[str, GpuComputeMode, NvmlError] | None:
        """A GPU of the sm-sharing container `c` known not in EXCLUSIVE_PROCESS
        (`Engine._wrong_mode`, this pass's or an earlier one's): its uuid, the mode read back and
        the set's error."""
        if c.compute is ComputeEnforcement.TIME_SLICING:
            return None
        for uuid in c.plan.device_uuids:
            if uuid in self.e._wrong_mode:
                return (uuid, *self.e._wrong_mode[uuid])
        return None

    # report ----------------------------------------------------------------------------------

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
            # The compute mode's reason before any other: no MPS cap holds without it.
            wrong = self.mode_missing(c)
            if wrong is not None:
                error = compute_mode_not_in_force(*wrong, error)
            if error is not None:
                missing = wrong is not None or self.cap_missing(c)
                unlimited = self.limit_missing(c)
                if wrong is None and missing:  # an MPS cap's reason next: its event and
                    error = self.cap_error(c, error)  # message say what to do
                elif wrong is None and unlimited is not None:
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


def compute_mode_not_in_force(uuid: str, read: GpuComputeMode, cause: NvmlError,
                              error: NodeError | None = None) -> NvmlError:
    """The error of an sm-sharing container whose GPU `uuid` is known not in EXCLUSIVE_PROCESS:
    read back as `read`, and the set failed with `cause`. `error`: what the container failed at
    first in this pass; `cause` itself when this pass's set failed (compute modes come first),
    else what puts nothing right (a read that failed, NVML down), named in the message."""
    now = error is None or error is cause
    why = (f"could not be set ({cause.reason}: {cause.message})" if now else
           f"could not be set ({cause.reason}) and is not known set since (this pass: "
           f"{error.reason}: {error.message})")
    return NvmlError(
        f"GPU {uuid} {'reads' if now else 'was read'} back compute mode {read.name}, not the "
        f"EXCLUSIVE_PROCESS sm-sharing needs, and {why}: there a process that leaves MPS (no "
        "CUDA_MPS_PIPE_DIRECTORY) runs outside the container's MPS caps. It stays pending, its "
        "readiness marker set aside, until the mode is in force (retried every pass): let the "
        f"agent set it, or run nvidia-smi -i {uuid} -c EXCLUSIVE_PROCESS",
        function=cause.function, code=cause.code, reason=COMPUTE_MODE_NOT_IN_FORCE)
