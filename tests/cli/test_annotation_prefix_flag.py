"""Every component that takes `--annotation-prefix` refuses a prefix that cannot make a valid
annotation key with the same line (`--annotation-prefix: <the rule>`), exit 2, before it does
anything else."""

from __future__ import annotations

from pathlib import Path

import pytest

from kai_fractions.cli import main
from kai_fractions.contract import Keys

BAD = ["a/.", "example.com/.", "example..com/x.", "Example.com/x.",
       "example.com/" + "a" * 42 + ".", ""]


def commands(tmp: Path) -> dict[str, list[str]]:
    pod = tmp / "pod.yaml"
    pod.write_text("apiVersion: v1\nkind: Pod\nmetadata: {name: p}\n"
                   "spec: {containers: [{name: main, image: x}]}\n")
    return {
        "mirror": ["mirror"],
        "node-agent": ["node-agent", "--node-name", "n1"],
        "validate": ["validate", "-f", str(pod)],
        "plan": ["plan", "-f", str(pod), "--node-gpu-memory", "40960", "--devices", "GPU-a"],
        "inspect": ["inspect", "node", "n1"],
        "admission": ["admission", "--tls-cert", "/nonexistent/c", "--tls-key", "/nonexistent/k",
                      "--gate-image", "img"],
    }


def rule(prefix: str) -> str:
    try:
        Keys(prefix=prefix)
    except ValueError as e:
        return str(e)
    raise AssertionError(f"{prefix!r} is accepted")


@pytest.mark.parametrize("prefix", BAD)
def test_every_component_says_the_same(tmp_path: Path, capsys, prefix: str):
    said = {}
    for name, argv in commands(tmp_path).items():
        assert main([*argv, "--annotation-prefix", prefix]) == 2, name
        err = capsys.readouterr().err
        assert err.startswith(f"kai-fractions {name}: "), (name, err)
        said[name] = err.split(": ", 1)[1]
    assert set(said.values()) == {f"--annotation-prefix: {rule(prefix)}\n"}, said
