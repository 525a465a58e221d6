"""No cgroup tier (a driver without the r615 limits) but an MPS daemon with namespaces
(where mps-pinned is a tier: `plan_refusals.hard_tiers_of`), sm-sharing, the default watchdog
policy (report): the MPS daemon holds one default pinned limit per GPU, the largest cap of
its sm-sharing containers. A container with a smaller cap on that GPU is not vouched for by
mps-pinned: its marker does not say applied and its gate does not release; one applied while it
was the largest is refused once a larger one comes, and says it runs without its own cap until
its sandbox restarts."""

from __future__ import annotations

from pathlib import Path

from kai_fractions.gate.check import Outcome
from kai_fractions.sim.nvml import FakeNvml

from .builders import NODE, Rig, binder_annotations, gate_outcome, marker_of, pod, result_of

OLD_DRIVER = "550.54.15"


def _node(tmp: Path) -> Rig:
    nvml = FakeNvml.simulated(2, model="H100-80GB", seed=NODE, driver_version=OLD_DRIVER)
    return Rig(tmp, nvml=nvml, sm_sharing=True, mps_v3=True)


def _add(rig: Rig, name: str, request: str, limit: str) -> str:
    notes = binder_annotations(devices=rig.gpu0, mode="sm-sharing", request=request, limit=limit)
    return rig.add(pod(name, notes=notes))["metadata"]["uid"]


def test_the_smaller_cap_is_not_applied_and_its_gate_does_not_release(short_tmp: Path) -> None:
    rig = _node(short_tmp)
    small, large = _add(rig, "p", "5Gi", "10Gi"), _add(rig, "q", "20Gi", "40Gi")
    rig.step()
    rig.step()
    entry = marker_of(rig, small)["containers"]["main"]
    assert (entry["state"], entry["reason"]) == ("refused", "MemoryLimitsUnsupported")
    assert (f"GPU {rig.gpu0}'s is 40960 MiB, the largest cap of the sm-sharing containers on it; "
            "this container's cap of 10240 MiB would rest on its own environment"
            ) in entry["message"]
    assert gate_outcome(rig, small) is Outcome.FAIL
    assert rig.cluster.event_reasons(small) == ["Refused"]
    # the largest one keeps its tier, and the daemon's limit is its cap
    assert marker_of(rig, large)["containers"]["main"]["state"] == "applied"
    assert gate_outcome(rig, large) is Outcome.RELEASE
    assert rig.mps.control.default_pinned_mib.get(0) == 40 * 1024


def test_one_applied_while_largest_is_refused_when_a_larger_one_comes(short_tmp: Path) -> None:
    rig = _node(short_tmp)
    small = _add(rig, "p", "5Gi", "10Gi")
    rig.step()
    assert marker_of(rig, small)["containers"]["main"]["state"] == "applied"
    _add(rig, "q", "20Gi", "40Gi")
    rig.step()
    result = result_of(rig, small)
    assert (result.state.value, result.reason) == ("refused", "MemoryLimitsUnsupported")
    assert result.plan_digest  # held to the plan it runs with
    assert "this container runs without its own cap" in result.message
    entry = marker_of(rig, small)["containers"]["main"]
    assert (entry["state"], entry["plan_digest"]) == ("refused", result.plan_digest)
    assert gate_outcome(rig, small) is Outcome.FAIL  # its next sandbox does not start
    assert rig.cluster.event_reasons(small) == ["Applied", "Refused"]
