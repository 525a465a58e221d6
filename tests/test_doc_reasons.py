"""Every reason the node agent reports is explained where an operator is sent to read it: the
node condition's False reasons in docs/chart.md's "Troubleshooting" (where the chart's alert
KaiFractionsNodeNotReady points), and every pending, pass-error, refusal and error reason in
docs/node-agent.md. A reason added to the code without a line in the docs fails here."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from kai_fractions.node.agent import condition

REPO = Path(__file__).resolve().parents[1]
REASON = re.compile(r"[A-Z][A-Za-z0-9]*[a-z][A-Z][A-Za-z0-9]*"
                    r"|[A-Z]{2,}[A-Za-z0-9]*[a-z][A-Za-z0-9]*")
"""A CamelCase word of two parts or more (`CgroupNotFound`, `NVMLError`): how every reason is
spelled. A one-word value (the event types `Normal` and `Warning`, the events `Applied` and
`Refused`) is not taken, nor is a sentence."""
AGENT_MODULES = (*sorted((REPO / "kai_fractions/node").glob("*.py")),
                 *sorted((REPO / "kai_fractions/node/agent").glob("*.py")),
                 REPO / "kai_fractions/node/mps/errors.py")
OWN_TABLES = {"events.py", "condition.py", "marker_probe.py", "blindness.py"}
"""Modules whose reasons have a table of their own on the page (the events, the node
condition, the reasons of the GPU-usage metrics): those may be anywhere on it."""
NOT_REPORTED = {
    "GPUMemoryOverCap": "watchdog_types.Violation.reason: the agent reports an episode above a "
                        "cap as the event LimitViolation, never under this name",
}
NAMED_BY_THE_REVIEW = {"CgroupNotFound", "MPSUnavailable", "AnnotationsNotWritten",
                       "MarkerNotWritten", "MPSPipeLinkFailed", "NotListed", "NotReconciled"}


def section(text: str, start: str, end: str) -> str:
    """From `start` to the next `end` after it, or to the end of `text`."""
    rest = text[text.index(start):]
    stop = rest.find(end, len(start))
    return rest if stop < 0 else rest[:stop]


def false_reasons() -> set[str]:
    """The reasons `condition.evaluate` can give with status False: the second argument of
    each `Condition(False, ...)` in the module, every UPPER_CASE name in it (`A if x else B`
    gives two), read from the source and resolved in the module."""
    tree = ast.parse(Path(condition.__file__).read_text())
    out = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id == "Condition" and len(node.args) >= 2
                and isinstance(node.args[0], ast.Constant) and node.args[0].value is False):
            out |= {getattr(condition, n.id) for n in ast.walk(node.args[1])
                    if isinstance(n, ast.Name) and n.id.isupper()}
    return out


def test_the_chart_troubleshooting_bullet_names_every_false_reason_of_the_condition() -> None:
    """The alert KaiFractionsNodeNotReady sends an operator to docs/chart.md "Troubleshooting",
    whose bullet "The node condition is False" named 4 of the 9 False reasons: a node not
    ready for `WatchdogBlind`, say, found nothing there. Now each has a clause, and the bullet
    points to the full table."""
    reasons = false_reasons()
    assert {"NVMLUnavailable", "NotReconciling", "MarkerDirectoryNotWritable",
            "MemoryLimitsNotSettable", "ComputeModeNotInForce", "WatchdogBlind"} <= reasons
    chart = (REPO / "docs/chart.md").read_text()
    bullet = section(section(chart, "## Troubleshooting", "\n## "),
                     "**The node condition is False**", "\n- **")
    missing = sorted(r for r in reasons if f"`{r}`" not in bullet)
    assert not missing, f"docs/chart.md, the bullet \"The node condition is False\": {missing}"
    assert 'docs/node-agent.md, "Node condition"' in " ".join(bullet.split())


def reported_reasons() -> dict[str, set[str]]:
    """reason -> the modules that define it, read from the agent's sources (kai_fractions/node,
    its agent/ and mps/errors.py) without importing them, so a new reason is found however it
    is reported. A reason is:
    - the value of a module-level UPPER_CASE constant;
    - a class's `reason = ...` (the typed errors: NVML's, MPS's), or an UPPER_CASE member of a
      class named `...Reason` (the refusals' StrEnum);
    - a literal given as `reason=...` (`min(errors, default="NotReconciled")` included) or
      added to a pass's `errors` set (`errors.add("PodUnreadable")`);
    in each case only a value spelled as a reason (`REASON`)."""
    found: dict[str, set[str]] = {}

    def take(node: ast.AST, module: str) -> None:
        for n in ast.walk(node):
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and \
                    REASON.fullmatch(n.value):
                found.setdefault(n.value, set()).add(module)

    for path in AGENT_MODULES:
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(
                    node.value, ast.Constant):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id.isupper() for t in targets):
                    take(node.value, path.name)
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.Assign) and any(
                            isinstance(t, ast.Name) and (t.id == "reason" or (
                                t.id.isupper() and node.name.endswith("Reason")))
                            for t in item.targets):
                        take(item.value, path.name)
        for node in ast.walk(tree):
            if isinstance(node, ast.keyword) and node.arg == "reason":
                take(node.value, path.name)
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "add" and isinstance(node.func.value, ast.Name)
                    and node.func.value.id == "errors"):
                take(node, path.name)
    return found


def test_node_agent_doc_explains_every_reason_the_agent_reports() -> None:
    """Pending and pass-error reasons (the container reasons GetNodeState gives, the reason
    labels of kai_fractions_reconcile_errors_total) such as `CgroupNotFound` or `NotListed`
    were in no doc: an operator with a pod stuck in its gate, or the alert
    KaiFractionsReconcileErrors, had only the name. Now docs/node-agent.md "Pending and
    pass-error reasons" lists each with what it means and what to check first; a reason of the
    events', the node condition's or the usage metrics' own tables is enough there."""
    found = reported_reasons()
    assert set(found) >= NAMED_BY_THE_REVIEW
    assert set(NOT_REPORTED) <= set(found), "an exclusion no longer needed: drop it"
    assert len(found) > 60  # the collection still works
    page = (REPO / "docs/node-agent.md").read_text()
    assert "\n## Pending and pass-error reasons\n" in page
    own = section(page, "## Pending and pass-error reasons", "\n## ")
    missing = []
    for reason, modules in sorted(found.items()):
        if reason in NOT_REPORTED:
            continue
        where = page if modules <= OWN_TABLES else own
        if f"`{reason}`" not in where:
            missing.append(f"{reason} ({', '.join(sorted(modules))})")
    assert not missing, ("not in docs/node-agent.md, \"Pending and pass-error reasons\" (or, "
                         "for events and conditions, on the page): " + ", ".join(missing))


def test_the_upgrading_section_names_the_node_conditions_this_release_added() -> None:
    """An upgrade review (R12): on a node whose limit sets fail or are rounded, an upgraded
    agent sets aside running pods' markers and turns the node False, where the release before
    reported them applied; the chart's "Upgrading" section (and the README) must say so."""
    text = (REPO / "docs/chart.md").read_text()
    upgrading = section(text, "## Upgrading", "\n## ")
    for word in ("MemoryLimitsNotSettable", "LimitNotReadBack", "MarkerDirectoryNotWritable"):
        assert word in upgrading, word
    assert "MemoryLimitsNotSettable" in section((REPO / "README.md").read_text(),
                                                "**Upgrade note:** a GPU memory limit", "\n\n")
