"""The Grafana dashboard (charts/kai-fractions/dashboards/kai-fractions.json): every PromQL
expression in it names only metrics and labels a live process really exports (taken from the
/metrics of the REAL process, not from a list here): the panels of the "Mirror" row a live
mirror's, those of the "Admission" row a live admission server's, every other panel and variable
a live node agent's. The chart ships it as a ConfigMap with the `grafana_dashboard` label when
`dashboard.enabled` (never by default).

Which row a panel is in is Grafana's rule: a collapsed row holds its panels, any other panel
belongs to the last row above it (gridPos.y). Labels Prometheus attaches to a target (`pod`,
`job`...) count as known only for the mirror's and the admission server's panels: their
ServiceMonitors keep them (neither exports those names), while the agent's honours the agent's
own workload labels.

The PromQL reader and the check (tests/support/promql.py, shared with the alerting rules' test)
are minimal but exact for what a dashboard needs: metric names, label matchers (`{l="v"}`, `=~`,
`!=`, `!~`), the label lists of `by`, `without`, `on`, `ignoring`, `group_left`, `group_right`,
and legend templates; string literals and range brackets are skipped whole (a keyword inside a
string is not a keyword). An unknown function is an error, so a typo never passes as a metric
name."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import generate_latest

from kai_fractions.admission.metrics import OUTCOMES, REFUSALS, WEBHOOKS
from kai_fractions.node.agent.metrics import CAP_NOT_IN_FORCE, USAGE_UNKNOWN, AgentMetrics
from kai_fractions.node.desired import ContainerKey
from kai_fractions.node.engine import ContainerResult, ContainerState
from tests.admission.certs import install, make_cert
from tests.chart.render import CHART, NAMESPACE, find, kube_validate, one, render
from tests.chart.test_alerts_promtool import (
    GPU,
    NODE_1,
    WORKLOAD,
    agent,
    per_container,
    report,
)
from tests.support.admission_metrics import FAMILIES as ADMISSION_FAMILIES
from tests.support.admission_metrics import populated_admission_scrape
from tests.support.agent_metrics import populated_scrape
from tests.support.agent_process import AgentEnv
from tests.support.kube import KubeServer
from tests.support.mirror_metrics import populated_mirror_scrape
from tests.support.promql import TARGET_LABELS, Expr, exported, parse, problems, sample_value

DASHBOARD = CHART / "dashboards" / "kai-fractions.json"
CONFIGMAP = "kai-fractions-dashboard"
MIRROR_ROW = "Mirror"
MIRROR_SERVICE_MONITOR = "kai-fractions-mirror"
ADMISSION_ROW = "Admission"
ADMISSION_SERVICE_MONITOR = "kai-fractions-admission"


def test_the_promql_reader_finds_names_and_labels_and_nothing_in_strings() -> None:
    q = parse('sum by (a, b) (rate(m_total{x="sum by (z)", y=~"p|q"}[$__rate_interval]))\n'
              "/ on (c) group_left (d) n{z!~'.*'} > bool 0.5 or ignoring (e) o")
    assert q.metrics == {"m_total", "n", "o"}
    assert q.matchers == {("m_total", "x"), ("m_total", "y"), ("n", "z")}
    assert q.grouping == {"a", "b", "c", "d", "e"}
    assert q.values == {("m_total", "x", "=", "sum by (z)"), ("m_total", "y", "=~", "p|q"),
                        ("n", "z", "!~", ".*")}
    q = parse('histogram_quantile(0.95, sum without (le) (h_bucket[5m:1m] offset 1h))'
              ' * on () group_left m2{__name__="m3"}')
    assert q.metrics == {"h_bucket", "m2", "m3"} and q.grouping == {"le"}
    with pytest.raises(ValueError, match="unknown function 'label_replace'"):
        parse('label_replace(m, "dst", "$1", "src", "(.*)")')
    with pytest.raises(ValueError, match="bad label matcher"):
        parse("m{x=y}")


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels_by_row(board: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(row title, panel) for every panel but the rows, as Grafana places them: a collapsed
    row holds its panels; any other panel belongs to the last row above it (by gridPos.y)."""
    rows = sorted((p["gridPos"]["y"], p["title"]) for p in board["panels"] if p["type"] == "row")
    out = []
    for p in board["panels"]:
        if p["type"] == "row":
            out += [(p["title"], inner) for inner in p.get("panels") or []]
        else:
            above = [title for y, title in rows if y < p["gridPos"]["y"]]
            out.append((above[-1] if above else "", p))
    return out


def expressions(board: dict[str, Any]) -> list[Expr]:
    """Every panel target (rows' nested panels too) with its row, and every query variable
    (`label_values(<selector>, <label>)` read as its selector plus a `by`; row "")."""
    out = []
    for row, p in panels_by_row(board):
        for t in p.get("targets") or []:
            out.append(Expr(row, f"panel {p['title']!r} {t['refId']}", t["expr"],
                            t.get("legendFormat", "")))
    for v in board["templating"]["list"]:
        if v["type"] != "query":
            continue
        query = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
        m = re.fullmatch(r"label_values\((.*),\s*([A-Za-z_][A-Za-z0-9_]*)\s*\)", query)
        assert m, f"variable {v['name']}: not a label_values query: {query}"
        out.append(Expr("", f"variable {v['name']}", f"sum by ({m.group(2)}) ({m.group(1)})",
                        ""))
    return out


def agent_side(board: dict[str, Any]) -> list[Expr]:
    return [e for e in expressions(board) if e.row not in (MIRROR_ROW, ADMISSION_ROW)]


def mirror_side(board: dict[str, Any]) -> list[Expr]:
    return [e for e in expressions(board) if e.row == MIRROR_ROW]


def admission_side(board: dict[str, Any]) -> list[Expr]:
    return [e for e in expressions(board) if e.row == ADMISSION_ROW]


SCRAPE = """\
# HELP m_calls_total Calls.
# TYPE m_calls_total counter
m_calls_total{code="OK"} 1.0
# HELP m_checks_total Checks (none yet: no sample, no label known).
# TYPE m_checks_total counter
# HELP m_delay_seconds A histogram without labels.
# TYPE m_delay_seconds histogram
m_delay_seconds_bucket{le="1.0"} 0.0
m_delay_seconds_bucket{le="+Inf"} 0.0
m_delay_seconds_count 0.0
m_delay_seconds_sum 0.0
"""


def test_the_checker_reports_every_unknown_metric_and_label() -> None:
    labels_of = exported(SCRAPE)
    assert labels_of["m_calls_total"] == {"code"} and labels_of["m_checks_total"] == set()
    assert labels_of["m_delay_seconds_bucket"] == {"le"}
    assert labels_of["m_delay_seconds_count"] == set()

    def check(expr: str, legend: str = "", targets: frozenset[str] = frozenset()) -> list[str]:
        return problems([Expr("", "e", expr, legend)], labels_of, "mirror", targets)

    assert check('sum by (code) (rate(m_calls_total{code!="OK"}[5m]))', "{{code}}") == []
    assert check("histogram_quantile(0.99, sum by (le) (rate(m_delay_seconds_bucket[5m])))") \
        == []
    assert check("sum(rate(m_checks_total[5m]))") == []  # exported, though never counted yet
    assert check("m_nope_total + m_delay_seconds") == [
        "e: the mirror exports no m_delay_seconds", "e: the mirror exports no m_nope_total"]
    assert check('m_calls_total{verb="GET"}') == ["e: m_calls_total has no label verb"]
    assert check("sum by (result) (m_checks_total)") == [
        "e: groups by result, which none of ['m_checks_total'] has"]
    assert check("m_calls_total", "{{method}}") == [
        "e: the legend names method, which no metric has"]
    # a target label: unknown unless the caller says Prometheus attaches it
    assert check('sum by (pod) (m_calls_total{job="x"})', "{{pod}}") == [
        "e: m_calls_total has no label job", "e: groups by pod, which none of "
        "['m_calls_total'] has", "e: the legend names pod, which no metric has"]
    assert check('sum by (pod) (m_calls_total{job="x"})', "{{pod}}", TARGET_LABELS) == []


def test_panels_belong_to_the_row_above_them_or_to_their_collapsed_row() -> None:
    def at(pid: int, y: int, kind: str = "timeseries", **rest: Any) -> dict[str, Any]:
        return {"id": pid, "type": kind, "title": f"p{pid}", "gridPos": {"y": y}, **rest}

    # by y, not by the order of the list; a collapsed row's panels keep their own y
    board = {"panels": [at(1, 0), at(2, 1, "row", title="A"), at(3, 9),
                        at(4, 10, "row", title="B", panels=[at(5, 3)]), at(6, 2)]}
    assert [(row, p["id"]) for row, p in panels_by_row(board)] == [
        ("", 1), ("A", 3), ("B", 5), ("A", 6)]


def test_the_dashboard_has_the_panels_issue_19_asks_for() -> None:
    board = dashboard()
    assert board["uid"] and board["title"]
    exprs = " ".join(e.expr for e in agent_side(board))
    for metric in ("kai_fractions_container_gpu_memory_requested_bytes",
                   "kai_fractions_container_gpu_memory_limit_bytes",
                   "kai_fractions_container_gpu_memory_used_bytes",
                   "kai_fractions_container_gpu_sm_share_percent",
                   "kai_fractions_container_gpu_memory_limit_violations_total",
                   "kai_fractions_container_refused", "kai_fractions_node_ready"):
        assert metric in exprs, metric
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for p in board["panels"]:
        assert p.get("datasource") == {"type": "prometheus", "uid": "${datasource}"} \
            or p["type"] == "row", p["title"]


USED = "kai_fractions_container_gpu_memory_used_bytes"
SM = "kai_fractions_container_gpu_sm_utilization_percent"
SHARE = "kai_fractions_container_gpu_sm_share_percent"
SM_NORMALIZED = "gpu_fractioning_gpu_sm_utilization_percent_normalized"
USAGE = {USED, SM, SM_NORMALIZED}
"""What the agent reads from NVML each check, 0 on a GPU whose usage is unknown."""


def test_caps_not_in_force_and_gpus_whose_usage_is_unknown_have_panels() -> None:
    """A container whose cap is not in force, and a GPU whose usage the watchdog cannot read
    (its containers' used series then read 0), each have a table of their own, by the labels
    that say which and why."""
    board = dashboard()
    grouped = {}
    for row, p in panels_by_row(board):
        for target in p.get("targets") or []:
            q = parse(target["expr"])
            for metric in (CAP_NOT_IN_FORCE, USAGE_UNKNOWN):
                if q.metrics == {metric}:
                    grouped[metric] = (row, p["title"], p["type"], q.grouping)
    assert grouped[CAP_NOT_IN_FORCE] == (
        "Violations and refusals", "Caps not in force", "table",
        {"node", "namespace", "pod", "container", "reason"})
    assert grouped[USAGE_UNKNOWN] == (
        "Violations and refusals", "GPUs whose usage is unknown", "table",
        {"node", "gpu_uuid", "reason"})


def test_the_usage_panels_leave_out_a_gpu_whose_usage_is_unknown(
        promtool_bin: Path, tmp_path: Path) -> None:
    """A container over its cap on a GPU the watchdog cannot see reads 0 used and 0 SM: every
    panel of its used memory (Used, Used of the cap, the per-GPU used line) and of its SM use
    (per container, of the share, gpu-fractioning's normalized one) shows nothing for that GPU
    while kai_fractions_agent_gpu_usage_unknown says so, not a 0, and shows it again once a
    check reads it. Run in Prometheus's own engine (promtool), on series as the agent's
    ServiceMonitor stores them (the agent's target labels on the per-GPU series)."""
    exprs = [e for e in agent_side(dashboard()) if parse(e.expr).metrics & USAGE]
    assert {e.where.split("'")[1] for e in exprs} == {
        "Used", "Used of the cap", "Per GPU: requested, capped, used and total",
        "SM utilization per container", "SM utilization of the share",
        "SM utilization of the requested fraction (gpu-fractioning)"}
    blind_gpu, seen_gpu = GPU, {"gpu_uuid": "GPU-1f2e3d4c-5b6a-4789-8a9b-0c1d2e3f4a5b",
                                "gpu": "1"}
    upstream = {k: v for k, v in WORKLOAD.items() if k != "container"}  # per pod, no container
    gib = 1 << 30
    series = [
        per_container(USED, "0x30", node=NODE_1, **blind_gpu),  # 30 GiB in truth
        per_container("kai_fractions_container_gpu_memory_limit_bytes", f"{20 * gib}x30",
                      node=NODE_1, **blind_gpu),
        per_container(USED, f"{5 * gib}x30", node=NODE_1, **seen_gpu),
        per_container("kai_fractions_container_gpu_memory_limit_bytes", f"{10 * gib}x30",
                      node=NODE_1, **seen_gpu),
        *(per_container(SM, "0x30", node=NODE_1, **gpu) for gpu in (blind_gpu, seen_gpu)),
        *(per_container(SHARE, "50x30", node=NODE_1, **gpu) for gpu in (blind_gpu, seen_gpu)),
        *(agent(SM_NORMALIZED, "0x30", **upstream, **gpu) for gpu in (blind_gpu, seen_gpu)),
        agent(USAGE_UNKNOWN, "1x15 stale", node=NODE_1, gpu_uuid=blind_gpu["gpu_uuid"],
              reason="NoProcessesVisible"),
    ]

    def gpus(*indexes: str) -> list[dict[str, Any]]:
        return [{"labels": f'{{gpu="{i}"}}', "value": 1} for i in indexes]

    def expression(e: Any) -> str:  # the variables at "All"
        return f"count by (gpu) ({e.expr.replace('$node', '.*').replace('$namespace', '.*')})"

    tests = {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": [{
        "name": e.where, "interval": "1m",
        "input_series": [{"series": s.selector(), "values": s.values} for s in series],
        "promql_expr_test": [
            {"expr": expression(e), "eval_time": "10m", "exp_samples": gpus("1")},
            {"expr": expression(e), "eval_time": "20m", "exp_samples": gpus("0", "1")}]}
        for e in exprs]}
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": []}))
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(tests, sort_keys=False, width=1000))
    proc = subprocess.run([str(promtool_bin), "test", "rules", "tests.yaml"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, report(proc, tmp_path)
    assert "SUCCESS" in proc.stdout, report(proc, tmp_path)


def in_process_labels() -> dict[str, set[str]]:
    """The labels of the series the live agent of `populated_scrape` holds too briefly to be
    scraped, or never (a cap not in force; a GPU whose usage is unknown: one blind check): as
    the agent's metrics (in process) export one."""
    metrics = AgentMetrics("node-a")
    metrics.count_caps([ContainerResult(
        key=ContainerKey("6b0f7d6e-3a1c-4f0e-9d57-2c8e1b4a9f10", "main"), ref="team-a/train-0/main",
        state=ContainerState.PENDING, reason="ComputeModeNotInForce", mps_cap_missing=True)])
    metrics.set_usage_unknown({GPU["gpu_uuid"]: "NoProcessesVisible"})
    labels_of = exported(generate_latest(metrics.registry).decode())
    assert labels_of[CAP_NOT_IN_FORCE] and labels_of[USAGE_UNKNOWN]
    return {name: labels_of[name] for name in (CAP_NOT_IN_FORCE, USAGE_UNKNOWN)}


def test_the_mirror_row_follows_the_nodes_with_a_panel_per_family() -> None:
    board = dashboard()
    placed = panels_by_row(board)
    mirror = [p for row, p in placed if row == MIRROR_ROW]
    exprs = " ".join(e.expr for e in mirror_side(board))
    for metric in ("kai_fractions_mirror_calls_total",
                   "kai_fractions_mirror_call_duration_seconds_bucket",
                   "kai_fractions_mirror_api_requests_total",
                   "kai_fractions_mirror_pod_cache_pods", "kai_fractions_mirror_pod_cache_synced",
                   "kai_fractions_mirror_pod_cache_lookups_total",
                   "kai_fractions_follower_leading", "kai_fractions_follower_checks_total",
                   "kai_fractions_follower_checks_in_progress",
                   "kai_fractions_follower_signature_delay_seconds_bucket",
                   "process_resident_memory_bytes", "process_cpu_seconds_total"):
        assert metric in exprs, metric
    assert "kai_fractions_mirror" not in " ".join(
        e.expr for e in agent_side(board) + admission_side(board))
    # the last row but the Admission one, below the nodes' rows; the panels tile the 24 columns
    # without overlapping
    rows = [p for p in board["panels"] if p["type"] == "row"]
    assert rows[-2]["title"] == MIRROR_ROW and mirror
    others = [p for row, p in placed if row not in (MIRROR_ROW, ADMISSION_ROW)]
    assert rows[-2]["gridPos"]["y"] == max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in others)
    cells: dict[tuple[int, int], int] = {}
    for p in board["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps panel {cells[(x, y)]}"
                cells[(x, y)] = p["id"]
    ids = [p["id"] for p in board["panels"]] + [
        inner["id"] for p in board["panels"] for inner in p.get("panels") or []]
    assert len(ids) == len(set(ids))
    for p in mirror:
        assert p["targets"] and p["datasource"] == {"type": "prometheus",
                                                    "uid": "${datasource}"}, p["title"]
        assert all(t["datasource"] == p["datasource"] for t in p["targets"]), p["title"]
    # exactly one leader: red below and above 1
    (leaders,) = [p for p in mirror
                  if [t["expr"] for t in p["targets"]] == ["sum(kai_fractions_follower_leading)"]]
    assert leaders["type"] == "stat"
    assert leaders["fieldConfig"]["defaults"]["thresholds"]["steps"] == [
        {"color": "red", "value": None}, {"color": "green", "value": 1},
        {"color": "red", "value": 2}]


def test_the_admission_row_closes_the_dashboard_with_a_panel_per_family() -> None:
    """Below the Mirror row, the last: every family the admission server exports (its own and
    the process's memory and CPU) is read by a panel of it, and no other row reads one."""
    board = dashboard()
    placed = panels_by_row(board)
    admission = [p for row, p in placed if row == ADMISSION_ROW]
    read = {m for e in admission_side(board) for m in parse(e.expr).metrics}
    for metric in ADMISSION_FAMILIES:
        assert metric in read, metric
    assert admission and all(p["targets"] for p in admission)
    assert "kai_fractions_admission" not in " ".join(
        e.expr for e in agent_side(board) + mirror_side(board))
    rows = [p for p in board["panels"] if p["type"] == "row"]
    assert rows[-1]["title"] == ADMISSION_ROW
    others = [p for row, p in placed if row != ADMISSION_ROW]
    assert rows[-1]["gridPos"]["y"] == max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in others)
    assert all(p["gridPos"]["y"] > rows[-1]["gridPos"]["y"] for p in admission)
    for p in admission:
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert all(t["datasource"] == p["datasource"] for t in p["targets"]), p["title"]
        assert [t["refId"] for t in p["targets"]] == [chr(ord("A") + i)
                                                      for i in range(len(p["targets"]))]
        assert all(t["legendFormat"] for t in p["targets"]), p["title"]
        assert p["description"], p["title"]
    # the outcomes and reasons each get a series of their own
    by = {tuple(sorted(parse(e.expr).grouping)): e for e in admission_side(board)
          if "reviews_total" in e.expr or "refused_total" in e.expr}
    assert set(by) == {("outcome", "webhook"), ("reason",)}
    assert by[("outcome", "webhook")].legend == "{{webhook}} {{outcome}}"
    assert by[("reason",)].legend == "{{reason}}"


def scrape_job(service_monitor: str) -> str:
    """The `job` of a ServiceMonitor's targets: Prometheus Operator names it after the Service
    its endpoint scrapes (no jobLabel), here the component's metrics Service."""
    docs = render(sets=("serviceMonitor.enabled=true",))
    monitor = one(docs, "ServiceMonitor", service_monitor)["spec"]
    assert "jobLabel" not in monitor
    selector = monitor["selector"]["matchLabels"]
    ports = {e["port"] for e in monitor["endpoints"]}
    (service,) = [s["metadata"]["name"] for s in find(docs, "Service")
                  if selector.items() <= s["metadata"]["labels"].items()
                  and ports & {p.get("name") for p in s["spec"]["ports"]}]
    return service


@pytest.mark.parametrize(("row", "service_monitor"), [
    (MIRROR_ROW, MIRROR_SERVICE_MONITOR), (ADMISSION_ROW, ADMISSION_SERVICE_MONITOR)])
def test_the_process_panels_select_their_component_by_its_job(row: str,
                                                              service_monitor: str) -> None:
    """process_* is every process's: the mirror's panels name the job the chart's mirror
    ServiceMonitor gives its targets, the admission server's its own, and so does each panel's
    description."""
    job = scrape_job(service_monitor)
    side = [e for e in expressions(dashboard()) if e.row == row]
    matchers = {(metric, op, value) for e in side
                for metric, label, op, value in parse(e.expr).values if label == "job"}
    assert matchers == {("process_resident_memory_bytes", "=", job),
                        ("process_cpu_seconds_total", "=", job)}
    for in_row, panel in panels_by_row(dashboard()):
        exprs = [parse(t["expr"]) for t in panel["targets"]]
        if in_row == row and any(m.startswith("process_") for q in exprs for m in q.metrics):
            assert all(any(v[1] == "job" for v in q.values) for q in exprs), panel["title"]
            assert job in panel["description"], panel["title"]
    assert scrape_job(MIRROR_SERVICE_MONITOR) != scrape_job(ADMISSION_SERVICE_MONITOR)


@pytest.mark.integration
def test_every_expression_names_only_what_a_live_agent_exports(agent_env: AgentEnv) -> None:
    """Every expression but the Mirror and Admission rows': against the real agent's
    /metrics."""
    text, _uids, run = populated_scrape(agent_env)
    run.stop()
    labels_of = exported(text)
    assert "gpu_fractioning_gpu_memory_used_bytes" in labels_of  # the scrape is the agent's
    # the families the live agent exports (HELP and TYPE) without a series to show: their
    # labels are those the agent's code gives one
    for name, labels in in_process_labels().items():
        assert name in labels_of, name
        labels_of[name] |= labels
    assert problems(agent_side(dashboard()), labels_of, "agent") == []
    # what the agent lacks is reported, target labels too
    assert problems([Expr("", "bad", 'sum by (pod) (kai_fractions_mirror_calls_total)', ""),
                     Expr("", "worse", 'kai_fractions_node_ready{job="x"}', "{{instance}}")],
                    labels_of, "agent") == [
        "bad: the agent exports no kai_fractions_mirror_calls_total",
        "bad: groups by pod, which none of ['kai_fractions_mirror_calls_total'] has",
        "worse: kai_fractions_node_ready has no label job",
        "worse: the legend names instance, which no metric has"]


@pytest.mark.integration
def test_every_mirror_row_expression_names_only_what_a_live_mirror_exports(
        kube: KubeServer, tmp_path: Path) -> None:
    """The Mirror row's expressions: against the real mirror's /metrics (pod cache on,
    following BindRequests, after a call that wrote), with the target labels Prometheus adds."""
    labels_of = exported(populated_mirror_scrape(kube, tmp_path))
    assert "kai_fractions_mirror_calls_total" in labels_of  # the scrape is the mirror's
    assert "kai_fractions_node_ready" not in labels_of
    # none is renamed exported_<label> by the scrape: the target's labels are what panels read
    assert set().union(*labels_of.values()) & TARGET_LABELS == set()
    exprs = mirror_side(dashboard())
    assert exprs
    assert problems(exprs, labels_of, "mirror", TARGET_LABELS) == []
    # what the mirror lacks is reported: an agent metric, a label of another family, a typo
    assert problems([
        Expr(MIRROR_ROW, "agent's", "sum by (node) (kai_fractions_node_ready)", ""),
        Expr(MIRROR_ROW, "other family's", 'kai_fractions_mirror_calls_total{verb="GET"}',
             "{{result}}"),
        Expr(MIRROR_ROW, "typo", "sum(rate(kai_fractions_mirror_call_total[5m]))", ""),
    ], labels_of, "mirror", TARGET_LABELS) == [
        "agent's: the mirror exports no kai_fractions_node_ready",
        "agent's: groups by node, which none of ['kai_fractions_node_ready'] has",
        "other family's: kai_fractions_mirror_calls_total has no label verb",
        "other family's: the legend names result, which no metric has",
        "typo: the mirror exports no kai_fractions_mirror_call_total"]


@pytest.mark.integration
def test_every_admission_row_expression_names_only_what_a_live_admission_server_exports(
        tmp_path: Path) -> None:
    """The Admission row's expressions: against the real admission server's /metrics (after a
    review of each outcome and refusals, so the labelled series are the counted ones), with the
    target labels Prometheus adds (its ServiceMonitor has no honorLabels)."""
    install(tmp_path, *make_cert("webhook-dashboard"))
    text, _draining = populated_admission_scrape(tmp_path)
    assert sample_value(text, "kai_fractions_admission_reviews_total", outcome="error") == 1
    assert sample_value(text, "kai_fractions_admission_requests_refused_total",
                        reason="malformed") == 1
    labels_of = exported(text)
    assert "kai_fractions_admission_reviews_total" in labels_of  # the scrape is the server's
    assert "kai_fractions_mirror_calls_total" not in labels_of
    assert labels_of["kai_fractions_admission_reviews_total"] == {"webhook", "outcome"}
    assert set().union(*labels_of.values()) & TARGET_LABELS == set()
    exprs = admission_side(dashboard())
    assert exprs
    assert problems(exprs, labels_of, "admission server", TARGET_LABELS) == []
    # every family the live server exports is drawn (a new one without a panel fails here)
    read = {m for e in exprs for m in parse(e.expr).metrics}
    families = {name.removesuffix("_bucket") for name in labels_of
                if name.startswith("kai_fractions_admission_")
                and not name.endswith(("_created", "_count", "_sum"))}
    assert families == {m.removesuffix("_bucket") for m in read
                        if m.startswith("kai_fractions_admission_")}
    # a label value a matcher names is one the server writes (a value it never writes would
    # leave a panel empty for ever); `job` is the scrape's, checked against the chart above
    written = {"webhook": WEBHOOKS, "outcome": OUTCOMES, "reason": REFUSALS}
    for e in exprs:
        for metric, label, _op, value in parse(e.expr).values:
            assert label == "job" or value in written.get(label, ()), (e.where, metric, label)
    # what the server lacks is reported: a mirror metric, a label of another family, a typo
    assert problems([
        Expr(ADMISSION_ROW, "mirror's", "sum by (method) (kai_fractions_mirror_calls_total)", ""),
        Expr(ADMISSION_ROW, "other family's",
             'kai_fractions_admission_requests_refused_total{webhook="mutate"}', "{{outcome}}"),
        Expr(ADMISSION_ROW, "typo", "sum(rate(kai_fractions_admission_review_total[5m]))", ""),
    ], labels_of, "admission server", TARGET_LABELS) == [
        "mirror's: the admission server exports no kai_fractions_mirror_calls_total",
        "mirror's: groups by method, which none of ['kai_fractions_mirror_calls_total'] has",
        "other family's: kai_fractions_admission_requests_refused_total has no label webhook",
        "other family's: the legend names outcome, which no metric has",
        "typo: the admission server exports no kai_fractions_admission_review_total"]


# -- the chart ------------------------------------------------------------------------------


def test_no_dashboard_by_default() -> None:
    assert find(render(), "ConfigMap", CONFIGMAP) == []


def test_enabled_renders_the_json_with_the_grafana_dashboard_label() -> None:
    docs = render(sets=("dashboard.enabled=true",))
    cm = one(docs, "ConfigMap", CONFIGMAP)
    assert cm["metadata"]["namespace"] == NAMESPACE
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert "annotations" not in cm["metadata"]
    assert list(cm["data"]) == ["kai-fractions.json"]
    assert json.loads(cm["data"]["kai-fractions.json"]) == dashboard()
    assert kube_validate([cm], "dashboard") == []


def test_namespace_labels_and_annotations_are_settable() -> None:
    docs = render(sets=("dashboard.enabled=true", "dashboard.namespace=monitoring",
                        "dashboard.labels.grafana_dashboard=kai",
                        "dashboard.labels.team=gpu",
                        "dashboard.annotations.grafana_folder=GPU"))
    cm = one(docs, "ConfigMap", CONFIGMAP)
    assert cm["metadata"]["namespace"] == "monitoring"
    labels = cm["metadata"]["labels"]
    assert (labels["grafana_dashboard"], labels["team"]) == ("kai", "gpu")
    assert cm["metadata"]["annotations"] == {"grafana_folder": "GPU"}


def test_gpu_sharing_disabled_renders_no_dashboard() -> None:
    docs = render(sets=("dashboard.enabled=true", "gpuSharing=Disabled"))
    assert find(docs, "ConfigMap", CONFIGMAP) == []
