"""The alerting rules (charts/kai-fractions/templates/prometheusrule.yaml) run in a real Prometheus
rule engine: the real `promtool` (Prometheus 2.42) checks the rendered groups for several value
sets (`promtool check rules`) and unit-tests every alert of the default rendering against series
shaped as Prometheus stores them (`promtool test rules`): each alert fires on a case it is meant
for, with the labels and the rendered annotations expected, and stays quiet on a case it is not
meant for (below its threshold, before its `for`, an excluded reason, a per-node alert whose node
a per-container alert covers). tests/chart/test_alerts.py checks the names an expression uses
against a live mirror's, node agent's and admission server's /metrics; this file checks what the
expressions DO.

The series carry the labels the chart's ServiceMonitors give them: a mirror's and an admission
server's the Prometheus Operator's target labels (job, instance, namespace, service, endpoint,
pod = the replica, container); a node agent's its own labels first (honorLabels: a
per-container series keeps the workload's namespace/pod/container), then the target's, and every
one of them (and `up`) the `node` the ServiceMonitor's relabeling adds.

All the cases run in one promtool call (one test group each, named after the case, so promtool's
report names the failing one); a mutated rule shows that a broken expression fails its cases."""

from __future__ import annotations

import copy
import json
import re
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from kai_fractions.mirror.metrics import SIGNATURE_BUCKETS
from tests.chart.render import NAMESPACE, one, render

RULE = "kai-fractions"
ON = ("prometheusRule.enabled=true",)
VALUE_SETS = {
    "default": (),
    "watchdog-kill": ("watchdog.policy=kill",),
    "no-follower": ("mirror.followBindRequests=false",),
    "no-mirror": ("mirror.enabled=false", "gpuFractioningConfig.enabled=false",
                  "signing.enabled=false"),
    "no-silent-node-marking": ("mirror.markSilentNodesAfterSeconds=0",),
    "webhooks-fail-open": ("webhook.failurePolicy=Ignore", "webhook.guardFailurePolicy=Ignore"),
}
CRITICAL = {"KaiFractionsFollowerNoLeader", "KaiFractionsMirrorDown", "KaiFractionsAdmissionDown"}
"""Every other alert is a warning."""

# -- series as Prometheus stores them --------------------------------------------------------

MIRROR_JOB = "kai-fractions-mirror-metrics"  # the Operator's job label: the Service's name
AGENT_JOB = "kai-fractions-node-agent-metrics"
ADMISSION_JOB = "kai-fractions-admission-metrics"
ADMISSION_A = "kai-fractions-admission-7c9f5d6b4-h8w2n"
ADMISSION_B = "kai-fractions-admission-7c9f5d6b4-r5t9k"
ADMISSION_IPS = {ADMISSION_A: "10.244.1.21", ADMISSION_B: "10.244.2.14"}
MIRROR_A = "kai-fractions-mirror-6f7d9c8b5-x2k4p"
MIRROR_B = "kai-fractions-mirror-6f7d9c8b5-q7m3z"
MIRROR_IPS = {MIRROR_A: "10.244.1.17", MIRROR_B: "10.244.2.9"}
NODE_1, NODE_2 = "gpu-node-1", "gpu-node-2"
AGENT_PODS = {NODE_1: "kai-fractions-node-agent-9xk2c", NODE_2: "kai-fractions-node-agent-b4r7t"}
AGENT_IPS = {NODE_1: "10.244.1.5", NODE_2: "10.244.2.6"}
WORKLOAD = {"namespace": "team-a", "pod": "train-0", "container": "trainer",
            "pod_uuid": "6b0f7d6e-3a1c-4f0e-9d57-2c8e1b4a9f10"}
GPU = {"gpu_uuid": "GPU-8c3e6f2a-1b4d-4e5f-9a7b-0c1d2e3f4a5b", "gpu": "0"}


@dataclass(frozen=True)
class Series:
    metric: str
    labels: Mapping[str, str]
    values: str
    """promtool's expanding notation, one sample a minute: `0+6x30`, `0x5 1x20`."""

    def selector(self) -> str:
        pairs = ",".join(f"{k}={json.dumps(v)}" for k, v in sorted(self.labels.items()))
        return f"{self.metric}{{{pairs}}}"


def mirror_target(pod: str) -> dict[str, str]:
    return {"job": MIRROR_JOB, "instance": f"{MIRROR_IPS[pod]}:9401", "namespace": NAMESPACE,
            "service": MIRROR_JOB, "endpoint": "metrics", "pod": pod, "container": "mirror"}


def admission_target(pod: str) -> dict[str, str]:
    return {"job": ADMISSION_JOB, "instance": f"{ADMISSION_IPS[pod]}:9402",
            "namespace": NAMESPACE, "service": ADMISSION_JOB, "endpoint": "metrics", "pod": pod,
            "container": "admission"}


def agent_target(node: str) -> dict[str, str]:
    return {"job": AGENT_JOB, "instance": f"{AGENT_IPS[node]}:9400", "namespace": NAMESPACE,
            "service": AGENT_JOB, "endpoint": "metrics", "pod": AGENT_PODS[node],
            "container": "node-agent", "node": node}


def mirror(metric: str, values: str, pod: str = MIRROR_A, **own: str) -> Series:
    return Series(metric, {**mirror_target(pod), **own}, values)


def admission(metric: str, values: str, pod: str = ADMISSION_A, **own: str) -> Series:
    return Series(metric, {**admission_target(pod), **own}, values)


def agent(metric: str, values: str, on: str = NODE_1, **own: str) -> Series:
    """honorLabels: the series' own labels win over the target's."""
    return Series(metric, {**agent_target(on), **own}, values)


def per_container(metric: str, values: str, on: str = NODE_1, **own: str) -> Series:
    """A series of the workload's container: its namespace/pod/container, not the agent's."""
    return agent(metric, values, on, **WORKLOAD, **own)


def up(target: Mapping[str, str], values: str) -> Series:
    return Series("up", target, values)


def signature_delays(worst: float, per_minute: int = 10, minutes: int = 40) -> list[Series]:
    """The follower's histogram when every signature took between the bucket below `worst` and
    `worst` seconds (le as prometheus_client writes it)."""
    def le(bound: float) -> str:
        return "+Inf" if bound == float("inf") else repr(float(bound))
    return [mirror("kai_fractions_follower_signature_delay_seconds_bucket",
                   f"0+{per_minute}x{minutes}" if bound >= worst else f"0x{minutes}", le=le(bound))
            for bound in (*SIGNATURE_BUCKETS, float("inf"))]


# -- the cases -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    alert: str
    why: str
    series: tuple[Series, ...]
    at: str
    """eval_time."""
    fires: tuple[Mapping[str, str] | Series, ...] = ()
    """Each alert expected at `at`: its labels (severity and alertname aside), or the series
    whose labels it keeps whole (no aggregation). Empty: it must not fire."""
    value: str | None = None
    """What `{{ $value ... }}` renders to in its annotations, where they name it."""

    @property
    def name(self) -> str:
        return f"{self.alert}: {self.why}"


def case(alert: str, why: str, *series: Series | Iterable[Series], at: str,
         fires: Iterable[Mapping[str, str] | Series] = (), value: str | None = None) -> Case:
    flat = tuple(s for item in series for s in ([item] if isinstance(item, Series) else item))
    return Case(alert, why, flat, at, tuple(fires), value)


CALLS = "kai_fractions_mirror_calls_total"
CALLS_OK = mirror(CALLS, "0+100x30", method="MirrorAllocation", code="OK")
API = "kai_fractions_mirror_api_requests_total"
CHECKS = "kai_fractions_follower_checks_total"
SILENT = "kai_fractions_follower_silent_nodes_total"
HELD_SILENT = "kai_fractions_follower_node_silent"
AGENT_DOWN = up(agent_target(NODE_1), "0x10")
NOT_READY = agent("kai_fractions_node_ready", "0x20", node=NODE_1, reason="NVMLUnavailable")
PATCHES = "kai_fractions_agent_api_requests_total"
VIOLATIONS = "kai_fractions_container_gpu_memory_limit_violations_total"
VIOLATED = per_container(VIOLATIONS, "0x5 1x20", **GPU)
NODE_VIOLATIONS = "kai_fractions_node_gpu_memory_limit_violations_total"
NODE_VIOLATED = agent(NODE_VIOLATIONS, "0x5 1x20", node=NODE_1)
REFUSED = "kai_fractions_container_refused"
CAP = "kai_fractions_container_cap_not_in_force"
CAP_MISSING = {"node": NODE_1, "namespace": "team-a", "pod": "train-0", "container": "trainer"}
REFUSALS = "kai_fractions_node_container_refusals_total"
ERRORS = "kai_fractions_reconcile_errors_total"
MPS_RESTARTED = agent("kai_fractions_mps_daemon_restarts_total", "0+1x40")
DRAINS = "kai_fractions_agent_mps_drains_total"
DRAIN_FAILED = agent(DRAINS, "0x5 1x20", result="failed")
STOPS_FAILED = "kai_fractions_node_gpu_memory_limit_stops_failed_total"
STOP_FAILED = agent(STOPS_FAILED, "0x5 1x20", node=NODE_1, step="terminate")
REFUSED_REQUESTS = "kai_fractions_admission_requests_refused_total"
BACKLOGGED = "kai_fractions_admission_connections_backlogged_total"
REVIEWS = "kai_fractions_admission_reviews_total"
BLIND = agent("kai_fractions_agent_gpu_usage_unreadable_total", "6+6x40", node=NODE_1,
              gpu_uuid=GPU["gpu_uuid"], reason="NoProcessesVisible")

CASES = (
    # -- the mirror --------------------------------------------------------------------------
    case("KaiFractionsMirrorReplicaDown", "a replica's target is down",
         up(mirror_target(MIRROR_A), "0x15"), up(mirror_target(MIRROR_B), "1x15"),
         at="12m", fires=[up(mirror_target(MIRROR_A), "")]),
    case("KaiFractionsMirrorReplicaDown", "down for less than its for (a restart)",
         up(mirror_target(MIRROR_A), "1x5 0x8 1x5"), at="13m"),
    case("KaiFractionsMirrorReplicaDown", "an admission replica down is not a mirror's",
         up(admission_target(ADMISSION_A), "0x15"), at="12m"),
    # (gRPC mode only: tested against the no-follower rendering)
    case("KaiFractionsMirrorDown", "every replica unscrapeable",
         up(mirror_target(MIRROR_A), "0x10"), up(mirror_target(MIRROR_B), "0x10"),
         at="7m", fires=[{}]),
    case("KaiFractionsMirrorDown", "no target at all (or vector(0))",
         up(agent_target(NODE_1), "1x10"), at="7m", fires=[{}]),
    case("KaiFractionsMirrorDown", "one replica up",
         up(mirror_target(MIRROR_A), "0x10"), up(mirror_target(MIRROR_B), "1x10"), at="7m"),
    case("KaiFractionsMirrorDown", "none up for less than its for (both restarted)",
         up(mirror_target(MIRROR_A), "1x3 0x3 1x5"), up(mirror_target(MIRROR_B), "1x3 0x3 1x5"),
         at="6m"),
    case("KaiFractionsFollowerNoLeader", "both replicas follow no one",
         mirror("kai_fractions_follower_leading", "0x10"),
         mirror("kai_fractions_follower_leading", "0x10", MIRROR_B), at="5m", fires=[{}]),
    case("KaiFractionsFollowerNoLeader", "no replica scraped at all (or vector(0))",
         up(mirror_target(MIRROR_A), "0x10"), at="5m", fires=[{}]),
    case("KaiFractionsFollowerNoLeader", "one replica leads",
         mirror("kai_fractions_follower_leading", "1x10"),
         mirror("kai_fractions_follower_leading", "0x10", MIRROR_B), at="5m"),
    case("KaiFractionsFollowerNoLeader", "a handover shorter than its for",
         mirror("kai_fractions_follower_leading", "1x4 0 1x5"),
         mirror("kai_fractions_follower_leading", "0x10", MIRROR_B), at="6m"),
    case("KaiFractionsFollowerSeveralLeaders", "both replicas lead",
         mirror("kai_fractions_follower_leading", "1x10"),
         mirror("kai_fractions_follower_leading", "1x10", MIRROR_B), at="10m", fires=[{}],
         value="2"),
    case("KaiFractionsFollowerSeveralLeaders", "both lead for less than its for",
         mirror("kai_fractions_follower_leading", "1x10"),
         mirror("kai_fractions_follower_leading", "0x5 1x5", MIRROR_B), at="9m"),
    case("KaiFractionsMirrorCallsFailing", "9 % of the calls UNAVAILABLE",
         CALLS_OK, mirror(CALLS, "0+10x30", method="MirrorAllocation", code="UNAVAILABLE"),
         at="15m", fires=[{}], value="9.091%"),
    case("KaiFractionsMirrorCallsFailing", "4.8 % of the calls INTERNAL, below 5 %",
         CALLS_OK, mirror(CALLS, "0+5x30", method="MirrorAllocation", code="INTERNAL"),
         at="15m"),
    case("KaiFractionsMirrorCallsFailing", "NOT_FOUND is an answer, not a failure",
         CALLS_OK, mirror(CALLS, "0+50x30", method="ReleaseAllocation", code="NOT_FOUND"),
         at="15m"),
    case("KaiFractionsMirrorApiUnreachable", "one replica's requests end unreachable",
         mirror(API, "0+6x30", verb="GET", code="unreachable"),
         mirror(API, "0+60x30", MIRROR_B, verb="GET", code="200"),
         at="10m", fires=[{"pod": MIRROR_A}], value="0.1"),
    case("KaiFractionsMirrorApiUnreachable", "unreachable no more for 10 minutes",
         mirror(API, "0+6x5 30x30", verb="GET", code="unreachable"), at="15m"),
    case("KaiFractionsSignatureDelayHigh", "every signature took 10 to 30 minutes",
         signature_delays(1800), at="20m", fires=[{}], value="29m 48s"),
    case("KaiFractionsSignatureDelayHigh", "p99 just below 300 s",
         signature_delays(300), at="20m"),
    case("KaiFractionsFollowerFailing", "errors and nothing complete",
         mirror(CHECKS, "0+5x30", result="error"),
         mirror(CHECKS, "0x30", result="complete"), at="15m", fires=[{}], value="0.0833"),
    case("KaiFractionsFollowerFailing", "errors, but others complete",
         mirror(CHECKS, "0+5x30", result="error"),
         mirror(CHECKS, "0+1x30", result="complete"), at="15m"),
    case("KaiFractionsFollowerFailing", "nothing but skipped and unchanged",
         mirror(CHECKS, "0+5x30", result="skipped"),
         mirror(CHECKS, "0+5x30", result="unchanged"), at="15m"),
    case("KaiFractionsFollowerMismatches", "a fifth of the verdicts (skips and replays aside)",
         mirror(CHECKS, "0+1x50", result="mismatch"), mirror(CHECKS, "0+1x50", result="invalid"),
         mirror(CHECKS, "0+8x50", result="complete"),
         mirror(CHECKS, "0+100x50", result="skipped"),
         mirror(CHECKS, "0+100x50", result="unchanged"),
         at="35m", fires=[{}], value="20%"),
    case("KaiFractionsFollowerMismatches", "2 % of the verdicts",
         mirror(CHECKS, "0+1x50", result="mismatch"), mirror(CHECKS, "0+49x50", result="complete"),
         at="35m"),
    case("KaiFractionsFollowerMismatches", "for less than its for",
         mirror(CHECKS, "0x10 0+1x40", result="mismatch"),
         mirror(CHECKS, "0+4x50", result="complete"), at="25m"),
    case("KaiFractionsFollowerMismatches", "none complete: KaiFractionsFollowerFailing's",
         mirror(CHECKS, "0+5x50", result="mismatch"), mirror(CHECKS, "0x50", result="complete"),
         at="35m"),
    case("KaiFractionsNodeAgentSilent", "the leader holds a node silent",
         mirror(SILENT, "0x5 1x60"), mirror(HELD_SILENT, "_x5 1x60", node=NODE_1),
         mirror(SILENT, "0x65", MIRROR_B), at="10m", fires=[{"node": NODE_1}]),
    case("KaiFractionsNodeAgentSilent", "still silent an hour on: the marks stopped, it did not",
         mirror(SILENT, "0x5 1x60"), mirror(HELD_SILENT, "_x5 1x60", node=NODE_1),
         at="65m", fires=[{"node": NODE_1}]),
    case("KaiFractionsNodeAgentSilent", "held for less than its for",
         mirror(SILENT, "0x5 1x60"), mirror(HELD_SILENT, "_x5 1x60", node=NODE_1), at="6m"),
    case("KaiFractionsNodeAgentSilent", "its agent back: the series went",
         mirror(SILENT, "0x5 1x60"), mirror(HELD_SILENT, "_x5 1x20 stale", node=NODE_1),
         mirror(HELD_SILENT, "_x5 1x60", node=NODE_2), at="40m", fires=[{"node": NODE_2}]),
    case("KaiFractionsNodeAgentSilent", "a handover: the new leader holds it, one episode",
         mirror(HELD_SILENT, "_x5 1x5 stale", node=NODE_1),
         mirror(HELD_SILENT, "_x10 1x20", MIRROR_B, node=NODE_1), at="12m",
         fires=[{"node": NODE_1}]),
    case("KaiFractionsNodeAgentSilent", "a mark counted, no node held any more",
         mirror(SILENT, "0x5 1x30"), at="10m"),
    case("KaiFractionsFollowerNodeChecksFailing", "the checks keep failing",
         mirror("kai_fractions_follower_node_checks_failed_total", "0+1x40"),
         at="20m", fires=[{}]),
    case("KaiFractionsFollowerNodeChecksFailing", "failing for less than its for",
         mirror("kai_fractions_follower_node_checks_failed_total", "0+1x40"), at="12m"),
    # -- the node agents ---------------------------------------------------------------------
    case("KaiFractionsNodeAgentDown", "the agent's target is down",
         AGENT_DOWN, up(agent_target(NODE_2), "1x10"), at="10m", fires=[AGENT_DOWN]),
    case("KaiFractionsNodeAgentDown", "down for less than its for",
         up(agent_target(NODE_1), "1x5 0x3 1x5"), at="9m"),
    case("KaiFractionsNodeAgentDown", "a mirror replica down is not an agent",
         up(mirror_target(MIRROR_A), "0x10"), at="10m"),
    case("KaiFractionsNodeNotReady", "not ready for 15 minutes",
         NOT_READY, agent("kai_fractions_node_ready", "1x20", NODE_2, node=NODE_2,
                          reason="AgentReady"), at="15m", fires=[{"node": NODE_1}]),
    # The reviewer's probe: a hung MPS daemon, NotReconciling while a pass hangs on it,
    # MPSDaemonUnhealthy once it returns, in turn every 5 minutes (a reason is a label: each
    # change is a new series, the old one marked stale at once).
    case("KaiFractionsNodeNotReady", "not ready for 35 minutes, its reason alternating",
         agent("kai_fractions_node_ready", "0x4 stale _x4 0x4 stale _x4 0x4 stale _x4 0x4",
               node=NODE_1, reason="NotReconciling"),
         agent("kai_fractions_node_ready", "_x5 0x4 stale _x4 0x4 stale _x4 0x4 stale _x4",
               node=NODE_1, reason="MPSDaemonUnhealthy"),
         at="34m", fires=[{"node": NODE_1}]),
    case("KaiFractionsNodeNotReady", "not ready across a replaced agent pod: one episode",
         agent("kai_fractions_node_ready", "0x7 stale", node=NODE_1, reason="NotReconciling"),
         Series("kai_fractions_node_ready",
                {**agent_target(NODE_1), "pod": "kai-fractions-node-agent-z8q4w",
                 "instance": "10.244.1.8:9400", "node": NODE_1, "reason": "NotReconciling"},
                "_x8 0x10"),
         at="12m", fires=[{"node": NODE_1}]),
    case("KaiFractionsNodeNotReady", "not ready for less than its for",
         agent("kai_fractions_node_ready", "1x10 0x10", node=NODE_1, reason="NVMLUnavailable"),
         at="15m"),
    case("KaiFractionsNodeNotReady", "reasons in turn, ready in between",
         agent("kai_fractions_node_ready", "0x6 stale _x13 0x6", node=NODE_1,
               reason="NotReconciling"),
         agent("kai_fractions_node_ready", "_x7 1x13 stale _x5", node=NODE_1,
               reason="AgentReady"),
         at="26m"),
    case("KaiFractionsNodeAgentWritesRefused", "its PATCHes refused",
         agent(PATCHES, "3+2x30", node=NODE_1, verb="PATCH", code="403"),
         agent(PATCHES, "0+20x30", node=NODE_1, verb="PATCH", code="200"),
         at="15m", fires=[{"node": NODE_1}], value="0.0333"),
    case("KaiFractionsNodeAgentWritesRefused", "its PATCHes unanswered",
         agent(PATCHES, "1+1x30", on=NODE_2, node=NODE_2, verb="PATCH", code="unreachable"),
         at="15m", fires=[{"node": NODE_2}], value="0.0167"),
    case("KaiFractionsNodeAgentWritesRefused", "conflicts, pods deleted before their patch, a "
         "refused GET",
         agent(PATCHES, "1+2x30", node=NODE_1, verb="PATCH", code="409"),
         agent(PATCHES, "1+2x30", node=NODE_1, verb="PATCH", code="404"),
         agent(PATCHES, "1+2x30", node=NODE_1, verb="GET", code="403"), at="15m"),
    case("KaiFractionsGpuMemoryLimitViolation", "a container went over its cap",
         VIOLATED, at="10m", fires=[VIOLATED]),
    case("KaiFractionsGpuMemoryLimitViolation", "no episode in 10 minutes",
         VIOLATED, per_container(VIOLATIONS, "0x25", **{**GPU, "gpu": "1"}), at="20m"),
    case("KaiFractionsNodeGpuMemoryLimitViolations", "its pod went before a scrape saw it",
         NODE_VIOLATED, agent(NODE_VIOLATIONS, "0x25", NODE_2, node=NODE_2),
         at="10m", fires=[NODE_VIOLATED], value="1"),
    case("KaiFractionsNodeGpuMemoryLimitViolations", "another node's container does not cover it",
         NODE_VIOLATED, agent(NODE_VIOLATIONS, "0x5 1x20", NODE_2, node=NODE_2),
         per_container(VIOLATIONS, "0x5 1x20", NODE_2, node=NODE_2, **GPU),
         at="10m", fires=[NODE_VIOLATED], value="1"),
    case("KaiFractionsNodeGpuMemoryLimitViolations", "the per-container alert covers it",
         NODE_VIOLATED, VIOLATED, at="10m"),
    case("KaiFractionsContainerRefused", "refused for 10 minutes",
         per_container(REFUSED, "1x20", node=NODE_1, reason="MemoryOvercommitted"),
         at="10m", fires=[{"node": NODE_1, "namespace": "team-a", "pod": "train-0",
                 "container": "trainer", "reason": "MemoryOvercommitted"}]),
    case("KaiFractionsContainerRefused", "refused for less than its for",
         per_container(REFUSED, "1x20", node=NODE_1, reason="MemoryOvercommitted"), at="4m"),
    case("KaiFractionsMpsCapNotInForce", "a cap not in force for 3 minutes",
         per_container(CAP, "1x10", node=NODE_1, reason="NamespaceCapNotSet"),
         at="3m", fires=[CAP_MISSING]),
    case("KaiFractionsMpsCapNotInForce", "its reason changed: one episode, its for not over",
         per_container(CAP, "1x1 stale", node=NODE_1, reason="NamespaceCapNotSet"),
         per_container(CAP, "_x1 1x10", node=NODE_1, reason="NamespaceCapUnverified"),
         at="3m", fires=[CAP_MISSING]),
    case("KaiFractionsMpsCapNotInForce", "not in force for less than its for",
         per_container(CAP, "1x10", node=NODE_1, reason="MpsPinnedLimitLost"), at="1m"),
    case("KaiFractionsMpsCapNotInForce", "back in force (applied again): the series went",
         per_container(CAP, "1x2 stale", node=NODE_1, reason="NamespaceCapNotSet"), at="6m"),
    case("KaiFractionsMpsCapNotInForce", "its GPU's compute mode is not EXCLUSIVE_PROCESS",
         per_container(CAP, "1x10", node=NODE_1, reason="ComputeModeNotInForce"),
         at="3m", fires=[CAP_MISSING]),
    case("KaiFractionsMpsCapNotInForce", "a pod cgroup's memory limit is not its",
         per_container(CAP, "1x10", node=NODE_1, reason="MemoryLimitNotInForce"), at="3m"),
    case("KaiFractionsMemoryLimitNotInForce", "the limit not in force for 3 minutes",
         per_container(CAP, "1x10", node=NODE_1, reason="MemoryLimitNotInForce"),
         at="3m", fires=[CAP_MISSING]),
    case("KaiFractionsMemoryLimitNotInForce", "an MPS cap is not its",
         per_container(CAP, "1x10", node=NODE_1, reason="NamespaceCapNotSet"), at="3m"),
    case("KaiFractionsMemoryLimitNotInForce", "not in force for less than its for",
         per_container(CAP, "1x10", node=NODE_1, reason="MemoryLimitNotInForce"), at="1m"),
    case("KaiFractionsNodeRefusedGonePods", "the refused pod is gone",
         agent(REFUSALS, "0x5 1x20", node=NODE_1, reason="DeviceNotOnNode"),
         agent(REFUSALS, "0x25", node=NODE_1, reason="MemoryOvercommitted"),
         at="10m", fires=[{"node": NODE_1, "reason": "DeviceNotOnNode"}], value="1"),
    case("KaiFractionsNodeRefusedGonePods", "a refusal of another reason does not cover it",
         agent(REFUSALS, "0x5 1x20", node=NODE_1, reason="DeviceNotOnNode"),
         per_container(REFUSED, "_x5 1x20", node=NODE_1, reason="MemoryOvercommitted"),
         at="10m", fires=[{"node": NODE_1, "reason": "DeviceNotOnNode"}], value="1"),
    case("KaiFractionsNodeRefusedGonePods", "a container refused now: its own alert is coming",
         agent(REFUSALS, "0x5 1x20", node=NODE_1, reason="DeviceNotOnNode"),
         per_container(REFUSED, "_x5 1x20", node=NODE_1, reason="DeviceNotOnNode"), at="8m"),
    case("KaiFractionsNodeRefusedGonePods", "the per-container alert fired, then its pod went",
         agent(REFUSALS, "0x5 1x20", node=NODE_1, reason="DeviceNotOnNode"),
         per_container(REFUSED, "_x5 1x7 stale", node=NODE_1, reason="DeviceNotOnNode"),
         at="14m"),
    case("KaiFractionsNodeRefusedGonePods", "refused for 3 minutes, then its pod went",
         agent(REFUSALS, "0x5 1x20", node=NODE_1, reason="DeviceNotOnNode"),
         per_container(REFUSED, "_x5 1x2 stale", node=NODE_1, reason="DeviceNotOnNode"),
         at="14m", fires=[{"node": NODE_1, "reason": "DeviceNotOnNode"}], value="1"),
    case("KaiFractionsReconcileErrors", "InternalError in every pass",
         agent(ERRORS, "1+1x40", reason="InternalError"),
         at="25m", fires=[{"node": NODE_1, "reason": "InternalError"}]),
    case("KaiFractionsReconcileErrors", "the waits for a signature and a bind",
         agent(ERRORS, "1+1x40", reason="SignatureMissing"),
         agent(ERRORS, "1+1x40", reason="NotBound"), at="25m"),
    case("KaiFractionsReconcileErrors", "errors that stopped 10 minutes ago",
         agent(ERRORS, "1+1x10 11x30", reason="InternalError"), at="25m"),
    case("KaiFractionsMpsDaemonRestarting", "a restart a minute",
         MPS_RESTARTED, at="30m", fires=[MPS_RESTARTED], value="30"),
    case("KaiFractionsMpsDaemonRestarting", "three restarts in 30 minutes",
         agent("kai_fractions_mps_daemon_restarts_total", "0x10 1x10 2x10 3x10"), at="35m"),
    case("KaiFractionsMpsDrainFailing", "a drain failed",
         DRAIN_FAILED, agent(DRAINS, "0+1x20", result="drained"),
         at="10m", fires=[DRAIN_FAILED], value="1"),
    case("KaiFractionsMpsDrainFailing", "drains that work",
         agent(DRAINS, "0x20", result="failed"), agent(DRAINS, "0+1x20", result="drained"),
         agent(DRAINS, "0+1x20", result="nothing"), at="10m"),
    case("KaiFractionsWatchdogBlind", "a GPU's processes invisible in every check",
         BLIND, at="20m", fires=[BLIND]),
    case("KaiFractionsWatchdogBlind", "one blind check",
         agent("kai_fractions_agent_gpu_usage_unreadable_total", "3x5 4x40", node=NODE_1,
               gpu_uuid=GPU["gpu_uuid"], reason="ProcessMemoryUnknown"), at="20m"),
    case("KaiFractionsWatchdogStopFailing", "a refused SIGTERM",
         STOP_FAILED, at="10m", fires=[STOP_FAILED], value="1"),
    case("KaiFractionsWatchdogStopFailing", "stops that proceed",
         agent(STOPS_FAILED, "0x20", node=NODE_1, step="drain"),
         agent(STOPS_FAILED, "0x20", node=NODE_1, step="terminate"), at="10m"),
    # -- the admission server ----------------------------------------------------------------
    case("KaiFractionsAdmissionReplicaDown", "a replica's target is down",
         up(admission_target(ADMISSION_B), "0x15"), up(admission_target(ADMISSION_A), "1x15"),
         at="12m", fires=[up(admission_target(ADMISSION_B), "")]),
    case("KaiFractionsAdmissionReplicaDown", "down for less than its for (a restart)",
         up(admission_target(ADMISSION_A), "1x5 0x8 1x5"), at="13m"),
    case("KaiFractionsAdmissionReplicaDown", "a mirror replica down is not an admission one",
         up(mirror_target(MIRROR_A), "0x15"), at="12m"),
    case("KaiFractionsAdmissionDown", "every replica unscrapeable",
         up(admission_target(ADMISSION_A), "0x10"), up(admission_target(ADMISSION_B), "0x10"),
         at="7m", fires=[{}]),
    case("KaiFractionsAdmissionDown", "no target at all (or vector(0))",
         up(agent_target(NODE_1), "1x10"), at="7m", fires=[{}]),
    case("KaiFractionsAdmissionDown", "one replica up",
         up(admission_target(ADMISSION_A), "0x10"), up(admission_target(ADMISSION_B), "1x10"),
         at="7m"),
    case("KaiFractionsAdmissionDown", "none up for less than its for (both restarted)",
         up(admission_target(ADMISSION_A), "1x3 0x3 1x5"),
         up(admission_target(ADMISSION_B), "1x3 0x3 1x5"), at="6m"),
    case("KaiFractionsAdmissionShedding", "a replica answers 503 for want of room",
         admission(REFUSED_REQUESTS, "0+3x30", reason="no_room"),
         admission(REFUSED_REQUESTS, "0x30", ADMISSION_B, reason="no_room"),
         at="20m", fires=[{"pod": ADMISSION_A}]),
    case("KaiFractionsAdmissionShedding", "new connections keep waiting in the backlog",
         admission(BACKLOGGED, "0+2x30", ADMISSION_B), at="20m", fires=[{"pod": ADMISSION_B}]),
    case("KaiFractionsAdmissionShedding", "a burst shed for less than its for",
         admission(REFUSED_REQUESTS, "0x5 40x30", reason="no_room"),
         admission(BACKLOGGED, "0x5 7x30"), at="20m"),
    case("KaiFractionsAdmissionShedding", "other refusals are no shedding",
         admission(REFUSED_REQUESTS, "0+3x30", reason="body_timeout"),
         admission(REFUSED_REQUESTS, "0+3x30", reason="malformed"), at="20m"),
    case("KaiFractionsAdmissionInternalErrors", "a review raised",
         admission(REVIEWS, "0x5 1x20", webhook="mutate", outcome="error"),
         admission(REVIEWS, "0+9x25", webhook="mutate", outcome="allowed"),
         at="10m", fires=[{"pod": ADMISSION_A, "webhook": "mutate"}], value="1"),
    case("KaiFractionsAdmissionInternalErrors", "denials are answers, not errors",
         admission(REVIEWS, "0+9x25", webhook="validate", outcome="denied"),
         admission(REVIEWS, "0x25", webhook="validate", outcome="error"), at="10m"),
    case("KaiFractionsAdmissionInternalErrors", "no error in the last 10 minutes",
         admission(REVIEWS, "0x5 1x30", webhook="validate", outcome="error"), at="25m"),
)

# -- the rules and promtool ------------------------------------------------------------------


def rule_groups(*sets: str) -> list[dict[str, Any]]:
    return one(render(sets=ON + sets), "PrometheusRule", RULE)["spec"]["groups"]


def alerting_rules(groups: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["alert"]: r for g in groups for r in g["rules"]}


def alert_labels(c: Case, fired: Mapping[str, str] | Series) -> dict[str, str]:
    labels = dict(fired.labels if isinstance(fired, Series) else fired)
    return {**labels, "severity": "critical" if c.alert in CRITICAL else "warning"}


TEMPLATE = re.compile(r"\{\{\s*(.*?)\s*\}\}")
LABEL = re.compile(r"\$labels\.(\w+)")
VALUE = re.compile(r'\$value(?:\s*\|\s*\w+)?|printf "[^"]*" \$value')


def rendered(text: str, labels: Mapping[str, str], value: str | None, where: str) -> str:
    """An annotation as Prometheus renders it for an alert with these labels: each
    `{{ $labels.x }}` its value, each `{{ $value ... }}` the case's `value`. Prometheus would
    render a label the alert lacks as "", so naming one fails here."""
    def substitute(m: re.Match[str]) -> str:
        template = m.group(1)
        if label := LABEL.fullmatch(template):
            assert label.group(1) in labels, f"{where} names {label.group(1)}, which it lacks"
            return labels[label.group(1)]
        assert VALUE.fullmatch(template), f"{where}: unexpected template {{{{ {template} }}}}"
        assert value is not None, f"{where} shows {{{{ {template} }}}}: give the case a value"
        return value
    return TEMPLATE.sub(substitute, text)


def expected_alert(c: Case, fired: Mapping[str, str] | Series,
                   rule: Mapping[str, Any]) -> dict[str, Any]:
    labels = alert_labels(c, fired)
    series_labels = {k: v for k, v in labels.items() if k != "severity"}
    return {"exp_labels": labels,
            "exp_annotations": {key: rendered(text, series_labels, c.value, f"{c.name} ({key})")
                                for key, text in rule["annotations"].items()}}


def unit_test_group(c: Case, rule: Mapping[str, Any]) -> dict[str, Any]:
    return {"name": c.name, "interval": "1m",
            "input_series": [{"series": s.selector(), "values": s.values} for s in c.series],
            "alert_rule_test": [{"eval_time": c.at, "alertname": c.alert,
                                 "exp_alerts": [expected_alert(c, f, rule) for f in c.fires]}]}


def promtool_test(promtool: Path, folder: Path, groups: list[dict[str, Any]],
                  cases: Iterable[Case]) -> subprocess.CompletedProcess[str]:
    """`promtool test rules` of `cases` against `groups`, all in one run."""
    rules = alerting_rules(groups)
    (folder / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    tests = {"rule_files": ["rules.yaml"], "evaluation_interval": "1m",
             "tests": [unit_test_group(c, rules[c.alert]) for c in cases]}
    (folder / "tests.yaml").write_text(yaml.safe_dump(tests, sort_keys=False, width=1000))
    return subprocess.run([str(promtool), "test", "rules", "tests.yaml"], cwd=folder,
                          capture_output=True, text=True, timeout=60, check=False)


def report(proc: subprocess.CompletedProcess[str], folder: Path) -> str:
    """promtool's whole output first, then where its input is kept."""
    return (f"{proc.stdout}{proc.stderr}\npromtool exited {proc.returncode}; its rules and "
            f"tests are in {folder}")


# -- the tests -------------------------------------------------------------------------------


@pytest.mark.parametrize("sets", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_promtool_checks_the_rendered_rules(sets: tuple[str, ...], promtool_bin: Path,
                                            tmp_path: Path) -> None:
    groups = rule_groups(*sets)
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    proc = subprocess.run([str(promtool_bin), "check", "rules", "rules.yaml"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, report(proc, tmp_path)
    assert f"SUCCESS: {len(alerting_rules(groups))} rules found" in proc.stdout, \
        report(proc, tmp_path)


def test_every_alert_has_a_case_that_fires_and_one_that_does_not() -> None:
    """Every alert of every value set here (KaiFractionsMirrorDown is gRPC mode's alone)."""
    alerts = {name for sets in VALUE_SETS.values() for name in alerting_rules(rule_groups(*sets))}
    assert len(CASES) == len({c.name for c in CASES}), "two cases share a name"
    assert {c.alert for c in CASES} <= alerts, "a case of an alert the chart no longer has"
    assert alerts == {c.alert for c in CASES if c.fires}, "an alert that never fires here"
    assert alerts == {c.alert for c in CASES if not c.fires}, "an alert never kept quiet here"


def test_every_alert_fires_as_its_cases_say(promtool_bin: Path, tmp_path: Path) -> None:
    """The default rendering's alerts; the others' (KaiFractionsMirrorDown) below."""
    groups = rule_groups()
    proc = promtool_test(promtool_bin, tmp_path, groups,
                         [c for c in CASES if c.alert in alerting_rules(groups)])
    assert proc.returncode == 0, report(proc, tmp_path)
    assert "SUCCESS" in proc.stdout, report(proc, tmp_path)


OTHER_VALUE_SETS = {name: sets for name, sets in VALUE_SETS.items() if sets}


@pytest.mark.parametrize("sets", OTHER_VALUE_SETS.values(), ids=OTHER_VALUE_SETS.keys())
def test_the_alerts_other_values_change_fire_as_their_cases_say(
        sets: tuple[str, ...], promtool_bin: Path, tmp_path: Path) -> None:
    """The alerts a value set renders otherwise than the defaults (a watchdog policy changes a
    description, the follower's silent-node marking another) against their cases, expecting
    this rendering's annotations; the others are the default's, tested above (a promtool test
    group costs ~25 ms)."""
    default = alerting_rules(rule_groups())
    groups = rule_groups(*sets)
    changed = {name for name, r in alerting_rules(groups).items() if r != default.get(name)}
    assert changed, f"{sets} renders every alert as the defaults do: nothing to test"
    proc = promtool_test(promtool_bin, tmp_path, groups, [c for c in CASES if c.alert in changed])
    assert proc.returncode == 0, report(proc, tmp_path)
    assert "SUCCESS" in proc.stdout, report(proc, tmp_path)


def test_an_annotation_that_names_a_label_the_alert_lacks_is_caught() -> None:
    """Prometheus renders `{{ $labels.node }}` of an alert without a node as "": the expected
    text is built from the alert's own labels, so such an annotation fails its case."""
    c = case("KaiFractionsFollowerFailing", "x", at="1m", fires=[{}], value="1")
    with pytest.raises(AssertionError, match="names node, which it lacks"):
        expected_alert(c, {}, {"annotations": {"summary": "On {{ $labels.node }}."}})
    assert expected_alert(c, {}, {"annotations": {"summary": "{{ $value | humanize }}/s"}}) \
        == {"exp_labels": {"severity": "warning"}, "exp_annotations": {"summary": "1/s"}}


MUTATIONS = {  # what breaks -> (alert, a part of its expression, what replaces it)
    "a misspelt metric": ("KaiFractionsNodeNotReady", "kai_fractions_node_ready",
                          "kai_fractions_node_redy"),
    "a threshold": ("KaiFractionsMpsDaemonRestarting", "> 3", "> 30"),
    "a grouping label dropped": ("KaiFractionsNodeAgentWritesRefused", "by (node)", ""),
    "the per-container cover dropped": (
        "KaiFractionsNodeRefusedGonePods",
        "unless on (node, reason) (max by (node, reason) (kai_fractions_container_refused) > 0)",
        ""),
    "the cover of a reported refusal dropped": (
        "KaiFractionsNodeRefusedGonePods", "unless on (node, reason) (max by (node, reason) "
        "(max_over_time(ALERTS", "or on (node, reason) (max by (node, reason) "
        "(max_over_time(ALERTS"),
    "404 counted as refused": ("KaiFractionsNodeAgentWritesRefused", "|404|", "|"),
    "the not-ready reason kept apart": ("KaiFractionsNodeNotReady",
                                        "max by (node) (kai_fractions_node_ready)",
                                        "kai_fractions_node_ready"),
    "the reason kept apart": ("KaiFractionsMpsCapNotInForce",
                              "by (node, namespace, pod, container)",
                              "by (node, namespace, pod, container, reason)"),
    "the excluded reasons": ("KaiFractionsReconcileErrors",
                             '{reason!~"SignatureMissing|NotBound"}', ""),
    "every refusal counted as shedding": ("KaiFractionsAdmissionShedding", '{reason="no_room"}',
                                          ""),
    "the backlog left out": ("KaiFractionsAdmissionShedding", " or sum by (pod)",
                             " unless sum by (pod)"),
    "no target taken for none down": ("KaiFractionsAdmissionDown", " or vector(0)", ""),
    "the marks counted instead of the nodes held": (
        "KaiFractionsNodeAgentSilent", "max by (node) (kai_fractions_follower_node_silent) > 0",
        "sum by (node) (increase(kai_fractions_follower_silent_nodes_total[15m])) > 0"),
    "skips and replays counted as verdicts": (
        "KaiFractionsFollowerMismatches", '{result=~"complete|mismatch|invalid|unsigned"}', ""),
    "while none completes too": (
        "KaiFractionsFollowerMismatches",
        ' and on() (sum(rate(kai_fractions_follower_checks_total{result="complete"}[15m])) > 0)',
        ""),
}


@pytest.mark.parametrize("mutation", MUTATIONS.values(), ids=MUTATIONS.keys())
def test_a_broken_expression_fails_its_cases(mutation: tuple[str, str, str], promtool_bin: Path,
                                             tmp_path: Path) -> None:
    """The harness checks something: the same cases pass with the chart's rule and fail, in
    promtool, with the rule broken."""
    alert, part, replacement = mutation
    groups = rule_groups()
    cases = [c for c in CASES if c.alert == alert]
    (tmp_path / "chart").mkdir()
    proc = promtool_test(promtool_bin, tmp_path / "chart", groups, cases)
    assert proc.returncode == 0, report(proc, tmp_path / "chart")
    broken = copy.deepcopy(groups)
    rule = alerting_rules(broken)[alert]
    assert part in rule["expr"], f"{alert}'s expression no longer has {part!r}"
    rule["expr"] = rule["expr"].replace(part, replacement)
    (tmp_path / "broken").mkdir()
    proc = promtool_test(promtool_bin, tmp_path / "broken", broken, cases)
    assert proc.returncode == 1, report(proc, tmp_path / "broken")
    assert "FAILED" in proc.stdout + proc.stderr, report(proc, tmp_path / "broken")
    assert f"alertname: {alert}," in proc.stdout + proc.stderr, report(proc, tmp_path / "broken")


# -- whole components down, and a healthy cluster: every alert of a rendering at once ---------


def healthy(minutes: int = 60, *, mirror_on: bool = True, follower: bool = True) -> list[Series]:
    """Every target up, for `minutes`: two mirror replicas (one leading the follower, which
    completes its checks), two admission replicas, the agents of two nodes, ready."""
    out = [up(agent_target(n), f"1x{minutes}") for n in (NODE_1, NODE_2)]
    out += [agent("kai_fractions_node_ready", f"1x{minutes}", n, node=n, reason="AgentReady")
            for n in (NODE_1, NODE_2)]
    out += [up(admission_target(a), f"1x{minutes}") for a in (ADMISSION_A, ADMISSION_B)]
    out += [admission(REVIEWS, f"0+9x{minutes}", a, webhook="mutate", outcome="allowed")
            for a in (ADMISSION_A, ADMISSION_B)]
    if mirror_on:
        out += [up(mirror_target(m), f"1x{minutes}") for m in (MIRROR_A, MIRROR_B)]
        out += [mirror(CALLS, f"0+100x{minutes}", m, method="MirrorAllocation", code="OK")
                for m in (MIRROR_A, MIRROR_B)]
    if mirror_on and follower:
        out += [mirror("kai_fractions_follower_leading", f"1x{minutes}"),
                mirror("kai_fractions_follower_leading", f"0x{minutes}", MIRROR_B),
                mirror(CHECKS, f"0+10x{minutes}", result="complete"),
                mirror(CHECKS, f"0+50x{minutes}", result="skipped")]
    return out


def every_alert_test(name: str, groups: list[dict[str, Any]], series: Iterable[Series],
                     at: str, fires: Mapping[str, Iterable[Mapping[str, str] | Series]]
                     ) -> dict[str, Any]:
    """A promtool test group that checks every alert of `groups` at `at`: those in `fires`
    with these labels (and their rendered annotations), every other one quiet."""
    rules = alerting_rules(groups)
    assert set(fires) <= set(rules), f"{name}: {set(fires) - set(rules)} not rendered"
    series = list(series)
    return {"name": name, "interval": "1m",
            "input_series": [{"series": s.selector(), "values": s.values} for s in series],
            "alert_rule_test": [
                {"eval_time": at, "alertname": alert,
                 "exp_alerts": [expected_alert(Case(alert, name, tuple(series), at), f, rule)
                                for f in fires.get(alert, ())]}
                for alert, rule in rules.items()]}


def run_every_alert_tests(promtool: Path, folder: Path, groups: list[dict[str, Any]],
                          tests: list[dict[str, Any]]) -> subprocess.CompletedProcess[str]:
    (folder / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    (folder / "tests.yaml").write_text(yaml.safe_dump(
        {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": tests},
        sort_keys=False, width=1000))
    return subprocess.run([str(promtool), "test", "rules", "tests.yaml"], cwd=folder,
                          capture_output=True, text=True, timeout=60, check=False)


MODES = {"default": (), "grpc": ("mirror.followBindRequests=false",)}


@pytest.mark.parametrize("mode", MODES, ids=MODES.keys())
def test_a_component_with_no_replica_up_pages_and_a_healthy_cluster_fires_nothing(
        mode: str, promtool_bin: Path, tmp_path: Path) -> None:
    """The reviewer's probe: every mirror and admission replica unscrapeable (a crash loop)
    for an hour, the node agents healthy. Each down replica has its warning, and each
    component with none up its critical alert (with the follower, KaiFractionsFollowerNoLeader
    is the mirror's), whether the replicas' targets say 0 or there is no target at all; no other
    alert fires. Against a healthy cluster, no alert fires at all."""
    groups = rule_groups(*MODES[mode])
    follower = mode == "default"
    mirror_none_up = "KaiFractionsFollowerNoLeader" if follower else "KaiFractionsMirrorDown"
    agents_only = [s for s in healthy() if s.labels.get("job") == AGENT_JOB]
    crash_loop = [up(mirror_target(m), "0x60") for m in (MIRROR_A, MIRROR_B)] + \
        [up(admission_target(a), "0x60") for a in (ADMISSION_A, ADMISSION_B)]
    tests = [
        every_alert_test("every replica of the mirror and the admission server down", groups,
                         [*agents_only, *crash_loop], "60m", {
                             "KaiFractionsMirrorReplicaDown": [up(mirror_target(m), "")
                                                               for m in (MIRROR_A, MIRROR_B)],
                             "KaiFractionsAdmissionReplicaDown": [
                                 up(admission_target(a), "") for a in (ADMISSION_A, ADMISSION_B)],
                             mirror_none_up: [{}],
                             "KaiFractionsAdmissionDown": [{}]}),
        every_alert_test("no target of the mirror or the admission server at all", groups,
                         agents_only, "60m", {mirror_none_up: [{}],
                                              "KaiFractionsAdmissionDown": [{}]}),
        every_alert_test("a healthy cluster", groups, healthy(follower=follower), "60m", {}),
        # Right after an install, nothing scraped yet: the alerts on a component with none up
        # wait their `for` (5m) out. (KaiFractionsFollowerNoLeader's is 2m: its Lease is
        # expected within that.)
        every_alert_test("nothing scraped yet, 4 minutes in", groups,
                         [up(agent_target(NODE_1), "_x4")], "4m",
                         {"KaiFractionsFollowerNoLeader": [{}]} if follower else {}),
    ]
    proc = run_every_alert_tests(promtool_bin, tmp_path, groups, tests)
    assert proc.returncode == 0, report(proc, tmp_path)
    assert "SUCCESS" in proc.stdout, report(proc, tmp_path)


def test_without_the_mirror_nothing_fires_for_its_absence(promtool_bin: Path,
                                                          tmp_path: Path) -> None:
    """mirror.enabled=false: no mirror series at all, and no alert says the mirror is down,
    neither in a healthy cluster nor while the admission server is down (which pages)."""
    groups = rule_groups(*VALUE_SETS["no-mirror"])
    agents_only = [s for s in healthy(mirror_on=False) if s.labels.get("job") == AGENT_JOB]
    tests = [
        every_alert_test("a healthy cluster without a mirror", groups,
                         healthy(mirror_on=False), "60m", {}),
        every_alert_test("no mirror, and every admission replica down", groups,
                         [*agents_only, *(up(admission_target(a), "0x60")
                                          for a in (ADMISSION_A, ADMISSION_B))], "60m",
                         {"KaiFractionsAdmissionReplicaDown": [
                             up(admission_target(a), "") for a in (ADMISSION_A, ADMISSION_B)],
                          "KaiFractionsAdmissionDown": [{}]}),
    ]
    proc = run_every_alert_tests(promtool_bin, tmp_path, groups, tests)
    assert proc.returncode == 0, report(proc, tmp_path)
    assert "SUCCESS" in proc.stdout, report(proc, tmp_path)
