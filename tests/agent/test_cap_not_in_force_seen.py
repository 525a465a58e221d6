"""What an operator sees of a container whose MPS cap is known not in force (its readiness marker
set aside, `ContainerResult.mps_cap_missing`): one Warning event `MpsCapNotInForce` per episode,
naming the container, the reason and its cause, then `Applied` again once the cap is back; a log
line that says why the marker was set aside (the plan did not change)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from kai_fractions.node.mps import MpsError
from tests.agent.builders import Rig, binder_annotations, pod
from tests.agent.builders import result_of as _result

BUSY = MpsError("MpsDaemonBusy", "busy")


def _sm_pod(rig: Rig) -> str:
    uid = rig.add(pod("sm", notes=binder_annotations(devices=rig.gpu0, mode="sm-sharing"))
                  )["metadata"]["uid"]
    assert rig.step().converged
    return uid


def _events(rig: Rig, since: int = 0) -> list[tuple[str, str, str]]:
    return [(e["type"], e["reason"], e["message"]) for e in rig.cluster.events[since:]]


def _reasons(rig: Rig, since: int = 0) -> list[str]:
    return [reason for _type, reason, _message in _events(rig, since)]


def test_one_warning_per_episode_and_applied_again_when_the_cap_is_back(short_tmp: Path
                                                                         ) -> None:
    rig = Rig(short_tmp)
    uid = _sm_pod(rig)
    assert _reasons(rig) == ["Applied"]
    control = rig.mps.control
    (name,) = control.namespaces
    control.kill()
    control.inject("namespace_set_active_thread_percentage", BUSY, times=3)
    control.inject("namespace_delete", BUSY, times=3)
    for _ in range(3):  # one episode, three passes: one event
        assert not rig.step().converged
        assert _result(rig, uid).reason == "NamespaceCapNotSet"
    ((kind, reason, message),) = _events(rig, 1)
    assert (kind, reason) == ("Warning", "MpsCapNotInForce")
    assert message.startswith(
        "container main: an MPS cap it relies on is not in force, so its readiness marker is "
        "set aside (a gate of the pod waits; Applied follows once the cap is back): "
        f"NamespaceCapNotSet: MPS namespace {name} was made but its active-thread percentage "
        "50 could not be set (MpsDaemonBusy: busy), and it could not be deleted either")
    assert message.endswith("the next pass sets the percentage before anything attaches, or "
                            "deletes the namespace")
    assert len(message) <= 1024  # an event's message is cut there
    assert rig.step().converged
    # the recovery is told too: Applied again, although its plan digest is the same
    assert _reasons(rig) == ["Applied", "MpsCapNotInForce", "Applied"]
    assert rig.step().converged
    assert _reasons(rig) == ["Applied", "MpsCapNotInForce", "Applied"]
    # a second episode is a second event
    control.kill()
    control.inject("set_default_pinned_mem_limit", BUSY)
    assert not rig.step().converged
    assert _result(rig, uid).reason == "MpsPinnedLimitLost"
    assert rig.step().converged
    assert _reasons(rig) == ["Applied", "MpsCapNotInForce", "Applied", "MpsCapNotInForce",
                             "Applied"]
    assert "MpsPinnedLimitLost: the MPS daemon's default pinned device memory limit of GPU 0" \
        in _events(rig)[3][2]


def test_an_episode_is_one_event_whatever_it_is_pending_for_in_between(short_tmp: Path
                                                                       ) -> None:
    """The reason changes, a pass is pending for something that keeps a marker (a GPU memory
    limit that cannot be read): still one episode, until the container is applied again."""
    rig = Rig(short_tmp)
    uid = _sm_pod(rig)
    control = rig.mps.control
    (name,) = control.namespaces
    create = control.namespace_create

    def create_then_attach(ns: str, **kw: Any) -> None:  # once: the running process reconnects
        create(ns, **kw)
        control.attach_client(4242, ns)
        control.namespace_create = create  # type: ignore[method-assign]

    control.kill()
    control.inject("namespace_set_active_thread_percentage", BUSY)
    assert not rig.step().converged
    assert _result(rig, uid).reason == "NamespaceCapNotSet"  # deleted
    control.inject("namespace_list", BUSY)
    assert not rig.step().converged
    r = _result(rig, uid)
    assert (r.reason, r.mps_cap_missing) == ("NamespaceCapNotSet", True)  # still not made
    control.namespace_create = create_then_attach  # type: ignore[method-assign]
    assert not rig.step().converged
    assert _result(rig, uid).reason == "NamespaceCapUnverified"
    assert not rig.step().converged
    assert _reasons(rig, 1) == ["MpsCapNotInForce"]
    control.detach_client(4242)
    rig.reconciler.engine.forget()  # the limits are read again, and the read fails
    rig.nvml.fail("get_memory_limits", "Unknown")
    assert not rig.step().converged
    r = _result(rig, uid)
    assert (r.reason, r.mps_cap_missing) == ("NVMLError", False)
    assert control.namespaces[name].active_thread_percentage == 50
    assert _reasons(rig, 1) == ["MpsCapNotInForce"]
    assert rig.step().converged
    assert _reasons(rig, 1) == ["MpsCapNotInForce", "Applied"]


def test_the_log_says_the_marker_is_set_aside_for_a_cap_not_for_another_plan(
        short_tmp: Path, caplog: pytest.LogCaptureFixture) -> None:
    rig = Rig(short_tmp)
    _sm_pod(rig)
    control = rig.mps.control
    control.kill()
    control.inject("set_default_pinned_mem_limit", BUSY)
    with caplog.at_level(logging.INFO, logger="kai_fractions.node.agent.markers"):
        assert not rig.step().converged
    lines = [(r.levelno, r.getMessage()) for r in caplog.records
             if r.name == "kai_fractions.node.agent.markers"]
    assert lines == [(logging.WARNING, (
        "pod default/sm: set aside its marker: an MPS cap is not in force for container main "
        "(MpsPinnedLimitLost) (the plan is unchanged; the marker is written again once the cap "
        "is back)"))]


CAP_METRIC = "kai_fractions_container_cap_not_in_force"


def _caps(rig: Rig) -> list[dict[str, str]]:
    """The labels of every kai_fractions_container_cap_not_in_force sample (each reads 1)."""
    out = []
    for family in rig.agent.metrics.registry.collect():
        for s in family.samples:
            if s.name == CAP_METRIC:
                assert s.value == 1, s
                out.append(dict(s.labels))
    return out


def _cap(uid: str, reason: str) -> dict[str, str]:
    return {"node": "node-a", "namespace": "default", "pod": "sm", "pod_uuid": uid,
            "container": "main", "reason": reason}


def test_a_series_per_container_while_its_cap_is_not_in_force(short_tmp: Path) -> None:
    rig = Rig(short_tmp)
    uid = _sm_pod(rig)
    control = rig.mps.control
    create = control.namespace_create
    assert _caps(rig) == []
    control.inject("namespace_list", BUSY)  # a busy daemon says nothing of the caps: none
    assert not rig.step().converged
    assert _caps(rig) == []
    control.kill()
    control.inject("namespace_set_active_thread_percentage", BUSY)
    control.inject("namespace_delete", BUSY)
    assert not rig.step().converged
    assert _caps(rig) == [_cap(uid, "NamespaceCapNotSet")]
    rig.reconciler.check_usage()  # a watchdog check sets the other series; this one stays
    assert _caps(rig) == [_cap(uid, "NamespaceCapNotSet")]

    def create_then_attach(ns: str, **kw: Any) -> None:  # once: the process reconnects
        create(ns, **kw)
        control.attach_client(4242, ns)
        control.namespace_create = create  # type: ignore[method-assign]

    control.kill()
    control.namespace_create = create_then_attach  # type: ignore[method-assign]
    assert not rig.step().converged
    assert _caps(rig) == [_cap(uid, "NamespaceCapUnverified")]  # the reason it has now only
    control.detach_client(4242)
    assert rig.step().converged
    assert _caps(rig) == []  # in force again: the series goes


def test_the_series_goes_with_its_pod(short_tmp: Path) -> None:
    rig = Rig(short_tmp)
    uid = _sm_pod(rig)
    kept = rig.add(pod("kept", notes=binder_annotations(devices=rig.gpu1, mode="sm-sharing"))
                   )["metadata"]["uid"]
    assert rig.step().converged
    rig.mps.control.kill()
    rig.mps.control.inject("set_default_pinned_mem_limit", BUSY, times=100)
    assert not rig.step().converged
    assert sorted(_caps(rig), key=lambda c: c["pod"]) == [
        {**_cap(kept, "MpsPinnedLimitLost"), "pod": "kept"}, _cap(uid, "MpsPinnedLimitLost")]
    rig.cluster.delete_pod(uid)
    assert not rig.step().converged
    assert _caps(rig) == [{**_cap(kept, "MpsPinnedLimitLost"), "pod": "kept"}]
    # NVML down: no pass plans, yet a pod deleted meanwhile leaves no series
    rig.nvml.fail("init", "DriverNotLoaded", times=None)
    rig.nvml.fail("driver_version", "DriverNotLoaded", times=None)
    rig.step()
    assert _caps(rig) == [{**_cap(kept, "MpsPinnedLimitLost"), "pod": "kept"}]
    rig.cluster.delete_pod(kept)
    rig.step()
    assert _caps(rig) == []


CAP_LOST = {  # how the restarted daemon's namespace ends up without its cap
    "deleted": "namespace_set_active_thread_percentage",  # made, its set failed: deleted
    "not-made": "namespace_create",
}
EARLIER = {  # a later pass that fails before it reaches the namespace -> what the message names
    "namespace-list-busy": "MpsDaemonBusy: list busy",
    "daemon-down": "MpsDaemonUnreachable: ",
}


@pytest.mark.parametrize("earlier", sorted(EARLIER))
@pytest.mark.parametrize("lost", sorted(CAP_LOST))
def test_a_cap_known_missing_stays_so_while_a_later_pass_fails_earlier(
        short_tmp: Path, lost: str, earlier: str) -> None:
    """A namespace deleted because its percentage could not be set, or not made: a later pass
    that fails before it reaches the namespace learns nothing new, and the cap is still not in
    force. The container keeps its cap reason (the new failure in the message) and its series,
    so the alert's 2 minutes do not start over and `inspect --agent-metrics` does not read it as
    enforced while its marker is set aside."""
    rig = Rig(short_tmp)
    uid = _sm_pod(rig)
    control = rig.mps.control
    (name,) = control.namespaces
    control.kill()
    control.inject(CAP_LOST[lost], BUSY)
    assert not rig.step().converged
    assert _caps(rig) == [_cap(uid, "NamespaceCapNotSet")]
    if earlier == "namespace-list-busy":
        control.inject("namespace_list", MpsError("MpsDaemonBusy", "list busy"))
    else:
        control.kill()
        rig.mps.can_start = False
    assert not rig.step().converged
    r = _result(rig, uid)
    assert (r.reason, r.mps_cap_missing) == ("NamespaceCapNotSet", True)
    if earlier == "daemon-down":  # not running: the namespace went with it, whatever it held
        assert r.message.startswith(
            f"the MPS control daemon is not running ({EARLIER[earlier]}")
        assert f"MPS namespace {name} and its active-thread percentage 50" in r.message
    else:
        assert r.message.startswith(
            f"MPS namespace {name} does not hold the plan's active-thread percentage 50, and "
            f"it could not be given it ({EARLIER[earlier]}")
    assert _caps(rig) == [_cap(uid, "NamespaceCapNotSet")]
    assert not rig.marker_path(uid).exists()
    rig.mps.can_start = True
    assert rig.step().converged
    assert _caps(rig) == []
    assert _reasons(rig, 1) == ["MpsCapNotInForce", "Applied"]


@pytest.mark.parametrize("step", ["namespace_create", "client_list"])
def test_a_new_pod_without_a_marker_gets_no_warning_of_one_set_aside(
        short_tmp: Path, step: str) -> None:
    """A pod that never had a marker (its gate waits anyway) whose first namespace create, or
    the client list that verifies it, is busy: its cap is not in force (the series says so),
    but no marker was set aside, so no Warning says one was. A pod with a marker of this boot,
    even one set aside already, gets it."""
    rig = Rig(short_tmp)
    rig.mps.control.inject(step, BUSY)
    uid = rig.add(pod("sm", notes=binder_annotations(devices=rig.gpu0, mode="sm-sharing"))
                  )["metadata"]["uid"]
    assert not rig.step().converged
    assert _result(rig, uid).mps_cap_missing
    assert len(_caps(rig)) == 1
    assert _reasons(rig) == []
    assert rig.step().converged
    assert _reasons(rig) == ["Applied"]
    assert rig.reconciler.markers.set_aside(uid)  # as a pass that could not keep it does
    control = rig.mps.control
    control.kill()
    control.inject("namespace_set_active_thread_percentage", BUSY)
    assert not rig.step().converged
    assert _reasons(rig) == ["Applied", "MpsCapNotInForce"]


def test_a_warning_the_api_refused_is_not_sent_after_the_episode_ended(short_tmp: Path
                                                                       ) -> None:
    """The Warning waits in the backlog (the API refused it), and the cap is back next pass:
    its Applied is the last word, not a late Warning of an episode that is over."""
    rig = Rig(short_tmp)
    uid = _sm_pod(rig)
    control = rig.mps.control
    control.kill()
    control.inject("namespace_set_active_thread_percentage", BUSY)
    rig.cluster.fail("create_event", times=2)  # the Warning, and its retry in the pass's flush
    assert not rig.step().converged
    assert _reasons(rig, 1) == []
    for _ in range(2):
        rig.step()
        assert _result(rig, uid).state.value == "applied"
        assert _reasons(rig, 1) == ["Applied"]


def test_an_applied_the_api_refused_is_not_sent_after_the_warning(short_tmp: Path) -> None:
    """The Applied of a new pod waits in the backlog, and the next pass finds its cap not in
    force: the Warning is the last word until the cap is back, then Applied."""
    rig = Rig(short_tmp)
    rig.cluster.fail("create_event", times=2)  # the Applied, and its retry in the pass's flush
    uid = _sm_pod(rig)
    assert _reasons(rig) == []
    control = rig.mps.control
    control.kill()
    control.inject("namespace_set_active_thread_percentage", BUSY)
    assert not rig.step().converged
    assert _reasons(rig) == ["MpsCapNotInForce"]
    assert rig.step().converged
    assert _result(rig, uid).state.value == "applied"
    assert _reasons(rig) == ["MpsCapNotInForce", "Applied"]
