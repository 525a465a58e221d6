"""Annotation values compared by meaning: `20Gi` and `20480Mi` are the same request.

KAI writes canonical quantities and copies a user's `8Gi` verbatim, so two writers of the same
allocation can differ in spelling but never in value. Whoever checks one against the other
(the follower, tests) compares here, never as strings.
"""

from __future__ import annotations

from . import keys as k
from .numbers import NumberError, parse_decimal
from .quantity import QuantityError, memory_bytes

_MEMORY = frozenset((k.MEMORY_REQUEST, k.MEMORY_LIMIT))


def same_value(key: str, a: str | None, b: str | None, keys: k.Keys = k.DEFAULT_KEYS) -> bool:
    """True when annotation `key` means the same with value `a` as with `b` (None: absent).
    A value that does not parse equals only its exact self."""
    if a is None or b is None or a == b:
        return a == b
    parts = keys.split(key)
    suffix = parts[1] if parts else ""
    try:
        if suffix in _MEMORY:
            return memory_bytes(a) == memory_bytes(b)
        if suffix == k.COMPUTE_PORTION:
            return parse_decimal(a) == parse_decimal(b)
    except (QuantityError, NumberError):
        return False
    if suffix == k.DEVICES:
        return _items(a) == _items(b)
    return False


def _items(devices: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in devices.split(","))
