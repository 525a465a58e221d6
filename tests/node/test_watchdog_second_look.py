"""The watchdog's NVML listings taken one by one, and a pid re-read before its signal.

Before: `PynvmlNvml.other_processes` took the graphics listing, then the MPS compute listing, and
an error of the first aborted both: an MPS-only client (70 GiB against a 20 GiB cap) went
uncounted and unstopped while the graphics listing failed, and a failing MPS listing was only
logged, the GPU not blind, so a container whose cap rests on the watchdog alone kept its marker.
And the check before a signal re-read a pid's pod only: a pid reused by another process of the
pod (a sidecar's, an exec's) between NVML's listing and the signal was stopped.

Now each listing is taken on its own (one failing keeps the other's processes); a failing
graphics listing is logged once (the others watched); a failing MPS listing makes a GPU where an
sm-sharing (MPS client) container is planned blind (`MpsListingFailed`); and a pid is signalled
only while it is in the very pod and container it was counted in."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from kai_fractions.node.agent.blindness import BlindnessTracker
from kai_fractions.node.agent.metrics import AgentMetrics
from kai_fractions.node.nvml import GRAPHICS_PROCESSES, MPS_PROCESSES, GpuProcess, PynvmlNvml
from kai_fractions.node.watchdog import SKIPPED
from tests.agent.builders import GIB, leaf_of, marker_of, slice_of
from tests.agent.builders import result_of as result
from tests.agent.test_watchdog_only_tier_blind import BLIND, add, old_node

U0 = "GPU-00000000-0000-0000-0000-000000000001"
MPS_BLIND = "MpsListingFailed"


def seam(graphics, mps) -> PynvmlNvml:
    """The real seam over a stub of pynvml whose two listings are `graphics` and `mps`."""

    class NVMLError(Exception):
        def __init__(self, value: int):
            self.value = value

        def __str__(self) -> str:
            return f"code {self.value}"

    class Mismatch(Exception):
        pass

    stub = SimpleNamespace(NVMLError=NVMLError, NVMLLibraryMismatchError=Mismatch,
                           **{GRAPHICS_PROCESSES: graphics(NVMLError),
                              MPS_PROCESSES: mps(NVMLError)})
    n = object.__new__(PynvmlNvml)
    n._pynvml, n._handles, n._library_path = stub, {U0: object()}, None
    return n


def lists(*rows: tuple[int, int]):
    return lambda _err: lambda _h: [SimpleNamespace(pid=p, usedGpuMemory=b) for p, b in rows]


def fails(_err):
    def listing(_h):
        raise _err(999)  # NVML_ERROR_UNKNOWN: a listing that fails, not one that is missing
    return listing


@pytest.mark.parametrize(("graphics", "mps", "kept"), [
    (fails, lists((101, 70 * GIB)), [GpuProcess(101, 70 * GIB)]),
    (lists((7, GIB)), fails, [GpuProcess(7, GIB)]),
])
def test_one_listing_failing_keeps_the_others_processes(graphics, mps, kept) -> None:
    """The reviewer's probe (w1a), through the real seam: the watchdog is given the processes
    of the listing that works (before: none of either, the MPS client's 70 GiB lost)."""
    sight = BlindnessTracker(seam(graphics, mps), AgentMetrics("node-a"))
    assert list(sight.other_processes(U0)) == kept


def mps_client(rig, uid: str, pid: int, used: int) -> None:
    rig.proc_entry(pid, leaf_of(uid)[len("/sys/fs/cgroup"):])
    rig.nvml.add_process(pid, rig.gpu0, used, kind="mps")


def test_an_mps_only_client_is_stopped_while_the_graphics_listing_fails(
        short_tmp: Path) -> None:
    """The reviewer's probe (w1b): the graphics listing fails on GPU 0; an MPS client listed
    in the MPS listing only uses 70 GiB against a 20 GiB cap. It is counted and stopped, and the
    GPU is not blind (graphics processes are not how an MPS tenant escapes its cap)."""
    rig = old_node(short_tmp, sm_sharing=True, mps_v3=False)
    uid = add(rig, mode="sm-sharing")
    assert rig.step().converged
    rig.proc_entry(100, leaf_of(uid)[len("/sys/fs/cgroup"):])
    rig.nvml.add_process(100, rig.gpu0, 1 * GIB)
    mps_client(rig, uid, 101, 70 * GIB)
    rig.nvml.fail("other_processes", "Unknown", times=None, device=rig.gpu0)
    rig.reconciler.check_usage()
    assert 101 in rig.killer.killed
    assert [u.used_bytes for u in rig.reconciler.view.usage.values()] == [71 * GIB]
    assert rig.reconciler.usage.blindness() == {}
    rig.step()
    assert rig.agent.condition().reason == "AgentReady"


def test_a_failing_mps_listing_makes_an_sm_sharing_gpu_blind(short_tmp: Path) -> None:
    """The MPS listing fails on GPU 0, where an sm-sharing container's cap rests on the
    watchdog alone: an MPS-only client of it could run over its cap unseen, so the GPU is blind
    (`MpsListingFailed`): the container pending WatchdogBlind, its marker set aside, the node
    condition WatchdogBlind. The compute and graphics listings are still watched. Two checks in
    a row with the listing working end the episode."""
    rig = old_node(short_tmp, sm_sharing=True, mps_v3=False)
    uid = add(rig, mode="sm-sharing")
    assert rig.step().converged and marker_of(rig, uid) is not None
    rig.proc_entry(100, leaf_of(uid)[len("/sys/fs/cgroup"):])
    rig.nvml.add_process(100, rig.gpu0, 30 * GIB)  # compute listing: still stopped
    rig.nvml.fail("mps_processes", "Unknown", times=None, device=rig.gpu0)
    rig.reconciler.check_usage()
    assert rig.killer.killed == [100]
    rig.nvml.remove_process(100)
    blind = rig.reconciler.usage.blindness()
    assert {u: b.reason for u, b in blind.items()} == {rig.gpu0: MPS_BLIND}
    assert "MPS" in blind[rig.gpu0].detail
    rig.step()
    assert result(rig, uid).reason == BLIND and marker_of(rig, uid) is None
    assert rig.agent.condition().reason == BLIND
    rig.nvml.clear_failures()
    for _ in range(2):
        rig.reconciler.check_usage()
    assert rig.reconciler.usage.blindness() == {}
    rig.step()
    assert result(rig, uid).state.value == "applied" and marker_of(rig, uid) is not None


def test_both_listings_failing_blind_the_gpu_and_keep_the_compute_listing(
        short_tmp: Path) -> None:
    rig = old_node(short_tmp, sm_sharing=True, mps_v3=False)
    uid = add(rig, mode="sm-sharing")
    assert rig.step().converged
    rig.proc_entry(100, leaf_of(uid)[len("/sys/fs/cgroup"):])
    rig.nvml.add_process(100, rig.gpu0, 30 * GIB)
    rig.nvml.fail("other_processes", "Unknown", times=None)
    rig.nvml.fail("mps_processes", "NoPermission", times=None)
    rig.reconciler.check_usage()
    assert rig.killer.killed == [100]
    assert {u: b.reason for u, b in rig.reconciler.usage.blindness().items()} == {
        rig.gpu0: MPS_BLIND}


def test_a_failing_mps_listing_where_no_mps_client_is_planned_is_no_blindness(
        short_tmp: Path) -> None:
    """A time-slicing container's processes are no MPS clients: the MPS listing hides nothing
    of it, and a node whose MPS listing fails is not held for it."""
    rig = old_node(short_tmp)
    uid = add(rig)
    assert rig.step().converged
    rig.nvml.fail("mps_processes", "Unknown", times=None)
    for _ in range(2):
        rig.reconciler.check_usage()
        rig.step()
    assert rig.reconciler.usage.blindness() == {}
    assert result(rig, uid).state.value == "applied" and marker_of(rig, uid) is not None
    assert rig.agent.condition().reason == "AgentReady"


def reused_by(rig, cgroup: str) -> None:
    """Between NVML's listing and the signal, the listed process exits and its pid goes to a
    new process in `cgroup`."""
    real = rig.killer.terminate

    def terminate(pid, still_ours):
        rig.proc_entry(pid, cgroup[len("/sys/fs/cgroup"):])
        return real(pid, still_ours)

    rig.killer.terminate = terminate


def test_a_pid_reused_by_another_container_of_the_pod_is_not_signalled(
        short_tmp: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The reviewer's probe (w2): the pid goes to a process of the pod's sidecar container (on
    no GPU): skipped, not signalled. Counting keeps the pod's fallback (a process in a
    container the status does not name yet counts for the pod's fractional container), but a
    signal needs the very pod and container the process was counted in."""
    rig = old_node(short_tmp)
    uid = add(rig)
    assert rig.step().converged
    rig.reconciler.check_usage()
    rig.proc_entry(4242, leaf_of(uid)[len("/sys/fs/cgroup"):])
    rig.nvml.add_process(4242, rig.gpu0, 70 * GIB)
    reused_by(rig, f"{slice_of(uid)}/cri-containerd-{'c' * 64}.scope")
    with caplog.at_level("WARNING", logger="kai_fractions.node.watchdog"):
        rig.reconciler.check_usage()
    assert rig.killer.calls == [4242] and rig.killer.killed == []
    assert any(SKIPPED in r.getMessage() and "4242" in r.getMessage() for r in caplog.records)


def test_a_pid_reused_in_the_pods_own_cgroup_is_not_signalled(short_tmp: Path) -> None:
    """The same with the pid going to a process in the pod's own cgroup (no container: None)."""
    rig = old_node(short_tmp)
    uid = add(rig)
    assert rig.step().converged
    rig.reconciler.check_usage()
    rig.proc_entry(4242, f"{slice_of(uid)}/cri-containerd-{'d' * 64}.scope"[
        len("/sys/fs/cgroup"):])
    rig.nvml.add_process(4242, rig.gpu0, 70 * GIB)
    reused_by(rig, slice_of(uid))
    rig.reconciler.check_usage()
    assert rig.killer.calls == [4242] and rig.killer.killed == []
