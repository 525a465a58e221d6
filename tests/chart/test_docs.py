"""docs/chart.md stays true to the chart: the KAI values it pairs with are the ones the chart
assumes, it never recommends the switch that installs the upstream gpu-fractioning operator, and
it documents the values this chart has for KAI."""

from __future__ import annotations

import re

import yaml

from .render import CHART, REPO

DOC = (REPO / "docs" / "chart.md").read_text()
VALUES = yaml.safe_load((CHART / "values.yaml").read_text())


def _kai_rows() -> dict[str, str]:
    """The 'KAI value | set it to | why' table: value -> what to set it to."""
    section = DOC.split("## Pairing with KAI Scheduler's chart", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([^`]+)` \| ([^|]+) \|", section, flags=re.M)
    return {name: setting.strip() for name, setting in rows}


def test_kai_is_installed_in_the_namespace_the_chart_assumes():
    install = re.search(r"helm upgrade --install kai-scheduler <KAI chart> -n (\S+)", DOC)
    assert install is not None
    assert install.group(1) == VALUES["kaiScheduler"]["namespace"]
    assert "--set global.gpuSharingMode=NvFractions" in DOC


def test_kai_values_by_their_current_names():
    rows = _kai_rows()
    assert rows["global.gpuSharingMode"] == "`NvFractions`"
    assert rows["global.nvFractions.set"] == "**leave it `false`**"  # never true
    assert "binder.runtimeClassName" in rows  # KAI's reservation pods
    assert "admission.gpuFractionRuntimeClassName" in rows  # fractional pods
    assert "admission.gpuPodRuntimeClassName" not in rows  # deprecated: named, never advised
    assert "`admission.gpuPodRuntimeClassName` is its deprecated name" in DOC


def test_this_charts_kai_values_are_documented_with_their_defaults():
    documented = {
        "kaiScheduler.dialect": VALUES["kaiScheduler"]["dialect"],
        "mirror.reserveMiB": VALUES["mirror"]["reserveMiB"],
        "mirror.writeAsBinder": VALUES["mirror"]["writeAsBinder"],
    }
    for name, default in documented.items():
        shown = str(default).lower()
        assert re.search(rf"^\| `{re.escape(name)}` \| `{shown}` \|", DOC, flags=re.M), name
    assert "| `gpuFractioningConfig.enabled` / `.reportIntervalSeconds` | `true` / `10` |" in DOC
    assert VALUES["gpuFractioningConfig"]["enabled"] is True
    assert VALUES["gpuFractioningConfig"]["reportIntervalSeconds"] == 10
    assert "### KAI versions and dialects" in DOC
    assert "### Check after install" in DOC
