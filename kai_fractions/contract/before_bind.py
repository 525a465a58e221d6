"""What KAI's admission refuses, or may never bind, in a pod it has not bound yet: the legacy
keys, the NvFractions keys beside them, and where a portion limit may sit. After the bind the
binder's own keys sit beside the legacy ones, so these rules apply to unbound pods only.
"""

from __future__ import annotations

from . import keys as k
from .collector import NO_FRACTION_ASKED, _Collector
from .numbers import NumberError, parse_positive_int
from .parse_legacy import _UINT64
from .pod import PodView
from .quantity import MIB, QuantityError, canonical_mib, memory_bytes

FRACTION_LIMIT_NOT_BOUND = (
    "beside gpu-fraction, upstream KAI main may never bind this pod: its binder writes the "
    "container's NvFractions memory limit from it, and KAI's own admission webhook refuses "
    "that limit beside gpu-fraction on the binder's pod update (kai-scheduler/api utilities/"
    "resources/gpu_sharing_validation.go, ValidateGPUFractionRequest); to let a container "
    "burst, use gpu-memory with gpu-memory.limit, or its NvFractions request and limit keys")
"""Warned on an unbound pod: a patched KAI, or one whose webhook lets its binder through,
binds it, and the node agent enforces it, so it is not refused."""


def _before_bind(pod: PodView, keys: k.Keys, container: str, c: _Collector) -> None:
    """The legacy keys, and NvFractions keys beside them, as KAI's admission judges a pod it
    has not bound (upstream kai-scheduler/api utilities/resources/gpu_sharing_validation.go,
    ValidateGPUFractionRequest; KAI-Scheduler pkg/admission/webhook/v1alpha2/nvfractions/
    mutation.go, Mutate, which writes the NvFractions request, limit and portion limit from
    gpu-memory, gpu-memory.limit and gpu-fraction.limit and refuses a key already there with
    other text). After the bind the binder's own keys sit there, so this is for unbound pods."""
    a = pod.annotations
    for key in (k.GPU_MEMORY, k.GPU_FRACTION_CONTAINER_NAME):
        if key not in a or a[key]:
            continue
        # ParseUint(""); GetFractionContainerRef's empty name, looked up only in a pod that
        # asks for a fraction (an empty gpu-memory is one: the key's presence is the request).
        if c.requests_fraction:
            c.error(key, "is empty: KAI's admission refuses an empty value; remove the key or "
                    "give it a value", a[key], container)
        else:
            c.warn(key, f"is empty and has no effect: {NO_FRACTION_ASKED}", a[key], container)
    memory, request_key = a.get(k.GPU_MEMORY), keys.container(container, k.MEMORY_REQUEST)
    if memory and request_key in a:
        _same_text_as_kai(a[request_key], memory, request_key, container, c)
    fraction_limit_target = _portion_limit_target(pod)
    if a.get(k.GPU_FRACTION_LIMIT) and a.get(k.GPU_FRACTION) and container != \
            fraction_limit_target:
        c.error(k.GPU_FRACTION_LIMIT, f"would limit container {container!r} (its NvFractions "
                f"keys name it), but KAI takes a portion limit only for the container "
                f"gpu-fraction-container-name names or the first one "
                f"({fraction_limit_target!r}): name {container!r} with "
                "gpu-fraction-container-name", a[k.GPU_FRACTION_LIMIT], container)
    burst = next((key for key in (k.GPU_FRACTION_LIMIT, keys.portion_limit(container))
                  if a.get(key)), None)
    if a.get(k.GPU_FRACTION) and burst is not None:
        c.warn(burst, FRACTION_LIMIT_NOT_BOUND, a[burst], container)
    limit_key = keys.container(container, k.MEMORY_LIMIT)
    if limit_key not in a:
        return
    limit = a[limit_key]
    if a.get(k.GPU_FRACTION):
        c.error(limit_key, "may not be combined with gpu-fraction in a pod not bound yet (KAI "
                "refuses the pair); to let a container burst, use gpu-memory with "
                "gpu-memory.limit, or its NvFractions request and limit keys", limit, container)
    elif a.get(k.GPU_MEMORY) and k.GPU_MEMORY_LIMIT not in a:
        c.error(limit_key, "may not be combined with gpu-memory in a pod not bound yet (KAI "
                "refuses the pair); give the limit as gpu-memory.limit", limit, container)
    elif k.GPU_MEMORY_LIMIT in a and a[k.GPU_MEMORY_LIMIT] != limit:
        c.error(k.GPU_MEMORY_LIMIT, f"differs from {limit_key} {limit!r}, which KAI writes "
                "from gpu-memory.limit; set one of them", a[k.GPU_MEMORY_LIMIT], container)


def _same_text_as_kai(request: str, memory: str, key: str, container: str,
                      c: _Collector) -> None:
    """KAI's admission writes gpu-memory N as the request `MustParse("<N>Mi").String()` and
    refuses a request already there with other text, even for the same amount (`20480Mi`
    beside gpu-memory 20480, which KAI writes `20Gi`). A different amount is reported where
    the two are merged."""
    try:
        mib = parse_positive_int(memory)
        same_amount = memory_bytes(request) == mib * MIB
    except (NumberError, QuantityError):
        return  # reported where each is read
    if same_amount and mib < _UINT64 and request != canonical_mib(mib):
        c.error(key, f"is {request!r}, but KAI's admission writes gpu-memory {memory!r} as "
                f"{canonical_mib(mib)!r} and refuses other text for the same amount; write "
                f"{canonical_mib(mib)!r}, or set one of them", request, container)


def _portion_limit_target(pod: PodView) -> str:
    """The one container KAI's admission takes a portion limit for: the one
    gpu-fraction-container-name names, else the first."""
    return pod.annotations.get(k.GPU_FRACTION_CONTAINER_NAME) or (
        pod.containers[0].name if pod.containers else "")


def _portion_limit_placed(pod: PodView, key: str, name: str, c: _Collector) -> bool:
    """Whether a portion limit sits where KAI's admission accepts one in a pod not bound yet
    (upstream validateGpuMemoryPortionLimitAnnotation): beside gpu-fraction, on the container
    gpu-fraction-container-name names, else on the first container."""
    a = pod.annotations
    if not a.get(k.GPU_FRACTION):
        c.error(key, "can only be used together with gpu-fraction", a[key], name)
        return False
    target = _portion_limit_target(pod)
    if name != target:
        c.error(key, f"names container {name!r}, but KAI takes a portion limit only for the "
                f"container gpu-fraction applies to by name or position ({target!r})", a[key],
                name)
        return False
    return True
