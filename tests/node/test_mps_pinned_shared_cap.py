"""The MPS daemon holds one default pinned device memory limit per GPU, the largest cap of the
GPU's mps-pinned containers. mps-pinned is a container's memory tier only where that limit is
its own cap (on every GPU it uses): below it, the daemon bounds it at the larger cap, and its own
rests on its client env (CUDA_MPS_PINNED_DEVICE_MEM_LIMIT), which its processes can change. Such
a container loses mps-pinned and keeps what it has left (cgroup, a kill watchdog) or, with
nothing left, is refused MemoryLimitsUnsupported; one that runs already stays watched."""

from __future__ import annotations

from kai_fractions.contract import ContainerPlan, parse_pod, plan_pod
from kai_fractions.node.config import Mechanism, NodeConfig
from kai_fractions.node.desired import ContainerKey, DesiredState, NodePod, RefusalReason, plan_node

from .nodepods import (
    CID_B,
    CID_C,
    GIB,
    GPU0,
    GPU1,
    UID_A,
    UID_C,
    annotations,
    inventory,
    node_pod,
    watchdog_caps,
)

OLD = "550.54.15"
DEFAULTS = NodeConfig(node_name="node-a")  # cgroup,mps-pinned,watchdog; policy report
KILL = NodeConfig(node_name="node-a", watchdog_policy="kill")
BELOW = (
    "cannot cap this container's GPU memory: the MPS daemon holds one default pinned device "
    f"memory limit per GPU, and GPU {GPU0}'s is 40960 MiB, the largest cap of the sm-sharing "
    "containers on it; this container's cap of 10240 MiB would rest on its own environment "
    "(CUDA_MPS_PINNED_DEVICE_MEM_LIMIT), which its processes can change, and no other enabled "
    "tier caps it (a watchdog with --watchdog-policy=report stops nothing)")
FIXES = (
    "; set --watchdog-policy=kill (the chart's watchdog.policy: kill), or upgrade the driver to "
    "r615 or newer for the cgroup tier, or place sm-sharing containers of equal caps together "
    "on a GPU")


def sm(uid: str, limit: str, *, request: str = "5Gi", devices: tuple[str, ...] = (GPU0,),
       created: str = "2025-01-01T00:00:00Z", cid: str = CID_B) -> NodePod:
    return node_pod(uid, name=f"pod-{uid[-1]}", created=created, container_ids={"main": cid},
                    notes=annotations(mode="sm-sharing", request=request, limit=limit,
                                      devices=devices))


def old_driver(*pods: NodePod, config: NodeConfig = DEFAULTS,
               applied: dict[ContainerKey, ContainerPlan] | None = None) -> DesiredState:
    """No cgroup limits, an MPS daemon with namespaces (mps-pinned is a tier only there)."""
    return plan_node(pods, inventory(memory_limits=False, mps_namespaces=True, driver=OLD),
                     config, applied=applied)


def mechanisms(state: DesiredState) -> dict[str, frozenset[Mechanism]]:
    return {c.key.pod_uid: c.mechanisms for c in state.containers}


def running(pod: NodePod) -> dict[ContainerKey, ContainerPlan]:
    return {ContainerKey(pod.uid, p.container): p for p in plan_pod(parse_pod(pod.view))}


def test_a_smaller_cap_is_refused_where_mps_pinned_is_its_only_tier() -> None:
    small, large = sm(UID_A, "10Gi"), sm(UID_C, "40Gi", request="20Gi", cid=CID_C)
    state = old_driver(small, large)
    (r,) = state.refusals
    assert (r.key.pod_uid, r.reason, r.final, r.watched) == (
        UID_A, RefusalReason.MEMORY_LIMITS_UNSUPPORTED, True, None)
    assert r.message == BELOW + " (the container would run without its own cap)" + FIXES
    assert mechanisms(state) == {UID_C: {Mechanism.MPS_PINNED, Mechanism.WATCHDOG}}
    gpu = state.gpu(GPU0)
    assert gpu.mps_pinned_mib == 40 * 1024
    # the refused one holds nothing on the GPU: neither its place nor its memory
    assert gpu.containers == (ContainerKey(UID_C, "main"),)
    assert gpu.requested_bytes == 20 * GIB
    assert {m.pod_uid for m in state.watchdog_containers()} == {UID_C}


def test_the_order_of_placing_does_not_matter() -> None:
    small = sm(UID_A, "10Gi", created="2025-06-01T00:00:00Z")
    large = sm(UID_C, "40Gi", created="2025-01-01T00:00:00Z", cid=CID_C)
    state = old_driver(small, large)
    assert [(r.key.pod_uid, r.reason) for r in state.refusals] == [
        (UID_A, RefusalReason.MEMORY_LIMITS_UNSUPPORTED)]
    assert mechanisms(state) == {UID_C: {Mechanism.MPS_PINNED, Mechanism.WATCHDOG}}


def test_equal_caps_all_keep_mps_pinned() -> None:
    state = old_driver(sm(UID_A, "20Gi"), sm(UID_C, "20Gi", cid=CID_C))
    assert state.refusals == ()
    assert mechanisms(state) == {u: {Mechanism.MPS_PINNED, Mechanism.WATCHDOG}
                                 for u in (UID_A, UID_C)}
    assert state.gpu(GPU0).mps_pinned_mib == 20 * 1024


def test_a_kill_watchdog_caps_the_smaller_one_without_mps_pinned() -> None:
    state = old_driver(sm(UID_A, "10Gi"), sm(UID_C, "40Gi", cid=CID_C), config=KILL)
    assert state.refusals == ()
    assert mechanisms(state) == {UID_A: {Mechanism.WATCHDOG},
                                 UID_C: {Mechanism.MPS_PINNED, Mechanism.WATCHDOG}}
    assert watchdog_caps(state)[(UID_A, "main")] == {GPU0: 10 * GIB}


def test_the_cgroup_tier_caps_the_smaller_one_without_mps_pinned() -> None:
    state = plan_node([sm(UID_A, "10Gi"), sm(UID_C, "40Gi", cid=CID_C)], inventory(), DEFAULTS)
    assert state.refusals == ()
    assert mechanisms(state) == {
        UID_A: {Mechanism.CGROUP, Mechanism.WATCHDOG},
        UID_C: {Mechanism.CGROUP, Mechanism.MPS_PINNED, Mechanism.WATCHDOG}}
    assert state.gpu(GPU0).mps_pinned_mib == 40 * 1024


def test_a_multi_gpu_container_needs_the_largest_cap_on_every_gpu() -> None:
    both = sm(UID_A, "20Gi", devices=(GPU0, GPU1))
    larger_on_gpu1 = sm(UID_C, "40Gi", devices=(GPU1,), cid=CID_C)
    state = old_driver(both, larger_on_gpu1)
    (r,) = state.refusals
    assert r.key.pod_uid == UID_A and f"GPU {GPU1}'s is 40960 MiB" in r.message
    assert "this container's cap of 20480 MiB" in r.message
    assert state.gpu(GPU1).mps_pinned_mib == 40 * 1024


def test_a_running_container_below_a_newcomers_cap_is_refused_and_still_watched() -> None:
    """Applied while it was the largest: a larger newcomer raises the GPU's limit past it."""
    small = sm(UID_A, "10Gi")
    large = sm(UID_C, "40Gi", created="2030-01-01T00:00:00Z", cid=CID_C)
    held = running(small)
    (plan,) = held.values()
    state = old_driver(small, large, applied=held)
    (r,) = state.refusals
    assert (r.key.pod_uid, r.reason, r.plan_digest) == (
        UID_A, RefusalReason.MEMORY_LIMITS_UNSUPPORTED, plan.digest)
    assert r.message == BELOW + (
        "; until its pod's sandbox restarts (a node reboot restarts it) this container runs "
        "without its own cap, its processes left running, their use over its cap only reported "
        "(LimitViolation events), and then its gate fails on this refusal") + FIXES
    assert r.watched is not None and r.watched.mechanisms == {Mechanism.WATCHDOG}
    assert watchdog_caps(state) == {(UID_A, "main"): {GPU0: 10 * GIB},
                                    (UID_C, "main"): {GPU0: 40 * GIB}}
    assert mechanisms(state) == {UID_C: {Mechanism.MPS_PINNED, Mechanism.WATCHDOG}}
    # it runs: its memory stays taken on the GPU
    assert state.gpu(GPU0).requested_bytes == 2 * 5 * GIB
