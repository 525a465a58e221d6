"""The Grafana dashboard (charts/kai-fractions/dashboards/kai-fractions.json): every PromQL
expression in it names only metrics and labels a live node agent really exports (taken from the
/metrics of the REAL agent process, not from a list here), and the chart ships it as a
ConfigMap with the `grafana_dashboard` label when `dashboard.enabled` (never by default).

The PromQL reader is minimal but exact for what a dashboard needs: metric names, label matchers
(`{l="v"}`, `=~`, `!=`, `!~`), the label lists of `by`, `without`, `on`, `ignoring`,
`group_left`, `group_right`, and legend templates; string literals and range brackets are
skipped whole (a keyword inside a string is not a keyword). An unknown function is an error, so
a typo never passes as a metric name."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.chart.render import CHART, NAMESPACE, find, kube_validate, one, render
from tests.support.agent_metrics import populated_scrape
from tests.support.agent_process import AgentEnv

DASHBOARD = CHART / "dashboards" / "kai-fractions.json"
CONFIGMAP = "kai-fractions-dashboard"

FUNCTIONS = {  # PromQL's aggregations and functions the dashboard may use
    "sum", "min", "max", "avg", "count", "stddev", "stdvar", "topk", "bottomk", "quantile",
    "group", "count_values", "rate", "irate", "increase", "delta", "idelta", "deriv",
    "histogram_quantile", "abs", "ceil", "floor", "round", "clamp", "clamp_min", "clamp_max",
    "max_over_time", "min_over_time", "avg_over_time", "sum_over_time", "last_over_time",
    "absent", "changes", "resets", "time", "timestamp", "vector", "scalar", "sort",
    "sort_desc",
}
LABEL_LISTS = {"by", "without", "on", "ignoring", "group_left", "group_right"}
OPERATOR_WORDS = {"and", "or", "unless", "bool", "offset", "atan2"}

TOKEN = re.compile(r"""
    (?P<space>\s+)
  | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<range>\[[^\]]*\])
  | (?P<var>\$\{[^}]*\}|\$[A-Za-z_][A-Za-z0-9_]*)
  | (?P<number>\d+(?:\.\d+)?(?:[eE][+-]?\d+)?[smhdwy]?)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<op>=~|!~|!=|==|<=|>=|[-+*/%^<>=(){},])
""", re.VERBOSE)


@dataclass
class Query:
    metrics: set[str] = field(default_factory=set)
    matchers: set[tuple[str, str]] = field(default_factory=set)
    """(metric, label) of every label matcher in a selector."""
    grouping: set[str] = field(default_factory=set)
    """Labels of by / without / on / ignoring / group_left / group_right."""


def tokens(expr: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(expr):
        m = TOKEN.match(expr, pos)
        if m is None:
            raise ValueError(f"cannot read {expr[pos:pos + 20]!r} in {expr!r}")
        pos = m.end()
        if m.lastgroup != "space":
            out.append((m.lastgroup or "", m.group()))
    return out


def parse(expr: str) -> Query:
    q = Query()
    toks = tokens(expr)
    i = 0

    def label_list(start: int, what: str) -> int:
        """`( l1, l2, ... )` from toks[start]; returns the index after `)`."""
        if toks[start] != ("op", "("):
            raise ValueError(f"{what} without a label list in {expr!r}")
        j = start + 1
        while toks[j] != ("op", ")"):
            kind, text = toks[j]
            if kind == "ident":
                q.grouping.add(text)
            elif (kind, text) != ("op", ","):
                raise ValueError(f"{text!r} in the label list of {what} in {expr!r}")
            j += 1
        return j + 1

    def selector(start: int, metric: str | None) -> int:
        """`{ l op "v", ... }` from toks[start] (after `{`); returns the index after `}`."""
        j = start
        while toks[j] != ("op", "}"):
            kind, label = toks[j]
            if (kind, label) == ("op", ","):
                j += 1
                continue
            op, value = toks[j + 1], toks[j + 2]
            if kind != "ident" or op[1] not in ("=", "!=", "=~", "!~") or value[0] != "string":
                raise ValueError(f"bad label matcher at {label!r} in {expr!r}")
            if label == "__name__":
                if op[1] != "=":
                    raise ValueError(f"a regex metric name cannot be checked: {expr!r}")
                metric = value[1][1:-1]
                q.metrics.add(metric)
            else:
                q.matchers.add((metric or "", label))
            j += 3
        return j + 1

    while i < len(toks):
        kind, text = toks[i]
        nxt = toks[i + 1] if i + 1 < len(toks) else ("", "")
        if kind == "ident" and text in LABEL_LISTS:
            if text in ("group_left", "group_right") and nxt != ("op", "("):
                i += 1  # group_left without extra labels
                continue
            i = label_list(i + 1, text)
        elif kind == "ident" and text in OPERATOR_WORDS:
            i += 1
        elif kind == "ident" and (text in FUNCTIONS or nxt == ("op", "(")):
            if text not in FUNCTIONS:
                raise ValueError(f"unknown function {text!r} in {expr!r}")
            i += 1
        elif kind == "ident":
            q.metrics.add(text)
            i += 1
            if nxt == ("op", "{"):
                i = selector(i + 1, text)
        elif (kind, text) == ("op", "{"):
            i = selector(i + 1, None)  # a selector without a metric name
        else:
            i += 1
    return q


def test_the_promql_reader_finds_names_and_labels_and_nothing_in_strings() -> None:
    q = parse('sum by (a, b) (rate(m_total{x="sum by (z)", y=~"p|q"}[$__rate_interval]))\n'
              "/ on (c) group_left (d) n{z!~'.*'} > bool 0.5 or ignoring (e) o")
    assert q.metrics == {"m_total", "n", "o"}
    assert q.matchers == {("m_total", "x"), ("m_total", "y"), ("n", "z")}
    assert q.grouping == {"a", "b", "c", "d", "e"}
    q = parse('histogram_quantile(0.95, sum without (le) (h_bucket[5m:1m] offset 1h))'
              ' * on () group_left m2{__name__="m3"}')
    assert q.metrics == {"h_bucket", "m2", "m3"} and q.grouping == {"le"}
    with pytest.raises(ValueError, match="unknown function 'label_replace'"):
        parse('label_replace(m, "dst", "$1", "src", "(.*)")')
    with pytest.raises(ValueError, match="bad label matcher"):
        parse("m{x=y}")


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def expressions(board: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(where, expr, legend) for every panel target (rows' nested panels too) and every
    query variable (`label_values(<selector>, <label>)` read as its selector plus a `by`)."""
    out = []
    panels = list(board["panels"])
    while panels:
        p = panels.pop(0)
        panels.extend(p.get("panels") or [])
        for t in p.get("targets") or []:
            out.append((f"panel {p['title']!r} {t['refId']}", t["expr"],
                        t.get("legendFormat", "")))
    for v in board["templating"]["list"]:
        if v["type"] != "query":
            continue
        query = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
        m = re.fullmatch(r"label_values\((.*),\s*([A-Za-z_][A-Za-z0-9_]*)\s*\)", query)
        assert m, f"variable {v['name']}: not a label_values query: {query}"
        out.append((f"variable {v['name']}", f"sum by ({m.group(2)}) ({m.group(1)})", ""))
    return out


def test_the_dashboard_has_the_panels_issue_19_asks_for() -> None:
    board = dashboard()
    assert board["uid"] and board["title"]
    exprs = " ".join(e for _, e, _ in expressions(board))
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


@pytest.mark.integration
def test_every_expression_names_only_what_a_live_agent_exports(agent_env: AgentEnv) -> None:
    text, _uids, run = populated_scrape(agent_env)
    run.stop()
    labels_of: dict[str, set[str]] = {}  # every sample name (with _total, _bucket...) -> labels
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels_of.setdefault(s.name, set()).update(s.labels)
    assert "gpu_fractioning_gpu_memory_used_bytes" in labels_of  # the scrape is the agent's

    problems = []
    for where, expr, legend in expressions(dashboard()):
        q = parse(expr)
        if not q.metrics:
            problems.append(f"{where}: names no metric: {expr}")
        unknown = q.metrics - labels_of.keys()
        problems += [f"{where}: the agent exports no {m}" for m in sorted(unknown)]
        known = set().union(*(labels_of.get(m, set()) for m in q.metrics))
        for metric, label in sorted(q.matchers):
            if label not in labels_of.get(metric, known):
                problems.append(f"{where}: {metric or 'the selector'} has no label {label}")
        for label in sorted(q.grouping - known):
            problems.append(f"{where}: groups by {label}, which none of "
                            f"{sorted(q.metrics)} has")
        for label in re.findall(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}", legend):
            if label not in known:
                problems.append(f"{where}: the legend names {label}, which no metric has")
    assert problems == []


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
