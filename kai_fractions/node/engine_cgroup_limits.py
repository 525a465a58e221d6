"""The cgroup step of one apply (`kai_fractions.node.engine`): the GPU memory limits on the pod
slices and container cgroups its plan names, the sweep of stale ones, what the report says of a
slice limit known not in force, and which GPUs take no limit at all (`Engine.limits_not_settable`,
`UnsettableGpus`: the sets there fail pass after pass, so the node condition says so rather than
let KAI place pods there that can only wait).

A step of the engine's `_Run` over the apply's state (`engine_run.RunState`); of the Engine
(`e`) it uses `cgroup_fs`, `layout`, `limits`, `_limited`, `_unlimited`, `_clean`,
`_limits_not_settable` and `_save_ledger`. Separate from the MPS step: they share nothing but
the run.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from .config import Mechanism
from .desired import ContainerDesired, ContainerKey, LimitTarget
from .engine_reports import Issue, _issue
from .engine_run import RunState
from .errors import (
    CGROUP_NOT_FOUND,  # the engine's own reason, and NvmlCgroupUnavailable's
    NodeError,
    NvmlCgroupUnavailable,
    NvmlError,
    NvmlNoPermission,
    NvmlNotSupported,
)
from .memory_limits import MEMORY_LIMIT_NOT_IN_FORCE, LimitNotSet, limit_not_in_force
from .nvml import MemoryLimits

NOT_SETTABLE_PASSES = 2
"""Passes in a row whose outcome on a GPU is "failed" for a reason that may be a blip (Unknown,
GPULost, LimitNotReadBack, ...) before `UnsettableGpus` reports it: a pass that leaves a
container pending is retried within seconds, so such a GPU still shows within seconds, while one
transient NVML error (one pass) never turns the whole node not ready. A failure that cannot be a
blip (`_NO_LIMITS_AT_ALL`) is reported in its own pass."""

_NO_LIMITS_AT_ALL = (NvmlNotSupported, NvmlNoPermission)
"""A failed read, or a refused set, of one of these reasons says the GPU takes no limit at all
(the driver or GPU cannot, or the agent may not): no blip, the next pass would fail alike. A read
failed for any other reason proves nothing, not even of the GPU."""


def _no_limits_at_all(error: NvmlError) -> bool:
    """`error` (a failed read, or `LimitNotSet` with the set's failure as its cause) says the
    GPU takes no limit at all."""
    return isinstance(error.cause if isinstance(error, LimitNotSet) else error, _NO_LIMITS_AT_ALL)


class UnsettableGpus(Mapping[str, NvmlError]):
    """`Engine._limits_not_settable`: the GPUs on which no cgroup memory limit can be put in
    force, each with the last failure there; a read-only mapping of the GPUs reported, which
    also remembers those that failed in fewer passes so far (not reported yet).

    A pass's outcome on a GPU (`record_pass`): "failed" when a set on a pod slice there was
    attempted and failed (`LimitNotSet`: refused, or read back otherwise), or a pod slice's read
    failed NotSupported or NoPermission, and no set on the GPU succeeded; "ok" when a set there
    succeeded, or every target there it reached reads back in force or was set; else nothing
    (nothing reached, only a read failed for a reason that proves nothing, or only a container's
    own cgroup failed, which the slice above it caps; a cgroup NVML could not open,
    `NvmlCgroupUnavailable`, is the path's fault, not the GPU's: it says nothing either). Only
    sets count: a slice limit an earlier agent set reads back in force whether this one may set
    limits or not, so it does not make the GPU fine while new pods' sets fail there. A GPU is
    reported in the pass whose failure there cannot be a blip (`_NO_LIMITS_AT_ALL`: a set
    refused, or a slice's read failed, NotSupported or NoPermission), so that an agent restarted
    where every set is refused is not ready from its first pass (this count lives in memory);
    for any other failure once its outcome was "failed" in NOT_SETTABLE_PASSES passes that said
    something of it in a row. "ok" forgets it at once, a pass that says nothing leaves it as it
    was, a GPU without a target is dropped."""

    def __init__(self) -> None:
        self._failed: dict[str, tuple[int, NvmlError]] = {}  # uuid -> (passes in a row, error)

    def __getitem__(self, uuid: str) -> NvmlError:
        passes, error = self._failed[uuid]
        if passes < NOT_SETTABLE_PASSES:
            raise KeyError(uuid)
        return error

    def __iter__(self) -> Iterator[str]:
        return (u for u, (passes, _) in self._failed.items() if passes >= NOT_SETTABLE_PASSES)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def record_pass(self, targeted: set[str], outcome: Mapping[str, NvmlError | None]) -> None:
        """One pass: `targeted`, the GPUs with a limit target; `outcome`, for each GPU the pass
        said something of, None ("ok") or the failure ("failed")."""
        for uuid in [u for u in self._failed if u not in targeted]:
            del self._failed[uuid]
        for uuid, error in outcome.items():
            if error is None:
                self._failed.pop(uuid, None)
                continue
            passes = self._failed.get(uuid, (0, error))[0] + 1
            if _no_limits_at_all(error):
                passes = max(passes, NOT_SETTABLE_PASSES)
            self._failed[uuid] = (passes, error)


class CgroupLimitStep(RunState):
    """The cgroup limits of an apply: set, read back, swept."""

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
        # This pass's outcome per GPU (`UnsettableGpus`): the GPUs where a set succeeded,
        # those where a target failed, and the failure that counts against each GPU.
        set_ok: set[str] = set()
        not_ok: set[str] = set()
        failed: dict[str, NvmlError] = {}
        for t, keys in ready:
            try:
                write = self.e.limits.ensure(t)
            except LimitNotSet as err:
                not_ok.add(t.gpu_uuid)
                if self.e.cgroup_went(err.cause, t.path):
                    # The set could not open a cgroup removed since its read (the pod is
                    # going): no limit is missing from a cgroup that is not there. Pending for
                    # its cgroup, as after a read that could not open it.
                    self.fail(keys, err.cause)
                    continue
                # A set on a pod slice that failed counts against the GPU, unless NVML could
                # not open the slice (still there): the path's fault, not the GPU's. Either
                # way the read showed the limit absent: known not in force.
                if t.container is None and not isinstance(err.cause, NvmlCgroupUnavailable):
                    self._count_against(failed, t.gpu_uuid, err)
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
                # Against the GPU it counts only when it says the GPU takes no limit at all.
                # So does a read on a cgroup NVML could not open (NvmlCgroupUnavailable,
                # reason CGROUP_NOT_FOUND, the path named): gone since the check above, as a
                # going pod's is, or not where NVML looks; that says nothing of the GPU.
                not_ok.add(t.gpu_uuid)
                if t.container is None and isinstance(err, _NO_LIMITS_AT_ALL):
                    self._count_against(failed, t.gpu_uuid, err)
                self.fail(keys, err)
                continue
            if write is not None:
                set_ok.add(t.gpu_uuid)
            self.e._unlimited.pop(t, None)  # read back in force, or set now
            self.e._clean.discard((t.gpu_uuid, t.path))
            if write is not None:
                self.writes.append(write)
            for k in keys:
                self.in_force.setdefault(k, []).append(t)
        outcome: dict[str, NvmlError | None] = {
            uuid: None for uuid in {t.gpu_uuid for t, _ in ready}
            if uuid in set_ok or uuid not in not_ok}
        outcome.update((uuid, e) for uuid, e in failed.items() if uuid not in outcome)
        self.e._limits_not_settable.record_pass({t.gpu_uuid for t in self.d.limits}, outcome)

    @staticmethod
    def _count_against(failed: dict[str, NvmlError], uuid: str, err: NvmlError) -> None:
        """The failure of this pass that counts against GPU `uuid`: the first, unless a later
        one cannot be a blip and it could (that one is reported at once, and named)."""
        first = failed.get(uuid)
        if first is None or (_no_limits_at_all(err) and not _no_limits_at_all(first)):
            failed[uuid] = err

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
                        if self.e.cgroup_went(e, path):
                            limited.discard(key)  # removed since the scan: limits and all
                            continue
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
