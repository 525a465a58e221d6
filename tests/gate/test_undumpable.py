"""The gate makes itself undumpable first thing: a process of its user in its process namespace
cannot ptrace it into exiting 0 (the webhook also refuses `exec` into it)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kai_fractions import undumpable
from kai_fractions.cli import main

from .pods import UID
from .test_cli import pod_files


@pytest.fixture
def calls(monkeypatch) -> Iterator[list[str]]:
    """make_undumpable's calls, none real, with the once-per-process outcome forgotten."""
    made: list[str] = []
    undumpable.undumpable_once.cache_clear()
    monkeypatch.setattr(undumpable, "make_undumpable", lambda: made.append("undumpable"))
    yield made
    undumpable.undumpable_once.cache_clear()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
def test_make_undumpable_clears_the_dumpable_flag() -> None:
    probe = ("import ctypes; from kai_fractions.undumpable import make_undumpable; "
             "before = ctypes.CDLL(None).prctl(3, 0, 0, 0, 0); "
             "print(before, make_undumpable(), ctypes.CDLL(None).prctl(3, 0, 0, 0, 0))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=60, check=True)
    assert done.stdout.split() == ["1", "None", "0"]


def test_the_gate_is_made_undumpable_once(tmp_path: Path, calls: list[str]) -> None:
    assert main(["gate", *pod_files(tmp_path, with_marker=True), "--pod-uid", UID]) == 0
    assert calls == ["undumpable"]


def test_no_other_command_is_made_undumpable(tmp_path: Path, calls: list[str], capsys) -> None:
    main(["validate", "-f", str(tmp_path / "missing.yaml")])
    assert calls == []


def test_it_happens_before_the_commands_are_imported() -> None:
    """The CLI imports every command module to build its parser (about 0.1 s): the gate is
    undumpable before the first of them, so nothing can attach while it starts."""
    probe = ("import sys; import kai_fractions.undumpable as u; real = u.make_undumpable\n"
             "def spy():\n"
             "    print('kai_fractions.cli.mirror' in sys.modules, 'kai_fractions.gate' in "
             "sys.modules); return real()\n"
             "u.make_undumpable = spy\n"
             "from kai_fractions.cli import main; main(['gate', '--pod-uid', ''])")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=60)
    assert done.stdout.split() == ["False", "False"], done.stderr


def test_a_refusal_is_a_warning_not_a_failure(tmp_path: Path, monkeypatch, capsys) -> None:
    """The webhook's refusal of exec into the gate still holds; the pod is not failed for a
    kernel without prctl."""
    undumpable.undumpable_once.cache_clear()
    monkeypatch.setattr(undumpable, "make_undumpable", lambda: "Operation not permitted")
    try:
        code = main(["gate", *pod_files(tmp_path, with_marker=True), "--pod-uid", UID])
    finally:
        undumpable.undumpable_once.cache_clear()  # no other test inherits the refusal
    err = capsys.readouterr().err
    assert "kai-fractions gate: warning: cannot make the gate undumpable: Operation not " \
        "permitted" in err
    assert code == 0
