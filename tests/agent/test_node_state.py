"""GetNodeState of a container whose applied plan is held while its pod's annotations ask for
another (`PlanChangeRefused`): the plan in force and the refusal's reason, and what
`kai-fractions inspect` makes of them."""

from __future__ import annotations

import copy
from pathlib import Path

from kai_fractions.api.v1 import node_pb2
from kai_fractions.inspect.model import pod_report
from kai_fractions.inspect.sources import from_node_state
from kai_fractions.node.agent.grpc_service import node_state
from kai_fractions.node.config import WatchdogPolicy

from .builders import GIB, LEAF, Rig, binder_annotations, pod, slice_of

LIMIT = "nvidia.com/container.main.gpu-memory.limit"


def _held(short_tmp: Path, limit: str = "32Gi") -> tuple[Rig, str]:
    """A running pod whose limit annotation was changed 20Gi -> `limit` after it was applied."""
    rig = Rig(short_tmp, sm_sharing=False)
    uid = rig.add(pod("p", notes=binder_annotations(devices=rig.gpu0)))["metadata"]["uid"]
    rig.cgroups.add(f"{slice_of(uid)}/{LEAF}")
    assert rig.step().converged
    meta = copy.deepcopy(rig.cluster.pods[uid]["metadata"])
    meta["annotations"][LIMIT] = limit
    rig.cluster.update_pod(uid, metadata=meta)
    assert rig.step().converged
    return rig, uid


def test_a_held_plan_carries_the_refusal_of_its_change(short_tmp: Path) -> None:
    rig, _ = _held(short_tmp)
    [a] = node_state(rig.reconciler.view, "node-a", None, "Ready").allocations
    assert (a.state, a.memory_limit_bytes) == (node_pb2.ALLOCATION_STATE_APPLIED, 20 * GIB)
    assert a.change_refused_reason == "PlanChangeRefused"
    assert "memory limit 20480 MiB -> 32768 MiB" in a.change_refused_message
    assert "stays in force until the pod is recreated" in a.change_refused_message


def test_an_unchanged_plan_has_no_refused_change(short_tmp: Path) -> None:
    rig = Rig(short_tmp, sm_sharing=False)
    uid = rig.add(pod("p", notes=binder_annotations(devices=rig.gpu0)))["metadata"]["uid"]
    rig.cgroups.add(f"{slice_of(uid)}/{LEAF}")
    assert rig.step().converged
    [a] = node_state(rig.reconciler.view, "node-a", None, "Ready").allocations
    assert (a.change_refused_reason, a.change_refused_message) == ("", "")


def test_inspect_shows_the_limit_in_force_and_why_the_edit_is_not(short_tmp: Path) -> None:
    """Inspect showed the edited 32 GiB limit as enforced while 20 GiB stayed in force."""
    rig, uid = _held(short_tmp)
    agent = from_node_state(node_state(rig.reconciler.view, "node-a", None, "Ready"), "socket")
    [row] = pod_report(rig.cluster.pods[uid], None, agent).rows
    assert (row.state, row.gpu_uuid, row.request_bytes, row.limit_bytes) == (
        "enforced", rig.gpu0, 10 * GIB, 20 * GIB)
    [warning] = row.warnings
    assert warning.startswith("PlanChangeRefused: the pod's GPU annotations changed after")


def test_inspect_keeps_an_applied_container_edited_invalid_enforced(short_tmp: Path) -> None:
    """A limit edited below the request showed `invalid` with the edited 4 GiB limit, and
    dropped from the GPU's requested, while the agent kept 20 GiB in force."""
    rig, uid = _held(short_tmp, limit="4Gi")
    agent = from_node_state(node_state(rig.reconciler.view, "node-a", None, "Ready"), "socket")
    [a] = agent.allocations
    assert (a.state, a.change_reason) == ("applied", "PlanChangeRefused")
    report = pod_report(rig.cluster.pods[uid], None, agent)
    [gpu] = report.gpus
    [row] = gpu.rows
    assert (row.state, row.request_bytes, row.limit_bytes, row.accounted) == (
        "enforced", 10 * GIB, 20 * GIB, True)
    assert gpu.requested_bytes == 10 * GIB
    assert [w.split(":")[0] for w in row.warnings] == ["PlanChangeRefused"]


def test_inspect_shows_a_watchdog_only_cap_and_usage_over_it(short_tmp: Path) -> None:
    """Memory caps held only by the watchdog showed as plain "enforced", even with the
    container over its limit (only a kill watchdog holds a cap alone: a report one is no tier,
    its container refused)."""
    rig = Rig(short_tmp, sm_sharing=False, memory_enforcement="watchdog",
              watchdog_policy=WatchdogPolicy.KILL)
    uid = rig.add(pod("p", notes=binder_annotations(devices=rig.gpu0)))["metadata"]["uid"]
    rig.cgroups.add(f"{slice_of(uid)}/{LEAF}")
    assert rig.step().converged
    rig.proc_entry(4242, f"{slice_of(uid)}/{LEAF}"[len("/sys/fs/cgroup"):])
    rig.nvml.add_process(4242, rig.gpu0, 30 * GIB)
    rig.reconciler.check_usage()
    agent = from_node_state(node_state(rig.reconciler.view, "node-a", None, "Ready"), "socket")
    [row] = pod_report(rig.cluster.pods[uid], None, agent).rows
    assert (row.state, row.tier, row.used_bytes) == ("enforced", "watchdog", 30 * GIB)
    assert row.warnings[0].startswith(
        f"OverLimit: uses 30720 MiB on {rig.gpu0}, above its limit of 20480 MiB: only the "
        "watchdog holds this cap")


def test_a_watchdog_is_a_limit_in_force_only_when_it_stops() -> None:
    """GetNodeState lists the limits in force; its proto says a watchdog's is one where "a
    process over the hard limit is stopped": in report mode it stops nothing, so it is not
    listed beside the cgroup limit it backs up."""
    import tempfile

    def mechanisms(**config) -> list[str]:
        with tempfile.TemporaryDirectory(prefix="kfw", dir="/tmp") as tmp:
            rig = Rig(Path(tmp), sm_sharing=False, **config)
            rig.add(pod("p", notes=binder_annotations(devices=rig.gpu0)))
            assert rig.step().converged
            [a] = node_state(rig.reconciler.view, "node-a", None, "Ready").allocations
            assert a.state == node_pb2.ALLOCATION_STATE_APPLIED
            return sorted({limit.mechanism for limit in a.applied_limits})

    assert mechanisms() == ["cgroup"]  # report (the default) beside cgroup
    assert mechanisms(watchdog_policy=WatchdogPolicy.KILL) == ["cgroup", "watchdog"]
    assert mechanisms(memory_enforcement="watchdog",
                      watchdog_policy=WatchdogPolicy.KILL) == ["watchdog"]
