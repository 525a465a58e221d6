"""The watchdog where it is a container's only memory tier (a driver before r615, time-slicing,
--watchdog-policy=kill) runs inside the agent: when no agent runs, or none has planned the pod,
nothing stops a process over the cap, and no marker may say otherwise.

Before: at the agent's stop (`Reconciler.close`, `abandon`) only the markers relying on an MPS
daemon were set aside, so a watchdog-only pod's marker kept saying "limits in force: memory
watchdog" and a restarted sandbox's gate released with no watchdog running; a fresh agent whose
passes failed before they planned (the pods not listed) kept it too, since the early pass's
set-aside read only the last plan, and it had none.

Now both set such markers aside (as the marker records, where no plan names the pod), a marker
with another tier in force stays, and the next agent's first full pass runs a watchdog check
(stopping what is over the cap) before it writes the marker again: a healthy restart delays a
gate, no more.

And then: one the stop set aside for the watchdog alone comes back as it was (no second
`Applied`) once the next agent's pass has run a watchdog check over the pod, so a container
pending for an ordinary reason (a failed call, which says nothing of what is in force) keeps its
marker across a healthy restart, as it does on a running agent; before, it lost it for good,
and a restarted sandbox's gate waited and failed. A marker set aside for anything else (a crash
whose next agent could not plan, a cap known not in force meanwhile) is not restored."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kai_fractions.gate.check import Outcome
from kai_fractions.marker import SET_ASIDE_FILE, ContainerMarker
from kai_fractions.node.agent.markers import (
    SET_ASIDE_CAUSE_FILE,
    WATCHDOG_STOPPED,
    entry_watchdog_only,
)
from kai_fractions.node.config import WatchdogPolicy
from kai_fractions.node.nvml import GpuComputeMode
from kai_fractions.sim.nvml import FakeNvml

from .builders import GIB, NODE, Rig, binder_annotations, leaf_of, marker_of, pod
from .builders import gate_outcome as gate
from .builders import result_of as result

OLD_DRIVER = "550.54.15"
DIGEST = "sha256:" + "0" * 64


def old_node(tmp: Path) -> Rig:
    """sm-sharing on (over an MPS daemon that was running: adopted, left running at a stop), so
    a pod with the MPS pinned limit can show what keeps its marker: a daemon with namespaces,
    where that limit is a tier (without them its tenants can change it: no tier)."""
    nvml = FakeNvml.simulated(2, model="H100-80GB", seed=NODE, driver_version=OLD_DRIVER)
    return Rig(tmp, nvml=nvml, sm_sharing=True, mps_v3=True,
               watchdog_policy=WatchdogPolicy.KILL)


def two_pods(rig: Rig) -> tuple[str, str]:
    """A time-slicing pod (the watchdog its only memory tier) on GPU 0, an sm-sharing one
    (mps-pinned beside the watchdog) on GPU 1; both applied, their markers written."""
    ts = rig.add(pod("ts", notes=binder_annotations(devices=rig.gpu0)))["metadata"]["uid"]
    sm = rig.add(pod("sm", notes=binder_annotations(devices=rig.gpu1, mode="sm-sharing"))
                 )["metadata"]["uid"]
    assert rig.step().converged
    assert {m.value for m in result(rig, ts).mechanisms} == {"watchdog"}
    assert {m.value for m in result(rig, sm).mechanisms} == {"mps-pinned", "watchdog"}
    assert gate(rig, ts) is Outcome.RELEASE and gate(rig, sm) is Outcome.RELEASE
    return ts, sm


def set_aside(rig: Rig, uid: str) -> bool:
    return (not rig.marker_path(uid).exists()
            and (rig.marker_path(uid).parent / SET_ASIDE_FILE).exists())


def over_the_cap(rig: Rig, uid: str, pid: int = 4242) -> None:
    """A process of the pod's container using 30 GiB against its 20 GiB cap."""
    rig.proc_entry(pid, leaf_of(uid)[len("/sys/fs/cgroup"):])
    rig.nvml.add_process(pid, rig.gpu0, 30 * GIB)


def first_full_pass_checks_then_writes(new: Rig, ts: str, pid: int = 4242) -> None:
    """The next agent's first pass that plans runs a watchdog check (which stops the process
    over the cap) before it vouches, then writes the marker again."""
    assert new.killer.calls == [] and gate(new, ts) is Outcome.WAIT
    assert new.step().converged
    assert new.killer.calls == [pid]
    assert marker_of(new, ts)["containers"]["main"]["message"] == (
        "limits in force: memory watchdog; compute time-slicing")
    assert gate(new, ts) is Outcome.RELEASE and not set_aside(new, ts)


# -- the agent stops ------------------------------------------------------------------------------


def test_a_stop_sets_a_watchdog_only_marker_aside_and_the_next_agent_writes_it_again(
        short_tmp: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The reviewer's probe: after `NodeAgent.stop` the watchdog-only pod's gate released."""
    rig = old_node(short_tmp)
    ts, sm = two_pods(rig)
    sm_marker = rig.marker_path(sm).read_text()
    with caplog.at_level(logging.WARNING, logger="kai_fractions.node.agent.reconciler"):
        rig.agent.stop(timeout=5)
    assert set_aside(rig, ts) and gate(rig, ts) is Outcome.WAIT
    # mps-pinned on an adopted daemon (left running) still caps it: kept as it was
    assert rig.marker_path(sm).read_text() == sm_marker and gate(rig, sm) is Outcome.RELEASE
    (line,) = [r.getMessage() for r in caplog.records if "set aside its marker" in r.getMessage()]
    assert line.startswith("pod default/ts: set aside its marker: no watchdog watches container "
                           "main (WatchdogBlind: the watchdog is its only GPU memory tier): "
                           "the node agent stopped, and its watchdog with it")
    assert "the next node agent writes the marker again" in line

    new = rig.restarted()
    over_the_cap(new, ts)
    first_full_pass_checks_then_writes(new, ts)
    assert rig.marker_path(sm).read_text() == sm_marker


def test_an_abandoned_stop_sets_it_aside_and_the_stuck_pass_cannot_write_it_back(
        short_tmp: Path) -> None:
    """A worker stuck past the stop's bound (`abandon`): the watchdog dies with the agent's
    container all the same; the store is closed first, so the stuck pass writes nothing."""
    rig = old_node(short_tmp)
    ts, sm = two_pods(rig)
    assert rig.reconciler.abandon() == [ts]
    assert set_aside(rig, ts) and gate(rig, ts) is Outcome.WAIT
    rig.step()  # the stuck pass ends
    assert set_aside(rig, ts) and gate(rig, ts) is Outcome.WAIT
    assert gate(rig, sm) is Outcome.RELEASE


# -- a fresh agent that cannot plan ---------------------------------------------------------------


@pytest.mark.parametrize("failure", ["not listed", "nvml down"])
def test_a_fresh_agent_that_cannot_plan_sets_it_aside_as_the_marker_records(
        short_tmp: Path, failure: str) -> None:
    """The reviewer's second probe: a restarted agent that cannot list its pods (the API server
    unreachable) runs no watchdog check (it has no plan), yet the marker stayed and the gate
    released a process 10 GiB over its cap. With no plan, what the marker records decides."""
    rig = old_node(short_tmp)
    ts, sm = two_pods(rig)
    sm_marker = rig.marker_path(sm).read_text()
    new = rig.restarted()  # a crash: no stop ran
    over_the_cap(new, ts)
    if failure == "nvml down":
        new.sync()
        new.nvml.fail("driver_version", "DriverNotLoaded", times=None)
    for _ in range(3):
        report = new.reconciler.reconcile()
        new.reconciler.check_usage()  # the worker's scheduled checks: no plan, none watches
    assert not report.applied and new.killer.calls == []
    assert set_aside(new, ts) and gate(new, ts) is Outcome.WAIT
    assert rig.marker_path(sm).read_text() == sm_marker and gate(new, sm) is Outcome.RELEASE
    new.nvml.clear_failures()
    first_full_pass_checks_then_writes(new, ts)


# -- the next agent restores what the stop set aside -----------------------------------------------


def events(rig: Rig, uid: str) -> list[tuple[str, str]]:
    return [(e["type"], e["reason"]) for e in rig.cluster.events
            if e["involvedObject"]["uid"] == uid]


def ts_pod(rig: Rig) -> str:
    uid = rig.add(pod("ts", notes=binder_annotations(devices=rig.gpu0)))["metadata"]["uid"]
    assert rig.step().converged
    assert {m.value for m in result(rig, uid).mechanisms} == {"watchdog"}
    return uid


def pending_for_an_ordinary_reason(rig: Rig, uid: str) -> None:
    """Its time-slicing GPU left in EXCLUSIVE_PROCESS, and the agent may not set it: pending
    with NVML's error, which says nothing of what is in force (its marker stays)."""
    rig.nvml.gpu(rig.gpu0).compute_mode = GpuComputeMode.EXCLUSIVE_PROCESS
    rig.nvml.fail("set_compute_mode", "NoPermission", times=None)
    rig.step()
    r = result(rig, uid)
    assert (r.state.value, r.reason, r.not_in_force) == ("pending", "NVMLNoPermission", False)


def stopped(rig: Rig, uid: str) -> None:
    rig.agent.stop(timeout=5)
    assert set_aside(rig, uid) and gate(rig, uid) is Outcome.WAIT
    cause = rig.marker_path(uid).parent / SET_ASIDE_CAUSE_FILE
    assert cause.read_text() == WATCHDOG_STOPPED


def test_a_container_pending_for_an_ordinary_reason_keeps_its_marker_across_a_restart(
        short_tmp: Path) -> None:
    """The reviewer's probe: after a healthy restart the marker stayed set aside for good while
    the set kept failing, and the gate waited, though the new agent's watchdog watched."""
    rig = old_node(short_tmp)
    ts = ts_pod(rig)
    pending_for_an_ordinary_reason(rig, ts)
    before = rig.marker_path(ts).read_text()
    assert gate(rig, ts) is Outcome.RELEASE
    stopped(rig, ts)

    new = rig.restarted()
    over_the_cap(new, ts)
    new.step()  # its first pass runs a watchdog check over the pod, then restores the marker
    assert new.killer.calls == [4242]
    assert result(new, ts).reason == "NVMLNoPermission"
    assert rig.marker_path(ts).read_text() == before  # the same marker, not a new one
    assert gate(new, ts) is Outcome.RELEASE and not set_aside(new, ts)
    assert not (rig.marker_path(ts).parent / SET_ASIDE_CAUSE_FILE).exists()
    for _ in range(3):
        new.step()
        new.reconciler.check_usage()
    assert rig.marker_path(ts).read_text() == before and gate(new, ts) is Outcome.RELEASE
    assert events(new, ts) == [("Normal", "Applied"), ("Warning", "LimitEnforced")]


def test_a_healthy_restart_sends_no_second_applied_event(short_tmp: Path) -> None:
    """Each healthy rollout sent one more `Applied` per watchdog-only container: the new agent
    wrote the marker the stop had set aside, the same entry for entry."""
    rig = old_node(short_tmp)
    ts = ts_pod(rig)
    before = rig.marker_path(ts).read_text()
    for _ in range(2):
        stopped(rig, ts)
        rig = rig.restarted()
        assert rig.step().converged
        assert rig.marker_path(ts).read_text() == before and gate(rig, ts) is Outcome.RELEASE
    assert events(rig, ts) == [("Normal", "Applied")]


def test_a_marker_the_stop_set_aside_stays_aside_while_the_watchdog_is_blind(
        short_tmp: Path) -> None:
    """The next agent finds the watchdog blind on the pod's GPU (its only tier): a running
    agent sets the marker aside for that (WatchdogBlind), and writes it again only once every
    container is applied. So once the cap was known not in force the stop's cause no longer
    holds: a container still pending for an ordinary reason after it does not get it back."""
    rig = old_node(short_tmp)
    ts = ts_pod(rig)
    pending_for_an_ordinary_reason(rig, ts)
    stopped(rig, ts)

    new = rig.restarted()
    new.nvml.fail("running_processes", "NoPermission", times=None, device=new.gpu0)
    new.step()
    assert result(new, ts).reason == "WatchdogBlind"
    assert set_aside(new, ts) and gate(new, ts) is Outcome.WAIT
    new.nvml.clear_failures()
    new.nvml.fail("set_compute_mode", "NoPermission", times=None)  # still pending, ordinarily
    for _ in range(3):  # the episode ends after two clean checks
        new.reconciler.check_usage()
        new.step()
    assert result(new, ts).reason == "NVMLNoPermission"
    assert set_aside(new, ts) and gate(new, ts) is Outcome.WAIT
    new.nvml.clear_failures()  # the mode can be set: applied, the marker written again
    assert new.step().converged
    assert gate(new, ts) is Outcome.RELEASE and not set_aside(new, ts)


def test_a_marker_set_aside_by_an_agent_that_could_not_plan_is_not_restored(
        short_tmp: Path) -> None:
    """A crash (no stop), then an agent whose passes cannot plan sets the marker aside (no
    watchdog check watches the pod): not the stop's cause, so it is written again only once
    every container is applied."""
    rig = old_node(short_tmp)
    ts = ts_pod(rig)
    pending_for_an_ordinary_reason(rig, ts)
    new = rig.restarted()
    new.reconciler.reconcile()  # the pods not listed yet
    assert set_aside(new, ts)
    assert not (rig.marker_path(ts).parent / SET_ASIDE_CAUSE_FILE).exists()
    for _ in range(3):
        new.step()
        new.reconciler.check_usage()
    assert result(new, ts).reason == "NVMLNoPermission"
    assert set_aside(new, ts) and gate(new, ts) is Outcome.WAIT


# -- what the marker records ----------------------------------------------------------------------


@pytest.mark.parametrize(("message", "only"), [
    ("limits in force: memory watchdog; compute time-slicing", True),
    ("limits in force: memory cgroup,watchdog; compute time-slicing", False),
    ("limits in force: memory mps-pinned,watchdog; compute mps-namespace", False),
    ("limits in force: memory mps-pinned; compute mps-client-env", False),
    ("limits in force: memory cgroup; compute time-slicing", False),
    # a report-only watchdog stops nothing: it vouches for no cap
    ("limits in force: memory watchdog (reports, stops nothing); compute time-slicing", False),
    # not as any release writes it: taken for the watchdog alone (set aside: a gate waits)
    ("limits applied", True),
    ("limits in force: memory watchdog; compute some-future-mode", True),
])
def test_an_entry_records_the_watchdog_as_its_only_tier(message: str, only: bool) -> None:
    assert entry_watchdog_only(ContainerMarker.applied(DIGEST, message)) is only
    assert entry_watchdog_only(ContainerMarker.refused("R", message, DIGEST)) is False
