"""What the node agent says about its node, independent of how it was asked (socket or metrics).

`AgentState` is filled from the agent's NodeEnforcer socket (everything: devices, allocations
with their state, usage, the condition) or from its Prometheus endpoint (usage per container and
GPU, the containers it refuses and those whose cap it knows not in force); `unreachable(why)`
records why neither answered, so the report can say so instead of guessing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType


@dataclass(frozen=True, slots=True)
class AgentDevice:
    index: int
    uuid: str
    name: str
    memory_total_bytes: int
    compute_mode: str
    """NVML's name for it: Default, ExclusiveProcess, ..."""


@dataclass(frozen=True, slots=True)
class AgentPlan:
    """The plan the agent holds a container to (GetNodeState): once applied, what is in force,
    whatever the pod's annotations say now."""

    devices: tuple[str, ...]
    mode: str
    """time-slicing | sm-sharing"""
    request_bytes: int
    limit_bytes: int
    active_thread_percentage: int | None = None
    mps_namespace: str = ""


@dataclass(frozen=True, slots=True)
class AgentAllocation:
    namespace: str
    pod: str
    container: str
    uid: str = ""
    state: str = ""
    """applied | refused | pending; "" when the source does not say (metrics: only refused)."""
    reason: str = ""
    message: str = ""
    cap_not_in_force: bool = False
    """The agent's metrics say an MPS cap the container relies on is known not in force
    (`kai_fractions_container_cap_not_in_force`; `reason` says why): it is pending, its
    readiness marker set aside, whatever its gate did before. The socket says so in `state`
    and `reason` (and leaves this False)."""
    used_bytes: int | None = None
    """Over all the container's GPUs."""
    used_by_gpu: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    """GPU UUID -> bytes, when the source gives it per GPU (metrics)."""
    plan: AgentPlan | None = None
    """The agent's plan for it (socket only; None when it has none, e.g. refused)."""
    mechanisms: Mapping[str, frozenset[str]] = field(
        default_factory=lambda: MappingProxyType({}))
    """GPU UUID -> how its memory cap is in force there (cgroup, mps-pinned, watchdog), from
    the agent's applied limits (socket only)."""
    change_reason: str = ""
    change_message: str = ""
    """Why the annotations' new plan is refused while `plan` stays in force
    (`PlanChangeRefused`); "" otherwise."""
    usage_unknown: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    """GPU UUID -> why the agent's watchdog cannot read the container's usage there now (the
    reason of `kai_fractions_agent_gpu_usage_unknown`, or of the socket's note): what the
    agent reports used there (0) is not known to be so."""

    def used_on(self, gpu_uuid: str, device_count: int) -> int | None:
        """Bytes used on the GPU; None when not known (`usage_unknown`, or a sum over GPUs)."""
        if gpu_uuid in self.usage_unknown:
            return None
        if gpu_uuid in self.used_by_gpu:
            return self.used_by_gpu[gpu_uuid]
        if self.used_bytes is not None and device_count == 1:
            return self.used_bytes
        return None


@dataclass(frozen=True, slots=True)
class AgentCondition:
    type: str
    ready: bool
    reason: str = ""
    message: str = ""


@dataclass(frozen=True, slots=True)
class AgentState:
    source: str
    """`socket unix:///...` or `metrics http://...`: where it came from."""
    reachable: bool = True
    error: str = ""
    """Why it is not reachable (one line)."""
    devices: tuple[AgentDevice, ...] = ()
    allocations: tuple[AgentAllocation, ...] = ()
    condition: AgentCondition | None = None
    driver_version: str = ""
    memory_limits_supported: bool | None = None
    notes: tuple[str, ...] = ()
    """What went wrong beside it (a metrics endpoint given with the socket but not used)."""

    @property
    def knows_limits(self) -> bool:
        """Whether it says what is in force (its socket answered; metrics do not say)."""
        return self.reachable and self.source.startswith("socket")

    def allocation(self, namespace: str, pod: str, container: str,
                   uid: str = "") -> AgentAllocation | None:
        for a in self.allocations:
            if (a.namespace, a.pod, a.container) == (namespace, pod, container) and (
                    not uid or not a.uid or a.uid == uid):
                return a
        return None


def unreachable(source: str, error: str) -> AgentState:
    return AgentState(source=source, reachable=False, error=" ".join(error.split()))
