"""Issue 17, finding 2 (node half): a tenant cannot switch its own enforcement off by editing the
user-owned keys of its running pod (admission denies that, but a webhook can be down or skip
the namespace). The container keeps its APPLIED plan: its limits, its place in the GPU's
accounting (requested memory, compute mode, MPS namespace and pinned limit) and the watchdog's
attention; the new plan is refused with a `PlanChangeRefused` event and the refusal metric, and
all of it survives an agent restart (read back from the derived annotations and the marker).

Annotation keys are spelled out literally."""

from __future__ import annotations

import copy
from pathlib import Path

from kai_fractions.node.config import WatchdogPolicy
from kai_fractions.node.mps.errors import MpsError
from kai_fractions.node.nvml import GpuComputeMode
from kai_fractions.sim.killer import RecordingKiller

from .builders import GIB, LEAF, Rig, binder_annotations, pod, slice_of
from .builders import limits_of as limits
from .builders import marker_of as marker

LIMIT = "nvidia.com/container.main.gpu-memory.limit"
MODE = "nvidia.com/container.main.gpu-compute.mode"
KEEPS = ("the change is refused and the applied plan (memory request 10240 MiB, limit 20480 "
         "MiB, {mode} on {gpu}) stays in force until the pod is recreated (delete it to have it "
         "planned again)")


def restarted(rig: Rig) -> Rig:
    return rig.restarted(killer=RecordingKiller())


def edit(rig: Rig, uid: str, **notes: str | None) -> None:
    meta = copy.deepcopy(rig.cluster.pods[uid]["metadata"])
    for key, value in notes.items():
        if value is None:
            meta["annotations"].pop(key, None)
        else:
            meta["annotations"][key] = value
    rig.cluster.update_pod(uid, metadata=meta)


def add(rig: Rig, name: str, **kw) -> str:
    uid = rig.add(pod(name, notes=binder_annotations(devices=rig.gpu0, **kw)))["metadata"]["uid"]
    rig.cgroups.add(f"{slice_of(uid)}/{LEAF}")
    return uid


def running(rig: Rig, uid: str, pid: int, used: int) -> None:
    rig.proc_entry(pid, f"{slice_of(uid)}/{LEAF}"[len("/sys/fs/cgroup"):])
    rig.nvml.add_process(pid, rig.gpu0, used)


def violations(rig: Rig, uid: str) -> list[str]:
    """Of every agent over `rig`'s cluster (a restarted one reports an episode again)."""
    return [e["message"] for e in rig.cluster.events
            if e["involvedObject"]["uid"] == uid and e["reason"] == "LimitViolation"]


def stops(rig: Rig, uid: str) -> list[str]:
    """The kill watchdog's stops (LimitEnforced), of every agent over `rig`'s cluster."""
    return [e["message"] for e in rig.cluster.events
            if e["involvedObject"]["uid"] == uid and e["reason"] == "LimitEnforced"]


def change_events(rig: Rig, uid: str) -> list[str]:
    return [e["message"] for e in rig.cluster.events
            if e["involvedObject"]["uid"] == uid and e["reason"] == "PlanChangeRefused"]


def refused_metric(rig: Rig, uid: str, name: str = "p") -> float | None:
    return rig.agent.metrics.registry.get_sample_value("kai_fractions_container_refused", {
        "node": "node-a", "namespace": "default", "pod": name, "pod_uuid": uid,
        "container": "main", "reason": "PlanChangeRefused"})


def assert_applied_plan_kept(rig: Rig, uid: str, digest: str, *, sm: bool = False) -> None:
    result = rig.reconciler.view.results[(uid, "main")]
    assert (result.state.value, result.plan_digest) == ("applied", digest)
    assert marker(rig, uid)["containers"]["main"]["plan_digest"] == digest
    desired = rig.reconciler.view.desired
    (c,) = [c for c in desired.containers if c.key.pod_uid == uid]
    assert (c.plan.request_bytes, c.plan.limit_bytes) == (10 * GIB, 20 * GIB)
    gpu = desired.gpu(rig.gpu0)
    assert c.key in gpu.containers and gpu.requested_bytes == 10 * GIB
    assert desired.refusal((uid, "main")).reason == "PlanChangeRefused"
    assert refused_metric(rig, uid) == 1
    if sm:
        assert gpu.compute_mode is GpuComputeMode.EXCLUSIVE_PROCESS
        assert gpu.mps_pinned_mib == 20 * 1024


# -- the finding: a raised limit on a watchdog-only node ---------------------------------------


def test_a_raised_limit_keeps_the_old_cap_under_the_watchdog_even_after_a_restart(
        short_tmp: Path) -> None:
    # the watchdog alone caps only with the kill policy (a report one is no tier)
    rig = Rig(short_tmp, sm_sharing=False, memory_enforcement="watchdog",
              watchdog_policy=WatchdogPolicy.KILL)
    uid = add(rig, "p")
    assert rig.step().converged
    digest = marker(rig, uid)["containers"]["main"]["plan_digest"]
    edit(rig, uid, **{LIMIT: "75Gi"})
    assert rig.step().converged  # nothing to retry: the applied plan is in force
    assert_applied_plan_kept(rig, uid, digest)
    assert change_events(rig, uid) == [
        "container main: the pod's GPU annotations changed after this container's limits were "
        "applied (memory limit 20480 MiB -> 76800 MiB): "
        + KEEPS.format(mode="time-slicing", gpu=rig.gpu0)]
    running(rig, uid, 4242, 30 * GIB)  # above the old cap, below the edited one
    rig.reconciler.check_usage()
    assert rig.killer.calls == [4242]  # stopped by the old cap
    assert stops(rig, uid) == [
        f"container main: process 4242 terminated for using more GPU memory on {rig.gpu0} than "
        "its cap (drained from MPS first when it was a client)"]

    fresh = restarted(rig)
    # its first pass runs a watchdog check before it vouches for the watchdog (its only tier)
    assert fresh.step().converged
    assert_applied_plan_kept(fresh, uid, digest)
    assert fresh.killer.calls == [4242]  # the restarted agent holds the old cap too
    assert len(stops(fresh, uid)) == 2
    assert rig.cluster.event_reasons(uid) == [
        "Applied", "PlanChangeRefused", "LimitEnforced", "LimitEnforced", "PlanChangeRefused"]


# -- invalid annotations: limits and the GPU's accounting stay ----------------------------------


def test_invalid_annotations_keep_the_limits_and_the_memory_they_hold(short_tmp: Path) -> None:
    rig = Rig(short_tmp, sm_sharing=False)
    uid = add(rig, "p")
    rig.step()
    digest = marker(rig, uid)["containers"]["main"]["plan_digest"]
    before = limits(rig, uid)
    assert before == {slice_of(uid): (10 * GIB, 20 * GIB),
                      f"{slice_of(uid)}/{LEAF}": (10 * GIB, 20 * GIB)}
    edit(rig, uid, **{LIMIT: "a lot"})
    # a pod that fits only if the first one's 10 GiB were free (81559 MiB GPU)
    waiting = add(rig, "q", request="75Gi", limit="75Gi")
    for n, agent in enumerate((rig, restarted(rig)), start=1):
        agent.step(full=True)
        assert limits(rig, uid) == before
        assert_applied_plan_kept(agent, uid, digest)
        (message,) = change_events(agent, uid)[-1:]
        assert message.startswith(
            "container main: its plan is refused now (ContractInvalid: the pod's GPU "
            f"annotations are invalid: {LIMIT}: ")
        assert message.endswith(KEEPS.format(mode="time-slicing", gpu=rig.gpu0))
        entry = marker(rig, waiting)["containers"]["main"]
        assert (entry["state"], entry["reason"]) == ("refused", "MemoryOvercommitted")
        assert limits(rig, waiting) == {}
        running(rig, uid, 4242, 25 * GIB)
        agent.reconciler.check_usage()
        assert len(violations(agent, uid)) == n


# -- a compute mode change: the GPU's mode, MPS namespace and pinned limit stay ------------------


def test_a_compute_mode_change_keeps_the_gpu_mode_and_mps_state(short_tmp: Path) -> None:
    rig = Rig(short_tmp)
    uid = add(rig, "p", mode="sm-sharing")
    rig.step()
    digest = marker(rig, uid)["containers"]["main"]["plan_digest"]
    (namespace,) = rig.mps.control.namespaces
    assert rig.nvml.gpu(rig.gpu0).compute_mode is GpuComputeMode.EXCLUSIVE_PROCESS
    edit(rig, uid, **{MODE: "time-slicing"})
    # a time-slicing pod on the same GPU may come only once the sm-sharing one is gone
    newcomer = add(rig, "q", request="1Gi", limit="1Gi", mode="time-slicing")
    for agent in (rig, restarted(rig)):
        agent.step(full=True)
        assert_applied_plan_kept(agent, uid, digest, sm=True)
        (message,) = change_events(agent, uid)[-1:]
        assert message == (
            "container main: the pod's GPU annotations changed after this container's limits "
            "were applied (compute mode sm-sharing -> time-slicing): "
            + KEEPS.format(mode="sm-sharing at 50% of the SMs", gpu=rig.gpu0))
        assert rig.nvml.gpu(rig.gpu0).compute_mode is GpuComputeMode.EXCLUSIVE_PROCESS
        assert set(rig.mps.control.namespaces) == {namespace}
        assert rig.mps.control.default_pinned_mib[0] == 20 * 1024
        entry = marker(rig, newcomer)["containers"]["main"]
        assert (entry["state"], entry["reason"]) == ("refused", "ComputeModeMix")


# -- what is not a plan change ---------------------------------------------------------------


def test_undoing_the_edit_ends_the_refusal_and_deleting_the_pod_releases_it(
        short_tmp: Path) -> None:
    rig = Rig(short_tmp, sm_sharing=False)
    uid = add(rig, "p")
    rig.step()
    original = copy.deepcopy(rig.cluster.pods[uid]["metadata"])
    edit(rig, uid, **{LIMIT: "40Gi"})
    rig.step()
    assert refused_metric(rig, uid) == 1
    rig.cluster.update_pod(uid, metadata=original)
    assert rig.step().converged
    assert rig.reconciler.view.desired.refusals == ()
    assert refused_metric(rig, uid) is None
    edit(rig, uid, **{LIMIT: "40Gi"})  # the same edit again: reported again
    rig.step()
    assert len(change_events(rig, uid)) == 2
    rig.cluster.delete_pod(uid)
    rig.step()
    assert limits(rig, uid) == {} and rig.reconciler.view.desired.containers == ()


def test_a_pod_not_yet_applied_is_planned_from_its_annotations_as_they_are(
        short_tmp: Path) -> None:
    """No marker yet (the gate has not released anything): an edit is simply the plan."""
    rig = Rig(short_tmp, sm_sharing=False)
    rig.nvml.fail("set_memory_limits", "NoPermission", times=None)
    uid = add(rig, "p")
    rig.step()
    assert marker(rig, uid) is None
    edit(rig, uid, **{LIMIT: "16Gi"})
    rig.nvml.clear_failures()
    assert rig.step().converged
    assert limits(rig, uid)[slice_of(uid)] == (10 * GIB, 16 * GIB)
    assert "PlanChangeRefused" not in rig.cluster.event_reasons(uid)


def test_a_running_container_a_node_rule_now_refuses_keeps_its_memory_limits(
        short_tmp: Path) -> None:
    """The operator restarts the agent with sm-sharing off: the running sm-sharing container's
    applied plan can no longer be kept (SmSharingDisabled, reported), but a refusal never turns
    into "no limit" for a container that runs: the memory limits the kernel holds stay, as for
    a refused signature."""
    rig = Rig(short_tmp)
    uid = rig.add(pod("p", notes=binder_annotations(devices=rig.gpu0, mode="sm-sharing")))[
        "metadata"]["uid"]
    rig.cgroups.add(f"{slice_of(uid)}/{LEAF}")
    assert rig.step().converged
    before = limits(rig, uid)
    assert before == {slice_of(uid): (10 * GIB, 20 * GIB),
                      f"{slice_of(uid)}/{LEAF}": (10 * GIB, 20 * GIB)}
    held = marker(rig, uid)["containers"]["main"]["plan_digest"]
    new = rig.restarted(sm_sharing=False)
    for _ in range(3):  # every pass, not the first only
        new.step()
        entry = marker(new, uid)["containers"]["main"]
        assert (entry["state"], entry["reason"]) == ("refused", "SmSharingDisabled")
        assert entry["plan_digest"] == held  # what the pod stays held to
        assert limits(new, uid) == before
    # an edit made meanwhile (admission down) is not what the pod is held to: never applied
    edit(new, uid, **{MODE: "time-slicing", LIMIT: "79Gi"})
    new.step()
    assert limits(new, uid) == before
    assert marker(new, uid)["containers"]["main"]["reason"] == "SmSharingDisabled"
    back = new.restarted(sm_sharing=True)  # the operator turns sm-sharing on again
    # its daemon still starting: a pass that cannot apply the held plan yet keeps the hold
    back.mps.control.inject("namespace_list", MpsError("MpsDaemonUnreachable", "starting"))
    back.step()
    assert limits(back, uid) == before and marker(back, uid) is None
    back.step()  # the edit is still there: the plan the pod is held to comes back, not it
    entry = marker(back, uid)["containers"]["main"]
    assert (entry["state"], entry["plan_digest"]) == ("applied", held)
    assert limits(back, uid) == before
    edit(back, uid, **{MODE: "sm-sharing", LIMIT: "20Gi"})  # the edit undone: nothing changes
    assert back.step().converged
    entry = marker(back, uid)["containers"]["main"]
    assert (entry["state"], entry["plan_digest"]) == ("applied", held)
    back.cluster.delete_pod(uid)  # the limits go with the pod
    back.step()
    assert limits(back, uid) == {}


def test_a_running_container_a_node_rule_refuses_still_takes_its_memory(
        short_tmp: Path) -> None:
    """It keeps running with the kernel's limits: a newcomer that fits only without its
    requested memory is refused, not placed on memory in use."""
    rig = Rig(short_tmp)
    uid = rig.add(pod("p", notes=binder_annotations(devices=rig.gpu0, mode="sm-sharing")))[
        "metadata"]["uid"]
    rig.cgroups.add(f"{slice_of(uid)}/{LEAF}")
    assert rig.step().converged
    new = rig.restarted(sm_sharing=False)
    newcomer = new.add(pod("big", notes=binder_annotations(
        devices=rig.gpu0, request="70Gi", limit="70Gi")))["metadata"]["uid"]
    new.step()
    assert marker(new, uid)["containers"]["main"]["reason"] == "SmSharingDisabled"
    entry = marker(new, newcomer)["containers"]["main"]
    assert (entry["state"], entry["reason"]) == ("refused", "MemoryOvercommitted")
