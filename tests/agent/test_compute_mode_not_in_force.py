"""An sm-sharing pod whose GPU is put back in DEFAULT compute mode behind the agent (nvidia-smi
-c 0, a GPU reset), while the agent cannot set it again: a process of it that leaves MPS would
open its own context, outside every MPS cap, so the pod's readiness marker is set aside (a
restarted sandbox's gate waits), one Warning `MpsCapNotInForce` says why (reason
`ComputeModeNotInForce`), the cap-not-in-force series names the reason, and the marker is written
again (`Applied`) once the mode is set."""

from __future__ import annotations

from pathlib import Path

from kai_fractions.gate.check import Outcome
from kai_fractions.marker import SET_ASIDE_FILE
from kai_fractions.node.nvml import GpuComputeMode
from tests.agent.builders import Rig, binder_annotations, gate_outcome, marker_of, pod, result_of

CAP_METRIC = "kai_fractions_container_cap_not_in_force"


def _events(rig: Rig, uid: str) -> list[tuple[str, str, str]]:
    return [(e["type"], e["reason"], e["message"]) for e in rig.cluster.events
            if e["involvedObject"]["uid"] == uid]


def _cap_reasons(rig: Rig, uid: str) -> list[str]:
    return [s.labels["reason"] for family in rig.agent.metrics.registry.collect()
            for s in family.samples
            if s.name == CAP_METRIC and s.labels["pod_uuid"] == uid and s.value == 1]


def test_a_gpu_put_back_in_default_mode_lets_no_gate_release(short_tmp: Path) -> None:
    rig = Rig(short_tmp)
    uid = rig.add(pod("sm", notes=binder_annotations(devices=rig.gpu0, mode="sm-sharing"))
                  )["metadata"]["uid"]
    assert rig.step().converged
    assert rig.nvml.gpu(rig.gpu0).compute_mode is GpuComputeMode.EXCLUSIVE_PROCESS
    assert gate_outcome(rig, uid) is Outcome.RELEASE
    rig.nvml.gpu(rig.gpu0).compute_mode = GpuComputeMode.DEFAULT  # reset behind the agent
    rig.nvml.fail("set_compute_mode", "NoPermission", times=None)
    for _ in range(3):  # one episode, three passes: one event
        assert not rig.step().converged
        r = result_of(rig, uid)
        assert (r.state.value, r.reason, r.not_in_force) == (
            "pending", "ComputeModeNotInForce", True)
        assert marker_of(rig, uid) is None
        assert (rig.marker_path(uid).parent / SET_ASIDE_FILE).exists()  # the plan it is held to
        assert gate_outcome(rig, uid) is Outcome.WAIT
        assert _cap_reasons(rig, uid) == ["ComputeModeNotInForce"]
    (applied, (kind, reason, message)) = _events(rig, uid)
    assert applied[1] == "Applied"
    assert (kind, reason) == ("Warning", "MpsCapNotInForce")
    assert message.startswith(
        "container main: an MPS cap it relies on is not in force, so its readiness marker is set "
        "aside (a gate of the pod waits; Applied follows once the cap is back): "
        f"ComputeModeNotInForce: GPU {rig.gpu0} reads back compute mode DEFAULT, not the "
        "EXCLUSIVE_PROCESS sm-sharing needs, and could not be set (NVMLNoPermission: "), message
    assert message.endswith(f"run nvidia-smi -i {rig.gpu0} -c EXCLUSIVE_PROCESS")
    assert len(message) <= 1024  # an event's message is cut there

    rig.nvml.clear_failures()  # the agent may set it again
    assert rig.step().converged
    assert rig.nvml.gpu(rig.gpu0).compute_mode is GpuComputeMode.EXCLUSIVE_PROCESS
    assert marker_of(rig, uid)["containers"]["main"]["state"] == "applied"
    assert gate_outcome(rig, uid) is Outcome.RELEASE
    assert _cap_reasons(rig, uid) == []
    assert [e[1] for e in _events(rig, uid)] == ["Applied", "MpsCapNotInForce", "Applied"]


def test_a_pass_that_cannot_read_the_mode_does_not_vouch_again(short_tmp: Path) -> None:
    """Known not in force until a set succeeds: NVML down for a pass proves nothing."""
    rig = Rig(short_tmp)
    uid = rig.add(pod("sm", notes=binder_annotations(devices=rig.gpu0, mode="sm-sharing"))
                  )["metadata"]["uid"]
    assert rig.step().converged
    rig.nvml.gpu(rig.gpu0).compute_mode = GpuComputeMode.DEFAULT
    rig.nvml.fail("set_compute_mode", "NoPermission", times=None)
    rig.step()
    rig.nvml.clear_failures()
    rig.nvml.fail("devices", "Unknown", times=1)
    assert not rig.step().converged
    assert marker_of(rig, uid) is None and gate_outcome(rig, uid) is Outcome.WAIT
    assert rig.step().converged
    assert gate_outcome(rig, uid) is Outcome.RELEASE
