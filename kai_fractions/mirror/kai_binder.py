"""What KAI's binder must have written for a BindRequest's decision, from the pod as KAI's
scheduler read it: the follower's expectation, before it compares it with the pod.

The pod carries what the binder wrote beside what its user did, and upstream's binder keeps a
request or a limit it finds: so before the arithmetic (`contract.binder_annotations`), what the
binder wrote is left out, except what was on the pod before this bind (a failed bind's), which
KAI's scheduler then decided by and its binder kept.
"""

from __future__ import annotations

from dataclasses import replace
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
from ..contract.binder import as_scheduler_sizes
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
    """For a rebind (the request taken as on the pod before this bind): (the key of the
    container's memory limit, its value on the pod, "" when KAI's binder would have kept it
    there, else the rule it breaks); None when the binder computes no limit, or none is there.

    KAI-Scheduler's binder writes the limit from the portion limit only when the container
    has none (pkg/binder/plugins/nvfractions/nv_fractions.go, setGpuMemoryPortionLimitAnnotation
    returns early), and a failed bind's Rollback removes nothing: the limit of a bind on an
    earlier node stays, sized for that node's GPU. It is accepted when the node bound now can
    honour it: at least the request, at most the GPU memory the binder shares there."""
    share = request.share
    if share is None or share.limit_portion is None or share.request_bytes is None:
        return None
    key = keys.container(share.container, k.MEMORY_LIMIT)
    found = pod.annotations.get(key)
    if found is None:
        return None
    usable = decision.node_gpu_memory_mib - decision.reserve_mib
    rule = (f"a limit kept from an earlier bind must be at least the request "
            f"({mib_ceil(share.request_bytes)} MiB) and at most the {usable:g} MiB a GPU of "
            "this node shares")
    try:
        limit = memory_bytes(found)
    except QuantityError as e:
        return key, found, f"{rule}, and it {e}"
    return key, found, "" if share.request_bytes <= limit <= usable * MIB else rule


def binder_expectation(request: PodRequest, decision: BindDecision, keys: Keys
                       ) -> dict[str, str]:
    """What KAI's binder must have written for `request` (raises InvalidAllocation)."""
    try:
        return binder_annotations(request, decision, keys)
    except ContractViolation as e:
        raise InvalidAllocation(e.errors) from None
