"""The pod cache's read-only maps: a dict's reads and equality, a tuple's memory."""

from __future__ import annotations

import sys

import pytest

from kai_fractions.mirror import compact_map
from kai_fractions.mirror.compact_map import CompactMap


def test_it_reads_and_compares_as_the_dict_it_was_made_from():
    items = {"name": "train-0", "namespace": "team-a", "uid": "u-0"}
    m = CompactMap(items)
    assert m == items and items == m and m == CompactMap(dict(items))
    assert m == dict(reversed(items.items())) == m  # equal in another order, as dicts are
    assert (m["name"], m.get("uid"), m.get("absent"), m.get("absent", "-")) == (
        "train-0", "u-0", None, "-")
    assert "namespace" in m and "absent" not in m and len(m) == 3
    assert list(m) == list(items) and dict(m.items()) == items and {**m} == items
    assert m != {**items, "uid": "u-1"} and m != {"name": "train-0"} and m != ["name"]
    with pytest.raises(KeyError):
        m["absent"]
    with pytest.raises(TypeError):
        m["name"] = "other"  # type: ignore[index]
    with pytest.raises(TypeError):
        hash(m)
    assert repr(m) == f"CompactMap({items!r})"


def test_maps_with_the_same_keys_share_one_index_and_cost_less_than_a_dict():
    a = CompactMap({"name": "a", "uid": "1", "resourceVersion": "5", "annotations": {}})
    b = CompactMap({"name": "b", "uid": "2", "resourceVersion": "6", "annotations": {}})
    assert a._index is b._index and a != b
    assert CompactMap({"uid": "1", "name": "a"})._index is not a._index  # another order
    items = {f"key-{i}": "v" for i in range(14)}  # a written pod's annotations
    compact = CompactMap(items)
    assert sys.getsizeof(compact) + sys.getsizeof(compact._values) < sys.getsizeof(items) / 2


def test_the_index_table_is_bounded(monkeypatch):
    monkeypatch.setattr(compact_map, "INDEXES_KEPT", 3)
    monkeypatch.setattr(compact_map, "_indexes", {})
    maps = [CompactMap({f"k{i}": i}) for i in range(10)]
    assert len(compact_map._indexes) <= 3
    assert [m[f"k{i}"] for i, m in enumerate(maps)] == list(range(10))  # each keeps its own
