"""Load with faults, reduced for CI: 500 MirrorAllocation calls while the Kubernetes API fails
5% of its requests (409, 429, 500, 503, timeouts, resets, writes whose answer is lost) and
clients retry. Exactly one write per pod: 500 effective allocations, 0 duplicates, 0 lost.
The full 10,000-call run: `python -m benchmarks.load_mirror` (benchmark L1)."""

from __future__ import annotations

import pytest

from .harness import run_load

pytestmark = [pytest.mark.faults, pytest.mark.integration]

CALLS = 500


def test_500_calls_with_5_percent_api_faults_are_each_written_exactly_once():
    report = run_load(CALLS, fault_rate=0.05, seed=10)
    print("\n".join(report.lines()))
    assert report.errors == []
    assert (report.effective, report.duplicates, report.lost) == (CALLS, 0, 0)
    assert report.writes == CALLS
    assert report.bad_signatures == 0
    # the faults really happened, and some were retried by the clients themselves
    assert report.fault_count >= 20
    assert report.patch_requests > CALLS
    assert report.client_attempts == CALLS + report.client_retries
