"""What counts as memory that no listed process accounts for (NoProcessesVisible), on a healthy
agent in the host's pid namespace.

Before: only NVML's compute listing was accounted, while NVML lists a graphics process (Xorg, a
Vulkan or OpenGL renderer) in the graphics listing only (and some drivers list MPS clients in an
MPS listing only): such a GPU read as hidden memory, and a new watchdog-only pod placed there
waited for ever (its own processes, held by its gate, could never show up). And the GPU's memory
was read after the listings, the /proc reads and the stops, so a process that started in
between (another tenant's, or the pod's own first one) counted as hidden, and set markers
aside on a healthy node."""

from __future__ import annotations

from pathlib import Path

import pytest

from kai_fractions.gate.check import Outcome
from kai_fractions.sim.nvml import FakeNvml

from .builders import GIB, MIB, marker_of
from .test_watchdog_only_tier_blind import BLIND, add, gate, old_node, result, running


def blindness(rig) -> dict[str, str]:
    return {u: b.reason for u, b in rig.reconciler.usage.blindness().items()}


@pytest.mark.parametrize("kind", ["graphics", "mps"])
def test_memory_of_processes_listed_apart_is_accounted(short_tmp: Path, kind: str) -> None:
    """The reviewer's probe (P2): 1 GiB of a graphics process, 3 GiB of a listed compute
    tenant; a new watchdog-only pod on that GPU is applied and stays so."""
    rig = old_node(short_tmp)
    rig.proc_entry(555, "/system.slice/some-service.scope")
    rig.nvml.add_process(555, rig.gpu0, 3 * GIB)
    rig.proc_entry(556, "/system.slice/display-manager.service")
    rig.nvml.add_process(556, rig.gpu0, GIB, kind=kind)
    rig.step()
    rig.reconciler.check_usage()
    uid = add(rig)
    assert rig.step().converged
    for _ in range(5):
        rig.reconciler.check_usage()
        assert rig.step().converged
    assert blindness(rig) == {}
    assert result(rig, uid).state.value == "applied" and gate(rig, uid) is Outcome.RELEASE
    assert rig.agent.condition().reason == "AgentReady"
    # the pod's own process comes: it is seen and capped as ever
    running(rig, uid, 4242, 30 * GIB)
    rig.reconciler.check_usage()
    assert rig.killer.calls == [4242]


def test_a_process_in_both_listings_counts_once(short_tmp: Path) -> None:
    """A process with a compute and a graphics context is in both listings, with the same
    memory: counted twice, it would hide as much memory of someone else."""
    rig = old_node(short_tmp)
    uid = add(rig)
    assert rig.step().converged
    rig.proc_entry(556, "/system.slice/renderer.service")
    rig.nvml.add_process(556, rig.gpu0, 2 * GIB)
    # in the graphics listing too (the sim counts the GPU's memory per entry: 0 here, and
    # the listing below says 2 GiB, as NVML gives the process's memory in each)
    rig.nvml.add_process(556, rig.gpu0, 0, kind="graphics")
    hidden = 700 * MIB  # someone NVML does not list at all
    rig.nvml.add_process(900, rig.gpu0, hidden)
    listed = type(rig.nvml).running_processes
    rig.nvml.running_processes = lambda u: tuple(  # type: ignore[method-assign]
        p for p in listed(rig.nvml, u) if p.pid != 900)
    other = type(rig.nvml).other_processes
    rig.nvml.other_processes = lambda u: tuple(  # type: ignore[method-assign]
        p.__class__(p.pid, 2 * GIB) if p.pid == 556 else p for p in other(rig.nvml, u))
    rig.reconciler.check_usage()
    assert blindness(rig) == {rig.gpu0: "NoProcessesVisible"}
    rig.step()
    assert result(rig, uid).reason == BLIND


@pytest.mark.parametrize("mode", ["time-slicing", "sm-sharing"])
def test_listings_the_driver_lacks_are_no_processes_not_blindness(short_tmp: Path,
                                                                  mode: str) -> None:
    """A driver without the graphics and MPS listings (FunctionNotFound: the fake fails each
    apart, `fail("other_processes")` the graphics one only since b4cbc70): they list no
    process, and the GPU is not blind, neither for a time-slicing container nor for an
    sm-sharing one (whose MPS clients an MPS listing that fails may hide: `MpsListingFailed`;
    one the driver lacks hides nothing). Memory nobody lists is still found."""
    rig = old_node(short_tmp, sm_sharing=mode == "sm-sharing")
    rig.nvml.fail("other_processes", "FunctionNotFound", times=None)
    rig.nvml.fail("mps_processes", "FunctionNotFound", times=None)
    uid = add(rig, mode=mode)
    assert rig.step().converged
    rig.reconciler.check_usage()
    assert rig.step().converged and blindness(rig) == {}
    assert marker_of(rig, uid) is not None
    assert rig.agent.condition().reason == "AgentReady"
    # memory nobody lists is still found so
    rig.nvml.add_process(900, rig.gpu0, 2 * GIB)
    listed = type(rig.nvml).running_processes
    rig.nvml.running_processes = lambda u: tuple(  # type: ignore[method-assign]
        p for p in listed(rig.nvml, u) if p.pid != 900)
    rig.reconciler.check_usage()
    assert blindness(rig) == {rig.gpu0: "NoProcessesVisible"}


def test_failing_graphics_and_mps_listings_leave_the_compute_listing_to_account(
        short_tmp: Path) -> None:
    """The graphics and MPS listings failing (not missing; each failed apart in the fake:
    `fail("other_processes")` is the graphics one only since b4cbc70, so this test failed the
    graphics listing alone before review finding S2-5) must not switch the test off: an agent
    without hostPID is still found by what the compute listing shows, and a GPU clear by it
    ends its episode (a third look found the pod released, or held for ever). A time-slicing
    container's GPU: the MPS listing failing is no blindness of its own there."""
    rig = old_node(short_tmp)
    uid = add(rig)
    assert rig.step().converged
    rig.nvml.add_process(900, rig.gpu0, 2 * GIB)
    listed = type(rig.nvml).running_processes
    rig.nvml.running_processes = lambda u: tuple(  # type: ignore[method-assign]
        p for p in listed(rig.nvml, u) if p.pid != 900)
    rig.nvml.fail("other_processes", "Unknown", times=None)
    rig.nvml.fail("mps_processes", "Unknown", times=None)
    rig.reconciler.check_usage()
    assert blindness(rig) == {rig.gpu0: "NoProcessesVisible"}
    rig.step()
    assert result(rig, uid).reason == BLIND and marker_of(rig, uid) is None
    rig.nvml.remove_process(900)
    for _ in range(2):
        rig.reconciler.check_usage()
    assert blindness(rig) == {}
    rig.step()
    assert result(rig, uid).state.value == "applied" and marker_of(rig, uid) is not None


def test_a_memory_read_that_fails_in_the_test_counts_as_blind(short_tmp: Path) -> None:
    """A suspect GPU whose memory cannot be read cannot be told clear: blind under NVML's
    reason, visible in the usage-unknown gauge, until a test runs again."""
    rig = old_node(short_tmp)
    uid = add(rig)
    assert rig.step().converged
    rig.nvml.fail("devices", "Unknown", times=None)
    rig.reconciler.check_usage()
    rig.nvml.clear_failures()
    assert blindness(rig) == {rig.gpu0: "NVMLError"}
    assert rig.reconciler.usage.sight.unreadable()[rig.gpu0].reason == "NVMLError"
    rig.step()
    assert result(rig, uid).reason == BLIND and marker_of(rig, uid) is None
    for _ in range(2):
        rig.reconciler.check_usage()
    assert blindness(rig) == {}
    rig.step()
    assert result(rig, uid).state.value == "applied" and marker_of(rig, uid) is not None


def appears_after_listing(rig, gpu: str, start) -> None:
    """Runs `start` (a process starting) right after NVML listed `gpu`'s compute processes."""
    real = type(rig.nvml).running_processes
    done = []

    def running_processes(uuid: str):
        out = real(rig.nvml, uuid)
        if uuid == gpu and not done:
            done.append(True)
            start()
        return out

    rig.nvml.running_processes = running_processes  # type: ignore[method-assign]


def test_a_process_starting_between_listing_and_memory_read_is_not_hidden(
        short_tmp: Path) -> None:
    """The reviewer's probe (P1): another fractional pod's first process starts right after
    GPU 0's listing."""
    rig = old_node(short_tmp)
    p = add(rig)
    assert rig.step().converged
    rig.reconciler.check_usage()
    q = add(rig, "q", request="5Gi", limit="10Gi")
    assert rig.step().converged
    appears_after_listing(rig, rig.gpu0, lambda: running(rig, q, 777, 2 * GIB))
    rig.reconciler.check_usage()
    del rig.nvml.running_processes
    assert blindness(rig) == {}
    assert rig.reconciler.usage_needs_pass() is False
    assert rig.step().converged
    for uid in (p, q):
        assert result(rig, uid).state.value == "applied" and marker_of(rig, uid) is not None
        assert rig.cluster.event_reasons(uid) == ["Applied"]


def test_the_pods_own_first_process_starting_meanwhile_is_not_hidden(short_tmp: Path) -> None:
    """The reviewer's probe (P1b)."""
    rig = old_node(short_tmp)
    uid = add(rig)
    assert rig.step().converged
    rig.reconciler.check_usage()
    appears_after_listing(rig, rig.gpu0, lambda: running(rig, uid, 4242, 600 * MIB))
    rig.reconciler.check_usage()
    del rig.nvml.running_processes
    assert blindness(rig) == {}
    assert rig.step().converged and marker_of(rig, uid) is not None
    assert rig.cluster.event_reasons(uid) == ["Applied"]


def test_a_process_hidden_before_and_after_the_listing_is_still_found(
        short_tmp: Path) -> None:
    rig = old_node(short_tmp)
    uid = add(rig)
    assert rig.step().converged
    running(rig, uid, 100, 5 * GIB)
    listed = type(rig.nvml).running_processes
    rig.nvml.running_processes = lambda u: tuple(  # type: ignore[method-assign]
        p for p in listed(rig.nvml, u) if p.pid != 100)
    since = len(rig.nvml.calls)
    rig.reconciler.check_usage()
    assert blindness(rig) == {rig.gpu0: "NoProcessesVisible"}
    # the suspect's own sequence: a read of the memory, its listings again, another read
    calls = [c.method for c in rig.nvml.calls[since:]]
    first = calls.index("devices")
    assert calls[first:] == ["devices", "running_processes", "other_processes", "devices"]


def test_a_check_whose_gpus_list_their_containers_processes_reads_no_memory(
        short_tmp: Path) -> None:
    """The steady state of a busy node costs the check no NVML call more than its listings
    (compute, then graphics and MPS, once each per GPU): only a GPU whose listings show no
    managed container's process is a suspect."""
    rig = old_node(short_tmp)
    uid = add(rig)
    assert rig.step().converged
    running(rig, uid, 100, 5 * GIB)
    since = len(rig.nvml.calls)
    rig.reconciler.check_usage()
    assert blindness(rig) == {}
    calls = [c.method for c in rig.nvml.calls[since:]]
    assert "devices" not in calls
    assert calls.count("running_processes") == calls.count("other_processes") == 2


def test_the_sim_lists_each_kind_apart() -> None:
    nvml = FakeNvml.from_dict({"gpus": [{"model": "L4"}], "processes": [
        {"gpu": 0, "pid": 1, "used": "1Gi"},
        {"gpu": 0, "pid": 2, "used": "2Gi", "kind": "graphics"},
        {"gpu": 0, "pid": 3, "used": "3Gi", "kind": "mps"}]})
    nvml.init()
    (u,) = nvml.gpus
    assert [p.pid for p in nvml.running_processes(u.uuid)] == [1]
    assert [p.pid for p in nvml.other_processes(u.uuid)] == [2, 3]
    assert nvml.devices()[0].memory_used == 6 * GIB
