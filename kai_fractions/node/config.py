"""The node agent's settings the engine needs (flag names as in the fixed CLI surface)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum

from ..contract import DEFAULT_KEYS, DEFAULT_MPS_PIPE_ROOT, MAX_PIPE_DIRECTORY, MPS_SERVER, Keys
from .cgroups import CgroupDriver, CgroupLayout
from .errors import ConfigError


class Mechanism(StrEnum):
    """How a container's GPU memory cap is enforced (the `--memory-enforcement` tiers)."""

    CGROUP = "cgroup"
    """NVML cgroup soft/hard limits (driver r615+): the real guarantee and cap."""
    MPS_PINNED = "mps-pinned"
    """The MPS pinned device-memory limit (sm-sharing containers only; a tier that caps only
    with MPS namespaces: `plan_refusals.hard_tiers_of`)."""
    WATCHDOG = "watchdog"
    """Usage polled through NVML and compared to the cap; report or kill by policy."""


class WatchdogPolicy(StrEnum):
    REPORT = "report"
    KILL = "kill"


ALL_MECHANISMS = frozenset(Mechanism)
HARD_TIERS = frozenset({Mechanism.CGROUP, Mechanism.MPS_PINNED})
"""The memory tiers that may cap a container without the watchdog: with one of them in force
the watchdog is a second line, and its blindness leaves the cap in force. mps-pinned is one
only for a container in an MPS namespace of its own: which of a container's tiers cap it is
`plan_refusals.hard_tiers_of`'s rule, the only one to ask."""
# Longest namespace name the contract makes (kf_ + 20 hex) - to check the pipe directory early.
_NAMESPACE_LEN = 23


def parse_memory_enforcement(value: str | Iterable[str]) -> frozenset[Mechanism]:
    """`cgroup,watchdog` -> {CGROUP, WATCHDOG}; raises ConfigError naming the flag."""
    items = [v.strip() for v in value.split(",")] if isinstance(value, str) else list(value)
    known = ", ".join(m.value for m in Mechanism)
    if not items or any(not i for i in items):
        raise ConfigError(f"--memory-enforcement: give a comma-separated subset of {known}, "
                          f"got {value!r}")
    out = set()
    for item in items:
        try:
            out.add(Mechanism(item))
        except ValueError:
            raise ConfigError(f"--memory-enforcement: unknown mechanism {item!r}; known: "
                              f"{known}") from None
    return frozenset(out)


@dataclass(frozen=True, slots=True)
class NodeConfig:
    node_name: str = ""
    cgroup_root: str = "/sys/fs/cgroup"
    cgroup_driver: CgroupDriver = CgroupDriver.SYSTEMD
    proc_root: str = "/proc"
    sm_sharing: bool = True
    mps_control_binary: str = "nvidia-cuda-mps-control"
    mps_pipe_dir: str = "/run/kai-fractions/mps"
    """The MPS pipe directory on the host (where the control daemon lives)."""
    mps_log_dir: str = "/var/log/kai-fractions/mps"
    container_mps_pipe_root: str = DEFAULT_MPS_PIPE_ROOT
    """Where that directory is mounted inside containers: what the plans (and their digests,
    which the mirror computes too) name. Change it only together with the admission webhook."""
    memory_enforcement: frozenset[Mechanism] = ALL_MECHANISMS
    watchdog_policy: WatchdogPolicy = WatchdogPolicy.REPORT
    watchdog_interval: float = 1.0
    keys: Keys = field(default=DEFAULT_KEYS)
    nvml_library: str | None = None

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "cgroup_driver", CgroupDriver(self.cgroup_driver))
        except ValueError:
            raise ConfigError(f"--cgroup-driver: must be systemd or cgroupfs, got "
                              f"{self.cgroup_driver!r}") from None
        try:
            object.__setattr__(self, "watchdog_policy", WatchdogPolicy(self.watchdog_policy))
        except ValueError:
            raise ConfigError(f"--watchdog-policy: must be report or kill, got "
                              f"{self.watchdog_policy!r}") from None
        object.__setattr__(self, "memory_enforcement",
                           parse_memory_enforcement(self.memory_enforcement))
        for flag, path in (("--cgroup-root", self.cgroup_root), ("--proc-root", self.proc_root),
                           ("--mps-pipe-dir", self.mps_pipe_dir),
                           ("--mps-log-dir", self.mps_log_dir)):
            if not path.startswith("/"):
                raise ConfigError(f"{flag}: must be an absolute path, got {path!r}")
        for name, root in (("--mps-pipe-dir", self.mps_pipe_dir),
                           ("the in-container MPS pipe root", self.container_mps_pipe_root)):
            longest = f"{root.rstrip('/')}/{MPS_SERVER}/" + "x" * _NAMESPACE_LEN
            if len(longest.encode()) > MAX_PIPE_DIRECTORY:
                raise ConfigError(
                    f"{name}: {root!r} is too long: an MPS pipe directory below it "
                    f"({len(longest.encode())} bytes) must stay within {MAX_PIPE_DIRECTORY} "
                    "bytes so that its unix socket path fits; choose a shorter directory")
        if not self.watchdog_interval > 0:
            raise ConfigError(f"--watchdog-interval: must be greater than 0 seconds, got "
                              f"{self.watchdog_interval!r}")

    @property
    def layout(self) -> CgroupLayout:
        return CgroupLayout(root=self.cgroup_root, driver=self.cgroup_driver)
