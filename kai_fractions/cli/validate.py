"""`kai-fractions validate -f FILE`: check manifests against the NvFractions contract, for the
protected keys the validating webhook refuses from users, and for what else it refuses in a
pod's spec (`admission.validate.manifest_problems`: host paths, ways past the containers).

Each error is one line, `<file>:<line>: <object>/<container>: <key>: <rule>`, the line being
where the object's YAML document starts; a spec problem names its field instead of a key. A
fractional pod that KAI's scheduler would not schedule (`spec.schedulerName`) is a warning, and
so is a GPU-sharing key where no pod reads it (`contract.misplaced_keys`: on a workload's own
metadata, or as a label)."""

from __future__ import annotations

import argparse
import json
import sys

from ..admission.config import AdmissionConfig
from ..admission.default_mps import default_mps_warnings
from ..contract import (
    DEFAULT_KEYS,
    ContractError,
    Keys,
    PodRequest,
    PodView,
    parse_pod,
)
from ..contract.misplaced_keys import misplaced_keys
from ..contract.scheduler import DEFAULT_SCHEDULER_NAME, scheduler_problem
from .admission import add_host_dirs, admission_config
from .manifests import InputError, Located, load_manifests

# The validating webhook's reasons (kai_fractions/admission/validate.py), for a user's manifest.
PROTECTED_IN_POD = ("is a protected key: only KAI's binder and the kai-fractions mirror and node "
                    "agent may create it; the validating webhook refuses it from anyone else")
PROTECTED_IN_TEMPLATE = ("a pod template may not carry a protected key; the binder writes it on "
                         "each pod after scheduling")
OFFLINE_GATE_IMAGE = "unused-offline"
"""`AdmissionConfig` names the gate's image; the checks of a user's manifest never read it."""


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
        "CronJob, ...) against the NvFractions annotation contract, and for protected keys "
        "(binder-owned, kai-fractions.io derived, the mirror's record), which the validating "
        "webhook refuses from users (a Pod read back from the cluster, with a metadata.uid, "
        "may carry them), and for what else that webhook refuses in a pod's spec (a hostPath "
        "reaching kai-fractions' or the kubelet's directories; in a fractional pod privileged, "
        "hostPID and other ways past its containers). Each error names its file:line, object, "
        "container and key (or field). The pod templates of other kinds are searched for below "
        "their spec (PyTorchJob, LeaderWorkerSet, RayCluster, JobSet, ...: a mapping whose "
        "spec.containers is a list), each named by its path; an object with none found is a "
        "warning, unless its kind holds none (ConfigMap, Service, Queue, ...). A fractional pod "
        "whose spec.schedulerName is not --scheduler-name is a warning: only KAI's scheduler "
        "binds GPU fractions. A GPU-sharing key where no pod reads it (on a workload's own "
        "metadata.annotations instead of its pod template's, or as a label) is a warning "
        "naming where it belongs. A file given by name with nothing to check is a warning; no "
        "such object anywhere is a usage error. Exit 0 when all are valid (warnings or not), "
        "1 when any breaks the contract, 2 on usage errors, unreadable input or nothing to "
        "check.",
    )
    add_common(p)
    p.add_argument("--scheduler-name", default=DEFAULT_SCHEDULER_NAME, metavar="NAME",
                   help="KAI's scheduler name (the chart's mirror.schedulerName); a fractional "
                   "pod naming another is a warning (default: %(default)s)")
    add_host_dirs(p)
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


def protected_key_errors(view: PodView, request: PodRequest, keys: Keys) -> list[ContractError]:
    """The protected keys (`Keys.is_protected`, as the validating webhook decides) on a manifest
    a user would apply: the webhook refuses them on a pod template always, and on a new Pod from
    anyone but the binder and kai-fractions' components. The one exception, as in the webhook:
    a new sm-sharing Pod may name its own container's MPS namespace. A Pod that has a
    metadata.uid was read back from the cluster, where the binder wrote them: not reported."""
    template = view.kind != "Pod"
    if not template and view.uid:
        return []
    exempt = None if template else request.admitted_namespace_key(keys)
    names = [c.name for c in view.all_containers]
    out = []
    for key in sorted(view.annotations):
        if not keys.is_protected(key) or key == exempt:
            continue
        # A derived key names its container by an id that may be shortened: the container is
        # the one whose `Keys.derived` it is (None: no container of this object).
        named = keys.split(key)
        container = named[0] if named else keys.derived_container(key, names)
        out.append(ContractError(key, PROTECTED_IN_TEMPLATE if template else PROTECTED_IN_POD,
                                 container=container))
    return out


def spec_errors(located: Located, request: PodRequest,
                config: AdmissionConfig) -> list[ContractError]:
    """What the validating webhook would refuse in the pod's spec, each problem as an error
    keyed by its field (its path in the object: a template's is `spec.template.spec...`), a
    hint said once, after the last problem that has it, as in the webhook's denial."""
    from ..admission.errors import hinted
    from ..admission.validate import manifest_problems  # only `validate` pays for it

    out = []
    for text in hinted(manifest_problems(located.spec, request, config)):
        field, _, rule = text.partition(": ")
        if field == "spec" or field.startswith("spec."):
            field = located.spec_path + field[len("spec"):]
        out.append(ContractError(field, rule))
    return out


def scheduler_warnings(located: Located, request: PodRequest,
                       scheduler: str) -> list[ContractError]:
    """A fractional pod (or template) that KAI's scheduler does not schedule: only KAI binds
    fractions (its webhook skips other schedulers' pods, and no BindRequest is made), so the
    pod would wait in its gate for ever. A warning, as a cluster may set the name on admission."""
    found = located.spec.get("schedulerName")
    key = f"{located.spec_path}.schedulerName"
    problem = scheduler_problem(found, scheduler, key) if request.shares else None
    if problem is None:
        return []
    return [ContractError(key, problem, None if found is None else str(found))]


def run(args: argparse.Namespace) -> int:
    try:
        keys = keys_from(args)
        config = admission_config(args, gate_image=OFFLINE_GATE_IMAGE, keys=keys)
        loaded = load_manifests(args.filename)
    except (InputError, ValueError) as e:  # ValueError: a host directory flag
        print(f"kai-fractions validate: {e}", file=sys.stderr)
        return 2
    for warning in loaded.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    results = []
    for located in loaded.views:
        request = parse_pod(located.view, keys)
        errors = (*request.errors, *protected_key_errors(located.view, request, keys),
                  *spec_errors(located, request, config))
        warnings = (*request.warnings,
                    *misplaced_keys(located.view, located.spec_path,
                                    located.owner_annotations, keys),
                    *scheduler_warnings(located, request, args.scheduler_name),
                    *(ContractError(located.spec_path, w)
                      for w in default_mps_warnings(located.spec, request, keys)))
        results.append((located, request, errors, warnings))
    invalid = [r for _, r, errors, _ in results if errors]
    if args.output == "json":
        print(json.dumps({
            "valid": not invalid,
            "objects": [{
                "object": at.ref,
                "file": at.file,
                "line": at.line,
                "fractional_containers": [s.container for s in r.shares],
                "errors": [_error_dict(e) for e in errors],
                "warnings": [_error_dict(w) for w in warnings],
            } for at, r, errors, warnings in results],
        }, indent=2))
    else:
        for at, _, errors, warnings in results:
            for e in errors:
                print(line(at.where, at.ref, e.container, e))
            for w in warnings:
                print("warning: " + line(at.where, at.ref, w.container, w), file=sys.stderr)
        print(f"{len(results) - len(invalid)} of {len(results)} object(s) valid",
              file=sys.stderr)
    return 1 if invalid else 0


def _error_dict(e) -> dict:
    return {"container": e.container, "key": e.key, "rule": e.rule, "value": e.value}
