"""A cgroup NVML cannot open (nvml.h: NVML_ERROR_OPERATING_SYSTEM, 17, "if the cgroup path
cannot be opened"), and the limits that go with a removed cgroup (nvml.h: "Removing the cgroup
will also clear any limits").

On a node, 17 means the pod's cgroup was removed between the agent's existence check and its
NVML call (the pod is going), or NVML cannot open the path the agent names (a wrong
--cgroup-root, a cgroup mount it cannot open): the container is pending for its cgroup
(CgroupNotFound, the path named), never counted against the GPU (`UnsettableGpus`: the path is
at fault, not the GPU). A set that fails 17 on a slice still there, after a read that showed
the limit absent, is a limit known missing (MemoryLimitNotInForce, the marker set aside), still
not counted against the GPU; a clear (release, sweep) on a cgroup that went before it is clean,
no issue. Both fakes answer so: the simulated NVML over the cgroup tree it is given
(`use_cgroups`), the C fake with `check_cgroups 1`; both forget the limits of a removed cgroup.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kai_fractions.node.agent.marker_rules import decide
from kai_fractions.node.cgroups import HostCgroupFs
from kai_fractions.node.config import NodeConfig
from kai_fractions.node.desired import LimitTarget, plan_node
from kai_fractions.node.engine import ContainerState, Engine
from kai_fractions.node.errors import NvmlCgroupUnavailable, NvmlError
from kai_fractions.node.inventory import take_inventory
from kai_fractions.node.memory_limits import LimitNotSet, MemoryLimitEnforcer
from kai_fractions.node.nvml import MEMORY_LIMIT_MAX, MemoryLimits, Nvml, PynvmlNvml
from kai_fractions.sim.cgroups import FakeCgroupFs
from kai_fractions.sim.mps import FakeMpsControl
from kai_fractions.sim.nvml import FakeGpu, FakeNvml
from tests.support.fake_nvml import FakeNvml as CFake
from tests.support.fake_nvml import unload_from_pynvml

from .nodepods import GIB, GPU0, UID_A, annotations, make_cgroups, node_pod, pod_cgroup

CGROUP_NOT_FOUND = "CgroupNotFound"
MEMORY_LIMIT_NOT_IN_FORCE = "MemoryLimitNotInForce"
CLEARED = MemoryLimits(0, MEMORY_LIMIT_MAX)


class CheckedCFake(CFake):
    """The C fake NVML with `check_cgroups 1` (opt-in: many tests limit made-up paths)."""

    check_cgroups = True

    def render(self) -> str:
        return super().render() + ("check_cgroups 1\n" if self.check_cgroups else "")


@pytest.fixture
def c_fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[CheckedCFake]:
    fake = CheckedCFake(tmp_path / "fake-nvml")
    fake.activate(monkeypatch)
    fake.add_gpu(GPU0, memory_mib=81559)
    try:
        yield fake
    finally:
        unload_from_pynvml()


def _cgroup_error(call: Callable[[], object], path: str) -> NvmlError:
    with pytest.raises(NvmlError) as e:
        call()
    assert (e.value.reason, e.value.code) == (CGROUP_NOT_FOUND, 17), e.value.message
    assert path in e.value.message
    return e.value


# -- the engine: a pod slice removed after the agent found it ----------------------------------


class RemovedAfterCheck(HostCgroupFs):
    """The pod slice `victim` is removed right after the agent found it there, before its
    first NVML call on it, as the kubelet removes a going pod's cgroups."""

    def __init__(self, victim: str):
        self.victim = victim

    def exists(self, path: str) -> bool:
        found = super().exists(path)
        if found and path == self.victim:
            shutil.rmtree(path)
        return found


def _remove_before_set(nvml: Nvml, victim: str) -> None:
    """The slice `victim` is removed after its limits were read, right before the set."""
    set_limits = nvml.set_memory_limits

    def racing(uuid: str, namespace: str, soft: int, hard: int) -> None:
        if namespace == victim and os.path.isdir(victim):
            shutil.rmtree(victim)
        set_limits(uuid, namespace, soft, hard)

    nvml.set_memory_limits = racing  # type: ignore[method-assign]


def _two_passes(nvml: Nvml, root: Path, moment: str) -> None:
    """Two passes of one time-slicing pod whose slice is removed at `moment` ("read": after
    the existence check, "set": between the read and the set) in each: pending CgroupNotFound
    with the slice named, not a limit known missing, and the GPU not unsettable."""
    config = NodeConfig(node_name="node-a", cgroup_root=str(root))
    slice_a = pod_cgroup(str(root), UID_A)
    fs = RemovedAfterCheck(slice_a) if moment == "read" else HostCgroupFs()
    if moment == "set":
        _remove_before_set(nvml, slice_a)
    mps = FakeMpsControl()
    engine = Engine(nvml, fs, mps, config=config)
    pod = node_pod(UID_A, notes=annotations(mode="time-slicing"))
    for _ in range(2):
        make_cgroups(root, config.layout, [pod])  # the pod's cgroups, made again each pass
        inv = take_inventory(nvml, mps_namespaces=mps.supports_protocol_v3())
        report = engine.apply(plan_node([pod], inv, config))
        r = report.containers[(UID_A, "main")]
        assert (r.state, r.reason, r.limit_missing) == (
            ContainerState.PENDING, CGROUP_NOT_FOUND, False), r.message
        assert slice_a in r.message and "--cgroup-root" in r.message, r.message
    assert dict(engine.limits_not_settable) == {}
    assert not os.path.isdir(slice_a)


@pytest.mark.parametrize("moment", ["read", "set"])
def test_a_slice_removed_after_the_check_is_pending_for_its_cgroup_c_fake(
        tmp_path: Path, c_fake: CheckedCFake, moment: str) -> None:
    """Before: the NVML call on the removed slice failed 17, reported NVMLError ("check the
    driver with nvidia-smi") or, where the set failed after a read, MemoryLimitNotInForce, and
    after two passes the GPU counted as taking no limit (MemoryLimitsNotSettable: the node
    not ready). Now the container is pending CgroupNotFound, the slice named, and the GPU is
    not counted: through the real bindings and the C fake."""
    nvml = PynvmlNvml()
    nvml.init()
    try:
        _two_passes(nvml, tmp_path / "cg", moment)
    finally:
        nvml.shutdown()
    assert (GPU0, pod_cgroup(str(tmp_path / "cg"), UID_A)) not in c_fake.limits()


@pytest.mark.parametrize("moment", ["read", "set"])
def test_a_slice_removed_after_the_check_is_pending_for_its_cgroup_sim(
        tmp_path: Path, moment: str) -> None:
    """The same through the simulated NVML over the node's cgroup tree: before, a missing
    cgroup failed INVALID_ARGUMENT (NVMLError), counted against the GPU once the set failed."""
    root = tmp_path / "cg"
    root.mkdir()
    nvml = FakeNvml([FakeGpu(GPU0)])
    nvml.use_cgroups(str(root), HostCgroupFs())
    nvml.init()
    _two_passes(nvml, root, moment)


# -- a set that fails 17 on a slice that is there: the limit is known missing -----------------


def _sim_on(root: Path) -> FakeNvml:
    root.mkdir()
    nvml = FakeNvml([FakeGpu(GPU0)])
    nvml.use_cgroups(str(root), HostCgroupFs())
    nvml.init()
    return nvml


def _set_fails_17_on_a_present_slice(nvml: Nvml, root: Path) -> None:
    """Three passes of one time-slicing pod whose slice is there, reads back no limit, and
    whose set fails 17 each time: the limit is known not in force (MemoryLimitNotInForce,
    the marker not kept), yet never counted against the GPU (the path is at fault)."""
    config = NodeConfig(node_name="node-a", cgroup_root=str(root))
    mps = FakeMpsControl()
    engine = Engine(nvml, HostCgroupFs(), mps, config=config)
    pod = node_pod(UID_A, notes=annotations(mode="time-slicing"))
    make_cgroups(root, config.layout, [pod])
    slice_a = pod_cgroup(str(root), UID_A)
    for _ in range(3):
        inv = take_inventory(nvml, mps_namespaces=mps.supports_protocol_v3())
        r = engine.apply(plan_node([pod], inv, config)).containers[(UID_A, "main")]
        assert (r.state, r.reason, r.limit_missing, r.not_in_force) == (
            ContainerState.PENDING, MEMORY_LIMIT_NOT_IN_FORCE, True, True), r.message
        assert CGROUP_NOT_FOUND in r.message and slice_a in r.message, r.message
        assert decide({"main": r}).keep_existing is False
        assert dict(engine.limits_not_settable) == {}
    assert os.path.isdir(slice_a)
    assert nvml.get_memory_limits(GPU0, slice_a) == CLEARED


def test_a_set_failing_17_on_a_present_slice_is_a_limit_known_missing_sim(tmp_path: Path
                                                                            ) -> None:
    """Before: a set that failed 17 right after a read that succeeded and showed no limit left
    the container pending CgroupNotFound (limit_missing False), so a running pod kept its
    readiness marker while its limit was known not in force. Now the read proved the limit
    absent: MemoryLimitNotInForce, the marker set aside, and the GPU still not counted as one
    that takes no limit (NVML could not open the path: the path's fault)."""
    nvml = _sim_on(tmp_path / "cg")
    nvml.fail("set_memory_limits", 17, times=None)
    _set_fails_17_on_a_present_slice(nvml, tmp_path / "cg")


def test_a_set_failing_17_on_a_present_slice_is_a_limit_known_missing_c_fake(
        tmp_path: Path, c_fake: CheckedCFake) -> None:
    """The same through the real bindings and the C fake (the set injected to fail 17)."""
    c_fake.inject_error("nvmlDeviceSetMemoryLimits_v1", 17)
    nvml = PynvmlNvml()
    nvml.init()
    try:
        _set_fails_17_on_a_present_slice(nvml, tmp_path / "cg")
    finally:
        nvml.shutdown()


def test_ensure_raises_limit_not_set_for_a_set_that_fails_17(tmp_path: Path) -> None:
    """Before: `ensure` raised the set's NvmlCgroupUnavailable as it was, as if the read had
    failed (nothing known). Now the read before it showed the limit absent, so it raises
    `LimitNotSet` with the 17 as its cause (reason CgroupNotFound, the path named)."""
    nvml = _sim_on(tmp_path / "cg")
    cg = tmp_path / "cg" / "pod1.slice"
    cg.mkdir()
    nvml.fail("set_memory_limits", 17, times=1)
    target = LimitTarget(gpu_uuid=GPU0, path=str(cg), soft=GIB, hard=2 * GIB, pod_uid=UID_A,
                         container=None)
    with pytest.raises(LimitNotSet) as e:
        MemoryLimitEnforcer(nvml).ensure(target)
    assert isinstance(e.value.cause, NvmlCgroupUnavailable)
    assert (e.value.reason, e.value.before) == (CGROUP_NOT_FOUND, CLEARED)


# -- release: a cgroup removed between its check and its clear ----------------------------------


class RemovedOnCheck(HostCgroupFs):
    """The cgroup `victim` (once set) is removed right after a check finds it there."""

    victim: str | None = None

    def exists(self, path: str) -> bool:
        found = super().exists(path)
        if found and path == self.victim:
            shutil.rmtree(path)
        return found


def test_release_counts_a_cgroup_removed_before_its_clear_clean(tmp_path: Path) -> None:
    """Before: release's clear on a pod slice removed after its existence check failed 17 and
    was reported as an issue (gRPC Release: "not everything enforced could be removed"),
    though a removed cgroup takes its limits with it (nvml.h). Now the path counts clean: no
    issue, nothing left claimed."""
    root = tmp_path / "cg"
    nvml = _sim_on(root)
    fs = RemovedOnCheck()
    nvml.use_cgroups(str(root), fs)
    config = NodeConfig(node_name="node-a", cgroup_root=str(root))
    mps = FakeMpsControl()
    engine = Engine(nvml, fs, mps, config=config)
    pod = node_pod(UID_A, notes=annotations(mode="time-slicing"))
    make_cgroups(root, config.layout, [pod])
    slice_a = pod_cgroup(str(root), UID_A)
    inv = take_inventory(nvml, mps_namespaces=mps.supports_protocol_v3())
    r = engine.apply(plan_node([pod], inv, config)).containers[(UID_A, "main")]
    assert r.state is ContainerState.APPLIED, r.message
    fs.victim = slice_a
    report = engine.release(UID_A)
    assert not os.path.isdir(slice_a)
    assert report.issues == (), report.issues
    assert report.complete
    assert not [key for key in engine._limited if key[1].startswith(slice_a)]


def test_the_sweep_counts_a_cgroup_removed_before_its_clear_clean(tmp_path: Path) -> None:
    """Before: the sweep's clear of a pod no longer desired, whose slice the kubelet removed
    after the scan found it, failed 17 and was reported as an issue of the pass ("could not
    clear the stale GPU memory limit"), the slice kept as ours. Now it counts clean: no
    issue, nothing left claimed."""
    root = tmp_path / "cg"
    nvml = _sim_on(root)
    config = NodeConfig(node_name="node-a", cgroup_root=str(root))
    mps = FakeMpsControl()
    engine = Engine(nvml, HostCgroupFs(), mps, config=config)
    pod = node_pod(UID_A, notes=annotations(mode="time-slicing"))
    make_cgroups(root, config.layout, [pod])
    slice_a = pod_cgroup(str(root), UID_A)
    inv = take_inventory(nvml, mps_namespaces=mps.supports_protocol_v3())
    r = engine.apply(plan_node([pod], inv, config)).containers[(UID_A, "main")]
    assert r.state is ContainerState.APPLIED, r.message
    read = nvml.get_memory_limits

    def racing(uuid: str, namespace: str) -> MemoryLimits:
        if namespace == slice_a and os.path.isdir(slice_a):
            shutil.rmtree(slice_a)
        return read(uuid, namespace)

    nvml.get_memory_limits = racing  # type: ignore[method-assign]
    report = engine.apply(plan_node([], inv, config))
    assert not os.path.isdir(slice_a)
    assert report.issues == (), report.issues
    assert not [key for key in engine._limited if key[1].startswith(slice_a)]


# -- the fakes: 17 for a cgroup that is not there, limits gone with a removed one --------------


def test_the_sim_answers_17_for_a_missing_cgroup_and_forgets_a_removed_ones_limits() -> None:
    """Before: a missing cgroup failed NVML_ERROR_INVALID_ARGUMENT (2), and a cgroup removed
    and made again still read back its old limits. Now a missing cgroup fails 17 (nvml.h: the
    cgroup path cannot be opened), and `FakeCgroupFs.remove` takes the limits under the path
    with it; another cgroup's stay."""
    root = "/sys/fs/cgroup"
    pod = f"{root}/kubepods.slice/kubepods-pod1.slice"
    leaf = f"{pod}/cri-containerd-abc.scope"
    other = f"{root}/kubepods.slice/kubepods-pod1.slicex"
    fs = FakeCgroupFs([leaf, other])
    nvml = FakeNvml([FakeGpu("GPU-a")])
    nvml.use_cgroups(root, fs)
    nvml.init()
    _cgroup_error(lambda: nvml.set_memory_limits("GPU-a", f"{pod}/nope.scope", GIB, 2 * GIB),
                  f"{pod}/nope.scope")
    for path in (pod, leaf, other):
        nvml.set_memory_limits("GPU-a", path, GIB, 2 * GIB)
    fs.remove(pod)
    assert nvml.limits == {("GPU-a", other): (GIB, 2 * GIB)}
    _cgroup_error(lambda: nvml.get_memory_limits("GPU-a", pod), pod)
    fs.add(leaf)  # made again: without limits
    assert nvml.get_memory_limits("GPU-a", pod) == CLEARED
    assert nvml.get_memory_limits("GPU-a", leaf) == CLEARED


def test_the_c_fake_forgets_a_removed_cgroups_limits(tmp_path: Path, c_fake: CheckedCFake
                                                     ) -> None:
    """Before: the C fake kept a record for its path whatever became of the directory: a cgroup
    removed and made again read back its old limits. Now a record whose directory is gone, or
    was made again, is absent (NOT_FOUND: no limit); a path that was not a directory when set
    (what many tests name) keeps its record."""
    c_fake.check_cgroups = False
    c_fake.write()
    nvml = PynvmlNvml()
    nvml.init()
    try:
        cg = tmp_path / "cg" / "kubepods.slice" / "pod1.slice"
        cg.mkdir(parents=True)
        nvml.set_memory_limits(GPU0, str(cg), GIB, 3 * GIB)
        assert nvml.get_memory_limits(GPU0, str(cg)) == MemoryLimits(GIB, 3 * GIB)
        shutil.rmtree(tmp_path / "cg")
        assert nvml.get_memory_limits(GPU0, str(cg)) == CLEARED
        cg.mkdir(parents=True)
        assert nvml.get_memory_limits(GPU0, str(cg)) == CLEARED
        nvml.set_memory_limits(GPU0, str(cg), GIB, 2 * GIB)  # set again in the new one
        assert nvml.get_memory_limits(GPU0, str(cg)) == MemoryLimits(GIB, 2 * GIB)
        made_up = "/sys/fs/cgroup/made/up.slice"
        nvml.set_memory_limits(GPU0, made_up, GIB, 2 * GIB)
        assert nvml.get_memory_limits(GPU0, made_up) == MemoryLimits(GIB, 2 * GIB)
    finally:
        nvml.shutdown()


def test_the_c_fake_with_check_cgroups_answers_17(tmp_path: Path, c_fake: CheckedCFake) -> None:
    """Before: the C fake took any absolute path as a cgroup. With `check_cgroups 1` a
    namespace that is not an existing directory fails 17 (set and get), as the real library
    does for a path it cannot open; one removed after its set fails so too, and one made again
    reads back no limit."""
    nvml = PynvmlNvml()
    nvml.init()
    try:
        missing = str(tmp_path / "cg" / "nope.slice")
        _cgroup_error(lambda: nvml.set_memory_limits(GPU0, missing, GIB, 2 * GIB), missing)
        _cgroup_error(lambda: nvml.get_memory_limits(GPU0, missing), missing)
        cg = tmp_path / "cg" / "pod1.slice"
        cg.mkdir(parents=True)
        nvml.set_memory_limits(GPU0, str(cg), GIB, 2 * GIB)
        cg.rmdir()
        _cgroup_error(lambda: nvml.get_memory_limits(GPU0, str(cg)), str(cg))
        cg.mkdir()
        assert nvml.get_memory_limits(GPU0, str(cg)) == CLEARED
        assert [c.args[0] for c in c_fake.calls("SetMemoryLimits") if c.rc == 17] == [missing]
    finally:
        nvml.shutdown()
