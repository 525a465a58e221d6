"""Typed errors of the node engine. Each carries a CamelCase `reason` (what node conditions, pod
events and the readiness marker show) and a `message` a node operator or user can act on.

The NVML seam raises these; the engine turns them into values (refusals, report entries), so a
stack trace never reaches a user.
"""

from __future__ import annotations

# NVML return codes (nvml.h); only the ones mapped to a type here.
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_OPERATING_SYSTEM = 17
NVML_ERROR_UNKNOWN = 999


class NodeError(Exception):
    """Base of every engine error: `reason` (CamelCase) and `message` (a sentence to act on)."""

    reason = "NodeError"

    def __init__(self, message: str, *, reason: str | None = None):
        super().__init__(message)
        self.message = message
        if reason is not None:
            self.reason = reason

    def __str__(self) -> str:
        return self.message


class ConfigError(NodeError):
    """A node-agent setting is invalid; the message names the flag."""

    reason = "InvalidConfig"


class NvmlError(NodeError):
    """An NVML call failed. `function` is the NVML (or seam) call, `code` the nvmlReturn_t."""

    reason = "NVMLError"

    def __init__(
        self, message: str, *, function: str = "", code: int | None = None,
        reason: str | None = None,
    ):
        super().__init__(message, reason=reason)
        self.function = function
        self.code = code


class NvmlLibraryNotFound(NvmlError):
    reason = "NVMLUnavailable"


class NvmlDriverNotLoaded(NvmlError):
    reason = "NVMLUnavailable"


class NvmlNoPermission(NvmlError):
    reason = "NVMLNoPermission"


class NvmlCapabilityMissing(NvmlError):
    """The driver or the GPU cannot do what was asked (the base of the two cases below)."""

    reason = "NotSupported"


class NvmlFunctionNotFound(NvmlCapabilityMissing):
    """The driver's NVML lacks the symbol: how a driver older than the feature looks."""

    reason = "DriverTooOld"


class NvmlNotSupported(NvmlCapabilityMissing):
    reason = "NotSupported"


class NvmlNotFound(NvmlError):
    reason = "GPUNotFound"


class NvmlGpuLost(NvmlError):
    reason = "GPULost"


class NvmlUnknown(NvmlError):
    reason = "NVMLError"


CGROUP_NOT_FOUND = "CgroupNotFound"
"""The reason of a container whose pod's cgroup is not there for its limits: not made yet (the
engine's existence check), or one NVML cannot open (`NvmlCgroupUnavailable`)."""


class NvmlCgroupUnavailable(NvmlError):
    """A memory-limit call's cgroup could not be opened (NVML_ERROR_OPERATING_SYSTEM: nvml.h
    "if the cgroup path cannot be opened"): removed since the agent found it (its pod is going),
    or not where NVML looks (a wrong --cgroup-root, a cgroup mount it cannot open). The path is
    at fault, not the GPU; `cgroup` is the path (None where the caller did not say it)."""

    reason = CGROUP_NOT_FOUND

    def __init__(self, message: str, *, function: str = "", code: int | None = None,
                 cgroup: str | None = None):
        super().__init__(message, function=function, code=code)
        self.cgroup = cgroup


# Hints for functions whose absence has a well-known cause.
_NO_CGROUP_LIMITS = (
    "cgroup GPU memory limits need NVIDIA driver r615 or newer; upgrade the driver, or allow a "
    "fallback with --memory-enforcement: mps-pinned (sm-sharing containers), or watchdog with "
    "--watchdog-policy=kill (one that only reports caps nothing)")
_FUNCTION_HINTS = {
    "nvmlDeviceSetMemoryLimits_v1": _NO_CGROUP_LIMITS,
    "nvmlDeviceGetMemoryLimits_v1": _NO_CGROUP_LIMITS,
}
_CGROUP_FUNCTIONS = frozenset(_FUNCTION_HINTS)
"""The calls that take a cgroup path (nvmlSetMemoryLimits_v1_t.nameSpace): their
NVML_ERROR_OPERATING_SYSTEM is a cgroup they could not open."""
_PROCESS_QUERY = (
    "the node agent lists every process on a GPU, and reads its memory, only with the host's "
    "pid namespace (hostPID: true) and the permission to query other users' GPU processes "
    "(root; the chart runs it so): check the agent pod's hostPID and securityContext")
_PERMISSION_HINTS = {
    "nvmlDeviceGetComputeRunningProcesses": _PROCESS_QUERY,
    "nvmlDeviceGetProcessUtilization": _PROCESS_QUERY,
}
"""NoPermission's hint by function; the others are device management (limits, modes)."""
_MANAGEMENT = ("the node agent must run as root in a privileged container to set GPU memory "
               "limits and compute modes")


def nvml_error(
    code: int, function: str, *, device: str | None = None, library: str | None = None,
    detail: str | None = None, cgroup: str | None = None,
) -> NvmlError:
    """The typed error for an nvmlReturn_t, with a message that says what to do about it;
    `cgroup`: the cgroup path of a memory-limit call, named in its message.

    Both NVML implementations (pynvml and the in-memory fake) build their errors here, so a
    test against the fake sees the same types, reasons and sentences as production.
    """
    on = f" on GPU {device}" if device else ""
    if code == NVML_ERROR_LIBRARY_NOT_FOUND:
        where = f" from {library}" if library else ""
        return NvmlLibraryNotFound(
            f"the NVML library (libnvidia-ml.so.1) could not be loaded{where}: install the "
            "NVIDIA driver on this node, or point --nvml-library at libnvidia-ml.so.1",
            function=function, code=code)
    if code == NVML_ERROR_DRIVER_NOT_LOADED:
        return NvmlDriverNotLoaded(
            "NVML is installed but the NVIDIA kernel driver is not loaded: check `nvidia-smi` "
            "on the node and load the driver (the GPU may also be missing or unsupported)",
            function=function, code=code)
    if code == NVML_ERROR_NO_PERMISSION:
        return NvmlNoPermission(
            f"NVML refused {function}{on}: insufficient permissions; "
            f"{_PERMISSION_HINTS.get(function, _MANAGEMENT)}", function=function, code=code)
    if code == NVML_ERROR_FUNCTION_NOT_FOUND:
        hint = _FUNCTION_HINTS.get(function, "upgrade the NVIDIA driver to one that has it")
        return NvmlFunctionNotFound(
            f"the NVIDIA driver's NVML has no {function}: {hint}", function=function, code=code)
    if code == NVML_ERROR_NOT_SUPPORTED:
        return NvmlNotSupported(
            f"{function} is not supported{on} (GPUs in MIG mode and some models cannot do "
            "this); use a GPU without MIG for fractional sharing",
            function=function, code=code)
    if code == NVML_ERROR_NOT_FOUND:
        what = f"GPU {device}" if device else "the requested object"
        return NvmlNotFound(
            f"NVML did not find {what} ({function}): the pod may be bound to a GPU this node "
            "does not have, or the GPU was removed", function=function, code=code)
    if code == NVML_ERROR_GPU_IS_LOST:
        return NvmlGpuLost(
            f"GPU {device or '?'} is lost (fell off the bus) during {function}: drain the node "
            "and reset or replace the GPU", function=function, code=code)
    if code == NVML_ERROR_OPERATING_SYSTEM and function in _CGROUP_FUNCTIONS:
        return NvmlCgroupUnavailable(
            f"NVML could not open the cgroup {cgroup or '(path not given)'} ({function}{on}: "
            "NVML_ERROR_OPERATING_SYSTEM): it was removed since the agent found it (its pod is "
            "going; the agent retries every pass), or NVML cannot open it where the agent names "
            "it: check --cgroup-root and --cgroup-driver against the kubelet's configuration, "
            "and that the agent's cgroup mount (the chart's hostPaths.cgroupRoot) is the host's "
            "cgroup tree", function=function, code=code, cgroup=cgroup)
    text = f": {detail}" if detail else ""
    return NvmlUnknown(
        f"NVML {function} failed{on}{text} (nvmlReturn_t {code}); check the driver with "
        "`nvidia-smi` and the agent log", function=function, code=code)


# Reason names accepted by the fake's error injection, mapped to return codes.
NVML_CODES_BY_NAME = {
    "Uninitialized": NVML_ERROR_UNINITIALIZED,
    "InvalidArgument": NVML_ERROR_INVALID_ARGUMENT,
    "NotSupported": NVML_ERROR_NOT_SUPPORTED,
    "NoPermission": NVML_ERROR_NO_PERMISSION,
    "NotFound": NVML_ERROR_NOT_FOUND,
    "DriverNotLoaded": NVML_ERROR_DRIVER_NOT_LOADED,
    "LibraryNotFound": NVML_ERROR_LIBRARY_NOT_FOUND,
    "FunctionNotFound": NVML_ERROR_FUNCTION_NOT_FOUND,
    "GpuIsLost": NVML_ERROR_GPU_IS_LOST,
    "OperatingSystem": NVML_ERROR_OPERATING_SYSTEM,
    "Unknown": NVML_ERROR_UNKNOWN,
}
