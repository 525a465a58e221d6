"""The two spellings of KAI's binder, and the arithmetic both share.

- `upstream`: KAI Scheduler main, as a user installs it from the KAI chart. Its binder
  (pkg/binder/plugins/nvfractions) writes the memory request, the limit of a
  `gpu-memory.portion.limit` key and the devices; never `.gpu-compute.portion` (its own webhook
  rejects that key as unknown), and it subtracts no memory reserve.
- `patched`: the KAI + gpu-fractioning forks behind NVIDIA's Dynamo fractions benchmark. The
  same keys, plus `.gpu-compute.portion`, computed after a configurable reserve (the MPS
  server's own context; 1024 MiB there).

Both compute in float64 and truncate: `uint64((label - reserve) * portion)` with the node label
and the portion read by strconv.ParseFloat. Python floats are IEEE doubles and `float(str)` is
correctly rounded as ParseFloat is, so the same inputs give the same MiB to the last one
(10000 x 0.57 is 5699, not 5700). Values written are Kubernetes' canonical quantities
(`quantity.canonical_mib`) and plain decimals (`numbers.format_plain`), as KAI writes them.
"""

from __future__ import annotations

from enum import StrEnum
from fractions import Fraction


class Dialect(StrEnum):
    UPSTREAM = "upstream"
    PATCHED = "patched"

    @property
    def writes_compute_portion(self) -> bool:
        return self is Dialect.PATCHED


DEFAULT_DIALECT = Dialect.UPSTREAM
DIALECTS = tuple(d.value for d in Dialect)


def check_reserve(dialect: Dialect, reserve_mib: int) -> str | None:
    """Why `reserve_mib` cannot go with `dialect` (None when it can): upstream KAI subtracts
    nothing, so any other reserve would make every request differ from its binder's."""
    if reserve_mib < 0:
        return f"must not be negative, got {reserve_mib}"
    if dialect is Dialect.UPSTREAM and reserve_mib:
        return (f"is {reserve_mib} MiB, but upstream KAI main subtracts no reserve: use 0, or "
                "the patched dialect for a KAI that does")
    return None


def memory_mib(node_memory_mib: float, reserve_mib: int, portion: Fraction | float) -> int:
    """KAI's `uint64((M - reserve) * portion)`: float64 product, truncated (never negative:
    callers check the portion and the reserve first)."""
    return int((float(node_memory_mib) - float(reserve_mib)) * float(portion))


def compute_portion_of(request_bytes: int, usable_mib: float) -> float:
    """The patched binder's fallback compute portion when the bind carries none: the request
    in whole MiB (bytes floored, as `uint64(q.Value()) / MiB`) over the usable memory, at most
    1. A request under one MiB gives 0, which the binder treats as no portion."""
    return min((request_bytes >> 20) / usable_mib, 1.0)
