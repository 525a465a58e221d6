"""A watchdog that cannot see a GPU where it is a container's only memory tier (a driver before
r615 without cgroup limits, time-slicing, --watchdog-policy=kill): the container's cap is not in
force there, and nothing may say it is.

Before: NVML refusing to list GPU 0's processes (NoPermission) left a new pod `Applied` with a
marker "limits in force: memory watchdog" (its gate released it; it used 70 GiB against a 20 GiB
cap and nothing stopped it), the node condition True, and GetNodeState `applied`, USED 0. Only
the usage-unreadable counter, a log warning and an alert 20 minutes later said otherwise.

Now such a container is pending `WatchdogBlind` (a not-in-force reason: no marker vouches for
it, a running pod's marker is set aside with one Warning per episode, `Applied` once the GPU is
seen again), the condition is False `WatchdogBlind` naming the GPU, and a container with
another tier in force there is unaffected."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from kai_fractions.gate.check import Outcome
from kai_fractions.node.agent.grpc_service import node_state
from kai_fractions.node.config import WatchdogPolicy
from kai_fractions.sim.nvml import FakeNvml

from .builders import GIB, NODE, Rig, binder_annotations, leaf_of, marker_of, pod
from .builders import gate_outcome as gate
from .builders import result_of as result

OLD_DRIVER = "550.54.15"
BLIND = "WatchdogBlind"


def old_node(tmp: Path, **config) -> Rig:
    nvml = FakeNvml.simulated(2, model="H100-80GB", seed=NODE, driver_version=OLD_DRIVER)
    config = {"sm_sharing": False, "watchdog_policy": WatchdogPolicy.KILL, **config}
    return Rig(tmp, nvml=nvml, **config)


def add(rig: Rig, name: str = "p", gpu: str | None = None, **notes: str) -> str:
    annotations = binder_annotations(devices=gpu or rig.gpu0, **notes)
    return rig.add(pod(name, notes=annotations))["metadata"]["uid"]


def running(rig: Rig, uid: str, pid: int, used: int | None, gpu: str | None = None) -> None:
    rig.proc_entry(pid, leaf_of(uid)[len("/sys/fs/cgroup"):])
    rig.nvml.add_process(pid, gpu or rig.gpu0, used)


def cap_series(rig: Rig, uid: str) -> dict[str, float]:
    """reason -> value of the container's kai_fractions_container_cap_not_in_force series."""
    out = {}
    for family in rig.agent.metrics.registry.collect():
        for s in family.samples:
            if s.name == "kai_fractions_container_cap_not_in_force" and \
                    s.labels["pod_uuid"] == uid:
                out[s.labels["reason"]] = s.value
    return out


def unknown_series(rig: Rig) -> dict[str, str]:
    """gpu uuid -> reason of kai_fractions_agent_gpu_usage_unknown."""
    return {s.labels["gpu_uuid"]: s.labels["reason"]
            for family in rig.agent.metrics.registry.collect() for s in family.samples
            if s.name == "kai_fractions_agent_gpu_usage_unknown" and s.value == 1}


def hide(rig: Rig, *pids: int) -> None:
    """NVML lists these pids no more, as for an agent outside the host's pid namespace."""
    listed = type(rig.nvml).running_processes

    def running_processes(uuid: str):
        return tuple(p for p in listed(rig.nvml, uuid) if p.pid not in pids)

    rig.nvml.running_processes = running_processes  # type: ignore[method-assign]


# -- a new pod -----------------------------------------------------------------------------------


def test_a_new_pod_waits_while_nvml_cannot_list_its_gpus_processes(short_tmp: Path) -> None:
    """The reviewer's probe: NoPermission on GPU 0 from the agent's start; the pod's gate was
    released by the agent's first pass, before any watchdog check ran."""
    rig = old_node(short_tmp)
    rig.nvml.fail("running_processes", "NoPermission", times=None, device=rig.gpu0)
    uid = add(rig)
    report = rig.step()
    assert not report.converged and BLIND in report.errors
    r = result(rig, uid)
    assert (r.state.value, r.reason, r.not_in_force, r.watchdog_blind) == (
        "pending", BLIND, True, True)
    assert r.message.startswith(f"usage unknown on GPU {rig.gpu0} (NVMLNoPermission): the "
                                "watchdog, this container's only GPU memory tier there")
    assert "cap of 20480 MiB is not in force" in r.message
    assert "hostPID: true" in r.message  # what to do, from NVML's own error
    assert marker_of(rig, uid) is None and gate(rig, uid) is Outcome.WAIT
    assert rig.cluster.event_reasons(uid) == []  # a new pod: its gate waits anyway
    assert cap_series(rig, uid) == {BLIND: 1}
    cond = rig.agent.condition()
    assert (cond.ready, cond.reason) == (False, BLIND)
    assert f"{rig.gpu0} (NVMLNoPermission)" in cond.message and rig.gpu1 not in cond.message
    # its workload runs anyway (an ungated pod, a gate of an older release): nothing stops it,
    # and nothing says it is capped
    running(rig, uid, 4242, 70 * GIB)
    for _ in range(3):
        rig.reconciler.check_usage()
    rig.step()
    assert rig.killer.calls == [] and marker_of(rig, uid) is None
    assert result(rig, uid).reason == BLIND
    # NVML lets the agent list them again: the watchdog stops the process over the cap at
    # once; the episode ends after two checks in a row that see the GPU, and the second asks
    # for a pass, which applies it
    rig.nvml.clear_failures()
    rig.reconciler.check_usage()
    assert rig.killer.calls == [4242]
    assert rig.reconciler.usage_needs_pass() is False
    rig.reconciler.check_usage()
    assert rig.reconciler.usage_needs_pass() is True
    assert rig.step().converged
    assert result(rig, uid).state.value == "applied" and gate(rig, uid) is Outcome.RELEASE
    assert rig.cluster.event_reasons(uid) == ["LimitEnforced", "Applied"]
    assert cap_series(rig, uid) == {}
    assert rig.agent.condition().reason == "AgentReady"


# -- a running pod -------------------------------------------------------------------------------


def test_a_running_pods_marker_is_set_aside_once_per_episode_and_written_again(
        short_tmp: Path, caplog: pytest.LogCaptureFixture) -> None:
    rig = old_node(short_tmp)
    uid = add(rig)
    assert rig.step().converged
    rig.reconciler.check_usage()
    assert rig.reconciler.usage_needs_pass() is False
    marker = marker_of(rig, uid)
    assert marker["containers"]["main"]["message"] == (
        "limits in force: memory watchdog; compute time-slicing")
    rig.nvml.fail("running_processes", "NoPermission", times=None, device=rig.gpu0)
    rig.reconciler.check_usage()
    assert rig.reconciler.usage_needs_pass() is True  # the condition within seconds
    with caplog.at_level(logging.WARNING, logger="kai_fractions.node.agent.markers"):
        rig.step()
        rig.reconciler.check_usage()
        rig.step()  # the same episode: nothing new
    assert marker_of(rig, uid) is None and gate(rig, uid) is Outcome.WAIT
    assert rig.cluster.event_reasons(uid) == ["Applied", BLIND]
    event = rig.cluster.events[-1]
    assert event["type"] == "Warning"
    assert event["message"].startswith(
        "container main: its GPU memory cap (the watchdog, its only memory tier there) is not "
        "in force, so its readiness marker is set aside (a gate of the pod waits; Applied "
        "follows once the watchdog's view of its GPU is back): WatchdogBlind: usage unknown on "
        f"GPU {rig.gpu0} (NVMLNoPermission): ")
    assert "hostPID" in event["message"] and len(event["message"]) < 1024
    assert [r.getMessage() for r in caplog.records
            if r.name == "kai_fractions.node.agent.markers"] == [
        "pod default/p: set aside its marker: the watchdog's GPU memory cap (its only memory "
        f"tier) is not in force for container main ({BLIND}) (the plan is unchanged; the marker "
        "is written again once the watchdog's view of its GPU is back)"]
    assert cap_series(rig, uid) == {BLIND: 1}
    assert unknown_series(rig) == {rig.gpu0: "NVMLNoPermission"}
    assert rig.agent.condition().reason == BLIND
    # listed again, twice in a row: Applied again, the marker back, the condition True
    rig.nvml.clear_failures()
    rig.reconciler.check_usage()
    assert not rig.reconciler.usage.news  # one check that sees it: the episode goes on
    rig.reconciler.check_usage()
    assert rig.reconciler.usage_needs_pass() is False  # within the 10 s gap: held back...
    assert rig.reconciler.usage.news  # ...not lost
    assert rig.step().converged
    assert marker_of(rig, uid)["containers"]["main"] == marker["containers"]["main"]
    assert rig.cluster.event_reasons(uid) == ["Applied", BLIND, "Applied"]
    assert cap_series(rig, uid) == {} and unknown_series(rig) == {}
    assert rig.agent.condition().reason == "AgentReady"


@pytest.mark.parametrize("kind", ["NoProcessesVisible", "ProcessMemoryUnknown",
                                  "ProcessContainerUnknown"])
def test_every_kind_of_blindness_is_not_in_force(short_tmp: Path, kind: str) -> None:
    """Each kind the usage check counts means the watchdog may miss the container over its
    cap: its processes unlisted (no hostPID), listed without their memory, or one it cannot
    place."""
    rig = old_node(short_tmp)
    uid = add(rig)
    assert rig.step().converged
    if kind == "NoProcessesVisible":
        running(rig, uid, 100, 5 * GIB)  # within its cap: only unseen
        hide(rig, 100)
    elif kind == "ProcessMemoryUnknown":
        running(rig, uid, 100, None)
    else:
        rig.proc_entry(100, f"/../../../../custom-root/pod{uid}/{'a' * 64}")
        rig.nvml.add_process(100, rig.gpu0, 5 * GIB)
    rig.reconciler.check_usage()
    assert rig.reconciler.usage_needs_pass() is True
    rig.step()
    r = result(rig, uid)
    assert (r.state.value, r.reason) == ("pending", BLIND)
    assert r.message.startswith(f"usage unknown on GPU {rig.gpu0} ({kind}): ")
    assert marker_of(rig, uid) is None
    assert rig.cluster.event_reasons(uid) == ["Applied", BLIND]
    cond = rig.agent.condition()
    assert (cond.ready, cond.reason) == (False, BLIND) and f"({kind})" in cond.message
    # seen again
    if kind == "NoProcessesVisible":
        del rig.nvml.running_processes
    else:
        rig.nvml.remove_process(100)
    rig.reconciler.check_usage()
    rig.step()
    assert marker_of(rig, uid) is None  # one check that sees it: the episode goes on
    rig.reconciler.check_usage()
    assert rig.step().converged and marker_of(rig, uid) is not None
    assert rig.cluster.event_reasons(uid) == ["Applied", BLIND, "Applied"]


# -- what is not affected ----------------------------------------------------------------------


@pytest.mark.parametrize("tier", ["cgroup", "mps-pinned"])
def test_a_container_with_another_tier_in_force_keeps_its_marker(short_tmp: Path,
                                                                  tier: str) -> None:
    """cgroup limits (r615 and newer), or the MPS pinned limit (sm-sharing in an MPS namespace
    of its own, no cgroup limits), cap the container whatever the watchdog sees: only its usage
    is unknown. (Without namespaces the pinned limit is no tier: test_mps_pinned_legacy_tier.)"""
    if tier == "cgroup":
        rig = Rig(short_tmp, sm_sharing=False, watchdog_policy=WatchdogPolicy.KILL)
        uid = add(rig)
    else:
        rig = old_node(short_tmp, sm_sharing=True, mps_v3=True)
        uid = add(rig, mode="sm-sharing")
    assert rig.step().converged
    assert {m.value for m in result(rig, uid).mechanisms} == {tier, "watchdog"}
    rig.nvml.fail("running_processes", "NoPermission", times=None, device=rig.gpu0)
    rig.reconciler.check_usage()
    assert rig.step().converged
    assert result(rig, uid).state.value == "applied" and gate(rig, uid) is Outcome.RELEASE
    assert rig.cluster.event_reasons(uid) == ["Applied"]
    # the condition: on the old driver a time-slicing pod placed on GPU 0 now would have the
    # watchdog alone, and wait
    assert rig.agent.condition().reason == ("AgentReady" if tier == "cgroup" else BLIND)
    assert unknown_series(rig) == {rig.gpu0: "NVMLNoPermission"}
    # GetNodeState says its usage is not known (memory_used_bytes reads 0)
    (a,) = node_state(rig.reconciler.view, NODE, None, "c").allocations
    assert a.state == 2 and a.memory_used_bytes == 0
    assert f"usage unknown on GPU {rig.gpu0} (NVMLNoPermission): " in a.message


def test_a_blind_gpu_without_a_container_keeps_the_others_applied_and_the_node_says_so(
        short_tmp: Path) -> None:
    """The condition says so before a pod is placed there (KAI would place one, which would
    wait), not only once one is; a container on a GPU the watchdog sees stays applied."""
    rig = old_node(short_tmp)
    uid = add(rig)  # on GPU 0
    assert rig.step().converged
    rig.nvml.fail("running_processes", "NoPermission", times=None, device=rig.gpu1)
    rig.reconciler.check_usage()
    assert rig.reconciler.usage_needs_pass() is True
    assert rig.step().converged
    assert result(rig, uid).state.value == "applied" and gate(rig, uid) is Outcome.RELEASE
    assert unknown_series(rig) == {rig.gpu1: "NVMLNoPermission"}
    cond = rig.agent.condition()
    assert (cond.ready, cond.reason) == (False, BLIND)
    assert f"{rig.gpu1} (NVMLNoPermission)" in cond.message and rig.gpu0 not in cond.message
    # a pod placed there waits, and the condition stays as it was
    other = add(rig, "q", gpu=rig.gpu1, request="5Gi", limit="10Gi")
    rig.step()
    assert result(rig, other).reason == BLIND and result(rig, uid).state.value == "applied"
    assert rig.agent.condition() == cond


# -- passes that do not settle -------------------------------------------------------------------


def test_while_nvml_is_down_no_marker_vouches_for_a_watchdog_only_cap(short_tmp: Path) -> None:
    """No watchdog check runs without NVML: the watchdog-only pod's marker went aside; a pod
    with cgroup limits (kept by the kernel) keeps its own."""
    rig = old_node(short_tmp)
    uid = add(rig)
    assert rig.step().converged
    rig.reconciler.check_usage()
    rig.nvml.fail("driver_version", "DriverNotLoaded", times=None)
    rig.step()
    assert marker_of(rig, uid) is None and gate(rig, uid) is Outcome.WAIT
    rig.nvml.clear_failures()
    assert rig.step().converged and gate(rig, uid) is Outcome.RELEASE

    (short_tmp / "r615").mkdir()
    limited = Rig(short_tmp / "r615", sm_sharing=False, watchdog_policy=WatchdogPolicy.KILL)
    kept = add(limited)
    assert limited.step().converged
    limited.nvml.fail("driver_version", "DriverNotLoaded", times=None)
    limited.step()
    assert marker_of(limited, kept) is not None


def test_a_pass_that_returns_before_it_settles_sets_a_blind_watchdogs_marker_aside(
        short_tmp: Path) -> None:
    rig = old_node(short_tmp)
    uid = add(rig)
    assert rig.step().converged
    rig.reconciler.check_usage()
    rig.nvml.fail("running_processes", "NoPermission", times=None, device=rig.gpu0)
    rig.reconciler.check_usage()
    rig.reconciler.pods.cache.synced = False  # the pods not listed (a watch cache gone)
    rig.reconciler.reconcile()
    assert marker_of(rig, uid) is None and gate(rig, uid) is Outcome.WAIT


# -- the hint ---------------------------------------------------------------------------------


def test_nvmls_no_permission_to_list_processes_says_what_that_call_needs(
        short_tmp: Path) -> None:
    rig = old_node(short_tmp)
    rig.nvml.fail("running_processes", "NoPermission", times=1, device=rig.gpu0)
    with pytest.raises(Exception) as e:
        rig.nvml.running_processes(rig.gpu0)
    text = str(e.value)
    assert "hostPID: true" in text and "query other users' GPU processes" in text
    assert "set GPU memory limits and compute modes" not in text
    rig.nvml.fail("set_compute_mode", "NoPermission", times=1, device=rig.gpu0)
    with pytest.raises(Exception) as e:
        rig.nvml.set_compute_mode(rig.gpu0, rig.nvml.gpus[0].compute_mode)
    assert "privileged container to set GPU memory limits and compute modes" in str(e.value)


def test_the_metrics_text_names_the_reason(short_tmp: Path) -> None:
    rig = old_node(short_tmp)
    rig.nvml.fail("running_processes", "Unknown", times=None, device=rig.gpu0)
    add(rig)
    rig.step()
    text = generate_latest(rig.agent.metrics.registry).decode()
    assert 'kai_fractions_container_cap_not_in_force{' in text
    assert 'reason="WatchdogBlind"' in text
    assert (f'kai_fractions_agent_gpu_usage_unknown{{gpu_uuid="{rig.gpu0}",node="node-a",'
            'reason="NVMLError"} 1.0') in text
    assert 'kai_fractions_node_ready{node="node-a",reason="WatchdogBlind"} 0.0' in text
