"""The inspect report, pure: numbers from the pods' annotations, state from agent and gate."""

from __future__ import annotations

from types import MappingProxyType

import pytest

from kai_fractions.contract import ComputeMode, Dialect, mps_namespace_name
from kai_fractions.inspect.agent_state import (
    AgentAllocation,
    AgentCondition,
    AgentDevice,
    AgentState,
    unreachable,
)
from kai_fractions.inspect.model import GATE_ONLY, gate_state, node_report, pod_report

from .pods import GPU0, GPU1, MIB, NODE, bind, gate_status, memory_pod, node, pod

UID_A = "aaaaaaaa-0000-4000-8000-000000000001"
UID_B = "bbbbbbbb-0000-4000-8000-000000000002"
AGENT_DOWN = unreachable("none", "give --agent-socket PATH (on the node) or --agent-metrics URL")


def test_a_released_pod_is_enforced_with_its_planned_numbers():
    p = gate_status(bind(memory_pod("train", UID_A, "8Gi", "12Gi"), (GPU0,)), exit_code=0,
                    message="limits applied: main sha256:x")
    report = node_report(NODE, node(), [p], AGENT_DOWN)
    [gpu] = report.gpus
    assert gpu.uuid == GPU0 and gpu.memory_bytes == 40960 * MIB and gpu.index is None
    [row] = gpu.rows
    assert (row.ref, row.mode, row.request_bytes, row.limit_bytes, row.active_thread_percentage,
            row.state, row.reason, row.message, row.used_bytes, row.state_source) == (
        "team-a/train/main", "time-slicing", 8192 * MIB, 12288 * MIB, None, "enforced",
        "", "limits applied: main sha256:x", None, "gate")
    assert report.notes == ("used: n/a (agent not reachable: give --agent-socket PATH (on the "
                            "node) or --agent-metrics URL)", GATE_ONLY)


@pytest.mark.parametrize(("dialect", "atp"), [
    (Dialect.PATCHED, 50),    # its compute portion: 20480 of 40960 MiB
    (Dialect.UPSTREAM, 100),  # no compute portion: no compute cap
])
def test_sm_sharing_gets_its_active_thread_percentage(dialect, atp):
    p = bind(memory_pod("srv", UID_A, "20480Mi", mode=ComputeMode.SM_SHARING), (GPU1,),
             dialect=dialect)
    [row] = node_report(NODE, node(), [p], None).rows
    assert (row.mode, row.request_bytes, row.active_thread_percentage) == (
        "sm-sharing", 20480 * MIB, atp)


def test_an_sm_sharing_row_names_its_mps_namespace():
    """What `nvidia-cuda-mps-control` lists: the admission webhook's name, else the UID's."""
    p = bind(memory_pod("srv", UID_A, "20480Mi", mode=ComputeMode.SM_SHARING), (GPU1,))
    [row] = node_report(NODE, node(), [p], None).rows
    assert row.mps_namespace == mps_namespace_name(UID_A, "main")
    p["metadata"]["annotations"]["kai-fractions.io/container.main.mps-namespace"] = (
        "kf_" + "5a" * 10)
    [row] = node_report(NODE, node(), [p], None).rows
    assert row.to_dict()["mps_namespace"] == "kf_" + "5a" * 10


def test_gate_states_waiting_failed_and_no_gate():
    bound = bind(memory_pod("a", UID_A), (GPU0,))
    waiting = gate_status(bound, exit_code=None, running=True)
    failed = gate_status(bound, exit_code=1, message="container 'main' refused by the node "
                         "agent: SmSharingDisabled: no MPS here")
    ungated = bind(memory_pod("a", UID_A, gate=False), (GPU0,))

    def state(p):
        [row] = node_report(NODE, node(), [p], None).rows
        return row.state, row.reason, row.message

    assert state(waiting) == ("waiting", "GateWaiting",
                              "the gate waits for the node agent to apply the limits")
    assert state(failed) == ("refused", "GateFailed", "container 'main' refused by the node "
                             "agent: SmSharingDisabled: no MPS here")
    assert state(bound) == ("pending", "", "waiting for the node agent")
    assert state(ungated)[:2] == ("ungated", "NoGate")


def test_a_gate_that_runs_again_is_waiting_whatever_its_last_run_said():
    """After a node reboot or a new sandbox the gate runs again: its last run's exit 0 says
    nothing of the limits now (they went with the reboot); a retry is waiting, not failed."""

    def gate(state: dict, last: dict | None = None) -> dict:
        status = {"name": "kai-fractions-gate", "state": state}
        if last is not None:
            status["lastState"] = {"terminated": last}
        return {"status": {"initContainerStatuses": [status]}}

    released, failed = {"exitCode": 0}, {"exitCode": 1, "message": "timed out"}
    assert gate_state(gate({"running": {}}, released))[:2] == ("waiting", "GateWaiting")
    assert gate_state(gate({"running": {}}, failed))[:2] == ("waiting", "GateWaiting")
    assert gate_state(gate({"waiting": {"reason": "PodInitializing"}}, released))[:2] == (
        "waiting", "GateWaiting")
    assert gate_state(gate({"waiting": {"reason": "CrashLoopBackOff"}}, failed)) == (
        "refused", "GateFailed", "timed out")
    assert gate_state(gate({"terminated": released}))[:2] == ("enforced", "")


def test_unbound_pods_are_unplaced_with_the_schedulers_reason():
    plain = memory_pod("later", UID_A)
    refused = {**memory_pod("never", UID_B), "status": {"conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
         "message": "0/2 GPUs fit"}]}}
    fraction = pod("frac", {"gpu-fraction": "0.5", "gpu-fraction-num-devices": "2"})
    report = node_report(NODE, node(), [plain, refused, fraction], None)
    assert report.gpus == ()
    got = {(r.pod, r.state, r.reason, r.message, r.portion, r.device_count)
           for r in report.unplaced}
    assert got == {("later", "unscheduled", "NotBound", "not bound to a node yet", "", 1),
                   ("never", "unscheduled", "Unschedulable", "0/2 GPUs fit", "", 1),
                   ("frac", "unscheduled", "NotBound", "not bound to a node yet", "0.5", 2)}


def test_the_agent_state_wins_over_the_gate_but_not_over_a_failed_gate():
    released = gate_status(bind(memory_pod("a", UID_A), (GPU0,)), exit_code=0)
    failed = gate_status(bind(memory_pod("b", UID_B), (GPU0,)), exit_code=1, message="digest")
    agent = AgentState(source="socket unix:///x", allocations=(
        AgentAllocation("team-a", "a", "main", UID_A, "refused", "MemoryOvercommitted",
                        "too much", used_bytes=None),
        AgentAllocation("team-a", "b", "main", UID_B, "applied", used_bytes=5 * MIB),
    ))
    rows = {r.pod: r for r in node_report(NODE, node(), [released, failed], agent).rows}
    assert (rows["a"].state, rows["a"].reason, rows["a"].message) == (
        "refused", "MemoryOvercommitted", "too much")
    assert (rows["b"].state, rows["b"].reason, rows["b"].used_bytes) == (
        "refused", "GateFailed", 5 * MIB)


def test_used_memory_per_gpu_and_devices_from_the_agent():
    multi = bind(pod("m", {"gpu-fraction": "0.5", "gpu-fraction-num-devices": "2"}, uid=UID_A),
                 (GPU0, GPU1), portion="0.5")
    agent = AgentState(
        source="metrics http://x/metrics",
        devices=(AgentDevice(1, GPU1, "NVIDIA A100", 40960 * MIB, "Default"),
                 AgentDevice(0, GPU0, "NVIDIA A100", 40960 * MIB, "Default"),
                 AgentDevice(2, "GPU-idle", "NVIDIA A100", 40960 * MIB, "Default")),
        allocations=(AgentAllocation("team-a", "m", "main", used_bytes=3 * MIB,
                                     used_by_gpu=MappingProxyType({GPU0: MIB, GPU1: 2 * MIB})),))
    report = node_report(NODE, node(), [multi], agent)
    assert [(g.index, g.uuid, len(g.rows)) for g in report.gpus] == [
        (0, GPU0, 1), (1, GPU1, 1), (2, "GPU-idle", 0)]
    assert [r.used_bytes for r in report.rows] == [MIB, 2 * MIB]
    assert [r.request_bytes for r in report.rows] == [20480 * MIB, 20480 * MIB]
    assert report.gpus[0].requested_bytes == 20480 * MIB


def test_a_multi_device_container_without_per_gpu_usage_shows_none():
    multi = bind(pod("m", {"gpu-fraction": "0.5", "gpu-fraction-num-devices": "2"}, uid=UID_A),
                 (GPU0, GPU1), portion="0.5")
    agent = AgentState(source="socket", allocations=(
        AgentAllocation("team-a", "m", "main", UID_A, "applied", used_bytes=3 * MIB),))
    assert [r.used_bytes for r in node_report(NODE, node(), [multi], agent).rows] == [None, None]


def test_contract_errors_show_as_invalid():
    bad = pod("bad", {"nvidia.com/container.main.gpu-memory.request": "8Gi",
                      "nvidia.com/container.main.gpu-memory.limit": "4Gi"})
    [row] = node_report(NODE, node(), [bad], None).unplaced
    assert (row.state, row.reason) == ("invalid", "ContractInvalid")
    assert row.message == ("nvidia.com/container.main.gpu-memory.limit: must be greater than or "
                           "equal to the request '8Gi' (got '4Gi')")


def test_notes_for_a_missing_label_and_a_false_condition():
    n = node(labels={}, conditions=[{"type": "gpu-fractioning.nvidia.com/Ready",
                                     "status": "False", "reason": "DriverTooOld",
                                     "message": "driver 550 has no memory limits"}])
    report = node_report(NODE, n, [], None)
    assert report.gpu_memory_label is None
    assert report.condition == ("gpu-fractioning.nvidia.com/Ready", "False", "DriverTooOld",
                                "driver 550 has no memory limits")
    assert report.notes == (
        "node gpu-node-1 has no nvidia.com/gpu.memory label: the mirror and KAI's binder cannot "
        "turn portions into memory for it (GPU feature discovery publishes it; the node agent "
        "does with --publish-gpu-memory-label)",
        "gpu-fractioning.nvidia.com/Ready is False: DriverTooOld: driver 550 has no memory "
        "limits")
    no_condition = node_report(NODE, node(conditions=[]), [], None)
    assert no_condition.notes == ("node gpu-node-1 has no gpu-fractioning.nvidia.com/Ready "
                                  "condition: no node agent has reported from it",)


def test_pod_report_of_a_pod_without_a_fraction():
    plain = pod("web", {})
    report = pod_report(plain, None, None)
    assert report.title == "pod team-a/web"
    assert report.rows == () and report.notes == ("the pod requests no GPU fraction",)


def test_pod_report_lists_only_that_pods_gpus():
    p = bind(memory_pod("a", UID_A), (GPU1,))
    agent = AgentState(source="socket", devices=(
        AgentDevice(0, GPU0, "A", 1, "Default"), AgentDevice(1, GPU1, "A", 1, "Default")))
    report = pod_report(p, node(), agent)
    assert [g.uuid for g in report.gpus] == [GPU1]
    assert report.node == NODE


def test_the_heartbeat_is_the_later_of_the_lease_and_the_condition() -> None:
    from kai_fractions.inspect.model import Heartbeat, heartbeat

    now = 1_800_000_000.0  # 2027-01-15T08:00:00Z
    cond = {"type": "gpu-fractioning.nvidia.com/Ready", "status": "True",
            "lastHeartbeatTime": "2027-01-15T07:55:00Z"}  # 300 s before now
    n = {"status": {"conditions": [cond]}}
    lease = {"spec": {"renewTime": "2027-01-15T07:59:30.000000Z"}}  # 30 s
    assert heartbeat(n, cond["type"], lease, "kf/x", now) == Heartbeat(30.0, "lease kf/x")
    old = {"spec": {"renewTime": "2027-01-15T07:50:00.000000Z"}}  # older than the condition
    assert heartbeat(n, cond["type"], old, "kf/x", now) == Heartbeat(300.0, "condition")
    assert heartbeat(n, cond["type"], None, "", now, "403") == Heartbeat(300.0, "condition",
                                                                          "403")
    assert heartbeat({"status": {}}, cond["type"], None, "", now) == Heartbeat(None)
    assert heartbeat(None, cond["type"], lease, "kf/x", now) is None


def test_an_applied_container_shows_the_agents_plan_and_a_refused_change():
    """The limit annotation was raised 16Gi -> 32Gi on the running pod; the agent keeps 16Gi
    (`PlanChangeRefused`): the row shows what is in force, and why the edit is not."""
    from kai_fractions.inspect.agent_state import AgentPlan
    from kai_fractions.inspect.render import render

    p = bind(memory_pod("nb", UID_A, "8Gi", "16Gi"), (GPU0,))
    p["metadata"]["annotations"]["nvidia.com/container.main.gpu-memory.limit"] = "32Gi"
    why = "the pod's GPU annotations changed (memory limit 16384 MiB -> 32768 MiB): refused"
    agent = AgentState(source="socket", allocations=(AgentAllocation(
        "team-a", "nb", "main", UID_A, "applied", used_bytes=MIB,
        plan=AgentPlan((GPU0,), "time-slicing", 8192 * MIB, 16384 * MIB),
        change_reason="PlanChangeRefused", change_message=why),))
    report = node_report(NODE, node(), [p], agent)
    [row] = report.rows
    assert (row.state, row.request_bytes, row.limit_bytes) == ("enforced", 8192 * MIB,
                                                                16384 * MIB)
    assert row.warnings == (f"PlanChangeRefused: {why}",)
    assert f"  ! team-a/nb/main: PlanChangeRefused: {why}" in render(report, "table").splitlines()


def test_requested_counts_only_what_the_agent_accounts():
    """A GPU's "requested" counted a contract-invalid container the agent refuses, and one the
    agent holds back unplanned (its signature missing)."""
    uid_c, uid_d = UID_A.replace("a", "c"), UID_A.replace("a", "d")
    ok = bind(memory_pod("ok", UID_A, "8Gi"), (GPU0,))
    refused = bind(memory_pod("full", UID_B, "4Gi"), (GPU0,))
    unsigned = bind(memory_pod("unsigned", uid_c, "2Gi"), (GPU0,))
    invalid = pod("bad", {"nvidia.com/container.main.gpu-memory.request": "8Gi",
                          "nvidia.com/container.main.gpu-memory.limit": "1Gi",
                          "nvidia.com/container.main.gpus.devices": GPU0,
                          "received-resource-type": "Fraction"}, uid=uid_d)
    invalid["spec"]["nodeName"] = NODE
    agent = AgentState(source="socket", allocations=(
        AgentAllocation("team-a", "ok", "main", UID_A, "applied"),
        AgentAllocation("team-a", "full", "main", UID_B, "refused", "MemoryOvercommitted"),
        AgentAllocation("team-a", "unsigned", "main", uid_c, "pending", "SignatureMissing"),
        AgentAllocation("team-a", "bad", "main", uid_d, "refused", "ContractInvalid")))
    [gpu] = node_report(NODE, node(), [ok, refused, unsigned, invalid], agent).gpus
    assert gpu.requested_bytes == 8192 * MIB
    assert {r.pod: (r.state, r.accounted) for r in gpu.rows} == {
        "ok": ("enforced", True), "full": ("refused", False), "unsigned": ("pending", False),
        "bad": ("invalid", False)}


@pytest.mark.parametrize("phase", ["Succeeded", "Failed"])
def test_a_finished_pod_is_not_shown_nor_counted(phase):
    """The agent drops finished pods; inspect showed them enforced and in "requested"."""
    running = gate_status(bind(memory_pod("run", UID_A, "8Gi"), (GPU0,)), exit_code=0)
    done = gate_status(bind(memory_pod("done", UID_B, "16Gi"), (GPU0,)), exit_code=0)
    done["status"]["phase"] = phase
    [gpu] = node_report(NODE, node(), [running, done], None).gpus
    assert gpu.requested_bytes == 8192 * MIB
    assert [r.pod for r in gpu.rows] == ["run"]
    report = pod_report(done, node(), None)
    assert report.rows == ()
    assert report.notes[-1] == (f"the pod has finished (phase {phase}): it holds no GPU memory "
                                "(the node agent drops finished pods)")


def test_a_finished_pods_report_keeps_its_nodes_label_condition_and_heartbeat():
    """The report of a finished pod was rebuilt with the node's label, condition and the
    agent's heartbeat dropped."""
    from kai_fractions.inspect.model import Heartbeat

    done = gate_status(bind(memory_pod("done", UID_B, "16Gi"), (GPU0,)), exit_code=0)
    done["status"]["phase"] = "Succeeded"
    beat = Heartbeat(12.0, "lease kai-fractions/x")
    report = pod_report(done, node(), None, beat=beat)
    assert (report.gpu_memory_label, report.condition[:2], report.heartbeat) == (
        "40960", ("gpu-fractioning.nvidia.com/Ready", "True"), beat)
    assert (report.gpus, report.unplaced) == ((), ())


def _applied_then_edited(annotations: dict[str, str], change: str = "") -> tuple[dict, AgentState]:
    """A pod applied at 8Gi / 16Gi on GPU0, using 6 GiB, whose annotations were then edited
    (`annotations`); the agent keeps its plan, with the refusal `change` (or none)."""
    from kai_fractions.inspect.agent_state import AgentPlan

    p = bind(memory_pod("nb", UID_A, "8Gi", "16Gi"), (GPU0,))
    p["metadata"]["annotations"].update(annotations)
    agent = AgentState(source="socket", allocations=(AgentAllocation(
        "team-a", "nb", "main", UID_A, "applied", used_bytes=6144 * MIB,
        plan=AgentPlan((GPU0,), "time-slicing", 8192 * MIB, 16384 * MIB),
        mechanisms=MappingProxyType({GPU0: frozenset({"cgroup"})}),
        change_reason="PlanChangeRefused" if change else "", change_message=change),))
    return p, agent


def test_an_applied_container_edited_invalid_keeps_its_plan_and_its_place():
    """The limit was edited below the request on a running pod: inspect showed it invalid with
    the edited 4 GiB limit, a false OverLimit, and dropped it from the GPU's requested."""
    p, agent = _applied_then_edited({"nvidia.com/container.main.gpu-memory.limit": "4Gi"},
                                    "its plan is refused now (ContractInvalid: ...)")
    [gpu] = node_report(NODE, node(), [p], agent).gpus
    [row] = gpu.rows
    assert (row.state, row.request_bytes, row.limit_bytes, row.tier, row.accounted) == (
        "enforced", 8192 * MIB, 16384 * MIB, "cgroup", True)
    assert row.warnings == ("PlanChangeRefused: its plan is refused now (ContractInvalid: ...)",)
    assert gpu.requested_bytes == 8192 * MIB

    p, agent = _applied_then_edited({"nvidia.com/container.main.gpu-memory.limit": "4Gi"})
    [row] = node_report(NODE, node(), [p], agent).rows
    assert row.state == "enforced"
    assert row.warnings == ("ContractInvalid: nvidia.com/container.main.gpu-memory.limit: must "
                            "be greater than or equal to the request '8Gi' (got '4Gi')",)


def test_an_applied_container_whose_edit_leaves_no_share_shows_the_plan_in_force():
    """Annotations replaced by ones the contract cannot read at all (no share is left): still
    the agent's plan."""
    p, agent = _applied_then_edited({})
    p["metadata"]["annotations"] = {"gpu-fraction": "abc"}
    [gpu] = node_report(NODE, node(), [p], agent).gpus
    [row] = gpu.rows
    assert (row.ref, row.state, row.limit_bytes, row.accounted) == (
        "team-a/nb/main", "enforced", 16384 * MIB, True)
    assert row.warnings[0].startswith("ContractInvalid: ")
    assert gpu.requested_bytes == 8192 * MIB
    # Not applied: invalid, as before.
    down = node_report(NODE, node(), [p], None)
    assert [(r.state, r.gpu_uuid) for r in down.rows] == [("invalid", "")]


def test_the_tier_is_a_dash_unless_enforced_or_refused():
    """With the socket read, pending, waiting, ungated and invalid rows said TIER `none` (no
    cap in force), as if something had failed; no cap is meant to hold for them yet."""
    from kai_fractions.inspect.agent_state import AgentPlan

    uid_c, uid_d, uid_e = (UID_A.replace("a", x) for x in "cde")
    pending = bind(memory_pod("pending", UID_A), (GPU0,))
    waiting = gate_status(bind(memory_pod("waiting", UID_B), (GPU0,)), exit_code=None,
                          running=True)
    ungated = bind(memory_pod("ungated", uid_c, gate=False), (GPU0,))
    invalid = bind(memory_pod("invalid", uid_d, "8Gi", "16Gi"), (GPU0,))
    invalid["metadata"]["annotations"]["nvidia.com/container.main.gpu-memory.limit"] = "1Gi"
    refused = bind(memory_pod("refused", uid_e), (GPU0,))
    agent = AgentState(source="socket unix:///x", allocations=(
        AgentAllocation("team-a", "pending", "main", UID_A, "pending",
                        plan=AgentPlan((GPU0,), "time-slicing", 8192 * MIB, 8192 * MIB)),
        AgentAllocation("team-a", "refused", "main", uid_e, "refused", "MemoryOvercommitted")))
    rows = node_report(NODE, node(), [pending, waiting, ungated, invalid, refused], agent).rows
    assert {r.pod: (r.state, r.tier) for r in rows} == {
        "pending": ("pending", "-"), "waiting": ("waiting", "-"), "ungated": ("ungated", "-"),
        "invalid": ("invalid", "-"), "refused": ("refused", "none")}


def test_off_the_node_a_container_whose_mps_cap_is_not_in_force_is_pending_not_enforced():
    """The agent's metrics (no socket) say an MPS cap of the container is not in force: its
    marker is set aside, so the gate's exit 0 of long ago says nothing of what is in force now.
    Pending with the reason, still counted in its GPU's requested memory (the agent holds its
    plan); a gate that failed still wins (the workload did not start)."""
    released = gate_status(bind(memory_pod("a", UID_A, "8Gi"), (GPU0,)), exit_code=0)
    failed = gate_status(bind(memory_pod("b", UID_B, "4Gi"), (GPU0,)), exit_code=1,
                         message="timed out")
    cap = "the node agent's metrics say an MPS cap this container relies on is not in force"
    agent = AgentState(source="metrics http://x/metrics", allocations=(
        AgentAllocation("team-a", "a", "main", UID_A, reason="NamespaceCapUnverified",
                        message=cap, cap_not_in_force=True, used_bytes=MIB,
                        used_by_gpu=MappingProxyType({GPU0: MIB})),
        AgentAllocation("team-a", "b", "main", UID_B, reason="MpsPinnedLimitLost",
                        message=cap, cap_not_in_force=True)))
    [gpu] = node_report(NODE, node(), [released, failed], agent).gpus
    rows = {r.pod: r for r in gpu.rows}
    a = rows["a"]
    assert (a.state, a.reason, a.message, a.tier, a.used_bytes, a.accounted) == (
        "pending", "NamespaceCapUnverified", cap, "-", MIB, True)
    assert (rows["b"].state, rows["b"].reason) == ("refused", "GateFailed")
    assert gpu.requested_bytes == 8192 * MIB
    # the usage of a container the metrics say nothing more of: the gate's word, as before
    usage_only = AgentState(source="metrics http://x/metrics", allocations=(
        AgentAllocation("team-a", "a", "main", used_bytes=MIB),))
    [row] = node_report(NODE, node(), [released], usage_only).rows
    assert (row.state, row.reason, row.tier, row.state_source) == ("enforced", "", "n/a", "gate")


@pytest.mark.parametrize("reason", ["ErrImagePull", "ImagePullBackOff",
                                    "CreateContainerConfigError", "CreateContainerError",
                                    "InvalidImageName", "RunContainerError"])
def test_a_gate_the_kubelet_cannot_start_says_why(reason):
    """Not "waiting for the node agent": the gate never runs, and this is what to fix."""
    p = bind(memory_pod("a", UID_A), (GPU0,))
    p["status"] = {"initContainerStatuses": [{"name": "kai-fractions-gate", "state": {
        "waiting": {"reason": reason, "message": 'pull access denied for "gate"'}}}]}
    [row] = pod_report(p, node(), AGENT_DOWN).rows
    assert (row.state, row.reason, row.message, row.state_source) == (
        "waiting", reason, 'pull access denied for "gate"', "gate")
    # an ordinary wait before the gate runs is still the agent's to end
    p["status"]["initContainerStatuses"][0]["state"] = {"waiting": {"reason": "PodInitializing"}}
    assert gate_state(p) is None


def test_a_condition_without_reason_or_message_says_only_its_status():
    unknown = node(conditions=[{"type": "gpu-fractioning.nvidia.com/Ready",
                                "status": "Unknown"}])
    p = bind(memory_pod("a", UID_A), (GPU0,))
    assert "gpu-fractioning.nvidia.com/Ready is Unknown" in pod_report(p, unknown, None).notes
    said = node(conditions=[{"type": "gpu-fractioning.nvidia.com/Ready", "status": "False",
                             "message": "the MPS control daemon is not running"}])
    assert ("gpu-fractioning.nvidia.com/Ready is False: the MPS control daemon is not running"
            in pod_report(p, said, None).notes)


def test_a_contract_invalid_pod_without_a_share_is_not_accounted():
    """The agent counts no request of a pod it cannot plan (the Row's docstring)."""
    bad = pod("bad", {"nvidia.com/container.main.gpu-memory.request": "lots"}, uid=UID_A)
    bad["spec"]["nodeName"] = NODE
    broken = pod("broken", {"gpu-fraction": "0.5"}, uid=UID_B)
    broken["spec"]["containers"] = "oops"  # not a pod spec at all: ManifestError
    rows = node_report(NODE, node(), [bad, broken], None).unplaced
    assert [(r.pod, r.state, r.reason, r.accounted, r.to_dict()["accounted"]) for r in rows] == [
        ("bad", "invalid", "ContractInvalid", False, False),
        ("broken", "invalid", "ManifestError", False, False)]


READY = "gpu-fractioning.nvidia.com/Ready"
NOT_RECONCILING = AgentCondition(
    READY, False, "NotReconciling",
    "the Kubernetes API has been unreachable for 60s or more: connection refused")


def test_the_agents_own_condition_is_noted_where_the_nodes_copy_is_stale():
    """An agent that cannot reach the API server (NotReconciling) cannot patch the Node either:
    the Node kept the True it last wrote, and inspect, run on the node to debug exactly that,
    showed it alone although the agent's socket had just said False."""
    agent = AgentState(source="socket unix:///run/kai-fractions/agent.sock",
                       condition=NOT_RECONCILING)
    report = node_report(NODE, node(), [], agent)
    assert report.condition[:3] == (READY, "True", "Reconciling")  # the Node's copy, as read
    assert report.notes == (
        "the node agent itself says now: gpu-fractioning.nvidia.com/Ready is False: "
        "NotReconciling: the Kubernetes API has been unreachable for 60s or more: connection "
        "refused; the Node's copy, which KAI reads, is stale (gpu-fractioning.nvidia.com/Ready "
        "is True: Reconciling): the agent writes a change within seconds; if this stays, it "
        "cannot patch the Node (the API server out of its reach, or its RBAC): its log says why",)
    assert report.to_dict()["agent"]["condition"] == {
        "type": READY, "status": "False", "reason": "NotReconciling",
        "message": NOT_RECONCILING.message}
    # a reason of its own with the same status is stale too
    other = AgentCondition(READY, True, "AgentReady", "sm-sharing")
    (note,) = node_report(NODE, node(), [], AgentState(source="socket", condition=other)).notes
    assert note.startswith("the node agent itself says now: gpu-fractioning.nvidia.com/Ready is "
                           "True: AgentReady: sm-sharing; the Node's copy")
    # a Node with no condition yet, while the agent has one
    notes = node_report(NODE, node(conditions=[]), [], agent).notes
    assert notes[1].startswith("the node agent itself says now: gpu-fractioning.nvidia.com/"
                               "Ready is False: NotReconciling: ")
    assert "it has not written it to the Node, which KAI reads" in notes[1]


def test_the_agents_own_condition_agreeing_with_the_nodes_adds_no_note():
    same = AgentCondition(READY, True, "Reconciling", "a newer message")
    assert node_report(NODE, node(), [], AgentState(source="socket", condition=same)).notes == ()
    no_reason = AgentCondition(READY, True)  # an agent that gives none: the status agrees
    assert node_report(NODE, node(), [], AgentState(source="socket",
                                                    condition=no_reason)).notes == ()
    # the metrics give no condition: nothing to compare, and JSON says none
    report = node_report(NODE, node(), [], AgentState(source="metrics http://x"))
    assert report.notes == () and report.to_dict()["agent"]["condition"] is None
