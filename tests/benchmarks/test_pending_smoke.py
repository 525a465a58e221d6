"""P6 (a large pending queue) at a tiny size: the mirror with its probe runs, lists, lists
again after the stub expires its watch, and every figure is well formed. No timing is
asserted: a benchmark is no pass/fail test."""

from __future__ import annotations

from benchmarks import bench_pending

from .test_harness_smoke import assert_well_formed


def test_p6_pending_queue_smoke():
    result = bench_pending.run(smoke=True)
    assert_well_formed(
        result, "P6", "200: loop stall max, first list", "200: loop stall max, re-list",
        "200: RSS growth per cached pod", "200: p99 first list / idle",
        "200: allocation p99 first list")
    targets = {f.name: f.target for f in result.figures if f.target}
    assert targets == {"200: loop stall max, first list": "<= 50",
                       "200: loop stall max, re-list": "<= 50",
                       "200: RSS growth per cached pod": "<= 2",
                       "200: p99 first list / idle": "<= 2"}
    assert result.notes[0].startswith("200: 200 pods cached")
