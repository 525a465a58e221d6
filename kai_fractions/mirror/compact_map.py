"""A read-only map for the pod cache's entries that costs a tuple of values, not a dict.

Each cached pod holds a metadata map and an annotation map of its own (the pods of one job differ
in name, uid and version, and in the MPS namespace the admission webhook names per pod). A dict
of a handful of keys costs 250-650 bytes; the pods of a job have the same keys, so here every map
with the same keys in the same order shares one key index, and a map costs about 50 bytes and
its tuple of values. Lookups are a method call and two index reads: the cache's own reads take
that, and the contract's parse gets a plain dict copy (`contract.pod._str_map`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

INDEXES_KEPT = 4096
"""Distinct key sequences indexed at most (then forgotten, which only ends the sharing of the
older ones' index)."""
_indexes: dict[tuple[Any, ...], dict[Any, int]] = {}
_MISSING = object()


class CompactMap(Mapping[Any, Any]):
    """An immutable map; equal to any Mapping with the same items."""

    __slots__ = ("_index", "_values")

    def __init__(self, items: Mapping[Any, Any]) -> None:
        keys = tuple(items)
        index = _indexes.get(keys)
        if index is None:
            if len(_indexes) >= INDEXES_KEPT:
                _indexes.clear()
            index = _indexes[keys] = {key: i for i, key in enumerate(keys)}
        self._index = index
        self._values = tuple(items.values())

    def __getitem__(self, key: Any) -> Any:
        return self._values[self._index[key]]

    def get(self, key: Any, default: Any = None) -> Any:
        i = self._index.get(key)
        return default if i is None else self._values[i]

    def __contains__(self, key: object) -> bool:
        return key in self._index

    def __iter__(self) -> Iterator[Any]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._values)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mapping):
            return NotImplemented
        if isinstance(other, CompactMap) and other._index is self._index:
            return other._values == self._values
        if type(other) is dict and tuple(other) == tuple(self._index):
            return tuple(other.values()) == self._values  # the cache's case, at C speed
        return len(other) == len(self._values) and all(
            other.get(key, _MISSING) == value
            for key, value in zip(self._index, self._values, strict=True))

    __hash__ = None  # type: ignore[assignment]  (a map, as a dict: equal by its items)

    def __repr__(self) -> str:
        return f"CompactMap({dict(zip(self._index, self._values, strict=True))!r})"
