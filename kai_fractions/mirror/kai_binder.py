"""What KAI's binder must have written for a BindRequest's decision, from the pod as KAI's
scheduler read it: the follower's expectation, before it compares it with the pod.

The pod carries what the binder wrote beside what its user did, and upstream's binder keeps a
request or a limit it finds: so before the arithmetic (`contract.binder_annotations`), what the
binder wrote is left out, except what was on the pod before this bind (a failed bind's), which
KAI's scheduler then decided by and its binder kept.
"""

from __future__ import annotations

import math
from dataclasses import replace
from fractions import Fraction
from types import MappingProxyType

from ..contract import (
    BindDecision,
    ContainerShare,
    ContractViolation,
    Keys,
    PodRequest,
    binder_annotations,
    parse_pod,
)
from ..contract import keys as k
from ..contract.binder import as_scheduler_sizes, as_scheduler_writes
from ..contract.dialect import memory_mib
from ..contract.numbers import NumberError, format_plain, parse_decimal
from ..contract.quantity import MIB, QuantityError, memory_bytes, mib_ceil
from .compute import is_mirror_managed
from .errors import InvalidAllocation
from .store import PodSnapshot


def binder_request(pod: PodSnapshot, keys: Keys, decision: BindDecision
                   ) -> tuple[PodRequest, bool]:
    """The pod's request as KAI's scheduler read it, what the binder wrote left out, and
    whether its request was taken as one on the pod before the bind (raises
    InvalidAllocation).

    KAI reads a container's own request key before `gpu-fraction` and `gpu-memory`
    (kai-scheduler/api utilities/resources/gpu_sharing.go, ParsePodGPUFractionRequest; its
    TestParsePodGPUFractionRequest: "NvFractions request takes precedence over legacy
    annotations"), and KAI-Scheduler's binder keeps a request it finds
    (pkg/binder/plugins/nvfractions/nv_fractions.go, setNvFractionsMemoryAnnotation). A request
    beside `gpu-fraction` is taken for one that was on the pod before the bind (its user's, or
    what a failed bind left) only when the bind's portion is exactly what the scheduler sizes
    that request as (`as_scheduler_sizes`): it then decided by it. Any other is checked as the
    binder's. So a binder that writes less than it should, by less than a hundredth of the GPU,
    passes as such a request: never more than KAI accounted."""
    view = pod.view
    before = False
    kept = {key: v for key, v in view.annotations.items() if not is_mirror_managed(key, keys)}
    share = parse_pod(replace(view, annotations=MappingProxyType(kept)), keys).share
    if share is not None:
        c = share.container
        # A "" gpu-fraction or gpu-memory asks for nothing: KAI sizes by the request alone. A
        # gpu-memory pod is sized by its memory either way (KAI's webhook copies it into the
        # request), so only beside gpu-fraction can the request be what KAI decided by.
        before = bool(kept.get(k.GPU_FRACTION) and not kept.get(k.GPU_MEMORY)
                      and _sized_by_request(share, decision))
        if kept.get(k.GPU_MEMORY) or (kept.get(k.GPU_FRACTION) and not before):
            kept.pop(keys.container(c, k.MEMORY_REQUEST), None)
        if (k.GPU_FRACTION_LIMIT in kept or k.GPU_MEMORY_LIMIT in kept
                or keys.portion_limit(c) in kept):
            kept.pop(keys.container(c, k.MEMORY_LIMIT), None)
    request = parse_pod(replace(view, annotations=MappingProxyType(kept)), keys)
    if request.errors:
        raise InvalidAllocation(request.errors)
    return request, before


def _sized_by_request(share: ContainerShare, decision: BindDecision) -> bool:
    """The bind's portion is what KAI's scheduler sizes the share's own request as."""
    return (share.request_bytes is not None and decision.received_portion is not None
            and decision.received_portion == as_scheduler_sizes(
                share.request_bytes, decision.node_gpu_memory_mib))


def kept_limit(pod: PodSnapshot, request: PodRequest, decision: BindDecision, keys: Keys
               ) -> tuple[str, str, str] | None:
    """For a bind whose request was taken as on the pod before it (`binder_request`): (the
    key of the container's memory limit, its value on the pod, "" when KAI's binder would have
    kept it there or written it now, else the rule it breaks); None when the binder computes
    no limit, none is there, or the pod has no `gpu-fraction` to size an earlier bind by.

    KAI-Scheduler's binder writes the limit from the portion limit only when the container
    has none (pkg/binder/plugins/nvfractions/nv_fractions.go, setGpuMemoryPortionLimitAnnotation
    returns early), and a failed bind's Rollback removes nothing: the limit of a bind on an
    earlier node stays, sized for that node's GPU. Such a bind wrote the request and the limit
    from one node's memory (setNvFractionsMemoryAnnotation from the bind's portion, the
    fraction as the scheduler writes it; the limit from the portion limit), so a limit other
    than this bind's is accepted only when one GPU memory size gives both the kept request and
    that limit (`earlier_gpu_memory`), and the node bound now can honour it: at least the
    request, at most the GPU memory the binder shares here. `before` alone says no more than
    that the portion sizes the request as KAI's scheduler would, which a first bind's own
    request also does on a node whose label is a multiple of 100 MiB, or a user's request
    beside `gpu-fraction`: there any limit in between would pass."""
    share = request.share
    fraction = _fraction(request)
    if (share is None or share.limit_portion is None or share.request_bytes is None
            or fraction is None):
        return None
    key = keys.container(share.container, k.MEMORY_LIMIT)
    found = pod.annotations.get(key)
    if found is None:
        return None
    usable = decision.node_gpu_memory_mib - decision.reserve_mib
    first = as_scheduler_writes(fraction)  # the portion of a bind sized by the fraction
    rule = (f"a limit kept from an earlier bind must be at least the request "
            f"({mib_ceil(share.request_bytes)} MiB), at most the {usable:g} MiB a GPU of this "
            f"node shares, and the {format_plain(share.limit_portion)} of a GPU that KAI's "
            f"binder computes on a node where {format_plain(first)} of that GPU is the request")
    try:
        limit = memory_bytes(found)
    except QuantityError as e:
        return key, found, f"{rule}, and it {e}"
    if limit == MIB * memory_mib(decision.node_gpu_memory_mib, decision.reserve_mib,
                                 share.limit_portion):
        return key, found, ""  # this bind's own
    kept = (share.request_bytes <= limit <= usable * MIB
            and earlier_gpu_memory(share.request_bytes, first, limit, share.limit_portion,
                                   decision.reserve_mib) is not None)
    return key, found, "" if kept else rule


def _fraction(request: PodRequest) -> Fraction | None:
    """The pod's `gpu-fraction` (the parse leaves it out of a share that has a request of its
    own); None when there is none (checked by the parse already: never unreadable there)."""
    value = request.pod.annotations.get(k.GPU_FRACTION)
    try:
        fraction = parse_decimal(value) if value else None
    except NumberError:
        return None
    return fraction if fraction is not None and fraction > 0 else None


EARLIER_SIZES_TRIED = 128
"""GPU memory sizes `earlier_gpu_memory` tries at most: a request of R MiB at portion p pins the
size to [R / p, (R + 1) / p) MiB past the reserve, 1 / p + 1 whole sizes, 101 at the least
portion KAI's scheduler writes (0.01)."""


def earlier_gpu_memory(request_bytes: int, portion: Fraction, limit_bytes: int,
                       limit_portion: Fraction, reserve_mib: int) -> int | None:
    """A GPU memory size (whole MiB, as `nvidia.com/gpu.memory` labels it) on which KAI's
    binder computes `request_bytes` from `portion` and `limit_bytes` from `limit_portion`
    (`dialect.memory_mib`: uint64((M - reserve) x portion), MiB); None when there is none."""
    if portion <= 0 or request_bytes % MIB or limit_bytes % MIB:
        return None  # the binder writes whole MiB
    mib, limit_mib = request_bytes // MIB, limit_bytes // MIB
    low = max(math.floor(mib / float(portion)) + reserve_mib - 1, reserve_mib + 1)
    high = min(math.ceil((mib + 1) / float(portion)) + reserve_mib + 1,
               low + EARLIER_SIZES_TRIED - 1)
    for size in range(low, high + 1):
        if (memory_mib(size, reserve_mib, portion) == mib
                and memory_mib(size, reserve_mib, limit_portion) == limit_mib):
            return size
    return None


def binder_expectation(request: PodRequest, decision: BindDecision, keys: Keys
                       ) -> dict[str, str]:
    """What KAI's binder must have written for `request` (raises InvalidAllocation)."""
    try:
        return binder_annotations(request, decision, keys)
    except ContractViolation as e:
        raise InvalidAllocation(e.errors) from None
