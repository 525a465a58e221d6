"""A pass error that lasts is logged once, naming the containers it holds pending, and its end
too: limits that could not be applied were before seen only in a counter without the node."""

from __future__ import annotations

import logging
from pathlib import Path

from kai_fractions.node.agent.pass_errors import PassErrorLog

from .builders import Rig, binder_annotations, pod


def test_a_lasting_pass_error_is_logged_once_with_its_containers(short_tmp: Path,
                                                                   caplog) -> None:
    rig = Rig(short_tmp)
    rig.add(pod("p", notes=binder_annotations(devices=rig.gpu0)))
    rig.nvml.fail("set_memory_limits", "NoPermission", times=None)
    now = [0.0]
    errors = PassErrorLog(lambda: now[0], persist=30)
    with caplog.at_level(logging.INFO, logger="kai_fractions.node.agent.pass_errors"):
        for now[0] in (0.0, 10.0, 29.0):  # a short wait is not worth a line
            errors.update(rig.step().errors, lambda: rig.reconciler.view)
        assert caplog.records == []
        for now[0] in (31.0, 45.0, 90.0):
            errors.update(rig.step().errors, lambda: rig.reconciler.view)
        (warned,) = caplog.records
        assert warned.levelno == logging.WARNING
        assert warned.getMessage().startswith(
            "reconcile passes have reported MemoryLimitNotInForce for 31 s: 1 container(s) "
            "pending: default/p/main: ")
        rig.nvml.clear_failures()
        now[0] = 95.0
        errors.update(rig.step().errors, lambda: rig.reconciler.view)
    assert [r.getMessage() for r in caplog.records[1:]] == [
        "reconcile: MemoryLimitNotInForce no longer reported"]
