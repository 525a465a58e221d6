"""`kai-fractions node-agent --cgroup-root`: the agent starts only on a cgroup v2 hierarchy."""

from __future__ import annotations

from pathlib import Path

import pytest

from kai_fractions.cli import main


def test_a_cgroup_root_that_is_not_cgroup_v2_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """NVML's limits name cgroup v2 directories and the watchdog reads the v2 line of
    /proc/<pid>/cgroup: a v1 hierarchy would have the agent report limits that do not hold."""
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: c, cluster: {server: 'https://127.0.0.1:1'}}]\n"
        "contexts: [{name: c, context: {cluster: c, user: u}}]\nusers: [{name: u, user: {}}]\n")
    import kai_fractions.node.agent.agent as agent_module

    def started(**_kw):  # a refusal that is missing would start the agent and never return
        raise AssertionError("the agent started on a cgroup v1 root")
    monkeypatch.setattr(agent_module, "NodeAgent", started)
    v1 = tmp_path / "cgroup"
    (v1 / "memory").mkdir(parents=True)  # what a v1 hierarchy has: one directory per controller
    code = main(["node-agent", "--node-name", "n1", "--kubeconfig", str(kubeconfig),
                 "--cgroup-root", str(v1)])
    assert code == 2
    assert capsys.readouterr().err.startswith(
        f"kai-fractions node-agent: --cgroup-root {v1}: not a cgroup v2 hierarchy (no "
        "cgroup.controllers there): GPU memory limits and the watchdog need cgroup v2")
