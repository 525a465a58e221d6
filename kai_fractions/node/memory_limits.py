"""The cgroup GPU memory-limit enforcer: NVML soft/hard limits on a cgroup, idempotently.

soft = the guaranteed share (the NvFractions request), hard = the cap (the limit), in bytes, on
each of the container's GPUs. Every write is preceded by a read, so a limit already in force is
never rewritten (an agent restart costs reads, not writes), and every set is followed by one: a
set NVML returns success for is in force only once it reads back as the target (a driver that
rounds, clamps or ignores it leaves the cgroup without the plan's limit). Clearing sets soft 0
and hard NVML_DEVICE_MEMORY_LIMIT_MAX, which NVIDIA asks for before a cgroup is deleted.

On a driver without the r615 functions every call raises `NvmlFunctionNotFound` (reason
DriverTooOld); the plan (`desired.py`) already chose the fallback or refused, so reaching that
here means the driver changed under the agent, and the engine reports it per container.

What a failure proves: a read that fails says nothing of the limit in force (it may well be
there), while a read that succeeds and shows something else than the target, followed by a set
that fails or by a read-back that shows something else again, proves the target is not in force
(`LimitNotSet`). A cgroup removed and made again (the same path) has lost its limits: NVML's
limits go with the cgroup. A cgroup NVML cannot open (`NvmlCgroupUnavailable`: removed since it
was found, or not where NVML looks) is told by the call that fails: a read raises it as it is
(nothing known), a set after a read that showed another limit raises `LimitNotSet` with it as
the cause (the read proved the target absent); whether the cgroup is still there, so whether a
limit is missing at all, the caller checks (`engine_cgroup_limits`). Either way the GPU is not
at fault.
"""

from __future__ import annotations

from dataclasses import dataclass

from .desired import LimitTarget
from .errors import NodeError, NvmlError
from .nvml import MEMORY_LIMIT_MAX, SET_MEMORY_LIMITS, MemoryLimits, Nvml

MEMORY_LIMIT_NOT_IN_FORCE = "MemoryLimitNotInForce"
"""The reason of a container pending with `ContainerResult.limit_missing`, and only of such a
container: the GPU memory limit on its pod's cgroup (the slice, which caps every container of
the pod) was read back absent or not the plan's and could not be set (the set failed, or
returned success and the limit reads back otherwise: LIMIT_NOT_READ_BACK), so its readiness
marker is set aside (`kai_fractions.node.agent.markers`). Whoever reads the reason alone
(GetNodeState, the metrics) tells it from a container pending for a reason that keeps its
marker (an NVML call that failed, a read that failed). The message names NVML's own error."""

LIMIT_NOT_READ_BACK = "LimitNotReadBack"
"""The reason of a `LimitNotSet` whose set NVML returned success for, but whose limits read back
as something else than the target (a driver that rounds, clamps or ignores the set); named in
the message of a container pending MEMORY_LIMIT_NOT_IN_FORCE for it."""


@dataclass(frozen=True, slots=True)
class LimitWrite:
    """A write that happened: what was there before and what is there now."""

    gpu_uuid: str
    path: str
    before: MemoryLimits
    soft: int
    hard: int


class LimitNotSet(NvmlError):
    """`ensure` read the limits in force on the target's cgroup (`before`), which are not the
    target, and the set that was to put the target in force failed (`cause`), or returned
    success while the limits read back after it (then `before`) are still not the target
    (`cause`: an NvmlError of reason LIMIT_NOT_READ_BACK): the target is known NOT in force.
    It carries the cause's reason, message, function and code (a caller that only reports it
    sees the NVML error as it was); a read that fails, before or after the set, raises the
    read's own error instead, which proves nothing of what is in force."""

    def __init__(self, target: LimitTarget, before: MemoryLimits, cause: NvmlError):
        super().__init__(cause.message, function=cause.function, code=cause.code,
                         reason=cause.reason)
        self.target = target
        self.before = before
        self.cause = cause


def _mib(n: int) -> str:
    return f"{-(-n // (1 << 20))} MiB"


def describe(soft: int, hard: int) -> str:
    """Limits as a message says them."""
    if soft == 0 and hard == MEMORY_LIMIT_MAX:
        return "no limit"
    cap = "no cap" if hard == MEMORY_LIMIT_MAX else f"hard {_mib(hard)}"
    return f"soft {_mib(soft)}, {cap}"


def limit_not_in_force(target: LimitTarget, before: MemoryLimits, error: NodeError, *,
                       now: bool = True) -> NvmlError:
    """The error of a container whose pod's cgroup is known not to hold `target`: it was read
    back as `before`. `now`: `error` is the set of this pass that failed; else the limit is
    known missing from an earlier pass and `error` is what this pass failed at first (a read
    that failed, NVML down, the cgroup not there), which puts nothing right."""
    why = (f"could not be set ({error.reason}: {error.message})" if now else
           f"has not been set since (this pass: {error.reason}: {error.message})")
    return NvmlError(
        f"the GPU memory limit on the pod's cgroup {target.path} (GPU {target.gpu_uuid}) "
        f"{'reads' if now else 'was read'} back {describe(before.soft, before.hard)}, not the "
        f"plan's {describe(target.soft, target.hard)}, and {why}: the pod's processes on that "
        "GPU are not held to their cap (a cgroup removed and made again loses its limits). "
        "The container stays pending until the limit is in force: a new pod's gate waits, a "
        "running one's readiness marker is set aside (the agent retries every pass; if this "
        "persists, check that the agent may set NVML memory limits)",
        reason=MEMORY_LIMIT_NOT_IN_FORCE)


class MemoryLimitEnforcer:
    def __init__(self, nvml: Nvml):
        self.nvml = nvml

    def supported(self) -> bool:
        return self.nvml.memory_limits_supported()

    def read(self, gpu_uuid: str, path: str) -> MemoryLimits:
        return self.nvml.get_memory_limits(gpu_uuid, path)

    def ensure(self, target: LimitTarget) -> LimitWrite | None:
        """Makes `target` the limits in force; returns the write, or None when already so.
        Raises a read's NvmlError when a read fails (nothing known), `LimitNotSet` when the
        read shows another limit and the set fails, or succeeds but the limits read back
        after it are not the target (known not in force), a set that could not open the
        cgroup (`NvmlCgroupUnavailable`) included: the read showed the target absent, and
        whether the cgroup went after it is for the caller to check."""
        before = self.nvml.get_memory_limits(target.gpu_uuid, target.path)
        if (before.soft, before.hard) == (target.soft, target.hard):
            return None
        try:
            self.nvml.set_memory_limits(target.gpu_uuid, target.path, target.soft, target.hard)
        except NvmlError as e:
            raise LimitNotSet(target, before, e) from e
        # Exact, as the comparison above is: a limit the driver rounded or clamped is not the
        # target there either (it would be rewritten at every pass), so it is not in force.
        after = self.nvml.get_memory_limits(target.gpu_uuid, target.path)
        if (after.soft, after.hard) != (target.soft, target.hard):
            cause = NvmlError(
                f"{SET_MEMORY_LIMITS} returned success on GPU {target.gpu_uuid}, but the limit "
                f"reads back {describe(after.soft, after.hard)}: the driver did not keep it "
                "(rounded, clamped or ignored)", function=SET_MEMORY_LIMITS,
                reason=LIMIT_NOT_READ_BACK)
            raise LimitNotSet(target, after, cause)
        return LimitWrite(target.gpu_uuid, target.path, before, target.soft, target.hard)

    def clear(self, gpu_uuid: str, path: str) -> LimitWrite | None:
        """Removes any limit on `path` for the GPU; returns the write, or None when none was."""
        before = self.nvml.get_memory_limits(gpu_uuid, path)
        if before.cleared:
            return None
        self.nvml.clear_memory_limits(gpu_uuid, path)
        return LimitWrite(gpu_uuid, path, before, 0, MEMORY_LIMIT_MAX)
