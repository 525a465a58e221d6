"""What a marker set aside for the MPS daemon says (`reconciler._not_running_cause`): a daemon
that is not running, or one that runs but was not adopted (started by someone else with another
GPU numbering: `kai_fractions.node.mps.adoption`), which holds nothing the agent set either."""

from __future__ import annotations

from kai_fractions.node.agent.reconciler import _not_running_cause
from kai_fractions.node.mps.errors import DAEMON_ALREADY_RUNNING, MPS_DAEMON_UNREACHABLE, MpsError


def test_a_daemon_not_adopted_is_not_called_not_running() -> None:
    why = _not_running_cause(MpsError(DAEMON_ALREADY_RUNNING, "pid 7 runs with CUDA_DEVICE_ORDER "
                                      "unset"))
    assert why.startswith("the MPS control daemon that runs is not one the agent can use "
                          "(MpsDaemonAlreadyRunning: pid 7 runs with CUDA_DEVICE_ORDER unset)")
    assert "not running" not in why


def test_a_daemon_gone_is_not_running() -> None:
    why = _not_running_cause(MpsError(MPS_DAEMON_UNREACHABLE, "no daemon"))
    assert why.startswith("the MPS control daemon is not running (MpsDaemonUnreachable")
