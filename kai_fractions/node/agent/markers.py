"""The agent's side of the readiness marker (format and atomic write: `kai_fractions.marker`).

Decides what a pod's marker must say from the engine's results, and keeps the marker directory
tidy (the rules: `marker_rules`; the directory: `marker_store`; both re-exported here). The
rules, in the order they are checked:

- a final refusal of any fractional container writes a `refused` marker at once (the gate fails
  the pod with the reason; pending siblings are left out, applied ones listed);
- anything pending writes nothing; a marker already there stays only if it is an `applied`
  marker whose digests are exactly the current plans' (the limits were in force when it was
  written and a passing hiccup must not flap it) and no container is known to be without
  something its plan needs (`ContainerResult.not_in_force`): an MPS cap it relies on, its
  namespace's active-thread percentage or its GPU's default pinned limit (`mps_cap_missing`:
  after an MPS daemon restart, a client attaching then may run uncapped; while the daemon is
  not running, all of them), or the GPU memory
  limit on its pod's slice (`limit_missing`: read back absent or not the plan's, e.g. the
  cgroup was made again, and not set since), or the watchdog where it is the container's only
  memory tier and cannot see the GPU (`watchdog_blind`); any other marker is removed (set
  aside when it names a plan), so a marker can never claim limits that are known not in force;
- everything applied writes an `applied` marker with each container's plan digest;
- while the MPS control daemon is known not running, or stops with the agent, the markers that
  vouch for a container whose caps rely on it are set aside (`Reconciler.set_aside_for_mps`),
  decided from the plan where one is known, else from the marker itself
  (`entry_relies_on_mps`: what its applied entry's message records);
- so are those of a container whose only memory tier is the watchdog while no watchdog watches
  it: at the agent's stop (the watchdog stops with it: `Reconciler.set_aside_at_stop`), and on
  a pass that returns before it settles the pods while NVML is down, the watchdog is blind on
  its GPU, or no plan names the pod yet (`Reconciler.set_aside_unwatched`; with no plan, as
  the marker records: `entry_watchdog_only`). One set aside at the stop for the watchdog alone
  (`WATCHDOG_STOPPED`, recorded beside it) comes back as it was once a pass of the next agent
  has run a watchdog check over the pod, for the same plans, with no container known not in
  force (`may_restore`, `MarkerStore.restore`): a container pending for an ordinary reason
  keeps its marker across a healthy restart, as on a running agent, and an applied one gets
  no second `Applied` event.

A marker of another boot of the host (or one without a boot ID, from an older agent) vouches
for limits the reboot cleared: it counts as no marker, and is removed when read and, for every
pod, at the agent's first pass (`forget_other_boots`), before any gate of an older release that
does not check boot IDs can trust it.

Removal of a live pod's stale marker unlinks the file only: the gate holds a bind mount of the
pod's directory (subPathExpr), and a new directory would be invisible to it.

Settling a pod after an apply (`MarkerWriter`) writes what the gate reads, in the order it must
see it: the derived annotations first (patched onto the pod when no mirror wrote them, i.e. the
agent follows an unmodified KAI; the workload's env reads them too), then the marker, then the
pod's Applied / Refused events. Directories of pods that are not on the node any more are
removed; a live pod with no fractional container left loses its marker file.

A pod whose marker (or the annotations it follows) could not be written, or whose stale marker
could not be removed, and that keeps no marker vouching for its plans, says why (`NotWritten`,
in `Settled`): the pass reports its applied containers pending under MARKER_NOT_WRITTEN or
ANNOTATIONS_NOT_WRITTEN (`pending_results`), so GetNodeState, the metrics and inspect do not
call enforced a container whose gate waits. The rules above decide from the engine's results,
never from those, and the next pass's apply makes them again.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ...contract import ContainerPlan, Keys, derived_annotations
from ...kube.errors import Conflict, KubeError, NotFound
from ...kube.objects import meta
from ...marker import Marker, MarkerError, write_marker
from ..desired import ContainerKey, DesiredState
from ..engine import ContainerResult, ContainerState
from . import events as ev
from .events import EventRecorder, PodRef
from .kube import ClusterWriter
from .marker_probe import MARKER_DIR_NOT_WRITABLE
from .marker_rules import (
    _NOT_IN_FORCE,
    REFUSED_DEFAULT_REASON,
    MarkerDecision,
    decide,
    entry_relies_on_mps,
    entry_watchdog_only,
    may_restore,
    still_valid,
)
from .marker_store import (
    CLOSE_WAIT_SECONDS,
    SET_ASIDE_CAUSE_FILE,
    WATCHDOG_STOPPED,
    MarkersClosed,
    MarkerStore,
)
from .watch import PodCache

# The rules and the store are re-exported: the reconciler, the pods and the tests import them
# from here (and a test patches `write_marker` here).
__all__ = [
    "ANNOTATIONS_NOT_WRITTEN",
    "CLOSE_WAIT_SECONDS",
    "MARKER_NOT_WRITTEN",
    "REFUSED_DEFAULT_REASON",
    "SET_ASIDE_CAUSE_FILE",
    "WATCHDOG_STOPPED",
    "MarkerDecision",
    "MarkerStore",
    "MarkerWriter",
    "MarkersClosed",
    "NotWritten",
    "Settled",
    "decide",
    "entry_relies_on_mps",
    "entry_watchdog_only",
    "may_restore",
    "pending_results",
    "still_valid",
    "write_marker",
]

log = logging.getLogger(__name__)

ANNOTATIONS_NOT_WRITTEN = "AnnotationsNotWritten"
MARKER_NOT_WRITTEN = "MarkerNotWritten"


@dataclass(frozen=True, slots=True)
class NotWritten:
    """Why a pod's gate has no marker vouching for its plans after this pass: the marker, or
    the derived annotations it follows, could not be written, or a stale marker removed.
    `reason` is MARKER_NOT_WRITTEN or ANNOTATIONS_NOT_WRITTEN; `message` names the error and
    what the gate does. The limits may well be in force: this is no cap not in force."""

    reason: str
    message: str


@dataclass(frozen=True, slots=True)
class Settled:
    """What settling one pod came to (`MarkerWriter.settle`)."""

    done: bool
    """Its marker says what its results say: nothing of this pod to retry."""
    not_written: NotWritten | None = None
    """Set when something could not be written and no marker vouching for the pod's plans
    stays: its applied containers are reported pending (`pending_results`)."""


def pending_results(results: Mapping[ContainerKey, ContainerResult],
                    not_written: Mapping[str, NotWritten]
                    ) -> dict[ContainerKey, ContainerResult]:
    """`results` with each applied container of a pod in `not_written` (by pod uid) pending
    under its reason and message, as the pass reports them (GetNodeState, metrics, inspect):
    its gate waits, so it is not enforced yet. Refused and pending ones stay as they are."""
    return {key: (dataclasses.replace(r, state=ContainerState.PENDING, reason=why.reason,
                                      message=why.message)
                  if r.state is ContainerState.APPLIED
                  and (why := not_written.get(key.pod_uid)) is not None else r)
            for key, r in results.items()}


class MarkerWriter:
    """Settles fractional pods after an apply: derived annotations, marker, events."""

    def __init__(self, store: MarkerStore, *, keys: Keys, cluster: ClusterWriter | None,
                 pods: PodCache, events: EventRecorder, clock: Callable[[], float],
                 watchdog_stops: bool = True):
        self.store = store
        self.watchdog_stops = watchdog_stops
        self.keys = keys
        self.cluster = cluster
        self.pods = pods
        self.events = events
        self.clock = clock

    def settle(self, uid: str, manifest: Mapping[str, Any], from_api: bool,
               results: Mapping[str, ContainerResult], desired: DesiredState, errors: set[str]
               ) -> Settled:
        """One fractional pod. Only a pod read from the API gets derived annotations (a
        provisioned one has none to write). What could not be written is added to `errors`,
        and told in the answer (`Settled.not_written`) unless a marker vouching for the pod's
        plans stays (a gate opens on it)."""
        ref = PodRef(str(meta(manifest).get("namespace") or ""),
                     str(meta(manifest).get("name") or ""), uid)
        decision = decide(results, watchdog_stops=self.watchdog_stops)
        existing = self.store.read(uid)
        failed: list[NotWritten] = []
        self._pending_events(ref, results, existing)
        if decision.write is None:
            self._drop_stale(ref, existing, results, errors, failed)
            return _settled(False, failed, existing, results)
        refused = any(r.state is ContainerState.REFUSED for r in results.values())
        if not refused and from_api:
            plans = [c.plan for name in results
                     if (c := desired.container(ContainerKey(uid, name))) is not None]
            if not self._ensure_annotations(ref, manifest, plans, errors, failed):
                self._drop_stale(ref, existing, results, errors, failed)
                return _settled(False, failed, existing, results)
        if existing is None or dict(existing.containers) != dict(decision.write):
            try:
                self.store.write(uid, decision.write, now=self.clock())
            except MarkersClosed as e:  # a pass that outlived the agent's stop
                log.info("%s", e)
                self._drop_stale(ref, existing, results, errors, failed)
                return _settled(False, failed, existing, results)
            except (OSError, MarkerError) as e:  # this pod's marker only: the others go on
                errors.add(MARKER_NOT_WRITTEN)
                failed.append(NotWritten(MARKER_NOT_WRITTEN, (
                    f"its pod's readiness marker could not be written under {self.store.root} "
                    f"({e}), so a gate of the pod waits for it (the limits may be in force; "
                    "each pass writes it again; a marker directory that takes no file at all "
                    f"makes the node not ready: {MARKER_DIR_NOT_WRITABLE})")))
                log.error("pod %s/%s: the readiness marker could not be written under %s: %s",
                          ref.namespace, ref.name, self.store.root, e)
                self._drop_stale(ref, existing, results, errors, failed)
                return _settled(False, failed, existing, results)
            log.info("pod %s/%s: marker written (%s)", ref.namespace, ref.name, ", ".join(
                f"{n}={m.state.value}" for n, m in sorted(decision.write.items())))
            self._marker_events(ref, results)
        return Settled(True)

    def _drop_stale(self, ref: PodRef, existing: Marker | None,
                    results: Mapping[str, ContainerResult], errors: set[str],
                    failed: list[NotWritten]) -> None:
        """Whatever kept the new marker from being written, an old one that no longer vouches
        for what is in force goes: a gate (a restarted sandbox's) must not open on it. One that
        names a plan the pod is held to is set aside rather than removed, so the hold outlasts
        the passing failure (`NodePods._applied`)."""
        if existing is None or still_valid(existing, results):
            return
        holds = any(entry.plan_digest for entry in existing.containers.values())
        try:
            removed = (self.store.set_aside if holds else self.store.unlink)(ref.uid)
        except OSError as e:
            errors.add(MARKER_NOT_WRITTEN)
            failed.append(NotWritten(MARKER_NOT_WRITTEN, (
                f"its pod's old readiness marker no longer vouches for the limits in force and "
                f"could not be removed ({e}): a gate of the pod may still open on it; each pass "
                "tries again")))
            log.error("pod %s/%s: its marker no longer vouches for the limits in force and "
                      "could not be removed: %s", ref.namespace, ref.name, e)
            return
        if not removed:
            return
        done = "set aside" if holds else "removed"
        missing = [(kind, ", ".join(f"container {n} ({r.reason})" for n, r in sorted(
            results.items()) if kind.flag(r))) for kind in _NOT_IN_FORCE]
        missing = [(kind, who) for kind, who in missing if who]
        for kind, who in missing:
            log.warning("pod %s/%s: %s its marker: %s is not in force for %s (the plan is "
                        "unchanged; the marker is written again once %s is back)",
                        ref.namespace, ref.name, done, kind.logged, who, kind.it)
        if not missing:
            log.info("pod %s/%s: %s its marker (it does not vouch for the plans in force now)",
                     ref.namespace, ref.name, done)

    def _ensure_annotations(self, ref: PodRef, manifest: Mapping[str, Any],
                            plans: Sequence[ContainerPlan], errors: set[str],
                            failed: list[NotWritten]) -> bool:
        have = meta(manifest).get("annotations") or {}
        want: dict[str, str] = {}
        for plan in plans:
            want.update(derived_annotations(plan, self.keys))
        missing = {key: value for key, value in want.items() if have.get(key) != value}
        if not missing:
            return True
        if self.cluster is None:
            errors.add(ANNOTATIONS_NOT_WRITTEN)
            failed.append(_annotations_not_written("the agent has no API client"))
            return False
        try:
            updated = self.cluster.patch_pod_annotations(ref.namespace, ref.name, ref.uid,
                                                         missing)
        except (NotFound, Conflict) as e:
            log.info("pod %s/%s changed under the agent (%s); waiting for the watch",
                     ref.namespace, ref.name, e.message)
            return False
        except KubeError as e:
            errors.add(ANNOTATIONS_NOT_WRITTEN)
            failed.append(_annotations_not_written(e.message))
            log.warning("pod %s/%s: derived annotations not written (%s); retried",
                        ref.namespace, ref.name, e.message)
            return False
        log.info("pod %s/%s: wrote %d derived annotation(s) (%s)", ref.namespace, ref.name,
                 len(missing), ", ".join(sorted(missing)))
        if isinstance(updated, dict) and updated.get("metadata"):
            self.pods.upsert(updated)
        return True

    def _pending_events(self, ref: PodRef, results: Mapping[str, ContainerResult],
                        existing: Marker | None) -> None:
        """One event per container waiting for its signature (the follower signs after the
        binder's annotations land) or for its signature's key (a rotation on its way to the
        node): its owner sees why the gate is still waiting. One per episode of an MPS cap or
        a pod slice's memory limit not in force (`_cap_events`)."""
        self._cap_events(ref, results, existing)
        for name, r in sorted(results.items()):
            if r.state is not ContainerState.PENDING:
                continue
            if r.reason == ev.SIGNATURE_MISSING:
                waiting = "its signature"
            elif r.reason == ev.SIGNATURE_KEY_UNKNOWN:
                waiting = "its signature's key"
            else:
                continue
            self.events.emit(ref, ev.WARNING, r.reason,
                             f"container {name}: waiting for {waiting}: {r.message}",
                             key=(r.reason, ref.uid, name))

    def _cap_events(self, ref: PodRef, results: Mapping[str, ContainerResult],
                    existing: Marker | None) -> None:
        """A Warning `MpsCapNotInForce` when a container's MPS cap turns out not in force
        (`ContainerResult.mps_cap_missing`), `MemoryLimitNotInForce` when its pod slice's GPU
        memory limit does (`limit_missing`, told as the MPS cap's while that is missing too: the
        container's reason and message are then the cap's), `WatchdogBlind` when the watchdog,
        its only memory tier, cannot see its GPU: its marker is set aside, and a client
        attaching meanwhile may run uncapped. Once per episode of each kind (`_NOT_IN_FORCE`):
        the episode lasts until the container is applied (or refused) again, so a reason that
        changes within the kind, or a pass pending for something else, sends nothing new; a
        kind new to the episode (the watchdog blind while an MPS cap was missing: `WatchdogBlind`
        once the cap is back) is a new blocker, with its own Warning. The `Applied` it had sent
        is forgotten as the episode begins, so its return is told too (the marker is written
        again then). Either event still waiting in the backlog when the other's turn comes is
        withdrawn: the last event sent says what is so. None for a pod that had no marker this
        boot (`existing`, or one set aside): a new pod's gate waits anyway, and no marker of it
        was set aside."""
        had_marker: bool | None = None
        for name, r in sorted(results.items()):
            for kind in _NOT_IN_FORCE:
                key = (kind.event, ref.uid, name)
                if r.state is not ContainerState.PENDING:
                    self.events.forget(key, withdraw=True)  # the episode is over
                    continue
                if not kind.flag(r) or self.events.seen(key):
                    continue
                if had_marker is None:  # read once, and only for a warning to send
                    had_marker = existing is not None or self._set_aside_this_boot(ref.uid)
                if not had_marker:
                    break
                self.events.forget_matching(
                    lambda k, name=name: isinstance(k, tuple)
                    and k[:3] == (ev.APPLIED, ref.uid, name), withdraw=True)
                # What to do is in the engine's message, after the reason: kept short before it
                # (an event's message is cut at 1024 characters).
                self.events.emit(ref, ev.WARNING, kind.event, (
                    f"container {name}: {kind.what} is not in force, so its readiness marker is "
                    f"set aside (a gate of the pod waits; Applied follows once {kind.it} is "
                    f"back): {r.reason}: {r.message}"), key=key)

    def _set_aside_this_boot(self, uid: str) -> bool:
        set_aside = self.store.set_aside_marker(uid)
        return set_aside is not None and set_aside.boot_id == self.store.boot_id

    def _marker_events(self, ref: PodRef, results: Mapping[str, ContainerResult]) -> None:
        for name, r in sorted(results.items()):
            if r.state is ContainerState.APPLIED:
                self.events.emit(ref, ev.NORMAL, ev.APPLIED,
                                 f"container {name}: GPU limits in force (plan {r.plan_digest})",
                                 key=(ev.APPLIED, ref.uid, name, r.plan_digest))
            elif r.state is ContainerState.REFUSED:
                self.events.emit(ref, ev.WARNING, ev.REFUSED,
                                 f"container {name}: {r.reason}: {r.message}",
                                 key=(ev.REFUSED, ref.uid, name, r.reason, r.message))


def _annotations_not_written(error: str) -> NotWritten:
    return NotWritten(ANNOTATIONS_NOT_WRITTEN, (
        f"its pod's derived annotations could not be written ({error}), and its readiness "
        "marker is written only after them, so a gate of the pod waits (the limits may be in "
        "force; each pass tries again)"))


def _settled(done: bool, failed: Sequence[NotWritten], existing: Marker | None,
             results: Mapping[str, ContainerResult]) -> Settled:
    """A marker that vouches for the current plans and stays (`still_valid`: `_drop_stale`
    keeps it) lets a gate open: nothing the pod waits for then, whatever failed."""
    if not failed or (existing is not None and still_valid(existing, results)):
        return Settled(done)
    return Settled(done, NotWritten(failed[0].reason, "; ".join(f.message for f in failed)))
