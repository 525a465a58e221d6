"""An mps-pinned container whose GPU's default pinned device memory limit the MPS daemon has lost
(a restarted daemon forgets it) and that cannot be set again is never vouched for: its pod's
readiness marker is set aside and its MPS namespace is not made again until the limit is back,
so no gate (a restarted sandbox's) lets a client in, and no client starts an MPS server, without
it. A read of the limit that merely fails says nothing of what is in force: the marker stays."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kai_fractions.gate.check import Outcome
from kai_fractions.node.engine import ContainerState
from kai_fractions.node.mps import MpsError
from kai_fractions.sim.nvml import FakeNvml
from tests.agent.builders import NODE, Rig, binder_annotations, marker_of, pod

from .nodepods import GPU0
from .test_engine import UID_A, Node, sm_pod
from .test_mps_cap_not_in_force import _gate, _not_vouched_for, _result

BUSY = MpsError("MpsDaemonBusy", "busy")

SETUPS: dict[str, Any] = {
    # every tier: the cgroup limit holds too, but the marker names mps-pinned in force
    "v3-every-tier": dict,
    # mps-pinned is the only hard memory tier (the watchdog only reports)
    "v3-pinned-only": lambda: dict(memory_enforcement="mps-pinned,watchdog"),
    "535-driver": lambda: dict(nvml=FakeNvml.simulated(2, model="H100-80GB", seed=NODE,
                                                       driver_version="535.104.05"),
                               mps_v3=False),
}


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_a_pinned_limit_a_restarted_daemon_lost_is_not_vouched_for_until_set_again(
        short_tmp: Path, setup: str) -> None:
    rig = Rig(short_tmp, **SETUPS[setup]())
    uid = rig.add(pod("sm", notes=binder_annotations(devices=rig.gpu0, mode="sm-sharing"))
                  )["metadata"]["uid"]
    assert rig.step().converged
    control = rig.mps.control
    names = set(control.namespaces)
    assert control.default_pinned_mib == {0: 20480} and _gate(rig, uid) is Outcome.RELEASE
    # a read that fails says nothing of what is in force: the running pod's marker stays
    written = rig.marker_path(uid).read_text()
    control.inject("get_default_pinned_mem_limit", BUSY)
    assert not rig.step().converged
    r = _result(rig, uid)
    assert (r.state, r.reason, r.mps_cap_missing) == (ContainerState.PENDING, "MpsDaemonBusy",
                                                      False)
    assert rig.marker_path(uid).read_text() == written
    control.kill()  # the agent restarts it: the pinned limit and every namespace are gone
    control.inject("set_default_pinned_mem_limit", BUSY, times=2)
    for _ in range(2):
        assert not rig.step().converged
        r = _result(rig, uid)
        # its own reason (a busy daemon's keeps the marker), naming the GPU and the limit
        assert (r.state, r.reason, r.mps_cap_missing) == (ContainerState.PENDING,
                                                          "MpsPinnedLimitLost", True)
        assert r.message is not None and r.message.startswith(
            f"the MPS daemon's default pinned device memory limit of GPU 0 ({rig.gpu0}) is "
            "not the plan's 20480 MiB (20G): it reads back no limit (a restarted daemon "
            "forgets it), and it could not be set again (MpsDaemonBusy: busy)")
        assert control.default_pinned_mib == {}
        assert control.namespaces == {}  # nothing to attach to (and start a server) unpinned
        _not_vouched_for(rig, uid)
    assert rig.step().converged
    assert _result(rig, uid).state is ContainerState.APPLIED
    assert control.default_pinned_mib == {0: 20480}
    assert set(control.namespaces) == names
    assert all(ns.active_thread_percentage == 50 for ns in control.namespaces.values())
    assert marker_of(rig, uid)["containers"]["main"]["state"] == "applied"
    assert _gate(rig, uid) is Outcome.RELEASE


def test_a_pinned_limit_the_set_reads_back_wrong_is_not_in_force(tmp_path: Path) -> None:
    """The read before the set showed the plan's GiB, yet the set's own readback another value
    (NotApplied): what the daemon holds is not the plan's."""
    node = Node(tmp_path / "cgroup")
    assert node.apply(sm_pod()).converged
    node.engine.forget()  # a resync writes the exact MiB again
    node.mps.inject("set_default_pinned_mem_limit", MpsError("NotApplied", "reads back 19G"))
    r = node.apply(sm_pod()).containers[(UID_A, "main")]
    assert (r.state, r.reason, r.mps_cap_missing) == (ContainerState.PENDING,
                                                      "MpsPinnedLimitLost", True)
    assert r.message is not None and r.message.startswith(
        f"the MPS daemon's default pinned device memory limit of GPU 0 ({GPU0}) is not the "
        "plan's 20480 MiB (20G): a set of it read back another value (NotApplied: reads back "
        "19G). An MPS server started for a client now would run without it")
    # any other failure of that set says nothing of what the daemon holds (it read back right)
    node.engine.forget()
    node.mps.inject("set_default_pinned_mem_limit", BUSY)
    r = node.apply(sm_pod()).containers[(UID_A, "main")]
    assert (r.state, r.reason, r.mps_cap_missing) == (ContainerState.PENDING, "MpsDaemonBusy",
                                                      False)
