"""Paths of the real tools the tests run (``scripts/test-tools.sh`` puts them into ``.tools/``).

Every accessor raises :class:`ToolMissingError` (a test *error*, never a skip) naming the script
to run when the tool is not there.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
TOOLS_DIR = REPO_ROOT / ".tools"
FAKE_NVML_SOURCE = REPO_ROOT / "tests" / "fakes" / "nvml" / "fake_nvml.c"
FAKE_NVML_VARIANTS = ("full", "old-driver")


class ToolMissingError(RuntimeError):
    """A test tool is not installed; the message says how to get it."""


def _require(path: Path, what: str, *, executable: bool = True) -> Path:
    if not path.exists() or (executable and not os.access(path, os.X_OK)):
        raise ToolMissingError(
            f"{what} is missing at {path}: run scripts/test-tools.sh "
            "(scripts/test runs it on a fresh clone)"
        )
    return path


def helm() -> Path:
    return _require(TOOLS_DIR / "bin" / "helm", "helm")


def kubectl() -> Path:
    return _require(TOOLS_DIR / "bin" / "kubectl", "kubectl")


def grpcurl() -> Path:
    return _require(TOOLS_DIR / "bin" / "grpcurl", "grpcurl")


def buf() -> Path:
    """``buf`` from the pip extra ``buf-bin``, next to the running interpreter (the venv)."""
    for candidate in (Path(sys.prefix) / "bin" / "buf", REPO_ROOT / ".venv" / "bin" / "buf"):
        if candidate.exists():
            return candidate
    raise ToolMissingError(
        "buf is missing from the venv: run scripts/bootstrap test (pip extra buf-bin)"
    )


def nvml_header() -> Path:
    return _require(TOOLS_DIR / "nvml" / "include" / "nvml.h", "nvml.h", executable=False)


def fake_nvml_library(variant: str = "full") -> Path:
    """The fake ``libnvidia-ml.so.1``: ``variant`` is ``"full"`` or ``"old-driver"``."""
    if variant not in FAKE_NVML_VARIANTS:
        raise ValueError(f"unknown fake NVML variant {variant!r}; one of {FAKE_NVML_VARIANTS}")
    path = _require(
        TOOLS_DIR / "nvml" / variant / "libnvidia-ml.so.1",
        f"the fake NVML library ({variant})",
        executable=False,
    )
    if FAKE_NVML_SOURCE.exists() and FAKE_NVML_SOURCE.stat().st_mtime > path.stat().st_mtime:
        raise ToolMissingError(
            f"{path} is older than {FAKE_NVML_SOURCE}: run scripts/test-tools.sh to rebuild it"
        )
    return path


def mps_control() -> Path:
    """The real ``nvidia-cuda-mps-control`` (Debian non-free ``nvidia-cuda-mps``)."""
    return _require(
        TOOLS_DIR / "mps" / "usr" / "bin" / "nvidia-cuda-mps-control", "nvidia-cuda-mps-control"
    )


def real_nvml_library() -> Path:
    """The real ``libnvidia-ml.so.1`` (Debian non-free ``libnvidia-ml1``); no driver here."""
    return _require(
        TOOLS_DIR / "nvidia-real" / "lib" / "libnvidia-ml.so.1",
        "the real libnvidia-ml.so.1",
        executable=False,
    )


def real_nvidia_smi() -> Path:
    """The real ``nvidia-smi`` (Debian non-free); exits 9 without a driver."""
    return _require(TOOLS_DIR / "nvidia-real" / "bin" / "nvidia-smi", "nvidia-smi")


def promtool() -> Path:
    """The real ``promtool`` (Debian ``prometheus``): checks and unit-tests alerting rules."""
    return _require(TOOLS_DIR / "prometheus" / "bin" / "promtool", "promtool")


@dataclass(frozen=True)
class ToolPaths:
    helm: Path
    kubectl: Path
    grpcurl: Path
    buf: Path


# ----------------------------------------------------------------------------------------------
# fixtures (registered through tests/conftest.py pytest_plugins)


@pytest.fixture(scope="session")
def tool_paths() -> ToolPaths:
    """All CLI tools at once; errors (not skips) when one is missing."""
    return ToolPaths(helm=helm(), kubectl=kubectl(), grpcurl=grpcurl(), buf=buf())


@pytest.fixture(scope="session")
def helm_bin() -> Path:
    return helm()


@pytest.fixture(scope="session")
def kubectl_bin() -> Path:
    return kubectl()


@pytest.fixture(scope="session")
def grpcurl_bin() -> Path:
    return grpcurl()


@pytest.fixture(scope="session")
def buf_bin() -> Path:
    return buf()


@pytest.fixture(scope="session")
def promtool_bin() -> Path:
    return promtool()
