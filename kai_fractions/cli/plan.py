"""`kai-fractions plan -f FILE --node-gpu-memory MIB --devices UUID[,UUID]`: show what the mirror
would write and what the node would enforce, without a cluster."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from fractions import Fraction
from types import MappingProxyType

from ..contract import (
    DEFAULT_DIALECT,
    DIALECTS,
    BindDecision,
    ContractError,
    ContractViolation,
    Dialect,
    NumberError,
    PodRequest,
    binder_annotations,
    derived_annotations,
    parse_decimal,
    parse_pod,
    plan_pod,
)
from ..contract.binder import as_scheduler_writes
from ..contract.decision_rules import received_portion_errors, reserved_gpu_errors
from ..contract.dialect import check_reserve
from .manifests import InputError, load_manifests
from .validate import add_common, keys_from, line

# The scheduler's decision comes from these flags: its errors name the flag, not the field.
_FLAGS = {
    "node_gpu_memory_mib": "--node-gpu-memory",
    "reserved_gpu_ids": "--devices",
    "received_gpu.portion": "--portion",
    "reserve_mib": "--reserve",
    "cdi": "--cdi",
}


def _flag(key: str) -> str | None:
    """`reserved_gpu_ids[1]` -> `--devices (item 2)`; None for a key of the pod's own."""
    base, _, index = key.partition("[")
    flag = _FLAGS.get(base)
    if flag is None or not index:
        return flag
    return f"{flag} (item {int(index.rstrip(']')) + 1})"


def error_line(where: str, ref: str, error) -> str:
    flag = _flag(error.key)
    if flag is None:
        return line(where, ref, error.container, error)
    return f"{where}: {ref}: {flag}: {error.rule}" + (
        f" (got {error.value!r})" if error.value is not None else "")


def register(sub) -> None:
    p = sub.add_parser(
        "plan", help="show the annotations the mirror would write and the node plan",
        description="Play the binder for each pod in FILE: compute the annotations KAI's binder "
        "(and the kai_fractions mirror) would write for the given node and devices, then the "
        "node-side plan per container (env, memory limits, compute mode). Errors name the "
        "flag (--devices, --portion, ...) or the pod's file:line, object, container and key. "
        "Exit codes as `validate`: a bad flag value (a device that is not a GPU UUID, the same "
        "GPU twice, a portion not above 0, a reserve that leaves no memory) is a usage error "
        "(2), found before any pod is read; a decision that does not fit a pod (the number of "
        "devices it asks for, a portion above its request) is that pod's error (1).",
    )
    add_common(p)
    p.add_argument("--node-gpu-memory", type=int, required=True, metavar="MIB",
                   help="the node's nvidia.com/gpu.memory label (MiB per GPU)")
    p.add_argument("--devices", required=True, metavar="UUID[,UUID...]",
                   help="the reserved GPU UUIDs, one per fractional group")
    p.add_argument("--portion", metavar="P",
                   help="the portion the scheduler gave (default: from the pod's own request; "
                   "a gpu-fraction as KAI's scheduler writes it, with two decimals)")
    p.add_argument("--reserve", type=int, default=0, metavar="MIB",
                   help="GPU memory kept back per GPU before the portion is taken, e.g. 1024 "
                   "for the MPS server; patched dialect only (default: %(default)s)")
    p.add_argument("--dialect", choices=DIALECTS, default=DEFAULT_DIALECT.value,
                   help="which KAI binder to play: upstream (KAI main: no compute portion key, "
                   "no reserve) or patched (both) (default: %(default)s)")
    p.add_argument("--cdi", action="store_true", help="write CDI device names")
    p.set_defaults(func=run)


def _decision(args: argparse.Namespace) -> BindDecision:
    from ..mirror.decision import MAX_NODE_GPU_MEMORY_MIB  # the mirror's bound, and its words

    if args.node_gpu_memory <= 0:
        raise InputError(f"--node-gpu-memory: must be the GPU memory in MiB, greater than 0, "
                         f"got {args.node_gpu_memory}")
    if args.node_gpu_memory > MAX_NODE_GPU_MEMORY_MIB:
        raise InputError(f"--node-gpu-memory: must be at most {MAX_NODE_GPU_MEMORY_MIB} MiB, "
                         f"got {args.node_gpu_memory}")
    dialect = Dialect(args.dialect)
    why = check_reserve(dialect, args.reserve)
    if why is not None:
        raise InputError(f"--reserve: {why}")
    if args.reserve >= args.node_gpu_memory:  # only the patched dialect takes a reserve
        raise InputError(f"--reserve: leaves no GPU memory to share: the node has "
                         f"{args.node_gpu_memory} MiB per GPU (--node-gpu-memory), got "
                         f"{args.reserve}")
    return BindDecision(
        node_gpu_memory_mib=args.node_gpu_memory,
        gpu_ids=_devices(args.devices),
        received_portion=_portion(args.portion),
        reserve_mib=args.reserve,
        cdi=args.cdi,
        dialect=dialect,
    )


def _devices(flag: str) -> tuple[str, ...]:
    """--devices, checked as a flag by the contract's own rules (each a GPU UUID, none twice);
    whether their number fits a pod is that pod's question."""
    devices = tuple(d.strip() for d in flag.split(",") if d.strip())
    if not devices:  # said of the flag: commas and blanks alone name no GPU
        raise InputError("--devices: names no GPU: give the reserved GPU UUID of each "
                         "fractional group")
    errors = reserved_gpu_errors(devices)
    if not errors:
        return devices
    error = errors[0]  # the first only: a usage error names one rule
    if error.key == "reserved_gpu_ids":  # unindexed, of a named list: the same GPU twice
        # Named, as the user reads the flag, rather than the whole list quoted.
        seen = [d.lower() for d in devices]  # one GPU in either case, as the contract reads it
        twice = next((d for i, d in enumerate(devices) if seen[i] in seen[:i]), error.value)
        raise InputError(f"--devices: lists {twice} twice")
    raise _flag_error(error, error.value or flag)


def _portion(flag: str | None) -> Fraction | None:
    """--portion, checked as a flag by the contract's own rules (a decimal above 0 that can be
    written as one); whether it fits a pod's request is that pod's question."""
    if flag is None:
        return None
    try:
        portion = parse_decimal(flag)
    except NumberError as e:
        raise InputError(f"--portion: {e}") from None
    errors = received_portion_errors(portion)
    if errors:  # the flag as typed: the exact value may read as a long ratio
        raise _flag_error(errors[0], flag)
    return portion


def _flag_error(error: ContractError, got: str) -> InputError:
    """A contract error about the decision, said of the flag that gave the field."""
    return InputError(f"{_flag(error.key)}: {error.rule}, got {got!r}")


def _as_kai_binds(decision: BindDecision, request: PodRequest) -> BindDecision:
    """Without --portion, a pod sized by `gpu-fraction` is planned with the portion KAI's
    scheduler writes for it (two decimals: 0.125 -> 0.12), not the fraction itself: the preview
    is what the binder will write, including a limit that the rounding puts below the
    request."""
    share = request.share
    if decision.received_portion is not None or share is None or share.fraction is None:
        return decision
    return replace(decision, received_portion=as_scheduler_writes(share.fraction))


def run(args: argparse.Namespace) -> int:
    try:
        keys = keys_from(args)
        decision = _decision(args)
        loaded = load_manifests(args.filename)
    except InputError as e:
        print(f"kai-fractions plan: {e}", file=sys.stderr)
        return 2
    for warning in loaded.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    results, failed = [], False
    for located in loaded.views:
        view = located.view
        request = parse_pod(view, keys)
        if request.share is None and not request.errors:
            continue  # not a fractional pod: nothing to plan
        try:
            annotations = binder_annotations(request, _as_kai_binds(decision, request), keys)
            bound = replace(view, annotations=MappingProxyType({**view.annotations,
                                                                **annotations}))
            plans = plan_pod(parse_pod(bound, keys), keys=keys)
        except ContractViolation as e:
            failed = True
            for err in e.errors:
                print(error_line(located.where, view.ref, err), file=sys.stderr)
            continue
        for plan in plans:
            annotations.update(derived_annotations(plan, keys))
        results.append((view, annotations, plans))
    if args.output == "json":
        out = [{"object": v.ref, "annotations": a,
                "containers": {p.container: p.to_dict() for p in plans}}
               for v, a, plans in results]
        print(json.dumps(out[0] if len(out) == 1 else out, indent=2))
    else:
        for view, annotations, plans in results:
            print(f"{view.ref}:")
            print("  annotations:")
            for key, value in annotations.items():
                print(f"    {key}: {value}")
            for plan in plans:
                print(f"  container {plan.container} ({plan.compute_mode.value}):")
                print(f"    memory: request {plan.request_mib} MiB, limit {plan.limit_mib} MiB")
                if plan.active_thread_percentage is not None:
                    print(f"    compute: {plan.active_thread_percentage}% of SMs "
                          f"(MPS namespace {plan.mps_namespace})")
                for name, value in plan.env.items():
                    print(f"    env {name}={value}")
    return 1 if failed else 0
