"""A small, exact PromQL reader and the check built on it, shared by the chart's dashboard
and alerting rule tests (tests/chart/test_dashboard.py, tests/chart/test_alerts.py): which
metrics and labels an expression names, and what of that a scrape of a REAL process lacks.

The reader is minimal but exact for what a dashboard or a rule needs: metric names, label
matchers (`{l="v"}`, `=~`, `!=`, `!~`), the label lists of `by`, `without`, `on`, `ignoring`,
`group_left`, `group_right`, and legend templates; string literals and range brackets are
skipped whole (a keyword inside a string is not a keyword). An unknown function is an error, so
a typo never passes as a metric name."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import NamedTuple

from prometheus_client.parser import text_string_to_metric_families

TARGET_LABELS = frozenset({"job", "instance", "namespace", "service", "endpoint", "pod",
                           "container"})
"""What Prometheus Operator attaches to every target of a ServiceMonitor endpoint. The mirror's
ServiceMonitor has no honorLabels and the mirror exports none of these names (checked), so its
series keep them as they are: a mirror panel or rule may use them (`pod` is the replica). The
agent's honours the agent's own `namespace`/`pod`/`container` (the workload's), so an agent
panel or rule gets no such allowance: every label it names must be in the agent's /metrics, but
for AGENT_TARGET_LABELS."""
AGENT_TARGET_LABELS = frozenset({"node"})
"""What the node agent's ServiceMonitor adds to each of its series (a relabeling of the pod's
node name): a series with a `node` of its own keeps it, the same name."""
UP_LABELS = TARGET_LABELS | AGENT_TARGET_LABELS
"""The labels of `up`, Prometheus's own series of a node agent target (no /metrics has it):
the target's, with the relabeled node."""
SAMPLE_SUFFIXES = {"counter": ("_total", "_created"),
                   "histogram": ("_bucket", "_count", "_sum", "_created"),
                   "gaugehistogram": ("_bucket", "_gcount", "_gsum"),
                   "summary": ("", "_count", "_sum", "_created"), "info": ("_info",)}
"""The sample names of a family of each type (a gauge's, an untyped's: its own name)."""

FUNCTIONS = {  # PromQL's aggregations and functions the dashboard and rules may use
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
    values: set[tuple[str, str, str, str]] = field(default_factory=set)
    """(metric, label, operator, value) of every label matcher (the value unquoted)."""


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
                q.values.add((metric or "", label, op[1], value[1][1:-1]))
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


class Expr(NamedTuple):
    row: str
    """The title of the row the panel is in ("" above the first row, and for a variable); for an
    alerting rule, its group's name."""
    where: str
    expr: str
    legend: str
    """A legend template (`{{label}}`): each label it names must be known on the metrics."""


def sample_value(text: str, name: str, **labels: str) -> float | None:
    """The value of the first sample `name` in a /metrics text whose labels include
    `labels`; None when there is none."""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return None


def exported(text: str) -> dict[str, set[str]]:
    """Every sample name the families of a scrape export -> the labels seen on it. A family's
    sample names follow from its type (a counter `x`: x_total; a histogram: x_bucket, x_count,
    x_sum), so a family with no sample yet (a labelled counter nothing incremented) is exported
    all the same, with no label known but a histogram's `le`."""
    labels_of: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for suffix in SAMPLE_SUFFIXES.get(family.type, ("",)):
            labels_of.setdefault(family.name + suffix, set())
        if family.type in ("histogram", "gaugehistogram"):
            labels_of[family.name + "_bucket"].add("le")
        for s in family.samples:
            labels_of.setdefault(s.name, set()).update(s.labels)
    return labels_of


def problems(exprs: list[Expr], labels_of: dict[str, set[str]], source: str,
             target_labels: frozenset[str] = frozenset()) -> list[str]:
    """What in `exprs` names a metric or label that `labels_of` (`exported`: what `source`
    exports) lacks; `target_labels` are known on every metric besides."""
    out = []
    for where, expr, legend in ((e.where, e.expr, e.legend) for e in exprs):
        q = parse(expr)
        if not q.metrics:
            out.append(f"{where}: names no metric: {expr}")
        unknown = q.metrics - labels_of.keys()
        out += [f"{where}: the {source} exports no {m}" for m in sorted(unknown)]
        known = set().union(*(labels_of.get(m, set()) for m in q.metrics)) | target_labels
        for metric, label in sorted(q.matchers):
            if label not in labels_of.get(metric, known) | target_labels:
                out.append(f"{where}: {metric or 'the selector'} has no label {label}")
        for label in sorted(q.grouping - known):
            out.append(f"{where}: groups by {label}, which none of {sorted(q.metrics)} has")
        for label in re.findall(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}", legend):
            if label not in known:
                out.append(f"{where}: the legend names {label}, which no metric has")
    return out
