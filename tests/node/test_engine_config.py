"""NodeConfig: defaults match the node-agent CLI surface; invalid settings name their flag."""

from __future__ import annotations

import pytest

from kai_fractions.contract import DEFAULT_KEYS, Keys
from kai_fractions.node.cgroups import CgroupDriver, CgroupLayout
from kai_fractions.node.config import (
    ALL_MECHANISMS,
    Mechanism,
    NodeConfig,
    WatchdogPolicy,
    parse_memory_enforcement,
)
from kai_fractions.node.errors import ConfigError


def test_defaults_follow_the_cli_surface() -> None:
    c = NodeConfig()
    assert c.cgroup_root == "/sys/fs/cgroup" and c.cgroup_driver is CgroupDriver.SYSTEMD
    assert c.proc_root == "/proc" and c.sm_sharing is True
    assert c.mps_control_binary == "nvidia-cuda-mps-control"
    assert c.mps_pipe_dir == "/run/kai-fractions/mps"
    assert c.mps_log_dir == "/var/log/kai-fractions/mps"
    assert c.container_mps_pipe_root == "/run/kai-fractions/mps"
    assert c.memory_enforcement == ALL_MECHANISMS == {
        Mechanism.CGROUP, Mechanism.MPS_PINNED, Mechanism.WATCHDOG}
    assert c.watchdog_policy is WatchdogPolicy.REPORT and c.watchdog_interval == 1.0
    assert c.keys == DEFAULT_KEYS and c.nvml_library is None
    assert c.layout == CgroupLayout("/sys/fs/cgroup", CgroupDriver.SYSTEMD)


def test_strings_are_accepted_and_normalised() -> None:
    c = NodeConfig(cgroup_driver="cgroupfs", watchdog_policy="kill",
                   memory_enforcement="cgroup,watchdog",
                   keys=Keys(prefix="example.com/container."))
    assert c.cgroup_driver is CgroupDriver.CGROUPFS and c.watchdog_policy is WatchdogPolicy.KILL
    assert c.memory_enforcement == {Mechanism.CGROUP, Mechanism.WATCHDOG}
    assert parse_memory_enforcement(["mps-pinned"]) == {Mechanism.MPS_PINNED}


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"cgroup_driver": "openrc"},
     "--cgroup-driver: must be systemd or cgroupfs, got 'openrc'"),
    ({"watchdog_policy": "shout"}, "--watchdog-policy: must be report or kill, got 'shout'"),
    ({"memory_enforcement": "cgroup,magic"},
     "--memory-enforcement: unknown mechanism 'magic'; known: cgroup, mps-pinned, watchdog"),
    ({"memory_enforcement": ""},
     "--memory-enforcement: give a comma-separated subset of cgroup, mps-pinned, watchdog, "
     "got ''"),
    ({"cgroup_root": "sys/fs/cgroup"},
     "--cgroup-root: must be an absolute path, got 'sys/fs/cgroup'"),
    ({"proc_root": "proc"}, "--proc-root: must be an absolute path, got 'proc'"),
    ({"watchdog_interval": 0}, "--watchdog-interval: must be greater than 0 seconds, got 0"),
    ({"mps_pipe_dir": "/" + "d" * 60},
     "--mps-pipe-dir: '/" + "d" * 60 + "' is too long: an MPS pipe directory below it "
     "(92 bytes) must stay within 83 bytes so that its unix socket path fits; choose a shorter "
     "directory"),
])
def test_invalid_settings_name_the_flag(kwargs, message) -> None:
    with pytest.raises(ConfigError) as e:
        NodeConfig(**kwargs)
    assert e.value.message == message
    assert e.value.reason == "InvalidConfig"
