"""The pure node plan: limits, paths, compute modes, MPS namespaces, and every refusal reason."""

from __future__ import annotations

import pytest

from kai_fractions.contract import mps_namespace_name, parse_pod, plan_pod
from kai_fractions.node.cgroups import QosClass
from kai_fractions.node.config import Mechanism, NodeConfig
from kai_fractions.node.desired import (
    ComputeEnforcement,
    ContainerKey,
    DesiredState,
    LimitTarget,
    NodePod,
    RefusalReason,
    plan_node,
)
from kai_fractions.node.nvml import GpuComputeMode

from .nodepods import (
    CID_A,
    CID_B,
    GIB,
    GPU0,
    GPU1,
    MIB,
    UID_A,
    UID_B,
    UID_C,
    annotations,
    device,
    inventory,
    manifest,
    node_pod,
    pod_cgroup,
    watchdog_caps,
)

ROOT = "/sys/fs/cgroup"
CONFIG = NodeConfig(node_name="node-a")
SLICE_A = pod_cgroup(ROOT, UID_A)
LEAF_A = f"{SLICE_A}/cri-containerd-{'a' * 64}.scope"


def plan(*pods: NodePod, config: NodeConfig = CONFIG, **inv) -> DesiredState:
    return plan_node(pods, inventory(**inv) if inv else inventory(), config)


def assert_nothing_for(state: DesiredState, uid: str) -> None:
    """A refused (or pending) pod gets nothing: no limits, no GPU membership, no namespace."""
    assert all(t.pod_uid != uid for t in state.limits)
    assert all(c.key.pod_uid != uid for c in state.containers)
    assert all(k.pod_uid != uid for g in state.gpus for k in g.containers)
    assert all(m.pod_uid != uid for m in state.watchdog_containers())


def test_sm_sharing_container_plan() -> None:
    p = node_pod(notes=annotations(mode="sm-sharing", portion="0.25"))
    state = plan(p)
    assert state.refusals == ()
    (c,) = state.containers
    assert c.key == ContainerKey(UID_A, "main")
    assert c.ref == "default/p/main"
    assert c.qos is QosClass.BURSTABLE
    assert c.pod_cgroup == SLICE_A
    assert c.container_cgroup == LEAF_A
    assert c.mechanisms == {Mechanism.CGROUP, Mechanism.MPS_PINNED, Mechanism.WATCHDOG}
    assert c.compute is ComputeEnforcement.MPS_NAMESPACE
    assert c.mps_namespace == mps_namespace_name(UID_A, "main")
    assert c.active_thread_percentage == 25
    assert c.device_indexes == (0,)
    assert c.plan.request_bytes == 10 * GIB and c.plan.limit_bytes == 20 * GIB
    assert state.limits == (
        LimitTarget(GPU0, SLICE_A, 10 * GIB, 20 * GIB, UID_A, None),
        LimitTarget(GPU0, LEAF_A, 10 * GIB, 20 * GIB, UID_A, "main"),
    )
    g0, g1 = state.gpus
    assert (g0.uuid, g0.compute_mode, g0.containers) == (
        GPU0, GpuComputeMode.EXCLUSIVE_PROCESS, (c.key,))
    assert g0.requested_bytes == 10 * GIB and g0.mps_pinned_mib == 20 * 1024
    assert (g1.compute_mode, g1.containers, g1.mps_pinned_mib) == (None, (), None)
    assert state.mps_namespaces == {c.mps_namespace}
    assert watchdog_caps(state) == {(UID_A, "main"): {GPU0: 20 * GIB}}
    assert state.owned_pods == {UID_A}


def test_time_slicing_wants_default_mode_and_no_mps() -> None:
    state = plan(node_pod(notes=annotations(mode="time-slicing", portion=None)))
    (c,) = state.containers
    assert c.compute is ComputeEnforcement.TIME_SLICING and c.mps_namespace is None
    assert c.mechanisms == {Mechanism.CGROUP, Mechanism.WATCHDOG}
    assert state.gpus[0].compute_mode is GpuComputeMode.DEFAULT
    assert state.gpus[0].mps_pinned_mib is None
    assert state.mps_namespaces == frozenset()


def test_memory_is_planned_in_whole_mib_rounded_up() -> None:
    state = plan(node_pod(notes=annotations(request="1000M", limit="1500M")))
    assert {(t.soft, t.hard) for t in state.limits} == {(954 * MIB, 1431 * MIB)}


def test_multi_device_container_gets_limits_on_each_gpu() -> None:
    state = plan(node_pod(notes=annotations(devices=(GPU0, GPU1))))
    assert [(t.gpu_uuid, t.path) for t in state.limits] == [
        (GPU0, SLICE_A), (GPU1, SLICE_A), (GPU0, LEAF_A), (GPU1, LEAF_A)]
    assert state.containers[0].device_indexes == (0, 1)


def test_guaranteed_pod_and_cgroupfs_layout() -> None:
    config = NodeConfig(cgroup_root="/host/cgroup", cgroup_driver="cgroupfs")
    state = plan(node_pod(qos="Guaranteed"), config=config)
    assert [t.path for t in state.limits] == [
        f"/host/cgroup/kubepods/pod{UID_A}", f"/host/cgroup/kubepods/pod{UID_A}/{'a' * 64}"]


def test_without_container_id_only_the_pod_slice_is_limited() -> None:
    state = plan(node_pod(container_ids={}))
    (c,) = state.containers
    assert c.container_cgroup is None and c.limits == ()
    assert state.limits == (LimitTarget(GPU0, SLICE_A, 10 * GIB, 20 * GIB, UID_A, None),)


def test_sm_sharing_disabled_node_never_touches_compute_modes() -> None:
    config = NodeConfig(sm_sharing=False)
    state = plan(node_pod(notes=annotations(mode="time-slicing")), config=config)
    assert state.containers and state.gpus[0].compute_mode is None


def test_old_driver_falls_back_per_config() -> None:
    sm = node_pod(UID_A, notes=annotations(mode="sm-sharing"))
    ts = node_pod(UID_B, name="q", notes=annotations(mode="time-slicing", devices=(GPU1,)),
                  container_ids={"main": CID_B})
    # A watchdog that stops what exceeds the cap is a tier; one that only reports is not
    # (test_desired_report_watchdog.py).
    state = plan(sm, ts, memory_limits=False, config=NodeConfig(watchdog_policy="kill"))
    by_uid = {c.key.pod_uid: c for c in state.containers}
    assert by_uid[UID_A].mechanisms == {Mechanism.MPS_PINNED, Mechanism.WATCHDOG}
    assert by_uid[UID_A].compute is ComputeEnforcement.MPS_CLIENT_ENV
    assert by_uid[UID_A].mps_namespace is None
    assert by_uid[UID_B].mechanisms == {Mechanism.WATCHDOG}
    assert state.limits == ()  # no cgroup limits on a driver without them
    assert state.gpus[0].mps_pinned_mib == 20 * 1024


def test_cgroup_only_on_an_old_driver_is_refused() -> None:
    config = NodeConfig(memory_enforcement="cgroup")
    state = plan(node_pod(notes=annotations(mode="time-slicing")), config=config,
                 memory_limits=False, driver="535.104.05")
    (r,) = state.refusals
    assert r.reason is RefusalReason.MEMORY_LIMITS_UNSUPPORTED and r.final
    assert r.message == (
        "cannot cap this container's GPU memory: NVIDIA driver 535.104.05 has no cgroup GPU "
        "memory limits (they need r615 or newer) and --memory-enforcement=cgroup allows no "
        "fallback (mps-pinned applies to sm-sharing containers only); upgrade the driver to "
        "r615 or newer, or add watchdog to --memory-enforcement with --watchdog-policy=kill (a "
        "watchdog that only reports caps nothing)")
    assert_nothing_for(state, UID_A)
    # with the kill policy already set, adding the watchdog is all it takes
    config = NodeConfig(memory_enforcement="cgroup", watchdog_policy="kill")
    (r,) = plan(node_pod(notes=annotations(mode="time-slicing")), config=config,
                memory_limits=False, driver="535.104.05").refusals
    assert r.message.endswith("; upgrade the driver to r615 or newer, or add watchdog to "
                              "--memory-enforcement")


def test_mps_pinned_only_refuses_time_slicing_without_cgroup_limits_but_serves_sm_sharing(
        ) -> None:
    # (with MPS namespaces: without them mps-pinned is no tier, test_mps_pinned_legacy_tier)
    config = NodeConfig(memory_enforcement="mps-pinned")
    state = plan(node_pod(UID_A, notes=annotations(mode="sm-sharing")),
                 node_pod(UID_B, name="q", notes=annotations(mode="sm-sharing")),
                 node_pod(UID_C, name="r", notes=annotations(mode="time-slicing",
                                                                devices=(GPU1,))),
                 config=config, memory_limits=False, mps_namespaces=True)
    assert {c.key.pod_uid for c in state.containers} == {UID_A, UID_B}
    assert [(r.key.pod_uid, r.reason) for r in state.refusals] == [
        (UID_C, RefusalReason.MEMORY_LIMITS_UNSUPPORTED)]


def test_not_bound_is_pending_not_final() -> None:
    state = plan(node_pod(notes=annotations(devices=None, request=None, limit="4Gi")))
    (r,) = state.refusals
    assert (r.reason, r.final, r.key) == (RefusalReason.NOT_BOUND, False,
                                          ContainerKey(UID_A, "main"))
    assert r.message == (
        "no GPU assigned yet: nvidia.com/container.main.gpus.devices is missing; it is written by "
        "the scheduler's binder (KAI) or the kai-fractions mirror when the pod is bound")
    assert_nothing_for(state, UID_A)


def test_contract_invalid() -> None:
    state = plan(node_pod(notes=annotations(request="lots")))
    (r,) = state.refusals
    assert r.reason is RefusalReason.CONTRACT_INVALID and r.final
    assert r.message.startswith("the pod's GPU annotations are invalid: "
                                "nvidia.com/container.main.gpu-memory.request: GPU memory ")
    assert "(got 'lots')" in r.message and r.message.endswith("fix them and recreate the pod")
    assert_nothing_for(state, UID_A)


def test_sm_sharing_without_a_portion_shares_the_sms_without_a_cap() -> None:
    # Upstream KAI main writes no compute portion: the container is served, its memory capped,
    # its MPS namespace uncapped (100%).
    state = plan(node_pod(notes=annotations(mode="sm-sharing", portion=None)))
    assert state.refusals == ()
    (c,) = state.containers
    assert c.compute is ComputeEnforcement.MPS_NAMESPACE
    assert c.mps_namespace == mps_namespace_name(UID_A, "main")
    assert c.active_thread_percentage == 100
    assert c.plan.request_bytes == 10 * GIB and c.plan.limit_bytes == 20 * GIB
    assert state.gpus[0].compute_mode is GpuComputeMode.EXCLUSIVE_PROCESS
    assert state.gpus[0].mps_pinned_mib == 20 * 1024
    assert watchdog_caps(state) == {(UID_A, "main"): {GPU0: 20 * GIB}}


def test_device_not_on_node() -> None:
    other = "GPU-99999999-9999-9999-9999-999999999999"
    state = plan(node_pod(notes=annotations(devices=(other,))))
    (r,) = state.refusals
    assert r.reason is RefusalReason.DEVICE_NOT_ON_NODE
    assert r.message == (
        f"GPU {other} assigned to this container is not on node node-a (GPUs here: {GPU0}, "
        f"{GPU1}); the pod was bound with a stale or wrong device list: delete it so it is "
        "scheduled again")
    assert_nothing_for(state, UID_A)


def test_mig_gpu_is_refused() -> None:
    state = plan_node([node_pod()], inventory(device(GPU0, 0, mig=True)), CONFIG)
    (r,) = state.refusals
    assert r.reason is RefusalReason.MIG_NOT_SUPPORTED
    assert r.message.startswith(f"GPU {GPU0} is in MIG mode")
    assert_nothing_for(state, UID_A)


def test_sm_sharing_disabled() -> None:
    state = plan(node_pod(notes=annotations(mode="sm-sharing")),
                 config=NodeConfig(sm_sharing=False))
    (r,) = state.refusals
    assert r.reason is RefusalReason.SM_SHARING_DISABLED
    assert r.message == (
        "the container asks for compute mode sm-sharing but this node runs without MPS "
        "(--no-sm-sharing): use time-slicing, or schedule it to a node with sm-sharing enabled")
    assert_nothing_for(state, UID_A)


@pytest.mark.parametrize("reverse", [False, True])
def test_compute_mode_mix_refuses_the_newcomer_whatever_the_input_order(reverse: bool) -> None:
    old = node_pod(UID_A, name="old", notes=annotations(mode="sm-sharing"),
                   created="2025-01-01T00:00:00Z")
    new = node_pod(UID_B, name="new", notes=annotations(mode="time-slicing"),
                   created="2025-01-02T00:00:00Z", container_ids={"main": CID_B})
    pods = [new, old] if reverse else [old, new]
    state = plan(*pods)
    assert [c.key.pod_uid for c in state.containers] == [UID_A]
    (r,) = state.refusals
    assert r.key == ContainerKey(UID_B, "main") and r.reason is RefusalReason.COMPUTE_MODE_MIX
    assert r.message == (
        f"GPU {GPU0} already runs sm-sharing (default/old/main); one GPU runs one compute mode at "
        "a time, so this time-slicing container cannot share it: use the same compute mode as "
        "the GPU's other tenants or let the scheduler pick another GPU")
    assert state.gpus[0].compute_mode is GpuComputeMode.EXCLUSIVE_PROCESS
    assert_nothing_for(state, UID_B)


def test_memory_overcommitted_refuses_the_newcomer() -> None:
    a = node_pod(UID_A, name="a", notes=annotations(request="50Gi", limit="60Gi"),
                 created="2025-01-01T00:00:00Z")
    b = node_pod(UID_B, name="b", notes=annotations(request="30Gi", limit="30Gi"),
                 created="2025-01-01T00:00:01Z", container_ids={"main": CID_B})
    c = node_pod(UID_C, name="c", notes=annotations(request="20Gi", limit="20Gi"),
                 created="2025-01-01T00:00:02Z", container_ids={})
    state = plan(c, b, a)
    assert [x.key.pod_uid for x in state.containers] == [UID_A, UID_C]
    (r,) = state.refusals
    assert r.key.pod_uid == UID_B and r.reason is RefusalReason.MEMORY_OVERCOMMITTED
    assert r.message == (
        f"GPU {GPU0} has 81559 MiB; containers placed there before this one already request "
        "51200 MiB, and this one requests 30720 MiB more: the guarantees cannot all be kept; "
        "lower the request or let the scheduler pick another GPU")
    assert state.gpus[0].requested_bytes == 70 * GIB
    assert_nothing_for(state, UID_B)


@pytest.mark.parametrize("limit", ["80Gi", "18446744095184388096"])
def test_a_cap_above_the_gpu_is_written_as_the_gpus_memory(limit: str) -> None:
    """A cap above the GPU's memory caps nothing, and NVML refuses to write it (nvml.h,
    SetMemoryLimits: INVALID_ARGUMENT): the same cap, the GPU's 81559 MiB, is written instead.
    One of 2^64 bytes or more (2^64 + 20 GiB here) would also wrap in NVML's 64-bit field."""
    state = plan(node_pod(notes=annotations(request="10Gi", limit=limit)))
    assert state.refusals == ()
    (c,) = state.containers
    assert c.plan.limit_bytes > 81559 * MIB  # the plan (and its marker) keep what was asked
    assert state.limits == (
        LimitTarget(GPU0, SLICE_A, 10 * GIB, 81559 * MIB, UID_A, None),
        LimitTarget(GPU0, LEAF_A, 10 * GIB, 81559 * MIB, UID_A, "main"),
    )


def test_every_refusal_applies_nothing_and_names_an_action() -> None:
    other = "GPU-99999999-9999-9999-9999-999999999999"
    pods = [
        node_pod(UID_A, name="a", notes=annotations(request="x")),
        node_pod(UID_B, name="b", notes=annotations(devices=(other,))),
        node_pod(UID_C, name="c", notes=annotations(devices=None)),
    ]
    state = plan(*pods)
    assert {r.reason for r in state.refusals} == {
        RefusalReason.CONTRACT_INVALID, RefusalReason.DEVICE_NOT_ON_NODE,
        RefusalReason.NOT_BOUND}
    for r in state.refusals:
        assert r.message and r.reason.value[0].isupper() and " " not in r.reason.value
        assert_nothing_for(state, r.key.pod_uid)


def test_terminal_and_non_fractional_pods() -> None:
    done = node_pod(UID_A, phase="Succeeded")
    plain = node_pod(UID_B, name="plain", notes={})
    state = plan(done, plain)
    assert state.containers == () and state.refusals == ()
    # Neither pod's cgroup limits are the agent's to clear, unless a marker says it set them.
    assert state.owned_pods == frozenset()
    marked = plan_node([done, plain], inventory(), CONFIG, marked=[UID_A])
    assert marked.owned_pods == {UID_A}


def test_node_pod_from_manifest() -> None:
    m = manifest(UID_A, containers=("main", "side"),
                 container_ids={"main": CID_A, "side": CID_B}, qos=None)
    m["spec"]["initContainers"] = [{"name": "kai-fractions-gate"}]
    m["status"]["initContainerStatuses"] = [
        {"name": "kai-fractions-gate", "containerID": "containerd://" + "d" * 64}]
    m["spec"]["containers"][0]["resources"] = {"limits": {"cpu": "1", "memory": "1Gi"}}
    p = NodePod.from_manifest(m)
    assert p.uid == UID_A and p.created == "2025-01-01T00:00:00Z" and p.phase == "Running"
    assert dict(p.container_ids) == {"kai-fractions-gate": "containerd://" + "d" * 64,
                                     "main": CID_A, "side": CID_B}
    assert p.qos is QosClass.BURSTABLE  # computed: "side" has no limits
    assert not p.terminal


def test_unknown_runtime_limits_only_the_pod_slice() -> None:
    state = plan(node_pod(container_ids={"main": "rkt://abc"}))
    assert state.refusals == ()
    assert state.containers[0].container_cgroup is None
    assert [t.path for t in state.limits] == [SLICE_A]


def test_watchdog_containers_for_the_watchdog() -> None:
    state = plan(node_pod(notes=annotations(devices=(GPU0, GPU1))),
                 node_pod(UID_B, name="q", container_ids={}, notes=annotations(
                     devices=(GPU1,), request="1Gi", limit="1Gi")))
    a, b = state.watchdog_containers()
    assert (a.pod_uid, a.container_name, a.container_id) == (UID_A, "main", CID_A)
    assert dict(a.caps) == {GPU0: 20 * GIB, GPU1: 20 * GIB}
    assert (b.pod_uid, b.container_id, dict(b.caps)) == (UID_B, None, {GPU1: GIB})
    # without the watchdog mechanism a container is observed (its usage), never capped
    (c,) = plan(node_pod(), config=NodeConfig(memory_enforcement="cgroup")).watchdog_containers()
    assert (c.pod_uid, c.container_name, dict(c.caps)) == (UID_A, "main", {})
    # only an sm-sharing container's processes may be MPS clients (to drain before a kill)
    assert (a.mps_client, b.mps_client) == (False, False)
    (d,) = plan(node_pod(notes=annotations(mode="sm-sharing"))).watchdog_containers()
    assert d.mps_client


NS_KEY = "kai-fractions.io/container.main.mps-namespace"
ADMITTED = "kf_" + "5a" * 10


def test_the_namespace_the_webhook_named_is_the_one_planned() -> None:
    state = plan(node_pod(notes={**annotations(mode="sm-sharing"), NS_KEY: ADMITTED}))
    (c,) = state.containers
    assert c.mps_namespace == ADMITTED
    assert c.plan.mps_pipe_directory == f"/run/kai-fractions/mps/shared/{ADMITTED}"


@pytest.mark.parametrize("reverse", [False, True])
def test_a_second_container_naming_a_taken_namespace_is_refused(reverse: bool) -> None:
    """A copied annotation: sharing the namespace would hand the newcomer the first one's
    pipe directory and compute cap."""
    old = node_pod(UID_A, name="old", notes={**annotations(mode="sm-sharing"), NS_KEY: ADMITTED},
                   created="2025-01-01T00:00:00Z")
    new = node_pod(UID_B, name="new", notes={
        **annotations(mode="sm-sharing", request="1Gi", limit="1Gi"), NS_KEY: ADMITTED},
        created="2025-01-02T00:00:00Z", container_ids={"main": CID_B})
    state = plan(*([new, old] if reverse else [old, new]))
    assert [c.key.pod_uid for c in state.containers] == [UID_A]
    (r,) = state.refusals
    assert (r.key, r.reason) == (ContainerKey(UID_B, "main"), RefusalReason.MPS_NAMESPACE_TAKEN)
    # Another tenant's pod is not named to the refused one; the agent's log names it.
    # Nor does it blame the refused pod: it may be the one a co-tenant copied the name from.
    assert r.message == (
        f"MPS namespace {ADMITTED} ({NS_KEY}) is held by another container on this node, "
        "placed first: two pods name the same namespace, a name copied from one pod to another "
        "of the same Kubernetes namespace (the admission webhook names a fresh one per pod, "
        "tagged with its Kubernetes namespace); recreate this pod without the annotation so the "
        "webhook names one of its own, and find who copied it (the node agent's log names the "
        "holder)")
    assert_nothing_for(state, UID_B)


def test_a_running_container_keeps_its_namespace_even_when_it_is_refused() -> None:
    """Its processes still use the directory: a copier on another GPU must not get it because
    the GPU of the one that runs went MIG (or off the node) meanwhile."""
    victim = node_pod(UID_A, name="victim", notes={
        **annotations(mode="sm-sharing"), NS_KEY: ADMITTED}, created="2025-01-01T00:00:00Z")
    (plan,) = plan_pod(parse_pod(victim.view))
    copier = node_pod(UID_B, name="copier", notes={
        **annotations(mode="sm-sharing", devices=(GPU1,), request="1Gi", limit="1Gi"),
        NS_KEY: ADMITTED}, created="2025-01-02T00:00:00Z", container_ids={"main": CID_B})
    state = plan_node([victim, copier], inventory(device(GPU0, 0, mig=True), device(GPU1, 1)),
                      CONFIG, applied={ContainerKey(UID_A, "main"): plan})
    assert {(r.key.pod_uid, r.reason) for r in state.refusals} == {
        (UID_A, RefusalReason.MIG_NOT_SUPPORTED), (UID_B, RefusalReason.MPS_NAMESPACE_TAKEN)}
    assert state.containers == ()


def with_mounts(pod: NodePod, *mounts: dict) -> NodePod:
    m = manifest(pod.uid, name=pod.view.name, notes=dict(pod.view.annotations))
    m["spec"]["containers"][0]["volumeMounts"] = list(mounts)
    return NodePod.from_manifest(m)


OWN = {"name": "kai-fractions-mps", "mountPath": f"/run/kai-fractions/mps/shared/{ADMITTED}",
       "subPath": ADMITTED}


@pytest.mark.parametrize("mount", [
    OWN,  # the webhook's own-namespace mount
    {"name": "kai-fractions-mps", "mountPath": "/run/kai-fractions/mps/shared"},  # wired before
    {"name": "kai-fractions-mps", "mountPath": "/run/kai-fractions/mps"},  # older still
    {"name": "data", "mountPath": "/data"},
])
def test_an_mps_mount_that_reaches_the_planned_directory_is_planned(mount: dict) -> None:
    pod = with_mounts(node_pod(notes={**annotations(mode="sm-sharing"), NS_KEY: ADMITTED}), mount)
    state = plan(pod)
    assert state.refusals == () and len(state.containers) == 1


@pytest.mark.parametrize("mount", [
    {**OWN, "mountPath": "/run/kai-fractions/mps/shared/kf_" + "ee" * 10,
     "subPath": "kf_" + "ee" * 10},  # wired for another name than every plan reads now
    {**OWN, "subPath": "kf_" + "ee" * 10},
    {**OWN, "subPath": ""},
])
def test_an_mps_mount_elsewhere_than_the_plan_is_refused_before_it_starts(mount: dict) -> None:
    """A component of another release in between (an old mirror dropping the name, say): its
    clients would find no server; the gate fails it with the reason instead."""
    pod = with_mounts(node_pod(notes={**annotations(mode="sm-sharing"), NS_KEY: ADMITTED}), mount)
    state = plan(pod)
    (r,) = state.refusals
    assert r.reason is RefusalReason.MPS_MOUNT_MISMATCH
    assert f"but its MPS pipe directory is /run/kai-fractions/mps/shared/{ADMITTED}" in r.message
    assert_nothing_for(state, UID_A)
