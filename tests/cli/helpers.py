"""Run `kai-fractions` in-process and capture exit code, stdout and stderr."""

from __future__ import annotations

from pathlib import Path

import pytest

from kai_fractions.cli import main

DATA = Path(__file__).resolve().parent / "data"
GPU_A = "GPU-3f2a1b4c-0d5e-6f70-8192-a3b4c5d6e7f8"
GPU_B = "GPU-77b1c2d3-e4f5-0617-2839-4a5b6c7d8e9f"


def data(name: str) -> str:
    return str(DATA / name)


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Exit code, stdout, stderr. Any exception other than SystemExit escapes and fails the
    test: to a user it would be a traceback."""
    try:
        code = main(list(argv))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 2
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err
