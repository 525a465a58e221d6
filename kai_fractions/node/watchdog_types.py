"""The watchdog's vocabulary, shared with its callers and its killer: the policies, the steps and
outcomes of stopping a process, the containers it watches (`ManagedContainer`) and what a check
returns (`WatchdogReport`: usage, violations, actions), with the shapes of its inputs (NVML's
processes, the MPS control it drains clients through).

Kept apart from `kai_fractions.node.watchdog` so that the agent, the desired state and a killer
can use these types without the watchdog's /proc and MPS plumbing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol

from kai_fractions.contract import MIB

from .procfs import normalize_container_id

REPORT = "report"
KILL = "kill"
POLICIES = (REPORT, KILL)

VIOLATION_REASON = "GPUMemoryOverCap"

# Action steps and outcomes
DRAIN = "drain"
TERMINATE = "terminate"
DRAINED = "drained"
"""MPS ended the client's outstanding GPU work."""
SIGNALLED = "signalled"
"""SIGTERM sent; it has the grace period to exit (its outcome comes at a later check)."""
ESCALATED = "escalated"
"""Still running when the grace period ended: SIGKILL sent (its outcome comes later)."""
TERMINATED = "terminated"
"""The process exited after SIGTERM."""
KILLED = "killed"
"""The process ignored SIGTERM for the grace period, got SIGKILL and exited."""
UNKILLABLE = "unkillable"
"""Still running some time after SIGKILL (uninterruptible sleep: stuck in the kernel or the
driver); its GPU memory stays in use until it exits. Reported once, never signalled again."""
GONE = "gone"
"""The process had already exited."""
SKIPPED = "skipped"
"""Not touched: the pid no longer belongs to the container (exited, or reused)."""
FAILED = "failed"
"""The step could not be done (the detail says why); the process was left alone."""


class GpuProcessLike(Protocol):
    pid: int
    used_bytes: int | None


class MpsClientLike(Protocol):
    pid: int


class MpsDrain(Protocol):
    """The part of MpsControl (or FakeMpsControl) the watchdog uses."""

    def supports_protocol_v3(self) -> bool: ...

    def client_list(self) -> Sequence[MpsClientLike]: ...

    def client_terminate(self, pid: int) -> None: ...

    def get_server_list(self) -> list[int]: ...

    def get_client_list(self, server_pid: int) -> list[int]: ...

    def terminate_client(self, server_pid: int, client_pid: int) -> None: ...


@dataclass(frozen=True, slots=True)
class ManagedContainer:
    pod_uid: str
    container_name: str
    container_id: str | None
    """The runtime's ID (`containerd://<hex>` or bare); None until the runtime reports one:
    until then a process of the container is recognised by its pod alone, and counts for the
    pod's container capped on its GPU (`watchdog`, one fractional container per pod)."""
    caps: Mapping[str, int] = field(default_factory=dict)
    """GPU UUID -> cap in bytes. A GPU without a cap here is observed, never enforced."""
    mps_client: bool = True
    """Whether its processes may be MPS clients (sm-sharing: it mounts an MPS pipe
    directory). A time-slicing container's cannot, so stopping one needs no word from MPS,
    and a daemon that does not answer does not hold its kill."""
    _key: tuple[str, str] | None = field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self) -> None:
        # Computed once: every check looks the key up for every process.
        key = (self.pod_uid.lower(), normalize_container_id(self.container_id)
               ) if self.container_id else None
        object.__setattr__(self, "_key", key)

    @classmethod
    def uniform(cls, pod_uid: str, container_name: str, container_id: str | None,
                cap_bytes: int, device_uuids: Iterable[str], *,
                mps_client: bool = True) -> ManagedContainer:
        """The same cap on each assigned GPU (a fractional container's limit is per GPU)."""
        return cls(pod_uid, container_name, container_id,
                   MappingProxyType(dict.fromkeys(device_uuids, cap_bytes)), mps_client)

    @property
    def key(self) -> tuple[str, str] | None:
        return self._key


@dataclass(frozen=True, slots=True)
class ContainerUsage:
    """One managed container on one GPU, for metrics."""

    pod_uid: str
    container_name: str
    container_id: str | None
    device_uuid: str
    used_bytes: int
    cap_bytes: int | None
    pids: tuple[int, ...] = ()
    sm_percent: int | None = None
    """Summed SM utilisation of its processes when the caller passed any; None otherwise."""
    unknown_usage_pids: tuple[int, ...] = ()
    """Processes whose usage the driver cannot tell (counted as 0 in `used_bytes`)."""


@dataclass(frozen=True, slots=True)
class Violation:
    pod_uid: str
    container_name: str
    container_id: str | None
    device_uuid: str
    used_bytes: int
    cap_bytes: int
    pids: tuple[int, ...]

    @property
    def reason(self) -> str:
        return VIOLATION_REASON

    @property
    def message(self) -> str:
        return (f"container {self.container_name} of pod {self.pod_uid} uses "
                f"{_mib(self.used_bytes)} of GPU memory on {self.device_uuid}, above its cap of "
                f"{_mib(self.cap_bytes)} (pids {', '.join(map(str, self.pids))})")


@dataclass(frozen=True, slots=True)
class Action:
    pid: int
    device_uuid: str
    pod_uid: str
    container_name: str
    step: str
    """`drain` or `terminate`."""
    outcome: str
    detail: str = ""


@dataclass(frozen=True, slots=True)
class WatchdogReport:
    checked_at: float
    violations: tuple[Violation, ...] = ()
    usage: tuple[ContainerUsage, ...] = ()
    """One row per managed container and GPU listed in the check: none for a GPU whose
    processes were not given (unknown, not 0)."""
    actions: tuple[Action, ...] = ()
    unmanaged: tuple[tuple[str, int], ...] = ()
    """(GPU UUID, pid) of GPU processes of no managed container: left alone, listed for logs."""
    unplaced: tuple[tuple[str, int, str], ...] = ()
    """(GPU UUID, pid, why) of GPU processes whose container cannot be told: they may be a
    managed container's, so the watchdog is blind to them (never touched)."""


@dataclass(frozen=True, slots=True)
class OwnerUnknown:
    """A live process whose pod the watchdog cannot tell (see `kai_fractions.node.watchdog`)."""

    why: str


def _mib(n: int) -> str:
    return f"{-(-n // MIB)} MiB"
