"""The agent's side of the readiness marker (format and atomic write: `kai_fractions.marker`).

Decides what a pod's marker must say from the engine's results, and keeps the marker directory
tidy. The rules, in the order they are checked:

- a final refusal of any fractional container writes a `refused` marker at once (the gate fails
  the pod with the reason; pending siblings are left out, applied ones listed);
- anything pending writes nothing; a marker already there stays only if it is an `applied`
  marker whose digests are exactly the current plans' (the limits were in force when it was
  written and a passing hiccup must not flap it); any other marker is removed, so a marker can
  never claim limits that are not the current plan's;
- everything applied writes an `applied` marker with each container's plan digest.

Removal of a live pod's stale marker unlinks the file only: the gate holds a bind mount of the
pod's directory (subPathExpr), and a new directory would be invisible to it.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ...marker import (
    MARKER_FILE,
    ContainerMarker,
    Marker,
    MarkerError,
    MarkerState,
    is_temp_file,
    pod_marker_dir,
    read_marker,
    remove_marker,
    write_marker,
)
from ..engine import ContainerResult, ContainerState

REFUSED_DEFAULT_REASON = "Refused"


@dataclass(frozen=True, slots=True)
class MarkerDecision:
    write: Mapping[str, ContainerMarker] | None = None
    """The entries to write (None: write nothing)."""
    keep_existing: bool = False
    """Pending: an existing marker that still matches may stay."""


def _applied_message(result: ContainerResult) -> str:
    # Deterministic (no times, no counters): an agent restart compares equal and rewrites
    # nothing.
    mechanisms = ",".join(sorted(m.value for m in result.mechanisms)) or "none"
    compute = result.compute.value if result.compute is not None else "time-slicing"
    return f"limits in force: memory {mechanisms}; compute {compute}"


def decide(results: Mapping[str, ContainerResult]) -> MarkerDecision:
    """`results`: container name -> the agent's result for each fractional container."""
    refused = {n: r for n, r in results.items() if r.state is ContainerState.REFUSED}
    applied = {n: r for n, r in results.items() if r.state is ContainerState.APPLIED}
    if refused:
        entries = {n: ContainerMarker.refused(
            r.reason or REFUSED_DEFAULT_REASON,
            r.message or "refused by the node agent", r.plan_digest or "")
            for n, r in refused.items()}
        entries.update({n: ContainerMarker.applied(r.plan_digest or "", _applied_message(r))
                        for n, r in applied.items() if r.plan_digest})
        return MarkerDecision(write=entries)
    if len(applied) < len(results) or not results:
        return MarkerDecision(keep_existing=True)
    return MarkerDecision(write={n: ContainerMarker.applied(r.plan_digest or "",
                                                            _applied_message(r))
                                 for n, r in applied.items()})


def still_valid(existing: Marker, results: Mapping[str, ContainerResult]) -> bool:
    """An existing marker may stay while something is pending only if it is an applied
    marker for exactly the current plans."""
    if set(existing.containers) != set(results):
        return False
    for name, entry in existing.containers.items():
        if entry.state is not MarkerState.APPLIED or entry.plan_digest != results[name].plan_digest:
            return False
    return True


class MarkerStore:
    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root)

    def read(self, uid: str) -> Marker | None:
        """The pod's marker; None when absent or unreadable (an unreadable one is replaced)."""
        try:
            return read_marker(pod_marker_dir(self.root, uid), expected_pod_uid=uid)
        except MarkerError:
            return None

    def write(self, uid: str, entries: Mapping[str, ContainerMarker],
              now: float | None = None) -> Path:
        marker = Marker.build(uid, entries, clock=(lambda: now) if now is not None else time.time)
        return write_marker(self.root, marker)

    def unlink(self, uid: str) -> bool:
        """Remove a live pod's marker file (not its directory: the gate's mount holds it)."""
        path = pod_marker_dir(self.root, uid) / MARKER_FILE
        try:
            path.unlink()
            return True
        except FileNotFoundError:
            return False

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
        try:
            entries = list(os.scandir(self.root))
        except (FileNotFoundError, NotADirectoryError):
            return []
        stale = []
        for entry in entries:
            if entry.name in live or not entry.is_dir(follow_symlinks=False):
                continue
            try:
                pod_marker_dir(self.root, entry.name)
            except MarkerError:
                continue  # not a pod UID: not ours to touch
            with contextlib.suppress(OSError):
                written = any(name == MARKER_FILE or is_temp_file(name)
                              for name in os.listdir(entry.path))
                if written or now - entry.stat(follow_symlinks=False).st_mtime >= grace:
                    stale.append(entry.name)
        return sorted(stale)
