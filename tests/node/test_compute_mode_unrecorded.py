"""A GPU in EXCLUSIVE_PROCESS with no fractional container and no record of the agent's switch
is left as it is: an administrator's choice, or the switch of a release before the record
(`LimitLedger.save_modes`), which nothing gives back. The agent says so once in its log, with
the command that resets it, so that an upgrade does not leave such a GPU unexplained (a
whole-GPU pod placed there can open one CUDA context only)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kai_fractions.node.nvml import GpuComputeMode

from .nodepods import GPU0, GPU1
from .test_engine import Node, sm_pod

EXCLUSIVE, DEFAULT = GpuComputeMode.EXCLUSIVE_PROCESS, GpuComputeMode.DEFAULT
LOGGER = "kai_fractions.node.engine_compute_modes"
SAID = "left as it is; if an earlier kai-fractions release set it"


def said(caplog: pytest.LogCaptureFixture, uuid: str) -> int:
    return sum(1 for r in caplog.records
               if SAID in r.getMessage() and f"nvidia-smi -i {uuid} -c DEFAULT" in r.getMessage())


def test_a_gpu_switched_before_the_record_is_logged_once_and_left(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    node = Node(tmp_path / "cgroup")
    node.nvml.gpu(GPU0).compute_mode = EXCLUSIVE  # an earlier release's switch, unrecorded
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        node.apply(sm_pod())  # its container still runs: nothing to say yet
        assert said(caplog, GPU0) == 0
        node.apply()  # it is gone
        node.apply()
        node.apply()
    assert said(caplog, GPU0) == 1  # the first pass that sees it, only
    assert said(caplog, GPU1) == 0  # in DEFAULT: nothing to say
    assert node.nvml.gpu(GPU0).compute_mode is EXCLUSIVE
    assert node.nvml.calls_of("set_compute_mode") == []
    assert node.ledger.modes == {}


def test_it_is_said_again_after_it_was_reset_and_set_again(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    node = Node(tmp_path / "cgroup")
    node.nvml.gpu(GPU0).compute_mode = EXCLUSIVE
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        node.apply()
        node.nvml.gpu(GPU0).compute_mode = DEFAULT  # reset by hand
        node.apply()
        node.nvml.gpu(GPU0).compute_mode = EXCLUSIVE  # and set again by someone
        node.apply()
    assert said(caplog, GPU0) == 2


def test_a_gpu_the_agent_switched_is_given_back_without_a_word(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    node = Node(tmp_path / "cgroup")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        node.apply(sm_pod())
        node.apply()
    assert node.nvml.gpu(GPU0).compute_mode is DEFAULT
    assert said(caplog, GPU0) == 0
