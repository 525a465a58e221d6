"""Each container's MPS namespace with its active-thread percentage in force: the namespace
part of the MPS step of one apply (`kai_fractions.node.engine`).

MPS fixes a namespace's percentage when its first client attaches, for the client's lifetime, so
a namespace is made, set, verified by a client list, made again or deleted with care; this is
the bulk of the MPS step, so it has a module of its own beside `engine_mps` (the pinned limits,
the sweep, the report's view of a cap).

A step of the engine's `_Run` over the apply's state (`engine_run.RunState`); of the Engine
(`e`) it uses what it remembers of namespaces across passes: `_fresh`, `_uncapped`, `_atp`,
`_atp_checked`, `pins`, `_namespace_gone`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .desired import ContainerDesired, ContainerKey
from .engine_run import RunState
from .errors import NodeError
from .mps.errors import NAMESPACE_BUSY, NAMESPACE_EXISTS, MpsError
from .mps_caps import (
    NAMESPACE_CAP_NOT_SET,
    NAMESPACE_CAP_UNVERIFIED,
    SET_REFUSED,
    MpsClientLike,
    attached_pids,
    cap_not_held_by_clients,
    cap_not_made,
    cap_not_set,
    cap_not_set_attached,
    cap_not_set_deleted,
    cap_unverified,
    namespace_busy,
)
from .mps_pinned import suspect_error

if TYPE_CHECKING:
    from .engine import Engine
    from .engine_mps import MpsControlLike  # that module builds on this one


def uncap(engine: Engine, name: str) -> None:
    """`name` is known not to hold its percentage (`Engine._uncapped`): whatever `engine` set
    there is not what it holds."""
    engine._uncapped.add(name)
    engine._atp.pop(name, None)
    engine._atp_checked.discard(name)


class NamespaceStep(RunState):
    """The MPS namespaces of an apply, each with its percentage in force."""

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
        uncap(self.e, name)

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
