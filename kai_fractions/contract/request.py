"""Parse a pod's annotations into a typed, immutable GPU share per container, with every error.

Nothing here raises for bad input: `parse_pod` returns a `PodRequest` whose `errors` lists each
broken rule (key, value, rule). Precedence and defaulting follow KAI:
NvFractions keys > `gpu-fraction` > `gpu-memory`; only a limit given means request := limit.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from fractions import Fraction
from functools import lru_cache

from . import keys as k
from .errors import ContractError
from .keys import MPS_NAMESPACE_PREFIX, is_mps_namespace_name
from .numbers import (
    NumberError,
    after_point,
    parse_decimal,
    parse_float64,
    parse_positive_int,
)
from .pod import PodView
from .quantity import MIB, QuantityError, canonical_mib, has_unit, memory_bytes


class ComputeMode(StrEnum):
    TIME_SLICING = "time-slicing"
    SM_SHARING = "sm-sharing"


DEFAULT_MODE = ComputeMode.TIME_SLICING
_MODES = ", ".join(m.value for m in ComputeMode)
# Physical GPU UUIDs as NVML prints them: GPU- then hex groups. MIG UUIDs are refused on purpose:
# NVML memory limits do not support MIG handles.
_GPU_UUID = re.compile(r"GPU-[0-9a-fA-F]+(?:-[0-9a-fA-F]+)*")
_MAX_LEGACY_DECIMALS = 5
_UINT64 = 1 << 64
"""KAI reads gpu-memory with strconv.ParseUint(value, 10, 64): this many MiB and more fail."""
MAX_DEVICES = 64
"""More GPUs than any node has: a longer list is refused before it is split and checked."""


@lru_cache(maxsize=4096)
def _uuids(devices: tuple[str, ...]) -> tuple[str, ...]:
    """Device items without their CDI prefix (a few distinct lists per node)."""
    return tuple(d.removeprefix(k.CDI_DEVICE_PREFIX) for d in devices)


@dataclass(frozen=True, slots=True)
class ContainerShare:
    """What one container asks for and what the binder wrote for it (raw, before arithmetic)."""

    container: str
    request_bytes: int | None = None
    """NvFractions `.gpu-memory.request` (the user's; never overwritten)."""
    limit_bytes: int | None = None
    """NvFractions `.gpu-memory.limit`."""
    fraction: Fraction | None = None
    """Legacy `gpu-fraction`: the portion of one GPU asked for."""
    limit_portion: Fraction | None = None
    """`gpu-fraction.limit` or `kai.scheduler/container.<c>.gpu-memory.portion.limit`."""
    legacy_memory_bytes: int | None = None
    """Legacy `gpu-memory` (MiB, converted to bytes)."""
    legacy_limit_bytes: int | None = None
    """Legacy `gpu-memory.limit`."""
    compute_mode: ComputeMode = DEFAULT_MODE
    devices_value: str | None = None
    """The `.gpus.devices` annotation verbatim (binder-written)."""
    devices: tuple[str, ...] = ()
    compute_portion: Fraction | None = None
    """The `.gpu-compute.portion` annotation (binder-written)."""
    num_devices: int = 1
    source_key: str | None = None
    """The annotation that makes the container fractional (what errors about it name)."""
    mps_namespace: str | None = None
    """The MPS namespace the admission webhook named for an sm-sharing container; None for a
    pod it did not wire (the plan then derives one from the pod UID)."""

    @property
    def node_request_bytes(self) -> int | None:
        """Guaranteed memory as the node reads it: the request, or the limit when only it is set."""
        return self.request_bytes if self.request_bytes is not None else self.limit_bytes

    @property
    def node_limit_bytes(self) -> int | None:
        """The cap as the node reads it: the limit, or the request when only it is set."""
        return self.limit_bytes if self.limit_bytes is not None else self.request_bytes

    @property
    def device_uuids(self) -> tuple[str, ...]:
        return _uuids(self.devices)

    @property
    def is_bound(self) -> bool:
        return bool(self.devices)


@dataclass(frozen=True, slots=True)
class PodRequest:
    pod: PodView
    shares: tuple[ContainerShare, ...]
    errors: tuple[ContractError, ...]
    warnings: tuple[ContractError, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.errors

    @property
    def share(self) -> ContainerShare | None:
        """The pod's fractional container (KAI allows one); None for non-fractional pods."""
        return self.shares[0] if self.shares else None

    def admitted_namespace_key(self, keys: k.Keys = k.DEFAULT_KEYS) -> str | None:
        """The key under which the admission webhook names the MPS namespace of the pod's
        sm-sharing container (the one protected key a user's new pod may carry); None when
        the pod has no sm-sharing container."""
        share = self.share
        if share is None or share.compute_mode is not ComputeMode.SM_SHARING:
            return None
        return keys.derived(share.container, k.ADMITTED_MPS_NAMESPACE)


MAX_LISTED_WARNINGS = 20
"""Warnings of one kind a parse lists in full, as a webhook's denial lists at most MAX_LISTED
problems (kai_fractions.admission.errors): a pod may carry thousands of keys that each have no
effect, and every warning travels in the admission response (and the API server's reply to
the user) and the CLI's output. The rest of that kind are counted in one line after the last
one listed."""
MAX_LISTED_CONTAINERS = 20
"""Container names a message lists (sorted) before it says how many more there are: a pod may
bring thousands, and the message is repeated for each key that names a missing one."""


class _Collector:
    """What one parse gathers: its errors and warnings, and what it works out about the whole
    pod, once, when first needed (the class defaults stand until then: most pods never need
    them, and a parse is the node agent's and the webhooks' hot path)."""

    _requests: bool | None = None
    _carries: bool | None = None
    _kinds: dict[str, int] | None = None
    """Warnings of each capped kind found so far, listed or not."""
    left_out: dict[str, tuple[int, ContractError]] | None = None
    """Per capped kind past its cap: where its summary goes and the summary's key and wording
    (its count is filled in by `listed_warnings`); None while nothing is left out."""

    def __init__(self, pod: PodView, keys: k.Keys) -> None:
        self.pod, self.keys = pod, keys
        self.errors: list[ContractError] = []
        self.warnings: list[ContractError] = []

    @property
    def requests_fraction(self) -> bool:
        """`requests_fraction` of the pod, worked out at the first question. Each of these walks
        every annotation: asked once per key (a compute mode per missing container), a pod of
        thousands of keys took seconds to parse."""
        if self._requests is None:
            self._requests = requests_fraction(self.pod, self.keys)
        return self._requests

    @property
    def carries_fraction(self) -> bool:
        """`requests_fraction`, or a binder-written key (`.gpus.devices`,
        `.gpu-compute.portion`): beside one, a compute mode on another container names a second
        fractional container, which KAI refuses (upstream validateDeviceAnnotationTargets,
        GetNvFractionsContainerName). Worked out once, as `requests_fraction` is."""
        if self._carries is None:
            self._carries = self.requests_fraction or _carries_binder_keys(self.pod, self.keys)
        return self._carries

    def error(self, key: str, rule: str, value: str | None = None, container: str | None = None):
        self.errors.append(ContractError(key, rule, value, container))

    def warn(self, key: str, rule: str, value: str | None = None, container: str | None = None):
        self.warnings.append(ContractError(key, rule, value, container))

    def lists(self, kind: str, key: str, what: str) -> bool:
        """Whether to list one more warning of `kind` (one a pod may carry once per key or
        container): True for the first MAX_LISTED_WARNINGS; the rest are only counted, and
        one line (`key`: and N more ... `what`) says how many. Asked before the warning's
        text is built, so those left out cost nothing more."""
        if self._kinds is None:
            self._kinds = {}
        seen = self._kinds[kind] = self._kinds.get(kind, 0) + 1
        if seen <= MAX_LISTED_WARNINGS:
            return True
        if self.left_out is None:
            self.left_out = {}
        if kind not in self.left_out:
            self.left_out[kind] = (len(self.warnings), ContractError(key, what))
        return False

    def listed_warnings(self) -> tuple[ContractError, ...]:
        """The warnings, each capped kind followed by its count of those left out."""
        if self.left_out is None or self._kinds is None:  # nothing left out
            return tuple(self.warnings)
        out = list(self.warnings)
        for kind, (at, summary) in sorted(self.left_out.items(), key=lambda item: -item[1][0]):
            more = self._kinds[kind] - MAX_LISTED_WARNINGS
            out.insert(at, ContractError(summary.key, f"and {more} more warning(s) of the same "
                                         f"kind, not listed: {summary.rule}"))
        return tuple(out)


def _memory(c: _Collector, key: str, value: str, container: str | None) -> int | None:
    try:
        amount = memory_bytes(value)
    except QuantityError as e:
        c.error(key, f"GPU memory {e}", value, container)
        return None
    if amount < MIB:
        # The node enforces whole MiB; gpu-fractioning's node side refuses less, and so do we.
        c.error(key, "GPU memory must be at least 1 MiB (1Mi)", value, container)
        return None
    return amount


def _portion(
    c: _Collector, key: str, value: str, container: str | None, *, upper_open: bool,
    max_decimals: int | None = None,
) -> Fraction | None:
    """A portion of one GPU: 0 < x < 1 (upper_open) or 0 < x <= 1."""
    number, rule = _checked_portion(value, upper_open, max_decimals)
    if rule is not None:
        c.error(key, rule, value, container)
    return number


@lru_cache(maxsize=4096)  # pure; a cluster repeats the same few portions
def _checked_portion(
    value: str, upper_open: bool, max_decimals: int | None
) -> tuple[Fraction | None, str | None]:
    # The range is checked on the float64 KAI reads (upstream parseGpuFractionalPortion,
    # validateFractionLimitShorthand, validateGpuMemoryPortionLimitAnnotation: ParseFloat,
    # then `<= 0 || >= 1`), before the exact value is built: `0.99999999999999999` is 1 there.
    try:
        approx = parse_float64(value)
    except NumberError as e:
        return None, e.args[0]
    if approx <= 0 or approx > 1 or (upper_open and approx == 1):
        return None, f"must be a portion of one GPU, {'0 < x < 1' if upper_open else '0 < x <= 1'}"
    if max_decimals is not None and after_point(value) > max_decimals:
        return None, f"must have at most {max_decimals} digits after the decimal point"
    return parse_decimal(value), None


def _above(limit: Fraction, fraction: Fraction) -> bool:
    """limit > fraction as KAI compares them: in float64 (upstream
    validateFractionLimitShorthand, validateGpuMemoryPortionLimitAnnotation: `limit <=
    fraction` refused). float() of the exact value is the float64 ParseFloat reads from the
    text (both round correctly), and a float64 above another means the exact value is too."""
    return float(limit) > float(fraction)


def _devices(c: _Collector, key: str, value: str, container: str) -> tuple[str, ...]:
    items, rule, offending = _checked_devices(value)
    if rule is not None:
        c.error(key, rule, offending, container)
    return items


@lru_cache(maxsize=4096)  # pure; every pod on a GPU carries the same device string
def _checked_devices(value: str) -> tuple[tuple[str, ...], str | None, str]:
    """(items, None, "") when valid, else ((), rule, offending value)."""
    if value.count(",") >= MAX_DEVICES:
        return (), f"must list at most {MAX_DEVICES} GPUs", value
    items = [item.strip() for item in value.split(",")]
    if not value.strip() or any(not item for item in items):
        return (), "must be a comma-separated list of GPU UUIDs with no empty item", value
    for item in items:
        uuid = item.removeprefix(k.CDI_DEVICE_PREFIX)
        if uuid.startswith("MIG-"):
            return (), "MIG devices cannot be shared as fractions", item
        if not _GPU_UUID.fullmatch(uuid):
            return (), (f"each item must be a GPU UUID (GPU-...) or "
                        f"{k.CDI_DEVICE_PREFIX}<uuid>"), item
    if len({i.removeprefix(k.CDI_DEVICE_PREFIX) for i in items}) != len(items):
        return (), "lists the same GPU twice", value
    return tuple(items), None, ""


def _scan(
    pod: PodView, keys: k.Keys, c: _Collector
) -> tuple[dict[str, dict[str, tuple[str, str]]], list[tuple[str, str, str]]]:
    """One pass over the annotations: `<prefix><container><suffix>` keys grouped by container
    (bad keys reported), and the `kai.scheduler/container.<c>...portion.limit` keys. Whatever
    a key's report needs of the whole pod (its container list, whether it asks for a fraction)
    is worked out once, at the first key that needs it: once per key, a pod of thousands of
    such keys cost seconds to parse."""
    names = {ct.name for ct in pod.all_containers}
    listed: str | None = None  # the pod's containers, as the messages name them
    by_container: dict[str, dict[str, tuple[str, str]]] = {}
    portion_limits: list[tuple[str, str, str]] = []
    prefix, skip = keys.prefix, len(keys.prefix)
    for key, value in pod.annotations.items():
        if not key.startswith(prefix):
            if key.startswith(k.PORTION_LIMIT_PREFIX):  # most keys are nobody's: skip the call
                name = keys.split_portion_limit(key)
                if name is not None:
                    portion_limits.append((key, name, value))
            continue
        name, dot, tail = key[skip:].partition(".")
        suffix = dot + tail
        if not name:
            c.error(key, "the container name between the prefix and the suffix is empty", value)
        elif suffix not in k.SUFFIXES:
            c.error(key, f"unknown suffix {suffix or '(none)'!r}; known suffixes: "
                    + ", ".join(k.SUFFIXES), value, name)
        elif name not in names:
            if suffix == k.COMPUTE_MODE and not c.carries_fraction:
                if value in _MODE_BY_VALUE and not c.lists(
                        _STRAY_MODE, keys.container("<container>", k.COMPUTE_MODE),
                        _STRAY_MODE_WHAT):
                    continue  # counted; its warning is one of those left out
                if listed is None:
                    listed = _container_list(names)
                _stray_mode(c, key, value, name, _missing(name, listed))
            else:
                if listed is None:
                    listed = _container_list(names)
                c.error(key, _missing(name, listed), value, name)
        else:
            by_container.setdefault(name, {})[suffix] = (key, value)
    return by_container, portion_limits


def _container_list(names: Iterable[str]) -> str:
    """The pod's containers as a message lists them: sorted, at most MAX_LISTED_CONTAINERS."""
    ordered = sorted(names)
    if not ordered:
        return "none"
    if len(ordered) <= MAX_LISTED_CONTAINERS:
        return ", ".join(ordered)
    return (", ".join(ordered[:MAX_LISTED_CONTAINERS])
            + f" and {len(ordered) - MAX_LISTED_CONTAINERS} more")


def _missing(name: str, listed: str) -> str:
    return f"names container {name!r}, which is not in the pod (containers: {listed})"


_MODE_BY_VALUE = {m.value: m for m in ComputeMode}
_STRAY_MODE = "stray-mode"
_STRAY_MODE_WHAT = ("compute modes on containers the pod does not have, which have no effect "
                    "in a pod that requests no GPU fraction")
_IDLE_MODE = "idle-mode"
_IDLE_MODE_WHAT = "compute modes on containers that request no GPU fraction, which have no effect"
# The keys that make a container fractional, in the order errors prefer to name them.
_SOURCE_SUFFIXES = (k.MEMORY_REQUEST, k.MEMORY_LIMIT, k.DEVICES, k.COMPUTE_PORTION)
_REQUEST_SUFFIXES = (k.MEMORY_REQUEST, k.MEMORY_LIMIT)

NO_FRACTION_ASKED = (
    "KAI resolves the fraction's container only in a pod that requests a GPU fraction "
    "(gpu-fraction, gpu-memory, or an NvFractions memory request or limit), and this pod "
    "requests none")
"""Ends the warning for a key KAI's admission looks at only beside a fraction request (where it
refuses the same value): what an unchanged KAI manifest may carry, so it is not refused."""


def requests_fraction(pod: PodView, keys: k.Keys = k.DEFAULT_KEYS) -> bool:
    """Whether KAI's admission takes the pod for one that asks for a GPU fraction (upstream
    RequestsGPUFraction, kai-scheduler/api utilities/resources/gpu_sharing.go): `gpu-fraction`
    or `gpu-memory` present, even empty, or an NvFractions `.gpu-memory.request` or
    `.gpu-memory.limit` key. Only then does its mutating webhook resolve the fraction's
    container (KAI-Scheduler pkg/admission/webhook/v1alpha2/nvfractions/mutation.go, Mutate,
    GetFractionContainerRef) and refuse a container name it cannot find; a compute mode alone
    makes no request (getNvFractionData)."""
    a = pod.annotations
    if k.GPU_FRACTION in a or k.GPU_MEMORY in a:
        return True
    prefix = keys.prefix
    return any(key.startswith(prefix) and key.endswith(_REQUEST_SUFFIXES) for key in a)


def _carries_binder_keys(pod: PodView, keys: k.Keys) -> bool:
    prefix = keys.prefix
    return any(key.startswith(prefix) and key.endswith(k.BINDER_SUFFIXES)
               for key in pod.annotations)


def _stray_mode(c: _Collector, key: str, value: str, name: str, missing: str) -> None:
    """A compute mode naming a container the pod does not have, in a pod that asks for no
    fraction: KAI's admission checks only its value (ExtractNvFractionsData refuses an unknown
    mode in every pod) and otherwise admits the pod unchanged, so it is a warning here."""
    if value not in _MODE_BY_VALUE:
        c.error(key, f"must be one of: {_MODES}", value, name)
    else:
        c.warn(key, f"has no effect: {missing}; {NO_FRACTION_ASKED}", value, name)


def _share_from_nvfractions(
    name: str, values: dict[str, tuple[str, str]], c: _Collector
) -> ContainerShare:
    """`values` maps suffix -> (full key, value) for one container."""
    request = limit = None
    if k.MEMORY_REQUEST in values:
        request = _memory(c, *values[k.MEMORY_REQUEST], name)
    if k.MEMORY_LIMIT in values:
        limit = _memory(c, *values[k.MEMORY_LIMIT], name)
    if request is not None and limit is not None and limit < request:
        key, value = values[k.MEMORY_LIMIT]
        c.error(key, "must be greater than or equal to the request "
                f"{values[k.MEMORY_REQUEST][1]!r}", value, name)
    mode = DEFAULT_MODE
    if k.COMPUTE_MODE in values:
        key, raw = values[k.COMPUTE_MODE]
        mode = _MODE_BY_VALUE.get(raw, DEFAULT_MODE)
        if raw not in _MODE_BY_VALUE:
            c.error(key, f"must be one of: {_MODES}", raw, name)
    devices: tuple[str, ...] = ()
    if k.DEVICES in values:
        devices = _devices(c, *values[k.DEVICES], name)
    portion = None
    if k.COMPUTE_PORTION in values:
        portion = _portion(c, *values[k.COMPUTE_PORTION], name, upper_open=False)
    source = None
    for suffix in _SOURCE_SUFFIXES:
        if suffix in values:
            source = values[suffix][0]
            break
    return ContainerShare(
        container=name,
        source_key=source,
        request_bytes=request,
        limit_bytes=limit,
        compute_mode=mode,
        devices_value=values[k.DEVICES][1] if devices else None,
        devices=devices,
        compute_portion=portion,
        num_devices=len(devices) or 1,
    )


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
            c.error(k.GPU_MEMORY, f"{e.args[0]} of MiB", memory, target)
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
        try:
            # KAI reads it with strconv.ParseInt (a leading '+' passes), gpu-memory with
            # ParseUint (it does not): upstream utilities/resources/gpu_sharing.go.
            legacy.num_devices = parse_positive_int(a[k.GPU_FRACTION_NUM_DEVICES], plus=True)
        except NumberError as e:
            c.error(k.GPU_FRACTION_NUM_DEVICES, e.args[0], a[k.GPU_FRACTION_NUM_DEVICES], target)
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


def parse_pod(pod: PodView, keys: k.Keys = k.DEFAULT_KEYS) -> PodRequest:
    """Every fractional share the pod asks for, and every contract error, without raising."""
    c = _Collector(pod, keys)
    by_container, portion_limit_items = _scan(pod, keys, c)
    shares: dict[str, ContainerShare] = {
        name: _share_from_nvfractions(name, values, c)
        for name, values in by_container.items()
    }
    legacy = _legacy(pod, c, by_container)
    named = pod.annotations.get(k.GPU_FRACTION_CONTAINER_NAME)
    if named and legacy is not None and by_container and c.requests_fraction:
        # Only a pod that asks for a fraction has its container resolved (upstream Mutate,
        # GetFractionContainerRef; validateGpuFractionContainerNameConsistency).
        for name in by_container:
            if name != named:
                c.error(k.GPU_FRACTION_CONTAINER_NAME, f"names container {named!r} but the "
                        f"NvFractions keys name {name!r}; they must agree", named, name)
    # What KAI's admission refuses in a pod it has not bound yet: a bound pod carries the
    # binder's own keys (its limit beside the legacy keys), so those rules are for unbound pods.
    bound = (legacy is not None or bool(portion_limit_items)) and any(
        share.devices for share in shares.values())
    if legacy is not None and not bound:
        _before_bind(pod, keys, legacy.container, c)
    if legacy is not None and legacy.requested:
        # After a bind the binder's NvFractions request sits beside the legacy key it came
        # from; the NvFractions key wins (precedence), so that is not worth a warning.
        share = shares.get(legacy.container)
        base = share or ContainerShare(container=legacy.container)
        shares[legacy.container] = _merge_legacy(base, legacy, c)
    elif legacy is not None and k.GPU_FRACTION_NUM_DEVICES in pod.annotations:
        _apply_num_devices(pod, shares, legacy.num_devices, c)
    for name, portion in _portion_limits(pod, portion_limit_items, c).items():
        share = shares.get(name)
        key = keys.portion_limit(name)
        value = pod.annotations[key]
        if not bound and not _portion_limit_placed(pod, key, name, c):
            continue
        if share is None:
            c.error(key, "the container requests no GPU fraction to limit", value, name)
        elif share.limit_portion is not None:
            # KAI's admission writes this key from gpu-fraction.limit, verbatim (upstream
            # nvfractions Mutate, translateLegacyGpuFractionLimit): the same value twice is
            # that pod; another value, KAI refuses.
            if value != pod.annotations.get(k.GPU_FRACTION_LIMIT):
                c.error(key, f"differs from {k.GPU_FRACTION_LIMIT} "
                        f"{pod.annotations.get(k.GPU_FRACTION_LIMIT)!r}, which KAI copies into "
                        "this key; set one of them", value, name)
        elif share.limit_bytes is not None:
            # The absolute limit wins. After a bind it is the one the binder computed from
            # this very key, so both being present is the normal, bound state.
            continue
        elif share.fraction is not None and not _above(portion, share.fraction):
            c.error(key, "must be greater than the container's gpu-fraction", None, name)
        else:
            _complete(share, limit_portion=portion)
    _check_shares(pod, keys, shares, c)
    for share in shares.values():
        _admitted_namespace(pod, keys, share, c)
    if k.LEGACY_COMPUTE_MODE in pod.annotations:
        c.warn(k.LEGACY_COMPUTE_MODE, "is ignored by KAI and by kai_fractions; set "
               f"{keys.prefix}<container>{k.COMPUTE_MODE} instead",
               pod.annotations[k.LEGACY_COMPUTE_MODE])
    # In the pod's container order; KAI allows one fractional container, so one is the rule.
    ordered = tuple(shares.values()) if len(shares) < 2 else tuple(
        shares[ct.name] for ct in pod.all_containers if ct.name in shares)
    warnings = tuple(c.warnings) if c.left_out is None else c.listed_warnings()
    return PodRequest(pod=pod, shares=ordered, errors=tuple(c.errors), warnings=warnings)


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


def _admitted_namespace(pod: PodView, keys: k.Keys, share: ContainerShare,
                        c: _Collector) -> None:
    """The webhook's MPS namespace name of an sm-sharing container, when the pod carries one."""
    key = keys.derived(share.container, k.ADMITTED_MPS_NAMESPACE)
    value = pod.annotations.get(key)
    if value is None or share.compute_mode is not ComputeMode.SM_SHARING:
        return  # a time-slicing container has no namespace: the key changes nothing there
    if is_mps_namespace_name(value):
        _complete(share, mps_namespace=value)
    else:
        c.error(key, f"must be {MPS_NAMESPACE_PREFIX} and 20 lowercase hex digits, as the "
                "admission webhook names an MPS namespace", value, share.container)


def _complete(share: ContainerShare, **fields: object) -> ContainerShare:
    """Sets fields of a share this parse made and has not handed out yet, in place: it is
    frozen for everyone who receives it, and a copy (`dataclasses.replace`) is a sizeable part
    of parsing a legacy pod (measured as P4 in benchmarks/)."""
    for name, value in fields.items():
        object.__setattr__(share, name, value)
    return share


def _check_shares(
    pod: PodView, keys: k.Keys, shares: dict[str, ContainerShare], c: _Collector
) -> None:
    fractional = [name for name, share in shares.items() if share.source_key is not None]
    for name, share in shares.items():
        view = pod.container(name)
        if share.source_key is None:
            # Only a compute mode on a container that asks for no fraction. Beside another
            # container's fraction KAI refuses it (upstream validateNvFractionsAnnotations:
            # the NvFractions keys of one container per pod); alone it changes nothing.
            key = keys.container(name, k.COMPUTE_MODE)
            if fractional:
                c.error(key, f"names container {name!r}, but the pod's GPU fraction is on "
                        f"{fractional[0]!r}: KAI allows the NvFractions keys of one container "
                        "per pod (set the compute mode on that container)", None, name)
            elif c.lists(_IDLE_MODE, keys.container("<container>", k.COMPUTE_MODE),
                         _IDLE_MODE_WHAT):
                c.warn(key, "has no effect: the container requests no GPU fraction",
                       container=name)
            continue
        if view is not None and (view.whole_gpus != 0 or view.sets_whole_gpus):
            c.error(share.source_key, "a GPU fraction may not be "
                    f"combined with a whole {k.WHOLE_GPU_RESOURCE} request", None, name)
    if fractional:
        # Upstream getFirstGPULimit: any container's nvidia.com/gpu, even 0, even another's.
        for views in (pod.containers, pod.init_containers):
            for view in views:
                if (view.sets_whole_gpus or view.whole_gpus) and view.name not in shares:
                    share = shares[fractional[0]]
                    c.error(share.source_key or "", "a GPU fraction may not be combined with a "
                            f"whole {k.WHOLE_GPU_RESOURCE} request in the same pod (container "
                            f"{view.name!r} sets one)", None, share.container)
    if len(fractional) > 1:
        c.error(shares[fractional[1]].source_key or "", "KAI allows only one "
                f"container per pod with a fractional GPU request; {fractional[0]!r} already "
                "has one", None, fractional[1])
    for name in list(shares):
        if name not in fractional:
            del shares[name]
