"""The engine's reconcile API over the in-memory seams (FakeNvml, a temp cgroup tree,
FakeMpsControl): apply / release, idempotence and convergence from any state."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest

from kai_fractions.contract import mps_namespace_name
from kai_fractions.node.agent.signatures import with_kept_limits
from kai_fractions.node.cgroups import HostCgroupFs
from kai_fractions.node.config import Mechanism, NodeConfig, WatchdogPolicy
from kai_fractions.node.desired import ContainerKey, LimitTarget, NodePod, plan_node
from kai_fractions.node.engine import (
    CGROUP_NOT_FOUND,
    MPS_UNAVAILABLE,
    ContainerState,
    Engine,
    is_our_namespace,
)
from kai_fractions.node.inventory import take_inventory
from kai_fractions.node.limit_ledger import LEDGER_NOT_WRITTEN, MemoryLimitLedger
from kai_fractions.node.mps import MpsError
from kai_fractions.node.nvml import MEMORY_LIMIT_MAX, GpuComputeMode
from kai_fractions.sim.mps import FakeMpsControl
from kai_fractions.sim.nvml import FakeGpu, FakeNvml

from .nodepods import (
    CID_A,
    CID_B,
    GIB,
    GPU0,
    GPU1,
    UID_A,
    UID_B,
    annotations,
    make_cgroups,
    node_pod,
    pod_cgroup,
)

NS_A = mps_namespace_name(UID_A, "main")
NS_B = mps_namespace_name(UID_B, "main")


class Node:
    """One simulated node: fakes that survive an engine restart, and helpers to plan/apply."""

    def __init__(self, root: Path, *, memory_limits: bool = True, protocol_v3: bool = True,
                 mps: bool = True, **config):
        self.root = root
        self.nvml = FakeNvml([FakeGpu(GPU0), FakeGpu(GPU1)], memory_limits=memory_limits)
        self.nvml.init()
        self.mps = FakeMpsControl(protocol_v3=protocol_v3) if mps else None
        self.fs = HostCgroupFs()
        self.config = NodeConfig(node_name="node-a", cgroup_root=str(root), **config)
        self.clock_value = 1000.0
        self.ledger = MemoryLimitLedger()  # the agent's record of its limits, on the host
        self.engine = self.new_engine()

    def new_engine(self) -> Engine:
        return Engine(self.nvml, self.fs, self.mps, lambda: self.clock_value, self.config,
                      ledger=self.ledger)

    def desired(self, *pods: NodePod, marked: tuple[str, ...] = ()):
        inv = take_inventory(self.nvml, mps_namespaces=(
            self.mps.supports_protocol_v3() if self.mps else None))
        return plan_node(pods, inv, self.config, marked=marked)

    def apply(self, *pods: NodePod, cgroups: bool = True, marked: tuple[str, ...] = ()):
        """`marked`: pods with a readiness marker of this boot (the agent passes them)."""
        if cgroups:
            make_cgroups(self.root, self.config.layout, pods)
        return self.engine.apply(self.desired(*pods, marked=marked))

    def slice(self, uid: str) -> str:
        return pod_cgroup(str(self.root), uid)

    def leaf(self, uid: str, cid: str) -> str:
        return f"{self.slice(uid)}/cri-containerd-{cid.split('://')[1]}.scope"


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return Node(tmp_path / "cgroup")


def sm_pod(uid: str = UID_A, cid: str = CID_A, **kw) -> NodePod:
    kw.setdefault("notes", annotations(mode="sm-sharing", portion="0.25"))
    return node_pod(uid, name=f"p-{uid[-1]}", container_ids={"main": cid}, **kw)


def ts_pod(uid: str = UID_B, cid: str = CID_B, device: str = GPU1, **kw) -> NodePod:
    kw.setdefault("notes", annotations(mode="time-slicing", devices=(device,), request="4Gi",
                                       limit="8Gi"))
    return node_pod(uid, name=f"p-{uid[-1]}", container_ids={"main": cid}, **kw)


def test_apply_enforces_everything_the_plan_needs(node: Node) -> None:
    report = node.apply(sm_pod(), ts_pod())
    a = report.containers[(UID_A, "main")]
    b = report.containers[(UID_B, "main")]
    assert a.state is ContainerState.APPLIED and b.state is ContainerState.APPLIED
    assert a.reason is None and not a.container_limit_pending
    assert a.mps_namespace == NS_A and a.plan_digest.startswith("sha256:")
    assert a.mechanisms == {Mechanism.CGROUP, Mechanism.MPS_PINNED, Mechanism.WATCHDOG}
    assert node.nvml.set_limit_calls == [
        (GPU0, node.slice(UID_A), 10 * GIB, 20 * GIB),
        (GPU1, node.slice(UID_B), 4 * GIB, 8 * GIB),
        (GPU0, node.leaf(UID_A, CID_A), 10 * GIB, 20 * GIB),
        (GPU1, node.leaf(UID_B, CID_B), 4 * GIB, 8 * GIB),
    ]
    assert [(t.path, t.soft, t.hard) for t in a.limits] == [
        (node.slice(UID_A), 10 * GIB, 20 * GIB), (node.leaf(UID_A, CID_A), 10 * GIB, 20 * GIB)]
    # compute modes: GPU0 to EXCLUSIVE_PROCESS for MPS; GPU1 already DEFAULT (not rewritten)
    assert report.compute_modes_set == ((GPU0, GpuComputeMode.EXCLUSIVE_PROCESS),)
    assert [c.args for c in node.nvml.calls_of("set_compute_mode")] == [
        (GPU0, GpuComputeMode.EXCLUSIVE_PROCESS)]
    # MPS: pinned default for GPU index 0, the namespace and its cap (set right after the
    # create, then verified: no client had attached by the list that follows)
    assert node.mps.calls == [
        ("get_default_pinned_mem_limit", (0,)),
        ("set_default_pinned_mem_limit", (0, 20480)),
        ("namespace_list", ()),
        ("namespace_create", (NS_A,)),
        ("namespace_set_active_thread_percentage", (NS_A, 25)),
        ("client_list", ()),
        # read back after the create: a daemon restarted in between would hold no limit
        ("get_default_pinned_mem_limit", (0,)),
        ("namespace_list", ()),
    ]
    assert node.mps.namespaces[NS_A].active_thread_percentage == 25
    assert report.namespaces_created == (NS_A,)
    assert report.at == 1000.0 and report.converged and report.issues == ()


def test_second_apply_writes_nothing(node: Node) -> None:
    pods = (sm_pod(), ts_pod())
    node.apply(*pods)
    nvml_calls, mps_calls = len(node.nvml.calls), len(node.mps.calls)
    report = node.apply(*pods)
    assert all(r.state is ContainerState.APPLIED for r in report.containers.values())
    assert report.writes == () and report.compute_modes_set == ()
    new_nvml = {c.method for c in node.nvml.calls[nvml_calls:]}
    assert new_nvml <= {"devices", "get_memory_limits", "memory_limits_supported",
                        "driver_version"}
    assert [m for m, _ in node.mps.calls[mps_calls:]] == [
        "get_default_pinned_mem_limit", "namespace_list", "namespace_list"]


def test_pod_slice_missing_is_pending_until_kubelet_creates_it(node: Node) -> None:
    p = sm_pod()
    report = node.apply(p, cgroups=False)
    r = report.containers[(UID_A, "main")]
    assert (r.state, r.reason) == (ContainerState.PENDING, CGROUP_NOT_FOUND)
    assert r.message == (
        f"the pod's cgroup {node.slice(UID_A)} does not exist yet (kubelet creates it when the "
        "pod starts on this node); the limits are applied as soon as it does. If it never "
        "appears, check --cgroup-root and --cgroup-driver against the kubelet's configuration")
    assert node.nvml.set_limit_calls == []
    assert not report.converged
    assert node.apply(p).containers[(UID_A, "main")].state is ContainerState.APPLIED


def test_container_cgroup_comes_later(node: Node) -> None:
    early = node_pod(UID_A, name="p-a", notes=annotations(mode="sm-sharing"), container_ids={})
    r = node.apply(early).containers[(UID_A, "main")]
    assert r.state is ContainerState.APPLIED and r.container_limit_pending
    assert node.nvml.set_limit_calls == [(GPU0, node.slice(UID_A), 10 * GIB, 20 * GIB)]
    # the runtime reports the container's ID but its cgroup is not there yet
    p = sm_pod()
    r = node.apply(p, cgroups=False).containers[(UID_A, "main")]
    assert r.state is ContainerState.APPLIED and r.container_limit_pending
    r = node.apply(p).containers[(UID_A, "main")]
    assert not r.container_limit_pending
    assert node.nvml.set_limit_calls[-1] == (GPU0, node.leaf(UID_A, CID_A), 10 * GIB, 20 * GIB)


def test_nvml_error_mid_apply_is_not_applied_and_next_apply_converges(node: Node) -> None:
    node.nvml.fail("set_memory_limits", "NoPermission", times=1, device=GPU1)
    report = node.apply(sm_pod(), ts_pod())
    a, b = report.containers[(UID_A, "main")], report.containers[(UID_B, "main")]
    assert a.state is ContainerState.APPLIED
    # read back without it, and not set: known not in force (`ContainerResult.limit_missing`)
    assert (b.state, b.reason, b.limit_missing) == (ContainerState.PENDING,
                                                    "MemoryLimitNotInForce", True)
    assert "could not be set (NVMLNoPermission: NVML refused nvmlDeviceSetMemoryLimits_v1 on " \
        "GPU " + GPU1 in b.message
    report = node.apply(sm_pod(), ts_pod())
    assert report.containers[(UID_B, "main")].state is ContainerState.APPLIED
    # the container's own cgroup got its limit the first time; only the slice was missing
    assert [w.path for w in report.writes] == [node.slice(UID_B)]


def test_compute_mode_failure_keeps_the_gpus_containers_pending(node: Node) -> None:
    node.nvml.fail("set_compute_mode", "NoPermission", times=1)
    report = node.apply(sm_pod(), ts_pod())
    assert report.containers[(UID_A, "main")].state is ContainerState.PENDING
    # GPU0 reads back DEFAULT and its set failed: known not in force (ComputeModeNotInForce)
    assert report.containers[(UID_A, "main")].reason == "ComputeModeNotInForce"
    assert report.containers[(UID_B, "main")].state is ContainerState.APPLIED
    (g0, _g1) = report.gpus
    assert g0.error is not None and g0.compute_mode is GpuComputeMode.DEFAULT
    report = node.apply(sm_pod(), ts_pod())
    assert report.containers[(UID_A, "main")].state is ContainerState.APPLIED


def test_mps_error_keeps_the_container_pending(node: Node) -> None:
    node.mps.inject("namespace_create", MpsError("MpsDaemonUnreachable", "no daemon"))
    r = node.apply(sm_pod()).containers[(UID_A, "main")]
    # no namespace to attach to: the cap is not in force, and the reason says so (the daemon's
    # own error in the message)
    assert (r.state, r.reason, r.mps_cap_missing) == (ContainerState.PENDING,
                                                      "NamespaceCapNotSet", True)
    assert f"MPS namespace {NS_A} is not there" in r.message
    assert "(MpsDaemonUnreachable: no daemon)" in r.message
    assert node.apply(sm_pod()).containers[(UID_A, "main")].state is ContainerState.APPLIED


def test_without_mps_control_sm_sharing_is_pending(tmp_path: Path) -> None:
    node = Node(tmp_path, mps=False)
    r = node.apply(sm_pod()).containers[(UID_A, "main")]
    assert (r.state, r.reason) == (ContainerState.PENDING, MPS_UNAVAILABLE)
    assert node.apply(ts_pod()).containers[(UID_B, "main")].state is ContainerState.APPLIED


def test_refused_container_gets_nothing(node: Node) -> None:
    other = "GPU-99999999-9999-9999-9999-999999999999"
    p = sm_pod(notes=annotations(mode="sm-sharing", devices=(other,)))
    report = node.apply(p)
    r = report.containers[(UID_A, "main")]
    assert (r.state, r.reason) == (ContainerState.REFUSED, "DeviceNotOnNode")
    assert r.message.startswith(f"GPU {other} assigned to this container is not on node node-a")
    assert node.nvml.set_limit_calls == [] and node.nvml.calls_of("set_compute_mode") == []
    assert node.mps.namespaces == {} and r.limits == ()


def test_not_bound_is_reported_pending(node: Node) -> None:
    r = node.apply(sm_pod(notes=annotations(devices=None))).containers[(UID_A, "main")]
    assert (r.state, r.reason) == (ContainerState.PENDING, "NotBound")


def test_release_clears_limits_and_deletes_the_namespace(node: Node) -> None:
    node.apply(sm_pod(), ts_pod())
    before = len(node.nvml.set_limit_calls)
    report = node.engine.release(UID_A)
    assert sorted(report.cleared) == sorted([(GPU0, node.slice(UID_A)),
                                             (GPU0, node.leaf(UID_A, CID_A))])
    assert report.namespaces_deleted == (NS_A,) and report.complete
    assert sorted(node.nvml.set_limit_calls[before:]) == sorted([
        (GPU0, node.slice(UID_A), 0, MEMORY_LIMIT_MAX),
        (GPU0, node.leaf(UID_A, CID_A), 0, MEMORY_LIMIT_MAX)])
    assert set(node.nvml.limits) == {(GPU1, node.slice(UID_B)), (GPU1, node.leaf(UID_B, CID_B))}
    assert NS_A not in node.mps.namespaces
    again = node.engine.release(UID_A)
    assert again.cleared == () and again.namespaces_deleted == ()


def test_the_namespace_the_webhook_named_is_created_and_released_by_container(
        node: Node) -> None:
    admitted = "kf_" + "5a" * 10
    pod = sm_pod(notes={**annotations(mode="sm-sharing", portion="0.25"),
                        "kai-fractions.io/container.main.mps-namespace": admitted})
    node.apply(pod)
    assert set(node.mps.namespaces) == {admitted}
    assert node.mps.namespaces[admitted].active_thread_percentage == 25
    report = node.engine.release(UID_A, "main")
    assert report.namespaces_deleted == (admitted,) and report.complete
    assert node.mps.namespaces == {}


def test_release_one_container_keeps_the_pod_slice_of_other_fractional_containers(
        node: Node) -> None:
    node.apply(ts_pod())
    report = node.engine.release(UID_B, "main")
    # the pod has no other fractional container, so its slice is cleared too
    assert sorted(report.cleared) == sorted([(GPU1, node.slice(UID_B)),
                                             (GPU1, node.leaf(UID_B, CID_B))])
    assert node.nvml.limits == {}


def test_release_with_attached_client_reports_and_the_sweep_retries(node: Node) -> None:
    node.apply(sm_pod())
    node.mps.attach_client(4242, NS_A)
    report = node.engine.release(UID_A)
    assert not report.complete and report.issues[0].reason == "NamespaceBusy"
    report = node.apply()  # the pod is gone from the desired state
    assert report.issues[0].reason == "NamespaceBusy"
    assert "could not delete the stale MPS namespace" in report.issues[0].message
    node.mps.detach_client(4242)
    report = node.apply()
    assert report.namespaces_deleted == (NS_A,) and report.converged


def test_restart_converges_from_the_gpu_and_daemon_state(node: Node) -> None:
    node.apply(sm_pod(), ts_pod())
    node.mps.namespaces["operator_owned"] = type(node.mps.namespaces[NS_A])("operator_owned")
    # the agent restarts; pod B vanished while it was down (its cgroup and marker are still
    # there)
    node.engine = node.new_engine()
    before = len(node.nvml.set_limit_calls)
    report = node.apply(sm_pod(), marked=(UID_A, UID_B))
    assert report.containers[(UID_A, "main")].state is ContainerState.APPLIED
    writes = node.nvml.set_limit_calls[before:]
    assert sorted(writes) == sorted([(GPU1, node.slice(UID_B), 0, MEMORY_LIMIT_MAX),
                                     (GPU1, node.leaf(UID_B, CID_B), 0, MEMORY_LIMIT_MAX)])
    assert sorted(report.cleared) == sorted([(GPU1, node.slice(UID_B)),
                                             (GPU1, node.leaf(UID_B, CID_B))])
    assert set(node.nvml.limits) == {(GPU0, node.slice(UID_A)), (GPU0, node.leaf(UID_A, CID_A))}
    assert report.compute_modes_set == ()  # GPU0 already EXCLUSIVE_PROCESS
    assert set(node.mps.namespaces) == {NS_A, "operator_owned"}  # only ours are deleted
    assert report.namespaces_deleted == ()  # B was time-slicing: it had none
    # the next apply of the restarted engine writes nothing
    assert node.apply(sm_pod()).writes == ()


def test_restart_deletes_stale_namespaces_of_vanished_pods(node: Node) -> None:
    node.apply(sm_pod(), sm_pod(UID_B, CID_B))
    node.engine = node.new_engine()
    report = node.apply(sm_pod())
    assert report.namespaces_deleted == (NS_B,)
    assert set(node.mps.namespaces) == {NS_A}


def test_limits_on_pods_that_are_not_ours_are_left_alone(node: Node) -> None:
    """A limit on the cgroup of a pod that has no fractional container, no marker and was
    never limited by this engine is someone else's (NVIDIA's container toolkit sets the same
    limits from a pod's env): the sweep must not undo it, after a restart either."""
    plain = node_pod(UID_B, name="plain", notes={}, container_ids={"main": CID_B})
    make_cgroups(node.root, node.config.layout, [plain])
    leaf = node.leaf(UID_B, CID_B)
    node.nvml.set_memory_limits(GPU1, leaf, GIB, 2 * GIB)  # the toolkit's
    for _ in range(2):
        report = node.apply(sm_pod(), plain)
        assert all(w.path.startswith(node.slice(UID_A)) for w in report.writes)
        assert node.nvml.get_memory_limits(GPU1, leaf).hard == 2 * GIB
        node.engine = node.new_engine()
    # and a pod that has gone from the API while its cgroup lingers is not ours either
    assert node.apply(sm_pod()).writes == ()
    assert node.nvml.get_memory_limits(GPU1, leaf).hard == 2 * GIB


def test_stale_limits_on_live_non_fractional_pods_with_our_marker_are_cleared(
        node: Node) -> None:
    plain = node_pod(UID_B, name="plain", notes={}, container_ids={"main": CID_B})
    make_cgroups(node.root, node.config.layout, [plain])
    node.nvml.set_memory_limits(GPU1, node.slice(UID_B), GIB, 2 * GIB)  # an agent's, earlier
    report = node.apply(plain, marked=(UID_B,))
    assert report.cleared == ((GPU1, node.slice(UID_B)),)
    assert node.apply(plain).writes == ()


def test_limits_this_engine_set_are_cleared_once_the_pod_is_not_ours_any_more(
        node: Node) -> None:
    """A pod this engine limited, gone from the API with its cgroup still there and no marker
    (the marker's directory was removed first): the engine's own record makes it ours."""
    node.apply(sm_pod(), ts_pod())
    report = node.apply(sm_pod())
    assert sorted(report.cleared) == sorted([(GPU1, node.slice(UID_B)),
                                             (GPU1, node.leaf(UID_B, CID_B))])
    assert set(node.nvml.limits) == {(GPU0, node.slice(UID_A)), (GPU0, node.leaf(UID_A, CID_A))}
    # its cgroups are removed: the record goes with them
    shutil.rmtree(node.slice(UID_B))
    assert node.apply(sm_pod()).writes == ()
    assert all(path.startswith(node.slice(UID_A)) for _gpu, path in node.engine._limited)


def test_a_restarted_engine_clears_the_limits_its_predecessor_recorded(node: Node) -> None:
    """No marker needed: a pod that went while no agent ran (or stayed pending, so it never
    got one) is found in the record of the limits the agent set."""
    node.apply(sm_pod(), ts_pod())
    node.engine = node.new_engine()
    report = node.apply(sm_pod())
    assert sorted(report.cleared) == sorted([(GPU1, node.slice(UID_B)),
                                             (GPU1, node.leaf(UID_B, CID_B))])
    assert node.ledger.entries == {(GPU0, node.slice(UID_A)), (GPU0, node.leaf(UID_A, CID_A))}


def test_a_limit_is_recorded_before_it_is_written(node: Node) -> None:
    in_force_at_save: list[set] = []
    save = node.ledger.save

    def spying(entries):
        in_force_at_save.append(set(node.nvml.limits))
        save(entries)

    node.ledger.save = spying
    node.apply(ts_pod())
    assert in_force_at_save[0] == set()  # the claim came first
    assert node.ledger.entries == {(GPU1, node.slice(UID_B)), (GPU1, node.leaf(UID_B, CID_B))}
    node.apply(ts_pod())
    assert len(in_force_at_save) == 1  # unchanged: not saved again


def test_a_clear_that_failed_is_still_claimed_after_a_restart(node: Node) -> None:
    node.apply(sm_pod(), ts_pod())
    node.nvml.fail("clear_memory_limits", "Unknown", times=None)
    assert node.apply(sm_pod()).issues
    node.nvml.clear_failures()
    node.engine = node.new_engine()
    assert len(node.apply(sm_pod()).cleared) == 2
    assert all(path.startswith(node.slice(UID_A)) for _gpu, path in node.ledger.entries)


def test_a_limit_kept_as_the_kernel_holds_it_is_not_claimed(node: Node) -> None:
    """A refused pod's limit is kept as it is (the agent may not have set it: the toolkit may
    have): it stays out of the record, so a later agent never clears it as its own."""
    plain = node_pod(UID_B, name="p-b", container_ids={"main": CID_B}, notes={})
    make_cgroups(node.root, node.config.layout, [plain])
    node.nvml.set_memory_limits(GPU1, node.slice(UID_B), GIB, 2 * GIB)  # the toolkit's
    kept = LimitTarget(GPU1, node.slice(UID_B), GIB, 2 * GIB, UID_B, None)
    desired = dataclasses.replace(with_kept_limits(node.desired(plain), ((kept,), frozenset())),
                                  owned_pods=frozenset({UID_B}))
    assert node.engine.apply(desired).writes == ()
    assert node.ledger.entries == set()
    node.engine = node.new_engine()
    assert node.apply(plain).cleared == ()
    assert node.nvml.get_memory_limits(GPU1, node.slice(UID_B)).hard == 2 * GIB


def test_a_record_that_cannot_be_saved_is_an_issue_until_it_is_saved(node: Node) -> None:
    save = node.ledger.save

    def failing(entries):
        raise PermissionError("read-only file system")

    node.ledger.save = failing
    for _ in range(2):  # tried again at every pass, not only when the claims change
        report = node.apply(ts_pod())
        assert report.containers[(UID_B, "main")].state is ContainerState.APPLIED
        [issue] = report.issues
        assert issue.reason == LEDGER_NOT_WRITTEN and "read-only file system" in issue.message
    node.ledger.save = save
    assert node.apply(ts_pod()).issues == ()
    assert node.ledger.entries == {(GPU1, node.slice(UID_B)), (GPU1, node.leaf(UID_B, CID_B))}


def test_a_release_whose_record_cannot_be_saved_still_succeeds(node: Node) -> None:
    """Its limits are gone: the record catches up at the next pass."""
    node.apply(ts_pod())

    def failing(entries):
        raise PermissionError("read-only file system")

    save, node.ledger.save = node.ledger.save, failing
    report = node.engine.release(UID_B)
    assert len(report.cleared) == 2 and report.issues == ()
    node.ledger.save = save
    node.apply()
    assert node.ledger.entries == set()


def test_mps_daemon_restart_recreates_the_namespace(node: Node) -> None:
    node.apply(sm_pod())
    node.mps.kill()
    node.mps.start()
    report = node.apply(sm_pod())
    assert report.containers[(UID_A, "main")].state is ContainerState.APPLIED
    assert report.namespaces_created == (NS_A,)
    assert node.mps.namespaces[NS_A].active_thread_percentage == 25
    assert node.mps.default_pinned_mib == {0: 20480}


def _attach_during(node: Node, method: str, pid: int) -> None:
    """A client attaches to the namespace right after the engine's next `method` call on it: a
    running container's process reconnecting (once) to a daemon that was restarted."""
    original = getattr(node.mps, method)

    def then_attach(name, *args, **kw):
        original(name, *args, **kw)
        node.mps.attach_client(pid, name)
        setattr(node.mps, method, original)

    setattr(node.mps, method, then_attach)


def _cap_unverified(pct: int, who: str) -> str:
    return (f"MPS namespace {NS_A} was created (again, e.g. after an MPS daemon restart) and "
            f"{who} before its active-thread percentage {pct} could be verified in force: MPS "
            "fixes the percentage at the first attach, so they may run without the cap for "
            "their lifetime. The container stays pending until they have exited (restart the "
            "container's GPU processes, or recreate the pod); the cap is then set before "
            "anything attaches again")


def test_a_client_that_attached_before_a_recreated_namespace_got_its_cap_keeps_it_pending(
        node: Node) -> None:
    """After an MPS daemon restart the namespace is created again; a client that attaches
    before its percentage is set runs uncapped for its lifetime: never reported applied."""
    node.apply(sm_pod())
    node.mps.kill()
    node.mps.start()
    _attach_during(node, "namespace_create", 4242)
    report = node.apply(sm_pod())
    r = report.containers[(UID_A, "main")]
    assert report.namespaces_created == (NS_A,)
    assert (r.state, r.reason) == (ContainerState.PENDING, "NamespaceCapUnverified")
    assert r.message == _cap_unverified(25, (
        "clients attached (the MPS control daemon rejected 'namespace set "
        f"{NS_A}': clients are attached (the cap is fixed at the first attach))"))
    assert node.mps.namespaces[NS_A].active_thread_percentage is None  # uncapped
    for _ in range(2):  # a resync between changes nothing: the client still runs uncapped
        r = node.apply(sm_pod()).containers[(UID_A, "main")]
        assert (r.state, r.reason) == (ContainerState.PENDING, "NamespaceCapUnverified")
        assert r.message == _cap_unverified(25, "clients (pids 4242) attached")
        node.engine.forget()
    node.mps.detach_client(4242)
    n = len(node.mps.calls)
    report = node.apply(sm_pod())
    assert report.containers[(UID_A, "main")].state is ContainerState.APPLIED
    assert node.mps.namespaces[NS_A].active_thread_percentage == 25
    # the client fixed the namespace's percentage (none) when it attached, for good: the daemon
    # refuses the set, so the namespace is made again, and set before anything attaches
    assert (report.namespaces_deleted, report.namespaces_created) == ((NS_A,), (NS_A,))
    assert [m for m, _ in node.mps.calls[n:] if "pinned" not in m] == [
        "namespace_list", "client_list", "namespace_set_active_thread_percentage",
        "namespace_delete", "namespace_create", "namespace_set_active_thread_percentage",
        "client_list", "namespace_list"]
    n = len(node.mps.calls)
    assert node.apply(sm_pod()).containers[(UID_A, "main")].state is ContainerState.APPLIED
    assert "client_list" not in node.mps.methods_called()[n:]  # verified: nothing to re-check


def test_a_client_seen_right_after_a_recreated_namespace_got_its_cap_is_not_vouched_for(
        node: Node) -> None:
    """Set, then a client in the list that follows: whether it attached before or after the
    set cannot be told, so the namespace is not applied until its clients have exited."""
    node.apply(sm_pod())
    node.mps.kill()
    node.mps.start()
    _attach_during(node, "namespace_set_active_thread_percentage", 4242)
    r = node.apply(sm_pod()).containers[(UID_A, "main")]
    assert (r.state, r.reason) == (ContainerState.PENDING, "NamespaceCapUnverified")
    assert r.message == _cap_unverified(25, "clients (pids 4242) attached")
    node.mps.detach_client(4242)
    del node.mps.namespace_set_active_thread_percentage  # the plain fake again
    assert node.apply(sm_pod()).containers[(UID_A, "main")].state is ContainerState.APPLIED


def test_a_recreated_namespace_whose_cap_could_not_be_set_is_retried_before_anyone_attaches(
        node: Node) -> None:
    node.apply(sm_pod())
    node.mps.kill()
    node.mps.start()
    node.mps.inject("namespace_set_active_thread_percentage",
                    MpsError("MpsDaemonBusy", "busy"))
    report = node.apply(sm_pod())
    r = report.containers[(UID_A, "main")]
    assert (r.state, r.reason, r.mps_cap_missing) == (ContainerState.PENDING,
                                                      "NamespaceCapNotSet", True)
    assert r.message == (
        f"MPS namespace {NS_A} was made but its active-thread percentage 25 could not be set "
        "(MpsDaemonBusy: busy); it was deleted, so that no client attaches to it without the "
        "cap. The container stays pending, and its readiness marker set aside, until the next "
        "pass has made it again with the percentage (it retries every pass; if this persists, "
        "check the MPS control daemon and its log)")
    # nobody attached yet: deleted at once, so nothing can attach to it without the cap
    assert (report.namespaces_created, report.namespaces_deleted) == ((NS_A,), (NS_A,))
    assert NS_A not in node.mps.namespaces
    n = len(node.mps.calls)
    assert node.apply(sm_pod()).containers[(UID_A, "main")].state is ContainerState.APPLIED
    assert [m for m, _ in node.mps.calls[n:] if "pinned" not in m] == [
        "namespace_list", "namespace_create", "namespace_set_active_thread_percentage",
        "client_list", "namespace_list"]
    assert node.mps.namespaces[NS_A].active_thread_percentage == 25


def test_attached_namespace_cap_is_not_reset_after_restart(node: Node) -> None:
    node.apply(sm_pod())
    node.mps.attach_client(77, NS_A)
    node.engine = node.new_engine()
    n = len(node.mps.calls)
    assert node.apply(sm_pod()).containers[(UID_A, "main")].state is ContainerState.APPLIED
    assert "namespace_set_active_thread_percentage" not in [m for m, _ in node.mps.calls[n:]]


class ReadableMps(FakeMpsControl):
    """The fake daemon, with the read of a namespace's percentage MpsControl has."""

    def namespace_get_active_thread_percentage(self, name: str) -> float | None:
        self._enter("namespace_get_active_thread_percentage", name, v3=True)
        self._alive("namespace get")
        pct = self._namespace(name).active_thread_percentage
        return None if pct is None else float(pct)


def readable(node: Node) -> Node:
    node.mps = ReadableMps()
    node.engine = node.new_engine()
    return node


def test_a_restarted_engine_does_not_adopt_an_uncapped_namespace_with_clients(
        node: Node) -> None:
    """The agent restarts while a recreated namespace's clients run uncapped: the new engine
    has no record of it, but the namespace holds no percentage, so it is not applied."""
    readable(node).apply(sm_pod())
    node.mps.kill()
    node.mps.start()
    _attach_during(node, "namespace_create", 4242)
    assert node.apply(sm_pod()).containers[(UID_A, "main")].reason == "NamespaceCapUnverified"
    node.engine = node.new_engine()  # the agent restarts
    for _ in range(2):
        r = node.apply(sm_pod()).containers[(UID_A, "main")]
        assert (r.state, r.reason) == (ContainerState.PENDING, "NamespaceCapUnverified")
        assert r.message == (
            f"MPS namespace {NS_A} has clients (pids 4242) attached but holds no active-thread "
            "percentage, not the plan's 25: MPS fixes it at the first attach, so they run "
            "without the cap for their lifetime. The container stays pending until they have "
            "exited (restart the container's GPU processes, or recreate the pod)")
    node.mps.detach_client(4242)
    assert node.apply(sm_pod()).containers[(UID_A, "main")].state is ContainerState.APPLIED
    assert node.mps.namespaces[NS_A].active_thread_percentage == 25


def test_a_restarted_engine_adopts_a_namespace_with_clients_on_the_plans_percentage(
        node: Node) -> None:
    readable(node).apply(sm_pod())
    node.mps.attach_client(77, NS_A)
    node.engine = node.new_engine()
    assert node.apply(sm_pod()).containers[(UID_A, "main")].state is ContainerState.APPLIED
    n = len(node.mps.calls)
    assert node.apply(sm_pod()).containers[(UID_A, "main")].state is ContainerState.APPLIED
    assert not {"client_list", "namespace_set_active_thread_percentage",
                "namespace_get_active_thread_percentage"} & set(node.mps.methods_called()[n:])
    # one whose clients run on another percentage is not the plan in force
    half = sm_pod(notes=annotations(mode="sm-sharing", portion="0.5"))
    node.engine = node.new_engine()
    r = node.apply(half).containers[(UID_A, "main")]
    assert (r.state, r.reason) == (ContainerState.PENDING, "NamespaceBusy")
    assert r.message == (
        f"MPS namespace {NS_A} has clients attached, which run with the active-thread "
        "percentage 25 the namespace holds (MPS fixes it at the first attach); the plan's 50 "
        "takes effect once they have exited: stop the container's GPU processes, or recreate "
        "the pod")


def test_a_new_percentage_for_an_attached_namespace_is_pending_until_its_clients_exit(
        node: Node) -> None:
    """MPS fixes the percentage at the first attach: the new one is not in force, so the
    container is not applied, and nothing records it as set (a resync between included)."""
    node.apply(sm_pod())
    node.mps.attach_client(77, NS_A)
    half = sm_pod(notes=annotations(mode="sm-sharing", portion="0.5"))
    for _ in range(2):
        r = node.apply(half).containers[(UID_A, "main")]
        assert (r.state, r.reason) == (ContainerState.PENDING, "NamespaceBusy")
        assert r.message == (
            f"MPS namespace {NS_A} has clients attached, which run with the active-thread "
            "percentage 25 set before they attached (MPS fixes it at the first attach); the "
            "plan's 50 takes effect once they have exited: stop the container's GPU processes, "
            "or recreate the pod")
        assert node.mps.namespaces[NS_A].active_thread_percentage == 25
        node.engine.forget()  # a periodic resync forgets nothing the daemon holds
    node.mps.detach_client(77)
    report = node.apply(half)
    assert report.containers[(UID_A, "main")].state is ContainerState.APPLIED
    assert node.mps.namespaces[NS_A].active_thread_percentage == 50
    # the daemon holds 25 for good (fixed at the first attach): made again to take 50
    assert (report.namespaces_deleted, report.namespaces_created) == ((NS_A,), (NS_A,))


def test_a_resync_reads_an_idle_namespaces_percentage_back_and_sets_nothing(
        node: Node) -> None:
    """A namespace whose clients came and went holds its percentage for good: a resync (or a
    restarted agent) reads it back; a set would be refused, and making it again is needless."""
    node.apply(sm_pod())
    node.mps.attach_client(77, NS_A)
    node.mps.detach_client(77)
    for engine in (node.engine, node.new_engine()):  # a resync, then an agent restart
        node.engine = engine
        engine.forget()
        n = len(node.mps.calls)
        report = node.apply(sm_pod())
        assert report.containers[(UID_A, "main")].state is ContainerState.APPLIED
        called = node.mps.methods_called()[n:]
        assert "namespace_get_active_thread_percentage" in called
        assert not {"namespace_set_active_thread_percentage", "namespace_delete",
                    "namespace_create"} & set(called), called


def test_a_namespace_made_again_with_a_client_right_after_its_set_is_not_vouched_for(
        node: Node) -> None:
    """Made again to take a new percentage, then a client in the list read after the set:
    whether it attached before the set cannot be told, so not applied until it has exited."""
    node.apply(sm_pod())
    node.mps.attach_client(77, NS_A)
    node.mps.detach_client(77)
    half = sm_pod(notes=annotations(mode="sm-sharing", portion="0.5"))
    _attach_during(node, "namespace_create", 4242)
    r = node.apply(half).containers[(UID_A, "main")]
    assert (r.state, r.reason) == (ContainerState.PENDING, "NamespaceCapUnverified")
    assert r.message == _cap_unverified(50, (
        "clients attached (the MPS control daemon rejected 'namespace set "
        f"{NS_A}': clients are attached (the cap is fixed at the first attach))"))
    r = node.apply(half).containers[(UID_A, "main")]  # the client is still there
    assert (r.state, r.reason) == (ContainerState.PENDING, "NamespaceCapUnverified")
    assert r.message == _cap_unverified(50, "clients (pids 4242) attached")
    node.mps.detach_client(4242)
    report = node.apply(half)
    assert report.containers[(UID_A, "main")].state is ContainerState.APPLIED
    assert node.mps.namespaces[NS_A].active_thread_percentage == 50


def test_a_pinned_limit_change_within_the_same_gib_is_written(node: Node) -> None:
    """The daemon reads a pinned limit back in whole GiB: 20900 MiB shows as 20G, like 20480."""
    a = sm_pod(notes=annotations(mode="sm-sharing", portion="0.25", limit="20Gi"))
    b = sm_pod(UID_B, CID_B, notes=annotations(mode="sm-sharing", portion="0.25",
                                               limit="20900Mi"))
    node.apply(a)
    assert node.mps.default_pinned_mib == {0: 20480}
    report = node.apply(a, b)
    assert report.containers[(UID_B, "main")].state is ContainerState.APPLIED
    assert node.mps.default_pinned_mib == {0: 20900}
    n = len(node.mps.calls)
    node.apply(a, b)
    assert "set_default_pinned_mem_limit" not in node.mps.methods_called()[n:]
    node.apply(a)
    assert node.mps.default_pinned_mib == {0: 20480}
    # a restarted engine does not know what was written: it writes its value once
    node.mps.default_pinned_mib[0] = 20900  # as another writer left it
    node.engine = node.new_engine()
    node.apply(a)
    assert node.mps.default_pinned_mib == {0: 20480}


def test_old_driver_uses_the_configured_fallback(tmp_path: Path) -> None:
    """Before r615 (an MPS daemon without namespaces): the only tier that caps a container is a
    watchdog that stops what exceeds its cap, so with the default report policy, which stops
    nothing, both are refused (62fc4b1): the MPS pinned limit is no tier there, its tenants can
    change it. With the kill policy both are applied, and the sm-sharing one's GPU still gets
    the pinned limit (it bounds a well-behaved tenant)."""
    node = Node(tmp_path, memory_limits=False, protocol_v3=False)
    report = node.apply(sm_pod(), ts_pod())
    for key in ((UID_A, "main"), (UID_B, "main")):
        r = report.containers[key]
        assert (r.state, r.reason) == (ContainerState.REFUSED, "MemoryLimitsUnsupported")
    assert node.nvml.set_limit_calls == []
    assert node.mps.default_pinned_mib == {}
    killing = Node(tmp_path, memory_limits=False, protocol_v3=False,
                   watchdog_policy=WatchdogPolicy.KILL)
    report = killing.apply(sm_pod(), ts_pod())
    a, b = report.containers[(UID_A, "main")], report.containers[(UID_B, "main")]
    assert a.state is ContainerState.APPLIED
    assert a.mechanisms == {Mechanism.MPS_PINNED, Mechanism.WATCHDOG} and a.mps_namespace is None
    assert (b.state, b.mechanisms) == (ContainerState.APPLIED, {Mechanism.WATCHDOG})
    assert killing.nvml.set_limit_calls == []
    assert killing.mps.default_pinned_mib == {0: 20480}
    assert not any(m.startswith("namespace") for m in killing.mps.methods_called())
    assert killing.apply(sm_pod(), ts_pod()).writes == ()


def test_old_driver_without_fallback_refuses(tmp_path: Path) -> None:
    node = Node(tmp_path, memory_limits=False, memory_enforcement="cgroup")
    r = node.apply(ts_pod()).containers[(UID_B, "main")]
    assert (r.state, r.reason) == (ContainerState.REFUSED, "MemoryLimitsUnsupported")
    assert node.nvml.set_limit_calls == []


def test_sm_sharing_disabled_never_sets_compute_modes(tmp_path: Path) -> None:
    node = Node(tmp_path, sm_sharing=False)
    node.nvml.gpu(GPU1).compute_mode = GpuComputeMode.EXCLUSIVE_PROCESS
    report = node.apply(ts_pod())
    assert report.containers[(UID_B, "main")].state is ContainerState.APPLIED
    assert node.nvml.calls_of("set_compute_mode") == []
    refused = node.apply(sm_pod()).containers[(UID_A, "main")]
    assert refused.reason == "SmSharingDisabled"


def test_nvml_down_applies_nothing_and_cleans_nothing(node: Node) -> None:
    node.apply(sm_pod())
    desired = node.desired(ts_pod())
    node.nvml.fail("devices", "DriverNotLoaded", times=1)
    report = node.engine.apply(desired)
    r = report.containers[(UID_B, "main")]
    assert (r.state, r.reason) == (ContainerState.PENDING, "NVMLUnavailable")
    assert report.issues[0].reason == "NVMLUnavailable"
    assert report.cleared == () and (GPU0, node.slice(UID_A)) in node.nvml.limits


def test_what_an_apply_leaves_in_force(node: Node) -> None:
    node.apply(sm_pod(), ts_pod())
    assert node.nvml.limits == {
        (GPU0, node.slice(UID_A)): (10 * GIB, 20 * GIB),
        (GPU0, node.leaf(UID_A, CID_A)): (10 * GIB, 20 * GIB),
        (GPU1, node.slice(UID_B)): (4 * GIB, 8 * GIB),
        (GPU1, node.leaf(UID_B, CID_B)): (4 * GIB, 8 * GIB),
    }
    assert set(node.mps.namespaces) == {NS_A}
    # a process of the pod's container is charged to its pod's limit
    node.nvml.add_process(500, GPU0, 3 * GIB, cgroup=node.leaf(UID_A, CID_A))
    got = node.engine.limits.read(GPU0, node.slice(UID_A))
    assert (got.soft, got.hard, got.current_used) == (10 * GIB, 20 * GIB, 3 * GIB)


def test_our_namespace_shape() -> None:
    assert is_our_namespace(NS_A)
    assert not is_our_namespace("default") and not is_our_namespace("kf_short")
    assert not is_our_namespace(NS_A + "0")


def test_container_key_is_a_plain_tuple() -> None:
    assert ContainerKey(UID_A, "main") == (UID_A, "main")


OTHER_GPU = "GPU-99999999-9999-9999-9999-999999999999"
REFUSALS = {
    # reason: (node options, config, the refused pod's annotations, an older pod to make room)
    "ContractInvalid": ({}, {}, annotations(request="x"), None),
    "NotBound": ({}, {}, annotations(devices=None), None),
    "DeviceNotOnNode": ({}, {}, annotations(devices=(OTHER_GPU,)), None),
    "ComputeModeMix": ({}, {}, annotations(mode="time-slicing"), "sm"),
    "MemoryOvercommitted": ({}, {}, annotations(request="70Gi", limit="70Gi"), "big"),
    "SmSharingDisabled": ({}, {"sm_sharing": False}, annotations(mode="sm-sharing"), None),
    "MemoryLimitsUnsupported": ({"memory_limits": False}, {"memory_enforcement": "cgroup"},
                                annotations(mode="time-slicing"), None),
    "MigNotSupported": ({"mig": True}, {}, annotations(mode="time-slicing"), None),
}


@pytest.mark.parametrize("reason", sorted(REFUSALS))
def test_every_refusal_reason_applies_nothing_for_that_container(tmp_path: Path,
                                                                  reason: str) -> None:
    opts, config, notes, older = REFUSALS[reason]
    node = Node(tmp_path / "cg", memory_limits=opts.get("memory_limits", True), **config)
    node.nvml.gpu(GPU0).mig = opts.get("mig", False)
    pods = []
    if older == "sm":
        pods.append(sm_pod(created="2024-01-01T00:00:00Z"))
    elif older == "big":
        pods.append(node_pod(UID_A, name="old", created="2024-01-01T00:00:00Z",
                             notes=annotations(request="60Gi", limit="60Gi")))
    newcomer = node_pod(UID_B, name="new", notes=notes, container_ids={"main": CID_B})
    pods.append(newcomer)
    report = node.apply(*pods)
    r = report.containers[(UID_B, "main")]
    assert r.reason == reason and r.message
    assert r.state is (ContainerState.PENDING if reason == "NotBound" else ContainerState.REFUSED)
    assert r.limits == () and r.plan_digest is None
    # nothing was written for the newcomer: no limit on its cgroups, no namespace, no mode
    assert not [c for c in node.nvml.set_limit_calls if c[1].startswith(node.slice(UID_B))]
    assert NS_B not in node.mps.namespaces
    assert not [c for c in node.mps.calls if NS_B in c[1]]
    if older is None:
        assert node.nvml.calls_of("set_compute_mode") == []
        assert node.mps.default_pinned_mib == {}


def test_simulated_node_for_the_demo() -> None:
    from kai_fractions.sim.cgroups import FakeCgroupFs

    nvml = FakeNvml.from_dict({"gpus": [{"model": "H100-80GB", "count": 2}]}, seed="node-a")
    nvml.init()
    config = NodeConfig(node_name="node-a")
    engine = Engine(nvml, FakeCgroupFs(assume_present=True), FakeMpsControl(), config=config)
    gpu = nvml.gpus[1].uuid
    p = node_pod(UID_A, notes=annotations(mode="sm-sharing", devices=(gpu,)))
    desired = plan_node([p], take_inventory(nvml), config)
    report = engine.apply(desired)
    assert report.containers[(UID_A, "main")].state is ContainerState.APPLIED
    slice_a = pod_cgroup("/sys/fs/cgroup", UID_A)
    assert nvml.limits[(gpu, slice_a)] == (10 * GIB, 20 * GIB)
    assert nvml.gpu(gpu).compute_mode is GpuComputeMode.EXCLUSIVE_PROCESS
    assert engine.apply(desired).writes == ()
