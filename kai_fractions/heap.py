"""Handing the memory a burst freed back to the operating system.

A large list is decoded page by page and mostly dropped (a cache keeps a trimmed part of each
object), but glibc's allocator keeps the freed chunks in its heap for later reuse, so after the
list the process's RSS stays near the burst's high-water mark: about a megabyte after the
mirror's list of a thousand Pending pods, as much again as the pods it keeps (benchmarks P6).
`malloc_trim(0)` returns every whole free page of the heap to the kernel; it takes well under a
millisecond. Where the C library has no such call (musl, macOS), nothing is done.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

_trim: Callable[[int], int] | None = None
_looked = False


def _malloc_trim() -> Callable[[int], int] | None:
    global _trim, _looked
    if not _looked:
        _looked = True
        try:
            _trim = ctypes.CDLL(None).malloc_trim  # the process's own C library
        except (AttributeError, OSError):
            _trim = None
    return _trim


def release_free_memory() -> bool:
    """Asks the C allocator to return its free pages; False where it cannot be asked."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
