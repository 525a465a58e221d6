"""Binder arithmetic: the exact annotation map KAI's binder writes for one allocation decision.

Both dialects (`dialect.Dialect`) compute as KAI does, in float64 with truncation, and write
canonical quantities: M=2000 MiB, portion 0.5 -> `1000Mi`; 20480 MiB -> `20Gi`; 10000 x 0.57 ->
`5699Mi`; with the patched dialect's reserve of 1024: `488Mi`, portion.limit 0.8 -> `780Mi`,
A100-40GB (40960) at 0.5 -> `19968Mi`. A user-given request is never overwritten; binder-owned
keys are always (re)written; `.gpu-compute.portion` only by the patched dialect.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from . import keys as k
from .decision_rules import received_portion_errors, reserved_gpu_errors
from .dialect import DEFAULT_DIALECT, Dialect, compute_portion_of, memory_mib
from .errors import ContractError, ContractViolation
from .numbers import format_plain
from .quantity import MIB, canonical_mib, mib_ceil
from .request import ComputeMode, ContainerShare, PodRequest


@dataclass(frozen=True, slots=True)
class BindDecision:
    """What the scheduler decided (the fields of KAI's BindRequest that the arithmetic reads)."""

    node_gpu_memory_mib: float
    """The node's `nvidia.com/gpu.memory` label (MiB per GPU, read as a float as KAI reads
    it); 0 or less means it is missing."""
    gpu_ids: tuple[str, ...] = ()
    """Reserved GPU UUIDs, one per fractional group."""
    received_portion: Fraction | None = None
    group_modes: tuple[ComputeMode, ...] = ()
    reserve_mib: int = 0
    cdi: bool = False
    resource_type: str = k.RESOURCE_TYPE_FRACTION
    dialect: Dialect = DEFAULT_DIALECT


def as_scheduler_writes(fraction: Fraction) -> Fraction:
    """The portion KAI's scheduler puts in its BindRequest for a `gpu-fraction` pod: the
    fraction as a float64, printed with two decimals (`fmt.Sprintf("%.2f", ...)` in upstream's
    pkg/scheduler/cache/cache.go, createBindRequest). Python's fixed-point format rounds the
    float's exact value, ties to even, as Go's does: 0.375 -> 0.38, 0.125 -> 0.12."""
    return Fraction(format(float(fraction), ".2f"))


def as_scheduler_sizes(request_bytes: int, node_gpu_memory_mib: float) -> Fraction | None:
    """The portion KAI's scheduler puts in its BindRequest for a pod it sizes by a memory
    request: the request's whole MiB over the node's GPU memory floored to a multiple of 100,
    rounded UP to a hundredth in float64, then printed with two decimals (upstream's
    pkg/scheduler/api/node_info/node_info.go, getNodeGpuMemory; gpu_sharing_node_info.go,
    getGpuMemoryFractionalOnNode; pkg/scheduler/cache/cache.go, createBindRequest). None where
    the label is not a whole number of MiB below 2^20 (KAI parses it as an integer, and reads
    a larger one as bytes): no portion is then known to be KAI's."""
    node = float(node_gpu_memory_mib)
    if not (0 < node < 1 << 20) or node != int(node):
        return None
    floored = int(node) - int(node) % 100
    if floored <= 0:
        return None
    return as_scheduler_writes(Fraction(math.ceil(float(request_bytes // MIB) / floored * 100)
                                        / 100))


def _check_decision(share: ContainerShare, d: BindDecision) -> list[ContractError]:
    errors = []
    if d.node_gpu_memory_mib <= 0:
        errors.append(ContractError(
            "node_gpu_memory_mib", f"unknown: the node has no {k.NODE_GPU_MEMORY_LABEL} label "
            "(GPU feature discovery publishes it); it is needed for all GPU memory arithmetic",
            str(d.node_gpu_memory_mib)))
    if d.reserve_mib < 0:
        errors.append(ContractError("reserve_mib", "must not be negative", str(d.reserve_mib)))
    elif 0 < d.node_gpu_memory_mib <= d.reserve_mib:
        errors.append(ContractError(
            "reserve_mib", f"leaves no GPU memory to share: the node has "
            f"{d.node_gpu_memory_mib} MiB per GPU", str(d.reserve_mib)))
    portion = d.received_portion
    if (portion is not None and portion > 1 and share.node_request_bytes is None
            and (share.fraction is not None or share.legacy_memory_bytes is None)):
        # KAI would write more memory than one GPU has; no node can honour that. With a
        # request of the pod's own, a portion above 1 only caps the compute portion at 1.
        errors.append(ContractError(
            "received_gpu.portion", "is above 1: the memory request computed from it would "
            "exceed one GPU", format_plain(portion) if portion < 10**15 else "huge"))
    else:  # one portion error at most: when above 1 is said, the portion's own rules are not
        errors.extend(received_portion_errors(portion))
    # For a gpu-fraction pod the portion sizes everything granted (its memory, and its SMs in
    # the patched dialect). A memory-sized pod keeps its own request whatever the portion; in
    # the patched dialect its portion may exceed its memory share on purpose (a compute
    # request), so it is not held to it.
    asked = share.fraction
    if (portion is not None and asked is not None and portion > asked
            and portion != as_scheduler_writes(asked)
            and not any(e.key == "received_gpu.portion" for e in errors)):
        # A decision must not grant more than the pod asked for: a caller that could write a
        # larger portion would hand the pod more memory or SMs than its owner requested. The
        # one exception is KAI's own rounding of the fraction to two decimals.
        rounded = as_scheduler_writes(asked)
        also = (f", or {format_plain(rounded)} as KAI's scheduler writes it"
                if rounded > asked else "")
        errors.append(ContractError(
            "received_gpu.portion", f"grants more than container {share.container!r} asks "
            f"for (at most {format_plain(asked)} of a GPU{also})",
            format_plain(portion) if portion < 10**15 else "huge"))
    short = _portion_short_of_memory(share, d)
    if short is not None and not any(e.key == "received_gpu.portion" for e in errors):
        errors.append(short)
    if d.gpu_ids and len(d.gpu_ids) != share.num_devices:
        errors.append(ContractError(
            "reserved_gpu_ids", f"lists {len(d.gpu_ids)} GPU(s) but the pod asks for "
            f"{share.num_devices} (gpu-fraction-num-devices)", ",".join(d.gpu_ids)))
    errors.extend(reserved_gpu_errors(d.gpu_ids))  # none named comes alone: no count error
    for i, mode in enumerate(d.group_modes):
        if mode != share.compute_mode:
            errors.append(ContractError(
                f"selected_fractional_gpu_groups[{i}].compute_sharing_mode",
                f"is {mode.value} but container {share.container!r} asks for "
                f"{share.compute_mode.value}; one GPU runs one compute mode", mode.value))
    return errors


def _portion_short_of_memory(share: ContainerShare, d: BindDecision) -> ContractError | None:
    """A memory-sized pod keeps its own request, so a portion below its share of the GPU
    would leave it more guaranteed memory than the scheduler counted on the GPU (a request
    raised after scheduling, or a caller's mistake): refused. Upstream KAI sizes the portion
    of such a pod as its whole MiB over the node's GPU memory, rounded UP to a hundredth, then
    prints it with two decimals, which keeps it (pkg/scheduler/api/node_info/
    gpu_sharing_node_info.go, getGpuMemoryFractionalOnNode; pkg/scheduler/cache/cache.go,
    createBindRequest); 1 MiB of slack absorbs its float64 arithmetic. The patched dialect's
    portion is a compute share, sized on its own, so it is not held to the memory."""
    portion, memory_mib_per_gpu = d.received_portion, d.node_gpu_memory_mib
    if (portion is None or portion <= 0 or share.fraction is not None or memory_mib_per_gpu <= 0
            or d.dialect.writes_compute_portion):
        return None
    asked = (share.node_request_bytes if share.node_request_bytes is not None
             else share.legacy_memory_bytes)
    if asked is None:
        return None
    asked_mib = asked // MIB  # KAI's Memory.Value() / BytesInMiB
    if (portion * Fraction(memory_mib_per_gpu) >= asked_mib - 1
            or asked_mib > memory_mib_per_gpu):  # no portion fits: the plan refuses the request
        return None
    needed = math.ceil(Fraction(asked_mib, 1) / Fraction(memory_mib_per_gpu) * 100) / 100
    return ContractError(
        "received_gpu.portion", f"is too small for container {share.container!r}: its own "
        f"request of {asked_mib} MiB of GPU memory (the binder keeps it) needs at least "
        f"{needed:g} of a {memory_mib_per_gpu:g} MiB GPU, as KAI's scheduler sizes it",
        format_plain(portion) if portion < 10**15 else "huge")


def _request_mib(share: ContainerShare, d: BindDecision) -> int | None:
    """The request to write, or None when the user gave one (it is never overwritten)."""
    if share.node_request_bytes is not None:
        return None
    if share.fraction is not None or share.legacy_memory_bytes is None:
        portion = d.received_portion if d.received_portion is not None else share.fraction
        if portion is None:
            raise ContractViolation([ContractError(
                "received_gpu.portion", "is required: the pod gives no GPU memory request")])
        return memory_mib(d.node_gpu_memory_mib, d.reserve_mib, portion)
    # KAI's admission turns `gpu-memory: N` into an `NMi` request before the binder runs.
    return mib_ceil(share.legacy_memory_bytes)


def binder_annotations(
    request: PodRequest, decision: BindDecision, keys: k.Keys = k.DEFAULT_KEYS
) -> dict[str, str]:
    """The annotations the binder writes in ONE patch; raises ContractViolation on any error."""
    if request.errors:
        raise ContractViolation(request.errors)
    share = request.share
    if decision.resource_type == k.RESOURCE_TYPE_REGULAR:
        if share is not None:
            raise ContractViolation([ContractError(
                "received_resource_type", f"is Regular but container {share.container!r} asks "
                "for a GPU fraction", decision.resource_type)])
        return {k.RECEIVED_RESOURCE_TYPE: k.RESOURCE_TYPE_REGULAR}
    if decision.resource_type != k.RESOURCE_TYPE_FRACTION:
        raise ContractViolation([ContractError(
            "received_resource_type", "must be Regular or Fraction", decision.resource_type)])
    if share is None:
        raise ContractViolation([ContractError(
            "received_resource_type", f"is Fraction but pod {request.pod.ref} has no "
            "fractional GPU request", decision.resource_type)])
    errors = _check_decision(share, decision)
    if errors:
        raise ContractViolation(errors)

    usable = decision.node_gpu_memory_mib - decision.reserve_mib
    name = share.container
    out: dict[str, str] = {}
    request_mib = _request_mib(share, decision)
    if request_mib is not None:
        if request_mib <= 0:
            raise ContractViolation([ContractError(
                keys.container(name, k.MEMORY_REQUEST), f"would be {request_mib} MiB: the "
                f"portion of {_mib_text(usable)} MiB (GPU memory minus reserve) rounds down "
                "to nothing",
                container=name)])
        out[keys.container(name, k.MEMORY_REQUEST)] = canonical_mib(request_mib)
    effective_request = (share.node_request_bytes if request_mib is None
                         else request_mib * MIB)
    assert effective_request is not None

    if share.limit_bytes is None:
        limit_bytes, limit_text = None, ""
        if share.limit_portion is not None:
            limit_mib = memory_mib(decision.node_gpu_memory_mib, decision.reserve_mib,
                                   share.limit_portion)
            limit_bytes, limit_text = limit_mib * MIB, canonical_mib(limit_mib)
        elif share.legacy_limit_bytes is not None:
            # gpu-memory.limit as written: what KAI's mutating webhook copies into the limit
            # key (upstream nvfractions/mutation.go, translateLegacyMemoryLimit), "8G" too.
            limit_bytes = share.legacy_limit_bytes
            limit_text = request.pod.annotations[k.GPU_MEMORY_LIMIT]
        if limit_bytes is not None:
            if limit_bytes < effective_request:
                raise ContractViolation([ContractError(
                    keys.container(name, k.MEMORY_LIMIT), f"would be {mib_ceil(limit_bytes)} "
                    f"MiB, below the request of {mib_ceil(effective_request)} MiB",
                    container=name)])
            out[keys.container(name, k.MEMORY_LIMIT)] = limit_text

    if effective_request > usable * MIB:
        raise ContractViolation([ContractError(
            keys.container(name, k.MEMORY_REQUEST), f"asks for {mib_ceil(effective_request)} "
            f"MiB but a GPU on this node shares only {_mib_text(usable)} MiB", container=name)])

    prefix = k.CDI_DEVICE_PREFIX if decision.cdi else ""
    out[keys.container(name, k.DEVICES)] = ",".join(prefix + g for g in decision.gpu_ids)
    if decision.dialect.writes_compute_portion:
        portion = _compute_portion(effective_request, usable, decision)
        key = keys.container(name, k.COMPUTE_PORTION)
        if portion is not None and k.key_name_length(key) > k.MAX_KEY_NAME:
            # The patched binder's own key: a name every other key holds may not fit this one
            # (`key_room` warns of it before the pod exists); the API server would refuse the
            # whole patch, so the decision is refused here, naming the rule.
            raise ContractViolation([ContractError(
                key, f"container {name!r} has a {len(name)}-character name, too long for this "
                f"key of the patched KAI binder: Kubernetes refuses an annotation key whose "
                f"name is over {k.MAX_KEY_NAME} characters, and this one's is "
                f"{k.key_name_length(key)}; name the container with at most "
                f"{len(name) - (k.key_name_length(key) - k.MAX_KEY_NAME)} characters",
                container=name)])
        if portion is not None:
            out[key] = portion
    out[k.RECEIVED_RESOURCE_TYPE] = k.RESOURCE_TYPE_FRACTION
    return out


def _mib_text(mib: float) -> str:
    return str(int(mib)) if mib == int(mib) else str(mib)


def _compute_portion(request_bytes: int, usable_mib: float, d: BindDecision) -> str | None:
    """The patched binder's `.gpu-compute.portion`: the received portion capped at 1, else the
    request's share of the usable memory; None (no key) when that rounds to nothing."""
    if d.received_portion is not None:
        return format_plain(min(d.received_portion, Fraction(1)))
    portion = compute_portion_of(request_bytes, usable_mib)
    if portion <= 0:
        return None
    return format_plain(Fraction(portion))


def parse_group_modes(values: Sequence[str]) -> tuple[ComputeMode, ...]:
    """Modes as KAI's BindRequest spells them; empty means time-slicing (older groups).
    Raises ContractViolation naming each group whose mode is unknown."""
    modes, errors = [], []
    for i, value in enumerate(values):
        try:
            modes.append(ComputeMode(value) if value else ComputeMode.TIME_SLICING)
        except ValueError:
            errors.append(ContractError(
                f"selected_fractional_gpu_groups[{i}].compute_sharing_mode",
                "must be one of: time-slicing, sm-sharing (empty means time-slicing)", value))
    if errors:
        raise ContractViolation(errors)
    return tuple(modes)
