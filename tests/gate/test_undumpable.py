"""The gate makes itself undumpable before it waits: a process of its user in its process
namespace cannot ptrace it into exiting 0 (the webhook also refuses `exec` into it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kai_fractions.cli import main

from .pods import UID
from .test_cli import pod_files

PR_GET_DUMPABLE = 3


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
def test_make_undumpable_clears_the_dumpable_flag() -> None:
    probe = ("import ctypes; from kai_fractions.gate.undumpable import make_undumpable; "
             "before = ctypes.CDLL(None).prctl(3, 0, 0, 0, 0); "
             "print(before, make_undumpable(), ctypes.CDLL(None).prctl(3, 0, 0, 0, 0))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=60, check=True)
    assert done.stdout.split() == ["1", "None", "0"]


def test_the_gate_command_makes_itself_undumpable_first(tmp_path: Path, monkeypatch,
                                                          capsys) -> None:
    calls: list[str] = []
    monkeypatch.setattr("kai_fractions.gate.undumpable.make_undumpable",
                        lambda: calls.append("undumpable") or None)
    assert main(["gate", *pod_files(tmp_path, with_marker=True), "--pod-uid", UID]) == 0
    assert calls == ["undumpable"]


def test_a_refusal_is_a_warning_not_a_failure(tmp_path: Path, monkeypatch, capsys) -> None:
    """The webhook's refusal of exec into the gate still holds; the pod is not failed for a
    kernel without prctl."""
    monkeypatch.setattr("kai_fractions.gate.undumpable.make_undumpable",
                        lambda: "Operation not permitted")
    code = main(["gate", *pod_files(tmp_path, with_marker=True), "--pod-uid", UID])
    err = capsys.readouterr().err
    assert "kai-fractions gate: warning: cannot make the gate undumpable: Operation not " \
        "permitted" in err
    assert code == 0
