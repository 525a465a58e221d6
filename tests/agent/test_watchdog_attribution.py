"""The watchdog where it is a container's only GPU memory tier (a driver before r615,
--watchdog-policy=kill): every process of the pod that NVML lists on the container's GPU is seen,
counted and, over the cap, stopped.

Before: the watchdog was given NVML's compute listing only, so a process NVML listed in its MPS
compute listing only (an MPS client, on some drivers) or its graphics listing only (a Vulkan or
OpenGL renderer) ran 70 GiB over a 20 GiB cap unstopped, its usage read 0, and the GPU was not
blind (the hidden-memory test accounted its memory): the marker stayed. And a process of the pod
in a container whose ID the pod's status did not name yet (right after a restart) was nobody's:
not counted, not stopped, not blind. Now the listings are merged, each pid once, and such a
process counts for the pod's fractional container on that GPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from kai_fractions.node.agent.grpc_service import node_state

from .builders import GIB, NODE, binder_annotations, leaf_of, pod, slice_of
from .test_watchdog_only_tier_blind import add, old_node

NEW = "b" * 64
"""The container's ID after a restart."""


def used(rig) -> list[int]:
    """The container's GPU memory use, as the usage figures and GetNodeState have it."""
    view = [u.used_bytes for u in rig.reconciler.view.usage.values()]
    state = [a.memory_used_bytes
             for a in node_state(rig.reconciler.view, NODE, None, "Ready").allocations]
    assert view == state
    return view


@pytest.mark.parametrize(("mode", "kind"), [("sm-sharing", "mps"), (None, "graphics")])
def test_a_process_listed_apart_from_the_compute_listing_is_capped(
        short_tmp: Path, mode: str | None, kind: str) -> None:
    """The reviewer's probes: an MPS client listed in the MPS listing only (sm-sharing, no MPS
    namespaces), a renderer in the graphics listing only (time-slicing)."""
    rig = old_node(short_tmp, **({"sm_sharing": True, "mps_v3": False} if mode else {}))
    uid = add(rig, **({"mode": mode} if mode else {}))
    assert rig.step().converged
    rig.reconciler.check_usage()
    rig.proc_entry(4242, leaf_of(uid)[len("/sys/fs/cgroup"):])
    rig.nvml.add_process(4242, rig.gpu0, 70 * GIB, kind=kind)
    rig.reconciler.check_usage()
    assert rig.killer.calls == [4242]
    assert used(rig) == [70 * GIB]


def test_a_process_in_two_listings_counts_once_beside_one_listed_apart(short_tmp: Path) -> None:
    """12 GiB in the compute and the MPS listing (one process, counted once) and 6 GiB of an
    MPS-only client: 18 GiB, within the 20 GiB cap; the MPS-only client growing to 9 GiB takes
    the container over it."""
    rig = old_node(short_tmp, sm_sharing=True, mps_v3=False)
    uid = add(rig, mode="sm-sharing")
    assert rig.step().converged
    leaf = leaf_of(uid)[len("/sys/fs/cgroup"):]
    for pid in (100, 101):
        rig.proc_entry(pid, leaf)
    rig.nvml.add_process(100, rig.gpu0, 12 * GIB)
    rig.nvml.add_process(100, rig.gpu0, 12 * GIB, kind="mps")
    rig.nvml.add_process(101, rig.gpu0, 6 * GIB, kind="mps")
    rig.reconciler.check_usage()
    assert rig.killer.calls == [] and used(rig) == [18 * GIB]
    rig.nvml.remove_process(101)
    rig.nvml.add_process(101, rig.gpu0, 9 * GIB, kind="mps")
    rig.reconciler.check_usage()
    assert sorted(rig.killer.calls) == [100, 101] and used(rig) == [21 * GIB]
    assert rig.reconciler.usage.blindness() == {}


def test_a_restarted_containers_process_is_capped_before_the_status_names_it(
        short_tmp: Path) -> None:
    """The reviewer's probe (P2): the pod's status still names the old container ID."""
    rig = old_node(short_tmp)
    uid = add(rig)
    assert rig.step().converged
    rig.reconciler.check_usage()
    rig.proc_entry(4242, f"{slice_of(uid)}/cri-containerd-{NEW}.scope"[len("/sys/fs/cgroup"):])
    rig.nvml.add_process(4242, rig.gpu0, 70 * GIB)
    rig.reconciler.check_usage()
    assert rig.killer.calls == [4242]
    assert used(rig) == [70 * GIB]
    # the status catches up: the same process, the same container
    rig.cluster.update_pod(uid, status={
        "phase": "Running", "qosClass": "Burstable",
        "containerStatuses": [{"name": "main", "containerID": "containerd://" + NEW}]})
    rig.step()
    rig.reconciler.check_usage()
    assert rig.killer.calls == [4242, 4242] and used(rig) == [70 * GIB]


def test_a_process_of_the_pod_on_a_gpu_its_container_is_not_on_is_left_alone(
        short_tmp: Path) -> None:
    """Only the GPU the pod's fractional container is planned on: a process of the pod in an
    unknown container on the other GPU is nobody's, as before."""
    rig = old_node(short_tmp)
    uid = add(rig)
    assert rig.step().converged
    rig.proc_entry(4242, f"{slice_of(uid)}/cri-containerd-{NEW}.scope"[len("/sys/fs/cgroup"):])
    rig.nvml.add_process(4242, rig.gpu1, 70 * GIB)
    rig.proc_entry(4243, f"{slice_of(uid)}/cri-containerd-{NEW}.scope"[len("/sys/fs/cgroup"):])
    rig.nvml.add_process(4243, rig.gpu0, 30 * GIB)
    rig.reconciler.check_usage()
    assert rig.killer.calls == [4243] and used(rig) == [30 * GIB]


def test_a_container_the_status_names_no_id_for_yet_is_capped(short_tmp: Path) -> None:
    """A pod whose status names no container ID yet (just started) is applied, its marker
    written: before, its process was nobody's until the status named the container."""
    rig = old_node(short_tmp)
    uid = rig.add(pod("p", notes=binder_annotations(devices=rig.gpu0),
                      container_id=None))["metadata"]["uid"]
    assert rig.step().converged
    rig.reconciler.check_usage()
    rig.proc_entry(4242, f"{slice_of(uid)}/cri-containerd-{NEW}.scope"[len("/sys/fs/cgroup"):])
    rig.nvml.add_process(4242, rig.gpu0, 70 * GIB)
    rig.reconciler.check_usage()
    assert rig.killer.calls == [4242] and used(rig) == [70 * GIB]
