"""The MPS control daemon gone, not merely slow: its namespaces, their active-thread percentages
and its default pinned limits die with it, so no readiness marker may go on vouching for them.

(a) A daemon that died and cannot be started again (its start fails, the supervisor backs off,
its binary is gone) sets aside the marker of every pod whose caps rely on it, under a reason of
CAP_NOT_IN_FORCE_REASONS whose message says the daemon is not running: a restarted sandbox's
gate waits, one Warning per episode, a series of the cap metric; once the daemon runs again
and the caps are back, the marker is written again (Applied). A daemon that still runs but does
not answer may still hold them all: its markers stay.

(b) A graceful stop of the agent (a rollout, `helm upgrade`) stops the daemon it started: the
markers that rely on it are set aside first, and the next agent writes them again once it has
applied everything on its own daemon. A daemon the agent adopted is left running, and its
markers stay.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kai_fractions.contract import DEFAULT_KEYS
from kai_fractions.gate.check import Outcome, judge
from kai_fractions.marker import SET_ASIDE_FILE, read_marker
from kai_fractions.node.engine import ContainerState
from kai_fractions.node.mps_caps import CAP_NOT_IN_FORCE_REASONS
from kai_fractions.sim.nvml import FakeNvml
from tests.agent.builders import NODE, Rig, binder_annotations, marker_of, pod, wait_for
from tests.agent.builders import result_of as _result

CAP_METRIC = "kai_fractions_container_cap_not_in_force"
NOT_RUNNING = "the MPS control daemon is not running (MpsDaemonUnreachable: "

SETUPS: dict[str, Any] = {
    # a namespace and the pinned limit (the defaults, a driver with namespaces)
    "v3-every-tier": (dict, "NamespaceCapNotSet",
                      ["MPS namespace {ns} and its active-thread percentage 50",
                       "the default pinned device memory limit of GPU 0"]),
    # a namespace, no mps-pinned tier
    "v3-cgroup": (lambda: dict(memory_enforcement="cgroup,watchdog"), "NamespaceCapNotSet",
                  ["MPS namespace {ns} and its active-thread percentage 50"]),
    # no namespaces: the MPS server the client env names; the pinned limit is set there but
    # no tier (the kill watchdog caps it), so it is not what the reason or message names
    "535-driver": (lambda: dict(nvml=FakeNvml.simulated(2, model="H100-80GB", seed=NODE,
                                                         driver_version="535.104.05"),
                                mps_v3=False, watchdog_policy="kill"), "NamespaceCapNotSet",
                   ["the MPS server its clients reach"]),
    # no namespaces, no mps-pinned tier: the MPS server alone enforces its share of the SMs
    "client-env": (lambda: dict(mps_v3=False, memory_enforcement="cgroup,watchdog"),
                   "NamespaceCapNotSet", ["the MPS server its clients reach"]),
}


def _sm_pod(rig: Rig, name: str = "sm") -> str:
    return rig.add(pod(name, notes=binder_annotations(devices=rig.gpu0, mode="sm-sharing"))
                   )["metadata"]["uid"]


def _ts_pod(rig: Rig) -> str:
    return rig.add(pod("ts", notes=binder_annotations(devices=rig.gpu1, mode="time-slicing"))
                   )["metadata"]["uid"]


def _gate(rig: Rig, uid: str) -> Outcome:
    """What the gate of a (restarted) sandbox of the pod would do now."""
    directory = rig.marker_path(uid).parent
    marker = read_marker(directory, expected_pod_uid=uid)
    aside = read_marker(directory, expected_pod_uid=uid, name=SET_ASIDE_FILE)
    return judge(rig.cluster.pods[uid]["metadata"]["annotations"], marker, pod_uid=uid,
                 keys=DEFAULT_KEYS, boot_id=rig.reconciler.markers.boot_id,
                 containers=["main"], set_aside=aside).outcome


def _set_aside(rig: Rig, uid: str) -> bool:
    return (not rig.marker_path(uid).exists()
            and (rig.marker_path(uid).parent / SET_ASIDE_FILE).exists())


def _events(rig: Rig, uid: str) -> list[tuple[str, str, str]]:
    return [(e["type"], e["reason"], e["message"]) for e in rig.cluster.events
            if e["involvedObject"]["uid"] == uid]


def _reasons(rig: Rig, uid: str) -> list[str]:
    return [reason for _type, reason, _message in _events(rig, uid)]


def _caps(rig: Rig) -> list[tuple[str, str]]:
    """(pod, reason) of every kai_fractions_container_cap_not_in_force series."""
    return sorted((s.labels["pod"], s.labels["reason"])
                  for family in rig.agent.metrics.registry.collect()
                  for s in family.samples if s.name == CAP_METRIC and s.value == 1)


# -- (a) the daemon dies and does not come back ---------------------------------------------


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_a_dead_daemon_that_cannot_start_again_sets_the_markers_aside_until_it_is_back(
        short_tmp: Path, setup: str) -> None:
    config, reason, gone = SETUPS[setup]
    rig = Rig(short_tmp, **config())
    uid, ts = _sm_pod(rig), _ts_pod(rig)
    assert rig.step().converged
    namespaces = set(rig.mps.control.namespaces)
    ns = next(iter(namespaces), None)
    assert _gate(rig, uid) is Outcome.RELEASE
    ts_marker, ts_gate = rig.marker_path(ts).read_text(), _gate(rig, ts)  # (refused on 535)

    rig.mps.control.kill()  # the daemon is gone, its namespaces and settings with it ...
    rig.mps.can_start = False  # ... and every start fails (backing off, binary gone)
    for _ in range(3):  # one episode, three passes
        report = rig.step()
        assert not report.converged and "MpsDaemonUnreachable" in report.errors
        r = _result(rig, uid)
        assert (r.state, r.reason, r.not_in_force) == (ContainerState.PENDING, reason, True)
        assert reason in CAP_NOT_IN_FORCE_REASONS
        assert r.message.startswith(NOT_RUNNING)
        for what in gone:
            assert what.format(ns=ns) in r.message
        assert _set_aside(rig, uid)  # still holds the pod to its plan, vouches for nothing
        assert _gate(rig, uid) is Outcome.WAIT
        assert _caps(rig) == [("sm", reason)]
    ((kind, event, message),) = _events(rig, uid)[1:]
    assert (kind, event) == ("Warning", "MpsCapNotInForce")
    assert message.startswith(
        "container main: an MPS cap it relies on is not in force, so its readiness marker is "
        f"set aside (a gate of the pod waits; Applied follows once the cap is back): {reason}: "
        f"{NOT_RUNNING}")
    # time-slicing relies on no daemon: its marker stays as it was
    assert rig.marker_path(ts).read_text() == ts_marker
    assert _gate(rig, ts) is ts_gate
    assert len(_reasons(rig, ts)) == 1  # Applied (Refused on 535), nothing since

    rig.mps.can_start = True  # the daemon runs again: everything is made again and verified
    assert rig.step().converged
    assert _result(rig, uid).state is ContainerState.APPLIED
    assert set(rig.mps.control.namespaces) == namespaces
    for name in namespaces:
        assert rig.mps.control.namespaces[name].active_thread_percentage == 50
    if "the default pinned device memory limit of GPU 0" in gone:
        assert rig.mps.control.default_pinned_mib == {0: 20480}
    assert marker_of(rig, uid)["containers"]["main"]["state"] == "applied"
    assert _gate(rig, uid) is Outcome.RELEASE
    assert _reasons(rig, uid) == ["Applied", "MpsCapNotInForce", "Applied"]
    assert _caps(rig) == []
    assert rig.step().converged
    assert _reasons(rig, uid) == ["Applied", "MpsCapNotInForce", "Applied"]


def test_a_daemon_that_runs_but_does_not_answer_keeps_the_markers(short_tmp: Path) -> None:
    """Slow, busy or hung, a daemon that still runs holds its namespaces and settings and
    serves its clients: killing it, or setting its markers aside, would be for nothing."""
    rig = Rig(short_tmp)
    uid = _sm_pod(rig)
    assert rig.step().converged
    written = rig.marker_path(uid).read_text()
    rig.mps.control.hang()
    for _ in range(3):
        report = rig.step()
        assert not report.converged and "MpsDaemonNotAnswering" in report.errors
        r = _result(rig, uid)
        assert (r.state, r.reason, r.not_in_force) == (
            ContainerState.PENDING, "MpsDaemonNotAnswering", False)
        assert rig.marker_path(uid).read_text() == written
        assert _gate(rig, uid) is Outcome.RELEASE
    assert _caps(rig) == [] and _reasons(rig, uid) == ["Applied"]
    rig.mps.control.resume()
    assert rig.step().converged
    assert rig.marker_path(uid).read_text() == written
    assert _reasons(rig, uid) == ["Applied"]


def test_a_daemon_that_stops_answering_then_dies_sets_the_marker_aside(short_tmp: Path
                                                                        ) -> None:
    """Not answering keeps the marker; the same daemon found gone afterwards does not."""
    rig = Rig(short_tmp)
    uid = _sm_pod(rig)
    assert rig.step().converged
    rig.mps.control.hang()
    assert not rig.step().converged
    assert rig.marker_path(uid).exists()
    rig.mps.control.kill()
    rig.mps.can_start = False
    assert not rig.step().converged
    assert _set_aside(rig, uid) and _gate(rig, uid) is Outcome.WAIT
    assert _reasons(rig, uid) == ["Applied", "MpsCapNotInForce"]


def test_a_restarted_daemon_whose_caps_cannot_be_set_keeps_the_marker_aside(
        short_tmp: Path) -> None:
    """Back, but the namespace cannot be made: the episode goes on under the cause's own
    reason (no second event), until the caps are in force."""
    from kai_fractions.node.mps import MpsError

    rig = Rig(short_tmp, memory_enforcement="cgroup,watchdog")
    uid = _sm_pod(rig)
    assert rig.step().converged
    rig.mps.control.kill()
    rig.mps.can_start = False
    assert not rig.step().converged
    rig.mps.can_start = True
    rig.mps.control.inject("namespace_create", MpsError("MpsDaemonBusy", "busy"))
    assert not rig.step().converged
    r = _result(rig, uid)
    assert (r.reason, r.not_in_force) == ("NamespaceCapNotSet", True)
    assert "could not be made" in r.message
    assert _set_aside(rig, uid)
    assert rig.step().converged
    assert _reasons(rig, uid) == ["Applied", "MpsCapNotInForce", "Applied"]


# -- (b) the agent stops, and the daemon it started with it -----------------------------------


def _owning_rig(short_tmp: Path) -> Rig:
    rig = Rig(short_tmp)
    rig.mps.control.kill()  # no daemon yet (as in the chart): the agent starts its own
    return rig


def _record_at_stop(rig: Rig, uids: dict[str, str]) -> dict[str, tuple[bool, bool]]:
    """Makes the daemon's stop record, for each pod, (marker there, set aside) as it begins."""
    seen: dict[str, tuple[bool, bool]] = {}
    stop = rig.mps.stop

    def recording(grace: float | None = None) -> bool:
        for name, uid in uids.items():
            seen[name] = (rig.marker_path(uid).exists(),
                          (rig.marker_path(uid).parent / SET_ASIDE_FILE).exists())
        return stop(grace)

    rig.mps.stop = recording  # type: ignore[method-assign]
    return seen


def test_a_graceful_stop_sets_the_markers_aside_before_the_daemon_it_started_stops(
        short_tmp: Path) -> None:
    rig = _owning_rig(short_tmp)
    uid, ts = _sm_pod(rig), _ts_pod(rig)
    rig.agent.start()
    wait_for(lambda: rig.marker_path(uid).exists() and rig.marker_path(ts).exists(),
             what="both markers")
    ts_marker = rig.marker_path(ts).read_text()
    seen = _record_at_stop(rig, {"sm": uid, "ts": ts})
    rig.agent.stop(timeout=5)
    assert rig.mps.stopped and not rig.mps.control.namespaces
    # set aside before the daemon began to stop; a time-slicing pod's stays
    assert seen == {"sm": (False, True), "ts": (True, False)}
    assert _set_aside(rig, uid) and _gate(rig, uid) is Outcome.WAIT
    assert rig.marker_path(ts).read_text() == ts_marker and _gate(rig, ts) is Outcome.RELEASE

    # the next agent starts a daemon, applies everything on it, then writes the marker again
    new = rig.restarted()
    assert new.step().converged
    assert new.mps.control.namespaces and new.mps.control.default_pinned_mib == {0: 20480}
    assert marker_of(new, uid)["containers"]["main"]["state"] == "applied"
    assert _gate(new, uid) is Outcome.RELEASE
    assert rig.marker_path(ts).read_text() == ts_marker  # adopted as it was
    assert _reasons(new, uid) == ["Applied", "Applied"]
    assert _reasons(new, ts) == ["Applied"]


def test_a_marker_set_aside_at_a_stop_is_not_adopted_while_the_next_daemon_does_not_run(
        short_tmp: Path) -> None:
    """The next agent takes a set-aside marker for the plan the pod is held to, never for
    limits in force: while its own daemon cannot start, the gate keeps waiting."""
    rig = _owning_rig(short_tmp)
    uid = _sm_pod(rig)
    assert rig.step().converged
    rig.reconciler.close()  # what NodeAgent.stop does once the worker has finished
    assert rig.mps.stopped and _set_aside(rig, uid)

    new = rig.restarted()
    new.mps.can_start = False
    assert not new.step().converged
    r = _result(new, uid)
    assert (r.reason, r.not_in_force) == ("NamespaceCapNotSet", True)
    assert r.message.startswith(NOT_RUNNING)
    assert _set_aside(new, uid) and _gate(new, uid) is Outcome.WAIT
    # the episode is told by the new agent too (the marker was set aside in this boot)
    assert _reasons(new, uid) == ["Applied", "MpsCapNotInForce"]
    new.mps.can_start = True
    assert new.step().converged
    assert marker_of(new, uid)["containers"]["main"]["state"] == "applied"
    assert _reasons(new, uid) == ["Applied", "MpsCapNotInForce", "Applied"]


def test_a_stop_leaves_an_adopted_daemon_running_and_its_markers_in_place(
        short_tmp: Path) -> None:
    rig = Rig(short_tmp)  # a daemon answers when the agent starts: adopted, not its own
    uid = _sm_pod(rig)
    rig.agent.start()
    wait_for(lambda: rig.marker_path(uid).exists(), what="the marker")
    written = rig.marker_path(uid).read_text()
    rig.agent.stop(timeout=5)
    assert not rig.mps.stopped and rig.mps.control.namespaces
    assert rig.marker_path(uid).read_text() == written
    assert _gate(rig, uid) is Outcome.RELEASE
