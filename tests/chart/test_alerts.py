"""The alerting rules (charts/kai-fractions/templates/prometheusrule.yaml): a Prometheus Operator
PrometheusRule, only with `prometheusRule.enabled` (never by default, never with gpuSharing
Disabled), whose every `expr` names only metrics and labels a live process really exports
(taken from the /metrics of the REAL process, as the dashboard's test does, with the same reader,
tests/support/promql.py): the `kai-fractions-mirror` group's a live mirror's, with the target
labels Prometheus adds (its ServiceMonitor keeps them), the `kai-fractions-node-agent` group's a
live node agent's, without (its ServiceMonitor honours the agent's own workload labels), the
`kai-fractions-admission` group's a live admission server's, with the target labels (as the
mirror's).

Every alert has a severity, a summary and a description, and the `for` listed here; the
Prometheus templates of its annotations (`{{ $labels.x }}`, `{{ $value }}`) survive Helm
literally and name only labels the alert's series carry."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client import generate_latest

from kai_fractions.admission.metrics import OUTCOMES, REFUSALS
from kai_fractions.mirror.metrics import MirrorMetrics
from kai_fractions.node.agent.metrics import CAP_NOT_IN_FORCE, AgentMetrics
from kai_fractions.node.desired import ContainerKey
from kai_fractions.node.engine import (
    CAP_NOT_IN_FORCE_REASONS,
    NOT_IN_FORCE_REASONS,
    ContainerResult,
    ContainerState,
)
from tests.admission.certs import install, make_cert
from tests.chart.render import (
    NAMESPACE,
    REPO,
    find,
    kube_validate,
    one,
    render,
    render_text,
    template_error,
)
from tests.support.admission_metrics import populated_admission_scrape
from tests.support.agent_metrics import populated_scrape
from tests.support.agent_process import AgentEnv
from tests.support.kube import KubeServer
from tests.support.mirror_metrics import populated_mirror_scrape
from tests.support.promql import (
    AGENT_TARGET_LABELS,
    TARGET_LABELS,
    UP_LABELS,
    Expr,
    exported,
    parse,
    problems,
)

RULE = "kai-fractions"
ON = ("prometheusRule.enabled=true",)
MIRROR_GROUP = "kai-fractions-mirror"
AGENT_GROUP = "kai-fractions-node-agent"
ADMISSION_GROUP = "kai-fractions-admission"
ALERTS = {  # alert -> (group, severity, `for`; None: fires at once)
    "KaiFractionsMirrorReplicaDown": (MIRROR_GROUP, "warning", "10m"),
    "KaiFractionsMirrorDown": (MIRROR_GROUP, "critical", "5m"),
    "KaiFractionsFollowerNoLeader": (MIRROR_GROUP, "critical", "2m"),
    "KaiFractionsFollowerSeveralLeaders": (MIRROR_GROUP, "warning", "5m"),
    "KaiFractionsMirrorCallsFailing": (MIRROR_GROUP, "warning", "10m"),
    "KaiFractionsMirrorApiUnreachable": (MIRROR_GROUP, "warning", "5m"),
    "KaiFractionsSignatureDelayHigh": (MIRROR_GROUP, "warning", "15m"),
    "KaiFractionsFollowerFailing": (MIRROR_GROUP, "warning", "10m"),
    "KaiFractionsFollowerMismatches": (MIRROR_GROUP, "warning", "15m"),
    "KaiFractionsNodeAgentSilent": (MIRROR_GROUP, "warning", "2m"),
    "KaiFractionsFollowerNodeChecksFailing": (MIRROR_GROUP, "warning", "15m"),
    "KaiFractionsNodeAgentDown": (AGENT_GROUP, "warning", "5m"),
    "KaiFractionsNodeNotReady": (AGENT_GROUP, "warning", "10m"),
    "KaiFractionsNodeAgentWritesRefused": (AGENT_GROUP, "warning", "10m"),
    "KaiFractionsGpuMemoryLimitViolation": (AGENT_GROUP, "warning", None),
    "KaiFractionsContainerRefused": (AGENT_GROUP, "warning", "5m"),
    "KaiFractionsMpsCapNotInForce": (AGENT_GROUP, "warning", "2m"),
    "KaiFractionsMemoryLimitNotInForce": (AGENT_GROUP, "warning", "2m"),
    "KaiFractionsNodeGpuMemoryLimitViolations": (AGENT_GROUP, "warning", None),
    "KaiFractionsNodeRefusedGonePods": (AGENT_GROUP, "warning", None),
    "KaiFractionsReconcileErrors": (AGENT_GROUP, "warning", "15m"),
    "KaiFractionsMpsDaemonRestarting": (AGENT_GROUP, "warning", None),
    "KaiFractionsMpsDrainFailing": (AGENT_GROUP, "warning", None),
    "KaiFractionsWatchdogBlind": (AGENT_GROUP, "warning", "10m"),
    "KaiFractionsWatchdogStopFailing": (AGENT_GROUP, "warning", None),
    "KaiFractionsAdmissionReplicaDown": (ADMISSION_GROUP, "warning", "10m"),
    "KaiFractionsAdmissionDown": (ADMISSION_GROUP, "critical", "5m"),
    "KaiFractionsAdmissionShedding": (ADMISSION_GROUP, "warning", "10m"),
    "KaiFractionsAdmissionInternalErrors": (ADMISSION_GROUP, "warning", None),
}
FOLLOWER = {"KaiFractionsFollowerNoLeader", "KaiFractionsFollowerSeveralLeaders",
            "KaiFractionsSignatureDelayHigh", "KaiFractionsFollowerFailing",
            "KaiFractionsFollowerMismatches", "KaiFractionsNodeAgentSilent",
            "KaiFractionsFollowerNodeChecksFailing"}
"""Only with mirror.followBindRequests: without the follower nothing leads or signs."""
GRPC_ONLY = {"KaiFractionsMirrorDown"}
"""Only without the follower (gRPC mode): with it, KaiFractionsFollowerNoLeader fires when no
mirror replica is up (its `or vector(0)`), and one critical alert is enough."""
DEFAULT_ALERTS = set(ALERTS) - GRPC_ONLY
PROMETHEUS_TEMPLATE = re.compile(r"\{\{\s*(.*?)\s*\}\}")
ALLOWED_TEMPLATE = re.compile(r"\$labels\.([A-Za-z_][A-Za-z0-9_]*)|\$value(?: \| humanize\w*)?"
                              r'|printf "%\.(?:0f|3g)" \$value')
"""A label, or the alert's value: humanized, a count (an increase, extrapolated: 1.011 is "1"),
or a rate (0.0333/s, where humanize would say "33.33m/s")."""


def rule(*sets: str) -> dict[str, Any]:
    return one(render(sets=ON + sets), "PrometheusRule", RULE)


def alerts(prometheus_rule: dict[str, Any]) -> dict[str, tuple[str, dict[str, Any]]]:
    """alert name -> (its group's name, the rule)."""
    out = {}
    for group in prometheus_rule["spec"]["groups"]:
        for r in group["rules"]:
            assert r["alert"] not in out, f"{r['alert']} twice"
            out[r["alert"]] = (group["name"], r)
    return out


def annotation_labels(r: dict[str, Any]) -> set[str]:
    """The labels the Prometheus templates of an alert's annotations name ({{ $labels.x }})."""
    return {m.group(1) for text in r["annotations"].values()
            for m in ALLOWED_TEMPLATE.finditer(text) if m.group(1)}


def alert_exprs(group: str, prometheus_rule: dict[str, Any]) -> list[Expr]:
    """The group's expressions, the labels its annotations name as the legend (so they are
    checked as a panel legend's are: known on the metrics the expression reads)."""
    return [Expr(g, f"alert {name}", r["expr"],
                 " ".join(f"{{{{{label}}}}}" for label in sorted(annotation_labels(r))))
            for name, (g, r) in alerts(prometheus_rule).items() if g == group]


def cap_not_in_force_labels() -> set[str]:
    """The labels of a kai_fractions_container_cap_not_in_force series, as the agent's metrics
    (in process) export one for a container pending with its MPS cap not in force."""
    metrics = AgentMetrics("node-a")
    metrics.count_caps([ContainerResult(
        key=ContainerKey("6b0f7d6e-3a1c-4f0e-9d57-2c8e1b4a9f10", "main"), ref="team-a/train-0/main",
        state=ContainerState.PENDING, reason="NamespaceCapNotSet", mps_cap_missing=True)])
    labels = exported(generate_latest(metrics.registry).decode())[CAP_NOT_IN_FORCE]
    assert labels, "the agent exports no series of a container whose MPS cap is not in force"
    return labels


SILENT_NODE = "kai_fractions_follower_node_silent"


def silent_node_labels() -> set[str]:
    """The labels of a kai_fractions_follower_node_silent series, as the mirror's metrics (in
    process) export one for a node the follower marked silent."""
    metrics = MirrorMetrics()
    metrics.node_marked_silent("gpu-node-1")
    labels = exported(generate_latest(metrics.registry).decode())[SILENT_NODE]
    assert labels == {"node"}, labels
    return labels


def kept_by_aggregation(expr: str) -> set[str] | None:
    """The labels an expression's aggregation keeps (its `by` list; none without one), or None
    when it aggregates nothing (its series keep their own labels)."""
    if not re.search(r"\b(sum|min|max|avg|count)\s*(by\s*\([^)]*\)\s*)?\(", expr):
        return None
    lists = [{label.strip() for label in m.split(",") if label.strip()}
             for m in re.findall(r"\bby\s*\(([^)]*)\)", expr)]
    return set.intersection(*lists) if lists else set()


# -- the chart ------------------------------------------------------------------------------


def test_no_rule_by_default() -> None:
    assert find(render(), "PrometheusRule") == []


def test_gpu_sharing_disabled_renders_no_rule() -> None:
    assert find(render(sets=(*ON, "gpuSharing=Disabled")), "PrometheusRule") == []


def test_enabled_renders_one_prometheus_rule_with_every_alert() -> None:
    docs = render(sets=ON)
    (r,) = find(docs, "PrometheusRule")
    assert (r["apiVersion"], r["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert (r["metadata"]["name"], r["metadata"]["namespace"]) == (RULE, NAMESPACE)
    labels = r["metadata"]["labels"]
    assert labels["app.kubernetes.io/name"] == "kai-fractions"
    assert labels["app.kubernetes.io/instance"] == "kf"
    assert labels["app.kubernetes.io/component"] == "alerts"
    assert labels["app.kubernetes.io/managed-by"] == "Helm"
    assert "annotations" not in r["metadata"] and list(r) == ["apiVersion", "kind", "metadata",
                                                              "spec"]
    # no schema for the CRD here: kubernetes-validate only checks it is a CUSTOM_KINDS one
    assert kube_validate([r], "alerts") == []
    assert [g["name"] for g in r["spec"]["groups"]] == [MIRROR_GROUP, AGENT_GROUP,
                                                        ADMISSION_GROUP]
    assert all(set(g) == {"name", "rules"} for g in r["spec"]["groups"])
    found = alerts(r)
    assert set(found) == DEFAULT_ALERTS
    grpc_mode = alerts(rule("mirror.followBindRequests=false"))
    assert set(grpc_mode) == set(ALERTS) - FOLLOWER
    for name, (group, rule_) in [*found.items(), *grpc_mode.items()]:
        want_group, severity, for_ = ALERTS[name]
        assert group == want_group, name
        assert rule_["labels"] == {"severity": severity}, name
        assert rule_.get("for") == for_, name
        assert set(rule_) <= {"alert", "expr", "for", "labels", "annotations"}, name
        assert set(rule_["annotations"]) == {"summary", "description"}, name
        summary, description = rule_["annotations"]["summary"], rule_["annotations"]["description"]
        assert summary.strip() and "\n" not in summary, name
        # what it means and where to look: a log, a doc, a kubectl command
        assert len(description) > len(summary) and "Look at" in description, name
        assert re.search(r"\blogs?\b|docs/\w+\.md|kubectl", description), name
        assert isinstance(rule_["expr"], str) and rule_["expr"].strip(), name


def test_docs_list_every_alert() -> None:
    """docs/chart.md, "Alerts": a row per alert the chart has."""
    section = (REPO / "docs" / "chart.md").read_text().split("### Alerts", 1)[1]
    section = section.split("\n### ", 1)[0]
    assert set(re.findall(r"^\| `(KaiFractions\w+)`", section, flags=re.M)) == set(ALERTS)


def test_labels_are_added_for_the_operators_rule_selector() -> None:
    r = rule("prometheusRule.labels.release=prometheus", "prometheusRule.labels.team=gpu")
    labels = r["metadata"]["labels"]
    assert (labels["release"], labels["team"]) == ("prometheus", "gpu")
    assert labels["app.kubernetes.io/component"] == "alerts"


def test_schema_rejects_unknown_keys() -> None:
    err = template_error("prometheusRule.enable=true")
    assert "additional properties 'enable' not allowed" in err
    err = template_error(set_string=["prometheusRule.enabled=yes"])
    assert "/prometheusRule/enabled" in err


def test_without_the_mirror_no_mirror_group() -> None:
    r = rule("mirror.enabled=false", "gpuFractioningConfig.enabled=false", "signing.enabled=false")
    assert [g["name"] for g in r["spec"]["groups"]] == [AGENT_GROUP, ADMISSION_GROUP]
    assert set(alerts(r)) == {n for n, (g, _s, _f) in ALERTS.items() if g != MIRROR_GROUP}
    assert "KaiFractionsMirrorReplicaDown" not in alerts(r)  # no mirror: nothing to be down


def test_without_the_follower_no_follower_alerts() -> None:
    r = rule("mirror.followBindRequests=false")
    assert [g["name"] for g in r["spec"]["groups"]] == [MIRROR_GROUP, AGENT_GROUP,
                                                        ADMISSION_GROUP]
    assert set(alerts(r)) == set(ALERTS) - FOLLOWER


def test_descriptions_follow_signing_and_the_watchdog_policy() -> None:
    no_leader = alerts(rule())["KaiFractionsFollowerNoLeader"][1]["annotations"]["description"]
    assert "SignatureMissing" in no_leader and "kai-fractions-mirror-follower" in no_leader
    unsigned = alerts(rule("signing.enabled=false"))["KaiFractionsFollowerNoLeader"][1]
    unsigned_text = unsigned["annotations"]["description"]
    assert "SignatureMissing" not in unsigned_text and "signs" not in unsigned_text
    violation = "KaiFractionsGpuMemoryLimitViolation"
    assert "policy report" in alerts(rule())[violation][1]["annotations"]["description"]
    killed = alerts(rule("watchdog.policy=kill"))[violation][1]["annotations"]["description"]
    assert "policy kill" in killed and "LimitEnforced" in killed
    gone = "KaiFractionsNodeGpuMemoryLimitViolations"
    reported = alerts(rule())[gone][1]["annotations"]["description"]
    assert "reason=LimitViolation" in reported and "LimitEnforced" not in reported
    killed = alerts(rule("watchdog.policy=kill"))[gone][1]["annotations"]["description"]
    assert "reason=LimitEnforced" in killed and "reason=LimitViolation" not in killed


def test_helm_keeps_the_prometheus_templates_of_the_annotations_literally() -> None:
    text = render_text(sets=ON)
    assert "summary: Mirror replica {{ $labels.pod }} cannot reach" in text
    assert "{{ $labels.node }}" in text and "{{ $value | humanizePercentage }}" in text
    assert "{{`" not in text and "`}}" not in text
    used = set()
    for name, (_group, r) in alerts(rule()).items():
        for text in r["annotations"].values():
            for template in PROMETHEUS_TEMPLATE.findall(text):
                assert ALLOWED_TEMPLATE.fullmatch(template), f"{name}: {{{{ {template} }}}}"
                used.add(template)
    assert {"$labels.pod", "$labels.node", "$labels.reason", "$value"} <= used
    # none is rendered by Helm itself: no value of the chart ended up where Prometheus's go
    for name, (_group, r) in alerts(rule()).items():
        assert "<no value>" not in str(r), name


def test_annotations_name_only_labels_the_aggregation_keeps() -> None:
    """Beyond the live check (a label the metric has), a label an aggregation drops is gone:
    `sum by (reason)` leaves no node to name."""
    for name, (_group, r) in alerts(rule()).items():
        kept = kept_by_aggregation(r["expr"])
        if kept is not None:
            assert annotation_labels(r) <= kept, name
    assert kept_by_aggregation("sum by (a, b) (rate(m[5m])) > 0") == {"a", "b"}
    assert kept_by_aggregation("(sum(m) or vector(0)) < 1") == set()
    assert kept_by_aggregation("increase(m_total[10m]) > 0") is None


def test_every_node_agent_alert_names_its_node() -> None:
    """A node agent's alert is acted on at one node: each names it (the per-process counters
    have no `node` of their own; the agent's ServiceMonitor adds it to every series)."""
    for name, (group, r) in alerts(rule()).items():
        if group == AGENT_GROUP:
            assert "node" in annotation_labels(r), name
            kept = kept_by_aggregation(r["expr"])
            assert kept is None or "node" in kept, name


def test_the_agent_down_alert_reads_up_of_the_agents_service_monitor() -> None:
    """Prometheus Operator names a ServiceMonitor target's job after its Service (no jobLabel
    here), so the alert reads `up` of exactly the agents' metrics Service."""
    docs = render(sets=(*ON, "serviceMonitor.enabled=true"))
    monitor = one(docs, "ServiceMonitor", "kai-fractions-node-agent")
    assert "jobLabel" not in monitor["spec"]
    (service,) = [s for s in find(docs, "Service")
                  if monitor["spec"]["selector"]["matchLabels"].items()
                  <= s["metadata"]["labels"].items()
                  and any(p["name"] == "metrics" for p in s["spec"]["ports"])]
    expr = alerts(rule())["KaiFractionsNodeAgentDown"][1]["expr"]
    assert expr == (f'up{{job="{service["metadata"]["name"]}", namespace="{NAMESPACE}"}} == 0')
    description = alerts(rule())["KaiFractionsNodeAgentDown"][1]["annotations"]["description"]
    assert "Unknown after 180 s" in description
    quiet = alerts(rule("mirror.followBindRequests=false"))["KaiFractionsNodeAgentDown"][1]
    assert "Unknown after" not in quiet["annotations"]["description"]


NONE_UP = {"KaiFractionsAdmissionDown", "KaiFractionsMirrorDown"}
"""The alerts on a whole component (no replica up): they name no replica."""


def test_every_admission_alert_names_its_replica() -> None:
    """Each replica counts its own reviews and connections, and has its own target: the alert
    says which (`pod`, the target label its ServiceMonitor keeps), but the one that fires when
    none is up."""
    for name, (group, r) in alerts(rule()).items():
        if group == ADMISSION_GROUP and name not in NONE_UP:
            assert "pod" in annotation_labels(r), name
            kept = kept_by_aggregation(r["expr"])
            assert kept is None or "pod" in kept, name


@pytest.mark.parametrize(("component", "replica_down", "none_up", "sets"), [
    ("mirror", "KaiFractionsMirrorReplicaDown", "KaiFractionsMirrorDown",
     ("mirror.followBindRequests=false",)),
    ("admission", "KaiFractionsAdmissionReplicaDown", "KaiFractionsAdmissionDown", ()),
])
def test_the_down_alerts_read_up_of_their_components_service_monitor(
        component: str, replica_down: str, none_up: str, sets: tuple[str, ...]) -> None:
    """Prometheus Operator names a ServiceMonitor target's job after its Service: the alerts
    read `up` of exactly the component's metrics Service, per replica (`pod`), and summed over
    its replicas with `or vector(0)`, so that no target at all (every pod Pending, none
    scraped) is none up too."""
    docs = render(sets=(*ON, "serviceMonitor.enabled=true", *sets))
    monitor = one(docs, "ServiceMonitor", f"kai-fractions-{component}")
    assert "jobLabel" not in monitor["spec"]
    (service,) = [s for s in find(docs, "Service")
                  if monitor["spec"]["selector"]["matchLabels"].items()
                  <= s["metadata"]["labels"].items()
                  and any(p["name"] == "metrics" for p in s["spec"]["ports"])]
    up = f'up{{job="{service["metadata"]["name"]}", namespace="{NAMESPACE}"}}'
    found = alerts(rule(*sets))
    assert found[replica_down][1]["expr"] == f"{up} == 0"
    assert found[none_up][1]["expr"] == f"({'sum'}({up}) or vector(0)) < 1"
    assert ALERTS[none_up][1] == "critical" and ALERTS[replica_down][1] == "warning"


def test_the_admission_down_alert_says_what_its_failure_policies_do() -> None:
    text = alerts(rule())["KaiFractionsAdmissionDown"][1]["annotations"]["description"]
    assert "refuses every fractional pod" in text and "hostPath volume" in text
    # the status writes of running fractional pods are not sent while annotations stay
    assert "except the kubelet's status writes that leave its annotations" in text
    open_ = alerts(rule("webhook.failurePolicy=Ignore", "webhook.guardFailurePolicy=Ignore"))
    text = open_["KaiFractionsAdmissionDown"][1]["annotations"]["description"]
    assert "admitted unchecked" in text and "let everything through" in text
    assert "refuses every fractional pod" not in text


def test_without_the_follower_the_mirror_down_alert_stands_for_no_leader() -> None:
    """With the follower, KaiFractionsFollowerNoLeader fires when no replica is up (no series:
    `or vector(0)`); without it, KaiFractionsMirrorDown does, and each replica-down alert names
    the one that comes next."""
    follow = alerts(rule())
    assert "KaiFractionsMirrorDown" not in follow
    assert "or vector(0)" in follow["KaiFractionsFollowerNoLeader"][1]["expr"]
    assert "KaiFractionsFollowerNoLeader fires" in \
        follow["KaiFractionsMirrorReplicaDown"][1]["annotations"]["description"]
    grpc_mode = alerts(rule("mirror.followBindRequests=false"))
    assert "KaiFractionsMirrorDown fires" in \
        grpc_mode["KaiFractionsMirrorReplicaDown"][1]["annotations"]["description"]


def test_the_silent_node_alert_reads_the_nodes_held_silent_not_the_marks() -> None:
    """Once a node is Unknown KAI binds nothing more there, so the marks' counter stops, while
    the node stays unusable: the alert reads the gauge of the nodes the leader holds silent now,
    by node (the replica that reports it may change: not by pod)."""
    silent = alerts(rule())["KaiFractionsNodeAgentSilent"][1]
    assert silent["expr"] == "max by (node) (kai_fractions_follower_node_silent) > 0"
    assert "node" in annotation_labels(silent)
    assert "KaiFractionsNodeAgentSilent" not in alerts(rule("mirror.markSilentNodesAfterSeconds=0"))


def test_the_admission_alerts_read_label_values_the_server_counts() -> None:
    """A label value the server never writes would keep an alert quiet for ever."""
    values = {name: {(label, op, v) for _m, label, op, v in parse(r["expr"]).values}
              for name, (group, r) in alerts(rule()).items() if group == ADMISSION_GROUP}
    up = {("job", "=", "kai-fractions-admission-metrics"), ("namespace", "=", NAMESPACE)}
    assert values == {"KaiFractionsAdmissionReplicaDown": up, "KaiFractionsAdmissionDown": up,
                      "KaiFractionsAdmissionShedding": {("reason", "=", "no_room")},
                      "KaiFractionsAdmissionInternalErrors": {("outcome", "=", "error")}}
    assert "no_room" in REFUSALS and "error" in OUTCOMES


def test_the_mirror_calls_alert_counts_real_grpc_codes() -> None:
    codes = {c.name for c in grpc.StatusCode}
    expr = alerts(rule())["KaiFractionsMirrorCallsFailing"][1]["expr"]
    values = [(op, v) for metric, label, op, v in parse(expr).values if label == "code"]
    assert values == [("=~", "INTERNAL|UNAVAILABLE|DEADLINE_EXCEEDED")]
    assert set(values[0][1].split("|")) <= codes
    assert "> 0.05" in expr


def test_the_mismatch_threshold_is_a_value_and_the_summary_follows_it() -> None:
    for sets, ratio, percent in (((), "0.05", "5"),
                                 (("prometheusRule.mismatchedChecksPercent=20",), "0.2", "20")):
        r = alerts(rule(*sets))["KaiFractionsFollowerMismatches"][1]
        assert f"> {ratio}\nand on()" in r["expr"] or f"> {ratio} and on()" in r["expr"]
        assert r["annotations"]["summary"] == (
            f"The follower finds more than {percent} % of KAI's binds wrong.")
    expr = alerts(rule())["KaiFractionsFollowerMismatches"][1]["expr"]
    values = {(op, v) for _m, label, op, v in parse(expr).values if label == "result"}
    assert values == {("=~", "mismatch|invalid"), ("=~", "complete|mismatch|invalid|unsigned"),
                      ("=", "complete")}
    unsigned = alerts(rule("signing.enabled=false"))["KaiFractionsFollowerMismatches"][1]
    assert "not signed" not in unsigned["annotations"]["description"]


def test_the_two_thresholds_are_values_and_the_summaries_follow_them() -> None:
    default = alerts(rule())
    tuned = alerts(rule("prometheusRule.failingCallsPercent=2",
                        "prometheusRule.signatureDelaySeconds=120"))
    for found, ratio, percent, seconds in ((default, "0.05", "5", "300"),
                                           (tuned, "0.02", "2", "120")):
        calls, delay = (found[name][1] for name in ("KaiFractionsMirrorCallsFailing",
                                                    "KaiFractionsSignatureDelayHigh"))
        assert calls["expr"].endswith(f"> {ratio}")
        assert calls["annotations"]["summary"] == (
            f"The mirror fails more than {percent} % of its calls.")
        assert delay["expr"].endswith(f"> {seconds}")
        assert delay["annotations"]["summary"] == (
            f"Fractional pods wait more than {seconds} s for their signature.")


@pytest.mark.parametrize(("value", "message"), [
    ("prometheusRule.failingCallsPercent=0", "minimum: got 0, want 1"),
    ("prometheusRule.failingCallsPercent=101", "maximum: got 101, want 100"),
    ("prometheusRule.signatureDelaySeconds=0", "minimum: got 0, want 1"),
    ("prometheusRule.signatureDelaySeconds=soon", "got string, want integer"),
    ("prometheusRule.mismatchedChecksPercent=0", "minimum: got 0, want 1"),
    ("prometheusRule.mismatchedChecksPercent=100", "maximum: got 100, want 99"),
])
def test_the_schema_refuses_a_threshold_out_of_range(value: str, message: str) -> None:
    err = template_error(value)
    assert f"/prometheusRule/{value.split('.')[1].split('=')[0]}" in err
    assert message in err


# -- against the real processes -------------------------------------------------------------


@pytest.mark.integration
def test_every_node_agent_alert_names_only_what_a_live_agent_exports(
        agent_env: AgentEnv) -> None:
    text, _uids, run = populated_scrape(agent_env)
    run.stop()
    labels_of = exported(text)
    assert "gpu_fractioning_gpu_memory_used_bytes" in labels_of  # the scrape is the agent's
    # `up` is Prometheus's own series of each target, never in a /metrics
    assert "up" not in labels_of
    labels_of["up"] = set(UP_LABELS)
    # and ALERTS is Prometheus's own series of the alerts that fire, with the alert's labels
    assert "ALERTS" not in labels_of
    refused = alerts(rule())["KaiFractionsContainerRefused"][1]
    labels_of["ALERTS"] = {"alertname", "alertstate", *refused["labels"],
                           *(kept_by_aggregation(refused["expr"]) or ())}
    # A series of kai_fractions_container_cap_not_in_force is there only while a cap is
    # known not in force (an MPS daemon that lost it and does not take it again), which the real
    # nvidia-cuda-mps-control here cannot be made to do: the live agent exports the family (its
    # HELP and TYPE), and its labels are those the agent's code gives such a series.
    assert CAP_NOT_IN_FORCE in labels_of
    labels_of[CAP_NOT_IN_FORCE] |= cap_not_in_force_labels()
    exprs = alert_exprs(AGENT_GROUP, rule())
    assert len(exprs) == 14
    assert problems(exprs, labels_of, "agent", AGENT_TARGET_LABELS) == []
    # a misspelt metric, a label the family lacks, a target label the agent's workload labels
    # would shadow: each is reported
    bad = [Expr(AGENT_GROUP, "typo", "kai_fractions_node_redy == 0", ""),
           Expr(AGENT_GROUP, "label", "sum by (gpu) (rate(kai_fractions_reconcile_errors_total"
                "[10m])) > 0", ""),
           Expr(AGENT_GROUP, "target", "increase(kai_fractions_mps_daemon_restarts_total[30m])"
                " > 3", "{{instance}} {{pod}}")]
    assert problems(bad, labels_of, "agent", AGENT_TARGET_LABELS) == [
        "typo: the agent exports no kai_fractions_node_redy",
        "label: groups by gpu, which none of ['kai_fractions_reconcile_errors_total'] has",
        "target: the legend names instance, which no metric has",
        "target: the legend names pod, which no metric has"]


@pytest.mark.integration
def test_every_mirror_alert_names_only_what_a_live_mirror_exports(
        kube: KubeServer, tmp_path: Path) -> None:
    labels_of = exported(populated_mirror_scrape(kube, tmp_path))
    assert "kai_fractions_mirror_calls_total" in labels_of  # the scrape is the mirror's
    assert set().union(*labels_of.values()) & TARGET_LABELS == set()
    # `up` is Prometheus's own series of each target (the mirror's target labels, no node)
    assert "up" not in labels_of
    labels_of["up"] = set(TARGET_LABELS)
    # The live mirror holds no node silent (that takes an agent silent for 120 s or more): it
    # exports the family, and its labels are those the mirror's code gives a node it marks.
    assert SILENT_NODE in labels_of and labels_of[SILENT_NODE] == set()
    labels_of[SILENT_NODE] |= silent_node_labels()
    exprs = alert_exprs(MIRROR_GROUP, rule())
    assert len(exprs) == 10
    grpc_mode = alert_exprs(MIRROR_GROUP, rule("mirror.followBindRequests=false"))
    assert len(grpc_mode) == 4
    assert problems(exprs + grpc_mode, labels_of, "mirror", TARGET_LABELS) == []
    # a misspelt metric in a real alert's expression fails the check
    (failing,) = [e for e in exprs if e.where == "alert KaiFractionsMirrorCallsFailing"]
    typo = failing._replace(expr=failing.expr.replace("mirror_calls_total[",
                                                      "mirror_call_total["))
    assert typo.expr != failing.expr
    assert problems([typo], labels_of, "mirror", TARGET_LABELS) == [
        "alert KaiFractionsMirrorCallsFailing: the mirror exports no "
        "kai_fractions_mirror_call_total"]
    assert problems([Expr(MIRROR_GROUP, "node", "kai_fractions_follower_leading", "{{node}}")],
                    labels_of, "mirror", TARGET_LABELS) == [
        "node: the legend names node, which no metric has"]


@pytest.mark.integration
def test_every_admission_alert_names_only_what_a_live_admission_server_exports(
        tmp_path: Path) -> None:
    """Against the /metrics of a real `kai-fractions admission --metrics-listen` after a review
    of each outcome and refusals, with the target labels Prometheus adds (its ServiceMonitor has
    no honorLabels, and the server exports none of those names)."""
    install(tmp_path, *make_cert("webhook-alerts"))
    text, _draining = populated_admission_scrape(tmp_path)
    labels_of = exported(text)
    assert "kai_fractions_admission_reviews_total" in labels_of  # the scrape is the server's
    assert "kai_fractions_mirror_calls_total" not in labels_of
    assert set().union(*labels_of.values()) & TARGET_LABELS == set()
    assert "up" not in labels_of
    labels_of["up"] = set(TARGET_LABELS)
    exprs = alert_exprs(ADMISSION_GROUP, rule())
    assert len(exprs) == 4
    assert problems(exprs, labels_of, "admission server", TARGET_LABELS) == []
    # a misspelt metric, a label of another family: each is reported
    assert problems([
        Expr(ADMISSION_GROUP, "typo", "sum(rate(kai_fractions_admission_review_total[5m])) > 0",
             ""),
        Expr(ADMISSION_GROUP, "label", 'kai_fractions_admission_requests_refused_total'
             '{outcome="error"}', "{{node}}"),
    ], labels_of, "admission server", TARGET_LABELS) == [
        "typo: the admission server exports no kai_fractions_admission_review_total",
        "label: kai_fractions_admission_requests_refused_total has no label outcome",
        "label: the legend names node, which no metric has"]


def catches(expr: str, metric: str, label: str, value: str) -> bool:
    """Whether `expr` reads a series of `metric` whose `label` is `value`: it names the metric
    and each of its matchers on that label matches (PromQL's regexes are anchored)."""
    q = parse(expr)
    if metric not in q.metrics:
        return False
    ops = {"=": lambda v: value == v, "!=": lambda v: value != v,
           "=~": lambda v: re.fullmatch(v, value) is not None,
           "!~": lambda v: re.fullmatch(v, value) is None}
    return all(ops[op](v) for m, name, op, v in q.values if m == metric and name == label)


def test_every_reason_a_cap_is_not_in_force_is_named_by_the_alert_that_catches_it() -> None:
    """kai_fractions_container_cap_not_in_force carries every reason of NOT_IN_FORCE_REASONS
    (the agent's own set): each is caught by exactly one alert, whose description names it, so
    its remedy is there (a reason added to the agent and missed here fails: ComputeModeNotInForce
    was caught by KaiFractionsMpsCapNotInForce, which sent the operator to the MPS logs)."""
    assert CAP_NOT_IN_FORCE_REASONS < NOT_IN_FORCE_REASONS
    assert "ComputeModeNotInForce" in NOT_IN_FORCE_REASONS
    found = alerts(rule())
    for reason in sorted(NOT_IN_FORCE_REASONS):
        catching = [name for name, (_g, r) in found.items()
                    if catches(r["expr"], CAP_NOT_IN_FORCE, "reason", reason)]
        assert len(catching) == 1, (reason, catching)
        description = found[catching[0]][1]["annotations"]["description"]
        assert re.search(rf"\b{reason}\b", description), (reason, catching[0])
    mps = found["KaiFractionsMpsCapNotInForce"][1]["annotations"]["description"]
    assert "EXCLUSIVE_PROCESS" in mps and "nvidia-smi -i <GPU uuid> -c EXCLUSIVE_PROCESS" in mps
    assert catches('m{reason!~"A|B"}', "m", "reason", "C")
    assert not catches('m{reason!~"A|B"}', "m", "reason", "A")
    assert not catches('m{reason=~"A"}', "m", "reason", "AB")
    assert not catches("n", "m", "reason", "A")


def test_the_node_not_ready_alert_is_by_node_whatever_its_reason() -> None:
    """The reason of kai_fractions_node_ready is a label: an alert on each series would start
    its `for` over whenever the reason changes while the node stays not ready (promtool's
    cases run it); so it is by node, and its annotations name no reason."""
    r = alerts(rule())["KaiFractionsNodeNotReady"][1]
    assert r["expr"] == "max by (node) (kai_fractions_node_ready) == 0"
    assert annotation_labels(r) == {"node"}
    assert "kubectl describe node" in r["annotations"]["description"]


def test_the_per_node_alerts_fire_only_for_what_the_per_container_ones_miss() -> None:
    """A pod that fails within seconds takes its own series with it (docs/node-agent.md,
    "Events and metrics"): its refusal or violation shows only in the per-node counters. While
    a per-container alert covers the node, the per-node one stays quiet: one alert, not two."""
    found = alerts(rule())
    refused = found["KaiFractionsNodeRefusedGonePods"][1]["expr"]
    assert "increase(kai_fractions_node_container_refusals_total[10m])" in refused
    assert "unless on (node, reason) (max by (node, reason) (kai_fractions_container_refused)" \
        in refused
    over = found["KaiFractionsNodeGpuMemoryLimitViolations"][1]["expr"]
    assert "increase(kai_fractions_node_gpu_memory_limit_violations_total[10m])" in over
    assert ("unless on (node) (sum by (node) (increase("
            "kai_fractions_container_gpu_memory_limit_violations_total[10m]))") in over


def test_the_waits_every_bound_pod_goes_through_are_no_reconcile_error_alert():
    """A busy cluster's pods each wait a moment for their signature and their bind: counted as
    reconcile errors, they would keep the alert firing for ever (the follower's alerts cover a
    signature that never comes)."""
    _, r = alerts(rule())["KaiFractionsReconcileErrors"]
    assert 'reason!~"SignatureMissing|NotBound"' in r["expr"]
    _, failing = alerts(rule())["KaiFractionsFollowerFailing"]
    assert 'result="complete"' in failing["expr"] and "unless on()" in failing["expr"]
