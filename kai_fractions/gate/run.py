"""The gate's loop: poll the marker and the annotations until the verdict is final or time is up.

Side effects sit behind seams (clock, sleep, output streams) so tests run it in milliseconds.
The one-line outcome goes to the termination-message file, which `kubectl describe pod` shows,
and to stderr (stdout on success). At the timeout it says what the gate last waited for and
where the node agent's own reason is (`check.reason_where`, naming the node condition the agent
publishes): a new pod the agent holds pending gets no event, and the gate cannot ask the agent.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from ..contract import Keys
from ..contract.keys import NODE_CONDITION
from ..marker import (
    MARKER_FILE,
    SET_ASIDE_FILE,
    Marker,
    MarkerError,
    MarkerUnreadable,
    read_marker,
)
from .check import Outcome, Verdict, judge, not_written_yet, reason_where
from .downward import DownwardError, read_annotations

EXIT_RELEASED, EXIT_REFUSED = 0, 1
MAX_MESSAGE = 1024
"""Kubernetes keeps at most 4096 bytes of a termination message; one line stays well under."""


@dataclass(frozen=True, slots=True)
class GateOptions:
    marker_dir: Path
    annotations_file: Path
    pod_uid: str
    timeout: float
    poll_interval: float
    termination_log: Path
    keys: Keys
    boot_id: str
    """The host's boot ID, read once at the gate's start: only a marker of this boot counts."""
    containers: tuple[str, ...] = ()
    init_containers: tuple[str, ...] = ()
    condition_name: str = NODE_CONDITION
    """The node condition the node agent publishes (`--condition-name`): where the gate's wait
    says the agent's reason is."""


def one_line(message: str) -> str:
    line = " ".join(message.split())
    return line if len(line) <= MAX_MESSAGE else line[: MAX_MESSAGE - 3] + "..."


def observe(opts: GateOptions) -> Verdict:
    """One look at the marker and the annotations."""
    try:
        marker = read_marker(opts.marker_dir, expected_pod_uid=opts.pod_uid)
    except MarkerUnreadable as e:
        # Not a bad marker: the kubelet made the pod's directory with the marker root's mode
        # (0700) for this mount, and the agent opens it (0755) when it first writes there.
        return not_written_yet("the pod's marker directory is not readable until the "
                               f"agent's first write opens it ({e})",
                               condition=opts.condition_name)
    except MarkerError as e:
        # The agent rewrites it atomically; a bad one is not ours to trust, but may be replaced.
        return Verdict(Outcome.WAIT, f"the readiness marker is not valid: {e}")
    try:
        annotations = read_annotations(str(opts.annotations_file))
    except DownwardError as e:
        return Verdict(Outcome.WAIT, f"the pod's annotations cannot be read: {e}")
    return judge(annotations, marker, pod_uid=opts.pod_uid, keys=opts.keys,
                 boot_id=opts.boot_id, containers=opts.containers,
                 init_containers=opts.init_containers,
                 set_aside=_set_aside(opts) if marker is None else None,
                 condition=opts.condition_name)


def _set_aside(opts: GateOptions) -> Marker | None:
    """The marker the agent set aside, for the message only (it vouches for nothing); None
    when there is none or it cannot be read as this pod's."""
    try:
        return read_marker(opts.marker_dir, expected_pod_uid=opts.pod_uid, name=SET_ASIDE_FILE)
    except MarkerError:
        return None


def _write_termination_log(path: Path, line: str, stderr: TextIO) -> None:
    try:
        path.write_text(line + "\n")
    except OSError as e:
        print(f"kai-fractions gate: cannot write the termination message to {path}: "
              f"{e.strerror or e}", file=stderr)


def run_gate(
    opts: GateOptions,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
) -> int:
    """Wait for the node agent; 0 when the pod's limits are in force, 1 otherwise."""
    out = stdout or sys.stdout
    err = stderr or sys.stderr
    deadline = clock() + opts.timeout
    last = ""
    while True:
        verdict = observe(opts)
        if verdict.outcome is Outcome.RELEASE:
            line = one_line(verdict.message)
            _write_termination_log(opts.termination_log, line, err)
            print(line, file=out, flush=True)
            return EXIT_RELEASED
        if verdict.outcome is Outcome.FAIL:
            return _give_up(opts, one_line(verdict.message), err)
        if verdict.message != last:
            # Progress for `kubectl logs`: only when the reason changes, not every poll.
            print(f"waiting: {verdict.message}", file=err, flush=True)
            last = verdict.message
        remaining = deadline - clock()
        if remaining <= 0:
            marker = opts.marker_dir / MARKER_FILE
            if verdict.set_aside:
                where = f"{marker}, set aside as {opts.marker_dir / SET_ASIDE_FILE}"
            elif verdict.reason_named:
                where = f"{marker}"
            else:
                where = f"{marker}; {reason_where(opts.condition_name)}"
            return _give_up(opts, one_line(
                f"timed out after {opts.timeout:g}s waiting for the node agent to apply this "
                f"pod's GPU limits: {verdict.message} (marker: {where})"), err)
        sleep(min(opts.poll_interval, remaining))


def _give_up(opts: GateOptions, line: str, err: TextIO) -> int:
    _write_termination_log(opts.termination_log, line, err)
    print(line, file=err, flush=True)
    return EXIT_REFUSED


def parse_names(value: str | None) -> tuple[str, ...]:
    return tuple(n.strip() for n in (value or "").split(",") if n.strip())

