"""KAI's legacy pod-level keys (`gpu-fraction`, `gpu-memory`, their limits,
`gpu-fraction-num-devices`, `gpu-fraction-container-name`) and the per-container
`kai.scheduler/container.<c>.gpu-memory.portion.limit` keys: read on the container KAI puts
them on, then merged into that container's NvFractions share (which wins where both speak).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from fractions import Fraction

from . import keys as k
from .annotation_values import _above, _memory, _portion
from .collector import NO_FRACTION_ASKED, _Collector
from .numbers import NumberError, parse_positive_int
from .pod import PodView
from .quantity import MIB, has_unit
from .shares import ContainerShare, _complete

_MAX_LEGACY_DECIMALS = 5
_UINT64 = 1 << 64
_INT64 = 1 << 63
"""KAI reads gpu-memory with strconv.ParseUint(value, 10, 64): this many MiB and more fail."""


@dataclass
class _Legacy:
    container: str
    fraction: Fraction | None = None
    limit_portion: Fraction | None = None
    memory_bytes: int | None = None
    limit_bytes: int | None = None
    num_devices: int = 1

    @property
    def requested(self) -> bool:
        return self.fraction is not None or self.memory_bytes is not None


_LEGACY_POD_KEYS = frozenset(k.LEGACY_POD_KEYS)


def _legacy(pod: PodView, c: _Collector,
            nv_names: Iterable[str]) -> _Legacy | None:
    """The legacy keys' request, on the container KAI puts it on (upstream
    GetFractionContainerRef): the one `gpu-fraction-container-name` names, else the one the
    pod's NvFractions keys name (a compute mode is enough), else the first container."""
    a = pod.annotations
    if _LEGACY_POD_KEYS.isdisjoint(a):  # the usual pod: one set operation, not six lookups
        return None
    present = [key for key in k.LEGACY_POD_KEYS if key in a]
    regular = [ct.name for ct in pod.containers]
    named = a.get(k.GPU_FRACTION_CONTAINER_NAME)
    target = named or next(iter(nv_names), "") or (regular[0] if regular else "")
    if named is not None and pod.container(target) is None:
        if c.requests_fraction:
            c.error(k.GPU_FRACTION_CONTAINER_NAME, "names a container that is not in the pod",
                    named)
            return None
        # KAI resolves the name only for a pod that asks for a fraction (Mutate returns first).
        if named:
            c.warn(k.GPU_FRACTION_CONTAINER_NAME, "has no effect: names a container that is "
                   f"not in the pod; {NO_FRACTION_ASKED}", named)
        target = next(iter(nv_names), "") or (regular[0] if regular else "")
    if not target:
        c.error(present[0], "the pod has no container to apply it to", a[present[0]])
        return None
    legacy = _Legacy(container=target)
    # An empty gpu-fraction or gpu-memory asks for nothing, as KAI reads it (upstream
    # parseGpuFractionalPortion / parseGpuFractionalMemory): a chart may render one empty.
    fraction, memory = a.get(k.GPU_FRACTION), a.get(k.GPU_MEMORY)
    if fraction and memory:
        c.error(k.GPU_FRACTION, "gpu-fraction and gpu-memory are mutually exclusive; set one",
                fraction, target)
    if fraction:
        legacy.fraction = _portion(c, k.GPU_FRACTION, fraction, target, upper_open=True)
    if k.GPU_FRACTION_LIMIT in a:
        value = a[k.GPU_FRACTION_LIMIT]
        if not fraction:
            c.error(k.GPU_FRACTION_LIMIT, "needs gpu-fraction", value, target)
        else:
            legacy.limit_portion = _portion(c, k.GPU_FRACTION_LIMIT, value, target,
                                            upper_open=True, max_decimals=_MAX_LEGACY_DECIMALS)
            if (legacy.limit_portion is not None and legacy.fraction is not None
                    and not _above(legacy.limit_portion, legacy.fraction)):
                c.error(k.GPU_FRACTION_LIMIT, f"must be greater than gpu-fraction "
                        f"{a[k.GPU_FRACTION]!r}", value, target)
                legacy.limit_portion = None
    if memory:
        try:
            mib = parse_positive_int(memory)
        except NumberError as e:
            rule = f"{e.args[0]} of MiB"
            if has_unit(memory):  # `gpu-memory: 8Gi`: say where a quantity goes
                rule += (', without a unit (e.g. "8192"); a quantity with a unit goes in '
                         f"{c.keys.container(target, k.MEMORY_REQUEST)} instead")
            c.error(k.GPU_MEMORY, rule, memory, target)
        else:
            if mib >= _UINT64:  # KAI reads it with strconv.ParseUint(value, 10, 64)
                c.error(k.GPU_MEMORY, "must be below 2^64 MiB (KAI reads it as a 64-bit "
                        "number)", memory, target)
            else:
                legacy.memory_bytes = mib * MIB
    if k.GPU_MEMORY_LIMIT in a:
        value = a[k.GPU_MEMORY_LIMIT]
        if not memory:
            c.error(k.GPU_MEMORY_LIMIT, "needs gpu-memory", value, target)
        elif not has_unit(value):
            c.error(k.GPU_MEMORY_LIMIT, "must be a quantity with a unit, such as 8Gi", value,
                    target)
        else:
            legacy.limit_bytes = _memory(c, k.GPU_MEMORY_LIMIT, value, target)
            if (legacy.limit_bytes is not None and legacy.memory_bytes is not None
                    and legacy.limit_bytes < legacy.memory_bytes):
                c.error(k.GPU_MEMORY_LIMIT, f"must be greater than or equal to gpu-memory "
                        f"({a[k.GPU_MEMORY]} MiB)", value, target)
                legacy.limit_bytes = None
    if k.GPU_FRACTION_NUM_DEVICES in a:
        value = a[k.GPU_FRACTION_NUM_DEVICES]
        try:
            # KAI reads it with strconv.ParseInt (a leading '+' passes), gpu-memory with
            # ParseUint (it does not): upstream utilities/resources/gpu_sharing.go.
            devices = parse_positive_int(value, plus=True)
        except NumberError as e:
            c.error(k.GPU_FRACTION_NUM_DEVICES, e.args[0], value, target)
        else:
            if devices >= _INT64:  # ParseInt(value, 10, 64) fails: KAI refuses the pod
                c.error(k.GPU_FRACTION_NUM_DEVICES, "must be below 2^63 (KAI reads it as a "
                        "64-bit signed number)", value, target)
            else:
                legacy.num_devices = devices
    return legacy


def _portion_limits(
    pod: PodView, items: list[tuple[str, str, str]], c: _Collector
) -> dict[str, Fraction]:
    out: dict[str, Fraction] = {}
    for key, name, value in items:
        if pod.container(name) is None:
            c.error(key, "names a container that is not in the pod", value, name or None)
            continue
        portion = _portion(c, key, value, name, upper_open=True,
                           max_decimals=_MAX_LEGACY_DECIMALS)
        if portion is not None:
            out[name] = portion
    return out


def _merge_legacy(share: ContainerShare, legacy: _Legacy, c: _Collector) -> ContainerShare:
    if share.devices and len(share.devices) != legacy.num_devices:
        c.error(k.GPU_FRACTION_NUM_DEVICES, f"asks for {legacy.num_devices} device(s) but the "
                f"binder wrote {len(share.devices)}", str(legacy.num_devices), share.container)
    if share.request_bytes is not None or share.limit_bytes is not None:
        # NvFractions request/limit win over the legacy keys (KAI's admission writes the
        # request of a `gpu-memory` pod itself, so both must say the same amount).
        if (legacy.memory_bytes is not None and share.request_bytes is not None
                and share.request_bytes != legacy.memory_bytes):
            c.error(k.GPU_MEMORY, f"says {legacy.memory_bytes // MIB} MiB but the container's "
                    f"NvFractions memory request is {share.request_bytes / MIB:g} MiB; they "
                    "must agree", str(legacy.memory_bytes // MIB), share.container)
        if share.request_bytes is None and legacy.memory_bytes is not None:
            # Only an NvFractions limit: KAI's admission writes gpu-memory as the request
            # (upstream nvfractions/mutation.go, translateLegacyMemory), so it is the request,
            # not the limit that a request defaults to.
            _complete(share, request_bytes=legacy.memory_bytes)
        return _complete(share, num_devices=max(legacy.num_devices, len(share.devices)))
    legacy_key = k.GPU_FRACTION if legacy.fraction is not None else k.GPU_MEMORY
    return _complete(
        share,
        fraction=legacy.fraction,
        limit_portion=legacy.limit_portion,
        legacy_memory_bytes=legacy.memory_bytes if legacy.fraction is None else None,
        legacy_limit_bytes=legacy.limit_bytes if legacy.fraction is None else None,
        num_devices=max(legacy.num_devices, len(share.devices)),
        source_key=share.source_key or legacy_key,
    )


def _apply_num_devices(pod: PodView, shares: dict[str, ContainerShare], num_devices: int,
                       c: _Collector) -> None:
    """`gpu-fraction-num-devices` beside an NvFractions request: the same request on each of N
    GPUs (upstream ParsePodGPUFractionRequest applies it to every fraction type)."""
    if any(e.key == k.GPU_FRACTION_NUM_DEVICES for e in c.errors):
        return  # already reported as unreadable
    requesting = [s for s in shares.values()
                  if s.request_bytes is not None or s.limit_bytes is not None]
    value = pod.annotations[k.GPU_FRACTION_NUM_DEVICES]
    if not requesting:
        c.error(k.GPU_FRACTION_NUM_DEVICES, "needs a fraction request (gpu-fraction, "
                "gpu-memory or an NvFractions memory request) to apply to", value)
        return
    for share in requesting:
        if share.devices and len(share.devices) != num_devices:
            c.error(k.GPU_FRACTION_NUM_DEVICES, f"asks for {num_devices} device(s) but the "
                    f"binder wrote {len(share.devices)}", value, share.container)
        _complete(share, num_devices=num_devices)
