"""The admission server's Prometheus metrics in the chart: every replica serves them on
`webhook.metricsPort` (`--metrics-listen`, container port `metrics`, plain HTTP beside the
webhooks' HTTPS); the NetworkPolicy admits that port from `webhook.networkPolicy.metricsFrom`,
from anywhere when it is empty (the metrics hold no secrets); with `serviceMonitor.enabled` a
headless Service and a ServiceMonitor make Prometheus scrape each replica (their series differ:
each counts its own reviews and connections)."""

from __future__ import annotations

from typing import Any

import pytest

from kai_fractions.cli import build_parser

from .render import CHART, NAMESPACE, container, find, kube_validate, one, render, template_error

ADMISSION = "kai-fractions-admission"
METRICS_SVC = f"{ADMISSION}-metrics"
WATCHDOG_KILL = CHART / "ci" / "watchdog-kill-values.yaml"  # sets serviceMonitor.enabled
MONITORED = ("serviceMonitor.enabled=true",)
PEERS = ("webhook.networkPolicy.metricsFrom[0].namespaceSelector.matchLabels.team=monitoring",
         "webhook.networkPolicy.metricsFrom[0].podSelector.matchLabels.app=prometheus",
         "webhook.networkPolicy.metricsFrom[1].ipBlock.cidr=10.20.0.0/16")
HTTPS_RULE = {"ports": [{"port": "https", "protocol": "TCP"}]}


def admission_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return container(one(docs, "Deployment", ADMISSION), "admission")


def metrics_flags(docs: list[dict[str, Any]]) -> list[str]:
    return [a for a in admission_container(docs)["args"] if a.startswith("--metrics-listen")]


def metrics_ingress(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [rule for rule in one(docs, "NetworkPolicy", ADMISSION)["spec"]["ingress"]
            if rule["ports"] == [{"port": "metrics", "protocol": "TCP"}]]


# -- the flag and the port ------------------------------------------------------------------

def test_every_replica_serves_metrics_on_the_default_port():
    docs = render()
    c = admission_container(docs)
    assert metrics_flags(docs) == ["--metrics-listen=0.0.0.0:9402"]
    assert c["ports"] == [{"name": "https", "containerPort": 8443, "protocol": "TCP"},
                          {"name": "metrics", "containerPort": 9402, "protocol": "TCP"}]
    # the flag the chart passes is the one the admission CLI reads
    assert build_parser().parse_args(c["args"]).metrics_listen == "0.0.0.0:9402"
    # the probes stay on the webhook's own port
    assert c["readinessProbe"]["httpGet"]["port"] == "https"
    # the mirror's and the node agent's keep their own ports: all can run on one node
    mirror = container(one(docs, "Deployment", "kai-fractions-mirror"), "mirror")
    agent = container(one(docs, "DaemonSet", "kai-fractions-node-agent"), "node-agent")
    assert "--metrics-listen=0.0.0.0:9401" in mirror["args"]
    assert "--metrics-listen=0.0.0.0:9400" in agent["args"]


def test_a_custom_metrics_port_moves_the_flag_the_container_port_and_the_service():
    docs = render(sets=("webhook.metricsPort=9555", *MONITORED))
    c = admission_container(docs)
    assert metrics_flags(docs) == ["--metrics-listen=0.0.0.0:9555"]
    assert [p for p in c["ports"] if p["name"] == "metrics"] == [
        {"name": "metrics", "containerPort": 9555, "protocol": "TCP"}]
    assert one(docs, "Service", METRICS_SVC)["spec"]["ports"] == [
        {"name": "metrics", "port": 9555, "targetPort": "metrics", "protocol": "TCP"}]
    # the webhooks' Service is untouched
    assert one(docs, "Service", ADMISSION)["spec"]["ports"] == [
        {"name": "https", "port": 443, "targetPort": "https", "protocol": "TCP"}]


@pytest.mark.parametrize(("value", "message"), [
    ("0", "minimum: got 0, want 1"),
    ("65536", "maximum: got 65,536, want 65,535"),
])
def test_schema_refuses_a_metrics_port_out_of_range(value: str, message: str):
    err = template_error(f"webhook.metricsPort={value}")
    assert "values don't meet the specifications of the schema" in err
    assert "/webhook/metricsPort" in err and message in err


def test_schema_refuses_a_metrics_port_that_is_not_a_number():
    err = template_error(set_string=["webhook.metricsPort=abc"])
    assert "/webhook/metricsPort" in err and "got string, want integer" in err


def test_metrics_and_webhooks_cannot_share_a_port():
    err = template_error("webhook.metricsPort=8443")
    assert "webhook.metricsPort=8443 is also webhook.port" in err
    err = template_error("webhook.port=9402")
    assert "webhook.metricsPort=9402 is also webhook.port" in err


# -- NetworkPolicy --------------------------------------------------------------------------

def test_the_metrics_port_is_open_to_anyone_by_default():
    docs = render()
    # no `from` at all: every source (Prometheus runs in a different namespace per cluster)
    assert one(docs, "NetworkPolicy", ADMISSION)["spec"]["ingress"] == [
        HTTPS_RULE, {"ports": [{"port": "metrics", "protocol": "TCP"}]}]


def test_metrics_from_limits_the_metrics_port_to_the_given_peers():
    docs = render(sets=PEERS)
    assert metrics_ingress(docs) == [{
        "ports": [{"port": "metrics", "protocol": "TCP"}],
        "from": [{"namespaceSelector": {"matchLabels": {"team": "monitoring"}},
                  "podSelector": {"matchLabels": {"app": "prometheus"}}},
                 {"ipBlock": {"cidr": "10.20.0.0/16"}}]}]
    # ...and leaves the HTTPS rule open to the API server, wherever it calls from
    assert one(docs, "NetworkPolicy", ADMISSION)["spec"]["ingress"][0] == HTTPS_RULE
    assert kube_validate(docs, "metricsFrom") == []


def test_schema_refuses_metrics_from_that_is_not_a_list():
    err = template_error("webhook.networkPolicy.metricsFrom=monitoring")
    assert "/webhook/networkPolicy/metricsFrom" in err and "got string, want array" in err


# -- headless Service + ServiceMonitor ------------------------------------------------------

def test_service_monitor_scrapes_every_admission_replica():
    docs = render(sets=(*MONITORED, "serviceMonitor.interval=15s",
                        "serviceMonitor.labels.release=kube-prometheus"))
    pods = one(docs, "Deployment", ADMISSION)["spec"]["selector"]["matchLabels"]
    svc = one(docs, "Service", METRICS_SVC)
    assert svc["metadata"]["namespace"] == NAMESPACE
    assert svc["spec"]["clusterIP"] == "None"  # headless: one target per pod
    assert svc["spec"]["selector"] == pods
    assert svc["spec"]["ports"] == [
        {"name": "metrics", "port": 9402, "targetPort": "metrics", "protocol": "TCP"}]
    monitor = one(docs, "ServiceMonitor", ADMISSION)
    assert monitor["metadata"]["namespace"] == NAMESPACE
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus"
    assert monitor["metadata"]["labels"]["app.kubernetes.io/component"] == "admission"
    assert monitor["spec"]["selector"]["matchLabels"] == pods
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    # no honorLabels: the admission server's series carry no workload labels to keep
    assert monitor["spec"]["endpoints"] == [
        {"port": "metrics", "path": "/metrics", "interval": "15s"}]
    # Of the Services its selector matches (the webhooks' HTTPS one too), only the headless one
    # has a `metrics` port, so each pod is scraped once.
    selected = [s for s in find(docs, "Service")
                if pods.items() <= s["metadata"]["labels"].items()]
    assert {s["metadata"]["name"] for s in selected} == {ADMISSION, METRICS_SVC}
    assert [s["metadata"]["name"] for s in selected
            if any(p["name"] == "metrics" for p in s["spec"]["ports"])] == [METRICS_SVC]
    # the mirror's and the node agents' are there beside it
    assert {m["metadata"]["name"] for m in find(docs, "ServiceMonitor")} == {
        ADMISSION, "kai-fractions-mirror", "kai-fractions-node-agent"}
    assert kube_validate(docs, "serviceMonitor") == []


def test_the_ci_values_with_a_service_monitor_cover_the_admission_server():
    docs = render(WATCHDOG_KILL)
    assert one(docs, "ServiceMonitor", ADMISSION)["metadata"]["labels"]["release"] == \
        "prometheus"
    assert one(docs, "Service", METRICS_SVC)["spec"]["clusterIP"] == "None"


def test_no_service_monitor_unless_asked():
    docs = render()
    assert not find(docs, "ServiceMonitor")
    assert not find(docs, "Service", METRICS_SVC)
    assert metrics_flags(docs) == ["--metrics-listen=0.0.0.0:9402"]  # served all the same


def test_gpu_sharing_disabled_renders_no_admission_metrics():
    docs = render(sets=("gpuSharing=Disabled", *MONITORED))
    assert not find(docs, "Service", METRICS_SVC)
    assert not find(docs, "ServiceMonitor", ADMISSION)
