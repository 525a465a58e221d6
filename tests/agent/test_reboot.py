"""A node reboot: the kernel's limits are gone, the marker directory (on the host's disk) is not.

After a reboot the kubelet runs every pod's gate again in a new sandbox; the limits the old
markers vouched for went with the old boot. The agent sets those markers aside at its first pass
(where no gate reads them), even while NVML is not back yet, and the gate waits until the agent
has applied the limits again in this boot.
"""

from __future__ import annotations

import copy
from pathlib import Path

from kai_fractions.contract import DEFAULT_KEYS
from kai_fractions.gate import Outcome, judge
from kai_fractions.marker import read_marker

from .builders import GIB, Rig, binder_annotations, limits_of, pod

UID = "7c1d2e3f-4a5b-4c6d-8e7f-9a0b1c2d3e4f"
BOOT_BEFORE = "0b0a1c2d-3e4f-4a5b-8c6d-7e8f9a0b1c2d"
BOOT_AFTER = "9f8e7d6c-5b4a-4c3d-8e2f-1a0b9c8d7e6f"


def agent_of_boot(tmp: Path, boot_id: str) -> Rig:
    """An agent whose host is in boot `boot_id`, over the same marker directory."""
    (tmp / f"boot-{boot_id}").write_text(boot_id + "\n")
    rig = Rig(tmp, sm_sharing=False, options={"boot_id_file": str(tmp / f"boot-{boot_id}")})
    notes = binder_annotations(devices=rig.gpu0)
    rig.add(pod("train", notes=notes, uid=UID))
    return rig


def gate(rig: Rig, boot_id: str) -> Outcome:
    notes = rig.cluster.pods[UID]["metadata"]["annotations"]
    return judge(notes, read_marker(rig.marker_path(UID).parent), pod_uid=UID,
                 keys=DEFAULT_KEYS, boot_id=boot_id, containers=["main"]).outcome


def test_a_marker_of_the_boot_before_vouches_for_nothing(short_tmp: Path) -> None:
    before = agent_of_boot(short_tmp, BOOT_BEFORE)
    assert before.step().converged
    assert before.nvml.limits and gate(before, BOOT_BEFORE) is Outcome.RELEASE
    assert read_marker(before.marker_path(UID).parent).boot_id == BOOT_BEFORE

    # The reboot: the driver comes back without limits, the marker file is still there, and
    # the gate, run again before any agent, does not trust it.
    after = agent_of_boot(short_tmp, BOOT_AFTER)
    assert not after.nvml.limits and after.marker_path(UID).exists()
    assert gate(after, BOOT_AFTER) is Outcome.WAIT

    # The agent's first pass while the driver is still loading: no inventory, so nothing can
    # be applied, yet the old marker goes (an older gate, which reads no boot ID, would trust
    # it), and nothing claims the pod is limited.
    after.nvml.fail("init", "DriverNotLoaded", times=None)
    after.nvml.fail("driver_version", "DriverNotLoaded", times=None)
    assert not after.step().converged
    assert not after.marker_path(UID).exists()
    assert gate(after, BOOT_AFTER) is Outcome.WAIT

    # The driver is back: the limits are applied again, and the marker says so for this boot.
    after.nvml.clear_failures()
    assert after.step().converged
    assert after.nvml.limits and gate(after, BOOT_AFTER) is Outcome.RELEASE
    assert read_marker(after.marker_path(UID).parent).boot_id == BOOT_AFTER


def test_an_agent_restart_in_the_same_boot_keeps_the_markers(short_tmp: Path) -> None:
    first = agent_of_boot(short_tmp, BOOT_BEFORE)
    assert first.step().converged
    written = first.marker_path(UID).read_text()
    second = agent_of_boot(short_tmp, BOOT_BEFORE)
    second.nvml.fail("init", "DriverNotLoaded", times=None)
    second.nvml.fail("driver_version", "DriverNotLoaded", times=None)
    second.step()
    assert second.marker_path(UID).read_text() == written  # the limits live in the kernel



def refused_edit_before_a_reboot(tmp: Path) -> tuple[Rig, dict]:
    """An agent of the boot before applies the pod; its tenant then raises its own limit
    where admission did not stop it: the change is refused, the applied plan kept. The rig and
    the edited pod's metadata (what the cluster holds after the reboot)."""
    before = agent_of_boot(tmp, BOOT_BEFORE)
    assert before.step().converged
    meta = copy.deepcopy(before.cluster.pods[UID]["metadata"])
    meta["annotations"]["nvidia.com/container.main.gpu-memory.limit"] = "79Gi"
    before.cluster.update_pod(UID, metadata=meta)
    before.step()
    assert before.reconciler.view.desired.refusal((UID, "main")).reason == "PlanChangeRefused"
    return before, copy.deepcopy(before.cluster.pods[UID]["metadata"])


def agent_after_the_reboot(tmp: Path, metadata: dict) -> Rig:
    rig = agent_of_boot(tmp, BOOT_AFTER)
    rig.cluster.update_pod(UID, metadata=copy.deepcopy(metadata))
    return rig


def test_a_change_refused_before_a_reboot_stays_refused_after_it(short_tmp: Path) -> None:
    """A tenant raised its own limit on the running pod where admission did not stop it: the
    change is refused and the applied plan kept. A reboot clears the kernel's limits and makes
    the old marker vouch for nothing, but not the pod (the same uid, its containers started
    again): the plan it was applied with is applied again, not the edit."""
    before, edited = refused_edit_before_a_reboot(short_tmp)
    held = read_marker(before.marker_path(UID).parent).containers["main"].plan_digest

    after = agent_after_the_reboot(short_tmp, edited)
    after.step()
    assert set(limits_of(after, UID).values()) == {(10 * GIB, 20 * GIB)}
    assert after.reconciler.view.desired.refusal((UID, "main")).reason == "PlanChangeRefused"
    marker = read_marker(after.marker_path(UID).parent)
    assert (marker.boot_id, marker.containers["main"].plan_digest) == (BOOT_AFTER, held)
    # a restarted sandbox's gate plans from the edited annotations: not what the marker
    # vouches for, so it waits (docs/node-agent.md, "Applied plans are kept")
    assert gate(after, BOOT_AFTER) is Outcome.WAIT
    again = agent_after_the_reboot(short_tmp, edited)  # an agent restart in this boot keeps it
    again.nvml.limits.update(after.nvml.limits)
    again.step()
    assert set(limits_of(again, UID).values()) == {(10 * GIB, 20 * GIB)}


def test_an_agent_restarted_before_it_rewrites_the_marker_still_holds_the_pod(
        short_tmp: Path) -> None:
    """After the reboot the first pass (NVML still loading) sets the old marker aside, then the
    agent restarts before the driver is back: the new agent still holds the pod to the plan the
    earlier boot applied, not to an edit refused before the reboot."""
    _before, edited = refused_edit_before_a_reboot(short_tmp)
    first = agent_after_the_reboot(short_tmp, edited)
    first.nvml.fail("init", "DriverNotLoaded", times=None)
    first.nvml.fail("driver_version", "DriverNotLoaded", times=None)
    first.step()
    assert not first.marker_path(UID).exists()
    aside = first.marker_path(UID).parent / "set-aside.json"
    assert read_marker(aside.parent, name="set-aside.json").boot_id == BOOT_BEFORE

    second = agent_after_the_reboot(short_tmp, edited)  # restarted; the driver is back
    second.step()
    assert set(limits_of(second, UID).values()) == {(10 * GIB, 20 * GIB)}
    assert second.reconciler.view.desired.refusal((UID, "main")).reason == "PlanChangeRefused"
    assert read_marker(second.marker_path(UID).parent).boot_id == BOOT_AFTER
    assert not aside.exists()  # this boot's marker replaces it
