"""The agent's side of the readiness marker (format and atomic write: `kai_fractions.marker`).

Decides what a pod's marker must say from the engine's results, and keeps the marker directory
tidy. The rules, in the order they are checked:

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
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...contract import ContainerPlan, Keys, derived_annotations
from ...kube.errors import Conflict, KubeError, NotFound
from ...kube.objects import meta
from ...marker import (
    MARKER_FILE,
    SET_ASIDE_FILE,
    ContainerMarker,
    Marker,
    MarkerError,
    MarkerState,
    is_temp_file,
    pod_marker_dir,
    read_marker,
    remove_leftovers,
    remove_marker,
    write_marker,
)
from ..config import HARD_TIERS, Mechanism
from ..desired import ComputeEnforcement, ContainerKey, DesiredState
from ..engine import ContainerResult, ContainerState
from ..engine_reports import NOT_IN_FORCE_REASONS, WATCHDOG_BLIND
from ..memory_limits import MEMORY_LIMIT_NOT_IN_FORCE
from . import events as ev
from .events import EventRecorder, PodRef
from .kube import ClusterWriter
from .watch import PodCache

log = logging.getLogger(__name__)

REFUSED_DEFAULT_REASON = "Refused"
ANNOTATIONS_NOT_WRITTEN = "AnnotationsNotWritten"
MARKER_NOT_WRITTEN = "MarkerNotWritten"

SET_ASIDE_CAUSE_FILE = "set-aside-cause"
"""Beside SET_ASIDE_FILE: why the agent set that marker aside, where a later pass may undo it
(`MarkerStore.set_aside`'s `cause`); absent for every other cause. No gate reads it."""
WATCHDOG_STOPPED = "watchdog-stopped"
"""The cause of a marker set aside at the agent's stop only because the watchdog, a container's
only memory tier, stopped with the agent (`Reconciler.set_aside_at_stop`): nothing else of what
it vouched for went, so the next agent restores it once its watchdog watches the pod
(`MarkerStore.stopped_for_watchdog`, `may_restore`)."""


@dataclass(frozen=True, slots=True)
class MarkerDecision:
    write: Mapping[str, ContainerMarker] | None = None
    """The entries to write (None: write nothing)."""
    keep_existing: bool = False
    """Pending: an existing marker that still matches may stay."""


def _applied_message(result: ContainerResult, watchdog_stops: bool) -> str:
    # Deterministic (no times, no counters): an agent restart compares equal and rewrites
    # nothing. `entry_relies_on_mps` and `entry_watchdog_only` read it back: keep them in step.
    mechanisms = ",".join(sorted(
        m.value if m is not Mechanism.WATCHDOG or watchdog_stops
        else f"{m.value} (reports, stops nothing)" for m in result.mechanisms)) or "none"
    compute = result.compute.value if result.compute is not None else "time-slicing"
    return f"limits in force: memory {mechanisms}; compute {compute}"


_APPLIED_MESSAGE = re.compile(r"limits in force: memory (?P<memory>.+); compute (?P<compute>\S+)")
_COMPUTE = frozenset(c.value for c in ComputeEnforcement)


def entry_relies_on_mps(entry: ContainerMarker) -> bool:
    """Whether an applied marker entry vouches for caps that rely on the MPS control daemon
    (`engine.relies_on_mps`), as the entry itself records it: for an agent with no plan yet
    (a fresh start) that finds the daemon not running. Every agent release wrote an applied
    entry's message as `_applied_message` does, `limits in force: memory <mechanisms>; compute
    <compute>`, so the rule reads it: compute other than `time-slicing` (`mps-namespace`,
    `mps-client-env`: an MPS namespace or the MPS server enforces its share of the SMs), or
    `mps-pinned` among the comma-separated memory mechanisms (its GPU's default pinned limit
    is the daemon's). An entry that does not read so (another message, a compute this release
    does not know) counts as relying on MPS: set aside, it only makes a gate wait until the
    agent has applied the plan again, while kept it could release a workload uncapped. A
    refused entry vouches for nothing (False)."""
    if entry.state is not MarkerState.APPLIED:
        return False
    recorded = _recorded(entry)
    if recorded is None:
        return True
    mechanisms, compute = recorded
    return (compute != ComputeEnforcement.TIME_SLICING.value
            or Mechanism.MPS_PINNED.value in mechanisms)


def entry_watchdog_only(entry: ContainerMarker) -> bool:
    """Whether an applied marker entry vouches for a GPU memory cap the watchdog alone enforces
    (`blindness.watchdog_only`), as the entry itself records it: `watchdog` (a kill-policy
    watchdog's name; a report-only one's says it stops nothing) among its memory mechanisms,
    and neither `cgroup` nor `mps-pinned`. For an agent with no plan naming the pod (a fresh
    start whose passes fail before they plan): no watchdog check of it watches the pod. Read
    as `entry_relies_on_mps` reads it: an entry that does not read so counts as watchdog-only
    (set aside, it only makes a gate wait), a refused one vouches for nothing (False)."""
    if entry.state is not MarkerState.APPLIED:
        return False
    recorded = _recorded(entry)
    if recorded is None:
        return True
    mechanisms, _compute = recorded
    return (Mechanism.WATCHDOG.value in mechanisms
            and not mechanisms & {m.value for m in HARD_TIERS})


def _recorded(entry: ContainerMarker) -> tuple[frozenset[str], str] | None:
    """(memory mechanisms, compute) as an entry's message records them (`_applied_message`);
    None when it does not read so, or names a compute this release does not know."""
    m = _APPLIED_MESSAGE.fullmatch(entry.message)
    if m is None or m["compute"] not in _COMPUTE:
        return None
    return frozenset(part.strip() for part in m["memory"].split(",")), m["compute"]


def decide(results: Mapping[str, ContainerResult], *, watchdog_stops: bool = True
           ) -> MarkerDecision:
    """`results`: container name -> the agent's result for each fractional container;
    `watchdog_stops`: the watchdog's policy is `kill` (with `report` the marker says so)."""
    refused = {n: r for n, r in results.items() if r.state is ContainerState.REFUSED}
    applied = {n: r for n, r in results.items() if r.state is ContainerState.APPLIED}
    if refused:
        entries = {n: ContainerMarker.refused(
            r.reason or REFUSED_DEFAULT_REASON,
            r.message or "refused by the node agent", r.plan_digest or "")
            for n, r in refused.items()}
        entries.update({n: ContainerMarker.applied(r.plan_digest or "",
                                                   _applied_message(r, watchdog_stops))
                        for n, r in applied.items() if r.plan_digest})
        return MarkerDecision(write=entries)
    if len(applied) < len(results) or not results:
        return MarkerDecision(keep_existing=not any(r.not_in_force for r in results.values()))
    return MarkerDecision(write={n: ContainerMarker.applied(r.plan_digest or "",
                                                            _applied_message(r, watchdog_stops))
                                 for n, r in applied.items()})


def _written(names: Collection[str]) -> bool:
    """Whether an agent of this boot wrote in a pod's directory: a marker, or a marker's temp
    file (an earlier boot's marker set aside is not)."""
    return any(name == MARKER_FILE or is_temp_file(name) for name in names)


def still_valid(existing: Marker, results: Mapping[str, ContainerResult]) -> bool:
    """An existing marker may stay while something is pending only if it is an applied
    marker for exactly the current plans, and no container of the pod is known to lack
    something its plan needs (`ContainerResult.not_in_force`: an MPS cap, its namespace's
    percentage or its GPU's pinned limit; the memory limit on its pod's slice): a gate (a
    restarted sandbox's) would let a client start uncapped."""
    if set(existing.containers) != set(results):
        return False
    if any(r.not_in_force for r in results.values()):
        return False
    for name, entry in existing.containers.items():
        if entry.state is not MarkerState.APPLIED or entry.plan_digest != results[name].plan_digest:
            return False
    return True


def may_restore(set_aside: Marker, results: Mapping[str, ContainerResult]) -> bool:
    """Whether a marker the agent's stop set aside for the watchdog (`WATCHDOG_STOPPED`) may
    come back for these results: it vouches for exactly the current plans (`still_valid`), and
    every container is applied or pending for an ordinary reason, one that says nothing of what
    is in force (a failed call); none refused, none known not in force (NOT_IN_FORCE_REASONS).
    It then stays as a marker a running agent had kept (`MarkerDecision.keep_existing`)."""
    return (all(r.state is ContainerState.APPLIED or (
        r.state is ContainerState.PENDING and r.reason not in NOT_IN_FORCE_REASONS)
        for r in results.values()) and still_valid(set_aside, results))


@dataclass(frozen=True, slots=True)
class _NotInForce:
    """One kind of thing a container's marker is set aside for (`ContainerResult.not_in_force`):
    the result's flag, the Warning sent once per episode (`MarkerWriter._cap_events`), and how
    the event and the log say it."""

    flag: Callable[[ContainerResult], bool]
    event: str
    what: str
    """As the event says it."""
    logged: str
    """As the log says it."""
    it: str
    """What comes back."""


_NOT_IN_FORCE = (
    _NotInForce(lambda r: r.mps_cap_missing, ev.MPS_CAP_NOT_IN_FORCE,
                "an MPS cap it relies on", "an MPS cap", "the cap"),
    # With an MPS cap missing too, the container's reason and message are the cap's
    # (`engine.ContainerResult.limit_missing`): told as that, until the cap is back.
    _NotInForce(lambda r: r.limit_missing and not r.mps_cap_missing, MEMORY_LIMIT_NOT_IN_FORCE,
                "the GPU memory limit on its pod's cgroup",
                "the GPU memory limit on the pod's cgroup", "the limit"),
    # Likewise: a container without an MPS cap is told as that until the cap is back.
    _NotInForce(lambda r: r.watchdog_blind and not r.mps_cap_missing and not r.limit_missing,
                WATCHDOG_BLIND, "its GPU memory cap (the watchdog, its only memory tier there)",
                "the watchdog's GPU memory cap (its only memory tier)",
                "the watchdog's view of its GPU"),
)


class MarkersClosed(Exception):
    """`MarkerStore.write` after `MarkerStore.close`: the agent is stopping, and no marker may
    be written any more."""


CLOSE_WAIT_SECONDS = 5.0
"""How long `MarkerStore.close` waits for a write in progress (a local file, fsynced)."""


class MarkerStore:
    def __init__(self, root: str | os.PathLike[str], boot_id: str):
        self.root = Path(root)
        self.boot_id = boot_id
        """This boot's (`kai_fractions.marker.read_boot_id`): every marker written carries it."""
        self._stuck: set[str] = set()
        """Leftovers a tidy could not remove (warned once each)."""
        self._write_lock = threading.Lock()
        self._closed = False
        """Latched by `close`: no marker is written after it."""

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, wait: float = CLOSE_WAIT_SECONDS) -> bool:
        """Latches the store shut: every `write` from now on raises MarkersClosed. Called as the
        agent stops, before it sets aside the markers that rely on its MPS control daemon, so
        that a pass still running (a worker that overran its stop bound) cannot write one of
        them back after the set-aside. Waits up to `wait` seconds for a write in progress to
        end (it holds the lock), so the set-aside that follows sees its marker; False when one
        did not end in time (it may still land: logged)."""
        self._closed = True  # first: a write that takes the lock from now on refuses
        if not self._write_lock.acquire(timeout=wait):
            log.error("a readiness marker write in progress did not end within %gs of the "
                      "agent's stop; it may land after the markers are set aside", wait)
            return False
        self._write_lock.release()
        return True

    def read(self, uid: str) -> Marker | None:
        """The pod's marker of this boot; None when absent or unreadable (an unreadable one is
        replaced). One of another boot is removed: its limits went with that boot."""
        try:
            marker = read_marker(pod_marker_dir(self.root, uid), expected_pod_uid=uid)
        except MarkerError:
            return None
        if marker is not None and marker.boot_id != self.boot_id:
            self._forget(uid, marker)
            return None
        return marker

    def write(self, uid: str, entries: Mapping[str, ContainerMarker],
              now: float | None = None) -> Path:
        """Writes the pod's marker (and drops its set-aside one); raises MarkersClosed once the
        store is closed (`close`)."""
        marker = Marker.build(uid, entries, boot_id=self.boot_id,
                              clock=(lambda: now) if now is not None else time.time)
        with self._write_lock:
            if self._closed:
                raise MarkersClosed(f"pod {uid}: no marker is written: the node agent is "
                                    "stopping")
            path = write_marker(self.root, marker)
            for name in (SET_ASIDE_FILE, SET_ASIDE_CAUSE_FILE):  # this boot's word replaces it
                with contextlib.suppress(FileNotFoundError):
                    (path.parent / name).unlink()
        return path

    def stopped_for_watchdog(self, uid: str) -> Marker | None:
        """The pod's set-aside marker when it is of this boot and was set aside at an agent's
        stop for the watchdog alone (`WATCHDOG_STOPPED` recorded beside it); else None."""
        try:  # non-blocking, bounded: the directory is the gate's mount
            fd = os.open(pod_marker_dir(self.root, uid) / SET_ASIDE_CAUSE_FILE,
                         os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except (OSError, MarkerError):  # none, or not a pod UID (no marker either)
            return None
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode) or f.read(64) != WATCHDOG_STOPPED.encode():
                return None
        marker = self.set_aside_marker(uid)
        return marker if marker is not None and marker.boot_id == self.boot_id else None

    def restore(self, uid: str) -> bool:
        """Moves the pod's set-aside marker back where the gate reads it (`may_restore` said it
        may); False when there is none, a marker is there, or the store is closed (the agent
        stopping: its watchdog with it)."""
        pod_dir = pod_marker_dir(self.root, uid)
        with self._write_lock:
            if self._closed or (pod_dir / MARKER_FILE).exists():
                return False
            try:
                os.replace(pod_dir / SET_ASIDE_FILE, pod_dir / MARKER_FILE)
            except FileNotFoundError:
                return False
            with contextlib.suppress(FileNotFoundError):
                (pod_dir / SET_ASIDE_CAUSE_FILE).unlink()
        return True

    def forget_cause(self, uid: str) -> None:
        """Drops the cause recorded beside the pod's set-aside marker: it is set aside now for
        something a running agent sets it aside for too (a container known not in force), or
        is about to be set aside anew, so no pass may restore it."""
        try:
            (pod_marker_dir(self.root, uid) / SET_ASIDE_CAUSE_FILE).unlink()
        except FileNotFoundError:
            pass
        except OSError as e:
            log.error("pod %s: cannot remove %s (%s): its set-aside marker may be restored "
                      "although it is no longer set aside for the watchdog alone", uid,
                      SET_ASIDE_CAUSE_FILE, e)

    def set_aside_marker(self, uid: str) -> Marker | None:
        """The pod's marker moved out of the gate's sight (`set_aside`: an earlier boot's, or
        one a pass could not keep), while no marker has replaced it: it vouches for no limit,
        but says which plan the pod ran with, so a reboot or a passing failure does not let an
        edit refused before it take effect. On disk, so a restarted agent still knows."""
        try:
            return read_marker(pod_marker_dir(self.root, uid), expected_pod_uid=uid,
                               name=SET_ASIDE_FILE)
        except MarkerError:
            return None

    def forget_other_boots(self) -> int:
        """Sets aside (`set_aside`) every marker written in another boot of the host; how many.
        Run once, at the agent's start: every marker written after is this boot's."""
        try:
            uids = [e.name for e in os.scandir(self.root) if e.is_dir(follow_symlinks=False)]
        except (FileNotFoundError, NotADirectoryError):
            return 0
        forgotten = 0
        for uid in sorted(uids):
            try:
                marker = read_marker(pod_marker_dir(self.root, uid))
            except MarkerError:
                continue  # not a pod UID, or unreadable: settled, or tidied, like any other
            if marker is not None and marker.boot_id != self.boot_id:
                forgotten += self._forget(uid, marker)
        return forgotten

    def _forget(self, uid: str, marker: Marker) -> bool:
        removed = self.set_aside(uid) if marker.pod_uid == uid else self.unlink(uid)
        if removed:
            log.info("set aside the marker of pod %s: written in %s, and the limits it vouched "
                     "for went with that boot (now %s)", uid,
                     f"boot {marker.boot_id}" if marker.boot_id else
                     "a boot this agent cannot tell (no boot ID)", self.boot_id)
        return removed

    def unlink(self, uid: str) -> bool:
        """Remove a live pod's marker file (not its directory: the gate's mount holds it)."""
        path = pod_marker_dir(self.root, uid) / MARKER_FILE
        try:
            path.unlink()
            return True
        except FileNotFoundError:
            return False

    def set_aside(self, uid: str, cause: str | None = None) -> bool:
        """Move the pod's marker to SET_ASIDE_FILE (no gate reads it); False when there was
        none. One that cannot be moved is removed. `cause`: recorded beside it
        (SET_ASIDE_CAUSE_FILE: WATCHDOG_STOPPED) where a later pass may restore it; any cause
        recorded before goes first, so none outlives the move it was for."""
        pod_dir = pod_marker_dir(self.root, uid)
        self.forget_cause(uid)
        try:
            os.replace(pod_dir / MARKER_FILE, pod_dir / SET_ASIDE_FILE)
        except FileNotFoundError:
            return False
        except OSError as e:
            log.warning("cannot move the marker of pod %s aside (%s); removing it", uid, e)
            return self.unlink(uid)
        if cause is not None:
            try:  # a cause torn or not written only keeps the marker from coming back
                (pod_dir / SET_ASIDE_CAUSE_FILE).write_text(cause)
            except OSError as e:
                log.warning("pod %s: its marker is set aside, but why could not be recorded "
                            "(%s): the next agent writes it again only once every container "
                            "is applied", uid, e)
        return True

    def remove_pod(self, uid: str) -> bool:
        """The pod is gone: remove its whole directory."""
        try:
            return remove_marker(self.root, uid)
        except (MarkerError, OSError):
            return False

    def stale_dirs(self, live: set[str], *, grace: float, now: float) -> list[str]:
        """Directories of pods not in `live`: any with a marker or a marker's temp file (an
        agent wrote it), and empty ones older than `grace` (the kubelet makes a new pod's
        directory for the gate's mount before the agent may have seen the pod: removing it then
        would hide the marker from the gate).

        The temp file counts because an agent killed while writing a pod's first marker (during
        its fsync) leaves the directory with nothing else; if the pod goes before an agent runs
        again, the next agent never knew it and would otherwise keep the directory as the
        kubelet's for the whole grace period."""
        stale = []
        for entry, names in self._pod_dirs(skip=live):
            written = _written(names) or SET_ASIDE_FILE in names
            with contextlib.suppress(OSError):
                if written or now - entry.stat(follow_symlinks=False).st_mtime >= grace:
                    stale.append(entry.name)
        return sorted(stale)

    def marked(self) -> set[str]:
        """The pods whose directory holds a marker or a marker's temp file: an agent of this
        boot (markers of other boots are forgotten first) applied limits for them, or was
        about to, so their cgroups' limits are the agent's to clear."""
        return {entry.name for entry, names in self._pod_dirs() if _written(names)}

    def _pod_dirs(self, skip: Collection[str] = ()
                  ) -> Iterator[tuple[os.DirEntry[str], frozenset[str]]]:
        """Each pod directory under the root but those of `skip`, and the names in it. Entries
        that are not a pod UID are not ours to touch."""
        try:
            entries = list(os.scandir(self.root))
        except (FileNotFoundError, NotADirectoryError):
            return
        for entry in entries:
            if entry.name in skip or not entry.is_dir(follow_symlinks=False):
                continue
            try:
                pod_marker_dir(self.root, entry.name)
            except MarkerError:
                continue
            try:
                names = frozenset(os.listdir(entry.path))
            except OSError:
                continue
            yield entry, names

    def remove_leftovers(self) -> None:
        """What removals of gone pods' directories that were cut short left (once a pass)."""
        for name, error in remove_leftovers(self.root).items():
            if error is None:
                self._stuck.discard(name)
                log.info("removed %s, left by a removal of a gone pod's marker directory that "
                         "was cut short", name)
            elif name not in self._stuck:
                self._stuck.add(name)
                log.warning("cannot remove %s under %s (left by a removal of a gone pod's "
                            "marker directory): %s", name, self.root, error)

    def tidy(self, live: set[str], fractional: set[str] | None, *, grace: float,
             now: float) -> None:
        """Removes the directories of pods not in `live` (`stale_dirs`) and, when `fractional`
        is known, the marker of each live pod without a fractional container (its annotations
        were removed, or it was released): a marker left from before must not keep vouching
        for limits."""
        for uid in self.stale_dirs(live, grace=grace, now=now):
            if self.remove_pod(uid):
                log.info("removed the marker directory of pod %s (no such pod on this node)",
                         uid)
        if fractional is None:
            return
        for uid in live - fractional:
            if self.read(uid) is not None and self.unlink(uid):
                log.info("removed the marker of pod %s (it has no fractional container now)",
                         uid)


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
               ) -> bool:
        """One fractional pod; True when settled. Only a pod read from the API gets derived
        annotations (a provisioned one has none to write)."""
        ref = PodRef(str(meta(manifest).get("namespace") or ""),
                     str(meta(manifest).get("name") or ""), uid)
        decision = decide(results, watchdog_stops=self.watchdog_stops)
        existing = self.store.read(uid)
        self._pending_events(ref, results, existing)
        if decision.write is None:
            self._drop_stale(ref, existing, results, errors)
            return False
        refused = any(r.state is ContainerState.REFUSED for r in results.values())
        if not refused and from_api:
            plans = [c.plan for name in results
                     if (c := desired.container(ContainerKey(uid, name))) is not None]
            if not self._ensure_annotations(ref, manifest, plans, errors):
                self._drop_stale(ref, existing, results, errors)
                return False
        if existing is None or dict(existing.containers) != dict(decision.write):
            try:
                self.store.write(uid, decision.write, now=self.clock())
            except MarkersClosed as e:  # a pass that outlived the agent's stop
                log.info("%s", e)
                self._drop_stale(ref, existing, results, errors)
                return False
            except (OSError, MarkerError) as e:  # this pod's marker only: the others go on
                errors.add(MARKER_NOT_WRITTEN)
                log.error("pod %s/%s: the readiness marker could not be written under %s: %s",
                          ref.namespace, ref.name, self.store.root, e)
                self._drop_stale(ref, existing, results, errors)
                return False
            log.info("pod %s/%s: marker written (%s)", ref.namespace, ref.name, ", ".join(
                f"{n}={m.state.value}" for n, m in sorted(decision.write.items())))
            self._marker_events(ref, results)
        return True

    def _drop_stale(self, ref: PodRef, existing: Marker | None,
                    results: Mapping[str, ContainerResult], errors: set[str]) -> None:
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
                            plans: Sequence[ContainerPlan], errors: set[str]) -> bool:
        have = meta(manifest).get("annotations") or {}
        want: dict[str, str] = {}
        for plan in plans:
            want.update(derived_annotations(plan, self.keys))
        missing = {key: value for key, value in want.items() if have.get(key) != value}
        if not missing:
            return True
        if self.cluster is None:
            errors.add(ANNOTATIONS_NOT_WRITTEN)
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
