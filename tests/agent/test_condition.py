"""The node condition: each reason with its message, heartbeats, transition times (also across
an agent restart), the legacy condition and the GPU memory label."""

from __future__ import annotations

from pathlib import Path

import pytest

from kai_fractions.kube.errors import KubeError
from kai_fractions.node.agent.condition import (
    Condition,
    Health,
    Liveness,
    evaluate,
)
from kai_fractions.node.agent.options import AgentOptions
from kai_fractions.node.agent.status_publisher import StatusPublisher
from kai_fractions.node.config import NodeConfig
from kai_fractions.node.errors import nvml_error
from kai_fractions.node.inventory import Capabilities, Inventory
from kai_fractions.node.mps.errors import MpsError
from kai_fractions.node.nvml import DeviceInfo, GpuComputeMode
from kai_fractions.sim.nvml import FakeNvml
from tests.support.fake_kube import FakeCluster

from .builders import MIB, NODE, Rig, binder_annotations, pod

DEV = DeviceInfo(index=0, uuid="GPU-1", name="NVIDIA H100 80GB HBM3", memory_total=81559 * MIB,
                 memory_used=0, compute_mode=GpuComputeMode.DEFAULT, mig_enabled=False)
SMALL = DeviceInfo(index=1, uuid="GPU-2", name="NVIDIA L4", memory_total=23034 * MIB,
                   memory_used=0, compute_mode=GpuComputeMode.DEFAULT, mig_enabled=False)


def inventory(limits: bool = True, namespaces: bool = True) -> Inventory:
    return Inventory("615.48.02", (DEV, SMALL), Capabilities(limits, namespaces))


LIVE = Liveness(synced=True, api_down_for=None, api_error=None, busy_for=None)
OPTIONS = AgentOptions(socket=None, metrics_listen=None, stale_after_seconds=60)


def health(**kw) -> Health:
    return Health(**{"inventory": inventory(), "passes": 1, "mps_namespaces": True, **kw})


def test_ready_names_the_gpus_and_the_enforcement() -> None:
    cond = evaluate(NodeConfig(node_name=NODE), OPTIONS, health(), LIVE)
    assert cond == Condition(True, "AgentReady",
                             "2 GPU(s), driver 615.48.02; memory: cgroup limits, MPS pinned limit "
                             "(sm-sharing), watchdog (report); compute: sm-sharing with one MPS "
                             "namespace per container")


@pytest.mark.parametrize(("config", "kw", "live", "reason", "message"), [
    ({}, {"nvml_error": nvml_error(9, "nvmlInit")}, LIVE, "NVMLUnavailable",
     "NVML does not work on this node (NVMLUnavailable): NVML is installed but the NVIDIA kernel "
     "driver is not loaded: check `nvidia-smi` on the node and load the driver (the GPU may also "
     "be missing or unsupported)"),
    ({"memory_enforcement": "cgroup"}, {"inventory": inventory(limits=False)}, LIVE,
     "DriverTooOld",
     "NVIDIA driver 615.48.02 has no cgroup GPU memory limits (nvmlDeviceSetMemoryLimits_v1 needs "
     "r615 or newer): no fractional container's GPU memory can be capped on this node with "
     "--memory-enforcement=cgroup, so every one is refused; upgrade the driver, or add watchdog "
     "to --memory-enforcement with --watchdog-policy=kill, or add mps-pinned to "
     "--memory-enforcement (sm-sharing containers only)"),
    # The defaults (cgroup,mps-pinned,watchdog; policy report) on a driver before r615 with
    # sm-sharing off: a watchdog that only reports caps nothing, so no container can be capped.
    ({"sm_sharing": False}, {"inventory": inventory(limits=False)}, LIVE, "DriverTooOld",
     "NVIDIA driver 615.48.02 has no cgroup GPU memory limits (nvmlDeviceSetMemoryLimits_v1 needs "
     "r615 or newer); the watchdog only reports (--watchdog-policy=report), it stops nothing; "
     "mps-pinned applies to sm-sharing containers only and sm-sharing is disabled on this node: "
     "no fractional container's GPU memory can be capped on this node with "
     "--memory-enforcement=cgroup,mps-pinned,watchdog, so every one is refused; upgrade the "
     "driver, or set --watchdog-policy=kill (the chart's watchdog.policy)"),
    ({"sm_sharing": False, "memory_enforcement": "watchdog"}, {}, LIVE, "NoMemoryEnforcement",
     "the cgroup tier is not enabled; the watchdog only reports (--watchdog-policy=report), it "
     "stops nothing: no fractional container's GPU memory can be capped on this node with "
     "--memory-enforcement=watchdog, so every one is refused; add cgroup to "
     "--memory-enforcement, or set --watchdog-policy=kill (the chart's watchdog.policy)"),
    ({}, {"mps_error": MpsError("MpsBinaryNotFound", "cannot execute x")}, LIVE,
     "MPSDaemonUnhealthy",
     "sm-sharing is enabled but the MPS control daemon is not usable (MpsBinaryNotFound): "
     "cannot execute x"),
    ({}, {}, Liveness(True, 61.0, "list pods: 503", None), "NotReconciling",
     "the Kubernetes API has been unreachable for 60s or more: list pods: 503"),
    ({}, {}, Liveness(True, None, None, 75.0), "NotReconciling",
     "a reconcile pass has been running for 60s or more (a GPU, MPS or API call hangs); see the "
     "agent's log"),
    ({}, {"passes": 0}, Liveness(False, None, None, None), "NotReconciling",
     "the node agent has not listed this node's pods and reconciled them yet"),
    ({}, {}, Liveness(True, None, None, None, stopping=True), "NotReconciling",
     "the node agent is stopping; the next one publishes this condition again"),
    ({}, {}, Liveness(True, None, None, None, failed_passes=3, failing_for=4.2,
                      pass_error="OSError: [Errno 12] Cannot allocate memory"), "NotReconciling",
     "reconcile passes keep failing with an internal error (3 or more in a row, or for 60s or "
     "more, none completed), the last: OSError: [Errno 12] Cannot allocate memory; see the "
     "agent's log"),
    ({}, {}, Liveness(True, None, None, None, failed_passes=1, failing_for=61.0,
                      pass_error="KeyError: 'x'"), "NotReconciling",
     "reconcile passes keep failing with an internal error (3 or more in a row, or for 60s or "
     "more, none completed), the last: KeyError: 'x'; see the agent's log"),
])
def test_not_ready_reasons(config, kw, live, reason, message) -> None:
    cond = evaluate(NodeConfig(node_name=NODE, **config), OPTIONS, health(**kw), live)
    assert (cond.ready, cond.reason, cond.message) == (False, reason, message)


def test_old_driver_with_a_fallback_is_ready_and_says_how() -> None:
    cond = evaluate(NodeConfig(node_name=NODE, sm_sharing=False,
                               memory_enforcement="cgroup,watchdog", watchdog_policy="kill"),
                    OPTIONS, health(inventory=inventory(limits=False)), LIVE)
    assert cond.ready
    assert cond.message.endswith("memory: watchdog (kill); compute: time-slicing only "
                                 "(sm-sharing disabled on this node)")


def test_old_driver_with_a_report_watchdog_and_only_mps_pinned_stays_ready_for_sm_sharing(
        ) -> None:
    """The defaults on a driver before r615 with sm-sharing on: sm-sharing containers are
    capped (mps-pinned), time-slicing ones are refused, and the Ready message says so."""
    cond = evaluate(NodeConfig(node_name=NODE), OPTIONS,
                    health(inventory=inventory(limits=False)), LIVE)
    assert (cond.ready, cond.reason) == (True, "AgentReady")
    assert cond.message == (
        "2 GPU(s), driver 615.48.02; memory: MPS pinned limit (sm-sharing), watchdog (report) "
        "(time-slicing containers are refused here: they need cgroup limits or a watchdog with "
        "--watchdog-policy=kill); compute: sm-sharing with one MPS namespace per container")


@pytest.mark.parametrize(("config", "limits", "ready"), [
    ({}, True, True),
    ({"sm_sharing": False}, True, True),  # cgroup, with the report watchdog as a second line
    ({"sm_sharing": False}, False, False),
    ({"sm_sharing": False, "watchdog_policy": "kill"}, False, True),
    ({}, False, True),  # sm-sharing containers: mps-pinned
    ({"memory_enforcement": "cgroup,watchdog"}, False, False),
    ({"memory_enforcement": "cgroup,watchdog", "watchdog_policy": "kill"}, False, True),
    ({"memory_enforcement": "watchdog"}, True, False),
    ({"memory_enforcement": "watchdog", "watchdog_policy": "kill"}, True, True),
    ({"memory_enforcement": "mps-pinned"}, False, True),
    ({"memory_enforcement": "mps-pinned", "sm_sharing": False}, True, False),
])
def test_ready_only_where_some_fractional_container_can_be_capped(config, limits, ready
                                                                  ) -> None:
    cond = evaluate(NodeConfig(node_name=NODE, **config), OPTIONS,
                    health(inventory=inventory(limits=limits)), LIVE)
    assert cond.ready is ready, cond
    if not ready:
        assert cond.reason == ("NoMemoryEnforcement" if limits else "DriverTooOld")
        assert "so every one is refused" in cond.message


def test_mps_without_namespaces_is_ready_but_says_it_is_weaker() -> None:
    cond = evaluate(NodeConfig(node_name=NODE), OPTIONS, health(mps_namespaces=False), LIVE)
    assert cond.ready
    assert cond.message.endswith(
        "compute: sm-sharing through the MPS client env only: this MPS daemon has no namespaces "
        "(driver before r615), so the active-thread percentage is the client's own "
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, not enforced by the daemon")


def test_a_driver_too_old_is_reported_by_a_running_agent(short_tmp: Path) -> None:
    nvml = FakeNvml.simulated(2, model="H100-80GB", memory_limits=False)
    rig = Rig(short_tmp, sm_sharing=False, nvml=nvml, memory_enforcement="cgroup")
    rig.step()
    cond = rig.agent.condition()
    assert cond is not None and (cond.ready, cond.reason) == (False, "DriverTooOld")


def test_the_default_flags_on_an_old_driver_make_a_time_slicing_node_not_ready(
        short_tmp: Path) -> None:
    """--memory-enforcement=cgroup,mps-pinned,watchdog with --watchdog-policy=report: the
    watchdog stops nothing, so a time-slicing node before r615 caps no container."""
    nvml = FakeNvml.simulated(2, model="H100-80GB", memory_limits=False)
    rig = Rig(short_tmp, sm_sharing=False, nvml=nvml)
    rig.step()
    cond = rig.agent.condition()
    assert cond is not None and (cond.ready, cond.reason) == (False, "DriverTooOld")
    assert "the watchdog only reports (--watchdog-policy=report)" in cond.message


def test_passes_failing_with_an_internal_error_make_the_node_not_ready_until_one_completes(
        short_tmp: Path) -> None:
    rig = Rig(short_tmp, sm_sharing=False)
    rig.sync()
    worker = rig.agent.worker
    worker._pass(False)
    assert rig.agent.condition().ready
    real = rig.reconciler.engine.apply

    def broken(*a, **kw):
        raise OSError(12, "Cannot allocate memory")

    rig.reconciler.engine.apply = broken
    rig.add(pod("new", notes=binder_annotations(devices=rig.gpu0)))
    rig.sync()
    for _ in range(2):  # one failure retried is not worth a flap
        worker._pass(False)
        assert rig.agent.condition().ready
    worker._pass(False)
    cond = rig.agent.condition()
    assert (cond.ready, cond.reason) == (False, "NotReconciling")
    assert cond.message.endswith("none completed), the last: OSError: [Errno 12] Cannot "
                                 "allocate memory; see the agent's log")
    worker._pass(False)  # a fourth failure says the same: the Node is not written again
    assert rig.agent.condition() == cond
    rig.reconciler.engine.apply = real
    worker._pass(False)
    assert rig.agent.condition().ready


def test_an_agent_whose_first_passes_fail_says_so_without_waiting(short_tmp: Path) -> None:
    rig = Rig(short_tmp, sm_sharing=False)

    def broken(**kw):
        raise RuntimeError("a bug")

    rig.reconciler.reconcile = broken
    for _ in range(3):
        rig.agent.worker._pass(False)
    cond = rig.agent.condition()
    assert cond is not None and (cond.ready, cond.reason) == (False, "NotReconciling")
    assert cond.message.endswith("the last: RuntimeError: a bug; see the agent's log")


# -- the publisher ----------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.t = 1_700_000_000.0

    def __call__(self) -> float:
        return self.t


def publisher(cluster: FakeCluster, conds: list[Condition], clock: Clock,
              **options) -> StatusPublisher:
    opts = AgentOptions(socket=None, metrics_listen=None, heartbeat_seconds=60, **options)
    return StatusPublisher(cluster, NODE, opts, lambda: conds[-1], lambda: 23034,
                           clock=clock, monotonic=clock)


READY = Condition(True, "AgentReady", "ok")
DOWN = Condition(False, "NVMLUnavailable", "no driver")


def test_publishes_on_change_and_heartbeats_at_most_every_interval() -> None:
    cluster = FakeCluster()
    cluster.add_node(NODE)
    clock = Clock()
    conds = [READY]
    p = publisher(cluster, conds, clock)
    assert p.tick()
    first = cluster.condition(NODE, "gpu-fractioning.nvidia.com/Ready")
    assert first == {"type": "gpu-fractioning.nvidia.com/Ready", "status": "True",
                     "reason": "AgentReady", "message": "ok",
                     "lastHeartbeatTime": "2023-11-14T22:13:20Z",
                     "lastTransitionTime": "2023-11-14T22:13:20Z"}
    clock.t += 30
    assert not p.tick()  # unchanged, heartbeat not due
    clock.t += 30
    assert p.tick()  # heartbeat
    beat = cluster.condition(NODE, "gpu-fractioning.nvidia.com/Ready")
    assert beat["lastHeartbeatTime"] == "2023-11-14T22:14:20Z"
    assert beat["lastTransitionTime"] == "2023-11-14T22:13:20Z"
    clock.t += 1
    conds.append(DOWN)
    assert p.tick()  # a change goes out at once
    down = cluster.condition(NODE, "gpu-fractioning.nvidia.com/Ready")
    assert (down["status"], down["reason"], down["message"]) == ("False", "NVMLUnavailable",
                                                                 "no driver")
    assert down["lastTransitionTime"] == "2023-11-14T22:14:21Z"
    clock.t += 1
    conds.append(Condition(False, "NVMLUnavailable", "still no driver"))
    assert p.tick()  # the message changed: published, the transition time kept
    assert cluster.condition(NODE, "gpu-fractioning.nvidia.com/Ready")[
        "lastTransitionTime"] == "2023-11-14T22:14:21Z"
    assert len(cluster.node_status_patches) == 4


@pytest.mark.parametrize("live", [
    lambda t: Liveness(True, 60.0 + t, "list pods: 503", None),
    lambda t: Liveness(True, None, None, 60.0 + t),
    lambda t: Liveness(True, None, None, None, failed_passes=3 + int(t), failing_for=t,
                       pass_error="KeyError: 'x'"),
], ids=["api-unreachable", "pass-hung", "passes-failing"])
def test_a_lasting_not_reconciling_writes_the_node_on_the_heartbeat_only(live) -> None:
    """A not-ready condition that lasts must not write the Node every tick (1 s): at 5,000
    nodes a fleet-wide problem would be 5,000 Node writes a second, to every Node watcher."""
    cluster = FakeCluster()
    cluster.add_node(NODE)
    clock = Clock()
    config, state = NodeConfig(node_name=NODE), health()
    conds = [evaluate(config, OPTIONS, state, live(0))]
    p = publisher(cluster, conds, clock)
    for second in range(600):
        conds.append(evaluate(config, OPTIONS, state, live(second)))
        p.tick()
        clock.t += 1
    assert conds[-1].reason == "NotReconciling"
    assert len(cluster.node_status_patches) == 10  # the first, then every 60 s


def test_transition_time_survives_an_agent_restart() -> None:
    cluster = FakeCluster()
    cluster.add_node(NODE)
    clock = Clock()
    publisher(cluster, [READY], clock).tick()
    clock.t += 600
    publisher(cluster, [READY], clock).tick()  # a new agent, same status
    cond = cluster.condition(NODE, "gpu-fractioning.nvidia.com/Ready")
    assert cond["lastTransitionTime"] == "2023-11-14T22:13:20Z"
    assert cond["lastHeartbeatTime"] == "2023-11-14T22:23:20Z"
    clock.t += 1
    publisher(cluster, [DOWN], clock).tick()  # a new agent, another status
    cond = cluster.condition(NODE, "gpu-fractioning.nvidia.com/Ready")
    assert cond["lastTransitionTime"] == "2023-11-14T22:23:21Z"


def test_legacy_condition_and_custom_name_are_published_together() -> None:
    cluster = FakeCluster()
    cluster.add_node(NODE)
    p = publisher(cluster, [READY], Clock(), legacy_condition=True,
                  condition_name="example.com/FractionsReady")
    p.tick()
    (patch,) = cluster.node_status_patches
    assert [c["type"] for c in patch] == ["example.com/FractionsReady",
                                          "gpu-sharing.nvidia.com/Ready"]
    assert cluster.condition(NODE, "gpu-fractioning.nvidia.com/Ready") is None


def test_a_failed_publish_is_retried_on_the_next_tick() -> None:
    cluster = FakeCluster()
    cluster.add_node(NODE)
    cluster.fail("patch_node_status", KubeError("patch: 503", 503))
    p = publisher(cluster, [READY], Clock())
    assert not p.tick()
    assert p.tick()
    assert cluster.condition(NODE, "gpu-fractioning.nvidia.com/Ready")["status"] == "True"


# -- the heartbeat Lease (heartbeat.py) ------------------------------------------------------

LEASE = ("kai-fractions", f"kai-fractions-agent.{NODE}")


def leased(cluster: FakeCluster, conds: list[Condition], clock: Clock) -> StatusPublisher:
    cluster.add_node(NODE)
    return publisher(cluster, conds, clock, heartbeat_lease_namespace="kai-fractions")


def test_with_a_lease_the_node_is_written_on_a_change_and_every_report_interval() -> None:
    cluster, clock, conds = FakeCluster(), Clock(), [READY]
    p = leased(cluster, conds, clock)
    assert p.tick()
    assert cluster.leases[LEASE] == {"holderIdentity": NODE, "leaseDurationSeconds": 180,
                                     "renewTime": "2023-11-14T22:13:20.000000Z"}
    for _ in range(4):  # 4 renewals a minute apart, no Node write
        clock.t += 60
        assert not p.tick()
    assert cluster.leases[LEASE]["renewTime"] == "2023-11-14T22:17:20.000000Z"
    assert (cluster.calls["renew_lease"], len(cluster.node_status_patches)) == (5, 1)
    clock.t += 60
    assert p.tick()  # the status report, 300 s on
    assert cluster.condition(NODE, "gpu-fractioning.nvidia.com/Ready")[
        "lastHeartbeatTime"] == "2023-11-14T22:18:20Z"
    clock.t += 1
    conds.append(DOWN)
    assert p.tick()  # a change goes out at once
    assert cluster.calls["renew_lease"] == 6  # and the Lease waits for its own interval


def test_while_the_lease_fails_the_node_carries_the_heartbeat_and_retries_back_off() -> None:
    cluster, clock = FakeCluster(), Clock()
    p = leased(cluster, [READY], clock)
    cluster.fail("renew_lease", KubeError("renew: 403", 403), times=100)
    assert p.tick()  # published; the Lease refused
    tried = []
    for _ in range(130):
        before = cluster.calls["renew_lease"]
        clock.t += 1
        p.tick()
        if cluster.calls["renew_lease"] > before:
            tried.append(clock.t - 1_700_000_000.0)
    assert tried == [1, 3, 7, 15, 31, 63, 123]  # 1, 2, 4 ... s apart, at most 60
    assert len(cluster.node_status_patches) == 3  # the 60 s heartbeat on the Node


def test_a_renewal_after_a_failure_or_a_gap_publishes_the_condition_at_once() -> None:
    cluster, clock = FakeCluster(), Clock()
    p = leased(cluster, [READY], clock)
    p.tick()
    clock.t += 30
    cluster.fail("renew_lease", times=2)
    assert not p.tick() and cluster.calls["renew_lease"] == 1  # not due
    clock.t += 30
    assert not p.tick() and cluster.calls["renew_lease"] == 2  # refused
    clock.t += 1
    assert p.tick()  # the Node carries the heartbeat at once (and the Lease refused again)
    clock.t += 2
    assert not p.tick()  # renewed: back
    clock.t += 1
    assert p.tick()  # so the condition goes out: the follower may have set it Unknown
    clock.t += 200  # the process hung (a stopped container, a paused machine)
    assert p.tick()  # the Node's heartbeat, 60 s without a current Lease
    clock.t += 1
    assert p.tick()  # and once more for the gap the renewal saw
    clock.t += 1
    assert not p.tick()
    assert len(cluster.node_status_patches) == 5


def test_the_lease_is_renewed_only_while_the_condition_can_be_written() -> None:
    # A fresh Lease beside a condition the agent cannot write would hide a stale True from the
    # follower's silent-node check.
    cluster, clock = FakeCluster(), Clock()
    conds = [READY]
    p = leased(cluster, conds, clock)
    p.tick()
    cluster.fail("patch_node_status", times=1000)
    conds.append(DOWN)
    for _ in range(300):
        clock.t += 1
        p.tick()
    assert cluster.calls["renew_lease"] == 1  # the first one only
    assert cluster.condition(NODE, "gpu-fractioning.nvidia.com/Ready")["status"] == "True"
    cluster._faults.clear()
    clock.t += 1
    assert p.tick()  # written again
    clock.t += 1
    p.tick()
    assert cluster.calls["renew_lease"] == 2  # and the Lease with it


def test_the_agent_cli_beats_on_the_node_by_default_and_refuses_a_bad_lease_namespace(
        capsys) -> None:
    from kai_fractions.cli import build_parser, main

    assert build_parser().parse_args(["node-agent"]).heartbeat_lease_namespace == ""
    assert main(["node-agent", "--node-name", "n1", "--heartbeat-lease-namespace", "KF"]) == 2
    assert capsys.readouterr().err == (
        "kai-fractions node-agent: --heartbeat-lease-namespace 'KF': not a namespace name "
        "(lower-case letters, digits and '-', at most 63)\n")


def test_a_node_name_too_long_for_a_lease_beats_on_the_node(caplog) -> None:
    cluster, clock = FakeCluster(), Clock()
    name = "n" * 240
    cluster.add_node(name)
    opts = AgentOptions(socket=None, metrics_listen=None, heartbeat_lease_namespace="kf")
    p = StatusPublisher(cluster, name, opts, lambda: READY, clock=clock, monotonic=clock)
    assert p.lease is None and "too long for a heartbeat Lease name" in caplog.text
    p.tick()
    clock.t += 60
    assert p.tick() and cluster.calls["renew_lease"] == 0


def test_gpu_memory_label_is_set_only_when_missing() -> None:
    cluster = FakeCluster()
    cluster.add_node(NODE)
    publisher(cluster, [READY], Clock(), publish_gpu_memory_label=True).tick()
    assert cluster.nodes[NODE]["metadata"]["labels"] == {"nvidia.com/gpu.memory": "23034"}
    other = FakeCluster()
    other.add_node(NODE, labels={"nvidia.com/gpu.memory": "40960"})
    publisher(other, [READY], Clock(), publish_gpu_memory_label=True).tick()
    assert other.nodes[NODE]["metadata"]["labels"] == {"nvidia.com/gpu.memory": "40960"}
    assert other.calls["patch_node_labels"] == 0
    off = FakeCluster()
    off.add_node(NODE)
    publisher(off, [READY], Clock()).tick()
    assert off.nodes[NODE]["metadata"]["labels"] == {}

