"""docs/chart.md stays true to the chart: the KAI values it pairs with are the ones the chart
assumes, it never recommends the switch that installs the upstream gpu-fractioning operator, and
it documents the values this chart has for KAI."""

from __future__ import annotations

import re

import yaml

from .render import CHART, EXAMPLES, REPO

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


def _install_commands(text: str) -> list[str]:
    """Every `helm install|upgrade --install ... charts/kai-fractions` command, with its
    continuation lines."""
    out = []
    for m in re.finditer(r"^[ \t]*helm (?:install|upgrade --install) kai-fractions "
                         r"charts/kai-fractions(?:[^\n]*\\\n)*[^\n]*", text, flags=re.M):
        out.append(m.group(0))
    return out


def test_documented_install_commands_set_the_image():
    """The chart refuses to render without image.repository (no image is published): every
    install command a reader may copy sets it, and the tag."""
    for path in (REPO / "docs" / "chart.md", REPO / "README.md"):
        commands = _install_commands(path.read_text())
        assert commands, path.name
        for command in commands:
            assert "image.repository=<registry>/kai-fractions" in command, command
            assert "image.tag=<version>" in command, command
    assert len(_install_commands(DOC)) == 3  # Install, Pairing with KAI, the ci/ example


def test_namespaces_that_run_fractions_are_documented():
    """The gate runs the chart's image in the workloads' namespaces (the chart's pull secrets
    do not reach them) and mounts a hostPath (Pod Security `privileged`); the critical priority
    classes may be refused outside kube-system."""
    section = DOC.split("### Namespaces that run fractional pods", 1)[1].split("\n## ", 1)[0]
    for text in (section, (EXAMPLES / "README.md").read_text()):
        text = " ".join(text.split())
        assert "kai-fractions-gate" in text
        assert "pull secret" in text and "imagePullSecrets" in text
        assert "pod-security.kubernetes.io/enforce=privileged" in text
        assert "`baseline` and `restricted` forbid" in text
    assert "ResourceQuota" in DOC and "GKE" in DOC
    assert "`nodeAgent.priorityClassName`" in DOC and "`webhook.priorityClassName`" in DOC


def test_docs_cite_code_by_symbol_not_by_line_number():
    """`service.py:62` goes stale with the next edit above line 62; a module and a function or
    constant name (`mirror/service.py` `NODE_LABELS_TTL`) stays true or fails a grep."""
    pages = [REPO / "README.md", REPO / "SECURITY.md", *sorted((REPO / "docs").glob("*.md")),
             *sorted(EXAMPLES.glob("*.md"))]
    cited = re.compile(r"[\w./-]+\.(?:py|go|yaml|proto|sh):\d+")
    found = {p.name: cited.findall(p.read_text()) for p in pages if p.exists()}
    assert not {name: hits for name, hits in found.items() if hits}
