"""A pass never vouches for a container whose only memory tier is the kill-policy watchdog on a GPU
that no watchdog check has judged with that container planned: it runs the check first.

Before: a restarted agent's first pass only asked whether NVML could *list* the GPU's processes
(`probe`), so an agent without hostPID (every process hidden: NoProcessesVisible), one that
NVML shows processes to without their memory, or one that cannot place a process, wrote the
markers of pods it had held pending, and a new pod's gate released, until the first check a
watchdog interval later set them aside again (a second WatchdogBlind each). And a running agent
judged the other kinds only on GPUs that already had a planned container, so the first pod placed
on a GPU with an unplaceable process was vouched for before any check judged that GPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from kai_fractions.gate.check import Outcome
from kai_fractions.node.agent.worker import Worker

from .builders import GIB, Rig, marker_of
from .test_watchdog_only_tier_blind import (
    BLIND,
    add,
    cap_series,
    gate,
    hide,
    old_node,
    result,
    running,
)


def unreadable_checks(rig: Rig) -> dict[tuple[str, str], float]:
    """(gpu uuid, reason) -> kai_fractions_agent_gpu_usage_unreadable_total."""
    return {(s.labels["gpu_uuid"], s.labels["reason"]): s.value
            for f in rig.agent.metrics.registry.collect() for s in f.samples
            if s.name == "kai_fractions_agent_gpu_usage_unreadable_total"}


def make_blind(rig: Rig, kind: str, uid: str) -> None:
    if kind == "NoProcessesVisible":  # an agent without hostPID: NVML lists none of them
        running(rig, uid, 100, 5 * GIB)
        hide(rig, 100)
    elif kind == "ProcessMemoryUnknown":
        running(rig, uid, 100, None)
    else:  # ProcessContainerUnknown: a pod-shaped path it cannot place
        rig.proc_entry(100, f"/../../../../custom-root/pod{uid}/{'a' * 64}")
        rig.nvml.add_process(100, rig.gpu0, 5 * GIB)


@pytest.mark.parametrize("kind", ["NoProcessesVisible", "ProcessMemoryUnknown",
                                  "ProcessContainerUnknown"])
def test_a_restarted_agent_does_not_vouch_before_a_check_judged_the_gpu(
        short_tmp: Path, kind: str) -> None:
    """The reviewer's probe (P3): pod p runs, pod q is new and waits; the agent restarts."""
    rig = old_node(short_tmp)
    p = add(rig)
    assert rig.step().converged
    make_blind(rig, kind, p)
    rig.reconciler.check_usage()
    rig.step()
    q = add(rig, "q", request="5Gi", limit="10Gi")
    rig.step()
    assert result(rig, p).reason == BLIND and result(rig, q).reason == BLIND

    new = rig.restarted()
    new.step()  # its first pass, before any scheduled check
    for uid in (p, q):
        r = result(new, uid)
        assert (r.state.value, r.reason) == ("pending", BLIND)
        assert r.message.startswith(f"usage unknown on GPU {new.gpu0} ({kind}): ")
        assert marker_of(new, uid) is None and gate(new, uid) is Outcome.WAIT
        assert cap_series(new, uid) == {BLIND: 1}
    assert "Applied" not in new.cluster.event_reasons(q)
    assert new.cluster.event_reasons(p).count("Applied") == 1  # the first agent's, only
    cond = new.agent.condition()
    assert (cond.ready, cond.reason) == (False, BLIND)
    # it was a real check: counted as one (the metrics and the view say what it found)
    assert new.reconciler.usage.checks == 1
    assert unreadable_checks(new) == {(new.gpu0, kind): 1}
    assert new.reconciler.view.usage_unknown == {new.gpu0: kind}


def test_a_restarted_agents_first_pass_enforces_as_a_check_does(short_tmp: Path) -> None:
    """Its check is the scheduled one, brought forward: over the cap is stopped then."""
    rig = old_node(short_tmp)
    uid = add(rig)
    assert rig.step().converged
    running(rig, uid, 4242, 30 * GIB)  # over its 20 GiB cap
    new = rig.restarted()
    assert new.step().converged
    assert new.killer.calls == [4242]
    assert result(new, uid).state.value == "applied" and marker_of(new, uid) is not None
    assert new.cluster.event_reasons(uid) == ["Applied", "LimitEnforced"]


def test_the_first_pod_on_a_gpu_is_judged_with_it_planned(short_tmp: Path) -> None:
    """The reviewer's probe (P2b): GPU 1 runs a process whose container cannot be told, and no
    planned container yet: nothing was judged there. A pod placed on it is never vouched for."""
    rig = old_node(short_tmp)
    a = add(rig, "a")  # GPU 0
    assert rig.step().converged
    for _ in range(5):
        rig.reconciler.check_usage()
    rig.proc_entry(100, "/../../../../custom-root/pod" + "0" * 8 + "-1111-2222-3333-"
                   + "4" * 12 + "/" + "a" * 64)
    rig.nvml.add_process(100, rig.gpu1, 30 * GIB)
    rig.reconciler.check_usage()
    rig.step()
    checks = rig.reconciler.usage.checks
    b = add(rig, "b", gpu=rig.gpu1, request="5Gi", limit="10Gi")
    rig.step()
    assert rig.reconciler.usage.checks == checks + 1
    r = result(rig, b)
    assert (r.state.value, r.reason) == ("pending", BLIND)
    assert r.message.startswith(f"usage unknown on GPU {rig.gpu1} (ProcessContainerUnknown): ")
    assert marker_of(rig, b) is None and gate(rig, b) is Outcome.WAIT
    assert rig.cluster.event_reasons(b) == []
    assert result(rig, a).state.value == "applied"
    # judged once: the next passes do not check again
    rig.step()
    assert rig.reconciler.usage.checks == checks + 1


def test_a_pass_with_nothing_unjudged_runs_no_check(short_tmp: Path) -> None:
    rig = old_node(short_tmp)
    uid = add(rig)
    assert rig.step().converged  # a new pod: judged in this pass
    assert rig.reconciler.usage.checks == 1
    rig.reconciler.check_usage()
    for _ in range(3):
        rig.step()
    assert rig.reconciler.usage.checks == 2 and marker_of(rig, uid) is not None
    # a node where the cgroup tier caps the pod: no check in a pass at all
    (short_tmp / "r615").mkdir()
    limited = Rig(short_tmp / "r615", sm_sharing=False, watchdog_policy="kill")
    add(limited)
    assert limited.step().converged
    assert limited.reconciler.usage.checks == 0


def test_a_check_that_raises_in_a_pass_vouches_for_nothing(short_tmp: Path) -> None:
    rig = old_node(short_tmp)
    uid = add(rig)

    def broken(*_args):
        raise RuntimeError("a bug in the check")

    rig.reconciler.usage.check = broken  # type: ignore[method-assign]
    with pytest.raises(RuntimeError):
        rig.step()
    assert marker_of(rig, uid) is None and gate(rig, uid) is Outcome.WAIT


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_a_pass_that_checked_moves_the_scheduled_check_on(short_tmp: Path) -> None:
    """One check, never two in a row: the worker counts the pass's as the interval's."""
    rig = old_node(short_tmp)
    clock = Clock()
    worker = Worker(rig.reconciler, rig.options, watchdog_interval=1.0, mps_checks=False,
                    monotonic=clock)
    rig.sync()
    add(rig)
    rig.sync()
    clock.t += 1.0  # the scheduled check is due, and a pass (the pod is new)
    worker._step([], True)
    assert rig.reconciler.usage.checks == 1  # the pass's, not a second one after it
    assert worker._next_watchdog == clock.t + 1.0
    clock.t += 1.0
    worker._step([], False)
    assert rig.reconciler.usage.checks == 2
