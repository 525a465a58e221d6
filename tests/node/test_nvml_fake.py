"""The in-memory FakeNvml: configuration, the seam's behaviour, error injection, the call log."""

from __future__ import annotations

from pathlib import Path

import pytest

from kai_fractions.node.errors import (
    ConfigError,
    NvmlCgroupUnavailable,
    NvmlDriverNotLoaded,
    NvmlFunctionNotFound,
    NvmlGpuLost,
    NvmlNoPermission,
    NvmlNotFound,
    NvmlNotSupported,
    NvmlUnknown,
)
from kai_fractions.node.nvml import (
    MEMORY_LIMIT_MAX,
    GpuComputeMode,
    GpuProcess,
    MemoryLimits,
    Nvml,
)
from kai_fractions.sim.cgroups import FakeCgroupFs
from kai_fractions.sim.nvml import (
    CALL_LOG_SIZE,
    FakeGpu,
    FakeNvml,
    GpuOutOfMemory,
    NvmlCall,
    fake_uuid,
)

MIB = 1 << 20
GIB = 1 << 30
NS = "/sys/fs/cgroup/kubepods.slice/x.slice"


def started(fake: FakeNvml) -> FakeNvml:
    fake.init()
    return fake


def test_simulated_h100s() -> None:
    nvml = started(FakeNvml.simulated(2, seed="node-a"))
    assert isinstance(nvml, Nvml)
    d0, d1 = nvml.devices()
    assert (d0.index, d0.name, d0.memory_total, d0.compute_mode, d0.mig_enabled) == (
        0, "NVIDIA H100 80GB HBM3", 81559 * MIB, GpuComputeMode.DEFAULT, False)
    assert d0.uuid == fake_uuid("node-a", 0) and d1.uuid == fake_uuid("node-a", 1)
    assert d0.uuid != fake_uuid("node-b", 0)
    assert nvml.driver_version() == "615.00.00"
    assert nvml.memory_limits_supported()


def test_fake_uuid_is_well_formed_and_stable() -> None:
    u = fake_uuid("s", 3)
    assert u == fake_uuid("s", 3)
    parts = u.split("-")
    assert parts[0] == "GPU" and [len(p) for p in parts[1:]] == [8, 4, 4, 4, 12]


def test_from_yaml_file(tmp_path: Path) -> None:
    f = tmp_path / "gpus.yaml"
    f.write_text(
        "driver_version: 535.104.05\n"
        "memory_limits: false\n"
        "gpus:\n"
        "  - model: A100-40GB\n"
        "    count: 2\n"
        "  - uuid: GPU-abc\n"
        "    name: Custom GPU\n"
        "    memory: 16Gi\n"
        "    compute_mode: exclusive-process\n"
        "    mig: true\n"
        "processes:\n"
        "  - {gpu: 0, pid: 42, used: 1Gi, sm: 30, cgroup: /a/b}\n"
        "  - {gpu: GPU-abc, pid: 43, used: na}\n")
    nvml = started(FakeNvml.from_yaml(f))
    devs = nvml.devices()
    assert [(d.name, d.memory_total) for d in devs] == [
        ("NVIDIA A100-SXM4-40GB", 40960 * MIB), ("NVIDIA A100-SXM4-40GB", 40960 * MIB),
        ("Custom GPU", 16 * GIB)]
    assert devs[2].uuid == "GPU-abc" and devs[2].mig_enabled
    assert devs[2].compute_mode is GpuComputeMode.EXCLUSIVE_PROCESS
    assert devs[0].memory_used == GIB
    assert nvml.driver_version() == "535.104.05" and not nvml.memory_limits_supported()
    assert nvml.running_processes("GPU-abc") == (GpuProcess(43, None),)
    (u,) = nvml.process_utilization(devs[0].uuid)
    assert (u.pid, u.sm_percent) == (42, 30)


@pytest.mark.parametrize(("data", "message"), [
    ({"gpus": [{"model": "B9000"}]}, "gpus[0].model: unknown GPU model 'B9000'; known: "),
    ({"gpus": [{"memory": "lots"}]}, "gpus[0].memory: "),
    ({"gpus": [{"count": 0}]}, "gpus[0].count: must be a whole number >= 1, got 0"),
    ({"gpus": [{"uuid": "GPU-x", "count": 2}]}, "gpus[0]: uuid can only be given with count 1"),
    ({"gpus": [{"colour": "green"}]}, "gpus[0]: unknown keys ['colour']"),
    ({"gpus": [{"compute_mode": "turbo"}]}, "gpus[0].compute_mode: one of default, "),
    ({"gpus": [{}], "processes": [{"gpu": 3, "pid": 1, "used": 1}]},
     "processes[0].gpu: no GPU with index 3"),
    ({"processes": [{"pid": 1}]}, "processes[0]: gpu is required"),
    ({"gpu": []}, "fake NVML config: unknown keys ['gpu']"),
    ({"gpus": [{"uuid": "GPU-x"}, {"uuid": "GPU-x"}]}, "GPU UUIDs must be unique"),
    # A quoted "false" is a non-empty string: it must not turn MIG on.
    ({"gpus": [{"mig": "false"}]},
     "gpus[0].mig: must be true or false (a YAML boolean, unquoted), got 'false'"),
    ({"gpus": [{"mig": None}]}, "gpus[0].mig: must be true or false"),
    ({"gpus": [{"memory": 1}]}, "gpus[0].memory: must be at least 1Mi (a bare number is bytes"),
])
def test_config_errors_say_what_is_wrong(data, message) -> None:
    with pytest.raises(ConfigError) as e:
        FakeNvml.from_dict(data)
    assert message in e.value.message
    assert e.value.reason == "InvalidConfig"


def test_bad_yaml() -> None:
    with pytest.raises(ConfigError, match="not valid YAML"):
        FakeNvml.from_yaml("gpus: [")


def test_calls_need_init() -> None:
    nvml = FakeNvml.simulated(1)
    with pytest.raises(NvmlUnknown) as e:
        nvml.devices()
    assert e.value.code == 1  # NVML_ERROR_UNINITIALIZED
    nvml.init()
    nvml.shutdown()
    with pytest.raises(NvmlUnknown):
        nvml.driver_version()


def test_memory_limits_set_get_clear_and_call_log() -> None:
    nvml = started(FakeNvml([FakeGpu("GPU-a")], processes=[]))
    nvml.add_process(7, "GPU-a", 3 * GIB, cgroup=NS + "/leaf.scope")
    nvml.add_process(8, 0, GIB, cgroup="/elsewhere")
    assert nvml.get_memory_limits("GPU-a", NS) == MemoryLimits(0, MEMORY_LIMIT_MAX, 3 * GIB)
    nvml.set_memory_limits("GPU-a", NS, GIB, 2 * GIB)
    assert nvml.limits == {("GPU-a", NS): (GIB, 2 * GIB)}
    assert nvml.get_memory_limits("GPU-a", NS) == MemoryLimits(GIB, 2 * GIB, 3 * GIB)
    nvml.clear_memory_limits("GPU-a", NS)
    assert nvml.limits == {}
    assert nvml.get_memory_limits("GPU-a", NS).cleared
    assert nvml.set_limit_calls == [("GPU-a", NS, GIB, 2 * GIB), ("GPU-a", NS, 0, MEMORY_LIMIT_MAX)]
    assert nvml.calls_of("set_memory_limits") == [
        NvmlCall("set_memory_limits", ("GPU-a", NS, GIB, 2 * GIB))]
    nvml.remove_process(7)
    assert nvml.get_memory_limits("GPU-a", NS).current_used == 0


def test_invalid_limits_are_refused() -> None:
    nvml = started(FakeNvml([FakeGpu("GPU-a")]))
    with pytest.raises(NvmlUnknown, match="soft 2 must be <= hard 1"):
        nvml.set_memory_limits("GPU-a", NS, 2, 1)
    with pytest.raises(NvmlUnknown, match="not an absolute cgroup path"):
        nvml.set_memory_limits("GPU-a", "relative", 1, 2)
    total = nvml.devices()[0].memory_total  # as nvml.h: no limit above the device's memory
    with pytest.raises(NvmlUnknown, match=f"hard {total + 1} exceeds the GPU's {total} bytes"):
        nvml.set_memory_limits("GPU-a", NS, 1, total + 1)
    nvml.set_memory_limits("GPU-a", NS, 1, total)
    nvml.set_memory_limits("GPU-a", NS, 0, MEMORY_LIMIT_MAX)  # MAX is "no limit", not a size
    with pytest.raises(NvmlNotFound) as e:
        nvml.set_memory_limits("GPU-nope", NS, 1, 2)
    assert e.value.reason == "GPUNotFound"


def test_old_driver_has_no_memory_limit_functions() -> None:
    nvml = started(FakeNvml([FakeGpu("GPU-a")], memory_limits=False))
    assert not nvml.memory_limits_supported()
    with pytest.raises(NvmlFunctionNotFound) as e:
        nvml.set_memory_limits("GPU-a", NS, 1, 2)
    assert e.value.reason == "DriverTooOld"
    assert e.value.function == "nvmlDeviceSetMemoryLimits_v1"
    assert e.value.message == (
        "the NVIDIA driver's NVML has no nvmlDeviceSetMemoryLimits_v1: cgroup GPU memory limits "
        "need NVIDIA driver r615 or newer; upgrade the driver, or allow a fallback with "
        "--memory-enforcement: mps-pinned (sm-sharing containers), or watchdog with "
        "--watchdog-policy=kill (one that only reports caps nothing)")


def test_mig_and_lost_gpus() -> None:
    nvml = started(FakeNvml([FakeGpu("GPU-m", mig=True), FakeGpu("GPU-l")]))
    with pytest.raises(NvmlNotSupported):
        nvml.get_memory_limits("GPU-m", NS)
    nvml.gpu("GPU-l").lost = True
    with pytest.raises(NvmlGpuLost) as e:
        nvml.running_processes("GPU-l")
    assert e.value.reason == "GPULost"
    with pytest.raises(NvmlGpuLost):
        nvml.devices()


def test_error_injection_times_and_device() -> None:
    nvml = started(FakeNvml([FakeGpu("GPU-a"), FakeGpu("GPU-b")]))
    nvml.fail("set_memory_limits", "NoPermission", times=1, device="GPU-b")
    nvml.set_memory_limits("GPU-a", NS, 1, 2)  # other GPU: unaffected
    with pytest.raises(NvmlNoPermission) as e:
        nvml.set_memory_limits("GPU-b", NS, 1, 2)
    assert e.value.reason == "NVMLNoPermission"
    assert "must run as root" in e.value.message
    nvml.set_memory_limits("GPU-b", NS, 1, 2)  # used up
    nvml.fail("devices", "Unknown", times=None)
    for _ in range(3):
        with pytest.raises(NvmlUnknown):
            nvml.devices()
    nvml.clear_failures()
    assert len(nvml.devices()) == 2
    with pytest.raises(ConfigError, match="unknown seam method 'nope'"):
        nvml.fail("nope")
    with pytest.raises(ConfigError, match="unknown NVML error 'Oops'"):
        nvml.fail("devices", "Oops")


def test_init_failure_like_a_node_without_driver() -> None:
    nvml = FakeNvml.simulated(1)
    nvml.fail("init", "DriverNotLoaded", times=None)
    with pytest.raises(NvmlDriverNotLoaded) as e:
        nvml.init()
    assert e.value.reason == "NVMLUnavailable"


def test_compute_mode() -> None:
    nvml = started(FakeNvml([FakeGpu("GPU-a")]))
    nvml.set_compute_mode("GPU-a", GpuComputeMode.EXCLUSIVE_PROCESS)
    assert nvml.devices()[0].compute_mode is GpuComputeMode.EXCLUSIVE_PROCESS
    with pytest.raises(NvmlNotSupported):
        nvml.set_compute_mode("GPU-a", GpuComputeMode.EXCLUSIVE_THREAD)
    assert nvml.calls_of("set_compute_mode")[0].args == ("GPU-a",
                                                         GpuComputeMode.EXCLUSIVE_PROCESS)


def test_mig_takes_a_yaml_boolean() -> None:
    nvml = FakeNvml.from_yaml("gpus: [{mig: false}, {mig: true}]")
    assert [g.mig for g in nvml.gpus] == [False, True]
    with pytest.raises(ConfigError, match=r"gpus\[0\]\.mig: must be true or false"):
        FakeNvml.from_yaml('gpus: [{mig: "false"}]')


def test_the_call_log_keeps_the_newest_calls_only() -> None:
    nvml = started(FakeNvml([FakeGpu("GPU-a")]))
    mark = len(nvml.calls)
    nvml.set_memory_limits("GPU-a", NS, 1, 2)
    assert nvml.calls[mark:] == [NvmlCall("set_memory_limits", ("GPU-a", NS, 1, 2))]
    for _ in range(CALL_LOG_SIZE):
        nvml.driver_version()
    assert len(nvml.calls) == CALL_LOG_SIZE  # bounded: a demo left running does not grow
    assert nvml.calls[-1] == NvmlCall("driver_version")
    assert nvml.calls_of("set_memory_limits") == [] and nvml.set_limit_calls == []


def test_an_allocation_over_the_gpus_memory_fails_and_changes_nothing() -> None:
    nvml = started(FakeNvml([FakeGpu("GPU-a", memory_total=10 * GIB)]))
    nvml.add_process(7, "GPU-a", 6 * GIB, cgroup=NS + "/a")
    nvml.add_process(8, "GPU-a", 3 * GIB, cgroup=NS + "/b")
    nvml.allocate(7, "GPU-a", GIB)  # 10 GiB in use: all of it, not more
    with pytest.raises(GpuOutOfMemory) as e:  # no cgroup limit set: the GPU itself is full
        nvml.allocate(8, "GPU-a", 1)
    assert (e.value.cgroup, e.value.hard, e.value.used, e.value.extra) == (
        None, 10 * GIB, 10 * GIB, 1)
    assert str(e.value) == ("out of memory on GPU-a: 0 MiB more would take the GPU to 10240 MiB "
                            "in use, over its 10240 MiB of memory")
    assert [p.used_bytes for p in nvml.processes] == [7 * GIB, 3 * GIB]


ROOT = "/sys/fs/cgroup"
POD = ROOT + "/kubepods.slice/kubepods-pod1.slice"


@pytest.mark.parametrize(("path", "detail"), [
    ("/kubepods.slice/kubepods-pod1.slice",  # the /proc/<pid>/cgroup form, not the sysfs path
     "namespace '/kubepods.slice/kubepods-pod1.slice' is not a cgroup: the full sysfs path of "
     "one starts with /sys/fs/cgroup/"),
    ("/etc", "namespace '/etc' is not a cgroup: the full sysfs path of one starts with "
             "/sys/fs/cgroup/"),
    ("/sys/fs/cgroupx/a", "is not a cgroup"),
    (ROOT + "/kubepods.slice/kubepods-pod2.slice",
     f"NVML could not open the cgroup {ROOT}/kubepods.slice/kubepods-pod2.slice"),
])
def test_with_the_nodes_cgroup_tree_only_its_cgroups_take_limits(path, detail) -> None:
    """A path outside the cgroup root is NVML_ERROR_INVALID_ARGUMENT (NvmlUnknown); one under
    it that is no cgroup of the tree NVML_ERROR_OPERATING_SYSTEM (nvml.h: the cgroup path
    cannot be opened), `NvmlCgroupUnavailable`."""
    missing = path.startswith(ROOT + "/")
    nvml = started(FakeNvml([FakeGpu("GPU-a")]))
    nvml.use_cgroups(ROOT, FakeCgroupFs([POD]))
    for call in (lambda: nvml.set_memory_limits("GPU-a", path, 1, 2),
                 lambda: nvml.get_memory_limits("GPU-a", path),
                 lambda: nvml.clear_memory_limits("GPU-a", path)):
        with pytest.raises(NvmlCgroupUnavailable if missing else NvmlUnknown) as e:
            call()
        assert e.value.code == (17 if missing else 2) and detail in e.value.message
    assert nvml.limits == {}
    nvml.set_memory_limits("GPU-a", POD, 1, 2)
    nvml.set_memory_limits("GPU-a", POD + "/", 1, 2)
    assert nvml.get_memory_limits("GPU-a", POD).hard == 2


def test_without_the_nodes_cgroup_tree_any_absolute_path_takes_limits() -> None:
    nvml = started(FakeNvml([FakeGpu("GPU-a")]))
    nvml.set_memory_limits("GPU-a", "/made/up", 1, 2)  # what many tests rely on
    assert nvml.limits == {("GPU-a", "/made/up"): (1, 2)}
