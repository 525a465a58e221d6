"""The watchdog's checks as the agent runs them, where it used to see nothing or say nothing: a
workload's cgroup seen from the agent's own cgroup namespace, a process whose container cannot
be told, a GPU whose processes cannot be listed for one check, and a kill-mode stop that
cannot proceed."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kai_fractions.node.mps.errors import MpsError

from .builders import GIB, Rig, binder_annotations
from .test_reconcile import _running, add_pod

CID_HEX = "a" * 64
"""The container ID of `builders.CID`, as its cgroup names it."""


def sample(rig: Rig, name: str, **labels: str) -> float | None:
    return rig.agent.metrics.registry.get_sample_value(name, labels)


def container_labels(rig: Rig, uid: str) -> dict[str, str]:
    return {"node": "node-a", "namespace": "default", "pod": "p", "pod_uuid": uid,
            "container": "main", "gpu_uuid": rig.gpu0, "gpu": "0"}


def blind(rig: Rig, gpu: str, reason: str) -> float | None:
    return sample(rig, "kai_fractions_agent_gpu_usage_unreadable_total", node="node-a",
                  gpu_uuid=gpu, reason=reason)


def test_a_cgroupfs_workload_seen_from_the_agents_cgroup_namespace_is_stopped(
        short_tmp: Path) -> None:
    """`privileged: false` on cgroup v2: containerd gives the agent a cgroup namespace of its
    own, and on a cgroupfs-driver node /proc shows `/../../pod<uid>/<id>`: every GPU process
    was no pod's, and a container 50 GiB over its cap was neither stopped nor reported."""
    rig = Rig(short_tmp, sm_sharing=False, watchdog_policy="kill")
    uid = add_pod(rig)
    rig.step()
    rig.proc_entry(4242, f"/../../pod{uid}/{CID_HEX}")
    rig.nvml.add_process(4242, rig.gpu0, 70 * GIB)
    rig.reconciler.check_usage()
    assert rig.killer.killed == [4242]
    assert rig.cluster.event_reasons(uid) == ["Applied", "LimitEnforced"]
    assert sample(rig, "kai_fractions_container_gpu_memory_used_bytes",
                  **container_labels(rig, uid)) == 70 * GIB


def test_a_process_whose_container_cannot_be_told_counts_the_watchdog_blind(
        short_tmp: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A pod-shaped cgroup path relative to the agent's namespace that names no pod it can
    place may be a managed container's: read as no pod's, the watchdog was blind there and
    nothing said so. Counted every check on a GPU with managed containers, logged when it
    starts and ends."""
    rig = Rig(short_tmp, sm_sharing=False, watchdog_policy="kill")
    uid = add_pod(rig)
    rig.step()
    rig.proc_entry(4242, f"/../../../../custom-root/pod{uid}/{CID_HEX}")
    rig.nvml.add_process(4242, rig.gpu0, 30 * GIB)
    rig.proc_entry(4343, f"/../../../../custom-root/pod{uid}/{'b' * 64}")
    rig.nvml.add_process(4343, rig.gpu1, 30 * GIB)  # no managed container on GPU 1
    rig.proc_entry(4444, "/../../../../system.slice/some-daemon.service")
    rig.nvml.add_process(4444, rig.gpu0, GIB)  # a host process: no pod's, and said so
    rig.proc_entry(4545, "/../../../../runtime.slice/containerd.service")
    rig.nvml.add_process(4545, rig.gpu0, GIB)  # EKS AL2023's runtime: the host's too
    with caplog.at_level(logging.INFO, logger="kai_fractions.node.agent.usage"):
        rig.reconciler.check_usage()
        rig.reconciler.check_usage()
        rig.nvml.remove_process(4242)
        rig.reconciler.check_usage()
    assert blind(rig, rig.gpu0, "ProcessContainerUnknown") == 2
    assert blind(rig, rig.gpu1, "ProcessContainerUnknown") is None
    assert rig.killer.calls == [] and rig.cluster.event_reasons(uid) == ["Applied"]
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", f"GPU {rig.gpu0} runs 1 process(es) whose container the agent cannot tell "
                    f"(pid 4242: its cgroup /../../../../custom-root/pod{uid}/{CID_HEX} is "
                    "relative to the "
                    "agent's cgroup namespace and names no pod the agent can place): the "
                    "watchdog counts their memory for no container until it can"),
        ("INFO", f"the container of every process on GPU {rig.gpu0} can be told again")]


def test_a_failed_listing_neither_ends_nor_starts_a_violation_episode(
        short_tmp: Path) -> None:
    """One check that could not list the GPU's processes read the container's use as 0: its
    episode ended, and the next check started another (a second LimitViolation, a second
    episode counted) although the process never stopped using 25 GiB."""
    rig = Rig(short_tmp, sm_sharing=False)
    uid = add_pod(rig)
    rig.step()
    _running(rig, uid, 4242, 25 * GIB)
    rig.reconciler.check_usage()
    labels = container_labels(rig, uid)
    episodes = "kai_fractions_container_gpu_memory_limit_violations_total"
    rig.nvml.fail("running_processes", "Unknown", times=1, device=rig.gpu0)
    rig.reconciler.check_usage()
    # unknown there: read 0 as while NVML is down, and counted as a blind check
    assert sample(rig, "kai_fractions_container_gpu_memory_used_bytes", **labels) == 0
    assert rig.reconciler.view.usage.keys() == set()
    assert blind(rig, rig.gpu0, "NVMLError") == 1
    rig.reconciler.check_usage()
    assert sample(rig, "kai_fractions_container_gpu_memory_used_bytes", **labels) == 25 * GIB
    assert rig.cluster.event_reasons(uid) == ["Applied", "LimitViolation"]
    assert sample(rig, episodes, **labels) == 1
    assert sample(rig, "kai_fractions_node_gpu_memory_limit_violations_total",
                  node="node-a") == 1
    # a listed GPU still ends the episode, and the next one is a new one
    rig.nvml.remove_process(4242)
    rig.reconciler.check_usage()
    _running(rig, uid, 4243, 25 * GIB)
    rig.reconciler.check_usage()
    assert rig.cluster.event_reasons(uid) == ["Applied", "LimitViolation", "LimitViolation"]
    assert sample(rig, episodes, **labels) == 2


def stops_failed(rig: Rig, step: str) -> float | None:
    return sample(rig, "kai_fractions_node_gpu_memory_limit_stops_failed_total",
                  node="node-a", step=step)


def test_a_stop_that_cannot_proceed_is_told_to_the_pod_once_per_episode(
        short_tmp: Path) -> None:
    """Kill mode: an sm-sharing container over its cap whose drain fails (MPS does not answer)
    is not stopped, check after check; only the agent's log said so."""
    rig = Rig(short_tmp, watchdog_policy="kill")
    uid = add_pod(rig, notes=binder_annotations(devices=rig.gpu0, mode="sm-sharing"))
    rig.step()
    (name,) = rig.mps.control.namespaces
    _running(rig, uid, 4242, 25 * GIB)
    rig.mps.control.attach_client(4242, name)
    assert (stops_failed(rig, "drain"), stops_failed(rig, "terminate")) == (0, 0)
    for _ in range(5):
        rig.mps.control.inject("client_list", MpsError("MpsDaemonBusy", "busy"), times=1)
        rig.reconciler.check_usage()
    assert rig.killer.calls == []
    assert rig.cluster.event_reasons(uid) == ["Applied", "LimitViolation"]
    event = rig.cluster.events[-1]
    assert event["type"] == "Warning"
    assert event["message"] == (
        f"container main of pod {uid} uses 25600 MiB of GPU memory on {rig.gpu0}, above its "
        "cap of 20480 MiB (pids 4242); the watchdog (kill policy) could not stop it: pid "
        "4242: drain failed (MpsDaemonBusy: busy); it tries again at every check while the "
        "use stays over the cap")
    assert (stops_failed(rig, "drain"), stops_failed(rig, "terminate")) == (1, 0)
    rig.reconciler.check_usage()  # MPS answers again: drained, stopped
    assert rig.killer.killed == [4242] and rig.mps.control.terminated == [4242]
    assert rig.cluster.event_reasons(uid)[-1] == "LimitEnforced"
    rig.nvml.remove_process(4242)
    rig.reconciler.check_usage()  # the episode is over
    # the next episode: its terminate fails (the killer could not signal the process)
    rig.killer.outcome = "failed"
    _running(rig, uid, 4243, 25 * GIB)
    rig.reconciler.check_usage()
    rig.reconciler.check_usage()
    assert rig.cluster.event_reasons(uid) == [
        "Applied", "LimitViolation", "LimitEnforced", "LimitViolation"]
    assert "could not stop it: pid 4243: terminate failed;" in rig.cluster.events[-1]["message"]
    assert (stops_failed(rig, "drain"), stops_failed(rig, "terminate")) == (1, 1)


@pytest.mark.parametrize("cgroup", [
    "/../../../../runtime.slice/containerd.service",  # EKS AL2023
    "/../../../../system/ext-nvidia-persistenced",  # Talos
    "/../../../../docker/" + "d" * 64,  # Docker with the cgroupfs driver
    "/../cri-containerd-" + "b" * 64 + ".scope",  # a sibling of the agent's own container
])
def test_a_host_or_own_pod_process_outside_the_usual_host_cgroups_is_no_pods(
        short_tmp: Path, cgroup: str) -> None:
    """A GPU process of the host or of the agent's own pod names no pod-shaped cgroup, seen
    from the agent's cgroup namespace: it was counted as one whose container cannot be told
    (ProcessContainerUnknown, the chart's KaiFractionsWatchdogBlind) for as long as it ran."""
    rig = Rig(short_tmp, sm_sharing=False, watchdog_policy="kill")
    uid = add_pod(rig)
    rig.step()
    rig.proc_entry(4646, cgroup)
    rig.nvml.add_process(4646, rig.gpu0, 30 * GIB)
    rig.reconciler.check_usage()
    assert blind(rig, rig.gpu0, "ProcessContainerUnknown") is None
    assert rig.killer.calls == [] and rig.cluster.event_reasons(uid) == ["Applied"]
