"""Small pieces every benchmark shares: timing loops, percentiles, results, the machine."""

from __future__ import annotations

import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction


@dataclass(frozen=True)
class Figure:
    name: str
    value: float
    unit: str
    target: str = ""
    """A human-readable target such as '>= 20000' (checked by `met`); empty = no target."""

    @property
    def met(self) -> bool | None:
        if not self.target:
            return None
        op, _, bound = self.target.partition(" ")
        limit = float(bound)
        return {"<=": self.value <= limit, ">=": self.value >= limit,
                "<": self.value < limit, ">": self.value > limit}[op]


@dataclass
class Result:
    benchmark: str
    title: str
    figures: list[Figure] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, name: str, value: float, unit: str, target: str = "") -> None:
        self.figures.append(Figure(name, value, unit, target))

    def to_dict(self) -> dict:
        return {
            "benchmark": self.benchmark,
            "title": self.title,
            "figures": [{"name": f.name, "value": f.value, "unit": f.unit, "target": f.target,
                         "met": f.met} for f in self.figures],
            "notes": self.notes,
        }


def print_table(results: list[Result]) -> None:
    """Every figure of `results`, its target and whether it was met, then the notes."""
    width = max([len("figure")] + [len(f.name) for r in results for f in r.figures])
    print(f"{'bench':6} {'figure':{width}} {'value':>12} {'unit':10} {'target':>12}  met")
    for r in results:
        for f in r.figures:
            met = {True: "yes", False: "NO", None: ""}[f.met]
            print(f"{r.benchmark:6} {f.name:{width}} {f.value:>12} {f.unit:10} "
                  f"{f.target:>12}  {met}")
        for note in r.notes:
            print(f"{'':6} note: {note}")


def percentile(samples: list[float], q: float) -> float:
    """The q-th percentile (0..100) by nearest rank: the smallest sample with at least q % of
    the samples at or below it (rank ceil(q/100 x n), exact); samples need not be sorted."""
    if not samples:
        return float("nan")
    ordered = sorted(samples)
    rank = math.ceil(Fraction(str(q)) * len(ordered) / 100)
    return ordered[max(0, min(len(ordered), rank) - 1)]


def latencies(fn: Callable[[], object], count: int) -> list[float]:
    """Seconds per call, one sample per call."""
    out = []
    for _ in range(count):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def rate(fn: Callable[[], object], count: int) -> float:
    """Calls per second over `count` back-to-back calls."""
    start = time.perf_counter()
    for _ in range(count):
        fn()
    return count / (time.perf_counter() - start)


def best_of(runs: int, measure: Callable[[], float], higher_is_better: bool = True) -> float:
    """The best of several runs: these machines are noisy, and noise only ever slows things."""
    values = [measure() for _ in range(runs)]
    return max(values) if higher_is_better else min(values)


def machine() -> dict:
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), "")
    except OSError:
        pass
    return {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "cpu_model": cpu,
        "platform": platform.platform(),
    }


def median(values: list[float]) -> float:
    return statistics.median(values)
