"""The mirror's Prometheus metrics in the chart: every replica serves them on
`mirror.metricsPort` (`--metrics-listen`, container port `metrics`); the NetworkPolicy admits that
port from `mirror.networkPolicy.metricsFrom`, from anywhere when it is empty (the metrics hold no
secrets); with `serviceMonitor.enabled` a headless Service and a ServiceMonitor make Prometheus
scrape each replica (their series differ: one replica leads the BindRequest follower)."""

from __future__ import annotations

from typing import Any

import pytest

from kai_fractions.cli import build_parser

from .render import CHART, NAMESPACE, container, find, kube_validate, one, render, template_error

MIRROR = "kai-fractions-mirror"
AGENT = "kai-fractions-node-agent"
METRICS_SVC = f"{MIRROR}-metrics"
WATCHDOG_KILL = CHART / "ci" / "watchdog-kill-values.yaml"  # sets serviceMonitor.enabled
MONITORED = ("serviceMonitor.enabled=true",)
# Prometheus's namespace by label, its pods by label, and a CIDR: the three kinds of peer.
PEERS = ("mirror.networkPolicy.metricsFrom[0].namespaceSelector.matchLabels.team=monitoring",
         "mirror.networkPolicy.metricsFrom[0].podSelector.matchLabels.app=prometheus",
         "mirror.networkPolicy.metricsFrom[1].ipBlock.cidr=10.20.0.0/16")
# No mirror (the GpuFractioningConfig reporter needs it, so that goes too).
NO_MIRROR = ("mirror.enabled=false", "gpuFractioningConfig.enabled=false",
             "signing.enabled=false")


def mirror_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return container(one(docs, "Deployment", MIRROR), "mirror")


def metrics_flags(docs: list[dict[str, Any]]) -> list[str]:
    return [a for a in mirror_container(docs)["args"] if a.startswith("--metrics-listen")]


def metrics_ingress(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [rule for rule in one(docs, "NetworkPolicy", MIRROR)["spec"]["ingress"]
            if rule["ports"] == [{"port": "metrics", "protocol": "TCP"}]]


# -- the flag and the port ------------------------------------------------------------------

def test_every_replica_serves_metrics_on_the_default_port():
    docs = render()
    c = mirror_container(docs)
    assert metrics_flags(docs) == ["--metrics-listen=0.0.0.0:9401"]
    assert {"name": "metrics", "containerPort": 9401, "protocol": "TCP"} in c["ports"]
    # the flag the chart passes is the one the mirror's CLI reads
    assert build_parser().parse_args(c["args"]).metrics_listen == "0.0.0.0:9401"
    # the node agent keeps its own port: both can run on one node
    agent = container(one(docs, "DaemonSet", AGENT), "node-agent")
    assert "--metrics-listen=0.0.0.0:9400" in agent["args"]


def test_a_custom_metrics_port_moves_the_flag_the_container_port_and_the_service():
    docs = render(sets=("mirror.metricsPort=9555", *MONITORED))
    c = mirror_container(docs)
    assert metrics_flags(docs) == ["--metrics-listen=0.0.0.0:9555"]
    assert [p for p in c["ports"] if p["name"] == "metrics"] == [
        {"name": "metrics", "containerPort": 9555, "protocol": "TCP"}]
    assert [p for p in c["ports"] if p["name"] == "grpc"] == [
        {"name": "grpc", "containerPort": 50051, "protocol": "TCP"}]
    assert one(docs, "Service", METRICS_SVC)["spec"]["ports"] == [
        {"name": "metrics", "port": 9555, "targetPort": "metrics", "protocol": "TCP"}]


@pytest.mark.parametrize(("value", "message"), [
    ("0", "minimum: got 0, want 1"),
    ("65536", "maximum: got 65,536, want 65,535"),
])
def test_schema_refuses_a_metrics_port_out_of_range(value: str, message: str):
    err = template_error(f"mirror.metricsPort={value}")
    assert "values don't meet the specifications of the schema" in err
    assert "/mirror/metricsPort" in err and message in err


def test_schema_refuses_a_metrics_port_that_is_not_a_number():
    err = template_error(set_string=["mirror.metricsPort=abc"])
    assert "/mirror/metricsPort" in err and "got string, want integer" in err


def test_metrics_and_grpc_cannot_share_a_port():
    err = template_error("mirror.metricsPort=50051")
    assert "mirror.metricsPort=50051 is also mirror.port" in err
    err = template_error("mirror.port=9401")
    assert "mirror.metricsPort=9401 is also mirror.port" in err


# -- NetworkPolicy --------------------------------------------------------------------------

def test_the_metrics_port_is_open_to_anyone_by_default():
    docs = render()
    # no `from` at all: every source (Prometheus runs in a different namespace per cluster)
    assert metrics_ingress(docs) == [{"ports": [{"port": "metrics", "protocol": "TCP"}]}]
    grpc = [r for r in one(docs, "NetworkPolicy", MIRROR)["spec"]["ingress"]
            if r["ports"] == [{"port": "grpc", "protocol": "TCP"}]]
    assert grpc == [{"ports": [{"port": "grpc", "protocol": "TCP"}],
                     "from": [{"namespaceSelector": {"matchLabels": {
                         "kubernetes.io/metadata.name": "kai-scheduler"}}}]}]


def test_metrics_from_limits_the_metrics_port_to_the_given_peers():
    docs = render(sets=PEERS)
    assert metrics_ingress(docs) == [{
        "ports": [{"port": "metrics", "protocol": "TCP"}],
        "from": [{"namespaceSelector": {"matchLabels": {"team": "monitoring"}},
                  "podSelector": {"matchLabels": {"app": "prometheus"}}},
                 {"ipBlock": {"cidr": "10.20.0.0/16"}}]}]
    # ...and leaves the gRPC rule as it was
    assert (one(docs, "NetworkPolicy", MIRROR)["spec"]["ingress"][0]
            == one(render(), "NetworkPolicy", MIRROR)["spec"]["ingress"][0])
    assert kube_validate(docs, "metricsFrom") == []


def test_schema_refuses_metrics_from_that_is_not_a_list():
    err = template_error("mirror.networkPolicy.metricsFrom=monitoring")
    assert "/mirror/networkPolicy/metricsFrom" in err and "got string, want array" in err


# -- headless Service + ServiceMonitor ------------------------------------------------------

def test_service_monitor_scrapes_every_mirror_replica():
    docs = render(sets=(*MONITORED, "serviceMonitor.interval=15s",
                        "serviceMonitor.labels.release=kube-prometheus"))
    pods = one(docs, "Deployment", MIRROR)["spec"]["selector"]["matchLabels"]
    svc = one(docs, "Service", METRICS_SVC)
    assert svc["metadata"]["namespace"] == NAMESPACE
    assert svc["spec"]["clusterIP"] == "None"  # headless: one target per pod
    assert svc["spec"]["selector"] == pods
    assert svc["spec"]["ports"] == [
        {"name": "metrics", "port": 9401, "targetPort": "metrics", "protocol": "TCP"}]
    monitor = one(docs, "ServiceMonitor", MIRROR)
    assert monitor["metadata"]["namespace"] == NAMESPACE
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus"
    assert monitor["metadata"]["labels"]["app.kubernetes.io/component"] == "mirror"
    assert monitor["spec"]["selector"]["matchLabels"] == pods
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    # no honorLabels: the mirror's series carry no workload labels to keep
    assert monitor["spec"]["endpoints"] == [
        {"port": "metrics", "path": "/metrics", "interval": "15s"}]
    # Of the Services its selector matches (the gRPC one too), only the headless one has a
    # `metrics` port, so each pod is scraped once.
    selected = [s for s in find(docs, "Service")
                if pods.items() <= s["metadata"]["labels"].items()]
    assert {s["metadata"]["name"] for s in selected} == {MIRROR, METRICS_SVC}
    assert [s["metadata"]["name"] for s in selected
            if any(p["name"] == "metrics" for p in s["spec"]["ports"])] == [METRICS_SVC]
    # the node agent's keeps honorLabels (its series carry the workloads' labels)
    agent = one(docs, "ServiceMonitor", AGENT)
    assert agent["spec"]["endpoints"][0]["honorLabels"] is True
    # and names every series' node (the agent's own counters have none; alerts name it)
    assert agent["spec"]["endpoints"][0]["relabelings"] == [
        {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node",
         "action": "replace"}]
    assert agent["metadata"]["labels"]["release"] == "kube-prometheus"
    assert kube_validate(docs, "serviceMonitor") == []


def test_the_ci_values_with_a_service_monitor_cover_the_mirror():
    docs = render(WATCHDOG_KILL)
    assert one(docs, "ServiceMonitor", MIRROR)["metadata"]["labels"]["release"] == "prometheus"
    assert one(docs, "Service", METRICS_SVC)["spec"]["clusterIP"] == "None"


def test_no_service_monitor_unless_asked():
    docs = render()
    assert not find(docs, "ServiceMonitor")
    assert not find(docs, "Service", METRICS_SVC)
    assert metrics_flags(docs) == ["--metrics-listen=0.0.0.0:9401"]  # served all the same


def test_no_mirror_no_mirror_metrics():
    docs = render(sets=(*NO_MIRROR, *MONITORED))
    assert not find(docs, "Deployment", MIRROR)
    assert not find(docs, "Service", METRICS_SVC)
    assert not find(docs, "ServiceMonitor", MIRROR)
    assert not find(docs, "NetworkPolicy", MIRROR)
    # the node agent's stay
    assert one(docs, "ServiceMonitor", AGENT)
    assert one(docs, "Service", f"{AGENT}-metrics")
