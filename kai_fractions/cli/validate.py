"""`kai-fractions validate -f FILE`: check manifests against the NvFractions contract.

Each error is one line, `<file>:<line>: <object>/<container>: <key>: <rule>`, the line being
where the object's YAML document starts."""

from __future__ import annotations

import argparse
import json
import sys

from ..contract import DEFAULT_KEYS, Keys, parse_pod
from .manifests import InputError, load_manifests


def add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-f", "--filename", action="append", required=True, metavar="FILE",
                        help="YAML file or directory (repeatable; `-` reads stdin)")
    parser.add_argument("--output", "-o", choices=("text", "json"), default="text")
    parser.add_argument("--annotation-prefix", default=DEFAULT_KEYS.prefix,
                        help="per-container key prefix (default: %(default)s)")


def register(sub) -> None:
    p = sub.add_parser(
        "validate", help="check manifests against the NvFractions contract",
        description="Check Pods and workloads with a pod template (Deployment, StatefulSet, Job, "
        "CronJob, ...) against the NvFractions annotation contract; each error names its "
        "file:line, object, container and key. A file given by name with none of those kinds "
        "is a warning; no such object anywhere is a usage error. Exit 0 when all are valid, "
        "1 when any breaks the contract, 2 on usage errors, unreadable input or nothing to "
        "check.",
    )
    add_common(p)
    p.set_defaults(func=run)


def keys_from(args: argparse.Namespace) -> Keys:
    try:
        return Keys(prefix=args.annotation_prefix)
    except ValueError as e:
        raise InputError(f"--annotation-prefix: {e}") from None


def line(where: str, ref: str, container: str | None, error) -> str:
    """`<file>:<line>: <object>/<container>: <key>: <rule> (got <value>)`; without a container
    (a pod-level key) the object alone."""
    return f"{where}: {ref}{'/' + container if container else ''}: {error.key}: {error.rule}" + (
        f" (got {error.value!r})" if error.value is not None else "")


def run(args: argparse.Namespace) -> int:
    try:
        keys = keys_from(args)
        loaded = load_manifests(args.filename)
    except InputError as e:
        print(f"kai-fractions validate: {e}", file=sys.stderr)
        return 2
    for warning in loaded.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    results = [(located, parse_pod(located.view, keys)) for located in loaded.views]
    invalid = [r for _, r in results if r.errors]
    if args.output == "json":
        print(json.dumps({
            "valid": not invalid,
            "objects": [{
                "object": r.pod.ref,
                "file": at.file,
                "line": at.line,
                "fractional_containers": [s.container for s in r.shares],
                "errors": [_error_dict(e) for e in r.errors],
                "warnings": [_error_dict(e) for e in r.warnings],
            } for at, r in results],
        }, indent=2))
    else:
        for at, r in results:
            for e in r.errors:
                print(line(at.where, r.pod.ref, e.container, e))
            for w in r.warnings:
                print("warning: " + line(at.where, r.pod.ref, w.container, w), file=sys.stderr)
        print(f"{len(results) - len(invalid)} of {len(results)} object(s) valid",
              file=sys.stderr)
    return 1 if invalid else 0


def _error_dict(e) -> dict:
    return {"container": e.container, "key": e.key, "rule": e.rule, "value": e.value}
