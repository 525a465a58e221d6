"""`kai-fractions inspect` on a GPU whose usage the node agent's watchdog cannot read (NVML
refuses to list its processes): the container's USED is not known, not `0 MiB`, and one whose
only memory tier is that watchdog is pending `WatchdogBlind`, not `enforced`; through the
agent's socket (GetNodeState) and through its metrics (`--agent-metrics`), each read from what
a real agent over in-memory fakes answers."""

from __future__ import annotations

import copy
from pathlib import Path

from prometheus_client import generate_latest

from kai_fractions.inspect import sources
from kai_fractions.inspect.agent_metrics import from_metrics_text
from kai_fractions.inspect.model import ENFORCED, PENDING, node_report
from kai_fractions.inspect.render import render
from kai_fractions.inspect.sources import from_node_state, merged
from kai_fractions.node.agent.grpc_service import node_state
from kai_fractions.node.config import WatchdogPolicy
from kai_fractions.sim.nvml import FakeNvml
from tests.agent.builders import GIB, NODE, Rig, binder_annotations, leaf_of, pod

SOCKET = "socket unix:///run/kai-fractions/agent.sock"
METRICS = "metrics http://10.0.0.5:9400"


def blind_node(tmp: Path, *, old_driver: bool) -> tuple[Rig, dict]:
    """A node whose GPU 0 NVML refuses to list, running pod `p` there (its gate released
    before), its process using 70 GiB against a 20 GiB cap."""
    nvml = FakeNvml.simulated(2, model="H100-80GB", seed=NODE,
                              **({"driver_version": "550.54.15"} if old_driver else {}))
    rig = Rig(tmp, sm_sharing=False, watchdog_policy=WatchdogPolicy.KILL, nvml=nvml)
    manifest = pod("p", notes=binder_annotations(devices=rig.gpu0))
    manifest["spec"]["initContainers"] = [{"name": "kai-fractions-gate", "image": "g"}]
    manifest["status"]["initContainerStatuses"] = [{
        "name": "kai-fractions-gate",
        "state": {"terminated": {"exitCode": 0, "finishedAt": "2030-01-01T00:00:00Z"}}}]
    uid = rig.add(manifest)["metadata"]["uid"]
    assert rig.step().converged
    rig.reconciler.check_usage()
    rig.proc_entry(4242, leaf_of(uid)[len("/sys/fs/cgroup"):])
    rig.nvml.fail("running_processes", "NoPermission", times=None, device=rig.gpu0)
    rig.nvml.add_process(4242, rig.gpu0, 70 * GIB)
    rig.reconciler.check_usage()
    rig.step()
    rig.reconciler.check_usage()
    return rig, rig.cluster.pods[uid]


def node_of(rig: Rig) -> dict:
    node = copy.deepcopy(rig.cluster.get_node(NODE))
    cond = rig.agent.condition()
    node.setdefault("status", {})["conditions"] = [{
        "type": "gpu-fractioning.nvidia.com/Ready", "status": "True" if cond.ready else "False",
        "reason": cond.reason, "message": cond.message}]
    node["metadata"].setdefault("labels", {})["nvidia.com/gpu.memory"] = "81559"
    return node


def by_socket(rig: Rig):
    return from_node_state(node_state(rig.reconciler.view, NODE, rig.agent.condition(),
                                      "gpu-fractioning.nvidia.com/Ready"), SOCKET)


def by_metrics(rig: Rig):
    return from_metrics_text(generate_latest(rig.agent.metrics.registry).decode(), METRICS,
                             node=NODE)


def test_the_only_tier_blind_is_pending_with_its_usage_unknown(short_tmp: Path) -> None:
    rig, p = blind_node(short_tmp, old_driver=True)
    for state, source in ((by_socket(rig), "agent"), (by_metrics(rig), "metrics")):
        report = node_report(NODE, node_of(rig), [p], state, all_gpus=False)
        (row,) = report.rows
        assert (row.state, row.reason, row.used_bytes, row.state_source) == (
            PENDING, "WatchdogBlind", None, source)
        assert row.warnings == ()  # the message says it: no second line
        table = render(report, "table")
        assert "n/a   pending (WatchdogBlind)" in table and "  0 MiB  " not in table
    socket = by_socket(rig)
    (a,) = socket.allocations
    assert a.message.startswith(f"usage unknown on GPU {rig.gpu0} (NVMLNoPermission): ")
    assert dict(a.usage_unknown) == {rig.gpu0: "NVMLNoPermission"}
    (m,) = by_metrics(rig).allocations
    assert (m.reason, m.cap_not_in_force, dict(m.usage_unknown)) == (
        "WatchdogBlind", True, {rig.gpu0: "NVMLNoPermission"})
    assert m.message.startswith("the node agent's metrics say its watchdog, this container's "
                                "only GPU memory tier, cannot see")


def test_another_tier_stays_enforced_its_usage_unknown_with_a_note(short_tmp: Path) -> None:
    rig, p = blind_node(short_tmp, old_driver=False)  # cgroup limits: the cap holds
    note = (f"UsageUnknown: the node agent cannot read its GPU memory use on {rig.gpu0} "
            "(NVMLNoPermission), so USED is not known")
    socket, metrics = by_socket(rig), by_metrics(rig)
    for state in (socket, metrics, merged(socket, metrics)):
        report = node_report(NODE, node_of(rig), [p], state, all_gpus=False)
        (row,) = report.rows
        assert (row.state, row.used_bytes) == (ENFORCED, None)
        (warning,) = row.warnings
        assert warning.startswith(note)
        table = render(report, "table")
        assert "  0 MiB  " not in table and f"! default/p/main: {note}" in table
    # seen again: the usage is read, and shown
    rig.nvml.clear_failures()
    rig.reconciler.check_usage()
    rig.step()
    for state in (by_socket(rig), by_metrics(rig)):
        (row,) = node_report(NODE, node_of(rig), [p], state, all_gpus=False).rows
        assert row.used_bytes == 70 * GIB and not any(
            w.startswith("UsageUnknown") for w in row.warnings)


def test_the_socket_note_is_read_back() -> None:
    gpu0, gpu1 = "GPU-8b7f7e71-182c-dddd-4660-5655b03984ea", "GPU-11111111-2222-3333-4444-5"
    assert sources.usage_unknown(f"x; usage unknown on GPU {gpu0} (NVMLError), GPU {gpu1} "
                         "(NoProcessesVisible): the watchdog cannot read it there") == {
        gpu0: "NVMLError", gpu1: "NoProcessesVisible"}
    assert sources.usage_unknown("limits in force") == {}
