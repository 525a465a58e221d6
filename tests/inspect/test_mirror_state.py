"""`inspect mirror`'s model and renderer, pure: a replica's /metrics (as `MirrorMetrics` serves
it) read into a Replica, the histogram quantile read as PromQL's histogram_quantile reads it,
what counts as a problem across replicas, and the table / JSON / YAML."""

from __future__ import annotations

import json
import math

import pytest
import yaml

from kai_fractions.inspect.mirror_render import duration, render, short_time
from kai_fractions.inspect.mirror_sources import replica_from_url
from kai_fractions.inspect.mirror_state import (
    MIN_JUDGED,
    Replica,
    bucket_quantile,
    problems,
    replica_from_metrics,
    unreadable,
    windowed,
)
from kai_fractions.inspect.sources import agent_from_metrics

from .mirrors import mirror_metrics, scrape

INF = math.inf


def replica(name: str = "mirror-0", **state) -> Replica:
    return replica_from_metrics(name, f"http://{name}:9401/metrics",
                                scrape(mirror_metrics(**state)), now=4e9)


def test_a_replica_is_read_from_what_the_mirror_serves():
    r = replica()
    assert r.reachable and r.leading is True
    assert (r.cache_pods, r.cache_synced, r.cache_hits, r.cache_misses, r.cache_lists) == (
        3, True, 1, 0, 1)
    assert dict(r.calls) == {"INVALID_ARGUMENT": 1, "OK": 4}
    assert (r.calls_total, r.calls_failed) == (5, 1)
    assert r.call_seconds_mean == pytest.approx(0.01)
    assert dict(r.api_requests) == {"200": 5}  # 4 PATCH and a WATCH
    assert dict(r.checks) == {"complete": 2, "skipped": 1}
    assert r.checks_in_progress == 0
    # Signed 3 s and 100 s after creation: buckets (2, 5] and (60, 120].
    assert r.signatures == 2
    assert r.signature_p50_s == pytest.approx(5.0)
    assert r.signature_p99_s == pytest.approx(60 + 60 * 0.98)
    assert r.rss_bytes and r.rss_bytes > 0 and r.cpu_seconds is not None
    assert r.uptime_s and r.uptime_s > 0


def test_what_a_replica_does_not_run_is_told_apart_from_zero():
    r = replica(leading=None, cached=None, signed_after=(), skipped=0)
    assert (r.leading, r.cache_pods, r.cache_synced) == (None, None, None)
    assert (r.signatures, r.signature_p50_s, r.signature_p99_s) == (0, None, None)
    assert replica(leading=False).leading is False


def test_text_that_is_not_a_mirrors_is_refused():
    with pytest.raises(ValueError, match="not a mirror's metrics"):
        replica_from_metrics("x", "u", "# TYPE up gauge\nup 1\n", now=0)
    with pytest.raises(ValueError):
        replica_from_metrics("x", "u", "kai_fractions_mirror_calls_total{ 1\n", now=0)


@pytest.mark.parametrize(("q", "buckets", "expected"), [
    (0.5, [(1.0, 0), (2.0, 10), (INF, 10)], 1.5),  # within a bucket: linear
    (0.5, [(1.0, 4), (INF, 4)], 0.5),  # the first bucket starts at 0
    (0.99, [(1.0, 0), (INF, 4)], 1.0),  # in +Inf: the largest finite bound
    (0.6, [(1.0, 2), (2.0, 2), (4.0, 4), (INF, 4)], 2.4),  # past an empty bucket
    (0.5, [(1.0, 0), (INF, 0)], None),  # nothing observed
    (0.5, [], None),
])
def test_bucket_quantile_reads_buckets_as_histogram_quantile(q, buckets, expected):
    assert bucket_quantile(q, buckets) == expected


def test_problems_are_told_once_each():
    a, b = replica("mirror-a"), replica("mirror-b", leading=False)
    assert problems([a, b]) == []
    assert problems([])[0].startswith("no mirror replica found: no pod matched the selector")
    off = [replica("mirror-a", leading=None), replica("mirror-b", leading=None)]
    assert problems(off) == []  # the follower is off everywhere: nothing to lead

    [none] = problems([replica("mirror-a", leading=False), b])
    assert none.startswith("no replica follows BindRequests: ")
    [two] = problems([a, replica("mirror-b")])
    assert two.startswith("2 replicas follow BindRequests at once (mirror-a, mirror-b)")

    gone = unreadable("mirror-b", "pod ns/mirror-b", "the pod is Pending, not Running")
    assert problems([replica("mirror-a", leading=False), gone]) == [
        "mirror-b: not read: the pod is Pending, not Running",
        problems([replica("mirror-a", leading=False), gone])[1]]
    assert "(among the replicas read)" in problems([replica("mirror-a", leading=False),
                                                   gone])[1]
    assert problems([a, replica("mirror-b", leading=False, synced=False)]) == [
        "mirror-b: pod cache not synced: every call reads its pod from the API server"]


def test_failing_api_requests_and_calls_are_problems():
    """Every call failed UNAVAILABLE and every API request ended unreachable: inspect said
    nothing was wrong."""
    metrics = mirror_metrics(ok=0, invalid=0, signed_after=(), skipped=0, leading=None)
    for _ in range(10):
        metrics.call("MirrorAllocation", "UNAVAILABLE", 1.0)
        for _ in range(5):
            metrics.api_request("GET", "unreachable")
    down = replica_from_metrics("mirror-a", "u", scrape(metrics), now=4e9)
    api, calls = problems([down])
    assert api.startswith("mirror-a: 50 of its 51 requests to the API server failed since it "
                          "started (unreachable 50): its calls answer UNAVAILABLE")
    assert "check its log (kubectl logs) and its way to the API server" in api
    assert calls.startswith("mirror-a: 10 of its 10 calls failed since it started (UNAVAILABLE "
                            "10): the scheduler's binds that call it fail or retry.")


def test_a_few_failures_or_callers_mistakes_are_not_problems():
    """Over the chart's 5 % only, and only the mirror's own failures (as its alerts)."""
    metrics = mirror_metrics(ok=40, invalid=30)  # INVALID_ARGUMENT: the caller's mistake
    metrics.call("MirrorAllocation", "INTERNAL", 0.01)  # 1 of 71
    metrics.api_request("PATCH", "503")  # 1 of 42
    assert problems([replica_from_metrics("mirror-a", "u", scrape(metrics), now=4e9)]) == []
    metrics.api_request("PATCH", "500")  # 2 of 43
    assert problems([replica_from_metrics("mirror-a", "u", scrape(metrics), now=4e9)]) == []
    for _ in range(2):
        metrics.api_request("GET", "unreachable")  # 4 of 45
    [api] = problems([replica_from_metrics("mirror-a", "u", scrape(metrics), now=4e9)])
    assert "4 of its 45 requests to the API server failed since it started (500 1, 503 1, " \
        "unreachable 2)" in api


def _read(name: str, metrics, now: float = 4e9) -> Replica:
    return replica_from_metrics(name, "u", scrape(metrics), now=now)


def test_failures_are_judged_in_the_window_between_two_reads():
    """The totals since a replica started judged it: an early failure was a problem for ever,
    and an outage now was diluted by its healthy history."""
    metrics = mirror_metrics(ok=0, invalid=0, signed_after=(), skipped=0, leading=None)
    metrics.call("MirrorAllocation", "DEADLINE_EXCEEDED", 0.01)
    for _ in range(MIN_JUDGED):
        metrics.api_request("GET", "unreachable")
    before = _read("a", metrics)
    assert len(problems([before])) == 1  # totals: the API requests, 10 of 11
    for _ in range(MIN_JUDGED):
        metrics.call("MirrorAllocation", "OK", 0.01)
    [calm] = windowed([before], [_read("a", metrics)], 5)
    assert (calm.window_s, dict(calm.recent_calls), dict(calm.recent_api_requests)) == (
        5, {"OK": MIN_JUDGED}, {})
    assert problems([calm]) == []

    for _ in range(MIN_JUDGED - 1):
        metrics.call("MirrorAllocation", "UNAVAILABLE", 0.01)
    assert problems(windowed([calm], [_read("a", metrics)], 2.5)) == []  # too few to judge
    metrics.call("MirrorAllocation", "UNAVAILABLE", 0.01)
    [failing] = problems(windowed([calm], [_read("a", metrics)], 2.5))
    assert failing.startswith(f"a: {MIN_JUDGED} of its {MIN_JUDGED} calls failed in the last "
                              f"2.5 s (UNAVAILABLE {MIN_JUDGED}): ")


def test_a_replica_restarted_or_read_once_in_the_window():
    old = mirror_metrics(ok=500, invalid=0, signed_after=(), skipped=0)
    new = mirror_metrics(ok=0, invalid=0, signed_after=(), skipped=0)
    for _ in range(MIN_JUDGED):
        new.call("MirrorAllocation", "INTERNAL", 0.01)
    [restarted] = windowed([_read("a", old)], [_read("a", new)], 5)
    assert dict(restarted.recent_calls) == {"INTERNAL": MIN_JUDGED}  # all since its start
    assert "failed in the last 5 s (INTERNAL 10)" in problems([restarted])[0]
    gone = unreadable("a", "u", "refused")
    [first_missed] = windowed([gone], [_read("a", new)], 5)
    assert first_missed.window_s is None  # its totals are judged
    assert windowed([_read("a", new)], [gone], 5) == [gone]
    assert windowed([_read("a", new)], [], 5) == []


def test_the_table_has_a_row_a_replica_its_counts_and_the_problems():
    gone = unreadable("mirror-c", "pod ns/mirror-c", "the pod is Pending, not Running")
    out = render([replica("mirror-a"), replica("mirror-b", leading=False, synced=False),
                  gone], "table", " in namespace kai-fractions")
    lines = out.splitlines()
    assert lines[0] == ("mirror: 2 of 3 replicas read in namespace kai-fractions, "
                        "follower led by mirror-a")
    assert lines[1].split()[:4] == ["REPLICA", "FOLLOWER", "UP", "POD"]
    a = lines[2].split()
    assert a[:2] == ["mirror-a", "leading"]
    assert "3 pods" in lines[2] and "1 (20.0%)" in lines[2] and "10.0 ms" in lines[2]
    assert "5.0 s / 118.8 s" in lines[2]
    assert "3 pods syncing" in lines[3] and lines[3].split()[1] == "standby"
    assert lines[4].split()[:3] == ["mirror-c", "not", "read"]
    assert ("  mirror-a: calls INVALID_ARGUMENT 1, OK 4; API 200 5; checks complete 2, "
            "skipped 1; cache hits 1, misses 0, lists 1") in lines
    assert "! mirror-c: not read: the pod is Pending, not Running" in lines
    assert "! mirror-b: pod cache not synced: every call reads its pod from the API server" \
        in lines


def test_json_and_yaml_say_the_same_for_scripts():
    replicas = [replica("mirror-a"), unreadable("mirror-b", "u", "refused")]
    data = json.loads(render(replicas, "json"))
    assert data == yaml.safe_load(render(replicas, "yaml"))
    assert data["leader"] == "mirror-a"
    assert data["problems"] == ["mirror-b: not read: refused"]
    a, b = data["replicas"]
    assert (a["reachable"], a["calls"], a["leading"]) == (True, {"INVALID_ARGUMENT": 1,
                                                                 "OK": 4}, True)
    assert (b["reachable"], b["error"], b["leading"]) == (False, "refused", None)
    with pytest.raises(ValueError, match="--output"):
        render(replicas, "xml")


def test_durations_read_at_a_glance():
    assert [duration(s) for s in (None, 42, 61, 3 * 3600 + 12 * 60 + 5, 2 * 86400 + 3600)] == [
        "-", "42s", "1m1s", "3h12m", "2d1h"]
    assert [short_time(s) for s in (None, 0.0123, 4.8)] == ["-", "12.3 ms", "4.8 s"]


@pytest.mark.parametrize(("url", "said"), [
    ("http://127.0.0.1:abc", "InvalidURL: nonnumeric port: 'abc'"),
    ("http://[::1", "http://[::1: not a URL: Invalid IPv6 URL"),
])
def test_a_url_that_cannot_be_read_is_a_replica_not_read_not_a_crash(url, said):
    replica = replica_from_url(url)
    assert said in json.dumps(replica.to_dict()), replica
    agent = agent_from_metrics(url)
    assert not agent.reachable and said in agent.error
