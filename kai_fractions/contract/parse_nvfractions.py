"""The NvFractions keys (`<prefix><container><suffix>`): one pass that groups them by container
and reports keys that name no container of the pod (a stray compute mode in a pod that asks
for no fraction is only a warning, as KAI admits it), and the share each container's keys
describe.
"""

from __future__ import annotations

from collections.abc import Iterable

from . import keys as k
from .annotation_values import _devices, _memory, _portion
from .collector import NO_FRACTION_ASKED, _Collector
from .pod import PodView
from .shares import DEFAULT_MODE, ComputeMode, ContainerShare

_MODES = ", ".join(m.value for m in ComputeMode)
MAX_LISTED_CONTAINERS = 20
"""Container names a message lists (sorted) before it says how many more there are: a pod may
bring thousands, and the message is repeated for each key that names a missing one."""


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
# The keys that make a container fractional, in the order errors prefer to name them.
_SOURCE_SUFFIXES = (k.MEMORY_REQUEST, k.MEMORY_LIMIT, k.DEVICES, k.COMPUTE_PORTION)


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
