"""A daemon the agent does not adopt (started by someone else with another GPU numbering:
`kai_fractions.node.mps.adoption`) runs: it is not "not running", and the agent does not start
another while it holds the pipe directory. What a pod relying on MPS is told (its result, its
`MpsCapNotInForce` event, GetNodeState) says so and ends with the remedy, stopping that daemon,
as the set-aside marker's own cause does (`reconciler._not_running_cause`). It used to say "the
MPS control daemon is not running ... the agent starts it again ... check
--mps-control-binary", which sends the reader to the wrong fix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kai_fractions.node.agent.grpc_service import node_state
from kai_fractions.node.mps.adoption import NOT_USABLE, environment_problem, stop_it
from kai_fractions.node.mps.control import control_env
from kai_fractions.node.mps.errors import DAEMON_ALREADY_RUNNING

from .builders import NODE, Rig, binder_annotations, pod
from .builders import result_of as result
from .test_mps_daemon_down import _gate, _set_aside

SETUPS: dict[str, tuple[dict[str, Any], str]] = {
    # a namespace and its percentage, and the pinned limit (the defaults)
    "v3": ({}, "MPS namespace kf_"),
    # no namespaces: the MPS server enforces its share of the SMs
    "client-env": (dict(mps_v3=False, memory_enforcement="cgroup,watchdog"),
                   "its share of the SMs"),
}
WRONG = ("the MPS control daemon is not running", "the agent starts it again",
         "--mps-control-binary")


def _refused(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> str:
    """Makes the supervisor answer as `MpsDaemon` does for a daemon it does not adopt; returns
    the refusal's message."""
    pipe = rig.mps.control.pipe_dir
    err = environment_problem(4242, {}, control_env(pipe, "/var/log/kai-fractions/mps"), pipe)
    assert err is not None and err.reason == DAEMON_ALREADY_RUNNING

    def ensure_running() -> bool:
        rig.mps.last_error, rig.mps.not_running = err, True
        return False

    monkeypatch.setattr(rig.mps, "ensure_running", ensure_running)
    return err.message


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_a_daemon_not_adopted_is_named_so_with_its_remedy(
        short_tmp: Path, monkeypatch: pytest.MonkeyPatch, setup: str) -> None:
    config, held = SETUPS[setup]
    rig = Rig(short_tmp, **config)
    uid = rig.add(pod("sm", notes=binder_annotations(devices=rig.gpu0, mode="sm-sharing"))
                  )["metadata"]["uid"]
    assert rig.step().converged
    why = _refused(rig, monkeypatch)
    assert not rig.step().converged

    r = result(rig, uid)
    assert (r.state.value, r.reason, r.not_in_force) == ("pending", "NamespaceCapNotSet", True)
    assert r.message.startswith(f"{NOT_USABLE} ({DAEMON_ALREADY_RUNNING}: {why})")
    assert held in r.message and "not in force through it" in r.message
    assert r.message.endswith(stop_it())
    for wrong in WRONG:
        assert wrong not in r.message
    assert _set_aside(rig, uid) and _gate(rig, uid).value == "wait"

    (event,) = [e for e in rig.cluster.events
                if e["involvedObject"]["uid"] == uid and e["reason"] == "MpsCapNotInForce"]
    # (an event's message is cut at Kubernetes' 1 KiB: the refusal's own remedy is within it)
    said = event["message"].split(": NamespaceCapNotSet: ", 1)[1]
    assert r.message.startswith(said) and "stop it (`echo quit | CUDA_MPS_PIPE" in said
    (a,) = node_state(rig.reconciler.view, NODE, None, "c").allocations
    assert a.message.startswith(f"{NOT_USABLE} ({DAEMON_ALREADY_RUNNING}:")
    for wrong in WRONG:
        assert wrong not in a.message


def test_the_remedy_is_the_adoption_refusals_own() -> None:
    """One source: the refusal's own advice and the pod's closing remedy are the same words."""
    pipe = "/run/kai-fractions/mps"
    err = environment_problem(1, {}, control_env(pipe, "/var/log/x"), pipe)
    assert err is not None
    assert err.message.endswith(stop_it(pipe))
    assert stop_it(pipe).endswith("and the agent starts its own, or let the agent alone own the "
                                  "pipe directory")
    assert stop_it().startswith("stop that daemon (")
    assert stop_it().endswith("and the agent starts its own, or let the agent alone own the "
                              "pipe directory")
