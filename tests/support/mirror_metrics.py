"""A live mirror's /metrics with its families populated, for the dashboard test: the REAL
`kai-fractions mirror` process over kmock (`run_mirror_process`), its pod cache on, following
BindRequests, after its one MirrorAllocation call and one BindRequest the follower checked (a
fresh Pending one: `waiting`, so `kai_fractions_follower_checks_total` has its `result`
label)."""

from __future__ import annotations

from pathlib import Path

from tests.support.agent_process import free_port
from tests.support.kube import KubeServer
from tests.support.mirror_kube import create_pending_bind_request, run_mirror_process
from tests.support.promql import sample_value

NS = "team-a"


def _populated(text: str) -> bool:
    return bool(sample_value(text, "kai_fractions_mirror_calls_total", code="OK") == 1
                and sample_value(text, "kai_fractions_mirror_api_requests_total", verb="PATCH")
                and sample_value(text, "kai_fractions_follower_checks_total", result="waiting")
                and sample_value(text, "kai_fractions_follower_leading") == 1)


def populated_mirror_scrape(kube: KubeServer, tmp_path: Path) -> str:
    """The mirror's /metrics text once every family the dashboard reads has its samples; the
    process has stopped (SIGTERM, exit 0) when this returns."""
    create_pending_bind_request(
        kube, NS, "br-pending", "train-1", "gpu-node-1", backoffLimit=3,
        selectedFractionalGpuGroups=[{"id": "group-a", "computeSharingMode": ""}])
    address = f"127.0.0.1:{free_port()}"
    run = run_mirror_process(kube, tmp_path, "--follow-bindrequests", "--metrics-listen",
                             address, metrics_url=f"http://{address}/metrics",
                             metrics_ready=_populated)
    assert run.returncode == 0 and "Traceback" not in run.err, run.err
    return run.metrics
