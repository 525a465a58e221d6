"""A GPU memory limit is in force only once it reads back so: NVML's set returning success is not
enough. A driver that rounds the limit, clamps it or ignores the set leaves the cgroup without
the plan's limit, so `MemoryLimitEnforcer.ensure` reads the limits back after every set and
raises `LimitNotSet` (reason `LimitNotReadBack` in the cause) unless they are exactly the
target; on a pod slice the container is then pending `MemoryLimitNotInForce`, its readiness
marker set aside (or never written) and its gate waits. A read-back that fails proves nothing
and raises the read's own error, as the first read does."""

from __future__ import annotations

from pathlib import Path

import pytest

from kai_fractions.gate.check import Outcome
from kai_fractions.marker import SET_ASIDE_FILE
from kai_fractions.node.desired import LimitTarget
from kai_fractions.node.engine import ContainerState
from kai_fractions.node.errors import NvmlError
from kai_fractions.node.memory_limits import LimitNotSet, LimitWrite, MemoryLimitEnforcer
from kai_fractions.node.nvml import MEMORY_LIMIT_MAX, MemoryLimits
from kai_fractions.sim.nvml import FakeNvml
from tests.agent.builders import (
    GIB,
    MIB,
    NODE,
    Rig,
    binder_annotations,
    gate_outcome,
    leaf_of,
    limits_of,
    marker_of,
    pod,
    result_of,
    slice_of,
)

LIMIT_NOT_READ_BACK = "LimitNotReadBack"
"""kai_fractions.node.memory_limits.LIMIT_NOT_READ_BACK, as a container's message names it."""
MEMORY_LIMIT_NOT_IN_FORCE = "MemoryLimitNotInForce"


class DriftingNvml(FakeNvml):
    """A driver whose set of a limit returns success but keeps something else: `drift`
    "higher" (the hard limit 64 MiB above what was asked, as a driver rounding up to its
    granularity), "soft" (the soft limit 1 MiB below), "ignore" (nothing changes), or None (an
    honest driver). Clears are left alone."""

    drift: str | None = None

    def set_memory_limits(self, uuid: str, namespace: str, soft: int, hard: int) -> None:
        key = (uuid, namespace)
        before = self.limits.get(key)
        super().set_memory_limits(uuid, namespace, soft, hard)
        if self.drift == "higher":
            self.limits[key] = (soft, hard + 64 * MIB)
        elif self.drift == "soft":
            self.limits[key] = (soft - MIB, hard)
        elif self.drift == "ignore":
            if before is None:
                self.limits.pop(key, None)
            else:
                self.limits[key] = before


def _drifting() -> DriftingNvml:
    nvml = DriftingNvml.simulated(2, model="H100-80GB", seed=NODE)
    assert isinstance(nvml, DriftingNvml)
    return nvml


def _target(nvml: FakeNvml) -> LimitTarget:
    nvml.init()
    return LimitTarget(nvml.gpus[0].uuid, "/sys/fs/cgroup/kubepods/podx", 10 * GIB, 20 * GIB,
                       "x", None)


READ_BACK = {
    "higher": (MemoryLimits(10 * GIB, 20 * GIB + 64 * MIB), "soft 10240 MiB, hard 20544 MiB"),
    "soft": (MemoryLimits(10 * GIB - MIB, 20 * GIB), "soft 10239 MiB, hard 20480 MiB"),
    "ignore": (MemoryLimits(0, MEMORY_LIMIT_MAX), "no limit"),
}
"""What each drift leaves in force after a set of soft 10 GiB, hard 20 GiB, and how a message
says it."""


@pytest.mark.parametrize("drift", sorted(READ_BACK))
def test_a_set_that_returns_success_is_read_back(drift: str) -> None:
    """Before: a set that returned success was taken as the limit in force (`ensure` returned
    the write), whatever the driver kept. Now the limits are read back, and anything but the
    target exactly is `LimitNotSet`: what was read back, and a cause of its own
    (LimitNotReadBack) whose message says the set returned success but the limit reads back
    otherwise."""
    nvml = _drifting()
    nvml.drift = drift
    target = _target(nvml)
    with pytest.raises(LimitNotSet) as err:
        MemoryLimitEnforcer(nvml).ensure(target)
    readback, said = READ_BACK[drift]
    assert err.value.target == target
    assert (err.value.before.soft, err.value.before.hard) == (readback.soft, readback.hard)
    assert err.value.cause.reason == err.value.reason == LIMIT_NOT_READ_BACK
    assert err.value.message == err.value.cause.message
    assert "returned success" in err.value.message
    assert f"reads back {said}" in err.value.message, err.value.message
    assert [c.method for c in nvml.calls if c.method != "init"] == [
        "get_memory_limits", "set_memory_limits", "get_memory_limits"]


def test_a_set_read_back_in_force_is_a_write() -> None:
    """The honest driver: the set is read back as the target, the write is returned, and the
    next ensure only reads."""
    nvml = _drifting()
    target = _target(nvml)
    enforcer = MemoryLimitEnforcer(nvml)
    assert enforcer.ensure(target) == LimitWrite(target.gpu_uuid, target.path,
                                                 MemoryLimits(0, MEMORY_LIMIT_MAX),
                                                 10 * GIB, 20 * GIB)
    assert enforcer.ensure(target) is None
    assert [c.method for c in nvml.calls if c.method != "init"] == [
        "get_memory_limits", "set_memory_limits", "get_memory_limits", "get_memory_limits"]


class ReadBackFails(DriftingNvml):
    """The read after a successful set fails (once)."""

    def set_memory_limits(self, uuid: str, namespace: str, soft: int, hard: int) -> None:
        super().set_memory_limits(uuid, namespace, soft, hard)
        self.fail("get_memory_limits", "Unknown", times=1)


def test_a_read_back_that_fails_proves_nothing() -> None:
    """Before: the read-back did not happen. Now a read-back that fails raises the read's own
    NvmlError, not `LimitNotSet`: it proves nothing of what is in force, as the first read."""
    nvml = ReadBackFails.simulated(2, model="H100-80GB", seed=NODE)
    target = _target(nvml)
    with pytest.raises(NvmlError) as err:
        MemoryLimitEnforcer(nvml).ensure(target)
    assert not isinstance(err.value, LimitNotSet)
    assert err.value.reason == "NVMLError"
    assert [c.method for c in nvml.calls if c.method != "init"] == [
        "get_memory_limits", "set_memory_limits", "get_memory_limits"]


def _assert_not_in_force(rig: Rig, uid: str, said: str) -> None:
    report = rig.step()
    assert not report.converged and MEMORY_LIMIT_NOT_IN_FORCE in report.errors
    r = result_of(rig, uid)
    assert (r.state, r.reason, r.limit_missing, r.not_in_force, r.limits) == (
        ContainerState.PENDING, MEMORY_LIMIT_NOT_IN_FORCE, True, True, ())
    assert r.message.startswith(
        f"the GPU memory limit on the pod's cgroup {slice_of(uid)} (GPU {rig.gpu0}) reads back "
        f"{said}, not the plan's soft 10240 MiB, hard 20480 MiB, and could not be set "
        f"({LIMIT_NOT_READ_BACK}: "), r.message
    assert "returned success" in r.message
    assert marker_of(rig, uid) is None
    assert gate_outcome(rig, uid) is Outcome.WAIT


@pytest.mark.parametrize("drift", ["higher", "ignore"])
def test_a_new_pod_whose_limit_reads_back_otherwise_waits(short_tmp: Path, drift: str) -> None:
    """The reviewer's probe: the driver's set returns success but keeps a hard limit 64 MiB
    higher, or nothing. Before, the container was `applied`, its marker written, its gate
    released and the pass converged, with a write at every pass. Now it is pending
    MemoryLimitNotInForce (LimitNotReadBack named), no marker is written, its gate waits; once
    the driver keeps the limit, it is applied."""
    nvml = _drifting()
    nvml.drift = drift
    rig = Rig(short_tmp, sm_sharing=False, nvml=nvml)
    uid = rig.add(pod("p", notes=binder_annotations(devices=rig.gpu0)))["metadata"]["uid"]
    said = {"higher": "soft 10240 MiB, hard 20544 MiB", "ignore": "no limit"}[drift]
    for _ in range(2):
        _assert_not_in_force(rig, uid, said)
    nvml.drift = None
    assert rig.step().converged
    r = result_of(rig, uid)
    assert (r.state, r.limit_missing) == (ContainerState.APPLIED, False)
    assert limits_of(rig, uid) == {slice_of(uid): (10 * GIB, 20 * GIB),
                                   leaf_of(uid): (10 * GIB, 20 * GIB)}
    assert gate_outcome(rig, uid) is Outcome.RELEASE


def test_a_running_pod_whose_limit_reads_back_otherwise_is_set_aside(short_tmp: Path) -> None:
    """Before: a running pod whose slice was made again (its limits gone) and whose set the
    driver rounded kept its applied marker. Now the marker is set aside and the gate waits."""
    nvml = _drifting()
    rig = Rig(short_tmp, sm_sharing=False, nvml=nvml)
    uid = rig.add(pod("p", notes=binder_annotations(devices=rig.gpu0)))["metadata"]["uid"]
    assert rig.step().converged
    assert marker_of(rig, uid)["containers"]["main"]["state"] == "applied"
    nvml.use_cgroups("/sys/fs/cgroup", rig.cgroups)  # its removals clear NVML's limits
    rig.cgroups.remove(slice_of(uid))  # the cgroups made again: no limits (nvml.h)
    rig.cgroups.add(leaf_of(uid))
    assert limits_of(rig, uid) == {}
    nvml.drift = "higher"
    _assert_not_in_force(rig, uid, "soft 10240 MiB, hard 20544 MiB")
    assert (rig.marker_path(uid).parent / SET_ASIDE_FILE).exists()
