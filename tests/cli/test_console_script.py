"""The installed `kai-fractions` console script, run once as a real process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from .helpers import data


def test_console_script_exit_code_and_output() -> None:
    script = Path(sys.executable).parent / "kai-fractions"
    assert script.is_file(), f"{script} missing: run `pip install -e '.[test]'`"
    result = subprocess.run(
        [str(script), "validate", "-f", data("invalid-job.yaml"), "-f", data("valid-pod.yaml")],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert result.returncode == 1, result.stderr
    assert result.stdout.splitlines() == [
        f"{data('invalid-job.yaml')}:1: Job/ml/train/trainer: gpu-fraction: must be a portion "
        "of one GPU, 0 < x < 1 (got '50')"]
    assert "Traceback" not in result.stderr
    assert "1 of 2 object(s) valid" in result.stderr
