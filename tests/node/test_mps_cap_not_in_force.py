"""An sm-sharing container whose MPS namespace is without its active-thread percentage (the daemon
restarted, and the namespace made again could not be given its percentage, or a client attached
before it was) is never vouched for: the namespace is deleted when nobody is attached yet, and
the pod's readiness marker is set aside until the percentage is in force again, so no gate (a
restarted sandbox's) lets a client attach to it uncapped."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest

from kai_fractions.gate.check import Outcome
from kai_fractions.marker import SET_ASIDE_FILE, Marker
from kai_fractions.node import engine
from kai_fractions.node.agent.markers import decide, still_valid
from kai_fractions.node.engine import ContainerState
from kai_fractions.node.mps import MpsError
from tests.agent.builders import Rig, binder_annotations, marker_of, pod
from tests.agent.builders import gate_outcome as _gate
from tests.agent.builders import result_of as _result

from .test_engine import NS_A, UID_A, Node, annotations, sm_pod


def _sm_pod(rig: Rig) -> tuple[str, str]:
    """An sm-sharing pod (portion 0.5), applied; its uid and MPS namespace."""
    notes = binder_annotations(devices=rig.gpu0, mode="sm-sharing")
    uid = rig.add(pod("sm", notes=notes))["metadata"]["uid"]
    assert rig.step().converged
    (name,) = rig.mps.control.namespaces
    assert _gate(rig, uid) is Outcome.RELEASE
    return uid, name


def _not_vouched_for(rig: Rig, uid: str) -> None:
    assert marker_of(rig, uid) is None
    assert (rig.marker_path(uid).parent / SET_ASIDE_FILE).exists()  # the plan it is held to
    assert _gate(rig, uid) is Outcome.WAIT


def _applied_again(rig: Rig, uid: str, name: str) -> None:
    assert rig.step().converged
    assert _result(rig, uid).state is ContainerState.APPLIED
    assert rig.mps.control.namespaces[name].active_thread_percentage == 50
    assert marker_of(rig, uid)["containers"]["main"]["state"] == "applied"
    assert _gate(rig, uid) is Outcome.RELEASE




def _restart_refusing_set_and_delete(control) -> None:
    """The daemon restarts (its namespaces gone), and once refuses both the made-again
    namespace's percentage and its delete, as a busy daemon does."""
    control.kill()
    control.inject("namespace_set_active_thread_percentage", MpsError("MpsDaemonBusy", "busy"))
    control.inject("namespace_delete", MpsError("MpsDaemonBusy", "busy"))

def _reconnect_on_create(control, pid: int = 4242) -> None:
    """The next namespace the daemon makes gets a client at once: the running process
    reconnects before the agent could set the namespace's percentage."""
    create = control.namespace_create

    def create_then_attach(ns: str, **kw) -> None:
        create(ns, **kw)
        control.attach_client(pid, ns)
        control.namespace_create = create  # once

    control.namespace_create = create_then_attach

def test_a_restarted_daemons_namespace_whose_cap_cannot_be_set_is_deleted_and_gates_wait(
        short_tmp: Path) -> None:
    rig = Rig(short_tmp)
    uid, name = _sm_pod(rig)
    control = rig.mps.control
    # a passing failure that says nothing of the cap in force: a running pod's marker stays
    written = rig.marker_path(uid).read_text()
    control.inject("namespace_list", MpsError("MpsDaemonBusy", "busy"))
    assert not rig.step().converged and _result(rig, uid).reason == "MpsDaemonBusy"
    assert rig.marker_path(uid).read_text() == written
    control.kill()  # the agent restarts it: every namespace is gone
    control.inject("namespace_set_active_thread_percentage", MpsError("MpsDaemonBusy", "busy"))
    report = rig.step()
    # its own reason (a busy daemon keeps a marker; this one is set aside), the cause in the
    # message, which does not claim the namespace is still there
    assert not report.converged and "NamespaceCapNotSet" in report.errors
    r = _result(rig, uid)
    assert (r.state, r.reason, r.mps_cap_missing) == (ContainerState.PENDING,
                                                      "NamespaceCapNotSet", True)
    assert "(MpsDaemonBusy: busy); it was deleted" in r.message
    assert "could not be deleted" not in r.message
    assert name not in control.namespaces  # nothing to attach to without the cap
    _not_vouched_for(rig, uid)
    _applied_again(rig, uid, name)


def test_a_namespace_whose_cap_cannot_be_set_nor_itself_deleted_is_not_vouched_for(
        short_tmp: Path) -> None:
    rig = Rig(short_tmp)
    uid, name = _sm_pod(rig)
    control = rig.mps.control
    _restart_refusing_set_and_delete(control)
    assert not rig.step().converged
    r = _result(rig, uid)
    assert (r.state, r.reason) == (ContainerState.PENDING, "NamespaceCapNotSet")
    assert r.message == (
        f"MPS namespace {name} was made but its active-thread percentage 50 could not be set "
        "(MpsDaemonBusy: busy), and it could not be deleted either (MpsDaemonBusy: busy): a "
        "client attaching to it would run without the cap for its lifetime. The container "
        "stays pending; the next pass sets the percentage before anything attaches, or deletes "
        "the namespace")
    assert control.namespaces[name].active_thread_percentage is None
    _not_vouched_for(rig, uid)
    _applied_again(rig, uid, name)  # set while nobody is attached, then verified


def test_a_client_back_before_the_recreated_namespace_got_its_cap_lets_no_gate_release(
        short_tmp: Path) -> None:
    rig = Rig(short_tmp)
    uid, name = _sm_pod(rig)
    control = rig.mps.control
    _reconnect_on_create(control)
    control.kill()
    for _ in range(2):  # the pod keeps running; no pass vouches for it meanwhile
        assert "NamespaceCapUnverified" in rig.step().errors
        assert _result(rig, uid).reason == "NamespaceCapUnverified"
        assert control.namespaces[name].active_thread_percentage is None
        _not_vouched_for(rig, uid)
    control.detach_client(4242)
    _applied_again(rig, uid, name)


def test_a_namespace_made_again_whose_cap_cannot_be_set_is_deleted(tmp_path: Path) -> None:
    """Made again to take a new percentage (its clients came and went, fixing the old one): a
    failed set leaves it with none, so it goes at once and the next pass makes it again."""
    node = Node(tmp_path / "cgroup")
    node.apply(sm_pod())
    node.mps.attach_client(77, NS_A)
    node.mps.detach_client(77)
    half = sm_pod(notes=annotations(mode="sm-sharing", portion="0.5"))
    create = node.mps.namespace_create

    def create_then_busy(name: str, **kw) -> None:
        create(name, **kw)
        node.mps.inject("namespace_set_active_thread_percentage",
                        MpsError("MpsDaemonBusy", "busy"))
        node.mps.namespace_create = create  # type: ignore[method-assign]

    node.mps.namespace_create = create_then_busy  # type: ignore[method-assign]
    report = node.apply(half)
    r = report.containers[(UID_A, "main")]
    assert NS_A not in node.mps.namespaces
    assert (r.state, r.reason, r.mps_cap_missing) == (ContainerState.PENDING,
                                                      "NamespaceCapNotSet", True)
    assert "(MpsDaemonBusy: busy); it was deleted" in r.message
    assert (report.namespaces_deleted, report.namespaces_created) == ((NS_A, NS_A), (NS_A,))
    assert node.apply(half).containers[(UID_A, "main")].state is ContainerState.APPLIED
    assert node.mps.namespaces[NS_A].active_thread_percentage == 50


def test_a_marker_does_not_hold_while_a_namespace_lacks_its_cap(tmp_path: Path) -> None:
    node = Node(tmp_path / "cgroup")
    applied = node.apply(sm_pod()).containers[(UID_A, "main")]
    entries = decide({"main": applied}).write
    assert entries is not None
    marker = Marker.build(UID_A, entries, boot_id="b")
    busy = dataclasses.replace(applied, state=ContainerState.PENDING, reason="MpsDaemonBusy")
    assert still_valid(marker, {"main": busy}) and decide({"main": busy}).keep_existing
    uncapped = dataclasses.replace(busy, mps_cap_missing=True)
    assert not still_valid(marker, {"main": uncapped})
    assert not decide({"main": uncapped}).keep_existing


def test_a_namespace_a_list_answer_left_out_is_read_back_not_taken_for_a_fresh_one(
        short_tmp: Path) -> None:
    """The create that follows says it exists: it holds the plan's percentage, and its client
    attached under it, so the running pod stays applied and its marker stays."""
    rig = Rig(short_tmp)
    uid, name = _sm_pod(rig)
    control = rig.mps.control
    control.attach_client(4242, name)  # a long-running client
    written = rig.marker_path(uid).read_text()
    listed = control.namespace_list

    def without_it(timeout=None) -> list[str]:  # once
        control.namespace_list = listed  # type: ignore[method-assign]
        return [n for n in listed(timeout) if n != name]

    control.namespace_list = without_it  # type: ignore[method-assign]
    n = len(control.calls)
    assert rig.step().converged
    assert _result(rig, uid).state is ContainerState.APPLIED
    assert not _result(rig, uid).mps_cap_missing
    calls = control.methods_called()[n:]
    assert "namespace_create" in calls
    assert "namespace_set_active_thread_percentage" not in calls
    assert control.namespaces[name].clients == {4242}
    assert rig.marker_path(uid).read_text() == written
    assert not (rig.marker_path(uid).parent / SET_ASIDE_FILE).exists()
    assert _gate(rig, uid) is Outcome.RELEASE


def test_a_namespace_left_without_its_cap_before_an_agent_restart_goes_when_its_set_fails(
        short_tmp: Path) -> None:
    """A restarted agent does not know it made the namespace (`Engine._fresh` is memory): its
    read back shows no percentage, nobody is attached, and the set fails again (a busy daemon).
    It is deleted as a fresh one is, and made again by the next pass."""
    rig = Rig(short_tmp)
    uid, name = _sm_pod(rig)
    control = rig.mps.control
    _restart_refusing_set_and_delete(control)
    rig.step()
    assert _result(rig, uid).reason == "NamespaceCapNotSet"
    assert control.namespaces[name].active_thread_percentage is None
    new = rig.restarted()
    control.inject("namespace_set_active_thread_percentage", MpsError("MpsDaemonBusy", "busy"))
    assert not new.step().converged
    r = _result(new, uid)
    assert (r.state, r.reason, r.mps_cap_missing) == (ContainerState.PENDING,
                                                      "NamespaceCapNotSet", True)
    assert "(MpsDaemonBusy: busy); it was deleted" in r.message
    assert name not in control.namespaces  # nothing to attach to uncapped
    _not_vouched_for(new, uid)
    _applied_again(new, uid, name)


def test_a_namespace_read_back_without_its_cap_goes_only_when_nobody_is_attached(
        tmp_path: Path) -> None:
    """Its set failing, the namespace is deleted only when a client list read after the set
    shows nobody attached: a client that attached fixed what it holds (the next pass reads it
    back), and one that cannot be listed is left as it is."""
    node = Node(tmp_path / "cgroup")
    node.apply(sm_pod())
    busy = MpsError("MpsDaemonBusy", "busy")
    set_pct = node.mps.namespace_set_active_thread_percentage

    def failing_set(before: Callable[[], None]) -> None:
        def once(name: str, pct: int) -> None:
            node.mps.namespace_set_active_thread_percentage = set_pct  # type: ignore[method-assign]
            before()
            raise busy
        node.mps.namespace_set_active_thread_percentage = once  # type: ignore[method-assign]

    def without_cap() -> None:  # as an agent before a restart left it
        node.mps.namespaces[NS_A].active_thread_percentage = None
        node.engine = node.new_engine()

    def apply(reason: str) -> str:
        r = node.apply(sm_pod()).containers[(UID_A, "main")]
        assert (r.state, r.reason, r.mps_cap_missing) == (ContainerState.PENDING, reason, True)
        assert r.message is not None and "MpsDaemonBusy: busy" in r.message
        return r.message

    without_cap()
    failing_set(lambda: node.mps.inject("client_list", busy))
    assert apply("NamespaceCapNotSet").startswith(
        f"MPS namespace {NS_A} does not hold the plan's active-thread percentage 25, and it "
        "could not be given it (MpsDaemonBusy: busy)")
    assert node.mps.namespaces[NS_A].active_thread_percentage is None
    failing_set(lambda: node.mps.attach_client(4242, NS_A))
    # attached with no percentage: that client runs uncapped
    assert "clients (pids 4242) attached to it meanwhile" in apply("NamespaceCapUnverified")
    assert node.mps.namespaces[NS_A].clients == {4242}
    node.mps.detach_client(4242)
    failing_set(lambda: None)
    assert "it was deleted" in apply("NamespaceCapNotSet")
    assert NS_A not in node.mps.namespaces
    assert node.apply(sm_pod()).containers[(UID_A, "main")].state is ContainerState.APPLIED
    assert node.mps.namespaces[NS_A].active_thread_percentage == 25


def test_a_client_attached_before_the_delete_of_a_namespace_without_its_cap_is_unverified(
        short_tmp: Path) -> None:
    """The percentage set fails, and a client attaches before the delete meant to keep it out,
    which the daemon then refuses (NamespaceBusy): that client runs uncapped. It is reported as
    a client that attached before the cap (NamespaceCapUnverified), never as a namespace nobody
    is attached to (NamespaceCapNotSet)."""
    rig = Rig(short_tmp)
    uid, name = _sm_pod(rig)
    control = rig.mps.control
    _reconnect_on_create(control)
    control.kill()
    control.inject("namespace_set_active_thread_percentage", MpsError("MpsDaemonBusy", "busy"))
    assert not rig.step().converged
    r = _result(rig, uid)
    assert (r.state, r.reason, r.mps_cap_missing) == (ContainerState.PENDING,
                                                      "NamespaceCapUnverified", True)
    assert r.message is not None
    assert r.message.startswith(
        f"MPS namespace {name} does not hold the plan's active-thread percentage 50, which "
        "could not be set (MpsDaemonBusy: busy), and clients attached to it before it could be "
        "deleted (NamespaceBusy: ")
    assert "restart the container's GPU processes, or recreate the pod" in r.message
    assert control.namespaces[name].clients == {4242}
    _not_vouched_for(rig, uid)
    control.detach_client(4242)
    _applied_again(rig, uid, name)


BUSY = MpsError("MpsDaemonBusy", "busy")
CAP_NOT_IN_FORCE_REASONS = {"NamespaceCapUnverified", "NamespaceCapNotSet", "MpsPinnedLimitLost"}
"""kai_fractions.node.engine.CAP_NOT_IN_FORCE_REASONS, as GetNodeState's readers see them."""
CAP_FAULTS = {  # what fails after the daemon restarted -> (the reason, a part of the message)
    "namespace create": ({"namespace_create": 1}, "NamespaceCapNotSet",
                         "is not there (a new container's, or one a restarted MPS daemon lost) "
                         "and could not be made with its active-thread percentage 50 "
                         "(MpsDaemonBusy: busy)"),
    "percentage set": ({"namespace_set_active_thread_percentage": 1}, "NamespaceCapNotSet",
                       "could not be set (MpsDaemonBusy: busy); it was deleted"),
    "percentage set and delete": (
        {"namespace_set_active_thread_percentage": 1, "namespace_delete": 1},
        "NamespaceCapNotSet", "and it could not be deleted either (MpsDaemonBusy: busy)"),
    "pinned limit set": ({"set_default_pinned_mem_limit": 1}, "MpsPinnedLimitLost",
                         "is not the plan's 20480 MiB (20G): it reads back no limit"),
}


@pytest.mark.parametrize("fault", CAP_FAULTS.values(), ids=CAP_FAULTS.keys())
def test_a_set_aside_marker_is_reported_under_a_reason_of_its_own(
        short_tmp: Path, fault: tuple[dict[str, int], str, str]) -> None:
    """Whatever failed, a container whose marker is set aside because an MPS cap is not in
    force is pending under one of CAP_NOT_IN_FORCE_REASONS, with the daemon's error in the
    message: GetNodeState's reason (the proto has no other field) tells it from a container
    pending for a busy daemon, whose marker stays."""
    failing, reason, said = fault
    rig = Rig(short_tmp)
    uid, name = _sm_pod(rig)
    control = rig.mps.control
    control.inject("namespace_list", BUSY)  # a busy daemon: nothing known missing
    assert not rig.step().converged
    r = _result(rig, uid)
    assert (r.reason, r.mps_cap_missing) == ("MpsDaemonBusy", False)
    assert r.reason not in CAP_NOT_IN_FORCE_REASONS
    assert engine.CAP_NOT_IN_FORCE_REASONS == CAP_NOT_IN_FORCE_REASONS
    control.kill()
    for method, times in failing.items():
        control.inject(method, BUSY, times=times)
    report = rig.step()
    r = _result(rig, uid)
    assert (r.state, r.reason, r.mps_cap_missing) == (ContainerState.PENDING, reason, True)
    assert reason in report.errors and "MpsDaemonBusy" not in report.errors
    assert r.message is not None and said in r.message, r.message
    _not_vouched_for(rig, uid)
    _applied_again(rig, uid, name)


def test_a_namespace_whose_verification_cannot_be_read_is_unverified(tmp_path: Path) -> None:
    """Made again and given its percentage, but the client list that would show nobody
    attached before the set fails: NamespaceCapUnverified, the list's error in the message."""
    node = Node(tmp_path / "cgroup")
    assert node.apply(sm_pod()).converged
    node.mps.kill()
    node.mps.start()
    node.mps.inject("client_list", BUSY)
    r = node.apply(sm_pod()).containers[(UID_A, "main")]
    assert (r.state, r.reason, r.mps_cap_missing) == (ContainerState.PENDING,
                                                      "NamespaceCapUnverified", True)
    assert r.message is not None and r.message.startswith(
        f"MPS namespace {NS_A} was made (again, e.g. after an MPS daemon restart) and whether a "
        "client attached to it before its active-thread percentage 25 was set could not be "
        "checked (MpsDaemonBusy: busy)")
    assert node.apply(sm_pod()).containers[(UID_A, "main")].state is ContainerState.APPLIED


def test_a_namespace_without_its_cap_that_clients_keep_from_its_remake_is_unverified(
        tmp_path: Path) -> None:
    """Read back without the plan's percentage, nobody listed: the daemon refuses the set and
    then the delete that would make it again, both for clients attached (NamespaceBusy). Those
    clients run without the plan's cap: NamespaceCapUnverified, not NamespaceCapNotSet."""
    node = Node(tmp_path / "cgroup")
    assert node.apply(sm_pod()).converged
    node.mps.namespaces[NS_A].active_thread_percentage = None  # as an agent before left it
    node.engine = node.new_engine()
    attached = MpsError("NamespaceBusy", "clients are attached")
    node.mps.inject("namespace_set_active_thread_percentage", attached)
    node.mps.inject("namespace_delete", attached)
    r = node.apply(sm_pod()).containers[(UID_A, "main")]
    assert (r.state, r.reason, r.mps_cap_missing) == (ContainerState.PENDING,
                                                      "NamespaceCapUnverified", True)
    assert r.message is not None and r.message.startswith(
        f"MPS namespace {NS_A} does not hold the plan's active-thread percentage 25, which could "
        "not be set (NamespaceBusy: clients are attached), and clients attached to it meanwhile")
