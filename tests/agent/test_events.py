"""The node agent's events under load: at most `rate` per second after a burst (the rest wait
in the backlog and go out with later passes), and the events of one pod and reason beyond ten
in a window folded into one summary, so a restart or a misbehaving workload cannot flood the
API server with Event writes."""

from __future__ import annotations

from datetime import UTC, datetime

from kai_fractions.kube.errors import KubeError
from kai_fractions.node.agent.events import WARNING, EventRecorder, PodRef
from tests.support.fake_kube import FakeCluster

A = PodRef("team-a", "train-0", "uid-a")
B = PodRef("team-a", "train-1", "uid-b")


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def recorder(cluster: FakeCluster, clock: Clock, **kw) -> EventRecorder:
    return EventRecorder(cluster, "node-a", clock, **kw)


def test_a_burst_goes_out_then_the_rest_at_the_rate_from_the_backlog():
    cluster, clock = FakeCluster(), Clock()
    events = recorder(cluster, clock, burst=3, rate=0.5)
    sent = [events.emit(PodRef("ns", f"p{i}", f"u{i}"), WARNING, "Applied", f"pod {i}",
                        key=("Applied", i)) for i in range(5)]
    assert sent == [True, True, True, False, False]
    assert len(cluster.events) == 3
    events.flush()  # no time has passed: nothing more
    assert len(cluster.events) == 3
    clock.now += 2.0  # one more token
    events.flush()
    assert [e["message"] for e in cluster.events] == ["pod 0", "pod 1", "pod 2", "pod 3"]
    clock.now += 10.0
    events.flush()
    assert len(cluster.events) == 5
    assert not events.emit(PodRef("ns", "p0", "u0"), WARNING, "Applied", "again",
                           key=("Applied", 0))  # sent before: never twice


def test_a_refusing_api_keeps_the_event_and_spends_no_rate():
    cluster, clock = FakeCluster(), Clock()
    events = recorder(cluster, clock, burst=1, rate=0.001)
    cluster.fail("create_event", KubeError("events: 503", 503))
    assert not events.emit(A, WARNING, "Refused", "no", key="k")
    events.flush()
    assert [e["reason"] for e in cluster.events] == ["Refused"]


def test_events_of_one_pod_and_reason_beyond_ten_are_folded_into_one_per_window():
    cluster, clock = FakeCluster(), Clock()
    events = recorder(cluster, clock, burst=100, aggregate_after=10, aggregate_seconds=600)
    for i in range(25):
        assert events.emit(A, WARNING, "LimitViolation", f"episode {i}", key=("v", i))
        clock.now += 1
    events.emit(B, WARNING, "LimitViolation", "another pod", key=("v", "b"))
    events.emit(A, WARNING, "LimitEnforced", "another reason", key=("e", 0))
    assert len(cluster.events) == 12  # ten of A's, then B's and A's other reason
    clock.now += 600
    events.flush()
    summary = cluster.events[-1]
    assert summary["message"] == ("episode 24 (and 14 more LimitViolation event(s) of this "
                                  "pod in 600 s, not sent one by one)")
    assert (summary["count"], summary["involvedObject"]["uid"]) == (15, "uid-a")
    # A new window: the pod's events are sent one by one again.
    assert events.emit(A, WARNING, "LimitViolation", "episode 25", key=("v", 25))
    assert cluster.events[-1]["message"] == "episode 25"
    events.flush()
    assert len(cluster.events) == 14


def test_a_forgotten_pod_leaves_no_window_behind():
    cluster, clock = FakeCluster(), Clock()
    events = recorder(cluster, clock, aggregate_after=1)
    events.emit(A, WARNING, "LimitViolation", "first", key=1)
    events.emit(A, WARNING, "LimitViolation", "folded", key=2)
    events.forget_pod("uid-a")
    clock.now += 601
    events.flush()
    assert [e["message"] for e in cluster.events] == ["first"]


def test_a_recorder_keeps_nothing_of_the_pods_it_forgot():
    """Events are sent, not kept: an agent's life of pods must not grow its memory."""
    cluster, clock = FakeCluster(), Clock()
    events = recorder(cluster, clock, burst=10, rate=1.0)
    for i in range(30):
        pod = PodRef("ns", f"p{i}", f"u{i}")
        events.emit(pod, WARNING, "Applied", f"pod {i}", key=("Applied", i))
        events.flush()
        clock.now += 1
        events.forget_pod(pod.uid)
    assert len(cluster.events) == 30
    held = {name: value for name, value in vars(events).items()
            if isinstance(value, (list, dict, set, tuple)) and value}
    assert held == {}


def test_a_summary_carries_the_time_of_its_last_folded_event_not_the_windows_end():
    """`inspect pod` takes a container's newest agent event as its state: a summary stamped
    at the window's end read as newer than a later event of another reason (an `Applied`
    summary over a `MpsCapNotInForce` sent after the last folded `Applied`)."""
    cluster, clock = FakeCluster(), Clock()
    events = recorder(cluster, clock, burst=100, aggregate_after=1, aggregate_seconds=600)
    events.emit(A, "Normal", "Applied", "applied 0", key=("a", 0))
    clock.now += 5
    events.emit(A, "Normal", "Applied", "applied 1 (folded)", key=("a", 1))
    folded_at = clock.now
    clock.now += 10
    events.emit(A, WARNING, "MpsCapNotInForce", "cap lost", key=("c", 0))
    clock.now += 600
    events.flush()
    lost, summary = cluster.events[-2], cluster.events[-1]
    assert (lost["reason"], summary["reason"]) == ("MpsCapNotInForce", "Applied")
    assert summary["lastTimestamp"] < lost["lastTimestamp"]
    assert summary["lastTimestamp"] == datetime.fromtimestamp(int(folded_at), UTC).strftime(
        "%Y-%m-%dT%H:%M:%SZ")
