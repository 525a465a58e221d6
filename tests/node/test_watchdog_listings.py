"""What the watchdog attributes: every NVML listing of a GPU's processes, each pid once; and a
managed pod's process in a container whose ID the agent does not know yet.

Before: the watchdog was given the compute listing only, and a pid given twice (a process with
contexts of two kinds, in two listings) counted twice; a process whose cgroup named a managed
pod but a container ID the agent did not know (the pod's status still naming the old ID, or
none, right after a container start or restart) was "unmanaged": not counted, not stopped, not
blind. Now the listings are merged (one row per pid, its largest memory figure), and such a
process counts for the pod's fractional container capped on that GPU (the contract allows one
per pod; the cgroup tier caps the pod's slice, every container alike)."""

from __future__ import annotations

from kai_fractions.contract import MIB
from kai_fractions.node.procfs import Procfs
from kai_fractions.node.watchdog import (
    SKIPPED,
    TERMINATE,
    TERMINATED,
    ContainerUsage,
    ManagedContainer,
    Watchdog,
    merge_listings,
)
from kai_fractions.sim.killer import RecordingKiller

from .test_watchdog import (
    CAP,
    CID_A,
    CID_B,
    GPU0,
    GPU1,
    POD_A,
    POD_B,
    Clock,
    FakeProc,
    Proc,
    systemd,
)

CID_NEW = "c3" * 32
"""The ID of pod A's container after a restart, which the pod's status does not name yet."""


def trainer(container_id: str | None = f"containerd://{CID_A}") -> ManagedContainer:
    return ManagedContainer.uniform(POD_A, "trainer", container_id, CAP, [GPU0])


def dog(root, policy: str = "kill", killer=None) -> Watchdog:
    return Watchdog(policy, Procfs(root), killer or RecordingKiller(), None, Clock())


def test_the_listings_merge_into_one_row_per_pid_with_its_largest_figure() -> None:
    """A process in the compute and the MPS listing counts once, with its largest figure; a
    figure NVML has not (None) only where no listing has one; first-listed order."""
    compute = [Proc(100, 600 * MIB), Proc(101, None), Proc(102, None)]
    graphics = [Proc(100, 200 * MIB), Proc(103, 5 * MIB)]
    mps = [Proc(101, 300 * MIB), Proc(100, 700 * MIB), Proc(102, None)]
    assert merge_listings(compute, graphics, mps) == (
        Proc(100, 700 * MIB), Proc(101, 300 * MIB), Proc(102, None), Proc(103, 5 * MIB))
    assert merge_listings() == ()


def test_a_pid_given_in_two_listings_counts_once(tmp_path) -> None:
    """Before: 600 MiB in the compute listing and the same 600 MiB in the graphics one read as
    1200 MiB over a 1024 MiB cap, and the process was stopped."""
    proc = FakeProc(tmp_path)
    proc.add(100, systemd(POD_A, CID_A))
    killer = RecordingKiller()
    report = dog(tmp_path, killer=killer).check(
        {GPU0: [Proc(100, 600 * MIB), Proc(100, 600 * MIB)]}, [trainer()])
    assert report.violations == () and killer.calls == []
    assert report.usage == (ContainerUsage(POD_A, "trainer", f"containerd://{CID_A}", GPU0,
                                           600 * MIB, CAP, (100,)),)


def test_a_new_container_id_of_the_pod_counts_for_its_fractional_container(tmp_path) -> None:
    """The pod's container restarted (the status still names the old ID): its new process
    over the cap is counted and stopped as the container's own; the same process on a GPU
    where the container is not capped, and another pod's, stay unmanaged as before."""
    proc = FakeProc(tmp_path)
    proc.add(100, systemd(POD_A, CID_A))
    proc.add(500, systemd(POD_A, CID_NEW))
    proc.add(200, systemd(POD_B, CID_B))
    killer = RecordingKiller()
    report = dog(tmp_path, killer=killer).check(
        {GPU0: [Proc(500, 2 * CAP), Proc(200, 9 * CAP)], GPU1: [Proc(500, 3 * CAP)]},
        [trainer()])
    (v,) = report.violations
    assert (v.container_name, v.device_uuid, v.used_bytes, v.pids) == (
        "trainer", GPU0, 2 * CAP, (500,))
    assert killer.calls == [500] and killer.killed == [500]  # still ours at the signal
    assert [(a.pid, a.step, a.outcome) for a in report.actions] == [
        (500, TERMINATE, TERMINATED)]
    assert set(report.unmanaged) == {(GPU0, 200), (GPU1, 500)}
    assert report.unplaced == ()


def test_a_container_whose_runtime_id_is_not_known_yet_is_capped_through_its_pod(
        tmp_path) -> None:
    """Before: a container without a runtime ID in its pod's status (just started) was never
    enforced, its process "unmanaged", while its marker stood. Now its pod's process on its
    GPU counts for it (its usage row has no container ID)."""
    proc = FakeProc(tmp_path)
    proc.add(100, systemd(POD_A, CID_A))
    killer = RecordingKiller()
    report = dog(tmp_path, killer=killer).check({GPU0: [Proc(100, 2 * CAP)]}, [trainer(None)])
    assert [(v.container_id, v.pids) for v in report.violations] == [(None, (100,))]
    assert killer.killed == [100]
    assert report.usage == (ContainerUsage(POD_A, "trainer", None, GPU0, 2 * CAP, CAP,
                                           (100,)),)
    # in report mode: reported, nothing stopped
    killer = RecordingKiller()
    report = dog(tmp_path, "report", killer).check({GPU0: [Proc(100, 2 * CAP)]},
                                                   [trainer(None)])
    assert len(report.violations) == 1 and killer.calls == []


def test_a_process_that_leaves_the_pod_before_its_signal_is_not_stopped(tmp_path) -> None:
    """The ownership read again at the signal applies the same rule: a process attributed
    through its pod that is another pod's by then is skipped."""
    proc = FakeProc(tmp_path)
    proc.add(500, systemd(POD_A, CID_NEW))

    class Moving(RecordingKiller):
        def terminate(self, pid, still_ours):
            proc.add(pid, systemd(POD_B, CID_B))  # the pid is another pod's now
            return super().terminate(pid, still_ours)

    killer = Moving()
    report = dog(tmp_path, killer=killer).check({GPU0: [Proc(500, 2 * CAP)]}, [trainer()])
    assert killer.calls == [500] and killer.killed == []
    assert [(a.pid, a.outcome) for a in report.actions] == [(500, SKIPPED)]


def test_an_unknown_id_in_a_pod_with_several_capped_containers_is_unplaced(tmp_path) -> None:
    """Against the contract (one fractional container per pod), which container it is cannot
    be told: the watchdog says so (unplaced, so the agent counts the GPU blind) and touches
    nothing, rather than pick one."""
    proc = FakeProc(tmp_path)
    proc.add(500, systemd(POD_A, CID_NEW))
    side = ManagedContainer.uniform(POD_A, "side", f"containerd://{CID_B}", CAP, [GPU0])
    killer = RecordingKiller()
    report = dog(tmp_path, killer=killer).check({GPU0: [Proc(500, 2 * CAP)]},
                                                [trainer(), side])
    assert report.violations == () and killer.calls == []
    ((device, pid, why),) = report.unplaced
    assert (device, pid) == (GPU0, 500)
    assert CID_NEW in why and "2 of that pod's containers are capped on that GPU" in why
