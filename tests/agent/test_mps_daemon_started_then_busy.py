"""A daemon the agent started since its last apply (a restart, or a fresh agent's first start)
holds none of the caps the markers vouch for: no namespace, no percentage, no pinned limit. The
supervisor reports it usable as soon as it answers, so the pass goes on to apply; when that
apply's MPS step fails (another control client keeps the daemon busy, a timeout), the caps are
not merely unverified, they are known missing: each container that relies on them is pending
under a reason of CAP_NOT_IN_FORCE_REASONS and its marker is set aside, until a pass has put
them back. The markers used to stay (pending MpsDaemonBusy), and a restarted sandbox's gate
released a workload onto a daemon without its cap.

A restart whose first apply succeeds sets nothing aside and sends no event; a daemon the
agent adopted (it ran before the agent) holds what it held, and a busy answer keeps its markers.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kai_fractions.gate.check import Outcome
from kai_fractions.node.engine import ContainerState
from kai_fractions.node.mps import errors as e
from kai_fractions.node.mps.errors import MpsError
from kai_fractions.node.mps_caps import CAP_NOT_IN_FORCE_REASONS
from kai_fractions.sim.nvml import FakeNvml
from tests.agent.builders import NODE, Rig, marker_of
from tests.agent.builders import result_of as _result
from tests.agent.test_mps_daemon_down import _gate, _reasons, _set_aside, _sm_pod

BUSY = MpsError(e.MPS_DAEMON_BUSY, "the MPS control daemon is serving another client; it is "
                "alive, try again")

SETUPS = {
    # a namespace per container (v3): its namespace list is the first command of the MPS step
    "v3": (dict, "namespace_list", "NamespaceCapNotSet", "MPS namespace kf_"),
}
"""Without namespaces (a 535 driver) nothing the agent vouches for is put on the daemon:
test_on_a_daemon_without_namespaces_a_busy_first_apply_keeps_the_marker."""


def _busy_then_back(rig: Rig, uid: str, method: str, reason: str, said: str) -> None:
    """Two passes answered busy, then one that is not: set aside, then written again."""
    for _ in range(2):
        rig.mps.control.inject(method, BUSY)  # the MPS step's first command of this pass
        report = rig.step()
        assert not report.converged
        r = _result(rig, uid)
        assert (r.state, r.reason, r.not_in_force) == (ContainerState.PENDING, reason, True)
        assert reason in CAP_NOT_IN_FORCE_REASONS
        assert said in r.message and "MpsDaemonBusy" in r.message
        assert _set_aside(rig, uid) and _gate(rig, uid) is Outcome.WAIT
    assert _reasons(rig, uid) == ["Applied", "MpsCapNotInForce"]  # one per episode
    assert rig.step().converged
    assert _result(rig, uid).state is ContainerState.APPLIED
    assert marker_of(rig, uid)["containers"]["main"]["state"] == "applied"
    assert _gate(rig, uid) is Outcome.RELEASE
    assert _reasons(rig, uid) == ["Applied", "MpsCapNotInForce", "Applied"]


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_a_restarted_daemon_answering_busy_sets_the_marker_aside(short_tmp: Path,
                                                                  setup: str) -> None:
    config, method, reason, said = SETUPS[setup]
    rig = Rig(short_tmp, **config())
    uid = _sm_pod(rig)
    assert rig.step().converged
    assert _gate(rig, uid) is Outcome.RELEASE

    rig.mps.control.kill()  # the supervisor restarts it at the next pass's check: healthy
    _busy_then_back(rig, uid, method, reason, said)
    assert rig.mps.restarts == 1


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_a_fresh_agent_whose_first_daemon_answers_busy_sets_the_old_marker_aside(
        short_tmp: Path, setup: str) -> None:
    """The last agent died without its stop (nothing set aside), and its daemon with its
    container: the new agent starts one, and its first apply is answered busy."""
    config, method, reason, said = SETUPS[setup]
    rig = Rig(short_tmp, **config())
    uid = _sm_pod(rig)
    assert rig.step().converged
    rig.mps.control.kill()
    new = rig.restarted()
    _busy_then_back(new, uid, method, reason, said)
    assert new.mps.starts == 1


def test_a_restart_whose_first_apply_succeeds_sets_nothing_aside(short_tmp: Path) -> None:
    """The ordinary restart: everything is back on the new daemon in the same pass, and the
    marker stays as it was, without a second Applied."""
    rig = Rig(short_tmp)
    uid = _sm_pod(rig)
    assert rig.step().converged
    written = rig.marker_path(uid).read_text()
    namespaces = set(rig.mps.control.namespaces)
    rig.mps.control.kill()
    assert rig.step().converged
    assert rig.mps.restarts == 1
    assert set(rig.mps.control.namespaces) == namespaces
    assert rig.mps.control.default_pinned_mib == {0: 20480}
    assert rig.marker_path(uid).read_text() == written
    assert _reasons(rig, uid) == ["Applied"]


def test_an_adopted_daemon_answering_busy_keeps_the_marker(short_tmp: Path) -> None:
    """A fresh agent that finds the daemon running (it did not start it): that daemon holds
    what it held, and a busy answer says nothing of it."""
    rig = Rig(short_tmp)
    uid = _sm_pod(rig)
    assert rig.step().converged
    written = rig.marker_path(uid).read_text()
    new = rig.restarted()
    new.mps.control.inject("namespace_list", BUSY, times=1)
    assert not new.step().converged
    r = _result(new, uid)
    assert (r.state, r.reason, r.not_in_force) == (ContainerState.PENDING, "MpsDaemonBusy",
                                                   False)
    assert new.marker_path(uid).read_text() == written
    assert new.step().converged
    assert new.marker_path(uid).read_text() == written
    assert _reasons(new, uid) == ["Applied"]


@pytest.mark.parametrize("fresh_agent", [False, True])
def test_on_a_daemon_without_namespaces_a_busy_first_apply_keeps_the_marker(
        short_tmp: Path, fresh_agent: bool) -> None:
    """A 535 driver: the container's share of the SMs is its client env's, which any MPS server
    the new daemon starts enforces, and its memory the kill watchdog's; the daemon's default
    pinned limit is set there but no tier (its tenants can change it). A new daemon answering
    the limit's read busy (the MPS step's first command) holds back nothing the marker vouches
    for: the container stays applied, its marker as it was, and the next pass sets the limit.
    It used to be set aside (MpsPinnedLimitLost)."""
    rig = Rig(short_tmp, nvml=FakeNvml.simulated(2, model="H100-80GB", seed=NODE,
                                                 driver_version="535.104.05"),
              mps_v3=False, watchdog_policy="kill")
    uid = _sm_pod(rig)
    assert rig.step().converged
    written = rig.marker_path(uid).read_text()
    rig.mps.control.kill()
    if fresh_agent:
        rig = rig.restarted()
    for _ in range(2):
        rig.mps.control.inject("get_default_pinned_mem_limit", BUSY)
        report = rig.step()
        assert not report.converged and "MpsPinnedLimitLost" in report.errors
        r = _result(rig, uid)
        assert (r.state, r.not_in_force) == (ContainerState.APPLIED, False)
        assert rig.marker_path(uid).read_text() == written and _gate(rig, uid) is Outcome.RELEASE
    assert rig.step().converged
    assert rig.mps.control.default_pinned_mib == {0: 20480}
    assert rig.marker_path(uid).read_text() == written
    assert _reasons(rig, uid) == ["Applied"]
