"""A live agent's /metrics speaks upstream's dialect: the REAL agent process (fake NVML library,
kmock), scraped over HTTP, exports gpu-fractioning's metrics with upstream metricsd's names,
type, help and label set, and nothing else under their prefix.

Upstream facts (spelled out here, not imported): NVIDIA gpu-fractioning,
`fractioning-manager/metricsd/internal/metrics/exporter.go` @23ad945b: three GaugeVecs with the
labels `namespace, pod, pod_uuid, gpu_uuid, gpu` (`gpu` = the GPU index as a decimal string).
"""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.agent_metrics import GIB, populated_scrape
from tests.support.agent_process import GPU0, AgentEnv

pytestmark = pytest.mark.integration

UPSTREAM = {
    "gpu_fractioning_gpu_memory_used_bytes":
        "GPU memory used by processes attributed to a Kubernetes pod.",
    "gpu_fractioning_gpu_sm_utilization_percent":
        "GPU SM utilization attributed to a Kubernetes pod: the sum of per-process NVML "
        "SM-active time fractions, clamped to [0,100]. Approximate under MPS where a pod's "
        "processes execute concurrently.",
    "gpu_fractioning_gpu_sm_utilization_percent_normalized":
        "GPU SM utilization normalized by the pod's requested GPU fraction (SM utilization ÷ "
        "requested fraction), clamped to [0,100]. A pod using as much of the GPU as it "
        "requested reports 100. Falls back to the raw SM utilization when the requested "
        "fraction is unknown.",
}
UPSTREAM_LABELS = {"namespace", "pod", "pod_uuid", "gpu_uuid", "gpu"}


def test_a_live_agent_exports_gpu_fractionings_metrics_as_upstream_names_them(
        agent_env: AgentEnv) -> None:
    text, uids, run = populated_scrape(agent_env)
    families = {f.name: f for f in text_string_to_metric_families(text)}

    assert {n for n in families if n.startswith("gpu_fractioning_")} == set(UPSTREAM)
    pod = {"namespace": "default", "pod": "applied", "pod_uuid": uids["applied"],
           "gpu_uuid": GPU0, "gpu": "0"}
    for name, help_text in UPSTREAM.items():
        family = families[name]
        assert (family.type, family.documentation) == ("gauge", help_text), name
        assert {frozenset(s.labels) for s in family.samples} == {frozenset(UPSTREAM_LABELS)}
        # one series per pod and GPU: the refused pod has none
        assert [s.labels for s in family.samples] == [pod], name
    values = {name: families[name].samples[0].value for name in UPSTREAM}
    assert values == {
        "gpu_fractioning_gpu_memory_used_bytes": 25 * GIB,
        "gpu_fractioning_gpu_sm_utilization_percent": 10,
        # 10% of the GPU on a 20 GiB limit of an 81559 MiB GPU
        "gpu_fractioning_gpu_sm_utilization_percent_normalized": round(10 * 81559 / 20480, 3),
    }

    # our own detail: the same labels plus node and container, and the node-level series
    ours = {**pod, "node": agent_env.node, "container": "main"}
    for name, want in (("kai_fractions_container_gpu_memory_requested_bytes", 10 * GIB),
                       ("kai_fractions_container_gpu_memory_limit_bytes", 20 * GIB),
                       ("kai_fractions_container_gpu_memory_used_bytes", 25 * GIB),
                       ("kai_fractions_container_gpu_sm_utilization_percent", 10),
                       ("kai_fractions_container_gpu_sm_share_percent", 50),
                       ("kai_fractions_container_gpu_memory_limit_violations", 1)):
        samples = [(s.labels, s.value) for s in families[name].samples
                   if not s.name.endswith("_created")]
        assert samples == [(ours, want)], name
    refused = [s.labels for s in families["kai_fractions_container_refused"].samples]
    assert refused == [{"node": agent_env.node, "namespace": "default", "pod": "refused",
                        "pod_uuid": uids["refused"], "container": "main",
                        "reason": "ComputeModeMix"}]
    (ready,) = families["kai_fractions_node_ready"].samples
    assert (ready.labels, ready.value) == ({"node": agent_env.node, "reason": "AgentReady"}, 1)
    # its requests to the API server: the pod list + watch, the node's status, marker writes
    api = {(s.labels["verb"], s.labels["code"]): s.value
           for s in families["kai_fractions_agent_api_requests"].samples
           if s.name.endswith("_total") and s.labels["node"] == agent_env.node}
    assert api[("WATCH", "200")] >= 1 and api[("GET", "200")] >= 1
    assert api[("PATCH", "200")] >= 1
    assert run.stop() == 0
