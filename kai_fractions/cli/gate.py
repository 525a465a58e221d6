"""`kai-fractions gate`: the first init container of a fractional pod (see kai_fractions.gate).

Imports stay inside `run`: the CLI imports every command module to build its parser, and the
gate must start fast without pulling in anything it does not use.
"""

from __future__ import annotations

import argparse
import os

from ..contract.keys import NODE_CONDITION
from ..gate.paths import ANNOTATIONS_FILE, MARKER_DIR, POD_UID_ENV, TERMINATION_LOG


def _seconds(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {value!r}") from None
    if not number >= 0 or number == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {value!r}")
    return number


def _interval(value: str) -> float:
    number = _seconds(value)
    if number <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {value!r}")
    return number


def _condition(value: str) -> str:
    # Only words the gate's messages; the webhook passes the name its config checked.
    if not value or not value.isprintable() or value != value.strip() or " " in value:
        raise argparse.ArgumentTypeError(f"must name a node condition type, got {value!r}")
    return value


def register(sub) -> None:
    p = sub.add_parser(
        "gate", help="wait until the node agent has applied this pod's GPU limits",
        description="Run as the first init container of a fractional pod: wait for the node "
        "agent's readiness marker, check its plan digests against the pod's annotations "
        "(downward API) and exit 0 when they match. On a refusal, a mismatch that does not "
        "clear, or the timeout, exit 1 with a one-line reason in the termination message.",
    )
    p.add_argument("--marker-dir", default=MARKER_DIR, metavar="DIR",
                   help="this pod's marker directory (default: %(default)s)")
    p.add_argument("--annotations-file", default=ANNOTATIONS_FILE, metavar="FILE",
                   help="downward-API file with metadata.annotations (default: %(default)s)")
    p.add_argument("--pod-uid", default=os.environ.get(POD_UID_ENV, ""), metavar="UID",
                   help="this pod's UID (default: env POD_UID)")
    p.add_argument("--timeout", type=_seconds, default=600.0, metavar="SECONDS",
                   help="give up after this long (default: %(default)g)")
    p.add_argument("--poll-interval", type=_interval, default=0.5, metavar="SECONDS",
                   help="how often to look again (default: %(default)g)")
    p.add_argument("--termination-log", default=TERMINATION_LOG, metavar="FILE",
                   help="where the one-line outcome goes (default: %(default)s)")
    p.add_argument("--annotation-prefix", default=None, metavar="P",
                   help="per-container key prefix (default: nvidia.com/container.)")
    p.add_argument("--containers", default="", metavar="NAME[,NAME...]",
                   help="the pod's containers in order (the admission webhook sets it; default: "
                   "the containers the annotations name)")
    p.add_argument("--init-containers", default="", metavar="NAME[,NAME...]",
                   help="the pod's other init containers (the admission webhook sets it)")
    p.add_argument("--condition-name", type=_condition, default=NODE_CONDITION, metavar="NAME",
                   help="the node condition the node agent publishes, named where the gate says "
                   "the agent's reason is (the admission webhook sets it when it is not the "
                   "default; default: %(default)s)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import contextlib
    import sys
    from pathlib import Path

    from ..contract import DEFAULT_KEYS, Keys
    from ..gate import GateOptions, parse_names, run_gate
    from ..marker import MarkerError, read_boot_id
    from ..undumpable import undumpable_once

    refused = undumpable_once()  # done already when `main` started the gate
    if refused is not None:  # the webhook's refusal of exec into the gate still holds
        print(f"kai-fractions gate: warning: cannot make the gate undumpable: {refused}",
              file=sys.stderr)
    if not args.pod_uid:
        print("kai-fractions gate: no pod UID: set env POD_UID (fieldRef metadata.uid) or pass "
              "--pod-uid", file=sys.stderr)
        return 2
    try:
        keys = Keys(prefix=args.annotation_prefix) if args.annotation_prefix else DEFAULT_KEYS
    except ValueError as e:
        print(f"kai-fractions gate: --annotation-prefix: {e}", file=sys.stderr)
        return 2
    try:
        boot_id = read_boot_id()
    except MarkerError as e:
        line = (f"kai-fractions gate: {e}: a readiness marker written before the node restarted "
                "could not be told from this boot's, so none is trusted")
        print(line, file=sys.stderr)
        with contextlib.suppress(OSError):
            Path(args.termination_log).write_text(line + "\n")
        return 1
    opts = GateOptions(
        marker_dir=Path(args.marker_dir),
        annotations_file=Path(args.annotations_file),
        pod_uid=args.pod_uid,
        timeout=args.timeout,
        poll_interval=args.poll_interval,
        termination_log=Path(args.termination_log),
        keys=keys,
        boot_id=boot_id,
        containers=parse_names(args.containers),
        init_containers=parse_names(args.init_containers),
        condition_name=args.condition_name,
    )
    return run_gate(opts)
