"""The node condition while a GPU an sm-sharing plan needs in EXCLUSIVE_PROCESS reads back another
compute mode that the agent cannot set (`ComputeModeNotInForce`).

Before: its sm-sharing containers were pending and their markers set aside, but the node stayed
True `AgentReady`, so KAI kept placing sm-sharing pods on a GPU where they could only wait (a new
pod got no event either, and its gate failed after its wait). `WatchdogBlind` already makes the
node False for that reason.

Now the condition is False `ComputeModeNotInForce` while it lasts, naming each GPU, the mode read
back and what to do, and True again once the mode is in force or no plan needs it."""

from __future__ import annotations

from pathlib import Path

from kai_fractions.node.agent.condition import Health, Liveness, evaluate
from kai_fractions.node.agent.options import AgentOptions
from kai_fractions.node.config import NodeConfig
from kai_fractions.node.nvml import GpuComputeMode

from .builders import NODE, Rig, binder_annotations, condition, pod, result_of


def sm_pod(rig: Rig, name: str = "sm") -> str:
    return rig.add(pod(name, notes=binder_annotations(devices=rig.gpu0, mode="sm-sharing"))
                   )["metadata"]["uid"]


def test_the_node_is_not_ready_while_an_sm_sharing_gpu_cannot_be_put_in_exclusive_process(
        short_tmp: Path) -> None:
    """The reviewer's probe: an agent that may not set compute modes, a new sm-sharing pod."""
    rig = Rig(short_tmp)
    rig.nvml.fail("set_compute_mode", "NoPermission", times=None)
    uid = sm_pod(rig)
    for _ in range(2):
        rig.step()
        assert result_of(rig, uid).reason == "ComputeModeNotInForce"
        ready, reason, message = condition(rig)
        assert (ready, reason) == (False, "ComputeModeNotInForce")
    assert message.startswith(
        f"GPU(s) {rig.gpu0} (reads back DEFAULT; the agent's set failed: NVMLNoPermission) are "
        "not in the compute mode EXCLUSIVE_PROCESS that sm-sharing needs: a process that leaves "
        "MPS would run outside every MPS cap"), message
    assert f"run nvidia-smi -i {rig.gpu0} -c EXCLUSIVE_PROCESS, or let the node agent set it " \
           "(check its permissions" in message
    assert rig.gpu1 not in message

    rig.nvml.clear_failures()  # the agent may set it now
    assert rig.step().converged
    assert rig.nvml.gpu(rig.gpu0).compute_mode is GpuComputeMode.EXCLUSIVE_PROCESS
    assert condition(rig)[:2] == (True, "AgentReady")


def test_ready_again_once_no_plan_needs_the_mode(short_tmp: Path) -> None:
    rig = Rig(short_tmp)
    rig.nvml.fail("set_compute_mode", "NoPermission", times=None)
    uid = sm_pod(rig)
    rig.step()
    assert condition(rig)[:2] == (False, "ComputeModeNotInForce")
    rig.cluster.delete_pod(uid)
    rig.step()
    assert condition(rig)[:2] == (True, "AgentReady")
    assert rig.nvml.gpu(rig.gpu0).compute_mode is GpuComputeMode.DEFAULT


def test_a_time_slicing_gpu_left_in_exclusive_process_keeps_the_node_ready(
        short_tmp: Path) -> None:
    """It only keeps a second process from starting: its containers are pending with NVML's
    error, the node stays as it is."""
    rig = Rig(short_tmp)
    rig.nvml.gpu(rig.gpu0).compute_mode = GpuComputeMode.EXCLUSIVE_PROCESS
    rig.nvml.fail("set_compute_mode", "NoPermission", times=None)
    uid = rig.add(pod("ts", notes=binder_annotations(devices=rig.gpu0)))["metadata"]["uid"]
    rig.step()
    assert result_of(rig, uid).reason == "NVMLNoPermission"
    assert condition(rig)[:2] == (True, "AgentReady")


LIVE = Liveness(synced=True, api_down_for=None, api_error=None, busy_for=None)
OPTIONS = AgentOptions(socket=None, metrics_listen=None, stale_after_seconds=60)


def test_the_reasons_order(short_tmp: Path) -> None:
    """What the whole node lacks first (NotReconciling), then the compute mode before a blind
    watchdog, as a container's own reason puts it first (no MPS cap holds without it)."""
    rig = Rig(short_tmp)
    rig.step()
    inventory = rig.reconciler.view.health.inventory
    both = Health(inventory=inventory, passes=1, mps_namespaces=True,
                  watchdog_blind=(("GPU-1", "NVMLNoPermission"),),
                  wrong_compute_mode=(("GPU-1", "DEFAULT", "NVMLNoPermission"),
                                      ("GPU-2", "PROHIBITED", "NVMLNoPermission")))
    config = NodeConfig(node_name=NODE)
    cond = evaluate(config, OPTIONS, both, LIVE)
    assert cond.reason == "ComputeModeNotInForce"
    assert "GPU-1 (reads back DEFAULT; " in cond.message
    assert "GPU-2 (reads back PROHIBITED; " in cond.message
    assert ("nvidia-smi -i GPU-1 -c EXCLUSIVE_PROCESS; nvidia-smi -i GPU-2 -c EXCLUSIVE_PROCESS"
            in cond.message)
    unsynced = Liveness(synced=False, api_down_for=None, api_error=None, busy_for=None)
    assert evaluate(config, OPTIONS, both, unsynced).reason == "NotReconciling"
