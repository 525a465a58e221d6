"""NVIDIA's real user-space pieces from Debian non-free (driver 535) on a machine without a GPU
driver: the honest "no driver" path."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.support import tools

SCRIPT = """
import pynvml
try:
    pynvml.nvmlInit()
except pynvml.NVMLError as e:
    print(type(e).__name__, e.value)
else:
    print("initialised")
"""


def _env_with_real_nvml() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KAI_FAKE_NVML")}
    env["LD_LIBRARY_PATH"] = str(tools.real_nvml_library().parent)
    return env


def test_real_libnvidia_ml_raises_driver_not_loaded() -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        env=_env_with_real_nvml(),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.strip()
    # The real library loads (so not LibraryNotFound) and reports the missing kernel driver.
    assert out == "NVMLError_DriverNotLoaded 9"


def test_real_nvidia_smi_exits_9_without_driver() -> None:
    res = subprocess.run(
        [str(tools.real_nvidia_smi())],
        env=_env_with_real_nvml(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 9
    assert "couldn't communicate with the NVIDIA driver" in res.stdout + res.stderr
