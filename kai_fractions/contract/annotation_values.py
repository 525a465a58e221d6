"""Readers of one annotation value each: a GPU memory quantity, a portion of one GPU (range
checked on the float64 KAI reads), a list of GPU UUIDs. Each reports what is wrong to the
parse's collector and returns None (or nothing) for a value it refuses; both key dialects use
them.
"""

from __future__ import annotations

import re
from fractions import Fraction
from functools import lru_cache

from . import keys as k
from .collector import _Collector
from .numbers import NumberError, after_point, parse_decimal, parse_float64
from .quantity import MIB, QuantityError, memory_bytes

# Physical GPU UUIDs as NVML prints them: GPU- then hex groups. MIG UUIDs are refused on purpose:
# NVML memory limits do not support MIG handles.
_GPU_UUID = re.compile(r"GPU-[0-9a-fA-F]+(?:-[0-9a-fA-F]+)*")
MAX_DEVICES = 64
"""More GPUs than any node has: a longer list is refused before it is split and checked."""


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
    if len({i.removeprefix(k.CDI_DEVICE_PREFIX).lower() for i in items}) != len(items):
        return (), "lists the same GPU twice", value
    return tuple(items), None, ""
