"""The reconcile pass over in-memory fakes: markers, derived annotations, events, releases,
adoption after a restart, MPS supervision, the legacy pipe links and the watchdog."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest

from kai_fractions.contract import DEFAULT_KEYS
from kai_fractions.gate.check import Outcome, judge
from kai_fractions.marker import TEMP_PREFIX, TEMP_SUFFIX, read_marker
from kai_fractions.node.agent.grpc_service import node_state
from kai_fractions.node.agent.usage import NEWS_GAP_SECONDS
from kai_fractions.node.errors import NodeError
from kai_fractions.node.mps.errors import MpsError
from kai_fractions.node.nvml import MEMORY_LIMIT_MAX

from .builders import GIB, Rig, binder_annotations, pod

SLICE = "/sys/fs/cgroup/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{u}.slice"
LEAF = "cri-containerd-{hex}.scope"


def slice_of(uid: str) -> str:
    return SLICE.format(u=uid.replace("-", "_"))


def leaf_of(uid: str, hex_id: str = "a" * 64) -> str:
    return f"{slice_of(uid)}/{LEAF.format(hex=hex_id)}"


def add_pod(rig: Rig, name: str = "p", **kw) -> str:
    notes = kw.pop("notes", None) or binder_annotations(devices=rig.gpu0)
    return rig.add(pod(name, notes=notes, **kw))["metadata"]["uid"]


def marker(rig: Rig, uid: str) -> dict | None:
    path = rig.marker_path(uid)
    return json.loads(path.read_text()) if path.exists() else None


# -- markers and annotations ------------------------------------------------------------------


def test_follower_pod_gets_derived_annotations_then_an_applied_marker(short_tmp: Path) -> None:
    rig = Rig(short_tmp, sm_sharing=False)
    uid = add_pod(rig)
    order: list[str] = []
    write = rig.reconciler.markers.write

    def written(*args, **kw):
        order.append(f"marker:{len(rig.cluster.annotation_patches)}")
        return write(*args, **kw)

    rig.reconciler.markers.write = written
    report = rig.step()
    assert report.converged
    (patched_uid, patch), = rig.cluster.annotation_patches
    assert patched_uid == uid
    assert patch == {
        "kai-fractions.io/container.main.memory-request-mib": "10240",
        "kai-fractions.io/container.main.memory-limit-mib": "20480",
        "kai-fractions.io/container.main.mps-pinned-mem-limit": "0=20480M",
        "kai-fractions.io/container.main.plan-digest": patch[
            "kai-fractions.io/container.main.plan-digest"],
    }
    assert order == ["marker:1"]  # the patch came first
    body = marker(rig, uid)
    assert body is not None and body["containers"]["main"]["state"] == "applied"
    assert body["containers"]["main"]["plan_digest"] == patch[
        "kai-fractions.io/container.main.plan-digest"]
    # the gate, given the pod's annotations as the downward API shows them now, lets it run
    notes = rig.cluster.pods[uid]["metadata"]["annotations"]
    verdict = judge(notes, read_marker(rig.marker_path(uid).parent), pod_uid=uid,
                    keys=DEFAULT_KEYS, boot_id=rig.reconciler.markers.boot_id,
                    containers=["main"])
    assert verdict.outcome is Outcome.RELEASE, verdict.message
    assert rig.cluster.event_reasons(uid) == ["Applied"]


def test_pod_that_carries_the_derived_annotations_is_not_patched(short_tmp: Path) -> None:
    rig = Rig(short_tmp, sm_sharing=False)
    uid = add_pod(rig)
    rig.step()
    rig.cluster.annotation_patches.clear()
    rig.reconciler.markers.unlink(uid)  # as if the mirror had written them and no agent ran
    assert rig.step(full=True).converged
    assert rig.cluster.annotation_patches == []
    assert marker(rig, uid) is not None


def test_marker_never_written_while_pending_and_events_stay_quiet(short_tmp: Path) -> None:
    rig = Rig(short_tmp, sm_sharing=False)
    rig.nvml.fail("set_memory_limits", "NoPermission", times=None)
    uid = add_pod(rig)
    for _ in range(3):
        report = rig.step()
        assert not report.converged
        # read back without it and not set: known not in force (NVML's error in the message)
        assert "MemoryLimitNotInForce" in report.errors
    assert marker(rig, uid) is None
    assert rig.cluster.events == []  # no marker was set aside: nothing to warn of
    result = rig.reconciler.view.results[(uid, "main")]
    assert (result.state.value, result.reason) == ("pending", "MemoryLimitNotInForce")
    assert "(NVMLNoPermission: NVML refused" in result.message
    assert rig.agent.metrics.registry.get_sample_value(
        "kai_fractions_reconcile_errors_total", {"reason": "MemoryLimitNotInForce"}) == 3
    rig.nvml.clear_failures()
    assert rig.step().converged
    assert marker(rig, uid)["containers"]["main"]["state"] == "applied"


def test_a_running_pods_plan_change_keeps_the_applied_plan_and_its_marker(
        short_tmp: Path) -> None:
    rig = Rig(short_tmp, sm_sharing=False)
    uid = add_pod(rig)
    rig.step()
    written = rig.marker_path(uid).read_text()
    rig.nvml.fail("set_memory_limits", "NoPermission", times=None)
    manifest = rig.cluster.pods[uid]
    notes = {**manifest["metadata"]["annotations"],
             "nvidia.com/container.main.gpu-memory.limit": "16Gi"}
    rig.cluster.update_pod(uid, metadata={**manifest["metadata"], "annotations": notes})
    assert rig.step().converged  # nothing to write: the applied plan is in force
    assert rig.marker_path(uid).read_text() == written
    assert rig.cluster.event_reasons(uid) == ["Applied", "PlanChangeRefused"]


def test_stale_applied_marker_removed_when_the_plan_changes_and_is_pending(
        short_tmp: Path) -> None:
    """A marker whose plan can no longer be read back from the pod (its derived annotations
    say another plan) vouches for nothing: removed while the new plan is pending."""
    rig = Rig(short_tmp, sm_sharing=False)
    uid = add_pod(rig)
    rig.step()
    assert marker(rig, uid) is not None
    rig.nvml.fail("set_memory_limits", "NoPermission", times=None)
    manifest = rig.cluster.pods[uid]
    notes = {**manifest["metadata"]["annotations"],
             "nvidia.com/container.main.gpu-memory.limit": "16Gi",
             "kai-fractions.io/container.main.memory-limit-mib": "16384"}
    rig.cluster.update_pod(uid, metadata={**manifest["metadata"], "annotations": notes})
    rig.step()
    assert marker(rig, uid) is None
    assert rig.marker_path(uid).parent.is_dir()  # the gate's mount keeps its directory


def test_pending_keeps_an_applied_marker_of_the_same_plan(short_tmp: Path) -> None:
    rig = Rig(short_tmp, sm_sharing=False)
    uid = add_pod(rig)
    rig.step()
    written = rig.marker_path(uid).read_text()
    rig.nvml.fail("get_memory_limits", "Unknown", times=None)
    assert not rig.step(full=True).converged
    assert rig.reconciler.view.results[(uid, "main")].state.value == "pending"
    assert rig.marker_path(uid).read_text() == written


def test_final_refusal_writes_a_refused_marker_and_one_event(short_tmp: Path) -> None:
    rig = Rig(short_tmp, sm_sharing=False)
    uid = add_pod(rig, notes=binder_annotations(devices="GPU-deadbeef-0000-0000-0000-000000000000"))
    for _ in range(3):
        rig.step()
    body = marker(rig, uid)
    assert body is not None
    entry = body["containers"]["main"]
    assert (entry["state"], entry["reason"]) == ("refused", "DeviceNotOnNode")
    assert entry["message"].startswith(
        "GPU GPU-deadbeef-0000-0000-0000-000000000000 assigned to this container is not on node "
        "node-a")
    assert rig.cluster.event_reasons(uid) == ["Refused"]
    assert rig.cluster.annotation_patches == []  # nothing to feed an env that never runs


def test_not_bound_is_pending_not_refused(short_tmp: Path) -> None:
    rig = Rig(short_tmp, sm_sharing=False)
    notes = binder_annotations(devices=rig.gpu0)
    del notes["nvidia.com/container.main.gpus.devices"]
    uid = add_pod(rig, notes=notes)
    rig.step()
    assert marker(rig, uid) is None
    assert rig.reconciler.view.results[(uid, "main")].reason == "NotBound"


def test_events_are_not_repeated_every_pass(short_tmp: Path) -> None:
    rig = Rig(short_tmp, sm_sharing=False)
    a = add_pod(rig, "a")
    b = add_pod(rig, "b", notes=binder_annotations(devices=rig.gpu1, limit="200Gi",
                                                   request="200Gi"))
    for _ in range(4):
        rig.step(full=True)
    assert rig.cluster.event_reasons(a) == ["Applied"]
    assert rig.cluster.event_reasons(b) == ["Refused"]
    assert len(rig.cluster.events) == 2


def test_event_the_api_refused_is_sent_again(short_tmp: Path) -> None:
    rig = Rig(short_tmp, sm_sharing=False)
    rig.cluster.fail("create_event", times=2)  # the emit and the same pass's flush
    uid = add_pod(rig)
    rig.step()
    assert rig.cluster.event_reasons(uid) == []
    assert marker(rig, uid) is not None
    for _ in range(3):
        rig.step()
    assert rig.cluster.event_reasons(uid) == ["Applied"]


# -- deletion, container restarts, adoption ---------------------------------------------------


def test_deleted_pod_is_released_everywhere(short_tmp: Path) -> None:
    rig = Rig(short_tmp)  # sm-sharing with MPS namespaces
    uid = add_pod(rig, notes=binder_annotations(devices=rig.gpu0, mode="sm-sharing"))
    rig.step()
    namespaces = set(rig.mps.control.namespaces)
    assert len(namespaces) == 1
    assert set(rig.nvml.limits) == {(rig.gpu0, slice_of(uid)), (rig.gpu0, leaf_of(uid))}
    labels = {"node": "node-a", "namespace": "default", "pod": "p", "pod_uuid": uid,
              "container": "main", "gpu_uuid": rig.gpu0, "gpu": "0"}
    reg = rig.agent.metrics.registry
    assert reg.get_sample_value("kai_fractions_container_gpu_memory_limit_bytes",
                                labels) == 20 * GIB
    rig.cluster.delete_pod(uid)
    assert rig.step().converged
    assert rig.nvml.limits == {}  # cleared (soft 0, hard max) on the slice and the leaf
    assert sorted(rig.nvml.set_limit_calls[-2:]) == sorted([
        (rig.gpu0, slice_of(uid), 0, MEMORY_LIMIT_MAX),
        (rig.gpu0, leaf_of(uid), 0, MEMORY_LIMIT_MAX)])
    assert rig.mps.control.namespaces == {}
    assert not rig.marker_path(uid).parent.exists()
    for name in ("kai_fractions_container_gpu_memory_limit_bytes",
                 "kai_fractions_container_gpu_memory_used_bytes",
                 "kai_fractions_container_gpu_sm_utilization_percent"):
        assert reg.get_sample_value(name, labels) is None, name
    pod_labels = {k: v for k, v in labels.items() if k not in ("node", "container")}
    for name in ("gpu_fractioning_gpu_memory_used_bytes",
                 "gpu_fractioning_gpu_sm_utilization_percent",
                 "gpu_fractioning_gpu_sm_utilization_percent_normalized"):
        assert reg.get_sample_value(name, pod_labels) is None, name
    assert reg.get_sample_value("kai_fractions_containers",
                                {"node": "node-a", "state": "applied"}) == 0


def test_limits_on_a_pod_kai_does_not_manage_are_left_alone(short_tmp: Path) -> None:
    """NVIDIA's container toolkit can set the same cgroup limits from a pod's env: a pod with
    no fractional container and no marker of ours keeps them, pass after pass, while the
    limits of a fractional pod deleted next to it are cleared."""
    rig = Rig(short_tmp, sm_sharing=False)
    plain = add_pod(rig, "plain", notes={"app": "x"})
    rig.cgroups.add(leaf_of(plain, "b" * 64))
    ours = add_pod(rig)
    assert rig.step().converged
    rig.nvml.set_memory_limits(rig.gpu1, leaf_of(plain, "b" * 64), GIB, 2 * GIB)
    rig.cluster.delete_pod(ours)
    for full in (False, True):
        assert rig.step(full=full).converged
        assert rig.nvml.limits == {(rig.gpu1, leaf_of(plain, "b" * 64)): (GIB, 2 * GIB)}


def test_a_new_agent_clears_the_limits_of_a_pod_that_never_got_a_marker(
        short_tmp: Path) -> None:
    """A pending pod has limits but no marker (here its MPS daemon cannot start). It is deleted
    while the agent restarts, its cgroup lingers, and the new agent's first pass finds NVML
    down: the record of the limits the old agent set (beside the markers) still says they are
    the agent's, so a later pass clears them."""
    rig = Rig(short_tmp)
    rig.cgroups.assume_present = False
    rig.mps.control.kill()
    rig.mps.can_start = False
    uid = add_pod(rig, notes=binder_annotations(devices=rig.gpu0, mode="sm-sharing"))
    rig.cgroups.add(leaf_of(uid))
    rig.step()
    assert not rig.step().converged and marker(rig, uid) is None
    assert set(rig.nvml.limits) == {(rig.gpu0, slice_of(uid)), (rig.gpu0, leaf_of(uid))}
    rig.cluster.delete_pod(uid)
    rig.mps.can_start = True
    new = rig.restarted()
    rig.nvml.fail("driver_version", "DriverNotLoaded", times=None)
    assert not new.step().converged
    rig.nvml.clear_failures()
    assert new.step().converged
    assert rig.nvml.limits == {}


def test_terminal_pod_is_released_like_a_deleted_one(short_tmp: Path) -> None:
    rig = Rig(short_tmp, sm_sharing=False)
    uid = add_pod(rig)
    rig.step()
    manifest = rig.cluster.pods[uid]
    rig.cluster.update_pod(uid, status={**manifest["status"], "phase": "Succeeded"})
    rig.step()
    assert rig.nvml.limits == {}
    assert not rig.marker_path(uid).parent.exists()


def test_container_restart_moves_the_leaf_limit(short_tmp: Path) -> None:
    rig = Rig(short_tmp, sm_sharing=False)
    rig.cgroups.assume_present = False
    uid = add_pod(rig)
    rig.cgroups.add(leaf_of(uid))
    rig.step()
    assert rig.nvml.limits[(rig.gpu0, leaf_of(uid))] == (10 * GIB, 20 * GIB)
    new_cid = "containerd://" + "b" * 64
    rig.cgroups.add(leaf_of(uid, "b" * 64))  # the new container's cgroup; the old one lingers
    manifest = rig.cluster.pods[uid]
    rig.cluster.update_pod(uid, status={**manifest["status"], "containerStatuses": [
        {"name": "main", "containerID": new_cid}]})
    assert rig.step().converged
    assert rig.nvml.limits[(rig.gpu0, leaf_of(uid, "b" * 64))] == (10 * GIB, 20 * GIB)
    assert (rig.gpu0, leaf_of(uid)) not in rig.nvml.limits  # the old leaf: cleared
    assert (rig.gpu0, leaf_of(uid), 0, MEMORY_LIMIT_MAX) in rig.nvml.set_limit_calls
    assert rig.nvml.limits[(rig.gpu0, slice_of(uid))] == (10 * GIB, 20 * GIB)


def test_nothing_is_applied_or_cleared_before_the_first_list(short_tmp: Path) -> None:
    rig = Rig(short_tmp, sm_sharing=False)
    rig.cgroups.assume_present = False
    stale = "0a1b2c3d-0000-4000-8000-00000000000f"
    rig.cgroups.add(slice_of(stale))
    rig.nvml.limits[(rig.gpu0, slice_of(stale))] = (GIB, 2 * GIB)
    report = rig.reconciler.reconcile()  # no list yet
    assert not report.converged and "NotListed" in report.errors
    assert rig.nvml.set_limit_calls == []
    assert rig.agent.condition() is None  # nothing to publish yet


def test_restart_adopts_limits_and_markers_and_removes_what_has_no_pod(short_tmp: Path) -> None:
    rig = Rig(short_tmp, sm_sharing=False)
    rig.cgroups.assume_present = False
    uid = add_pod(rig)
    rig.cgroups.add(leaf_of(uid))
    rig.step()
    written = rig.marker_path(uid).read_text()
    limits = dict(rig.nvml.limits)
    # what a previous life of the agent left behind for a pod that no longer exists
    gone = "0a1b2c3d-0000-4000-8000-00000000000f"
    rig.cgroups.add(slice_of(gone))
    rig.nvml.limits[(rig.gpu0, slice_of(gone))] = (GIB, 2 * GIB)
    (Path(rig.options.marker_dir) / gone).mkdir()
    (Path(rig.options.marker_dir) / gone / "marker.json").write_text("{}")
    young = "0a1b2c3d-0000-4000-8000-0000000000ee"  # kubelet made it for a pod not seen yet
    (Path(rig.options.marker_dir) / young).mkdir()

    # a new agent process: fresh engine and caches, same GPU, cgroups, markers and cluster
    new = Rig(short_tmp, sm_sharing=False, nvml=rig.nvml)
    new.cluster, new.cgroups = rig.cluster, rig.cgroups
    new.agent = type(rig.agent)(config=new.config, options=new.options, nvml=rig.nvml,
                                cgroup_fs=rig.cgroups, source=rig.cluster, cluster=rig.cluster)
    new.reconciler = new.agent.reconciler
    calls_before = len(rig.nvml.set_limit_calls)
    assert new.step().converged
    assert rig.nvml.set_limit_calls[calls_before:] == [
        (rig.gpu0, slice_of(gone), 0, MEMORY_LIMIT_MAX)]  # only the stale one, cleared
    assert {k: v for k, v in rig.nvml.limits.items() if k[1] != slice_of(gone)} == limits
    assert rig.marker_path(uid).read_text() == written  # adopted as is
    assert rig.cluster.event_reasons(uid) == ["Applied"]  # not announced again
    assert not (Path(rig.options.marker_dir) / gone).exists()
    assert (Path(rig.options.marker_dir) / young).exists()


def test_a_first_marker_write_cut_by_a_crash_goes_with_its_pod(short_tmp: Path) -> None:
    """An agent SIGKILLed inside `write_marker` of a pod's first marker (its fsync is the wide
    part) leaves the pod's directory holding only the temp file. If the pod is deleted before
    an agent runs again, the next agent never knew it: the temp file shows the directory is an
    agent's, so it goes at once, not after the grace an empty directory gets (the kubelet's,
    for a pod not seen yet). The real-process SIGKILL fault test timed out on this rarely."""
    rig = Rig(short_tmp, sm_sharing=False)
    uid = add_pod(rig)
    rig.step()
    markers = Path(rig.options.marker_dir)
    gone = "0a1b2c3d-0000-4000-8000-00000000000f"
    (markers / gone).mkdir()
    fd, _tmp = tempfile.mkstemp(dir=markers / gone, prefix=TEMP_PREFIX, suffix=TEMP_SUFFIX)
    os.close(fd)
    young = "0a1b2c3d-0000-4000-8000-0000000000ee"  # kubelet made it for a pod not seen yet
    (markers / young).mkdir()
    assert rig.step().converged
    assert not (markers / gone).exists()
    assert (markers / young).is_dir()
    assert rig.marker_path(uid).exists()


class Killed(BaseException):
    """The agent's process dies here (nothing after it runs)."""


def test_a_gone_pods_directory_whose_removal_was_cut_short_goes_with_the_next_pass(
        short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent is killed after emptying a gone pod's marker directory, before removing it.
    The next agent never knew the pod, and an empty directory named for it is kept as the
    kubelet's for the grace period: the node stayed untidy for ten minutes (the real-process
    SIGKILL fault test timed out on this in CI). The directory leaves the pod's name before it
    is emptied, and the next pass removes what is left."""
    rig = Rig(short_tmp, sm_sharing=False)
    rig.cgroups.assume_present = False
    keep, gone = add_pod(rig, "keep"), add_pod(rig, "gone")
    for uid in (keep, gone):
        rig.cgroups.add(leaf_of(uid))
    assert rig.step().converged
    rig.cluster.delete_pod(gone)  # its cgroup lingers

    def killed(path: object) -> None:
        raise Killed

    monkeypatch.setattr(os, "rmdir", killed)
    with pytest.raises(Killed):
        rig.step()
    monkeypatch.undo()
    new = rig.restarted()
    assert new.step().converged
    assert [p.name for p in Path(rig.options.marker_dir).iterdir() if p.is_dir()] == [keep]
    assert {path for _gpu, path in rig.nvml.limits} == {slice_of(keep), leaf_of(keep)}


def test_marker_of_a_pod_without_fractions_any_more_is_removed(short_tmp: Path) -> None:
    rig = Rig(short_tmp, sm_sharing=False)
    uid = add_pod(rig)
    rig.step()
    manifest = rig.cluster.pods[uid]
    rig.cluster.update_pod(uid, metadata={**manifest["metadata"], "annotations": {}})
    rig.step()
    assert not rig.marker_path(uid).exists()


def test_nvml_down_writes_nothing_but_removes_gone_pods_markers(short_tmp: Path) -> None:
    rig = Rig(short_tmp, sm_sharing=False)
    uid = add_pod(rig)
    rig.step()
    rig.nvml.fail("init", "DriverNotLoaded", times=None)
    rig.nvml.fail("driver_version", "DriverNotLoaded", times=None)
    new = add_pod(rig, "new")
    rig.cluster.delete_pod(uid)
    report = rig.step()
    assert not report.converged and "NVMLUnavailable" in report.errors
    assert marker(rig, new) is None
    assert not rig.marker_path(uid).parent.exists()
    cond = rig.agent.condition()
    assert cond is not None and (cond.ready, cond.reason) == (False, "NVMLUnavailable")


def test_a_watchdog_check_that_finds_nvml_failing_asks_for_a_pass_once(
        short_tmp: Path) -> None:
    """Only a pass reports NVML failing (the node condition): without one the node stays Ready
    until the next resync (300 s), and KAI keeps placing pods on it."""
    rig = Rig(short_tmp, sm_sharing=False)
    add_pod(rig)
    rig.step()
    rig.reconciler.check_usage()
    assert rig.reconciler.usage_needs_pass() is False
    rig.nvml.fail("running_processes", "DriverNotLoaded", times=None)
    rig.reconciler.check_usage()
    assert rig.reconciler.usage_needs_pass() is True
    rig.reconciler.check_usage()  # the same failure again: no news
    assert rig.reconciler.usage_needs_pass() is False


def test_a_flapping_or_intermittent_failure_asks_for_a_pass_at_most_every_gap(
        short_tmp: Path) -> None:
    """A reason that flaps, or a listing that fails every other check, must not turn the
    watchdog's interval (1 s) into a full pass each: news only when a GPU turns blind, and
    taken at most every NEWS_GAP_SECONDS."""
    rig = Rig(short_tmp, sm_sharing=False)
    add_pod(rig)
    rig.step()
    usage, gap = rig.reconciler.usage, NEWS_GAP_SECONDS
    for reason in ("GpuIsLost", "Unknown", "GpuIsLost"):  # blind all along: one finding
        rig.nvml.fail("running_processes", reason, times=1)
        rig.reconciler.check_usage()
    assert usage.take_news(now=1000.0) is True and usage.take_news(now=1000.0) is False
    rig.reconciler.check_usage()  # listable again
    rig.nvml.fail("running_processes", "Unknown", times=1)
    rig.reconciler.check_usage()  # blind again: news, held back until the gap has passed
    assert usage.take_news(now=1000.0 + gap / 2) is False
    assert usage.take_news(now=1000.0 + gap) is True


def test_a_pod_deleted_while_nvml_is_down_leaves_its_series(short_tmp: Path) -> None:
    """No pass plans while NVML is down, yet the deleted pod's series must go, as after any
    pass (docs/node-agent.md: a deleted pod leaves no stale series)."""
    rig = Rig(short_tmp, sm_sharing=False)
    gone, kept = add_pod(rig, "gone"), add_pod(rig, "kept")
    rig.step()
    rig.nvml.fail("init", "DriverNotLoaded", times=None)
    rig.nvml.fail("driver_version", "DriverNotLoaded", times=None)
    rig.step()  # the first pass without NVML: the view keeps no inventory after it
    rig.cluster.delete_pod(gone)
    rig.step()
    requested = "kai_fractions_container_gpu_memory_requested_bytes"
    uids = {s.labels["pod_uuid"] for m in rig.agent.metrics.registry.collect()
            if m.name == requested for s in m.samples}
    assert uids == {kept}


def test_nvml_breaking_after_apply_reports_pending_and_keeps_the_marker(
        short_tmp: Path) -> None:
    rig = Rig(short_tmp, sm_sharing=False)
    uid = add_pod(rig)
    rig.step()
    written = rig.marker_path(uid).read_text()
    rig.nvml.fail("init", "DriverNotLoaded", times=None)
    rig.nvml.fail("driver_version", "DriverNotLoaded", times=None)
    rig.step()
    result = rig.reconciler.view.results[(uid, "main")]
    assert (result.state.value, result.reason) == ("pending", "NVMLUnavailable")
    assert rig.marker_path(uid).read_text() == written  # the limits stay in the kernel
    assert rig.agent.metrics.registry.get_sample_value(
        "kai_fractions_containers", {"node": "node-a", "state": "pending"}) == 1


# -- MPS --------------------------------------------------------------------------------------


def test_the_node_state_shows_the_compute_mode_the_same_pass_set(short_tmp: Path) -> None:
    """The inventory is read before the apply switches a GPU to EXCLUSIVE_PROCESS; GetNodeState
    must not show the mode it replaced until some later pass reads it again."""
    rig = Rig(short_tmp)
    add_pod(rig, notes=binder_annotations(devices=rig.gpu0, mode="sm-sharing"))
    assert rig.step().converged
    state = node_state(rig.reconciler.view, "node-a", None, "Ready")
    assert [(d.uuid, d.compute_mode) for d in state.devices] == [
        (rig.gpu0, "ExclusiveProcess"), (rig.gpu1, "Default")]


def test_mps_daemon_restart_reapplies_and_is_counted(short_tmp: Path) -> None:
    rig = Rig(short_tmp)
    uid = add_pod(rig, notes=binder_annotations(devices=rig.gpu0, mode="sm-sharing"))
    rig.step()
    (name,) = rig.mps.control.namespaces
    assert rig.mps.control.namespaces[name].active_thread_percentage == 50
    rig.mps.control.kill()  # the daemon dies and forgets everything
    assert rig.step().converged
    assert rig.mps.control.namespaces[name].active_thread_percentage == 50
    assert rig.mps.control.default_pinned_mib == {0: 20480}
    assert rig.agent.metrics.registry.get_sample_value(
        "kai_fractions_mps_daemon_restarts_total") == 1
    assert rig.reconciler.mps_health.owned  # restarted by us: stopped by us
    assert marker(rig, uid)["containers"]["main"]["state"] == "applied"


def test_a_client_back_before_the_restarted_daemons_namespace_got_its_cap_is_not_applied(
        short_tmp: Path) -> None:
    """The daemon restarts and the running container's process attaches to its namespace as
    soon as the agent creates it again, before its active-thread percentage is set: that client
    may run uncapped, so the container is reported pending with the reason until the client
    exits, and its marker is set aside meanwhile (the pod keeps running; a restarted sandbox's
    gate waits)."""
    rig = Rig(short_tmp)
    uid = add_pod(rig, notes=binder_annotations(devices=rig.gpu0, mode="sm-sharing"))
    rig.step()
    written = rig.marker_path(uid).read_text()
    (name,) = rig.mps.control.namespaces
    control = rig.mps.control
    create = control.namespace_create

    def create_then_attach(ns: str, **kw) -> None:  # once: the process reconnects
        create(ns, **kw)
        control.attach_client(4242, ns)
        control.namespace_create = create  # type: ignore[method-assign]

    control.namespace_create = create_then_attach  # type: ignore[method-assign]
    control.kill()
    report = rig.step()
    r = rig.reconciler.view.results[(uid, "main")]
    assert (r.state.value, r.reason) == ("pending", "NamespaceCapUnverified")
    assert not report.converged and "NamespaceCapUnverified" in report.errors
    assert control.namespaces[name].active_thread_percentage is None
    assert not rig.marker_path(uid).exists()
    assert (rig.marker_path(uid).parent / "set-aside.json").read_text() == written
    control.detach_client(4242)
    assert rig.step().converged
    assert rig.reconciler.view.results[(uid, "main")].state.value == "applied"
    assert control.namespaces[name].active_thread_percentage == 50
    assert marker(rig, uid)["containers"]["main"]["state"] == "applied"


def test_the_periodic_mps_check_asks_for_a_pass_only_when_something_changed(
        short_tmp: Path) -> None:
    rig = Rig(short_tmp)
    add_pod(rig, notes=binder_annotations(devices=rig.gpu0, mode="sm-sharing"))
    rig.step()
    passes = rig.reconciler.passes
    assert rig.reconciler.mps_needs_pass() is False  # healthy, as the last pass saw it
    assert rig.reconciler.mps_needs_pass() is False
    rig.mps.control.kill()
    assert rig.reconciler.mps_needs_pass() is True  # restarted: its state must be re-applied
    assert rig.reconciler.passes == passes  # the check itself ran no pass


def test_mps_daemon_that_cannot_start_makes_the_node_not_ready(short_tmp: Path) -> None:
    rig = Rig(short_tmp)
    rig.mps.control.kill()
    rig.mps.can_start = False
    uid = add_pod(rig, notes=binder_annotations(devices=rig.gpu0, mode="sm-sharing"))
    ts = add_pod(rig, "ts")
    rig.step()
    cond = rig.agent.condition()
    assert cond is not None and (cond.ready, cond.reason) == (False, "MPSDaemonUnhealthy")
    assert "MpsDaemonUnreachable" in cond.message
    assert marker(rig, uid) is None  # sm-sharing cannot be enforced
    assert marker(rig, ts) is not None  # time-slicing needs no MPS


@pytest.mark.parametrize("mps_v3", [True, False])
def test_without_a_daemon_no_sm_sharing_container_is_applied_whatever_the_tiers(
        short_tmp: Path, mps_v3: bool) -> None:
    """Without mps-pinned, an sm-sharing container on a driver without namespaces (or with a
    daemon whose protocol cannot be probed) gets nothing applied by MPS but its client env:
    without a daemon that answers, no share of the SMs would be enforced, so it stays pending
    (found by the fail-closed audit: it was marked applied)."""
    rig = Rig(short_tmp, mps_v3=mps_v3, memory_enforcement="cgroup,watchdog")
    rig.mps.control.kill()
    rig.mps.can_start = False
    uid = add_pod(rig, notes=binder_annotations(devices=rig.gpu0, mode="sm-sharing"))
    ts = add_pod(rig, "ts")
    report = rig.step()
    assert "MpsDaemonUnreachable" in report.errors
    assert marker(rig, uid) is None
    assert marker(rig, ts) is not None  # time-slicing needs no MPS
    result = rig.reconciler.view.results[(uid, "main")]
    # the daemon is not running: the cap its MPS server enforces is known not in force
    assert (result.state.value, result.reason, result.mps_cap_missing) == (
        "pending", "NamespaceCapNotSet", True)
    assert result.message.startswith(
        "the MPS control daemon is not running (MpsDaemonUnreachable: ")
    rig.mps.can_start = True  # the daemon comes back: the container is applied
    assert rig.step().converged
    assert marker(rig, uid)["containers"]["main"]["state"] == "applied"


def test_legacy_mps_links_the_namespace_directory_to_the_daemon(short_tmp: Path) -> None:
    rig = Rig(short_tmp, mps_v3=False)
    uid = add_pod(rig, notes=binder_annotations(devices=rig.gpu0, mode="sm-sharing"))
    rig.step()
    notes = rig.cluster.pods[uid]["metadata"]["annotations"]
    pipe = notes["kai-fractions.io/container.main.mps-pipe-directory"]
    name = Path(pipe).name
    link = short_tmp / "mps" / "shared" / name
    # the legacy daemon's directory, beside the link: inside the container's mount of shared/
    assert os.readlink(link) == "legacy"
    assert link.resolve() == (short_tmp / "mps" / "shared" / "legacy").resolve()
    result = rig.reconciler.view.results[(uid, "main")]
    assert result.compute.value == "mps-client-env" and result.state.value == "applied"
    cond = rig.agent.condition()
    assert cond is not None and cond.ready
    assert "not enforced by the daemon" in cond.message
    rig.cluster.delete_pod(uid)
    rig.step()
    assert not os.path.lexists(link)


def test_an_older_agents_link_to_the_root_is_put_right(short_tmp: Path) -> None:
    """Agents before the legacy daemon moved under shared/ linked to `..` (the pipe root, which
    containers no longer mount): the link is made again."""
    rig = Rig(short_tmp, mps_v3=False)
    uid = add_pod(rig, notes=binder_annotations(devices=rig.gpu0, mode="sm-sharing"))
    rig.step()
    notes = rig.cluster.pods[uid]["metadata"]["annotations"]
    link = short_tmp / "mps" / "shared" / Path(
        notes["kai-fractions.io/container.main.mps-pipe-directory"]).name
    link.unlink()
    link.symlink_to("..")
    rig.step()
    assert os.readlink(link) == "legacy"


def test_legacy_link_blocked_by_a_directory_keeps_the_container_pending(short_tmp: Path) -> None:
    rig = Rig(short_tmp, mps_v3=False)
    uid = add_pod(rig, notes=binder_annotations(devices=rig.gpu0, mode="sm-sharing"))
    rig.step()
    notes = rig.cluster.pods[uid]["metadata"]["annotations"]
    name = Path(notes["kai-fractions.io/container.main.mps-pipe-directory"]).name
    link = short_tmp / "mps" / "shared" / name
    link.unlink()
    link.mkdir()
    rig.step()
    result = rig.reconciler.view.results[(uid, "main")]
    assert (result.state.value, result.reason) == ("pending", "MPSPipeLinkFailed")
    assert marker(rig, uid) is not None  # same plan, applied before: kept
    link.rmdir()
    assert rig.step().converged
    assert os.readlink(link) == "legacy"


# -- watchdog ---------------------------------------------------------------------------------


def _running(rig: Rig, uid: str, pid: int, used: int, sm: int | None = None) -> None:
    rig.proc_entry(pid, leaf_of(uid)[len("/sys/fs/cgroup"):])
    rig.nvml.add_process(pid, rig.gpu0, used, sm_percent=sm)


def test_watchdog_report_emits_one_violation_per_episode(short_tmp: Path) -> None:
    rig = Rig(short_tmp, sm_sharing=False)
    uid = add_pod(rig)
    rig.step()
    _running(rig, uid, 4242, 25 * GIB, sm=30)
    for _ in range(3):
        rig.reconciler.check_usage()
    assert rig.cluster.event_reasons(uid) == ["Applied", "LimitViolation"]
    event = rig.cluster.events[-1]
    assert event["type"] == "Warning"
    assert event["message"] == (f"container main of pod {uid} uses 25600 MiB of GPU memory on "
                                f"{rig.gpu0}, above its cap of 20480 MiB (pids 4242)")
    labels = {"node": "node-a", "namespace": "default", "pod": "p", "pod_uuid": uid,
              "container": "main", "gpu_uuid": rig.gpu0, "gpu": "0"}
    reg = rig.agent.metrics.registry
    assert reg.get_sample_value("kai_fractions_container_gpu_memory_used_bytes",
                                labels) == 25 * GIB
    assert reg.get_sample_value("kai_fractions_container_gpu_sm_utilization_percent",
                                labels) == 30
    assert reg.get_sample_value(  # time-slicing: no active-thread share
        "kai_fractions_container_gpu_sm_share_percent", labels) is None
    assert reg.get_sample_value(  # one episode, however many checks saw it
        "kai_fractions_container_gpu_memory_limit_violations_total", labels) == 1
    rig.nvml.remove_process(4242)
    rig.reconciler.check_usage()
    _running(rig, uid, 4243, 21 * GIB)
    rig.reconciler.check_usage()
    assert rig.cluster.event_reasons(uid) == ["Applied", "LimitViolation", "LimitViolation"]
    assert rig.killer.calls == []


def test_watchdog_kill_drains_then_stops_and_reports_it(short_tmp: Path) -> None:
    rig = Rig(short_tmp, watchdog_policy="kill")
    uid = add_pod(rig, notes=binder_annotations(devices=rig.gpu0, mode="sm-sharing"))
    rig.step()
    (name,) = rig.mps.control.namespaces
    _running(rig, uid, 4242, 25 * GIB, sm=20)
    rig.mps.control.attach_client(4242, name)
    rig.reconciler.check_usage()
    assert rig.killer.killed == [4242]
    assert rig.mps.control.terminated == [4242]
    assert rig.cluster.event_reasons(uid) == ["Applied", "LimitEnforced"]
    labels = {"namespace": "default", "pod": "p", "pod_uuid": uid, "gpu_uuid": rig.gpu0,
              "gpu": "0"}
    reg = rig.agent.metrics.registry
    # normalized by the requested fraction as upstream does: 20 GiB of an 81559 MiB GPU
    assert reg.get_sample_value("gpu_fractioning_gpu_sm_utilization_percent_normalized",
                                labels) == round(20 * 81559 / 20480, 3)
    ours = {**labels, "node": "node-a", "container": "main"}
    assert reg.get_sample_value("kai_fractions_container_gpu_sm_share_percent", ours) == 50
    assert reg.get_sample_value(
        "kai_fractions_container_gpu_memory_limit_violations_total", ours) == 1


class SteppedKiller:
    """A killer whose stops take several checks, as the real one's do: `terminate` only
    starts one; `progress` answers what the test queued for the next check."""

    def __init__(self) -> None:
        self.next: list[tuple[int, str]] = []

    def terminate(self, pid, still_ours):
        return "signalled" if still_ours() else "skipped"

    def progress(self):
        out, self.next = self.next, []
        return out


def _sigterm_sent(short_tmp: Path, *others: int) -> tuple[Rig, SteppedKiller, str]:
    """A kill-mode agent whose watchdog has just sent SIGTERM to its container's processes:
    pid 4242 over its cap, and `others` (1 GiB each) beside it."""
    rig = Rig(short_tmp, sm_sharing=False, watchdog_policy="kill")
    killer = SteppedKiller()
    rig.reconciler.usage.watchdog.killer = killer
    uid = add_pod(rig)
    rig.step()
    _running(rig, uid, 4242, 25 * GIB)
    for pid in others:
        _running(rig, uid, pid, GIB)
    rig.reconciler.check_usage()
    return rig, killer, uid


def test_a_stop_is_an_event_when_it_ends_and_a_process_that_outlives_sigkill_is_one_too(
        short_tmp: Path) -> None:
    """SIGTERM sent is no event (the process may yet exit or be killed): the event says what
    happened in the end; a process still running after SIGKILL is a Warning of its own, not
    reported as killed."""
    rig, killer, uid = _sigterm_sent(short_tmp, 4243)
    assert rig.cluster.event_reasons(uid) == ["Applied"]
    killer.next = [(4242, "escalated"), (4243, "escalated")]
    rig.reconciler.check_usage()
    assert rig.cluster.event_reasons(uid) == ["Applied"]
    killer.next = [(4242, "killed"), (4243, "unkillable")]
    rig.nvml.remove_process(4242)
    rig.reconciler.check_usage()
    assert rig.cluster.event_reasons(uid) == ["Applied", "LimitEnforced", "ProcessNotStopped"]
    enforced, stuck = rig.cluster.events[-2:]
    assert "process 4242 killed" in enforced["message"]
    assert stuck["type"] == "Warning"
    assert stuck["message"] == (
        f"container main: process 4243, over its GPU memory cap on {rig.gpu0}, still runs "
        "after SIGKILL (stuck in the kernel or the driver); its GPU memory stays in use until "
        "it exits")


def test_a_stop_in_progress_moves_on_while_nvml_fails(short_tmp: Path) -> None:
    """SIGKILL is sent only when a stop moves on; signalling needs no NVML, so a GPU that
    fell off the bus must not let a process that ignores SIGTERM keep running (and keep its
    GPU memory) for as long as NVML fails. Its outcome is still an event."""
    rig, killer, uid = _sigterm_sent(short_tmp)
    rig.nvml.fail("devices", "GpuIsLost", times=None)
    assert "GPULost" in rig.step().errors
    assert rig.reconciler.nvml_health.inventory is None
    killer.next = [(4242, "escalated")]
    rig.reconciler.check_usage()
    assert killer.next == []  # moved on: SIGKILL sent
    killer.next = [(4242, "killed")]
    rig.reconciler.check_usage()
    assert killer.next == []
    assert rig.cluster.event_reasons(uid) == ["Applied", "LimitEnforced"]
    assert "process 4242 killed" in rig.cluster.events[-1]["message"]


@pytest.mark.parametrize("ends", ["Failed", "deleted"])
def test_a_stop_that_ends_after_its_pod_left_the_plan_is_still_its_event(
        short_tmp: Path, ends: str) -> None:
    """Stopping the main process usually ends the pod (or it is deleted meanwhile): its
    outcome comes at a later check, when the pod is planned no more, and is still the pod's
    event, named from what was remembered when the stop started."""
    rig, killer, uid = _sigterm_sent(short_tmp)
    rig.nvml.remove_process(4242)  # it exits on SIGTERM
    if ends == "Failed":
        rig.cluster.update_pod(uid, status={"phase": "Failed", "qosClass": "Burstable"})
    else:
        rig.cluster.delete_pod(uid)
    rig.step()
    assert rig.reconciler.view.desired.containers == ()
    killer.next = [(4242, "terminated")]
    rig.reconciler.check_usage()
    assert rig.cluster.event_reasons(uid) == ["Applied", "LimitEnforced"]
    event = rig.cluster.events[-1]
    assert event["involvedObject"]["name"] == "p"
    assert event["involvedObject"]["namespace"] == "default"
    assert "process 4242 terminated" in event["message"]
    assert rig.reconciler.usage._stop_refs == {}  # forgotten once it exited
    assert not [k for k in rig.reconciler.usage.events._sent if uid in k]  # nor its event's key


def test_drain_terminates_the_mps_clients_of_the_container(short_tmp: Path) -> None:
    rig = Rig(short_tmp)
    uid = add_pod(rig, notes=binder_annotations(devices=rig.gpu0, mode="sm-sharing"))
    rig.step()
    (name,) = rig.mps.control.namespaces
    _running(rig, uid, 4242, GIB)
    _running(rig, uid, 4243, GIB)  # not an MPS client: left alone
    rig.mps.control.attach_client(4242, name)
    assert rig.reconciler.drain(uid) == [4242]
    assert rig.mps.control.terminated == [4242]


def test_a_client_that_left_mps_since_the_list_does_not_fail_the_drain(
        short_tmp: Path) -> None:
    """Between `client list` and `client terminate` a process may exit (ClientNotFound): there
    is nothing left to drain of it, and the drain of the others stands (no MpsDrainFailed)."""
    rig = Rig(short_tmp)
    uid = add_pod(rig, notes=binder_annotations(devices=rig.gpu0, mode="sm-sharing"))
    rig.step()
    (name,) = rig.mps.control.namespaces
    for pid in (4242, 4243):
        _running(rig, uid, pid, GIB)
        rig.mps.control.attach_client(pid, name)
    rig.mps.control.inject("client_terminate", MpsError("ClientNotFound", "gone"))
    assert rig.reconciler.drain(uid) == [4243]
    assert rig.mps.control.terminated == [4243]


def test_provision_and_release_without_the_api(short_tmp: Path) -> None:
    rig = Rig(short_tmp, sm_sharing=False, with_cluster=False)
    rig.agent.cache.replace([])
    uid = "0a1b2c3d-0000-4000-8000-000000000123"
    keys = rig.reconciler.provision("ns", "direct", uid, binder_annotations(devices=rig.gpu0),
                                    ["main"])
    assert [tuple(k) for k in keys] == [(uid, "main")]
    assert rig.reconciler.view.results[keys[0]].state.value == "applied"
    assert marker(rig, uid)["containers"]["main"]["state"] == "applied"
    assert rig.nvml.limits[(rig.gpu0, slice_of(uid))] == (10 * GIB, 20 * GIB)
    assert rig.reconciler.release(uid) == ["main"]
    assert rig.nvml.limits == {}
    assert not rig.marker_path(uid).parent.exists()
    rig.reconciler.reconcile()  # stays released
    assert rig.nvml.limits == {}


@pytest.mark.parametrize("parent", [
    "kubepods.slice/kubepods-pod{u}.slice",
    "kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{u}.slice"])
def test_a_pod_provisioned_before_its_cgroup_exists_is_applied_once_it_does(
        short_tmp: Path, parent: str) -> None:
    """Its QoS class is where the kubelet makes its cgroup (Guaranteed, BestEffort): unknown
    until then, so it is looked for again on every pass, not guessed once for good."""
    rig = Rig(short_tmp, sm_sharing=False, with_cluster=False)
    rig.cgroups.assume_present = False
    rig.agent.cache.replace([])
    uid = "0a1b2c3d-0000-4000-8000-000000000123"
    rig.reconciler.provision("ns", "direct", uid, binder_annotations(devices=rig.gpu0), ["main"])
    assert rig.reconciler.view.results[(uid, "main")].reason == "CgroupNotFound"
    path = "/sys/fs/cgroup/" + parent.format(u=uid.replace("-", "_"))
    rig.cgroups.add(path)  # the kubelet starts the pod
    rig.reconciler.reconcile()
    assert rig.reconciler.view.results[(uid, "main")].state.value == "applied"
    assert rig.nvml.limits == {(rig.gpu0, path): (10 * GIB, 20 * GIB)}
    assert marker(rig, uid)["containers"]["main"]["state"] == "applied"


def test_a_reprovisioned_percentage_waits_for_the_namespaces_clients_to_exit(
        short_tmp: Path) -> None:
    """A provisioned pod is not held to its applied plan, but MPS holds its clients to the
    percentage of their first attach: no Applied result or marker for a plan not in force."""
    rig = Rig(short_tmp, with_cluster=False)
    rig.agent.cache.replace([])
    uid = "0a1b2c3d-0000-4000-8000-000000000123"

    def provision(portion: str) -> None:
        rig.reconciler.provision("ns", "direct", uid, binder_annotations(
            devices=rig.gpu0, mode="sm-sharing", portion=portion), ["main"])

    provision("0.5")
    (name,) = rig.mps.control.namespaces
    rig.mps.control.attach_client(4242, name)
    provision("0.2")
    r = rig.reconciler.view.results[(uid, "main")]
    assert (r.state.value, r.reason) == ("pending", "NamespaceBusy")
    assert marker(rig, uid) is None
    assert rig.mps.control.namespaces[name].active_thread_percentage == 50
    rig.mps.control.detach_client(4242)
    rig.reconciler.reconcile()
    assert rig.reconciler.view.results[(uid, "main")].state.value == "applied"
    assert rig.mps.control.namespaces[name].active_thread_percentage == 20
    assert marker(rig, uid)["containers"]["main"]["state"] == "applied"


def test_a_marker_that_cannot_be_rewritten_for_a_new_plan_is_removed(
        short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pod's new plan is in force, but its marker cannot be written (a full or failing
    disk): the old marker vouches for limits no longer in force, and a restarted sandbox's
    gate would open on it. It goes; the next pass that can write puts the new one."""
    rig = Rig(short_tmp, sm_sharing=False, with_cluster=False)
    rig.agent.cache.replace([])
    uid = "0a1b2c3d-0000-4000-8000-000000000123"

    def provision(limit: str) -> None:
        rig.reconciler.provision("ns", "direct", uid, binder_annotations(
            devices=rig.gpu0, limit=limit), ["main"])

    provision("20Gi")
    assert marker(rig, uid)["containers"]["main"]["state"] == "applied"

    def full(*_args: object, **_kw: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(rig.reconciler.markers, "write", full)
    provision("70Gi")
    assert rig.nvml.limits[(rig.gpu0, slice_of(uid))] == (10 * GIB, 70 * GIB)
    assert marker(rig, uid) is None
    gate = judge({}, read_marker(rig.marker_path(uid).parent), pod_uid=uid, keys=DEFAULT_KEYS,
                 boot_id=rig.reconciler.markers.boot_id, containers=["main"])
    assert gate.outcome is not Outcome.RELEASE
    assert "MarkerNotWritten" in rig.reconciler.reconcile().errors
    monkeypatch.undo()
    rig.reconciler.reconcile()
    new = marker(rig, uid)["containers"]["main"]
    assert (new["state"], new["plan_digest"]) == (
        "applied", rig.reconciler.view.results[(uid, "main")].plan_digest)


def test_a_release_that_could_not_remove_a_limit_says_so(short_tmp: Path) -> None:
    """The caller of Release must not believe the pod unlimited while a limit may still be in
    force: the call fails with the reason; the pod stays released and a later pass clears it."""
    rig = Rig(short_tmp, sm_sharing=False)
    uid = add_pod(rig)
    rig.cgroups.add(leaf_of(uid))  # as the kubelet made them: the sweep finds them by scanning
    rig.step()
    rig.nvml.fail("clear_memory_limits", "GpuIsLost", times=None)
    with pytest.raises(NodeError) as e:
        rig.reconciler.release(uid)
    assert e.value.reason == "GPULost"
    assert str(e.value.message).startswith(
        f"pod {uid} is released, but not everything enforced for it could be removed yet (")
    assert rig.nvml.limits  # still in force, as the error says
    rig.nvml.clear_failures()
    rig.step(full=True)
    assert rig.nvml.limits == {}  # the released pod's limit is swept
    assert rig.reconciler.release(uid) == []  # repeating it is harmless: nothing is left


def test_a_pod_whose_marker_cannot_be_written_does_not_stop_the_others(short_tmp: Path) -> None:
    rig = Rig(short_tmp, sm_sharing=False)
    rig.reconciler.pods.provision("ns", "bad", "not a uid", binder_annotations(
        devices=rig.gpu0), ["main"])  # only possible in process: Provision refuses it
    good = add_pod(rig)
    report = rig.step()
    assert "MarkerNotWritten" in report.errors
    assert marker(rig, good)["containers"]["main"]["state"] == "applied"


def test_release_of_a_watched_pod_holds_until_the_pod_goes(short_tmp: Path) -> None:
    rig = Rig(short_tmp, sm_sharing=False)
    uid = add_pod(rig)
    rig.step()
    assert rig.reconciler.release(uid) == ["main"]
    rig.step(full=True)
    assert rig.nvml.limits == {}
    assert not rig.marker_path(uid).exists()
    assert rig.marker_path(uid).parent.is_dir()  # the pod (and its gate's mount) still exist


def test_release_of_a_watched_pod_also_provisioned_holds_it_and_keeps_its_directory(
        short_tmp: Path) -> None:
    """The watched copy would be planned again in Release's own pass, and a new directory is
    invisible to the gate's bind mount: released like a watched pod, whatever was provisioned."""
    rig = Rig(short_tmp, sm_sharing=False)
    uid = add_pod(rig)
    assert rig.step().converged
    directory = rig.marker_path(uid).parent
    inode = directory.stat().st_ino
    rig.reconciler.provision("default", "p", uid, binder_annotations(devices=rig.gpu0), ["main"])
    assert rig.reconciler.release(uid) == ["main"]
    for _ in range(2):
        assert rig.nvml.limits == {}
        assert not rig.marker_path(uid).exists()
        assert directory.stat().st_ino == inode
        rig.step(full=True)
    rig.cluster.delete_pod(uid)
    rig.step()
    assert not directory.exists()  # goes with the pod: nothing provisioned keeps it


def test_an_applied_marker_names_a_watchdog_that_only_reports() -> None:
    """The marker's message says what is in force: with `--watchdog-policy report` the watchdog
    reports a container over its cap and stops nothing (found by the fail-closed audit)."""
    from kai_fractions.node.agent.markers import decide
    from kai_fractions.node.config import Mechanism
    from kai_fractions.node.desired import ComputeEnforcement, ContainerKey
    from kai_fractions.node.engine import ContainerResult, ContainerState

    result = ContainerResult(ContainerKey("uid", "main"), "ns/p/main", ContainerState.APPLIED,
                             plan_digest="sha256:" + "a" * 64,
                             mechanisms=frozenset({Mechanism.CGROUP, Mechanism.WATCHDOG}),
                             compute=ComputeEnforcement.TIME_SLICING)
    messages = [decide({"main": result}, watchdog_stops=stops).write["main"].message
                for stops in (True, False)]
    assert messages == [
        "limits in force: memory cgroup,watchdog; compute time-slicing",
        "limits in force: memory cgroup,watchdog (reports, stops nothing); compute time-slicing"]
