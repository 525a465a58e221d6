"""The applied plan read back from durable facts (derived annotations, binder devices, the
node's marker), and `plan_node` keeping it in force whatever the pod's annotations say now."""

from __future__ import annotations

from kai_fractions.contract import derived_annotations, parse_pod, plan_pod
from kai_fractions.marker import ContainerMarker, Marker
from kai_fractions.node.applied import applied_plans, has_recorded_plans, recorded_plan
from kai_fractions.node.config import Mechanism, NodeConfig, WatchdogPolicy
from kai_fractions.node.desired import ContainerKey, NodePod, Refusal, RefusalReason, plan_node
from kai_fractions.node.nvml import GpuComputeMode

from .nodepods import (
    GIB,
    GPU0,
    GPU1,
    UID_A,
    UID_B,
    annotations,
    device,
    inventory,
    node_pod,
    watchdog_caps,
)

CONFIG = NodeConfig(node_name="node-a")
KEY_A = ContainerKey(UID_A, "main")


def applied_pod(uid: str = UID_A, created: str = "2025-01-01T00:00:00Z", **kw
                ) -> tuple[NodePod, dict[str, str]]:
    """A pod as the agent left it after applying: its annotations plus the derived ones."""
    pod = node_pod(uid, notes=annotations(**kw))
    (plan,) = plan_pod(parse_pod(pod.view))
    notes = {**pod.view.annotations, **derived_annotations(plan)}
    return node_pod(uid, notes=notes, created=created), notes


def marker(uid: str, digest: str, state: str = "applied") -> Marker:
    entry = (ContainerMarker.applied(digest) if state == "applied"
             else ContainerMarker.refused("Refused", "no", digest))
    return Marker.build(uid, {"main": entry}, boot_id="0b0a1c2d-3e4f-4a5b-8c6d-7e8f9a0b1c2d")


def edited(uid: str, notes: dict[str, str], **changes: str) -> NodePod:
    return node_pod(uid, notes={**notes, **changes})


# -- reading the applied plan back ------------------------------------------------------------


def test_the_derived_annotations_rebuild_the_plan_exactly() -> None:
    for kw in ({}, {"mode": "sm-sharing", "portion": "0.25"},
               {"devices": (GPU0, GPU1), "mode": "sm-sharing"}):
        pod, _ = applied_pod(**kw)
        (plan,) = plan_pod(parse_pod(pod.view))
        assert has_recorded_plans(pod.view, CONFIG.keys)
        assert recorded_plan(pod.view, "main", CONFIG.keys) == plan
        assert applied_plans(pod.view, marker(UID_A, plan.digest), CONFIG.keys) == {"main": plan}


def test_the_namespace_the_webhook_named_is_read_back_and_cannot_be_swapped() -> None:
    ns_key = "kai-fractions.io/container.main.mps-namespace"
    admitted = "kf_" + "5a" * 10
    pod = node_pod(UID_A, notes={**annotations(mode="sm-sharing"), ns_key: admitted})
    (plan,) = plan_pod(parse_pod(pod.view))
    assert plan.mps_namespace == admitted
    notes = {**pod.view.annotations, **derived_annotations(plan)}
    assert recorded_plan(node_pod(UID_A, notes=notes).view, "main", CONFIG.keys) == plan
    # Another name after the apply (the validating webhook refuses the edit; the digest too)
    for other in ("kf_" + "ee" * 10, "not-a-name"):
        view = edited(UID_A, notes, **{ns_key: other}).view
        assert recorded_plan(view, "main", CONFIG.keys) is None


def test_a_plan_that_does_not_match_its_digest_or_the_marker_is_not_trusted() -> None:
    pod, notes = applied_pod()
    (plan,) = plan_pod(parse_pod(pod.view))
    d = "kai-fractions.io/container.main."
    for change in ({d + "memory-limit-mib": "81920"}, {d + "memory-limit-mib": "x"},
                   {d + "memory-limit-mib": "9" * 40}, {d + "plan-digest": "sha256:" + "0" * 64},
                   {"nvidia.com/container.main.gpus.devices": GPU1},
                   {d + "mps-active-thread-percentage": "50"}):
        view = edited(UID_A, notes, **change).view
        assert recorded_plan(view, "main", CONFIG.keys) is None, change
        assert applied_plans(view, marker(UID_A, plan.digest), CONFIG.keys) == {}
    no_digest = {k: v for k, v in notes.items() if not k.endswith(".plan-digest")}
    assert not has_recorded_plans(node_pod(UID_A, notes=no_digest).view, CONFIG.keys)
    # the marker is the node's word: a refusal that names no plan, another pod's or another
    # digest holds nothing; a refusal naming the plan (a node rule refused it while it ran)
    # holds the pod to it
    assert applied_plans(pod.view, None, CONFIG.keys) == {}
    assert applied_plans(pod.view, marker(UID_A, "", "refused"), CONFIG.keys) == {}
    assert applied_plans(pod.view, marker(UID_A, plan.digest, "refused"), CONFIG.keys) == {
        "main": plan}
    assert applied_plans(pod.view, marker(UID_B, plan.digest), CONFIG.keys) == {}
    assert applied_plans(pod.view, marker(UID_A, "sha256:" + "1" * 64), CONFIG.keys) == {}


# -- plan_node keeps it ------------------------------------------------------------------------


def held(pod: NodePod):
    (plan,) = plan_pod(parse_pod(pod.view))
    return {KEY_A: plan}


def test_a_raised_limit_is_refused_and_the_applied_plan_stays() -> None:
    pod, notes = applied_pod()
    applied = held(pod)
    raised = edited(UID_A, notes, **{"nvidia.com/container.main.gpu-memory.limit": "80Gi"})
    state = plan_node([raised], inventory(), CONFIG, applied=applied)
    (c,) = state.containers
    assert c.plan == applied[KEY_A] and c.plan.limit_bytes == 20 * GIB
    assert {t.hard for t in state.limits} == {20 * GIB}
    assert watchdog_caps(state) == {KEY_A: {GPU0: 20 * GIB}}
    assert state.gpu(GPU0).requested_bytes == 10 * GIB
    (r,) = state.refusals
    assert (r.key, r.reason, r.final) == (KEY_A, RefusalReason.PLAN_CHANGE_REFUSED, True)
    assert r.message == (
        "the pod's GPU annotations changed after this container's limits were applied (memory "
        "limit 20480 MiB -> 81920 MiB): the change is refused and the applied plan (memory "
        f"request 10240 MiB, limit 20480 MiB, time-slicing on {GPU0}) stays in force until the "
        "pod is recreated (delete it to have it planned again)")
    # the same annotations as applied: nothing refused
    assert plan_node([pod], inventory(), CONFIG, applied=applied).refusals == ()


def test_invalid_or_removed_annotations_keep_the_applied_plan_and_its_place() -> None:
    pod, notes = applied_pod(mode="sm-sharing")
    applied = held(pod)
    invalid = edited(UID_A, notes, **{"nvidia.com/container.main.gpu-memory.limit": "lots"})
    user_keys = ("gpu-memory.request", "gpu-memory.limit", "gpu-compute.mode",
                 "gpu-compute.portion")
    removed = node_pod(UID_A, notes={k: v for k, v in notes.items()
                                     if not k.endswith(user_keys)})
    unshared = node_pod(UID_A, notes={k: v for k, v in notes.items()
                                      if not k.startswith("nvidia.com/")})
    newcomer = node_pod(UID_B, created="2025-01-02T00:00:00Z", notes=annotations(
        request="75Gi", limit="75Gi", mode="time-slicing"))
    for edit, why in ((invalid, "its plan is refused now (ContractInvalid: the pod's GPU "
                                "annotations are invalid: nvidia.com/container.main.gpu-memory."
                                "limit"),
                      (removed, "its plan is refused now (ContractInvalid: the pod's GPU "
                                "annotations cannot be planned: nvidia.com/container.main."
                                "gpu-memory.request: is missing"),
                      (unshared, "the pod's GPU annotations no longer ask for a GPU share for "
                                 "this container: the change is refused")):
        state = plan_node([edit, newcomer], inventory(), CONFIG, applied=applied)
        (c,) = state.containers
        assert c.plan == applied[KEY_A] and c.mps_namespace is not None
        gpu = state.gpu(GPU0)
        assert gpu.requested_bytes == 10 * GIB and gpu.containers == (KEY_A,)
        assert gpu.compute_mode is GpuComputeMode.EXCLUSIVE_PROCESS
        assert gpu.mps_pinned_mib == 20 * 1024
        change = state.refusal(KEY_A)
        assert change.reason is RefusalReason.PLAN_CHANGE_REFUSED
        assert change.message.startswith(why), change.message
        # the newcomer would fit only without the applied pod, and only in another mode
        assert state.refusal(ContainerKey(UID_B, "main")).reason is \
            RefusalReason.COMPUTE_MODE_MIX


def test_a_vetoed_pod_keeps_its_applied_plan_and_the_veto_is_named() -> None:
    pod, _ = applied_pod()
    applied = held(pod)
    veto = plan_node([pod], inventory(), CONFIG).containers[0]
    refusal = Refusal(key=veto.key, pod_namespace="default", pod_name="p",
                      reason=RefusalReason.CONTRACT_INVALID, message="bad signature")
    state = plan_node([pod], inventory(), CONFIG, applied=applied, vetoes=[refusal, refusal])
    assert [c.plan for c in state.containers] == [applied[KEY_A]]  # held once
    assert state.gpu(GPU0).requested_bytes == 10 * GIB
    assert state.refusal(KEY_A).message.startswith(
        "its plan is refused now (ContractInvalid: bad signature)")
    # without an applied plan the veto is the pod's refusal, and nothing is planned
    state = plan_node([pod], inventory(), CONFIG, vetoes=[refusal])
    assert state.containers == () and state.refusals == (refusal,)
    assert state.owned_pods == {UID_A}  # a refused pod's limits are ours to clear


def test_running_containers_are_placed_before_older_pods_that_are_not() -> None:
    pod, _ = applied_pod(created="2025-01-03T00:00:00Z")
    older = node_pod(UID_B, created="2025-01-01T00:00:00Z", notes=annotations(
        request="75Gi", limit="75Gi"))
    state = plan_node([older, pod], inventory(), CONFIG, applied=held(pod))
    assert [c.key for c in state.containers] == [KEY_A]
    assert state.refusal(ContainerKey(UID_B, "main")).reason is \
        RefusalReason.MEMORY_OVERCOMMITTED
    # without the applied plan the older pod is placed first, as before
    state = plan_node([older, pod], inventory(), CONFIG)
    assert [c.key.pod_uid for c in state.containers] == [UID_B]


def test_an_applied_plan_the_node_cannot_serve_any_more_is_refused_for_that_reason() -> None:
    pod, notes = applied_pod(devices=(GPU1,))
    applied = held(pod)
    raised = edited(UID_A, notes, **{"nvidia.com/container.main.gpu-memory.limit": "30Gi"})
    state = plan_node([raised], inventory(device(GPU0, 0)), CONFIG, applied=applied)
    assert state.containers == ()
    (r,) = state.refusals
    assert r.reason is RefusalReason.DEVICE_NOT_ON_NODE
    # the watchdog as the only tier: only a kill policy caps (a report one is refused)
    watchdog_only = NodeConfig(node_name="node-a",
                               memory_enforcement=frozenset({Mechanism.WATCHDOG}),
                               watchdog_policy=WatchdogPolicy.KILL)
    state = plan_node([raised], inventory(), watchdog_only, applied=applied)
    assert watchdog_caps(state) == {KEY_A: {GPU1: 20 * GIB}} and state.limits == ()
