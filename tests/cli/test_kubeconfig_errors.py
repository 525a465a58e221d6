"""A kubeconfig that is not YAML, or not a mapping, given with --kubeconfig or found through
$KUBECONFIG: every command that reads one says which file and what is wrong in one line and
exits 2 (the official loader's YAML error or TypeError was a traceback)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from kubernetes.config import kube_config

from .helpers import cli

BROKEN = {
    "not YAML": ("garbage: [\n", "not valid YAML at line 2:1: expected the node content, but "
                 "found '<stream end>'"),
    "a list": ("- a\n- b\n", "not a mapping (a kubeconfig's top level is one: apiVersion, "
               "clusters, contexts, users...), got a list"),
    "clusters not a list": ("clusters: 5\n", "clusters must be a list of mappings, each with "
                            "a name"),
}
COMMANDS = {
    "inspect node": ["inspect", "node", "gpu-node-1"],
    "inspect pod": ["inspect", "pod", "team-a/train"],
    "inspect mirror": ["inspect", "mirror"],
    "mirror": ["mirror"],
    "node-agent": ["node-agent", "--node-name", "n1"],
}


@pytest.mark.parametrize("broken", list(BROKEN))
@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_broken_kubeconfig_file_is_one_line_and_exit_2(tmp_path: Path, capsys, broken: str,
                                                         command: str) -> None:
    text, problem = BROKEN[broken]
    path = tmp_path / "kubeconfig"
    path.write_text(text)
    code, out, err = cli(capsys, *COMMANDS[command], "--kubeconfig", str(path))
    prefix = command.split()[0]
    assert (code, out, err) == (2, "", f"kai-fractions {prefix}: kubeconfig {path}: {problem}\n")


@pytest.mark.parametrize("command", ["inspect pod", "mirror"])
def test_a_broken_kubeconfig_in_the_kubeconfig_path_is_named(
        tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch, command: str) -> None:
    """$KUBECONFIG (read once by the official client, as its default location): a list of
    files, the broken one named."""
    good, bad = tmp_path / "good", tmp_path / "bad"
    good.write_text("apiVersion: v1\nkind: Config\n")
    bad.write_text("- a\n")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # not in-cluster
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION",
                        f"{good}{os.pathsep}{tmp_path / 'missing'}{os.pathsep}{bad}")
    code, _, err = cli(capsys, *COMMANDS[command])
    assert code == 2
    assert err.startswith(f"kai-fractions {command.split()[0]}: kubeconfig {bad}: not a "
                          "mapping"), err
    assert err.count("\n") == 1


def test_python_dash_m_with_a_broken_kubeconfig_env(tmp_path: Path) -> None:
    """`python -m kai_fractions.cli` runs the CLI; $KUBECONFIG as a user's shell sets it."""
    bad = tmp_path / "kubeconfig"
    bad.write_text("garbage: [\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    env["KUBECONFIG"] = str(bad)
    result = subprocess.run([sys.executable, "-m", "kai_fractions.cli", "inspect", "node", "n"],
                            capture_output=True, text=True, env=env, timeout=60, check=False)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (f"kai-fractions inspect: kubeconfig {bad}: not valid YAML at line "
                             "2:1: expected the node content, but found '<stream end>'\n")
