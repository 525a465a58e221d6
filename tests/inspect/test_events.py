"""`inspect pod` off the node: the node agent's events on the pod tell what the gate's status
cannot (a marker set aside after the gate released, a signature awaited); the newest of them
decides each container, and only while the agent itself was not read."""

from __future__ import annotations

import datetime
from typing import Any

from kai_fractions.contract import ComputeMode
from kai_fractions.inspect.agent_events import agent_events, newest
from kai_fractions.inspect.agent_state import AgentAllocation, AgentState, unreachable
from kai_fractions.inspect.model import GATE_ONLY, pod_report
from kai_fractions.inspect.render import render
from kai_fractions.kube.objects import pod_event
from kai_fractions.node.agent import events as ev
from kai_fractions.node.agent.options import COMPONENT

from .pods import GPU0, bind, gate_status, memory_pod, node

UID = "aaaaaaaa-0000-4000-8000-000000000001"
MEMORY_LIMIT = "MemoryLimitNotInForce"
T0 = 1_700_000_000
AGENT_DOWN = unreachable("none", "give --agent-socket PATH (on the node) or --agent-metrics URL")
SET_ASIDE = ("container main: an MPS cap it relies on is not in force, so its readiness marker "
             "is set aside (a gate of the pod waits; Applied follows once the cap is back): "
             "MpsPinnedLimitLost: the MPS daemon restarted")


def stamp(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def event(reason: str, message: str, at: float, *, kind: str = ev.WARNING, uid: str = UID,
          component: str = COMPONENT) -> dict[str, Any]:
    """An Event as the agent writes it (kube.objects.pod_event)."""
    return pod_event("team-a", "srv", uid, event_type=kind, reason=reason, message=message,
                     component=component, host="gpu-node-1",
                     now=datetime.datetime.fromtimestamp(at, datetime.UTC))


def released(at: float = T0) -> dict[str, Any]:
    """An sm-sharing pod whose gate exited 0 at `at`."""
    p = gate_status(bind(memory_pod("srv", UID, "8Gi", mode=ComputeMode.SM_SHARING), (GPU0,)),
                    exit_code=0, message="limits applied")
    p["status"]["initContainerStatuses"][0]["state"]["terminated"]["finishedAt"] = stamp(at)
    return p


def row(p: dict[str, Any], events: list[dict[str, Any]] | None, agent=AGENT_DOWN):
    [r] = pod_report(p, node(), agent, events=events).rows
    return r


def test_a_marker_set_aside_after_the_gate_released_is_pending_not_enforced() -> None:
    r = row(released(), [event(ev.APPLIED, "container main: GPU limits in force (plan x)", T0,
                               kind=ev.NORMAL),
                         event(ev.MPS_CAP_NOT_IN_FORCE, SET_ASIDE, T0 + 60)])
    assert (r.state, r.reason, r.state_source, r.tier) == (
        "pending", "MpsCapNotInForce", "events", "-")
    assert r.message == SET_ASIDE.removeprefix("container main: ")
    assert r.accounted  # the agent holds its plan: still counted
    # the agent's Applied once the cap is back confirms what the gate said
    back = event(ev.APPLIED, "container main: GPU limits in force (plan x)", T0 + 120,
                 kind=ev.NORMAL)
    r = row(released(), [event(ev.MPS_CAP_NOT_IN_FORCE, SET_ASIDE, T0 + 60), back])
    assert (r.state, r.reason, r.message, r.state_source) == (
        "enforced", "", "GPU limits in force (plan x)", "events")


def test_a_pod_held_for_its_signature_says_so_and_is_not_accounted() -> None:
    waiting = gate_status(bind(memory_pod("srv", UID, "8Gi"), (GPU0,)), exit_code=None,
                          running=True)
    said = ("container main: waiting for its signature: the mirror has not signed this "
            "allocation yet")
    r = row(waiting, [event(ev.SIGNATURE_MISSING, said, T0)])
    assert (r.state, r.reason, r.message, r.accounted) == (
        "pending", "SignatureMissing",
        "waiting for its signature: the mirror has not signed this allocation yet", False)
    table = render(pod_report(waiting, node(), AGENT_DOWN, events=[event(
        ev.SIGNATURE_MISSING, said, T0)]), "table")
    assert "pending (SignatureMissing)" in table and "GateWaiting" not in table
    # without the events, the gate's word
    assert row(waiting, None).reason == "GateWaiting"


def test_a_refused_event_names_the_refusals_reason() -> None:
    r = row(released(), [event(ev.REFUSED, "container main: SmSharingDisabled: no MPS here",
                               T0 + 5)])
    assert (r.state, r.reason, r.message, r.state_source, r.accounted) == (
        "refused", "SmSharingDisabled", "no MPS here", "events", False)


def test_an_event_that_names_no_container_is_the_whole_pods() -> None:
    [said] = agent_events([event(MEMORY_LIMIT, "the pod's cgroup limit is gone", T0 + 9)], UID)
    assert (said.container, said.state) == ("", "pending")
    assert newest([said], "main") == said
    r = row(released(), [event(MEMORY_LIMIT, "the pod's cgroup limit is gone", T0 + 9)])
    assert (r.state, r.reason) == ("pending", MEMORY_LIMIT)


def test_a_gate_released_after_a_pending_event_wins() -> None:
    """The gate releases only once the marker is back: a set-aside older than its exit is over,
    even when the Applied that ended it never reached the API."""
    r = row(released(at=T0 + 300), [event(ev.MPS_CAP_NOT_IN_FORCE, SET_ASIDE, T0 + 60)])
    assert (r.state, r.reason, r.state_source) == ("enforced", "", "gate")


def test_only_the_agents_state_events_of_this_pod_count() -> None:
    others = [
        event(ev.MPS_CAP_NOT_IN_FORCE, SET_ASIDE, T0 + 60, uid="another-pod-uid"),
        event(ev.MPS_CAP_NOT_IN_FORCE, SET_ASIDE, T0 + 60, component="someone-else"),
        event(ev.LIMIT_VIOLATION, "container main: uses 9 GiB over its 8 GiB cap", T0 + 60),
        event(ev.PLAN_CHANGE_REFUSED, "container main: the plan in force stays", T0 + 60),
    ]
    assert agent_events(others, UID) == ()
    r = row(released(), others)
    assert (r.state, r.state_source) == ("enforced", "gate")


def test_the_newest_time_the_event_carries_decides() -> None:
    """An aggregated event's series.lastObservedTime (events.k8s.io) is newer than its
    lastTimestamp; a tie in seconds goes to the later resourceVersion."""
    applied = event(ev.APPLIED, "container main: GPU limits in force", T0 + 100, kind=ev.NORMAL)
    set_aside = event(ev.MPS_CAP_NOT_IN_FORCE, SET_ASIDE, T0 + 50)
    set_aside["series"] = {"count": 3, "lastObservedTime": stamp(T0 + 200)}
    assert row(released(), [applied, set_aside]).state == "pending"
    same = event(ev.MPS_CAP_NOT_IN_FORCE, SET_ASIDE, T0 + 100)
    applied["metadata"]["resourceVersion"], same["metadata"]["resourceVersion"] = "12", "11"
    assert row(released(), [applied, same]).state == "enforced"
    applied["metadata"]["resourceVersion"] = "10"
    assert row(released(), [applied, same]).state == "pending"


def test_the_agent_read_itself_wins_over_its_events() -> None:
    socket = AgentState(source="socket unix:///x", allocations=(AgentAllocation(
        "team-a", "srv", "main", UID, state="applied", reason="whatever"),))
    r = row(released(), [event(ev.MPS_CAP_NOT_IN_FORCE, SET_ASIDE, T0 + 60)], agent=socket)
    assert (r.state, r.reason, r.state_source) == ("enforced", "", "agent")


def test_an_enforced_rows_reason_is_the_same_whatever_said_it() -> None:
    """The socket, an Applied event, the gate alone: reason "" each time, `state_source` names
    who said it; only the gate's word alone reads `enforced (gate)`, with a note."""
    socket = AgentState(source="socket unix:///x", allocations=(AgentAllocation(
        "team-a", "srv", "main", UID, state="applied", reason="Applied"),))
    by_events = [event(ev.APPLIED, "container main: GPU limits in force", T0, kind=ev.NORMAL)]
    rows = [row(released(), None, socket), row(released(), by_events), row(released(), None)]
    assert [(r.state, r.reason, r.state_source) for r in rows] == [
        ("enforced", "", "agent"), ("enforced", "", "events"), ("enforced", "", "gate")]
    gate_only = pod_report(released(), node(), AGENT_DOWN)
    assert GATE_ONLY in gate_only.notes
    assert "enforced (gate)" in render(gate_only, "table")
    assert GATE_ONLY not in pod_report(released(), node(), AGENT_DOWN, events=by_events).notes


def test_within_one_second_a_later_single_event_outranks_a_summary_created_after_it() -> None:
    """Event times are whole seconds. An `Applied` summary is created at its window's end (a
    higher resourceVersion) but stamped with its last folded event's second, which a
    `MpsCapNotInForce` sent just after may share: the single event is the newer."""
    lost = event(ev.MPS_CAP_NOT_IN_FORCE, SET_ASIDE, T0 + 60)
    lost["metadata"]["resourceVersion"] = "101"
    summary = event(ev.APPLIED, "container main: GPU limits in force (plan x) (and 11 more "
                    "Applied event(s) of this pod in 600 s, not sent one by one)", T0 + 60,
                    kind=ev.NORMAL)
    summary["metadata"]["resourceVersion"], summary["count"] = "102", 12
    assert newest(agent_events([lost, summary], UID), "main").reason == "MpsCapNotInForce"
    summary["count"] = 1  # two single events in one second: the later written wins
    assert newest(agent_events([lost, summary], UID), "main").reason == ev.APPLIED
