"""The fake NVML library under AddressSanitizer/LeakSanitizer/UBSan, driven by selftest.c
(every exported call, config rewrites under 4 threads, injected errors, state and log)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.support import tools

FAKES = tools.REPO_ROOT / "tests" / "fakes" / "nvml"


def test_fake_nvml_is_clean_under_sanitizers(tmp_path: Path) -> None:
    binary = tmp_path / "selftest"
    subprocess.run(
        [
            "gcc",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-O1",
            "-g",
            "-fno-omit-frame-pointer",
            "-fsanitize=address,undefined",
            "-fno-sanitize-recover=all",
            "-pthread",
            f"-I{tools.nvml_header().parent}",
            "-o",
            str(binary),
            str(FAKES / "selftest.c"),
            str(FAKES / "fake_nvml.c"),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("KAI_FAKE_NVML")}
    env["ASAN_OPTIONS"] = "detect_leaks=1:halt_on_error=1"
    env["UBSAN_OPTIONS"] = "print_stacktrace=1:halt_on_error=1"
    res = subprocess.run(
        [str(binary), str(tmp_path)], env=env, capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.strip() == "selftest: ok"
    assert "Sanitizer" not in res.stderr
    # 4 threads x 200 SetMemoryLimits + 5 from the single-threaded part
    log = (tmp_path / "nvml.conf.log").read_text().splitlines()
    assert sum(1 for line in log if line.startswith("SetMemoryLimits")) == 805
