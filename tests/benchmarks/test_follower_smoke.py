"""P7 (the BindRequest follower during a wave of binds) with a small wave: every pod is signed
once at each latency and concurrency, in memory and through the stub API server, and every
figure is well formed. No timing is asserted:
a benchmark is no pass/fail test."""

from __future__ import annotations

import asyncio
import re

import pytest

from benchmarks import bench_follower

from .test_harness_smoke import assert_well_formed


def test_p7_follower_wave_smoke():
    result = bench_follower.run(smoke=True)
    assert_well_formed(
        result, "P7", "API 1 ms away, concurrency 1: all 20 signed in",
        "API 5 ms away, concurrency 8: BindRequests per second",
        "API 5 ms away: concurrency 8 / 1, time to sign the wave",
        "HTTP, the stub 5 ms away, concurrency 8: all 20 signed in",
        "HTTP, the stub 5 ms away, concurrency 1: follower CPU per BindRequest")
    assert result.notes[0] == "API 1 ms away: 4.0 requests per BindRequest"


def test_a_wave_not_all_signed_is_an_error(monkeypatch):
    real = bench_follower.wave

    def one_pod_mismatching(pods):
        store, bind_requests = real(pods)
        store.pods[(bench_follower.NAMESPACE, "train-0")]["metadata"]["annotations"].pop(
            "received-resource-type")  # what the binder writes, missing: never signed
        return store, bind_requests

    monkeypatch.setattr(bench_follower, "wave", one_pod_mismatching)
    refused = re.escape("P7: 1 pod(s) unsigned, 3 patch(es) for 4 pods")
    with pytest.raises(RuntimeError, match=refused):
        asyncio.run(bench_follower.one_wave(4, 0.0, 2))
