"""The memory-limit enforcer over the REAL pynvml and the fake library: exact bytes and paths,
idempotence (reads before writes), clearing, and the old-driver FunctionNotFound."""

from __future__ import annotations

import pynvml
import pytest

from kai_fractions.node.desired import LimitTarget
from kai_fractions.node.errors import NvmlFunctionNotFound, NvmlNoPermission
from kai_fractions.node.memory_limits import LimitNotSet, LimitWrite, MemoryLimitEnforcer
from kai_fractions.node.nvml import MEMORY_LIMIT_MAX, MemoryLimits, PynvmlNvml

GIB = 1 << 30
U0 = "GPU-00000000-0000-0000-0000-000000000001"
SLICE = "/sys/fs/cgroup/kubepods/burstable/pod0a1b2c3d-0000-4000-8000-00000000000a"
LEAF = SLICE + "/" + "a" * 64
POD = LimitTarget(U0, SLICE, 10 * GIB, 20 * GIB, "0a1b2c3d-0000-4000-8000-00000000000a", None)


@pytest.fixture
def enforcer(fake_nvml):
    fake_nvml.add_gpu(U0)
    nvml = PynvmlNvml()
    nvml.init()
    yield MemoryLimitEnforcer(nvml)
    nvml.shutdown()


def test_ensure_writes_once_then_only_reads(enforcer, fake_nvml) -> None:
    write = enforcer.ensure(POD)
    assert write == LimitWrite(U0, SLICE, MemoryLimits(0, MEMORY_LIMIT_MAX, 0), 10 * GIB, 20 * GIB)
    assert enforcer.ensure(POD) is None
    assert [(c.uuid, c.args) for c in fake_nvml.calls("SetMemoryLimits")] == [
        (U0, (SLICE, "10737418240", "21474836480"))]


def test_changed_target_is_rewritten(enforcer, fake_nvml) -> None:
    enforcer.ensure(POD)
    bigger = LimitTarget(U0, SLICE, 10 * GIB, 30 * GIB, POD.pod_uid, None)
    assert enforcer.ensure(bigger).before == MemoryLimits(10 * GIB, 20 * GIB, 0)
    assert fake_nvml.limits()[(U0, SLICE)].hard == 30 * GIB


def test_clear_only_when_something_is_there(enforcer, fake_nvml) -> None:
    assert enforcer.clear(U0, LEAF) is None
    enforcer.ensure(POD)
    write = enforcer.clear(U0, SLICE)
    assert (write.soft, write.hard) == (0, MEMORY_LIMIT_MAX)
    assert fake_nvml.calls("SetMemoryLimits")[-1].args == (SLICE, "0", str(MEMORY_LIMIT_MAX))
    assert enforcer.clear(U0, SLICE) is None
    assert len(fake_nvml.calls("SetMemoryLimits")) == 2


def test_errors_are_typed(enforcer, fake_nvml) -> None:
    """A set that fails after a read that shows another limit: `LimitNotSet` (the target is
    known not in force), carrying what was read and NVML's own error; a read that fails raises
    its own error (nothing known)."""
    fake_nvml.inject_error("nvmlDeviceSetMemoryLimits_v1", pynvml.NVML_ERROR_NO_PERMISSION, 1)
    with pytest.raises(LimitNotSet) as err:
        enforcer.ensure(POD)
    assert isinstance(err.value.cause, NvmlNoPermission)
    assert (err.value.reason, err.value.message) == (err.value.cause.reason,
                                                     err.value.cause.message)
    assert err.value.before == MemoryLimits(0, MEMORY_LIMIT_MAX, 0)
    assert err.value.target == POD
    assert fake_nvml.limits() == {}
    fake_nvml.inject_error("nvmlDeviceGetMemoryLimits_v1", pynvml.NVML_ERROR_NO_PERMISSION, 1)
    with pytest.raises(NvmlNoPermission) as read:
        enforcer.ensure(POD)
    assert not isinstance(read.value, LimitNotSet)
    assert enforcer.ensure(POD) is not None


def test_old_driver(fake_nvml_old_driver) -> None:
    fake_nvml_old_driver.add_gpu(U0)
    nvml = PynvmlNvml()
    nvml.init()
    try:
        e = MemoryLimitEnforcer(nvml)
        assert not e.supported()
        with pytest.raises(NvmlFunctionNotFound) as err:
            e.ensure(POD)
        assert err.value.reason == "DriverTooOld"
    finally:
        nvml.shutdown()
