"""The marker directory on disk (`MarkerStore`): reads, writes, sets aside, restores and tidies
each pod's marker, latched shut at the agent's stop (`MarkersClosed`).

Apart from the rules of what a marker says (`marker_rules`) and the writer that settles pods
(`markers`): the file handling and its locking, without the cluster or the events.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import threading
import time
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path

from ...marker import (
    MARKER_FILE,
    SET_ASIDE_FILE,
    ContainerMarker,
    Marker,
    MarkerError,
    pod_marker_dir,
    read_marker,
    remove_leftovers,
    remove_marker,
    write_marker,
)
from .marker_rules import _written

log = logging.getLogger("kai_fractions.node.agent.markers")  # its name before the split

SET_ASIDE_CAUSE_FILE = "set-aside-cause"
"""Beside SET_ASIDE_FILE: why the agent set that marker aside, where a later pass may undo it
(`MarkerStore.set_aside`'s `cause`); absent for every other cause. No gate reads it."""
WATCHDOG_STOPPED = "watchdog-stopped"
"""The cause of a marker set aside at the agent's stop only because the watchdog, a container's
only memory tier, stopped with the agent (`Reconciler.set_aside_at_stop`): nothing else of what
it vouched for went, so the next agent restores it once its watchdog watches the pod
(`MarkerStore.stopped_for_watchdog`, `may_restore`)."""


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
