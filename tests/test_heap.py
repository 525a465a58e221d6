"""kai_fractions.heap: the C allocator is asked to return its free pages where it can be."""

from __future__ import annotations

import platform

import pytest

from kai_fractions import heap


@pytest.fixture
def fresh(monkeypatch):
    """The lookup done again, as in a new process."""
    monkeypatch.setattr(heap, "_looked", False)
    monkeypatch.setattr(heap, "_trim", None)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_with_glibc_the_allocator_is_asked(fresh):
    assert heap.release_free_memory() is True
    assert heap.release_free_memory() is True  # looked up once, asked each time


def test_without_malloc_trim_nothing_is_done(fresh, monkeypatch):
    class NoTrim:
        def __init__(self, name):
            assert name is None  # the process's own C library, not a search for one

    monkeypatch.setattr(heap.ctypes, "CDLL", NoTrim)
    assert heap.release_free_memory() is False
    assert heap._looked and heap._trim is None
