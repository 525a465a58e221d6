"""A watchdog in report mode (`--watchdog-policy=report`, the default) stops nothing: it is a
second line beside a tier that caps (cgroup, mps-pinned), never a container's only one. A
container only it would watch is refused (MemoryLimitsUnsupported), not reported applied while
it runs without a cap: on a driver before r615 with the default flags, that is every
time-slicing container."""

from __future__ import annotations

from kai_fractions.node.config import Mechanism, NodeConfig
from kai_fractions.node.desired import DesiredState, NodePod, RefusalReason, plan_node

from .nodepods import (
    CID_B,
    GIB,
    GPU0,
    GPU1,
    UID_A,
    UID_B,
    annotations,
    inventory,
    node_pod,
    watchdog_caps,
)

OLD = "550.54.15"
DEFAULTS = NodeConfig(node_name="node-a")  # cgroup,mps-pinned,watchdog; policy report


def plan(*pods: NodePod, config: NodeConfig = DEFAULTS, **inv) -> DesiredState:
    return plan_node(pods, inventory(**inv), config)


def time_slicing(uid: str = UID_B) -> NodePod:
    return node_pod(uid, name="q", notes=annotations(mode="time-slicing", devices=(GPU1,)),
                    container_ids={"main": CID_B})


def sm_sharing(uid: str = UID_A) -> NodePod:
    return node_pod(uid, notes=annotations(mode="sm-sharing", devices=(GPU0,)))


def assert_nothing_for(state: DesiredState, uid: str) -> None:
    assert all(t.pod_uid != uid for t in state.limits)
    assert all(c.key.pod_uid != uid for c in state.containers)
    assert all(k.pod_uid != uid for g in state.gpus for k in g.containers)
    assert all(m.pod_uid != uid for m in state.watchdog_containers())


def test_default_flags_on_an_old_driver_refuse_time_slicing_and_say_why() -> None:
    state = plan(time_slicing(), memory_limits=False, driver=OLD)
    (r,) = state.refusals
    assert (r.key.pod_uid, r.reason, r.final) == (
        UID_B, RefusalReason.MEMORY_LIMITS_UNSUPPORTED, True)
    assert r.message == (
        "cannot cap this container's GPU memory: NVIDIA driver 550.54.15 has no cgroup GPU "
        "memory limits (they need r615 or newer), mps-pinned applies to sm-sharing containers "
        "only, and a watchdog with --watchdog-policy=report only reports use over the cap, it "
        "stops nothing (the container would run without a cap); set --watchdog-policy=kill (the "
        "chart's watchdog.policy: kill) so that the watchdog caps the memory by stopping what "
        "exceeds it, or upgrade the driver to r615 or newer")
    assert state.containers == ()
    assert_nothing_for(state, UID_B)


def test_a_kill_watchdog_is_a_tier_on_its_own() -> None:
    state = plan(time_slicing(), memory_limits=False, driver=OLD,
                 config=NodeConfig(node_name="node-a", watchdog_policy="kill"))
    assert state.refusals == ()
    (c,) = state.containers
    assert c.mechanisms == {Mechanism.WATCHDOG}
    assert watchdog_caps(state) == {(UID_B, "main"): {GPU1: 20 * GIB}}


def test_a_report_watchdog_stays_a_second_line_beside_cgroup() -> None:
    state = plan(time_slicing())
    assert state.refusals == ()
    (c,) = state.containers
    assert c.mechanisms == {Mechanism.CGROUP, Mechanism.WATCHDOG}
    assert watchdog_caps(state) == {(UID_B, "main"): {GPU1: 20 * GIB}}  # it reports there


def test_a_report_watchdog_stays_a_second_line_beside_mps_pinned() -> None:
    state = plan(sm_sharing(), time_slicing(), memory_limits=False, driver=OLD)
    (c,) = state.containers
    assert (c.key.pod_uid, c.mechanisms) == (UID_A, {Mechanism.MPS_PINNED, Mechanism.WATCHDOG})
    assert [(r.key.pod_uid, r.reason) for r in state.refusals] == [
        (UID_B, RefusalReason.MEMORY_LIMITS_UNSUPPORTED)]


def test_sm_sharing_with_only_a_report_watchdog_is_refused_and_mps_pinned_named() -> None:
    state = plan(sm_sharing(), memory_limits=False, driver=OLD,
                 config=NodeConfig(memory_enforcement="cgroup,watchdog"))
    (r,) = state.refusals
    assert r.reason is RefusalReason.MEMORY_LIMITS_UNSUPPORTED
    assert r.message.endswith(
        "set --watchdog-policy=kill (the chart's watchdog.policy: kill) so that the watchdog "
        "caps the memory by stopping what exceeds it, or upgrade the driver to r615 or newer, "
        "or add mps-pinned to --memory-enforcement")
    assert_nothing_for(state, UID_A)


def test_watchdog_only_in_report_mode_is_refused_on_a_new_driver_too() -> None:
    state = plan(time_slicing(), config=NodeConfig(memory_enforcement="watchdog"))
    (r,) = state.refusals
    assert r.message == (
        "cannot cap this container's GPU memory: the cgroup tier is not enabled, and a "
        "watchdog with --watchdog-policy=report only reports use over the cap, it stops "
        "nothing (the container would run without a cap); set --watchdog-policy=kill (the "
        "chart's watchdog.policy: kill) so that the watchdog caps the memory by stopping what "
        "exceeds it, or add cgroup to --memory-enforcement")
    applied = plan(time_slicing(), config=NodeConfig(memory_enforcement="watchdog",
                                                      watchdog_policy="kill"))
    assert applied.refusals == () and applied.containers[0].mechanisms == {Mechanism.WATCHDOG}
