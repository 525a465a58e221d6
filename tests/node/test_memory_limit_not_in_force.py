"""A container whose pod slice's GPU memory limit the engine read back missing (or not the plan's)
and could not set is never vouched for: NVML's limits go with the cgroup, so a pod slice removed
and made again holds none, and while every set fails the pod's readiness marker is set aside
(`ContainerResult.limit_missing`, reason MemoryLimitNotInForce), a Warning
`MemoryLimitNotInForce` tells it once, and `Applied` follows once the limit is back. A read that
fails proves nothing (the marker stays), nor does a limit missing on the container's own cgroup
while its slice holds one (the slice caps the whole pod)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from kai_fractions.gate.check import Outcome
from kai_fractions.marker import SET_ASIDE_FILE, Marker
from kai_fractions.node import engine
from kai_fractions.node.agent.markers import decide, still_valid
from kai_fractions.node.engine import ContainerState
from kai_fractions.node.errors import nvml_error
from kai_fractions.node.mps import MpsError
from tests.agent.builders import GIB, Rig, binder_annotations, leaf_of, marker_of, pod, slice_of
from tests.agent.builders import gate_outcome as _gate
from tests.agent.builders import result_of as _result

from .test_engine import UID_A, Node, sm_pod, ts_pod

NVML_ERROR_NO_PERMISSION = 4  # nvmlReturn_t
MEMORY_LIMIT_NOT_IN_FORCE = "MemoryLimitNotInForce"
"""kai_fractions.node.memory_limits.MEMORY_LIMIT_NOT_IN_FORCE, as GetNodeState's readers see it."""


def _pod(rig: Rig, mode: str | None = None) -> str:
    """A pod (20 GiB cap on GPU 0), applied: its limits on its slice and its container's
    cgroup, its marker written; its uid."""
    uid = rig.add(pod("p", notes=binder_annotations(devices=rig.gpu0, mode=mode))
                  )["metadata"]["uid"]
    assert rig.step().converged
    assert _limits(rig, uid) == {slice_of(uid): (10 * GIB, 20 * GIB),
                                 leaf_of(uid): (10 * GIB, 20 * GIB)}
    assert _gate(rig, uid) is Outcome.RELEASE
    return uid


def _limits(rig: Rig, uid: str) -> dict[str, tuple[int, int]]:
    return {path: value for (gpu, path), value in rig.nvml.limits.items()
            if gpu == rig.gpu0 and uid.replace("-", "_") in path}


def _recreate(rig: Rig, uid: str, *paths: str) -> None:
    """The cgroups at `paths` (default: the pod's slice and everything under it) are removed
    and made again: their NVML limits go with them."""
    for path in paths or (slice_of(uid), leaf_of(uid)):
        rig.nvml.limits.pop((rig.gpu0, path), None)


def _events(rig: Rig, uid: str) -> list[tuple[str, str, str]]:
    return [(e["type"], e["reason"], e["message"]) for e in rig.cluster.events
            if e["involvedObject"]["uid"] == uid]


def _not_vouched_for(rig: Rig, uid: str) -> None:
    assert marker_of(rig, uid) is None
    assert (rig.marker_path(uid).parent / SET_ASIDE_FILE).exists()  # the plan it is held to
    assert _gate(rig, uid) is Outcome.WAIT


def _applied_again(rig: Rig, uid: str) -> None:
    assert rig.step().converged
    r = _result(rig, uid)
    assert (r.state, r.limit_missing) == (ContainerState.APPLIED, False)
    assert _limits(rig, uid)[slice_of(uid)] == (10 * GIB, 20 * GIB)
    assert marker_of(rig, uid)["containers"]["main"]["state"] == "applied"
    assert not (rig.marker_path(uid).parent / SET_ASIDE_FILE).exists()
    assert _gate(rig, uid) is Outcome.RELEASE


def test_a_slice_made_again_whose_limit_cannot_be_set_lets_no_gate_release(
        short_tmp: Path) -> None:
    """The reviewer's probe: the pod slice is removed and made again (its limits gone with
    it), and every set fails. The engine read the limit back absent and could not set it: the
    container says so, and its applied marker is set aside, not kept."""
    rig = Rig(short_tmp, sm_sharing=False)
    uid = _pod(rig)
    _recreate(rig, uid)
    rig.nvml.fail("set_memory_limits", "NoPermission", times=None)
    for _ in range(3):  # one episode, three passes: one event
        report = rig.step()
        assert not report.converged and MEMORY_LIMIT_NOT_IN_FORCE in report.errors
        r = _result(rig, uid)
        assert (r.state, r.reason, r.limit_missing, r.mps_cap_missing, r.not_in_force) == (
            ContainerState.PENDING, "MemoryLimitNotInForce", True, False, True)
        assert r.message.startswith(
            f"the GPU memory limit on the pod's cgroup {slice_of(uid)} (GPU {rig.gpu0}) reads "
            "back no limit, not the plan's soft 10240 MiB, hard 20480 MiB, and could not be set "
            "(NVMLNoPermission: NVML refused nvmlDeviceSetMemoryLimits_v1"), r.message
        assert _limits(rig, uid) == {}
        _not_vouched_for(rig, uid)
    (applied, (kind, reason, message)) = _events(rig, uid)
    assert applied[1] == "Applied"
    assert (kind, reason) == ("Warning", "MemoryLimitNotInForce")
    assert message.startswith(
        "container main: the GPU memory limit on its pod's cgroup is not in force, so its "
        "readiness marker is set aside (a gate of the pod waits; Applied follows once the "
        "limit is back): MemoryLimitNotInForce: the GPU memory limit on the pod's cgroup ")
    assert len(message) <= 1024  # an event's message is cut there
    rig.nvml.clear_failures()
    _applied_again(rig, uid)
    # the recovery is told too: Applied again, although its plan digest is the same
    assert [e[1] for e in _events(rig, uid)] == ["Applied", "MemoryLimitNotInForce", "Applied"]


def test_the_knowledge_outlasts_passes_that_fail_before_they_reach_the_cgroup(
        tmp_path: Path) -> None:
    """Known missing until a set succeeds or the limit reads back in force: a later pass whose
    read fails, or that does not reach the cgroup at all, still reports it (its own failure in
    the message), so the marker is not vouched for again on a read that proved nothing."""
    node = Node(tmp_path / "cgroup")
    p = ts_pod(uid=UID_A)
    assert node.apply(p).converged
    slice_ = node.slice(UID_A)
    targets = node.engine._last.limits  # the slice's, then the container's cgroup's
    assert targets[0].path == slice_
    gpu = targets[0].gpu_uuid
    for t in targets:  # the cgroups made again
        node.nvml.limits.pop((t.gpu_uuid, t.path))
    node.nvml.fail("set_memory_limits", "NoPermission", times=None)
    r = node.apply(p).containers[(UID_A, "main")]
    assert (r.state, r.reason, r.limit_missing) == (ContainerState.PENDING,
                                                    "MemoryLimitNotInForce", True)
    node.nvml.clear_failures()
    node.nvml.fail("get_memory_limits", "Unknown", times=None)  # the read fails
    r = node.apply(p).containers[(UID_A, "main")]
    assert (r.state, r.reason, r.limit_missing) == (ContainerState.PENDING,
                                                    "MemoryLimitNotInForce", True)
    assert r.message.startswith(
        f"the GPU memory limit on the pod's cgroup {slice_} (GPU {gpu}) was read back no "
        "limit, not the plan's soft 4096 MiB, hard 8192 MiB, and has not been set since (this "
        "pass: NVMLError: "), r.message
    node.nvml.clear_failures()
    desired = node.desired(p)
    node.nvml.fail("devices", "Unknown")  # the pass stops before any cgroup
    r = node.engine.apply(desired).containers[(UID_A, "main")]
    assert (r.reason, r.limit_missing) == ("MemoryLimitNotInForce", True)
    node.engine.forget()  # a resync: the knowledge is no cache
    node.nvml.fail("set_memory_limits", "NoPermission")
    assert node.apply(p).containers[(UID_A, "main")].limit_missing
    r = node.apply(p).containers[(UID_A, "main")]  # the set works again
    assert (r.state, r.limit_missing) == (ContainerState.APPLIED, False)
    assert node.nvml.limits[(gpu, slice_)] == (4 * GIB, 8 * GIB)
    assert node.engine._unlimited == {}


def test_a_limit_read_back_in_force_ends_the_episode(tmp_path: Path) -> None:
    """Someone (the toolkit, an agent before a restart) put the plan's limit back: read back in
    force, nothing to write, the container applied."""
    node = Node(tmp_path / "cgroup")
    p = ts_pod(uid=UID_A)
    assert node.apply(p).converged
    (target, *_rest) = node.engine._last.limits
    held = node.nvml.limits.pop((target.gpu_uuid, target.path))
    node.nvml.fail("set_memory_limits", "NoPermission", times=None)
    assert node.apply(p).containers[(UID_A, "main")].limit_missing
    node.nvml.limits[(target.gpu_uuid, target.path)] = held
    r = node.apply(p).containers[(UID_A, "main")]
    assert (r.state, r.limit_missing) == (ContainerState.APPLIED, False)


def test_a_failed_read_keeps_the_marker(short_tmp: Path) -> None:
    """A read of the limit that fails says nothing of what is in force (it may well be there):
    pending for it, as before, the marker kept."""
    rig = Rig(short_tmp, sm_sharing=False)
    uid = _pod(rig)
    written = rig.marker_path(uid).read_text()
    rig.reconciler.engine.forget()  # the limits are read again, and the read fails
    rig.nvml.fail("get_memory_limits", "Unknown", times=None)
    for _ in range(2):
        assert not rig.step().converged
        r = _result(rig, uid)
        assert (r.state, r.reason, r.limit_missing, r.not_in_force) == (
            ContainerState.PENDING, "NVMLError", False, False)
        assert rig.marker_path(uid).read_text() == written
        assert _gate(rig, uid) is Outcome.RELEASE
    assert [e[1] for e in _events(rig, uid)] == ["Applied"]
    rig.nvml.clear_failures()
    assert rig.step().converged
    assert rig.marker_path(uid).read_text() == written


def test_a_limit_missing_only_on_the_containers_own_cgroup_keeps_the_marker(
        short_tmp: Path) -> None:
    """The container's own cgroup (its .scope) made again without its limit, which cannot be
    set: its pod slice's limit is in force and caps it (the limit is hierarchical), so this is
    no missing cap. Pending with NVML's reason, as before; the marker kept."""
    rig = Rig(short_tmp, sm_sharing=False)
    uid = _pod(rig)
    written = rig.marker_path(uid).read_text()
    _recreate(rig, uid, leaf_of(uid))
    set_limits = rig.nvml.set_memory_limits
    refused = {leaf_of(uid)}

    def refused_on_the_leaf(uuid: str, namespace: str, soft: int, hard: int) -> None:
        if namespace in refused:
            raise nvml_error(NVML_ERROR_NO_PERMISSION, "nvmlDeviceSetMemoryLimits_v1",
                             device=uuid)
        set_limits(uuid, namespace, soft, hard)

    rig.nvml.set_memory_limits = refused_on_the_leaf  # type: ignore[method-assign]
    rig.reconciler.engine.forget()
    for _ in range(2):
        assert not rig.step().converged
        r = _result(rig, uid)
        assert (r.state, r.reason, r.limit_missing, r.not_in_force) == (
            ContainerState.PENDING, "NVMLNoPermission", False, False)
        assert _limits(rig, uid) == {slice_of(uid): (10 * GIB, 20 * GIB)}
        assert rig.marker_path(uid).read_text() == written
        assert _gate(rig, uid) is Outcome.RELEASE
    # both made again, neither set: the slice's is what counts
    _recreate(rig, uid)
    refused.add(slice_of(uid))
    assert not rig.step().converged
    assert (_result(rig, uid).reason, _result(rig, uid).limit_missing) == (
        "MemoryLimitNotInForce", True)
    _not_vouched_for(rig, uid)
    rig.nvml.set_memory_limits = set_limits  # type: ignore[method-assign]
    _applied_again(rig, uid)


def test_a_marker_does_not_hold_while_a_slice_lacks_its_limit(tmp_path: Path) -> None:
    node = Node(tmp_path / "cgroup")
    applied = node.apply(ts_pod(uid=UID_A)).containers[(UID_A, "main")]
    entries = decide({"main": applied}).write
    assert entries is not None
    marker = Marker.build(UID_A, entries, boot_id="b")
    failed = dataclasses.replace(applied, state=ContainerState.PENDING, reason="NVMLError")
    assert still_valid(marker, {"main": failed}) and decide({"main": failed}).keep_existing
    missing = dataclasses.replace(failed, reason="MemoryLimitNotInForce", limit_missing=True)
    assert not still_valid(marker, {"main": missing})
    assert not decide({"main": missing}).keep_existing
    reasons = engine.NOT_IN_FORCE_REASONS
    assert reasons == engine.CAP_NOT_IN_FORCE_REASONS | {"MemoryLimitNotInForce",
                                                         "WatchdogBlind", "ComputeModeNotInForce"}


def test_with_an_mps_cap_missing_too_the_caps_reason_is_reported(tmp_path: Path) -> None:
    """Both known missing: the MPS cap's reason (its message says what to do), both flags."""
    node = Node(tmp_path / "cgroup")
    p = sm_pod()
    assert node.apply(p).converged
    (target, *_rest) = node.engine._last.limits
    node.nvml.limits.pop((target.gpu_uuid, target.path))
    node.nvml.fail("set_memory_limits", "NoPermission", times=None)
    node.mps.kill()
    node.mps.start()
    node.mps.inject("namespace_create", MpsError("MpsDaemonBusy", "busy"))
    r = node.apply(p).containers[(UID_A, "main")]
    assert (r.state, r.reason, r.mps_cap_missing, r.limit_missing) == (
        ContainerState.PENDING, "NamespaceCapNotSet", True, True)
    r = node.apply(p).containers[(UID_A, "main")]  # the namespace is made: the limit's turn
    assert (r.reason, r.mps_cap_missing, r.limit_missing) == (
        "MemoryLimitNotInForce", False, True)


def test_a_new_pods_limit_that_cannot_be_set_is_not_in_force_either(tmp_path: Path) -> None:
    """No marker to set aside yet, but the same reason: the limit is known not in force."""
    node = Node(tmp_path / "cgroup")
    node.nvml.fail("set_memory_limits", "NoPermission", times=1)
    r = node.apply(ts_pod(uid=UID_A)).containers[(UID_A, "main")]
    assert (r.state, r.reason, r.limit_missing) == (ContainerState.PENDING,
                                                    "MemoryLimitNotInForce", True)
    assert node.apply(ts_pod(uid=UID_A)).converged
