"""An sm-sharing container whose MPS namespace is without its active-thread percentage (the daemon
restarted, and the namespace made again could not be given its percentage, or a client attached
before it was) is never vouched for: the namespace is deleted when nobody is attached yet, and
the pod's readiness marker is set aside until the percentage is in force again, so no gate (a
restarted sandbox's) lets a client attach to it uncapped."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from kai_fractions.contract import DEFAULT_KEYS
from kai_fractions.gate.check import Outcome, judge
from kai_fractions.marker import SET_ASIDE_FILE, Marker, read_marker
from kai_fractions.node.agent.markers import decide, still_valid
from kai_fractions.node.engine import ContainerState
from kai_fractions.node.mps import MpsError
from tests.agent.builders import Rig, binder_annotations, marker_of, pod

from .test_engine import NS_A, UID_A, Node, annotations, sm_pod


def _sm_pod(rig: Rig) -> tuple[str, str]:
    """An sm-sharing pod (portion 0.5), applied; its uid and MPS namespace."""
    notes = binder_annotations(devices=rig.gpu0, mode="sm-sharing")
    uid = rig.add(pod("sm", notes=notes))["metadata"]["uid"]
    assert rig.step().converged
    (name,) = rig.mps.control.namespaces
    assert _gate(rig, uid) is Outcome.RELEASE
    return uid, name


def _gate(rig: Rig, uid: str) -> Outcome:
    """What the gate of a (restarted) sandbox of the pod would do now."""
    marker = read_marker(rig.marker_path(uid).parent, expected_pod_uid=uid)
    return judge(rig.cluster.pods[uid]["metadata"]["annotations"], marker, pod_uid=uid,
                 keys=DEFAULT_KEYS, boot_id=rig.reconciler.markers.boot_id,
                 containers=["main"]).outcome


def _result(rig: Rig, uid: str):
    return rig.reconciler.view.results[(uid, "main")]


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
    assert not report.converged and "MpsDaemonBusy" in report.errors
    assert (_result(rig, uid).state, _result(rig, uid).reason) == (ContainerState.PENDING,
                                                                   "MpsDaemonBusy")
    assert name not in control.namespaces  # nothing to attach to without the cap
    _not_vouched_for(rig, uid)
    _applied_again(rig, uid, name)


def test_a_namespace_whose_cap_cannot_be_set_nor_itself_deleted_is_not_vouched_for(
        short_tmp: Path) -> None:
    rig = Rig(short_tmp)
    uid, name = _sm_pod(rig)
    control = rig.mps.control
    control.kill()
    control.inject("namespace_set_active_thread_percentage", MpsError("MpsDaemonBusy", "busy"))
    control.inject("namespace_delete", MpsError("MpsDaemonBusy", "busy"))
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
    create = control.namespace_create

    def create_then_attach(ns: str, **kw) -> None:  # once: the running process reconnects
        create(ns, **kw)
        control.attach_client(4242, ns)
        control.namespace_create = create  # type: ignore[method-assign]

    control.namespace_create = create_then_attach  # type: ignore[method-assign]
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
                                                      "MpsDaemonBusy", True)
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
    control.kill()
    control.inject("namespace_set_active_thread_percentage", MpsError("MpsDaemonBusy", "busy"))
    control.inject("namespace_delete", MpsError("MpsDaemonBusy", "busy"))
    rig.step()
    assert _result(rig, uid).reason == "NamespaceCapNotSet"
    assert control.namespaces[name].active_thread_percentage is None
    new = rig.restarted()
    control.inject("namespace_set_active_thread_percentage", MpsError("MpsDaemonBusy", "busy"))
    assert not new.step().converged
    r = _result(new, uid)
    assert (r.state, r.reason, r.mps_cap_missing) == (ContainerState.PENDING, "MpsDaemonBusy",
                                                      True)
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

    def apply() -> None:
        r = node.apply(sm_pod()).containers[(UID_A, "main")]
        assert (r.state, r.reason, r.mps_cap_missing) == (ContainerState.PENDING,
                                                          "MpsDaemonBusy", True)

    without_cap()
    failing_set(lambda: node.mps.inject("client_list", busy))
    apply()
    assert node.mps.namespaces[NS_A].active_thread_percentage is None
    failing_set(lambda: node.mps.attach_client(4242, NS_A))
    apply()
    assert node.mps.namespaces[NS_A].clients == {4242}
    node.mps.detach_client(4242)
    failing_set(lambda: None)
    apply()
    assert NS_A not in node.mps.namespaces
    assert node.apply(sm_pod()).containers[(UID_A, "main")].state is ContainerState.APPLIED
    assert node.mps.namespaces[NS_A].active_thread_percentage == 25
