"""An sm-sharing pod being deleted has its MPS clients drained shortly before the kubelet's
SIGKILL (docs/node-agent.md, "Stopping an sm-sharing pod"): the schedule over fake clocks (the
wall clock of deletionTimestamp and the worker's monotonic clock differ on purpose), which pods
it applies to, and the CLI flag. The running agent's end-to-end drain is in
test_grpc_and_lifecycle.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kai_fractions.node.agent.drain_before_kill import DrainBeforeKill, deleting_sm_pods
from kai_fractions.node.agent.events import EventRecorder, PodRef
from kai_fractions.node.agent.metrics import AgentMetrics
from kai_fractions.node.errors import NvmlError
from kai_fractions.node.mps.errors import MpsError
from tests.support.fake_kube import FakeCluster

from .builders import Rig, binder_annotations, pod

WALL = 1_700_000_000.0
"""The wall clock at the start of each test (deletionTimestamps are wall-clock times)."""
UID = "0a1b2c3d-0000-4000-8000-00000000d001"
POD = PodRef("team-a", "train-0", UID)


@dataclass
class Clocks:
    mono: float = 500.0
    wall: float = WALL

    def advance(self, seconds: float) -> None:
        self.mono += seconds
        self.wall += seconds


@dataclass
class FakeDrain:
    """`Reconciler.drain`: answers from `results` in turn (a list of pids, or an exception)."""

    clocks: Clocks
    results: list[list[int] | Exception] = field(default_factory=list)
    calls: list[tuple[str, float]] = field(default_factory=list)
    """(uid, wall time) of each call."""

    def __call__(self, uid: str) -> list[int]:
        self.calls.append((uid, self.clocks.wall))
        result = self.results.pop(0) if self.results else []
        if isinstance(result, Exception):
            raise result
        return result


class Setup:
    def __init__(self, margin: float = 3.0, results: list | None = None):
        self.clocks = Clocks()
        self.drain = FakeDrain(self.clocks, list(results or []))
        self.cluster = FakeCluster()
        self.events = EventRecorder(self.cluster, "node-a", lambda: self.clocks.wall)
        self.metrics = AgentMetrics("node-a")
        self.drains = DrainBeforeKill(margin, self.drain, self.events, self.metrics,
                                      clock=lambda: self.clocks.wall,
                                      monotonic=lambda: self.clocks.mono)

    def deleting(self, deadline: float, pod: PodRef = POD) -> None:
        """The watch shows `pod` with this deletionTimestamp (wall clock)."""
        self.drains.update({pod.uid: (pod, deadline)}, {pod.uid})

    def run_for(self, seconds: float, step: float = 0.25) -> None:
        """The worker's loop: runs what is due every `step` for `seconds`."""
        end = self.clocks.mono + seconds
        while self.clocks.mono < end:
            self.drains.run_due()
            self.clocks.advance(step)

    def count(self, result: str) -> float | None:
        return self.metrics.registry.get_sample_value(
            "kai_fractions_agent_mps_drains_total", {"result": result})

    def reasons(self) -> list[tuple[str, str]]:
        return [(e["type"], e["reason"]) for e in self.cluster.events]


def test_the_drain_is_due_the_margin_before_the_deletion_deadline() -> None:
    s = Setup(margin=3.0, results=[[4242, 4243]])
    s.deleting(WALL + 30)  # a 30 s grace period
    assert s.drains.next_due() == 500.0 + 27  # in the worker's monotonic time
    s.run_for(26.5)
    assert s.drain.calls == []  # the grace period is the workload's: nothing at SIGTERM
    s.run_for(1.0)
    assert s.drain.calls == [(UID, WALL + 27)]
    assert s.drains.next_due() is None and UID in s.drains.done
    assert (s.count("drained"), s.count("nothing"), s.count("failed")) == (1, 0, 0)
    assert s.reasons() == [("Normal", "MpsClientsDrained")]
    assert s.cluster.events[0]["message"].endswith("pids 4242, 4243")
    assert s.cluster.events[0]["involvedObject"]["uid"] == UID


@pytest.mark.parametrize("deadline", [WALL + 1, WALL, WALL - 120],
                         ids=["grace-shorter-than-margin", "deadline-now", "deadline-past"])
def test_a_moment_already_past_drains_at_once(deadline: float) -> None:
    s = Setup(margin=3.0)
    s.deleting(deadline)
    assert s.drains.next_due() == 500.0
    s.drains.run_due()
    assert s.drain.calls == [(UID, WALL)]
    assert (s.count("drained"), s.count("nothing")) == (0, 1)  # no client of the pod found
    assert s.reasons() == []  # an event only when pids were drained


def test_each_pod_is_drained_once_while_it_stays() -> None:
    s = Setup(results=[[7]])
    s.deleting(WALL + 10)
    s.run_for(8)
    s.deleting(WALL + 10)  # every later pass shows it again
    s.deleting(WALL + 5)  # even with a new deadline
    s.run_for(10)
    assert s.drain.calls == [(UID, WALL + 7)]
    assert s.count("drained") == 1


def test_a_changed_deadline_reschedules_a_drain_not_done_yet() -> None:
    s = Setup()
    s.deleting(WALL + 60)
    s.deleting(WALL + 10)  # deleted again with a shorter grace period
    s.run_for(8)
    assert s.drain.calls == [(UID, WALL + 7)]


def test_a_failed_drain_is_retried_every_second_until_it_works() -> None:
    s = Setup(results=[MpsError("MPSDaemonUnreachable", "the MPS control daemon does not "
                                "answer"), NvmlError("GPU lost", reason="GPULost"), [99]])
    s.deleting(WALL + 20)
    s.run_for(20)
    assert [t - WALL for _uid, t in s.drain.calls] == [17, 18, 19]
    assert (s.count("failed"), s.count("drained")) == (2, 1)
    assert s.reasons() == [("Warning", "MpsDrainFailed"), ("Normal", "MpsClientsDrained")]
    assert s.cluster.events[0]["message"] == (
        "draining the pod's MPS clients before the kubelet stops it failed: "
        "MPSDaemonUnreachable: the MPS control daemon does not answer")


def test_a_drain_that_keeps_failing_stops_a_few_seconds_after_the_deadline() -> None:
    s = Setup(results=[MpsError("MPSDaemonUnreachable", "down")] * 100)
    s.deleting(WALL + 10)
    s.run_for(60)
    # from deadline - 3 s to deadline + 5 s, once a second; then given up, never again
    assert [t - WALL for _uid, t in s.drain.calls] == [7, 8, 9, 10, 11, 12, 13, 14, 15]
    assert s.count("failed") == 9 and s.drains.next_due() is None
    assert s.reasons() == [("Warning", "MpsDrainFailed")]  # once per pod


def test_a_bug_in_the_drain_is_a_failure_not_the_end_of_the_worker() -> None:
    s = Setup(results=[KeyError("boom"), [1]])
    s.deleting(WALL)
    s.run_for(2)
    assert s.count("failed") == 1 and s.count("drained") == 1


def test_a_pod_that_goes_is_forgotten() -> None:
    s = Setup(results=[[5], [6]])
    s.deleting(WALL)
    s.drains.run_due()
    assert UID in s.drains.done
    s.drains.update({}, {UID})  # not deleting any more (e.g. it finished): still remembered
    assert UID in s.drains.done
    s.drains.update({}, set())  # gone
    assert s.drains.done == set()
    other = PodRef("team-a", "train-1", "0a1b2c3d-0000-4000-8000-00000000d002")
    s.deleting(WALL + 30, other)
    s.drains.update({}, set())  # gone before its drain was due: cancelled
    s.run_for(40)
    assert [uid for uid, _ in s.drain.calls] == [UID]


# -- which pods -------------------------------------------------------------------------------


def _deleting(rig: Rig, uid: str, timestamp: str = "2030-01-01T00:00:30Z") -> None:
    manifest = rig.cluster.pods[uid]
    rig.cluster.update_pod(uid, metadata={**manifest["metadata"],
                                          "deletionTimestamp": timestamp,
                                          "deletionGracePeriodSeconds": 30})


def _deleting_sm_pods(rig: Rig) -> dict:
    rig.step()
    return deleting_sm_pods(rig.agent.cache.snapshot(), rig.reconciler.view.desired)


def test_only_sm_sharing_pods_being_deleted_are_drained(short_tmp: Path) -> None:
    rig = Rig(short_tmp)
    sm = rig.add(pod("sm", notes=binder_annotations(devices=rig.gpu0, mode="sm-sharing")))
    ts = rig.add(pod("ts", notes=binder_annotations(devices=rig.gpu1)))  # time-slicing
    uid, ts_uid = sm["metadata"]["uid"], ts["metadata"]["uid"]
    assert _deleting_sm_pods(rig) == {}  # nothing is being deleted
    _deleting(rig, uid)
    _deleting(rig, ts_uid)
    assert _deleting_sm_pods(rig) == {
        uid: (PodRef("default", "sm", uid), 1893456030.0)}  # 2030-01-01T00:00:30Z


def test_no_mps_daemon_or_a_zero_margin_schedules_nothing(short_tmp: Path) -> None:
    for name in "abc":
        (short_tmp / name).mkdir()
    assert Rig(short_tmp / "a").agent.worker.drains is not None
    assert Rig(short_tmp / "b", sm_sharing=False).agent.worker.drains is None
    off = Rig(short_tmp / "c", options={"mps_drain_before_kill_seconds": 0})
    assert off.agent.worker.drains is None


# -- the flag ---------------------------------------------------------------------------------


def test_the_cli_drains_3_s_before_the_kill_by_default_and_refuses_a_negative_margin(
        capsys: pytest.CaptureFixture[str]) -> None:
    from kai_fractions.cli import build_parser, main

    assert build_parser().parse_args(["node-agent"]).mps_drain_before_kill == 3.0
    assert main(["node-agent", "--node-name", "n1", "--mps-drain-before-kill", "-1"]) == 2
    assert capsys.readouterr().err == (
        "kai-fractions node-agent: --mps-drain-before-kill must be 0 or more seconds, got -1.0\n")
    assert main(["node-agent", "--node-name", "n1", "--mps-drain-before-kill", "nan"]) == 2
    assert "--mps-drain-before-kill" in capsys.readouterr().err
