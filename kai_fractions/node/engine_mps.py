"""The MPS step of one apply (`kai_fractions.node.engine`): the daemon's default pinned limits,
the sweep of stale namespaces, and what the report says of a container's MPS cap.

A step of the engine's `_Run` over the apply's state (`engine_run.RunState`), built on the
namespace step (`kai_fractions.node.engine_mps_namespaces`): separate from the namespaces
themselves (how one is made and its percentage put in force, the bulk of the work) and from
the cgroup limits.
Also the MPS control seam as the engine uses it (`MpsControlLike`) and which containers and
namespaces rely on the daemon or are ours.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

from ..contract import is_mps_namespace_name
from .config import Mechanism
from .desired import ComputeEnforcement, ContainerDesired, ContainerKey, DesiredState
from .engine_mps_namespaces import NamespaceStep, uncap
from .engine_reports import Issue, _issue
from .errors import NodeError
from .mps.errors import (
    MPS_BINARY_NOT_FOUND,
    MPS_DAEMON_NOT_ANSWERING,
    MPS_DAEMON_UNREACHABLE,
    NAMESPACE_BUSY,
    MpsError,
)
from .mps_caps import (
    CAP_NOT_IN_FORCE_REASONS,
    MpsClientLike,
    cap_gone_with_daemon,
    cap_not_held,
    cap_not_set_attached,
    cap_not_verified,
)
from .mps_pinned import DAEMON_NOT_RUNNING, MPS_PINNED_LIMIT_LOST, suspect_error
from .plan_refusals import PINNED_NOT_A_TIER, hard_tiers_of

if TYPE_CHECKING:
    from .engine import Engine  # which builds on this module

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
MPS_UNAVAILABLE = "MPSUnavailable"


def relies_on_mps(c: ContainerDesired) -> bool:
    """Whether what `c`'s plan needs in force relies on the node's MPS control daemon: an
    sm-sharing container (its processes are MPS clients, its share of the SMs is an MPS
    server's, even where no namespace or pinned limit is applied for it: a driver without
    namespaces caps it by its client env alone), one with an MPS namespace, or an mps-pinned
    one. When the daemon is not running, none of that is in force."""
    return (c.compute is not ComputeEnforcement.TIME_SLICING or bool(c.mps_namespace)
            or Mechanism.MPS_PINNED in c.mechanisms)


def pinned_is_a_tier(c: ContainerDesired) -> bool:
    """Whether `c`'s GPUs' default pinned limit is one of its memory tiers (`hard_tiers_of`):
    mps-pinned in an MPS namespace of its own. On a daemon without namespaces the limit is set
    but caps nothing the agent vouches for (its tenants can change it), so losing it holds no
    container back and sets no marker aside."""
    return Mechanism.MPS_PINNED in hard_tiers_of(c.mechanisms, c.compute)


def is_our_namespace(name: str) -> bool:
    """Only namespaces the contract's naming makes are ours to delete, never an operator's."""
    return is_mps_namespace_name(name)


def caps_not_on_daemon(engine: Engine, desired: DesiredState, cause: str) -> None:
    """The MPS control daemon holds none of the caps of `desired`'s containers that rely on it
    (`relies_on_mps`): it is not running (DAEMON_NOT_RUNNING), or it was started since they
    were put on one (DAEMON_STARTED: a restart, or a fresh agent's first start; a daemon
    starts with no namespace, percentage or pinned limit). Their namespaces are known without
    their percentage (`Engine._uncapped`, until one is made again and verified), and the
    default pinned limits of their mps-pinned containers' GPUs lost (`PinnedLimits.lost`,
    `cause` saying why, until a set succeeds): an apply that cannot put them back (a busy
    daemon, a timeout) reports them not in force, so no marker keeps vouching for them."""
    needs_mps = [c for c in desired.containers if relies_on_mps(c)]
    for c in needs_mps:
        if c.mps_namespace:
            uncap(engine, c.mps_namespace)
    for g in desired.gpus:
        if g.mps_pinned_mib is not None and any(
                Mechanism.MPS_PINNED in c.mechanisms and g.uuid in c.plan.device_uuids
                for c in needs_mps):
            engine.pins.daemon_gone(g.index, g.uuid, g.mps_pinned_mib, cause)


NO_ANSWER = frozenset({MPS_DAEMON_UNREACHABLE, MPS_DAEMON_NOT_ANSWERING, MPS_BINARY_NOT_FOUND})
"""The reasons of a command that no daemon answered: it may have died (mid-pass: the supervisor's
next check tells), and the MPS server that enforces an sm-sharing container's share of the SMs
with it."""


class _SeenErrors:
    """The pinned-limit commands of `PinnedLimits.ensure`, noting each error the daemon gave
    (`seen`) before `ensure` words it as a loss: whether any daemon answered at all."""

    def __init__(self, mps: MpsControlLike):
        self.mps = mps
        self.seen: list[NodeError] = []

    def get_default_pinned_mem_limit(self, device_index: int) -> str:
        try:
            return self.mps.get_default_pinned_mem_limit(device_index)
        except NodeError as e:
            self.seen.append(e)
            raise

    def set_default_pinned_mem_limit(self, device_index: int, mib: int) -> str:
        try:
            return self.mps.set_default_pinned_mem_limit(device_index, mib)
        except NodeError as e:
            self.seen.append(e)
            raise


def _has_namespaces(mps: MpsControlLike) -> bool:
    """Whether the daemon speaks the v3 protocol (namespaces); assumed when it cannot say."""
    probe = getattr(mps, "supports_protocol_v3", None)
    return True if probe is None else bool(probe())


class MpsStep(NamespaceStep):
    """The MPS step of an apply: the daemon, the pinned limits, then the namespaces."""

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
            if self.mps_gone:  # not running: what it held went with it
                caps_not_on_daemon(self.e, self.d, DAEMON_NOT_RUNNING)
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
            control = _SeenErrors(mps)
            try:
                self.e.pins.ensure(control, g.index, g.uuid, g.mps_pinned_mib,
                                   [c.mps_namespace for c in users if c.mps_namespace])
            except NodeError as e:
                capped = [c.key for c in users if pinned_is_a_tier(c)]
                self.fail(capped, e)
                self.unpinned.update(capped)
                if len(capped) < len(users):
                    self._not_a_tier(g.index, g.uuid, g.mps_pinned_mib, e, control.seen,
                                     [c.key for c in users if not pinned_is_a_tier(c)])
            if made is None:
                continue
            self.e.pins.confirm(made)  # just made: there
            for c in users:
                if c.mps_namespace in self.e.pins.suspect:
                    self.fail([c.key], suspect_error(c.mps_namespace or ""))

    def _not_a_tier(self, index: int, uuid: str, mib: int, error: NodeError,
                    seen: list[NodeError], keys: list[ContainerKey]) -> None:
        """A GPU's default pinned limit not known in force (`error`; `seen`: the daemon's own
        errors) where it is no tier of its containers (`keys`, `pinned_is_a_tier`): a node
        issue (the next pass sets it again), not theirs, which their other tiers cap. Unless
        no daemon answered: the MPS server their share of the SMs needs may be gone with it,
        so they are pending with that error (the supervisor's next check tells)."""
        gone = next((e for e in seen if e.reason in NO_ANSWER), None)
        if gone is not None:
            self.fail(keys, gone)
            return
        issue = self._not_a_tier_issue(index, uuid, mib, error)
        log.warning("%s", issue.message)
        self.issues.append(issue)

    def _not_a_tier_issue(self, index: int, uuid: str, mib: int, error: NodeError) -> Issue:
        """The node issue of `_not_a_tier`."""
        loss = self.e.pins.lost.get(index)
        why = (loss.cause if error.reason == MPS_PINNED_LIMIT_LOST and loss is not None
               else error.message)
        return Issue(error.reason, (
            f"the MPS daemon's default pinned device memory limit of GPU {index} ({uuid}) is "
            f"not known to be the plan's {mib} MiB ({error.reason}: {why}); it is no tier of "
            f"the sm-sharing containers there ({PINNED_NOT_A_TIER}), so they stay applied on "
            "the tiers that cap them; the agent sets it again at the next pass"))

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
        default pinned limit (`PinnedLimits.lost`); `since`: this pass's failure. None where
        that limit is no tier of `c` (`pinned_is_a_tier`)."""
        if not pinned_is_a_tier(c):
            return None
        for g in self.d.gpus:
            if g.uuid in c.plan.device_uuids and g.mps_pinned_mib is not None:
                lost = self.e.pins.lost_error(g.index, since)
                if lost is not None:
                    return lost
        return None

    def pinned_gpus(self, c: ContainerDesired) -> list[int]:
        """The indexes of the GPUs whose default pinned limit the mps-pinned container `c`
        relies on: none where it is no tier of `c` (`pinned_is_a_tier`)."""
        if not pinned_is_a_tier(c):
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
