"""An agent upgraded past the rule that a watchdog in report mode is no memory tier, on a node
where that watchdog was a running container's only one (a time-slicing container on a driver
before r615 with the default flags): the container is refused (MemoryLimitsUnsupported, its
marker refused, so its next sandbox fails), but it still runs, so the watchdog keeps watching
it as before the upgrade: its usage is measured and each episode over its plan's cap is a
LimitViolation event; nothing of it is stopped (report). A container new after the upgrade is
refused and never watched. A kill policy caps such a container, and stays as it was.

The old rule's apply is made here by an agent with --watchdog-policy=kill (it applies the same
plan with the mechanisms {watchdog}, as the agent before the rule did under report); the
upgraded agent is the same node restarted with the default policy."""

from __future__ import annotations

from pathlib import Path

from kai_fractions.gate.check import Outcome
from kai_fractions.node.config import WatchdogPolicy
from kai_fractions.sim.nvml import FakeNvml

from ..node.test_desired_report_watchdog import RUNNING_REFUSED
from .builders import GIB, NODE, Rig, binder_annotations, leaf_of, marker_of, pod, slice_of
from .builders import gate_outcome as _gate

OLD_DRIVER = "550.54.15"
CID_NEW = "containerd://" + "b" * 64
LEAF_NEW = "cri-containerd-" + "b" * 64 + ".scope"


def _old_node(tmp: Path) -> tuple[Rig, str]:
    """A pre-r615 node whose time-slicing pod `p` (20 GiB cap on GPU 0) was applied with the
    watchdog as its only tier; then the agent restarted with the default policy (report)."""
    nvml = FakeNvml.simulated(2, model="H100-80GB", seed=NODE, driver_version=OLD_DRIVER)
    rig = Rig(tmp, sm_sharing=False, nvml=nvml, watchdog_policy=WatchdogPolicy.KILL)
    uid = rig.add(pod("p", notes=binder_annotations(devices=rig.gpu0)))["metadata"]["uid"]
    rig.cgroups.add(leaf_of(uid))
    assert rig.step().converged
    result = rig.reconciler.view.results[(uid, "main")]
    assert (result.state.value, {m.value for m in result.mechanisms}) == (
        "applied", {"watchdog"})
    upgraded = rig.restarted(watchdog_policy=WatchdogPolicy.REPORT)
    upgraded.step()
    return upgraded, uid


def _running(rig: Rig, uid: str, pid: int, used: int, leaf: str | None = None) -> None:
    rig.proc_entry(pid, (leaf or leaf_of(uid))[len("/sys/fs/cgroup"):])
    rig.nvml.add_process(pid, rig.gpu0, used)


def _check(rig: Rig) -> None:
    rig.reconciler.check_usage()
    rig.reconciler.events.flush()


def _episodes(rig: Rig) -> float | None:
    return rig.agent.metrics.registry.get_sample_value(
        "kai_fractions_node_gpu_memory_limit_violations_total", {"node": NODE})


def test_a_running_container_is_refused_and_says_it_runs_without_a_cap(short_tmp: Path) -> None:
    rig, uid = _old_node(short_tmp)
    result = rig.reconciler.view.results[(uid, "main")]
    assert (result.state.value, result.reason) == ("refused", "MemoryLimitsUnsupported")
    assert result.message == RUNNING_REFUSED
    entry = marker_of(rig, uid)["containers"]["main"]
    assert (entry["state"], entry["reason"], entry["plan_digest"], entry["message"]) == (
        "refused", "MemoryLimitsUnsupported", result.plan_digest, result.message)
    assert result.plan_digest  # held to the plan it runs with
    assert _gate(rig, uid) is Outcome.FAIL  # its next sandbox does not start
    assert rig.cluster.event_reasons(uid) == ["Applied", "Refused"]
    rig.step()
    assert rig.cluster.event_reasons(uid) == ["Applied", "Refused"]  # one Refused


def test_the_watchdog_still_reports_a_running_container_over_its_cap(short_tmp: Path) -> None:
    rig, uid = _old_node(short_tmp)
    _running(rig, uid, 4242, 30 * GIB)
    for _ in range(3):
        _check(rig)
    assert rig.cluster.event_reasons(uid) == ["Applied", "Refused", "LimitViolation"]
    event = rig.cluster.events[-1]
    assert (event["type"], event["message"]) == (
        "Warning", f"container main of pod {uid} uses 30720 MiB of GPU memory on {rig.gpu0}, "
        "above its cap of 20480 MiB (pids 4242)")
    usage = rig.reconciler.view.usage
    assert {(k.pod_uid, k.container, gpu): u.used_bytes for (k, gpu), u in usage.items()} == {
        (uid, "main", rig.gpu0): 30 * GIB}
    assert _episodes(rig) == 1
    assert rig.killer.calls == []  # report: nothing stopped
    # the episode ends under the cap, and the next one is reported again; a pass between
    # checks changes nothing
    rig.nvml.remove_process(4242)
    _check(rig)
    rig.step()
    _running(rig, uid, 4243, 21 * GIB)
    _check(rig)
    assert rig.cluster.event_reasons(uid) == [
        "Applied", "Refused", "LimitViolation", "LimitViolation"]
    assert _episodes(rig) == 2
    assert rig.killer.calls == []
    assert marker_of(rig, uid)["containers"]["main"]["state"] == "refused"


def test_a_container_new_after_the_upgrade_is_refused_and_not_watched(short_tmp: Path) -> None:
    rig, _uid = _old_node(short_tmp)
    new = rig.add(pod("q", notes=binder_annotations(devices=rig.gpu0), container_id=CID_NEW)
                  )["metadata"]["uid"]
    rig.cgroups.add(f"{slice_of(new)}/{LEAF_NEW}")
    rig.step()
    result = rig.reconciler.view.results[(new, "main")]
    assert (result.state.value, result.reason, result.plan_digest) == (
        "refused", "MemoryLimitsUnsupported", None)
    assert "(the container would run without a cap)" in result.message
    assert "started before" not in result.message
    _running(rig, new, 4244, 30 * GIB, leaf=f"{slice_of(new)}/{LEAF_NEW}")
    _check(rig)
    assert rig.cluster.event_reasons(new) == ["Refused"]
    assert all(k.pod_uid != new for k, _gpu in rig.reconciler.view.usage)
    assert rig.killer.calls == []


def test_a_kill_policy_still_caps_such_a_container(short_tmp: Path) -> None:
    rig, uid = _old_node(short_tmp)
    fixed = rig.restarted(watchdog_policy=WatchdogPolicy.KILL)  # the operator sets kill
    assert fixed.step().converged
    result = fixed.reconciler.view.results[(uid, "main")]
    assert (result.state.value, {m.value for m in result.mechanisms}) == (
        "applied", {"watchdog"})
    _running(fixed, uid, 4242, 30 * GIB)
    _check(fixed)
    assert fixed.killer.calls == [4242]
    assert "LimitViolation" not in fixed.cluster.event_reasons(uid)


def test_a_watched_container_is_measured_in_the_metrics_and_get_node_state(
        short_tmp: Path) -> None:
    """Its usage and violations are in the per-container series (as before the upgrade), and
    GetNodeState says what it uses, beside its refusal."""
    from prometheus_client import generate_latest

    from kai_fractions.api.v1 import node_pb2
    from kai_fractions.node.agent.grpc_service import node_state

    rig, uid = _old_node(short_tmp)
    _running(rig, uid, 4242, 30 * GIB)
    _check(rig)
    rig.step()  # the metrics are set from the view a pass leaves
    text = generate_latest(rig.reconciler.metrics.registry).decode()
    used = [line for line in text.splitlines()
            if line.startswith("kai_fractions_container_gpu_memory_used_bytes{")
            and f'pod_uuid="{uid}"' in line]
    assert len(used) == 1 and float(used[0].rsplit(" ", 1)[1]) == 30 * GIB, used
    violations = [line for line in text.splitlines()
                  if line.startswith("kai_fractions_container_gpu_memory_limit_violations_total{")
                  and f'pod_uuid="{uid}"' in line]
    assert len(violations) == 1 and float(violations[0].rsplit(" ", 1)[1]) == 1, violations
    [a] = [a for a in node_state(rig.reconciler.view, NODE, None, "Ready").allocations
           if a.pod.uid == uid]
    assert (a.state, a.reason, a.memory_used_bytes) == (
        node_pb2.ALLOCATION_STATE_REFUSED, "MemoryLimitsUnsupported", 30 * GIB)
