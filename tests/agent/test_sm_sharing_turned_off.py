"""A node whose agent restarts without sm-sharing (--no-sm-sharing: sm-sharing turned off, or a
chart rolled back) while sm-sharing containers run.

Such a container is refused (`SmSharingDisabled`, its marker `refused`: its compute share went
with the agent's MPS daemon), but it runs on and keeps its GPU memory limits. Before, its
message told the user to "use time-slicing, or schedule it to a node with sm-sharing enabled",
as if the pod were new; now it says that until its pod's sandbox restarts (a reboot restarts it)
the container runs on, without its compute share, that its gate fails then, and what to do
(docs/node-agent.md, the `--sm-sharing` row): words that hold after a reboot too, when the plan is
held from the boot before (a second look found the first wording, "runs on", said then too)."""

from __future__ import annotations

from pathlib import Path

from kai_fractions.gate.check import Outcome

from .builders import (
    Rig,
    binder_annotations,
    gate_outcome,
    limits_of,
    marker_of,
    pod,
    result_of,
)

EXPECTED = (
    "the container asks for compute mode sm-sharing but this node runs without MPS "
    "(--no-sm-sharing): this container was started while the node ran sm-sharing: until its "
    "pod's sandbox restarts (a node reboot restarts it) it runs on, its GPU memory limits kept "
    "as the kernel holds them but without its compute share (no MPS daemon of the agent's holds "
    "it any more), and then its gate fails on this refusal; turn sm-sharing back on for this "
    "node (--sm-sharing, the chart's smSharing.enabled), or recreate the pod with time-slicing")


def test_a_running_sm_sharing_container_is_told_it_runs_on_without_its_compute_share(
        short_tmp: Path) -> None:
    rig = Rig(short_tmp)
    uid = rig.add(pod("sm", notes=binder_annotations(devices=rig.gpu0, mode="sm-sharing"))
                  )["metadata"]["uid"]
    assert rig.step().converged
    limits = limits_of(rig, uid)
    assert limits and marker_of(rig, uid)["containers"]["main"]["state"] == "applied"

    off = rig.restarted(sm_sharing=False)
    # The same on the next pass and after another agent restart.
    for agent in (off, off, off.restarted()):
        agent.step()
        result = result_of(agent, uid)
        assert (result.state.value, result.reason) == ("refused", "SmSharingDisabled")
        assert result.message == (
            EXPECTED)
        assert limits_of(agent, uid) == limits  # its memory stays capped
        assert gate_outcome(agent, uid) is not Outcome.RELEASE  # a new sandbox does not start


def test_a_new_sm_sharing_pod_is_told_to_go_elsewhere(short_tmp: Path) -> None:
    rig = Rig(short_tmp, sm_sharing=False)
    uid = rig.add(pod("sm", notes=binder_annotations(devices=rig.gpu0, mode="sm-sharing"))
                  )["metadata"]["uid"]
    rig.step()
    assert result_of(rig, uid).message.endswith(
        "(--no-sm-sharing): use time-slicing, or schedule it to a node with sm-sharing enabled")


UID = "7c1d2e3f-4a5b-4c6d-8e7f-9a0b1c2d3e4f"
BOOT_BEFORE = "0b0a1c2d-3e4f-4a5b-8c6d-7e8f9a0b1c2d"
BOOT_AFTER = "9f8e7d6c-5b4a-4c3d-8e2f-1a0b9c8d7e6f"


def agent_of_boot(tmp: Path, boot_id: str, *, sm_sharing: bool, notes: dict | None = None
                  ) -> Rig:
    """An agent whose host is in boot `boot_id`, over the same marker directory, with the
    sm-sharing pod (`notes`: its annotations as an earlier agent left them)."""
    (tmp / f"boot-{boot_id}").write_text(boot_id + "\n")
    rig = Rig(tmp, sm_sharing=sm_sharing, options={"boot_id_file": str(tmp / f"boot-{boot_id}")})
    rig.add(pod("sm", notes=notes or binder_annotations(devices=rig.gpu0, mode="sm-sharing"),
                uid=UID))
    return rig


def test_after_a_reboot_the_message_still_holds(short_tmp: Path) -> None:
    """A second look's probe (p_reboot_smoff): the sm-sharing pod applied in the boot before;
    the node reboots and its agent now runs --no-sm-sharing. The reboot cleared its limits and
    its container does not run (its gate fails on the refusal), while its plan is held from
    the boot before. The first wording said it "runs on" then too; the message now says what
    holds before and after a sandbox restart, on every pass and after an agent restart."""
    before = agent_of_boot(short_tmp, BOOT_BEFORE, sm_sharing=True)
    assert before.step().converged and before.nvml.limits
    notes = before.cluster.pods[UID]["metadata"]["annotations"]

    after = agent_of_boot(short_tmp, BOOT_AFTER, sm_sharing=False, notes=notes)
    for rig in (after, after, after.restarted()):
        rig.step()
        result = result_of(rig, UID)
        assert (result.state.value, result.reason) == ("refused", "SmSharingDisabled")
        assert result.message == EXPECTED
        assert not rig.nvml.limits
        assert gate_outcome(rig, UID) is Outcome.FAIL
    marker = marker_of(after, UID)["containers"]["main"]
    assert marker["plan_digest"]  # its plan is still held: an edit does not change it
