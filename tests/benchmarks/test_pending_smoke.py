"""P6 (a large pending queue) at a tiny size: the mirror with its probe runs, lists, lists
again after the stub expires its watch, takes a Job's pods arriving at once, and every figure
is well formed. No timing is
asserted: a benchmark is no pass/fail test."""

from __future__ import annotations

import pytest

from benchmarks import bench_pending

from .test_harness_smoke import assert_well_formed


def test_p6_pending_queue_smoke():
    result = bench_pending.run(smoke=True)
    assert_well_formed(
        result, "P6", "200: loop stall max, first list", "200: loop stall max, re-list",
        "200: RSS growth per cached pod", "200: RSS growth per cached pod, list alone (no calls)",
        "200: RSS growth per cached pod, a bare cache (aiohttp, no project code)",
        "200: p99 first list / idle", "200: allocation p99 first list",
        "200: loop stall max, a Job of 200 pods at once",
        "200: allocation p99, a Job of 200 pods at once")
    targets = {f.name: f.target for f in result.figures if f.target}
    assert targets == {"200: loop stall max, first list": "<= 50",
                       "200: loop stall max, re-list": "<= 50",
                       "200: RSS growth per cached pod": "<= 2",
                       "200: p99 first list / idle": "<= 2",
                       "200: loop stall max, a Job of 200 pods at once": "<= 50"}
    assert result.notes[0].startswith("200: 200 pods cached")
    assert "while the Job arrived" in result.notes[0]


def test_rss_per_added_pod_is_the_growth_from_one_size_to_the_next():
    from benchmarks.harness import Result

    result = Result("P6", "")
    sizes = [{"size": 10_000, "added": 10_000, "rss_growth": 15 * 2**20,
              "cached_alone": 10_000, "rss_growth_alone": 11 * 2**20,
              "cached_bare": 10_000, "rss_growth_bare": 28 * 2**20},
             {"size": 1_000, "added": 1_000, "rss_growth": 3 * 2**20,
              "cached_alone": 1_000, "rss_growth_alone": 2 * 2**20,
              "cached_bare": 1_000, "rss_growth_bare": 1 * 2**20}]
    bench_pending._per_added_pod(result, sizes)
    assert [(f.name, f.value, f.target) for f in result.figures] == [
        ("1k-10k: RSS per added cached pod", round(12 * 1024 / 9_000, 2), "<= 2"),
        ("1k-10k: RSS per added cached pod, list alone", round(9 * 1024 / 9_000, 2), ""),
        ("1k-10k: RSS per added cached pod, a bare cache", round(27 * 1024 / 9_000, 2), "")]


def test_alone_prints_the_list_alones_growth_twice_per_size(capsys):
    assert bench_pending.main(["alone", "0", "5"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["0 pods", "5 pods"]
    assert all(line.endswith(" KB") and line.count(" / ") == 1 for line in lines)


def test_calls_prints_the_growth_over_the_calls_twice(capsys):
    assert bench_pending.main(["calls", "30", "5"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("5 calls after a list of 30 pods grew RSS by ")
    assert line.endswith(" KB per call)") and line.count(" / ") == 2


def test_calls_needs_a_pod_for_each_call(capsys):
    with pytest.raises(SystemExit):
        bench_pending.main(["calls", "20", "5"])
    assert "SIZE must exceed CALLS by 20" in capsys.readouterr().err
