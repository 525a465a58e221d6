"""The node condition while no GPU memory limit can be set on a GPU (`MemoryLimitsNotSettable`).

Before: on a node where every cgroup limit set failed (the agent not root: NoPermission) or every
read and set was NotSupported, each fractional container there was pending
(MemoryLimitNotInForce, or NVML's reason) but the node stayed True `AgentReady`, so KAI kept
placing fractional pods there whose gates could only wait until their timeout.

Now the condition is False `MemoryLimitsNotSettable` once a set on a pod slice on a GPU failed (or
a slice's read failed NotSupported or NoPermission) and no set there succeeded
(`Engine.limits_not_settable`) -- in that very pass where the failure cannot be a blip (refused
NoPermission or NotSupported), else in two passes in a row -- naming each GPU, NVML's reason and
what to do, and True again once a set there succeeds, every target there reads back in force, or
no target is left on it. Only sets count: an earlier pod's slice limit that reads back in force
does not make the GPU fine while new pods' sets fail there. A container's own cgroup that cannot
be limited under a pod slice that is does not count (the slice caps it), nor does one pass
failed for a reason that may be a blip (Unknown, GPULost, a limit read back otherwise)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kai_fractions.node.agent.condition import Health, Liveness, evaluate
from kai_fractions.node.agent.options import AgentOptions
from kai_fractions.node.config import NodeConfig
from kai_fractions.node.errors import nvml_error

from .builders import (
    GIB,
    NODE,
    Rig,
    binder_annotations,
    condition,
    leaf_of,
    limits_of,
    pod,
    result_of,
)

NVML_ERROR_NO_PERMISSION = 4  # nvmlReturn_t
NOT_SETTABLE = "MemoryLimitsNotSettable"


def ts_pod(rig: Rig, name: str = "p", gpu: str | None = None) -> str:
    return rig.add(pod(name, notes=binder_annotations(devices=gpu or rig.gpu0))
                   )["metadata"]["uid"]


def test_the_node_is_not_ready_while_no_limit_can_be_set_for_lack_of_permission(
        short_tmp: Path) -> None:
    """The reviewer's probe p4b: every set is refused (the agent not root), reads work. From
    the first pass on (a refusal is no blip: review finding S2-1), the message names the GPU,
    NVML's reason and what to do, the same every pass."""
    rig = Rig(short_tmp, sm_sharing=False)
    rig.nvml.fail("set_memory_limits", "NoPermission", times=None)
    uid = ts_pod(rig)
    messages = set()
    for _ in range(4):
        rig.step()
        assert result_of(rig, uid).reason == "MemoryLimitNotInForce"
        ready, reason, message = condition(rig)
        assert (ready, reason) == (False, NOT_SETTABLE)
        messages.add(message)
        rig.reconciler.engine.forget()  # a periodic resync changes nothing of it
    assert len(messages) == 1
    assert message.startswith(
        f"no GPU memory limit can be set on GPU(s) {rig.gpu0} (NVMLNoPermission)"), message
    assert "nvmlDeviceSetMemoryLimits_v1" in message
    assert "root" in message and "privileged" in message and "driver" in message
    assert rig.gpu1 not in message

    rig.nvml.clear_failures()  # the agent may set them now
    assert rig.step().converged
    assert condition(rig)[:2] == (True, "AgentReady")


def test_the_node_is_not_ready_where_limits_are_not_supported(short_tmp: Path) -> None:
    """The reviewer's probe p4: every read (and set) is NotSupported; a read that fails for that
    reason counts too (the GPU takes no limit at all), from the first pass on (no blip)."""
    rig = Rig(short_tmp, sm_sharing=False)
    rig.nvml.fail("get_memory_limits", "NotSupported", times=None, device=rig.gpu1)
    rig.nvml.fail("set_memory_limits", "NotSupported", times=None, device=rig.gpu1)
    fine = ts_pod(rig, "fine")
    stuck = ts_pod(rig, "stuck", rig.gpu1)
    for _ in range(3):
        rig.step()
        assert result_of(rig, stuck).reason == "NotSupported"
        assert result_of(rig, fine).reason is None
        ready, reason, message = condition(rig)
        assert (ready, reason) == (False, NOT_SETTABLE)
    assert message.startswith(
        f"no GPU memory limit can be set on GPU(s) {rig.gpu1} (NotSupported)"), message
    assert rig.gpu0 not in message


def test_ready_again_once_no_target_is_left_on_the_gpu(short_tmp: Path) -> None:
    rig = Rig(short_tmp, sm_sharing=False)
    rig.nvml.fail("set_memory_limits", "NoPermission", times=None)
    uid = ts_pod(rig)
    rig.step()
    assert condition(rig)[:2] == (False, NOT_SETTABLE)
    rig.cluster.delete_pod(uid)
    rig.step()
    assert condition(rig)[:2] == (True, "AgentReady")


def test_a_limit_in_force_does_not_hide_sets_that_fail(short_tmp: Path) -> None:
    """A pod whose limits were set before the sets started failing: they read back in force,
    but the second pod's set fails pass after pass, as would every new pod's. Before, that
    limit in force marked the GPU fine and the node stayed ready; now only sets count: not
    ready from the first pass (a refused set is no blip), also once the first pod is gone,
    ready again once a set succeeds."""
    rig = Rig(short_tmp, sm_sharing=False)
    first = ts_pod(rig, "first")
    assert rig.step().converged
    rig.nvml.fail("set_memory_limits", "NoPermission", times=None)
    second = ts_pod(rig, "second")
    rig.step()
    assert result_of(rig, second).reason == "MemoryLimitNotInForce"
    assert result_of(rig, first).reason is None
    assert condition(rig)[:2] == (False, NOT_SETTABLE)
    rig.step()
    assert result_of(rig, first).reason is None
    assert condition(rig)[:2] == (False, NOT_SETTABLE)
    rig.cluster.delete_pod(first)
    rig.step()
    assert result_of(rig, second).reason == "MemoryLimitNotInForce"
    assert condition(rig)[:2] == (False, NOT_SETTABLE)
    rig.nvml.clear_failures()
    assert rig.step().converged
    assert condition(rig)[:2] == (True, "AgentReady")


def test_an_agent_restarted_without_root_is_not_ready_though_an_old_limit_reads_in_force(
        short_tmp: Path) -> None:
    """Review finding S1-1 (probe p3): the agent restarted without root (every set refused)
    over a node where an earlier pod's slice limit still reads back in force. Before, that read
    marked the GPU fine: the node stayed True `AgentReady` while every new pod there waited
    (MemoryLimitNotInForce). Now the failed sets count, the read does not: False
    `MemoryLimitsNotSettable` from the first pass (a refusal is no blip), naming the GPU and
    NoPermission."""
    rig = Rig(short_tmp, sm_sharing=False)
    old = ts_pod(rig, "old")
    assert rig.step().converged
    rig = rig.restarted()
    rig.nvml.fail("set_memory_limits", "NoPermission", times=None)
    new = [ts_pod(rig, f"new{i}") for i in range(3)]
    rig.step()
    assert condition(rig)[:2] == (False, NOT_SETTABLE)
    rig.step()
    assert result_of(rig, old).reason is None
    assert {result_of(rig, u).reason for u in new} == {"MemoryLimitNotInForce"}
    ready, reason, message = condition(rig)
    assert (ready, reason) == (False, NOT_SETTABLE)
    assert message.startswith(
        f"no GPU memory limit can be set on GPU(s) {rig.gpu0} (NVMLNoPermission)"), message


def test_a_restarted_agent_where_every_set_is_refused_is_not_ready_from_its_first_pass(
        short_tmp: Path) -> None:
    """Review finding S2-1 (probe p_restart_flap_b): every set refused NoPermission, the node
    False `MemoryLimitsNotSettable`; the agent restarts. Before, the new agent counted the
    failed passes afresh (in memory) and reported True `AgentReady` after its first pass, False
    again after its second: False -> True -> False across the restart, a window in which KAI
    may place pods there. Now a refused set is no blip: False from its first pass."""
    rig = Rig(short_tmp, sm_sharing=False)
    rig.nvml.fail("set_memory_limits", "NoPermission", times=None)
    uid = ts_pod(rig)
    for _ in range(3):
        rig.step()
    assert condition(rig)[:2] == (False, NOT_SETTABLE)
    new = rig.restarted()
    new.step()
    assert result_of(new, uid).reason == "MemoryLimitNotInForce"
    ready, reason, message = condition(new)
    assert (ready, reason) == (False, NOT_SETTABLE)
    assert message.startswith(
        f"no GPU memory limit can be set on GPU(s) {rig.gpu0} (NVMLNoPermission)"), message


def test_a_set_failing_for_a_reason_that_may_be_a_blip_is_reported_from_its_second_pass(
        short_tmp: Path) -> None:
    """The two-pass rule is kept where the failure may be transient (S2-1 changed only the
    refusals): every set failing Unknown leaves the node ready after the first pass, not ready
    from the second."""
    rig = Rig(short_tmp, sm_sharing=False)
    rig.nvml.fail("set_memory_limits", "Unknown", times=None, device=rig.gpu0)
    uid = ts_pod(rig)
    rig.step()
    assert result_of(rig, uid).reason == "MemoryLimitNotInForce"
    assert condition(rig)[:2] == (True, "AgentReady")
    for _ in range(2):
        rig.step()
        ready, reason, message = condition(rig)
        assert (ready, reason) == (False, NOT_SETTABLE)
    assert message.startswith(
        f"no GPU memory limit can be set on GPU(s) {rig.gpu0} (NVMLError)"), message


def test_a_limit_read_back_other_than_set_is_reported_from_its_second_pass(
        short_tmp: Path) -> None:
    """A set that returns success while the limit reads back otherwise (LimitNotReadBack) may
    be a blip too: two passes, as before S2-1."""
    rig = Rig(short_tmp, sm_sharing=False)
    rig.nvml.set_memory_limits = lambda *args: None  # type: ignore[method-assign]
    uid = ts_pod(rig)
    rig.step()
    assert result_of(rig, uid).reason == "MemoryLimitNotInForce"
    assert condition(rig)[:2] == (True, "AgentReady")
    rig.step()
    ready, reason, message = condition(rig)
    assert (ready, reason) == (False, NOT_SETTABLE)
    assert "(LimitNotReadBack)" in message, message


@pytest.mark.parametrize("times", [1, 2])
@pytest.mark.parametrize("call, reason", [("get_memory_limits", "Unknown"),
                                          ("set_memory_limits", "Unknown"),
                                          ("set_memory_limits", "GpuIsLost")])
def test_one_failed_pass_leaves_the_node_ready(short_tmp: Path, call: str, reason: str,
                                               times: int) -> None:
    """Review finding S1-2 (probe p1_flap): one pass in which the NVML calls on a GPU fail
    (`times` failures: with 2, every read of a running pod's slice and container cgroup, or
    every set of a new pod's, in that one pass). Before, that pass turned the whole node False
    `MemoryLimitsNotSettable` and the next True again: one transient error flapped it. Now
    it stays True `AgentReady` throughout (a GPU is reported only after two passes failed for
    a reason that may be a blip). Review finding S2-1: the cases of a read failed NotSupported
    and a set refused NoPermission went from here: those are no blip, reported at once
    (`test_a_restarted_agent_where_every_set_is_refused_is_not_ready_from_its_first_pass`)."""
    rig = Rig(short_tmp, sm_sharing=False)
    if call == "get_memory_limits":
        uid = ts_pod(rig)
        assert rig.step().converged
        rig.reconciler.engine.forget()  # the next pass reads the limits again
    else:
        rig.step()
        uid = None
    rig.nvml.fail(call, reason, times=times, device=rig.gpu0)
    if uid is None:
        uid = ts_pod(rig)
    rig.step()
    assert result_of(rig, uid).reason is not None  # the pass did fail
    assert condition(rig)[:2] == (True, "AgentReady")
    for _ in range(2):
        rig.step()
        assert result_of(rig, uid).reason is None
        assert condition(rig)[:2] == (True, "AgentReady")


def test_a_containers_own_cgroup_that_cannot_be_limited_under_a_limited_slice_is_fine(
        short_tmp: Path) -> None:
    """The container's own cgroup made again and its set refused, pass after pass, while its
    pod slice's limit is in force: the slice caps the container, so that failed set does not
    count against the GPU and the node stays ready. The slice made again and its set refused
    too: not ready from the second pass."""
    rig = Rig(short_tmp, sm_sharing=False)
    uid = ts_pod(rig)
    assert rig.step().converged
    rig.nvml.limits.pop((rig.gpu0, leaf_of(uid)))
    set_limits = rig.nvml.set_memory_limits

    def refused_on_the_leaf(uuid: str, namespace: str, soft: int, hard: int) -> None:
        if namespace == leaf_of(uid):
            raise nvml_error(NVML_ERROR_NO_PERMISSION, "nvmlDeviceSetMemoryLimits_v1",
                             device=uuid)
        set_limits(uuid, namespace, soft, hard)

    rig.nvml.set_memory_limits = refused_on_the_leaf  # type: ignore[method-assign]
    for _ in range(2):
        rig.reconciler.engine.forget()
        rig.step()
        assert result_of(rig, uid).reason == "NVMLNoPermission"
        assert leaf_of(uid) not in limits_of(rig, uid)
        assert condition(rig)[:2] == (True, "AgentReady")
    # the slice made again too, its set refused as well: no limit in force on the GPU
    rig.nvml.limits.clear()
    rig.nvml.fail("set_memory_limits", "NoPermission", times=None)
    rig.step()
    rig.step()
    assert result_of(rig, uid).reason == "MemoryLimitNotInForce"
    assert condition(rig)[:2] == (False, NOT_SETTABLE)
    rig.nvml.clear_failures()
    rig.nvml.set_memory_limits = set_limits  # type: ignore[method-assign]
    assert rig.step().converged
    assert limits_of(rig, uid)[leaf_of(uid)] == (10 * GIB, 20 * GIB)
    assert condition(rig)[:2] == (True, "AgentReady")


LIVE = Liveness(synced=True, api_down_for=None, api_error=None, busy_for=None)
OPTIONS = AgentOptions(socket=None, metrics_listen=None, stale_after_seconds=60)


def test_the_reasons_order(short_tmp: Path) -> None:
    """After an unwritable marker directory (no gate opens at all), before the compute mode
    and a blind watchdog; every GPU named, each with NVML's reason."""
    rig = Rig(short_tmp)
    rig.step()
    inventory = rig.reconciler.view.health.inventory
    health = Health(inventory=inventory, passes=1, mps_namespaces=True,
                    watchdog_blind=(("GPU-1", "NVMLNoPermission"),),
                    wrong_compute_mode=(("GPU-1", "DEFAULT", "NVMLNoPermission"),),
                    limits_not_settable=(
                        ("GPU-1", "NVMLNoPermission", "NVML refused it on GPU GPU-1"),
                        ("GPU-2", "NotSupported", "not supported on GPU GPU-2")))
    config = NodeConfig(node_name=NODE)
    cond = evaluate(config, OPTIONS, health, LIVE)
    assert (cond.ready, cond.reason) == (False, NOT_SETTABLE)
    assert "GPU-1 (NVMLNoPermission), GPU-2 (NotSupported)" in cond.message
    assert "NVML refused it on GPU GPU-1" in cond.message
    unwritable = Liveness(synced=True, api_down_for=None, api_error=None, busy_for=None,
                          markers_unwritable="disk full")
    assert evaluate(config, OPTIONS, health, unwritable).reason == "MarkerDirectoryNotWritable"
