"""The node condition while the watchdog is blind, and how long an episode of blindness lasts.

Before: the condition turned False only once a watchdog-only pod was on a blind GPU, so KAI
placed one there (the condition True), which then waited; from then on it was False for the
whole node, and True again once the pod left. Now, where the watchdog would be the only
memory tier of a time-slicing pod placed on the node, any blind GPU makes it False, with a pod
there or not.

Before: an episode ended at the first check that saw the GPU, so a GPU whose listing failed
every other check set markers aside and wrote them again, patched the condition and sent
events at the pace of the passes. Now an episode ends after two checks in a row that see it."""

from __future__ import annotations

from pathlib import Path

import pytest

from kai_fractions.node.agent.worker import Worker
from kai_fractions.node.config import Mechanism, WatchdogPolicy
from kai_fractions.node.errors import nvml_error
from kai_fractions.node.mps import MpsError
from kai_fractions.sim.nvml import FakeNvml

from .builders import NODE, Rig, marker_of
from .test_watchdog_only_tier_blind import BLIND, OLD_DRIVER, add, old_node, result


def condition(rig: Rig) -> tuple[bool, str]:
    c = rig.agent.condition()
    return c.ready, c.reason


# -- the condition ---------------------------------------------------------------------------


def test_a_blind_gpu_without_a_pod_makes_the_node_not_ready_before_kai_places_one(
        short_tmp: Path) -> None:
    """The reviewer's probe (P5)."""
    rig = old_node(short_tmp)
    a = add(rig, "a")  # GPU 0, seen
    assert rig.step().converged
    rig.nvml.fail("running_processes", "NoPermission", times=None, device=rig.gpu1)
    rig.reconciler.check_usage()
    rig.step()
    assert condition(rig) == (False, BLIND)
    message = rig.agent.condition().message
    assert f"{rig.gpu1} (NVMLNoPermission)" in message and rig.gpu0 not in message
    b = add(rig, "b", gpu=rig.gpu1, request="5Gi", limit="10Gi")
    rig.step()
    rig.reconciler.check_usage()
    rig.step()
    assert condition(rig) == (False, BLIND) and rig.agent.condition().message == message
    assert result(rig, a).state.value == "applied" and result(rig, b).reason == BLIND
    rig.cluster.delete_pod(b)
    rig.step()
    assert condition(rig) == (False, BLIND)  # still blind: the next pod would wait too
    rig.nvml.clear_failures()
    for _ in range(2):
        rig.reconciler.check_usage()
    rig.step()
    assert condition(rig) == (True, "AgentReady")


def test_a_fresh_agent_checks_before_it_calls_a_watchdog_only_node_ready(
        short_tmp: Path) -> None:
    rig = old_node(short_tmp)
    rig.nvml.fail("running_processes", "NoPermission", times=None, device=rig.gpu1)
    rig.step()  # no pod at all: the first pass runs the first check
    assert rig.reconciler.usage.checks == 1
    assert condition(rig) == (False, BLIND)


@pytest.mark.parametrize(("driver", "config", "blind"), [
    (OLD_DRIVER, {}, True),  # kill watchdog, no cgroup limits: the watchdog alone
    ("615.00.00", {"memory_enforcement": frozenset({Mechanism.WATCHDOG})}, True),
    ("615.00.00", {}, False),  # cgroup limits cap a new pod
    # sm-sharing containers get mps-pinned, time-slicing ones are refused (report watchdog)
    (OLD_DRIVER, {"watchdog_policy": WatchdogPolicy.REPORT, "sm_sharing": True}, False),
])
def test_the_condition_follows_what_a_new_time_slicing_pod_would_get(
        short_tmp: Path, driver: str, config: dict, blind: bool) -> None:
    nvml = FakeNvml.simulated(2, model="H100-80GB", seed=NODE, driver_version=driver)
    config = {"sm_sharing": False, "watchdog_policy": WatchdogPolicy.KILL, **config}
    rig = Rig(short_tmp, nvml=nvml, **config)
    rig.step()
    rig.nvml.fail("running_processes", "NoPermission", times=None, device=rig.gpu1)
    rig.reconciler.check_usage()
    rig.step()
    assert condition(rig) == ((False, BLIND) if blind else (True, "AgentReady"))


# -- episodes ----------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def run_worker(rig: Rig, fails, seconds: float) -> dict[str, int]:
    """Drives the worker on a fake clock (1 s watchdog interval) for `seconds`, GPU 0's
    listing failing at the scheduled checks `fails(n)` says; counts what the pod and the node
    see."""
    clock = Clock()  # the worker hands it to the watchdog's news throttle too
    worker = Worker(rig.reconciler, rig.options, watchdog_interval=1.0, mps_checks=False,
                    monotonic=clock)
    worker._dirty = False
    n = [0]
    real = type(rig.nvml).running_processes

    def running_processes(uuid: str):
        if uuid == rig.gpu0 and fails(n[0]):
            raise nvml_error(999, "nvmlDeviceGetComputeRunningProcesses", device=uuid)
        return real(rig.nvml, uuid)

    check = rig.reconciler.check_usage

    def counted() -> None:
        n[0] += 1
        check()

    rig.nvml.running_processes = running_processes  # type: ignore[method-assign]
    rig.reconciler.check_usage = counted  # type: ignore[method-assign]
    (uid,) = {k.pod_uid for k in rig.reconciler.view.results}
    events = len(rig.cluster.events)
    marker, ready = marker_of(rig, uid) is not None, condition(rig)[0]
    out = {"set_aside": 0, "written": 0, "condition_changes": 0}
    start = clock.t
    while clock.t - start < seconds:
        clock.t = max(clock.t + 0.001, worker._due())
        worker._step([], False)
        now = marker_of(rig, uid) is not None
        if now != marker:
            out["written" if now else "set_aside"] += 1
            marker = now
        if condition(rig)[0] != ready:
            out["condition_changes"] += 1
            ready = not ready
    reasons = [e["reason"] for e in rig.cluster.events[events:]]
    out.update({r: reasons.count(r) for r in set(reasons)})
    del rig.nvml.running_processes
    return out


def test_a_listing_that_fails_every_other_check_is_one_episode(short_tmp: Path) -> None:
    """The reviewer's probe (P4): before, some 6 set-asides and rewrites of the marker, 12
    condition patches and 10 events a minute."""
    rig = old_node(short_tmp)
    uid = add(rig)
    assert rig.step().converged
    rig.reconciler.check_usage()
    seen = run_worker(rig, lambda n: n % 2 == 1, 120)
    assert seen == {"set_aside": 1, "written": 0, "condition_changes": 1, BLIND: 1}
    assert result(rig, uid).reason == BLIND
    # then seen at every check: the episode ends after two of them
    seen = run_worker(rig, lambda n: False, 30)
    assert seen == {"set_aside": 0, "written": 1, "condition_changes": 1, "Applied": 1}
    assert result(rig, uid).state.value == "applied"


def test_one_failed_listing_starts_an_episode_at_once_and_two_clean_checks_end_it(
        short_tmp: Path) -> None:
    rig = old_node(short_tmp)
    uid = add(rig)
    assert rig.step().converged
    rig.reconciler.check_usage()
    rig.nvml.fail("running_processes", "Unknown", times=1, device=rig.gpu0)
    rig.reconciler.check_usage()
    rig.step()
    assert result(rig, uid).reason == BLIND and marker_of(rig, uid) is None
    rig.reconciler.check_usage()
    rig.step()
    assert result(rig, uid).reason == BLIND  # one check that saw it
    # usage is read again at once, though: only the episode waits
    assert rig.reconciler.view.usage_unknown == {}
    rig.nvml.fail("running_processes", "Unknown", times=1, device=rig.gpu0)
    rig.reconciler.check_usage()  # blind again: the count starts over
    rig.reconciler.check_usage()
    rig.step()
    assert result(rig, uid).reason == BLIND
    rig.reconciler.check_usage()
    assert rig.step().converged and marker_of(rig, uid) is not None
    assert rig.cluster.event_reasons(uid) == ["Applied", BLIND, "Applied"]


def test_each_new_blocker_gets_its_own_warning(short_tmp: Path) -> None:
    """The reviewer's probe (P9), as docs/node-agent.md now says it: an sm-sharing container
    whose only memory tier is the watchdog is pending MpsCapNotInForce (its namespace's
    percentage lost with a daemon restart) while its GPU is blind; once the MPS cap is back it
    still waits, now for the watchdog, and is told so."""
    rig = old_node(short_tmp, sm_sharing=True, mps_v3=True,
                   memory_enforcement=frozenset({Mechanism.WATCHDOG}))
    uid = add(rig, mode="sm-sharing")
    assert rig.step().converged
    busy = MpsError("MpsDaemonBusy", "busy")
    control = rig.mps.control
    control.kill()
    control.inject("namespace_set_active_thread_percentage", busy, times=2)
    control.inject("namespace_delete", busy, times=2)
    rig.nvml.fail("running_processes", "NoPermission", times=None, device=rig.gpu0)
    rig.reconciler.check_usage()
    rig.step()
    r = result(rig, uid)
    assert r.reason == "NamespaceCapNotSet" and r.watchdog_blind
    assert rig.cluster.event_reasons(uid) == ["Applied", "MpsCapNotInForce"]
    for _ in range(2):
        rig.step()  # the MPS cap back (the injections spent), the GPU still blind
    assert result(rig, uid).reason == BLIND
    assert rig.cluster.event_reasons(uid) == ["Applied", "MpsCapNotInForce", BLIND]
