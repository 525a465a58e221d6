"""An MPS control daemon known not running takes every cap that relies on it along, whether or
not the pass gets as far as its apply: the markers that vouch for such caps are set aside at
once, also on a pass that returns early (the pods not listed yet, a list not confirmed, NVML
down), and by an agent with no plan yet (a fresh start after a crash), which reads what each
marker records. And at a stop whose worker overruns its bound, the daemon this agent started
still dies with its container: its markers are set aside all the same, and the pass that ends
late writes none back.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from kai_fractions.gate.check import Outcome
from kai_fractions.kube.errors import KubeError
from kai_fractions.marker import ContainerMarker, MarkerState
from kai_fractions.node.agent.markers import (
    MarkersClosed,
    MarkerStore,
    decide,
    entry_relies_on_mps,
)
from kai_fractions.node.agent.reconciler import UNCONFIRMED
from kai_fractions.node.config import Mechanism
from kai_fractions.node.desired import ComputeEnforcement, ContainerKey
from kai_fractions.node.engine import ContainerResult, ContainerState

from .builders import NODE, Rig, marker_of, wait_for
from .test_mps_daemon_down import _gate, _reasons, _set_aside, _sm_pod, _ts_pod

DIGEST = "sha256:" + "ab" * 32


def _down_for_good(rig: Rig) -> None:
    """The daemon dies and cannot be started again (its start fails, the backoff, no binary)."""
    rig.mps.control.kill()
    rig.mps.can_start = False


def _nvml_down(rig: Rig) -> None:
    """The driver in trouble (a GPU off the bus): NVML fails, and so does each take."""
    rig.nvml.fail("init", "DriverNotLoaded", times=None)
    rig.nvml.fail("driver_version", "DriverNotLoaded", times=None)


# -- with a plan: a pass that returns before its apply -----------------------------------------


def test_nvml_down_with_the_daemon_dead_sets_the_markers_that_rely_on_it_aside(
        short_tmp: Path) -> None:
    """NVML down returns before the apply: "the limits live in the kernel" holds for the cgroup
    limits, not for the MPS caps, which went with the daemon. The marker used to stay, and a
    restarted sandbox's gate released a workload that would find no MPS daemon."""
    rig = Rig(short_tmp)
    uid, ts = _sm_pod(rig), _ts_pod(rig)
    assert rig.step().converged
    ts_marker = rig.marker_path(ts).read_text()
    _nvml_down(rig)
    _down_for_good(rig)
    for _ in range(3):
        report = rig.step()
        assert not report.applied and "MpsDaemonUnreachable" in report.errors
        assert rig.reconciler.mps_health.not_running
        assert _set_aside(rig, uid) and _gate(rig, uid) is Outcome.WAIT
        # time-slicing relies on no daemon, and its limits do live in the kernel
        assert rig.marker_path(ts).read_text() == ts_marker
    assert _gate(rig, ts) is Outcome.RELEASE

    rig.nvml.clear_failures()
    rig.mps.can_start = True
    assert rig.step().converged
    assert marker_of(rig, uid)["containers"]["main"]["state"] == "applied"
    assert _gate(rig, uid) is Outcome.RELEASE
    assert rig.marker_path(ts).read_text() == ts_marker


def test_a_list_not_confirmed_with_the_daemon_dead_sets_the_markers_aside(
        short_tmp: Path) -> None:
    """A list from the watch cache that lacks a pod the agent knew returns before the apply
    until a consistent list confirms it: the daemon's markers go aside meanwhile all the same."""
    rig = Rig(short_tmp, options={"list_from_watch_cache": True})
    uid, other = _sm_pod(rig), _sm_pod(rig, "other")
    assert rig.step().converged
    # a lagging watch cache lacks `other`, and no consistent list answers to confirm it gone
    rig.agent.cache.replace([p for p in rig.cluster.pods_on(NODE)
                             if p["metadata"]["uid"] != other], consistent=False)
    rig.cluster.fail("list_pods", KubeError("etcd: request timed out"))
    _down_for_good(rig)
    report = rig.reconciler.reconcile()
    assert UNCONFIRMED in report.errors and not report.applied
    assert _set_aside(rig, uid) and _gate(rig, uid) is Outcome.WAIT
    assert _set_aside(rig, other)  # unconfirmed: still the plan's, and its caps went too


# -- no plan yet: a fresh agent decides from the markers ---------------------------------------


@pytest.mark.parametrize("early", ["pods-not-listed", "nvml-down"])
def test_a_fresh_agent_whose_daemon_cannot_start_sets_aside_what_the_markers_record(
        short_tmp: Path, early: str) -> None:
    """The agent crashed (no clean stop: nothing set aside) and its daemon died with its
    container; the next one cannot start its own, and its first pass returns before it plans
    anything: the API is not reachable yet, or NVML is down. Its old markers used to release
    until its first full pass; it knows the daemon is not running, and each marker records
    whether it vouches for MPS caps (sm-sharing: yes; time-slicing: no)."""
    rig = Rig(short_tmp)
    rig.mps.control.kill()  # the agent starts (owns) its daemon, as in the chart
    uid, ts = _sm_pod(rig), _ts_pod(rig)
    assert rig.step().converged and rig.reconciler.mps_health.owned
    ts_marker = rig.marker_path(ts).read_text()
    rig.mps.control.kill()  # the crash: no close(), the daemon gone with the container

    new = rig.restarted()
    new.mps.can_start = False
    if early == "pods-not-listed":
        report = new.reconciler.reconcile()
        assert "NotListed" in report.errors
    else:
        _nvml_down(new)
        report = new.step()
        assert not report.applied
    assert new.reconciler.view.desired is None  # no plan: the markers said it
    assert new.reconciler.mps_health.not_running
    assert _set_aside(new, uid) and _gate(new, uid) is Outcome.WAIT
    assert new.marker_path(ts).read_text() == ts_marker and _gate(new, ts) is Outcome.RELEASE

    new.nvml.clear_failures()
    new.mps.can_start = True
    assert new.step().converged
    assert marker_of(new, uid)["containers"]["main"]["state"] == "applied"
    assert _gate(new, uid) is Outcome.RELEASE
    assert new.marker_path(ts).read_text() == ts_marker
    assert _reasons(new, uid)[-1] == "Applied"


def test_a_fresh_agent_whose_new_daemon_holds_nothing_yet_sets_the_markers_aside(
        short_tmp: Path) -> None:
    """The common crash: the next agent starts a daemon of its own at once, but cannot apply
    yet (the API is not reachable). That daemon has none of the namespaces, percentages and
    pinned limits the old markers vouch for: they are set aside until its first apply puts
    them back, verified, and writes them again."""
    rig = Rig(short_tmp)
    rig.mps.control.kill()
    uid, ts = _sm_pod(rig), _ts_pod(rig)
    assert rig.step().converged
    ts_marker = rig.marker_path(ts).read_text()
    rig.mps.control.kill()  # the crash: the daemon gone with the agent's container

    new = rig.restarted()
    report = new.reconciler.reconcile()  # its daemon starts; the pods are not listed yet
    assert "NotListed" in report.errors
    assert new.mps.control.running and not new.reconciler.mps_health.not_running
    assert not new.mps.control.namespaces  # a new daemon: nothing on it
    assert _set_aside(new, uid) and _gate(new, uid) is Outcome.WAIT
    assert new.marker_path(ts).read_text() == ts_marker

    assert new.step().converged
    assert new.mps.control.namespaces
    assert marker_of(new, uid)["containers"]["main"]["state"] == "applied"
    assert _gate(new, uid) is Outcome.RELEASE
    # once applied on it, a pass that returns early keeps them
    new.agent.cache.synced = False
    new.reconciler.reconcile()
    assert marker_of(new, uid)["containers"]["main"]["state"] == "applied"


def test_an_agent_that_adopts_a_running_daemon_keeps_the_markers_before_its_first_apply(
        short_tmp: Path) -> None:
    """A daemon that ran before the agent (adopted) still holds its namespaces: a first pass
    that cannot apply leaves the markers as they are."""
    rig = Rig(short_tmp)  # a daemon answers: adopted
    uid = _sm_pod(rig)
    assert rig.step().converged
    written = rig.marker_path(uid).read_text()
    new = rig.restarted()
    new.reconciler.reconcile()  # not listed
    assert not new.reconciler.mps_health.owned
    assert rig.marker_path(uid).read_text() == written


def test_a_marker_that_does_not_say_what_it_vouches_for_is_set_aside(short_tmp: Path) -> None:
    """A marker whose entry reads as no release wrote it (its message not the agent's) cannot
    tell whether it vouches for MPS caps: a fresh agent with its daemon down sets it aside (the
    gate waits until the plan is applied again) rather than let it release; a refused one
    vouches for nothing and stays."""
    rig = Rig(short_tmp)
    uid, ts = _sm_pod(rig), _ts_pod(rig)
    refused = _sm_pod(rig, "refused")
    assert rig.step().converged
    store = rig.reconciler.markers
    store.write(ts, {"main": ContainerMarker.applied(
        marker_of(rig, ts)["containers"]["main"]["plan_digest"], "")})
    store.write(refused, {"main": ContainerMarker.refused("Refused", "no")})
    rig.mps.control.kill()

    new = rig.restarted()
    new.mps.can_start = False
    new.reconciler.reconcile()  # not listed
    assert _set_aside(new, uid) and _set_aside(new, ts)
    assert new.marker_path(refused).exists()


# -- what a marker records ----------------------------------------------------------------------


def _result(compute: ComputeEnforcement | None, mechanisms: set[Mechanism],
            namespace: str | None = None) -> ContainerResult:
    return ContainerResult(ContainerKey("u", "main"), "ns/p/main", ContainerState.APPLIED,
                           plan_digest=DIGEST, mechanisms=frozenset(mechanisms),
                           compute=compute, mps_namespace=namespace)


@pytest.mark.parametrize("stops", [True, False])
@pytest.mark.parametrize("compute", [None, *ComputeEnforcement])
@pytest.mark.parametrize("mechanisms", [set(), {Mechanism.CGROUP},
                                        {Mechanism.CGROUP, Mechanism.WATCHDOG},
                                        {Mechanism.MPS_PINNED},
                                        {Mechanism.CGROUP, Mechanism.MPS_PINNED,
                                         Mechanism.WATCHDOG},
                                        {Mechanism.WATCHDOG, Mechanism.MPS_PINNED}])
def test_what_a_marker_entry_records_reads_back_as_the_plan_says(
        stops: bool, compute: ComputeEnforcement | None, mechanisms: set[Mechanism]) -> None:
    """The rule reads the message every release writes (`_applied_message`): compute other than
    time-slicing, or mps-pinned among the memory mechanisms, relies on the MPS daemon, as
    `engine.relies_on_mps` says of the plan."""
    namespace = "kai-x" if compute is ComputeEnforcement.MPS_NAMESPACE else None
    entry = decide({"main": _result(compute, mechanisms, namespace)},
                   watchdog_stops=stops).write["main"]
    relies = (compute not in (None, ComputeEnforcement.TIME_SLICING)
              or Mechanism.MPS_PINNED in mechanisms)
    assert entry_relies_on_mps(entry) is relies


@pytest.mark.parametrize(("message", "relies"), [
    # what releases wrote
    ("limits in force: memory cgroup,mps-pinned,watchdog (reports, stops nothing); "
     "compute mps-client-env", True),
    ("limits in force: memory cgroup,watchdog (reports, stops nothing); compute time-slicing",
     False),
    ("limits in force: memory none; compute time-slicing", False),
    ("limits in force: memory watchdog; compute mps-namespace", True),
    ("limits in force: memory mps-pinned; compute time-slicing", True),
    # anything else cannot say: counted as relying on MPS
    ("", True),
    ("limits in force", True),
    ("limits in force: memory cgroup; compute something-new", True),
])
def test_the_rule_for_a_marker_entry(message: str, relies: bool) -> None:
    assert entry_relies_on_mps(ContainerMarker.applied(DIGEST, message)) is relies
    refused = ContainerMarker(MarkerState.REFUSED, DIGEST, "Refused", message or "no")
    assert entry_relies_on_mps(refused) is False


# -- a stop whose worker overruns its bound -----------------------------------------------------



def _stuck_pass(rig: Rig) -> threading.Event:
    """Starts a pass that waits, in its MPS health check, until the event returned is set: a
    worker that overruns the agent's stop bound."""
    entered, release = threading.Event(), threading.Event()
    real = rig.mps.ensure_running

    def stuck() -> bool:
        entered.set()
        release.wait()
        return real()

    rig.mps.ensure_running = stuck  # type: ignore[method-assign]
    rig.agent.worker.mark_dirty()
    assert entered.wait(5)
    return release

def test_a_worker_that_overruns_the_stop_bound_still_sets_the_markers_aside(
        short_tmp: Path) -> None:
    """The pass in progress is stuck (a hung control call, say) past the stop's bound: the
    daemon and NVML are left as they are, but the daemon this agent started runs in its
    container and dies with it. Its markers used to stay; they are set aside, and the stuck
    pass, once it ends and applies, writes none of them back (the store is closed first)."""
    rig = Rig(short_tmp)
    rig.mps.control.kill()  # the agent starts (owns) its daemon, as in the chart
    uid, ts = _sm_pod(rig), _ts_pod(rig)
    rig.agent.start()
    wait_for(lambda: rig.marker_path(uid).exists() and rig.marker_path(ts).exists(),
             what="both markers")
    assert rig.reconciler.mps_health.owned
    ts_marker = rig.marker_path(ts).read_text()
    release = _stuck_pass(rig)
    try:
        rig.agent.stop(timeout=0.2)  # the worker cannot finish: it waits for `release`
        assert rig.agent.worker.thread is not None and rig.agent.worker.thread.is_alive()
        assert not rig.mps.stopped  # left as it is
        assert _set_aside(rig, uid) and _gate(rig, uid) is Outcome.WAIT
        assert rig.marker_path(ts).read_text() == ts_marker
    finally:
        release.set()
    rig.agent.worker.thread.join(5)
    assert not rig.agent.worker.thread.is_alive()
    # the late pass applied everything on the daemon that still ran, and wrote nothing back
    assert rig.reconciler.view.results[(uid, "main")].state is ContainerState.APPLIED
    assert _set_aside(rig, uid) and _gate(rig, uid) is Outcome.WAIT
    assert rig.marker_path(ts).read_text() == ts_marker


def test_an_adopted_daemon_keeps_its_markers_when_the_worker_overruns(short_tmp: Path) -> None:
    """A daemon the agent did not start outlives it: nothing is set aside."""
    rig = Rig(short_tmp)
    uid = _sm_pod(rig)
    rig.agent.start()
    wait_for(lambda: rig.marker_path(uid).exists(), what="the marker")
    release = _stuck_pass(rig)
    try:
        rig.agent.stop(timeout=0.2)
        assert rig.marker_path(uid).exists() and _gate(rig, uid) is Outcome.RELEASE
    finally:
        release.set()
    assert rig.agent.worker.thread is not None
    rig.agent.worker.thread.join(5)
    assert rig.marker_path(uid).exists()


def test_a_closed_marker_store_writes_nothing_and_waits_for_a_write_in_progress(
        short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kai_fractions.node.agent import marker_store as markers_module  # where it writes

    store = MarkerStore(short_tmp / "markers", "boot-1")
    uid = "0a1b2c3d-0000-4000-8000-000000000001"
    entries = {"main": ContainerMarker.applied(DIGEST, "m")}
    writing, finish = threading.Event(), threading.Event()
    real = markers_module.write_marker

    def slow_write(root, marker):
        writing.set()
        finish.wait()
        return real(root, marker)

    monkeypatch.setattr(markers_module, "write_marker", slow_write)
    writer = threading.Thread(target=store.write, args=(uid, entries), daemon=True)
    closed: list[bool] = []
    closer = threading.Thread(target=lambda: closed.append(store.close()), daemon=True)
    try:
        writer.start()
        assert writing.wait(5)
        closer.start()
        closer.join(0.2)
        assert closer.is_alive()  # the write in progress holds it
        assert store.closed  # latched already: nothing new starts
    finally:
        finish.set()
    writer.join(5)
    closer.join(5)
    assert closed == [True]
    assert store.read(uid) is not None  # the write in progress landed, before close returned
    with pytest.raises(MarkersClosed):
        store.write(uid, entries)


def test_a_pass_after_the_store_closed_writes_no_marker_and_goes_on(short_tmp: Path) -> None:
    """`MarkerWriter.settle` takes MarkersClosed as a pod not settled: no error of the pass's,
    no marker, the other pods go on."""
    rig = Rig(short_tmp, sm_sharing=False)
    uid = _ts_pod(rig)
    rig.reconciler.markers.close()
    report = rig.step()
    assert report.applied and not report.converged
    assert "MarkerNotWritten" not in report.errors
    assert not rig.marker_path(uid).exists()
