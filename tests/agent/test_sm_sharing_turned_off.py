"""A node whose agent restarts without sm-sharing (--no-sm-sharing: sm-sharing turned off, or a
chart rolled back) while sm-sharing containers run.

Such a container is refused (`SmSharingDisabled`, its marker `refused`: its compute share went
with the agent's MPS daemon), but it runs on and keeps its GPU memory limits. Before, its
message told the user to "use time-slicing, or schedule it to a node with sm-sharing enabled",
as if the pod were new; now it says the container runs on, without its compute share, and fails
at its next sandbox restart, and what to do (docs/node-agent.md, the `--sm-sharing` row)."""

from __future__ import annotations

from pathlib import Path

from kai_fractions.gate.check import Outcome

from .builders import Rig, binder_annotations, gate_outcome, limits_of, marker_of, pod, result_of


def test_a_running_sm_sharing_container_is_told_it_runs_on_without_its_compute_share(
        short_tmp: Path) -> None:
    rig = Rig(short_tmp)
    uid = rig.add(pod("sm", notes=binder_annotations(devices=rig.gpu0, mode="sm-sharing"))
                  )["metadata"]["uid"]
    assert rig.step().converged
    limits = limits_of(rig, uid)
    assert limits and marker_of(rig, uid)["containers"]["main"]["state"] == "applied"

    off = rig.restarted(sm_sharing=False)
    off.step()
    result = result_of(off, uid)
    assert (result.state.value, result.reason) == ("refused", "SmSharingDisabled")
    assert result.message == (
        "the container asks for compute mode sm-sharing but this node runs without MPS "
        "(--no-sm-sharing): this container was started while the node ran sm-sharing and runs "
        "on, its GPU memory limits kept as they are but without its compute share (no MPS "
        "daemon of the agent's holds it any more), and it will not start again after its pod's "
        "sandbox restarts; turn sm-sharing back on for this node (--sm-sharing, the chart's "
        "smSharing.enabled), or recreate the pod with time-slicing")
    assert limits_of(off, uid) == limits  # its memory stays capped
    assert gate_outcome(off, uid) is not Outcome.RELEASE  # a restarted sandbox does not start


def test_a_new_sm_sharing_pod_is_told_to_go_elsewhere(short_tmp: Path) -> None:
    rig = Rig(short_tmp, sm_sharing=False)
    uid = rig.add(pod("sm", notes=binder_annotations(devices=rig.gpu0, mode="sm-sharing"))
                  )["metadata"]["uid"]
    rig.step()
    assert result_of(rig, uid).message.endswith(
        "(--no-sm-sharing): use time-slicing, or schedule it to a node with sm-sharing enabled")
