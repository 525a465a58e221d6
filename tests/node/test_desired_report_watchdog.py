"""A watchdog in report mode (`--watchdog-policy=report`, the default) stops nothing: it is a
second line beside a tier that caps (cgroup, mps-pinned), never a container's only one. A
container only it would watch is refused (MemoryLimitsUnsupported), not reported applied while
it runs without a cap: on a driver before r615 with the default flags, that is every
time-slicing container. One that runs already (applied by an agent before this rule) is refused
too, held to its plan, and still watched at its plan's cap (`Refusal.watched`)."""

from __future__ import annotations

from kai_fractions.contract import ContainerPlan, parse_pod, plan_pod
from kai_fractions.node.config import Mechanism, NodeConfig
from kai_fractions.node.desired import (
    ContainerKey,
    DesiredState,
    NodePod,
    RefusalReason,
    plan_node,
)
from kai_fractions.node.nvml import GpuComputeMode

from .nodepods import (
    CID_B,
    GIB,
    GPU0,
    GPU1,
    UID_A,
    UID_B,
    UID_C,
    annotations,
    inventory,
    node_pod,
    watchdog_caps,
)

OLD = "550.54.15"
DEFAULTS = NodeConfig(node_name="node-a")  # cgroup,mps-pinned,watchdog; policy report
RUNNING_REFUSED = (
    "cannot cap this container's GPU memory: NVIDIA driver 550.54.15 has no cgroup GPU "
    "memory limits (they need r615 or newer), mps-pinned applies to sm-sharing containers "
    "only, and a watchdog with --watchdog-policy=report only reports use over the cap, it "
    "stops nothing; this container was started before such a watchdog was refused: until "
    "its pod's sandbox restarts (a node reboot restarts it) it runs without a cap, its "
    "processes left running and their use over the cap only reported (LimitViolation "
    "events), and then its gate fails on this refusal; set --watchdog-policy=kill (the "
    "chart's watchdog.policy: kill) to cap it (the watchdog then stops what exceeds the cap), "
    "or upgrade the driver to r615 or newer")
"""What a container running since before the rule is told (planner and agent tests)."""


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
    # MPS namespaces, no cgroup limits: mps-pinned is the sm-sharing container's tier
    state = plan(sm_sharing(), time_slicing(), memory_limits=False, mps_namespaces=True,
                 driver=OLD)
    (c,) = state.containers
    assert (c.key.pod_uid, c.mechanisms) == (UID_A, {Mechanism.MPS_PINNED, Mechanism.WATCHDOG})
    assert [(r.key.pod_uid, r.reason) for r in state.refusals] == [
        (UID_B, RefusalReason.MEMORY_LIMITS_UNSUPPORTED)]


def test_sm_sharing_with_only_a_report_watchdog_is_refused_and_mps_pinned_named() -> None:
    # (named where the MPS daemon has namespaces: without them it would cap nothing)
    state = plan(sm_sharing(), memory_limits=False, mps_namespaces=True, driver=OLD,
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


# -- a container that runs already: applied before this rule, the agent upgraded since ---------


def running(pod: NodePod) -> dict[ContainerKey, ContainerPlan]:
    """The plan in force for each of the pod's containers (as `applied.applied_plans` reads it
    back from the marker an agent before this rule wrote with the mechanisms {watchdog})."""
    return {ContainerKey(pod.uid, p.container): p for p in plan_pod(parse_pod(pod.view))}


def test_a_running_container_is_refused_held_and_still_watched() -> None:
    pod = time_slicing()
    held = running(pod)
    state = plan_node([pod], inventory(memory_limits=False, driver=OLD), DEFAULTS, applied=held)
    (r,) = state.refusals
    (plan,) = held.values()
    assert (r.reason, r.final, r.plan_digest) == (
        RefusalReason.MEMORY_LIMITS_UNSUPPORTED, True, plan.digest)
    assert r.message == RUNNING_REFUSED
    # nothing applied: no container, no limit; the watchdog keeps it at the plan's cap (report)
    assert state.containers == () and state.limits == ()
    assert UID_B in state.owned_pods
    assert r.watched is not None and state.watched == (r.watched,)
    assert (r.watched.container_id, r.watched.mechanisms, r.watched.plan) == (
        CID_B, {Mechanism.WATCHDOG}, plan)
    assert watchdog_caps(state) == {(UID_B, "main"): {GPU1: 20 * GIB}}
    (m,) = state.watchdog_containers()
    assert m.mps_client is False  # time-slicing
    # its place on the GPU is kept: its memory, and its compute mode
    assert state.gpu(GPU1).requested_bytes == plan.request_bytes


def test_a_newcomer_does_not_take_a_watched_containers_gpu_to_another_compute_mode() -> None:
    pod = time_slicing()
    newcomer = node_pod(UID_C, name="n", notes=annotations(mode="sm-sharing", devices=(GPU1,)),
                        created="2030-01-01T00:00:00Z")
    # (MPS namespaces: the newcomer has mps-pinned, which caps it, and is judged on its mode)
    state = plan_node([pod, newcomer], inventory(memory_limits=False, mps_namespaces=True,
                                                 driver=OLD), DEFAULTS, applied=running(pod))
    assert {(r.key.pod_uid, r.reason) for r in state.refusals} == {
        (UID_B, RefusalReason.MEMORY_LIMITS_UNSUPPORTED), (UID_C, RefusalReason.COMPUTE_MODE_MIX)}
    assert state.gpu(GPU1).compute_mode is GpuComputeMode.DEFAULT


def test_a_new_container_is_refused_and_not_watched() -> None:
    state = plan(time_slicing(), memory_limits=False, driver=OLD)
    (r,) = state.refusals
    assert (r.plan_digest, r.watched, state.watched) == ("", None, ())
    assert "(the container would run without a cap)" in r.message


def test_a_kill_policy_keeps_a_running_container_applied() -> None:
    pod = time_slicing()
    state = plan_node([pod], inventory(memory_limits=False, driver=OLD),
                      NodeConfig(node_name="node-a", watchdog_policy="kill"), applied=running(pod))
    assert state.refusals == () and state.watched == ()
    (c,) = state.containers
    assert c.mechanisms == {Mechanism.WATCHDOG}
    assert watchdog_caps(state) == {(UID_B, "main"): {GPU1: 20 * GIB}}


def test_a_running_container_no_enabled_watchdog_would_watch_is_not_watched() -> None:
    pod = time_slicing()
    state = plan_node([pod], inventory(memory_limits=False, driver=OLD),
                      NodeConfig(node_name="node-a", memory_enforcement="cgroup,mps-pinned"),
                      applied=running(pod))
    (r,) = state.refusals
    assert r.plan_digest and r.watched is None
    assert state.watchdog_containers() == ()
