"""The CLI tools from scripts/test-tools.sh run (helm v4 has no --version: ``helm version``)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.support.tools import ToolPaths


def _run(*args: str | Path) -> str:
    res = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout + res.stderr


def test_helm_runs(helm_bin: Path) -> None:
    assert _run(helm_bin, "version", "--short").startswith("v4.")


def test_kubectl_runs(kubectl_bin: Path) -> None:
    assert "Client Version: v1.35." in _run(kubectl_bin, "version", "--client")


def test_grpcurl_runs(grpcurl_bin: Path) -> None:
    assert _run(grpcurl_bin, "-version").strip() == "grpcurl v1.8.6"


def test_buf_runs(buf_bin: Path) -> None:
    assert _run(buf_bin, "--version").strip().startswith("1.")


def test_promtool_runs(promtool_bin: Path) -> None:
    assert _run(promtool_bin, "--version").startswith("promtool, version 2.")


def test_tool_paths_fixture(tool_paths: ToolPaths) -> None:
    assert all(
        p.is_file()
        for p in (tool_paths.helm, tool_paths.kubectl, tool_paths.grpcurl, tool_paths.buf)
    )
