"""The report as a table per GPU, and as JSON / YAML."""

from __future__ import annotations

import json
from types import MappingProxyType

import pytest
import yaml

from kai_fractions.contract import ComputeMode, Dialect
from kai_fractions.inspect.agent_state import AgentAllocation, AgentDevice, AgentState
from kai_fractions.inspect.model import node_report
from kai_fractions.inspect.render import render

from .pods import GPU0, GPU1, MIB, NODE, bind, gate_status, memory_pod, node

UID_A = "aaaaaaaa-0000-4000-8000-000000000001"
UID_B = "bbbbbbbb-0000-4000-8000-000000000002"


def _report():
    a = gate_status(bind(memory_pod("notebook", UID_A, "8Gi", "16Gi"), (GPU0,)), exit_code=0)
    # The patched KAI's compute portion gives the server its 50% cap.
    server = bind(memory_pod("server", UID_B, "20480Mi", mode=ComputeMode.SM_SHARING), (GPU1,),
                  dialect=Dialect.PATCHED)
    b = gate_status(server, exit_code=1, message="container 'main' refused by the node "
                    "agent: SmSharingDisabled: no MPS")
    agent = AgentState(
        source="socket unix:///run/kai-fractions/agent.sock", driver_version="615.00.00",
        devices=(AgentDevice(0, GPU0, "NVIDIA A100-SXM4-40GB", 40960 * MIB, "Default"),
                 AgentDevice(1, GPU1, "NVIDIA A100-SXM4-40GB", 40960 * MIB, "Default")),
        allocations=(AgentAllocation("team-a", "notebook", "main", UID_A, "applied",
                                     used_bytes=6144 * MIB, mechanisms=MappingProxyType(
                                         {GPU0: frozenset({"watchdog", "cgroup"})})),))
    return node_report(NODE, node(), [a, b], agent)


def test_table_per_gpu():
    assert render(_report(), "table") == """\
node gpu-node-1  nvidia.com/gpu.memory=40960  gpu-fractioning.nvidia.com/Ready=True
agent: socket unix:///run/kai-fractions/agent.sock (driver 615.00.00)

GPU 0  GPU-00000000-1111-2222-3333-444444444440  NVIDIA A100-SXM4-40GB  40960 MiB  time-slicing  requested 8192 MiB (20%)
  POD/CONTAINER         MODE          REQUEST   LIMIT      ATP  USED      STATE     TIER
  team-a/notebook/main  time-slicing  8192 MiB  16384 MiB  -    6144 MiB  enforced  cgroup

GPU 1  GPU-00000000-1111-2222-3333-444444444441  NVIDIA A100-SXM4-40GB  40960 MiB  sm-sharing  requested 0 MiB (0%)
  POD/CONTAINER       MODE        REQUEST    LIMIT      ATP  USED  STATE                 TIER
  team-a/server/main  sm-sharing  20480 MiB  20480 MiB  50%  n/a   refused (GateFailed)  none
  ! team-a/server/main: GateFailed: container 'main' refused by the node agent: SmSharingDisabled: no MPS
"""  # noqa: E501


@pytest.mark.parametrize("output, load", [("json", json.loads), ("yaml", yaml.safe_load)])
def test_machine_readable(output, load):
    data = load(render(_report(), output))
    assert data["node"] == NODE and data["gpu_memory_label"] == "40960"
    assert data["condition"] == {"type": "gpu-fractioning.nvidia.com/Ready", "status": "True",
                                 "reason": "Reconciling", "message": "ok"}
    assert data["agent"] == {"source": "socket unix:///run/kai-fractions/agent.sock",
                             "reachable": True, "error": "", "driver_version": "615.00.00",
                             "condition": None}  # the socket's own condition: none given here
    [g0, g1] = data["gpus"]
    assert (g0["index"], g0["uuid"], g0["memory_bytes"], g0["modes"], g0["requested_bytes"]) == (
        0, GPU0, 40960 * MIB, ["time-slicing"], 8192 * MIB)
    assert g0["allocations"] == [{
        "namespace": "team-a", "pod": "notebook", "container": "main", "gpu_uuid": GPU0,
        "mode": "time-slicing", "request_bytes": 8192 * MIB, "limit_bytes": 16384 * MIB,
        "active_thread_percentage": None, "devices": [GPU0], "state": "enforced", "reason": "",
        "message": "", "used_bytes": 6144 * MIB, "portion": "", "device_count": 1,
        "mps_namespace": "", "warnings": [], "tier": "cgroup", "accounted": True,
        "state_source": "agent"}]
    assert g1["allocations"][0]["state"] == "refused"
    assert g1["allocations"][0]["active_thread_percentage"] == 50
    assert data["unplaced"] == [] and data["notes"] == []


def test_unknown_output():
    with pytest.raises(ValueError, match="--output must be one of table, json, yaml"):
        render(_report(), "xml")


def test_a_watchdog_only_cap_with_usage_over_it_is_flagged():
    """Only the watchdog (report mode by default) held the cap while the container used more:
    inspect said "enforced" and nothing else."""
    p = gate_status(bind(memory_pod("train", UID_A, "8Gi", "8Gi"), (GPU0,)), exit_code=0)
    agent = AgentState(source="socket unix:///x", allocations=(AgentAllocation(
        "team-a", "train", "main", UID_A, "applied", used_bytes=10240 * MIB,
        mechanisms=MappingProxyType({GPU0: frozenset({"watchdog"})})),))
    report = node_report(NODE, node(), [p], agent)
    lines = render(report, "table").splitlines()
    row = next(line for line in lines if line.startswith("  team-a/train/main")).split()
    assert row[-2:] == ["enforced", "watchdog"]
    assert (f"  ! team-a/train/main: OverLimit: uses 10240 MiB on {GPU0}, above its limit of "
            "8192 MiB: only the watchdog holds this cap, which never stops an allocation (it "
            "records LimitViolation events, and stops the processes only with "
            "--watchdog-policy kill)") in lines
    [data] = json.loads(render(report, "json"))["gpus"][0]["allocations"]
    assert data["tier"] == "watchdog" and data["warnings"][0].startswith("OverLimit: ")


def test_the_tier_without_the_agents_socket_is_not_known():
    p = gate_status(bind(memory_pod("train", UID_A, "8Gi", "8Gi"), (GPU0,)), exit_code=0)
    metrics = AgentState(source="metrics http://x/metrics", allocations=(AgentAllocation(
        "team-a", "train", "main", used_bytes=9 * 1024 * MIB),))
    [row] = node_report(NODE, node(), [p], metrics).rows
    assert (row.tier, row.warnings) == ("n/a", (
        f"OverLimit: uses 9216 MiB on {GPU0}, above its limit of 8192 MiB (which tier holds "
        "the cap is not known: give --agent-socket on the node)",))
