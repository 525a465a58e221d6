"""Setting readiness markers aside, and restoring them, for the caps that are not in force
while no agent watches them: `MarkerSetAside`, a mixin of `reconciler.Reconciler`.

A marker vouches for caps; some go with something outside the pass: those that rely on the MPS
control daemon (gone when it is not running, or fresh: `set_aside_for_mps`, `_fresh_daemon`)
and those of a container whose only memory tier is the watchdog (unwatched while a pass
returns early or the agent stops: `set_aside_unwatched`, `set_aside_at_stop`). Their markers
are set aside (moved, not removed: they still hold the pod to its plan), and one the last
agent's stop set aside for the watchdog alone comes back on the next agent's first full pass
(`_restore_stopped`). Local file moves only: no API call.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from ...kube.objects import meta
from ...marker import ContainerMarker, Marker, MarkerState
from ..config import Mechanism
from ..desired import ContainerDesired, DesiredState
from ..engine import ContainerResult, relies_on_mps
from ..engine_reports import WATCHDOG_BLIND
from ..mps_caps import gone_with_daemon_reason
from .markers import (
    WATCHDOG_STOPPED,
    MarkerStore,
    entry_relies_on_mps,
    entry_watchdog_only,
    may_restore,
)
from .usage import UsageCheck, watchdog_only

if TYPE_CHECKING:
    from .mps_supervisor import MpsHealth, MpsSupervisor
    from .reconciler import NodeView

log = logging.getLogger(__package__ + ".reconciler")
"""The reconciler's logger, as before these methods moved here: what operators filter on."""


class MarkerSetAside:
    """The marker set-aside and restore methods of `Reconciler`, apart from the pass that calls
    them: they decide which markers go while caps are not in force, from the last plan or the
    markers themselves, and never plan, apply or publish. NOT thread-safe, as the `Reconciler`
    (`set_aside_at_stop` alone may run on another thread, through `abandon`).

    What they use of the `Reconciler` (set in its `__init__`): `markers` (the `MarkerStore`:
    read, set aside, restore, close), `view` (the last plan, `view.desired`, and
    `view.watchdog_stops`), `usage` (`UsageCheck.blindness`: where the watchdog is blind),
    `mps` and `mps_health` (the daemon: `starts`, `owned`), and `_applied_on_start` (the
    daemon's `starts` at the last apply with it usable)."""

    markers: MarkerStore
    view: NodeView
    usage: UsageCheck
    mps: MpsSupervisor | None
    mps_health: MpsHealth | None
    _applied_on_start: int | None

    def _daemon_new(self) -> bool:
        """Whether the daemon is one this agent started (`owned`) since its last apply with the
        daemon usable (`_applied_on_start`; any, for an agent that has not applied yet, as
        after a crash, whose daemon died with it): it holds none of the caps a marker written
        before vouches for (a daemon starts with no namespace, percentage or pinned limit). An
        adopted daemon (one that ran before this agent) holds what it held."""
        return (self.mps is not None and self.mps_health is not None and self.mps_health.owned
                and self.mps.starts != self._applied_on_start)

    def _fresh_daemon(self) -> None:
        """On a pass that returns before its apply, with a new daemon (`_daemon_new`): no apply
        put the caps on it yet, so the markers that vouch for them are set aside as for a
        daemon not running (`set_aside_for_mps`). A pass that applies takes those caps for
        gone instead (`engine_mps.caps_not_on_daemon`): it puts them back on the daemon,
        verified, before a marker is kept, and one whose MPS step fails reports them not in
        force, which sets the markers aside."""
        if self._daemon_new():
            self.set_aside_for_mps(_FRESH_DAEMON_CAUSE)

    def set_aside_unwatched(self, *, nvml_down: bool) -> list[str]:
        """On a pass that returns before it settles the pods (no pod list, one not confirmed,
        NVML down): the readiness marker of each pod with a container whose only memory tier
        is the watchdog, and that the watchdog cannot watch now, is set aside (a pass that
        settles does this through `UsageCheck.blind_results`): one of the last plan while NVML
        is down (`nvml_down`: no check runs) or on a GPU where the watchdog is blind
        (`UsageCheck.blindness`), and one no plan names, as its marker records (a fresh agent
        whose passes fail before they plan: no check watches it). `_set_aside_watchdog_only`;
        local file moves only. Returns the pods' uids."""
        blind = self.usage.blindness()

        def cause(containers: list[ContainerDesired] | None) -> str:
            why = ("no plan of this agent names the pod yet, so no watchdog check watches it"
                   if containers is None else
                   "NVML does not work, so no watchdog check runs" if nvml_down else
                   "the watchdog cannot see " + ", ".join(
                       f"GPU {u} ({blind[u].reason})" for u in sorted(
                           {u for c in containers for u in c.plan.device_uuids} & blind.keys())))
            return f"{why}; the marker is written again once a pass sees the watchdog watch again"

        return self._set_aside_watchdog_only(
            lambda c: nvml_down or bool(blind.keys() & set(c.plan.device_uuids)), cause)

    def _set_aside_watchdog_only(self, at_stake: Callable[[ContainerDesired], bool],
                                 cause: Callable[[list[ContainerDesired] | None], str],
                                 recorded: str | None = None) -> list[str]:
        """Sets aside the readiness marker of each pod with an applied entry of a container
        whose only memory tier is the watchdog (`usage.watchdog_only`) and that no watchdog
        watches now: for the pods the last plan names, its containers `at_stake` says so of;
        for the others (every pod, for an agent with no plan yet), the entries that record the
        watchdog alone (`markers.entry_watchdog_only`). `cause`: why, for the log, given the
        pod's containers (None: as its marker records); `recorded`: the cause recorded beside
        the marker (`MarkerStore.set_aside`: WATCHDOG_STOPPED at the agent's stop, so that the
        next agent may restore it). Set aside, not removed, as for the MPS caps
        (`set_aside_for_mps`). Returns the pods' uids."""
        done = []
        for uid, containers, names in self._set_aside_each(
                lambda c: watchdog_only(c, self.view.watchdog_stops) and at_stake(c),
                entry_watchdog_only, "no watchdog stops what exceeds its GPU memory cap",
                recorded):
            done.append(uid)
            who = (f"pod {containers[0].pod_namespace}/{containers[0].pod_name}" if containers
                   else f"pod {uid}")
            tier = ("the watchdog is its only GPU memory tier" if containers else
                    "its marker records the watchdog as its only GPU memory tier")
            log.warning("%s: set aside its marker: no watchdog watches %s: %s", who, ", ".join(
                f"container {n} ({WATCHDOG_BLIND}: {tier})" for n in names), cause(containers))
        return done

    def _set_aside_each(self, relies: Callable[[ContainerDesired], bool],
                        recorded: Callable[[ContainerMarker], bool], at_risk: str,
                        cause: str | None = None
                        ) -> Iterator[tuple[str, list[ContainerDesired] | None, list[str]]]:
        """Sets aside the marker of each pod with an applied entry of a container whose caps
        are at stake: the last plan's containers `relies` says so of, for the pods it names;
        for the others (every pod, for an agent with no plan yet), the entries `recorded` says
        so of, as the marker records them. Yields (uid, the pod's containers at stake, None
        where no plan names it; the entries' names) for each marker set aside, for the caller
        to log. `at_risk` and `cause`: as `_set_aside_relying`'s."""
        desired = self.view.desired
        relying: dict[str, list[ContainerDesired]] = {}
        for c in desired.containers if desired is not None else ():
            if relies(c):
                relying.setdefault(c.key.pod_uid, []).append(c)
        planned = _planned_pods(desired)
        for uid in sorted(set(relying) | (self.markers.marked() - planned)):
            containers = relying.get(uid, []) if uid in planned else None
            names = self._set_aside_relying(uid, containers, at_risk, recorded, cause=cause)
            if names is not None:
                yield uid, containers, names

    def _set_aside_relying(self, uid: str, containers: list[ContainerDesired] | None,
                           at_risk: str,
                           recorded: Callable[[ContainerMarker], bool],
                           cause: str | None = None) -> list[str] | None:
        """Sets the pod's readiness marker aside when it has an applied entry of `containers`
        (`_relying_entries`; None: those `recorded` says so of, as its marker records them);
        returns those entries' names, None when nothing was set aside. `at_risk`: what a gate
        releasing on it would run without, for the log when the move fails; `cause`: recorded
        beside it (`MarkerStore.set_aside`)."""
        try:
            marker = self.markers.read(uid)
            if marker is None:
                return None
            names = _relying_entries(marker, containers, recorded)
            if not names or not self.markers.set_aside(uid, cause):
                return None
        except OSError as e:
            log.error("pod %s: its readiness marker could not be set aside (%s): a gate of the "
                      "pod may release on it while %s", uid, e, at_risk)
            return None
        return names

    def _restore_stopped(self, uid: str, marker: Marker,
                         results: Mapping[str, ContainerResult], manifest: Mapping[str, Any]
                         ) -> None:
        """The pod's marker, set aside at the last agent's stop because its watchdog stopped
        (`markers.WATCHDOG_STOPPED`), comes back as the existing marker when this pass allows
        it (`markers.may_restore`; this pass ran a watchdog check over the pod first:
        `_watchdog_blind`): the next settle keeps it as a running agent would have, a pending
        container's included, and writes nothing (no second `Applied`) where it is what the
        pass would write. With a container known not in force it is set aside for that now,
        as a running agent would set it aside: it never comes back (`forget_cause`)."""
        if any(r.not_in_force for r in results.values()):
            self.markers.forget_cause(uid)
            return
        if not may_restore(marker, results):
            return
        who = "pod {}/{}".format(meta(manifest).get("namespace"), meta(manifest).get("name"))
        try:
            restored = self.markers.restore(uid)
        except OSError as e:
            log.error("%s: its readiness marker, set aside at the last node agent's stop, could "
                      "not be restored (%s): it is written again once every container is "
                      "applied", who, e)
            return
        if restored:
            log.info("%s: restored its readiness marker, set aside at the last node agent's "
                     "stop for its watchdog: this agent's watchdog check watches the pod, its "
                     "plans are those the marker names, and none of its containers is known "
                     "without what it vouches for (%s)", who, ", ".join(
                         f"{n}={r.state.value}" + (f" ({r.reason})" if r.reason else "")
                         for n, r in sorted(results.items())))

    def set_aside_at_stop(self) -> list[str]:
        """As the agent stops (`close`, `abandon`): closes the marker store (`MarkerStore.close`:
        no pass may write a marker after this), then sets aside the markers of the pods whose
        limits go with the agent, since no agent runs to say so until the next one's first
        pass, which writes them again once it has applied them (and run a watchdog check over
        them: `_watchdog_blind`): those that rely on an MPS control daemon this
        agent started (`set_aside_for_mps`: it stops it, or it dies with the agent's
        container), and those of a container whose only memory tier is the watchdog, which runs
        in the agent (`_set_aside_watchdog_only`). Local file moves only (no API call: the
        shutdown's time is bounded). Returns the pods' uids."""
        self.markers.close()
        done: set[str] = set()
        if self.mps_health is not None and self.mps_health.owned:
            done.update(self.set_aside_for_mps(_STOP_CAUSE))
        done.update(self._set_aside_watchdog_only(lambda c: True, lambda c: _WATCHDOG_STOP_CAUSE,
                                                  recorded=WATCHDOG_STOPPED))
        return sorted(done)

    def set_aside_for_mps(self, cause: str) -> list[str]:
        """Sets aside the readiness marker of each pod with a container whose caps rely on the
        MPS control daemon, which is not running or is about to stop (`cause`, for the log):
        its MPS namespace and percentage, its GPU's default pinned limit, its MPS server
        (`engine.relies_on_mps`). Which containers rely on it: the last plan's word
        (`view.desired`) for the pods it names; for the pods it does not (every pod, for an
        agent with no plan yet: a fresh start before its first full pass), what the marker
        itself records (`markers.entry_relies_on_mps`). Only a marker with an applied entry of
        such a container is set aside: a refusal vouches for nothing. Set aside, not removed:
        it still holds the pod to its plan. Returns the pods' uids."""
        done = []
        for uid, containers, names in self._set_aside_each(
                relies_on_mps, entry_relies_on_mps, f"no MPS cap is in force ({cause})"):
            done.append(uid)
            if containers:
                who = f"pod {containers[0].pod_namespace}/{containers[0].pod_name}"
                what = ", ".join(f"container {c.key.container} ({_stop_reason(c)})"
                                 for c in sorted(containers, key=lambda c: c.key.container))
            else:  # no plan names it: what its marker records
                who = f"pod {uid}"
                what = ", ".join(f"container {n} (its marker records MPS caps)" for n in names)
            log.warning("%s: set aside its marker: an MPS cap is not in force for %s: %s", who,
                        what, cause)
        return done


def _planned_pods(desired: DesiredState | None) -> set[str]:
    """The pods a plan names: with a container planned, or refused."""
    if desired is None:
        return set()
    return {c.key.pod_uid for c in desired.containers} | {r.key.pod_uid for r in desired.refusals}


def _relying_entries(marker: Marker, planned: list[ContainerDesired] | None,
                     recorded: Callable[[ContainerMarker], bool]) -> list[str]:
    """The names of `marker`'s applied entries that vouch for caps not in force now: those of
    `planned` (the plan's containers of the pod whose caps are at stake: relying on the MPS
    control daemon, or on a watchdog that cannot watch), or, with no plan for the pod (None),
    those whose entry records such caps (`recorded`: `entry_relies_on_mps`,
    `entry_watchdog_only`)."""
    if planned is not None:
        names = {c.key.container for c in planned}
        return sorted(n for n, e in marker.containers.items()
                      if e.state is MarkerState.APPLIED and n in names)
    return sorted(n for n, e in marker.containers.items() if recorded(e))


_STOP_CAUSE = ("the node agent stopped, and its MPS control daemon with it (its namespaces, "
               "their active-thread percentages and its default pinned limits go with it; a "
               "gate of the pod waits); the next node agent writes the marker again once it "
               "has applied them")


_WATCHDOG_STOP_CAUSE = (
    "the node agent stopped, and its watchdog with it (nothing stops a process over the cap; a "
    "gate of the pod waits); the next node agent writes the marker again once its first pass "
    "has run a watchdog check over the pod")


_FRESH_DAEMON_CAUSE = (
    "the MPS control daemon runs, but this agent started it and has not applied anything on "
    "it yet (a daemon starts with no namespace, active-thread percentage or default pinned "
    "limit: those the marker vouched for went with the daemon before it; a gate of the pod "
    "waits); the marker is written again once they are applied on it")


def _stop_reason(c: ContainerDesired) -> str:
    """The reason a pass gives a container whose MPS caps went with the daemon
    (`Engine.apply`'s `mps_not_running`)."""
    return gone_with_daemon_reason(c.mps_namespace is not None,
                                   Mechanism.MPS_PINNED in c.mechanisms)
