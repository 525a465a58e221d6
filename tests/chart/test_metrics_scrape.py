"""The Prometheus metrics of the chart's Deployments, the mirror and the admission server: every
replica serves them on `mirror.metricsPort` / `webhook.metricsPort` (`--metrics-listen`, container
port `metrics`; the admission server's is plain HTTP beside the webhooks' HTTPS); the
NetworkPolicy admits that port from `mirror.networkPolicy.metricsFrom` /
`webhook.networkPolicy.metricsFrom`, from anywhere when it is empty (the metrics hold no secrets);
with `serviceMonitor.enabled` a headless Service and a ServiceMonitor (both from the chart's
`kf.metricsScrape`) make Prometheus scrape each replica (their series differ: one mirror replica
leads the BindRequest follower, each admission replica counts its own reviews and connections).

Most tests run once per component; the ones about one component alone come last."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from kai_fractions.cli import build_parser

from .render import CHART, NAMESPACE, container, find, kube_validate, one, render, template_error

MIRROR = "kai-fractions-mirror"
ADMISSION = "kai-fractions-admission"
AGENT = "kai-fractions-node-agent"
WATCHDOG_KILL = CHART / "ci" / "watchdog-kill-values.yaml"  # sets serviceMonitor.enabled
MONITORED = ("serviceMonitor.enabled=true",)
METRICS_RULE = {"ports": [{"port": "metrics", "protocol": "TCP"}]}
# Every metrics-serving workload and the port its flag names by default: all can run on one node.
DEFAULT_FLAGS = {("Deployment", MIRROR, "mirror"): "--metrics-listen=0.0.0.0:9401",
                 ("Deployment", ADMISSION, "admission"): "--metrics-listen=0.0.0.0:9402",
                 ("DaemonSet", AGENT, "node-agent"): "--metrics-listen=0.0.0.0:9400"}
# No mirror (the GpuFractioningConfig reporter needs it, so that goes too).
NO_MIRROR = ("mirror.enabled=false", "gpuFractioningConfig.enabled=false",
             "signing.enabled=false")


@dataclass(frozen=True)
class Component:
    """One component whose replicas the chart has Prometheus scrape."""

    label: str  # app.kubernetes.io/component
    name: str  # its Deployment, NetworkPolicy, ServiceMonitor and own Service
    values: str  # its section of the values: <values>.metricsPort, <values>.networkPolicy...
    port: int  # the default metrics port
    own_port: str  # the container port it serves on (and the Service's, the probe's)
    own_port_value: int  # <values>.port by default
    own_container_port: dict[str, Any]
    own_service_ports: list[dict[str, Any]]  # its own Service's, which has no `metrics` port
    probe: str  # how the readiness probe reaches own_port
    own_rule: dict[str, Any]  # the NetworkPolicy rule of own_port, whatever metricsFrom says

    @property
    def metrics_service(self) -> str:
        return f"{self.name}-metrics"

    def container(self, docs: list[dict[str, Any]]) -> dict[str, Any]:
        return container(one(docs, "Deployment", self.name), self.label)

    def metrics_flags(self, docs: list[dict[str, Any]]) -> list[str]:
        return [a for a in self.container(docs)["args"] if a.startswith("--metrics-listen")]

    def metrics_ingress(self, docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [rule for rule in one(docs, "NetworkPolicy", self.name)["spec"]["ingress"]
                if rule["ports"] == [{"port": "metrics", "protocol": "TCP"}]]


MIRROR_COMPONENT = Component(
    label="mirror", name=MIRROR, values="mirror", port=9401, own_port="grpc",
    own_port_value=50051,
    own_container_port={"name": "grpc", "containerPort": 50051, "protocol": "TCP"},
    own_service_ports=[{"name": "grpc", "port": 50051, "targetPort": "grpc", "protocol": "TCP",
                        "appProtocol": "grpc"}],
    probe="tcpSocket",
    # KAI's scheduler alone calls the mirror
    own_rule={"ports": [{"port": "grpc", "protocol": "TCP"}],
              "from": [{"namespaceSelector": {"matchLabels": {
                  "kubernetes.io/metadata.name": "kai-scheduler"}}}]})
ADMISSION_COMPONENT = Component(
    label="admission", name=ADMISSION, values="webhook", port=9402, own_port="https",
    own_port_value=8443,
    own_container_port={"name": "https", "containerPort": 8443, "protocol": "TCP"},
    own_service_ports=[{"name": "https", "port": 443, "targetPort": "https", "protocol": "TCP"}],
    probe="httpGet",
    # open to the API server, wherever it calls from
    own_rule={"ports": [{"port": "https", "protocol": "TCP"}]})
COMPONENTS = pytest.mark.parametrize(
    "comp", [MIRROR_COMPONENT, ADMISSION_COMPONENT], ids=lambda c: c.label)


def metrics_port(port: int) -> dict[str, Any]:
    return {"name": "metrics", "containerPort": port, "protocol": "TCP"}


def service_port(port: int) -> list[dict[str, Any]]:
    return [{"name": "metrics", "port": port, "targetPort": "metrics", "protocol": "TCP"}]


# -- the flag and the port ------------------------------------------------------------------

@COMPONENTS
def test_every_replica_serves_metrics_on_the_default_port(comp: Component):
    docs = render()
    c = comp.container(docs)
    assert comp.metrics_flags(docs) == [f"--metrics-listen=0.0.0.0:{comp.port}"]
    assert metrics_port(comp.port) in c["ports"]
    assert c["ports"] == [comp.own_container_port, metrics_port(comp.port)]
    # the flag the chart passes is the one the component's CLI reads
    assert build_parser().parse_args(c["args"]).metrics_listen == f"0.0.0.0:{comp.port}"
    # the probes stay on the component's own port
    assert c["readinessProbe"][comp.probe]["port"] == comp.own_port
    # the other components keep their own ports: all can run on one node
    for (kind, name, container_name), flag in DEFAULT_FLAGS.items():
        assert flag in container(one(docs, kind, name), container_name)["args"]


@COMPONENTS
def test_a_custom_metrics_port_moves_the_flag_the_container_port_and_the_service(
        comp: Component):
    docs = render(sets=(f"{comp.values}.metricsPort=9555", *MONITORED))
    c = comp.container(docs)
    assert comp.metrics_flags(docs) == ["--metrics-listen=0.0.0.0:9555"]
    assert [p for p in c["ports"] if p["name"] == "metrics"] == [metrics_port(9555)]
    assert one(docs, "Service", comp.metrics_service)["spec"]["ports"] == service_port(9555)
    # the component's own container port and Service are untouched
    assert [p for p in c["ports"] if p["name"] == comp.own_port] == [comp.own_container_port]
    assert one(docs, "Service", comp.name)["spec"]["ports"] == comp.own_service_ports


@COMPONENTS
@pytest.mark.parametrize(("value", "message"), [
    ("0", "minimum: got 0, want 1"),
    ("65536", "maximum: got 65,536, want 65,535"),
])
def test_schema_refuses_a_metrics_port_out_of_range(comp: Component, value: str, message: str):
    err = template_error(f"{comp.values}.metricsPort={value}")
    assert "values don't meet the specifications of the schema" in err
    assert f"/{comp.values}/metricsPort" in err and message in err


@COMPONENTS
def test_schema_refuses_a_metrics_port_that_is_not_a_number(comp: Component):
    err = template_error(set_string=[f"{comp.values}.metricsPort=abc"])
    assert f"/{comp.values}/metricsPort" in err and "got string, want integer" in err


@COMPONENTS
def test_metrics_and_the_components_own_port_cannot_be_the_same(comp: Component):
    """The mirror's gRPC port, the admission server's webhook (HTTPS) port."""
    v = comp.values
    err = template_error(f"{v}.metricsPort={comp.own_port_value}")
    assert f"{v}.metricsPort={comp.own_port_value} is also {v}.port" in err
    err = template_error(f"{v}.port={comp.port}")
    assert f"{v}.metricsPort={comp.port} is also {v}.port" in err


# -- NetworkPolicy --------------------------------------------------------------------------

@COMPONENTS
def test_the_metrics_port_is_open_to_anyone_by_default(comp: Component):
    docs = render()
    # no `from` at all: every source (Prometheus runs in a different namespace per cluster)
    assert comp.metrics_ingress(docs) == [METRICS_RULE]
    # ...beside the component's own port's rule
    assert one(docs, "NetworkPolicy", comp.name)["spec"]["ingress"] == [comp.own_rule,
                                                                        METRICS_RULE]


@COMPONENTS
def test_metrics_from_limits_the_metrics_port_to_the_given_peers(comp: Component):
    # Prometheus's namespace by label, its pods by label, and a CIDR: the three kinds of peer.
    peers = f"{comp.values}.networkPolicy.metricsFrom"
    docs = render(sets=(f"{peers}[0].namespaceSelector.matchLabels.team=monitoring",
                        f"{peers}[0].podSelector.matchLabels.app=prometheus",
                        f"{peers}[1].ipBlock.cidr=10.20.0.0/16"))
    assert comp.metrics_ingress(docs) == [{
        "ports": [{"port": "metrics", "protocol": "TCP"}],
        "from": [{"namespaceSelector": {"matchLabels": {"team": "monitoring"}},
                  "podSelector": {"matchLabels": {"app": "prometheus"}}},
                 {"ipBlock": {"cidr": "10.20.0.0/16"}}]}]
    # ...and leaves the component's own port's rule as it was
    ingress = one(docs, "NetworkPolicy", comp.name)["spec"]["ingress"]
    assert ingress[0] == comp.own_rule
    assert ingress[0] == one(render(), "NetworkPolicy", comp.name)["spec"]["ingress"][0]
    assert kube_validate(docs, "metricsFrom") == []


@COMPONENTS
def test_schema_refuses_metrics_from_that_is_not_a_list(comp: Component):
    err = template_error(f"{comp.values}.networkPolicy.metricsFrom=monitoring")
    assert (f"/{comp.values}/networkPolicy/metricsFrom" in err
            and "got string, want array" in err)


# -- headless Service + ServiceMonitor ------------------------------------------------------

def monitored_docs() -> list[dict[str, Any]]:
    return render(sets=(*MONITORED, "serviceMonitor.interval=15s",
                        "serviceMonitor.labels.release=kube-prometheus"))


@COMPONENTS
def test_service_monitor_scrapes_every_replica(comp: Component):
    docs = monitored_docs()
    pods = one(docs, "Deployment", comp.name)["spec"]["selector"]["matchLabels"]
    svc = one(docs, "Service", comp.metrics_service)
    assert svc["metadata"]["namespace"] == NAMESPACE
    assert svc["spec"]["clusterIP"] == "None"  # headless: one target per pod
    assert svc["spec"]["selector"] == pods
    assert svc["spec"]["ports"] == service_port(comp.port)
    monitor = one(docs, "ServiceMonitor", comp.name)
    assert monitor["metadata"]["namespace"] == NAMESPACE
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus"
    assert monitor["metadata"]["labels"]["app.kubernetes.io/component"] == comp.label
    assert monitor["spec"]["selector"]["matchLabels"] == pods
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    # no honorLabels: the component's series carry no workload labels to keep
    assert monitor["spec"]["endpoints"] == [
        {"port": "metrics", "path": "/metrics", "interval": "15s"}]
    # Of the Services its selector matches (the component's own one too: the mirror's gRPC, the
    # webhooks' HTTPS), only the headless one has a `metrics` port, so each pod is scraped once.
    selected = [s for s in find(docs, "Service")
                if pods.items() <= s["metadata"]["labels"].items()]
    assert {s["metadata"]["name"] for s in selected} == {comp.name, comp.metrics_service}
    assert [s["metadata"]["name"] for s in selected
            if any(p["name"] == "metrics" for p in s["spec"]["ports"])] == [comp.metrics_service]
    # the other components' are there beside it
    assert {m["metadata"]["name"] for m in find(docs, "ServiceMonitor")} == {
        ADMISSION, MIRROR, AGENT}
    assert kube_validate(docs, "serviceMonitor") == []


def test_the_node_agents_service_monitor_keeps_honor_labels_and_names_the_node():
    docs = monitored_docs()
    agent = one(docs, "ServiceMonitor", AGENT)
    # the node agent's keeps honorLabels (its series carry the workloads' labels)
    assert agent["spec"]["endpoints"][0]["honorLabels"] is True
    # and names every series' node (the agent's own counters have none; alerts name it)
    assert agent["spec"]["endpoints"][0]["relabelings"] == [
        {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node",
         "action": "replace"}]
    assert agent["metadata"]["labels"]["release"] == "kube-prometheus"


@COMPONENTS
def test_the_ci_values_with_a_service_monitor_cover_the_component(comp: Component):
    docs = render(WATCHDOG_KILL)
    assert one(docs, "ServiceMonitor", comp.name)["metadata"]["labels"]["release"] == \
        "prometheus"
    assert one(docs, "Service", comp.metrics_service)["spec"]["clusterIP"] == "None"


@COMPONENTS
def test_no_service_monitor_unless_asked(comp: Component):
    docs = render()
    assert not find(docs, "ServiceMonitor")
    assert not find(docs, "Service", comp.metrics_service)
    # served all the same
    assert comp.metrics_flags(docs) == [f"--metrics-listen=0.0.0.0:{comp.port}"]


@COMPONENTS
def test_gpu_sharing_disabled_renders_no_metrics_scraping(comp: Component):
    docs = render(sets=("gpuSharing=Disabled", *MONITORED))
    assert not find(docs, "Service", comp.metrics_service)
    assert not find(docs, "ServiceMonitor", comp.name)


# -- one component alone --------------------------------------------------------------------

def test_no_mirror_no_mirror_metrics():
    docs = render(sets=(*NO_MIRROR, *MONITORED))
    assert not find(docs, "Deployment", MIRROR)
    assert not find(docs, "Service", MIRROR_COMPONENT.metrics_service)
    assert not find(docs, "ServiceMonitor", MIRROR)
    assert not find(docs, "NetworkPolicy", MIRROR)
    # the node agent's stay, and so do the admission server's
    assert one(docs, "ServiceMonitor", AGENT)
    assert one(docs, "Service", f"{AGENT}-metrics")
    assert one(docs, "ServiceMonitor", ADMISSION)
    assert one(docs, "Service", ADMISSION_COMPONENT.metrics_service)
