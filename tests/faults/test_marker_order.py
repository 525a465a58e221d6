"""Markers never outlive the limits they vouch for: when a pod goes away its marker is removed
before its limits are cleared, by the agent that knew it and by a new agent that did not."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.agent.builders import Rig, binder_annotations, pod

pytestmark = pytest.mark.faults

UID = "0b7e1c9a-3d2f-4a5b-8c6d-7e8f9a0b1c2d"
SLICE = ("/sys/fs/cgroup/kubepods.slice/kubepods-burstable.slice/"
         "kubepods-burstable-pod0b7e1c9a_3d2f_4a5b_8c6d_7e8f9a0b1c2d.slice")


def spy(rig: Rig, order: list[str]) -> None:
    clear, remove = rig.nvml.clear_memory_limits, rig.reconciler.markers.remove_pod

    def cleared(uuid, path):
        order.append(f"clear {path}")
        return clear(uuid, path)

    def removed(uid):
        order.append(f"marker {uid} {'present' if rig.marker_path(uid).exists() else 'absent'}")
        return remove(uid)

    rig.nvml.clear_memory_limits = cleared
    rig.reconciler.markers.remove_pod = removed


def applied_pod(tmp: Path) -> Rig:
    rig = Rig(tmp, sm_sharing=False)
    rig.cgroups.add(SLICE)
    rig.add(pod(uid=UID, container_id=None, notes=binder_annotations(devices=rig.gpu0)))
    assert rig.step().converged and rig.marker_path(UID).exists()
    return rig


def test_the_agent_that_knew_the_pod(short_tmp):
    rig = applied_pod(short_tmp)
    order: list[str] = []
    spy(rig, order)
    rig.cluster.delete_pod(UID)
    rig.step()
    assert order[:2] == [f"marker {UID} present", f"clear {SLICE}"]
    assert not rig.marker_path(UID).parent.exists() and rig.nvml.limits == {}


def test_a_new_agent_that_never_saw_the_pod(short_tmp):
    old = applied_pod(short_tmp)
    old.cluster.delete_pod(UID)  # deleted while no agent ran
    new = Rig(short_tmp, sm_sharing=False, nvml=old.nvml)
    new.cluster = new.agent.watcher.source = old.cluster
    new.agent.reconciler.cgroup_fs = new.agent.reconciler.engine.cgroup_fs = old.cgroups
    order: list[str] = []
    spy(new, order)
    new.step()
    assert order[:2] == [f"marker {UID} present", f"clear {SLICE}"]
    assert not new.marker_path(UID).parent.exists() and new.nvml.limits == {}
