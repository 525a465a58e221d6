"""The node condition KAI reads before placing fractional pods: what it says, and why
(`evaluate`, from what the agent saw; no side effect). `status_publisher` writes it to the Node.

`gpu-fractioning.nvidia.com/Ready` (name configurable; `gpu-sharing.nvidia.com/Ready` too with
`--legacy-condition`) is True only when NVML works, an enabled memory tier can cap some
fractional container (`no_cap_reason`), the MPS control daemon answers (when sm-sharing is
enabled), the agent is reconciling, its readiness marker directory takes a file (`marker_probe`),
every GPU where cgroup memory limits are to be set takes one, every GPU an sm-sharing plan needs
in EXCLUSIVE_PROCESS is in it, and the watchdog sees every GPU where it would be a fractional
container's only memory tier.
Otherwise False with one reason, the first that holds in this order (what the whole node lacks
before what one GPU does):

| reason | when |
|---|---|
| `NVMLUnavailable` | NVML cannot be loaded or initialised, or the inventory failed |
| `DriverTooOld` | no enabled tier caps any fractional container, the driver lacks r615 limits |
| `NoMemoryEnforcement` | no enabled tier caps any fractional container (the driver has them) |
| `MPSDaemonUnhealthy` | sm-sharing on; the control daemon does not answer, or is not adopted |
| `NotReconciling` | no pod list yet, API unreachable, passes hung or failing too long, stopping |
| `MarkerDirectoryNotWritable` | the last probe could not write in the marker directory |
| `MemoryLimitsNotSettable` | a GPU's cgroup limit sets refused, or failed two passes in a row |
| `ComputeModeNotInForce` | a GPU sm-sharing needs in EXCLUSIVE_PROCESS is in another mode, unset |
| `WatchdogBlind` | the watchdog cannot see a GPU where it is (would be) the only memory tier |

`WatchdogBlind`: a GPU in an episode of blindness (`agent.blindness`) where a planned container's
only memory tier is the kill-policy watchdog; or, where the watchdog would be the only memory
tier of a time-slicing container placed on the node now (`watchdog_sole_tier`: no cgroup limits
enabled and supported), any GPU in such an episode, with a container yet or not: a pod KAI places
there would wait, so the node says so before, not once it is there.

`MemoryLimitsNotSettable`: a GPU where a set of a pod slice's cgroup memory limit failed (or the
slice's read failed NotSupported or NoPermission) and no set there succeeded
(`Engine.limits_not_settable`): in the very pass where the failure cannot be a blip (the set
refused NoPermission, e.g. an agent not root, or NotSupported; the read failed so), so that an
agent restarted there is not ready from its first pass; for any other failure (Unknown, GPULost,
a limit read back other than set) in two passes in a row that said something of the GPU, as one
failed pass may be a transient NVML error (a pass that leaves a container pending is retried
within seconds, so a real problem shows within seconds too). Its containers capped by a cgroup
limit are pending (MemoryLimitNotInForce, or NVML's reason), and so would be every such pod KAI
placed there. Only sets count: an earlier pod's slice limit that reads back in force (set by an
agent that had root) does not make the GPU fine while new pods' sets fail. A container's own
cgroup that failed under a pod slice that holds its limit does not count (the slice caps it),
nor does a read that failed for another reason (it proves nothing). Before
`ComputeModeNotInForce` (it concerns every pod a cgroup limit caps, the mode only sm-sharing
ones). True again as soon as a set there succeeds, every target there reads back in force, or no
target is left on it.

`ComputeModeNotInForce`: a GPU a planned sm-sharing container needs in EXCLUSIVE_PROCESS reads
back another compute mode and the agent's set failed (`Engine.wrong_mode`): its sm-sharing
containers are pending (their markers set aside), and so would be every sm-sharing pod KAI
placed there, whose gate would wait and fail. Before `WatchdogBlind`, as a container's own
reason comes first: no MPS cap holds without the mode. True again once the mode is in force or
no plan needs it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import Mechanism, NodeConfig, WatchdogPolicy
from ..errors import NodeError
from ..inventory import Inventory
from ..plan_refusals import PINNED_NOT_A_TIER, hard_tiers, watchdog_stops
from .marker_probe import MARKER_DIR_NOT_WRITABLE
from .options import AgentOptions

READY = "AgentReady"
NVML_UNAVAILABLE = "NVMLUnavailable"
DRIVER_TOO_OLD = "DriverTooOld"
NO_MEMORY_ENFORCEMENT = "NoMemoryEnforcement"
MPS_DAEMON_UNHEALTHY = "MPSDaemonUnhealthy"
NOT_RECONCILING = "NotReconciling"
WATCHDOG_BLIND = "WatchdogBlind"
"""`engine_reports.WATCHDOG_BLIND`, the containers' reason, as the condition's."""
MEMORY_LIMITS_NOT_SETTABLE = "MemoryLimitsNotSettable"
"""Not the containers' MEMORY_LIMIT_NOT_IN_FORCE: that one is a pod slice's limit known missing,
this one a GPU on which no limit at all could be put in force."""
COMPUTE_MODE_NOT_IN_FORCE = "ComputeModeNotInForce"
"""`engine_reports.COMPUTE_MODE_NOT_IN_FORCE`, the containers' reason, as the condition's."""


@dataclass(frozen=True, slots=True)
class Condition:
    ready: bool
    reason: str
    message: str


@dataclass(frozen=True, slots=True)
class Health:
    """What the last pass saw (the worker leaves it behind after each pass)."""

    inventory: Inventory | None = None
    nvml_error: NodeError | None = None
    mps_error: NodeError | None = None
    """sm-sharing only: why the control daemon is not usable; None when it is."""
    mps_namespaces: bool | None = None
    """sm-sharing only: whether the daemon has v3 namespaces (False: client env only)."""
    passes: int = 0
    watchdog_blind: tuple[tuple[str, str], ...] = ()
    """(GPU uuid, reason) of each GPU where the watchdog cannot see the GPU's usage and is some
    planned container's only memory tier (`UsageCheck.blind_results`: those containers are
    pending WatchdogBlind), or would be a new time-slicing container's (`watchdog_sole_tier`)."""
    wrong_compute_mode: tuple[tuple[str, str, str], ...] = ()
    """(GPU uuid, compute mode read back, the failed set's reason) of each GPU a planned
    sm-sharing container needs in EXCLUSIVE_PROCESS that is known in another mode
    (`Engine.wrong_mode`: those containers are pending ComputeModeNotInForce)."""
    limits_not_settable: tuple[tuple[str, str, str], ...] = ()
    """(GPU uuid, NVML's reason, NVML's message) of each GPU on which no cgroup memory limit
    can be put in force: a pod slice's set failed there in two passes in a row
    (`Engine.limits_not_settable`: its cgroup-capped containers are pending)."""


@dataclass(frozen=True, slots=True)
class Liveness:
    """What the loop is doing now (read by the publisher, never from a stale pass)."""

    synced: bool
    api_down_for: float | None
    api_error: str | None
    busy_for: float | None
    stopping: bool = False
    failed_passes: int = 0
    """Passes in a row that raised (an internal error) since the last one that completed."""
    failing_for: float | None = None
    """Seconds since the first of them started; None while passes complete."""
    pass_error: str | None = None
    """The last one's exception."""
    markers_unwritable: str | None = None
    """Why the last probe of the marker directory could not write there (`marker_probe`);
    None when it could."""


def compute_summary(config: NodeConfig, health: Health) -> str:
    if not config.sm_sharing:
        return "time-slicing only (sm-sharing disabled on this node)"
    if health.mps_namespaces is False:
        return ("sm-sharing through the MPS client env only: this MPS daemon has no namespaces "
                "(driver before r615), so the active-thread percentage is the client's own "
                "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, not enforced by the daemon")
    return "sm-sharing with one MPS namespace per container"


def caps_time_slicing(config: NodeConfig, inventory: Inventory) -> bool:
    """Whether a time-slicing container's GPU memory can be capped here: cgroup limits, or a
    watchdog that stops what exceeds the cap (one that only reports caps nothing)."""
    return bool(hard_tiers(config, inventory, sm=False)) or watchdog_stops(config)


def caps_sm_sharing(config: NodeConfig, inventory: Inventory) -> bool:
    """Whether an sm-sharing container's GPU memory can be capped here (the MPS pinned limit
    too, where the daemon has namespaces: `hard_tiers`); False where sm-sharing is disabled."""
    return config.sm_sharing and (bool(hard_tiers(config, inventory, sm=True))
                                  or watchdog_stops(config))


def watchdog_sole_tier(config: NodeConfig, inventory: Inventory) -> bool:
    """Whether the kill-policy watchdog would be the only GPU memory tier of a time-slicing
    container placed on this node now, as the planner decides (`plan_refusals._mechanisms`):
    the watchdog is enabled with --watchdog-policy=kill and no cgroup limit caps it (the tier
    not enabled, or a driver before r615; mps-pinned caps sm-sharing containers only). A
    watchdog that cannot see a GPU then leaves any such container placed there uncapped."""
    return watchdog_stops(config) and not hard_tiers(config, inventory, sm=False)


def no_cap_reason(config: NodeConfig, inventory: Inventory) -> str | None:
    """Why no fractional container's GPU memory can be capped on this node (the desired state
    refuses every one of them), with what to change; None when some can. A node where only
    sm-sharing containers can be capped stays ready: its time-slicing containers are refused
    one by one, with the reason on each."""
    if caps_time_slicing(config, inventory) or caps_sm_sharing(config, inventory):
        return None
    wanted = config.memory_enforcement
    enabled = ",".join(sorted(m.value for m in wanted))
    if not inventory.capabilities.memory_limits:
        why = [f"NVIDIA driver {inventory.driver_version} has no cgroup GPU memory limits "
               "(nvmlDeviceSetMemoryLimits_v1 needs r615 or newer)"]
        fixes = ["upgrade the driver" + ("" if Mechanism.CGROUP in wanted
                                         else " and add cgroup to --memory-enforcement")]
    else:
        why = ["the cgroup tier is not enabled"]
        fixes = ["add cgroup to --memory-enforcement"]
    if Mechanism.WATCHDOG in wanted:  # report: a kill watchdog caps
        why.append("the watchdog only reports (--watchdog-policy=report), it stops nothing")
        fixes.append("set --watchdog-policy=kill (the chart's watchdog.policy)")
    else:
        fixes.append("add watchdog to --memory-enforcement"
                     + ("" if config.watchdog_policy is WatchdogPolicy.KILL
                        else " with --watchdog-policy=kill"))
    if Mechanism.MPS_PINNED in wanted:  # it caps nothing here (`hard_tiers`)
        why.append(PINNED_NOT_A_TIER if config.sm_sharing else
                   "mps-pinned applies to sm-sharing containers only and sm-sharing is "
                   "disabled on this node")
    elif config.sm_sharing and inventory.capabilities.mps_namespaces:
        fixes.append("add mps-pinned to --memory-enforcement (sm-sharing containers only)")
    return (f"{'; '.join(why)}: no fractional container's GPU memory can be capped on this "
            f"node with --memory-enforcement={enabled}, so every one is refused; "
            f"{', or '.join(fixes)}")


def memory_summary(config: NodeConfig, inventory: Inventory) -> str:
    tiers = []
    if Mechanism.CGROUP in config.memory_enforcement and inventory.capabilities.memory_limits:
        tiers.append("cgroup limits")
    if Mechanism.MPS_PINNED in config.memory_enforcement and config.sm_sharing:
        tiers.append("MPS pinned limit (sm-sharing)"
                     if Mechanism.MPS_PINNED in hard_tiers(config, inventory, sm=True) else
                     "MPS pinned limit (sm-sharing; set, but no tier: on an MPS daemon without "
                     "namespaces its tenants can change it)")
    if Mechanism.WATCHDOG in config.memory_enforcement:
        tiers.append(f"watchdog ({config.watchdog_policy.value})")
    out = ", ".join(tiers) or "none"
    if not caps_time_slicing(config, inventory):
        out += (" (time-slicing containers are refused here: they need cgroup limits or a "
                "watchdog with --watchdog-policy=kill)")
    return out


def passes_failing(options: AgentOptions, live: Liveness) -> bool:
    """Whether passes have failed often or long enough to make the node not ready: the last
    good pass's health says nothing of a node whose pods are no longer reconciled (a new pod's
    gate would wait forever), while one failure retried at once is not worth a flap."""
    return live.failed_passes >= options.failed_passes_not_ready or (
        live.failing_for is not None and live.failing_for >= options.stale_after_seconds)


def evaluate(config: NodeConfig, options: AgentOptions, health: Health,
             live: Liveness) -> Condition:
    if live.stopping:
        return Condition(False, NOT_RECONCILING, "the node agent is stopping; the next one "
                         "publishes this condition again")
    if health.nvml_error is not None:
        e = health.nvml_error
        return Condition(False, NVML_UNAVAILABLE,
                         f"NVML does not work on this node ({e.reason}): {e.message}")
    inv = health.inventory
    gap = no_cap_reason(config, inv) if inv is not None else None
    if gap is not None:
        return Condition(False, DRIVER_TOO_OLD if not inv.capabilities.memory_limits
                         else NO_MEMORY_ENFORCEMENT, gap)
    if config.sm_sharing and health.mps_error is not None:
        e = health.mps_error
        return Condition(False, MPS_DAEMON_UNHEALTHY,
                         f"sm-sharing is enabled but the MPS control daemon is not usable "
                         f"({e.reason}): {e.message}")
    # No running count in these messages: the condition is patched whenever it changes, and a
    # message that counted seconds or passes would write the Node every tick while it lasts
    # (lastTransitionTime says since when).
    stale = options.stale_after_seconds
    if live.api_down_for is not None and live.api_down_for >= stale:
        return Condition(False, NOT_RECONCILING,
                         f"the Kubernetes API has been unreachable for {stale:g}s or more: "
                         f"{live.api_error or 'no answer'}")
    if live.busy_for is not None and live.busy_for >= stale:
        return Condition(False, NOT_RECONCILING,
                         f"a reconcile pass has been running for {stale:g}s or more (a GPU, "
                         "MPS or API call hangs); see the agent's log")
    if passes_failing(options, live):
        return Condition(False, NOT_RECONCILING,
                         f"reconcile passes keep failing with an internal error "
                         f"({options.failed_passes_not_ready} or more in a row, or for "
                         f"{stale:g}s or more, none completed), the last: {live.pass_error}; "
                         "see the agent's log")
    if not live.synced or health.passes == 0 or inv is None:
        return Condition(False, NOT_RECONCILING,
                         "the node agent has not listed this node's pods and reconciled them "
                         "yet")
    if live.markers_unwritable is not None:
        return Condition(False, MARKER_DIR_NOT_WRITABLE,
                         f"the readiness marker directory cannot be written "
                         f"({live.markers_unwritable}): the gate of every fractional pod placed "
                         "here would wait until its timeout; free space on its disk or make it "
                         "writable again (the node agent's --marker-dir, a host path)")
    if health.limits_not_settable:
        return Condition(False, MEMORY_LIMITS_NOT_SETTABLE,
                         limits_not_settable_message(health.limits_not_settable))
    if health.wrong_compute_mode:
        return Condition(False, COMPUTE_MODE_NOT_IN_FORCE,
                         compute_mode_message(health.wrong_compute_mode))
    if health.watchdog_blind:
        return Condition(False, WATCHDOG_BLIND, watchdog_blind_message(health.watchdog_blind))
    return Condition(True, READY,
                     f"{len(inv.devices)} GPU(s), driver {inv.driver_version}; memory: "
                     f"{memory_summary(config, inv)}; compute: {compute_summary(config, health)}")


def watchdog_blind_message(gpus: tuple[tuple[str, str], ...]) -> str:
    """The condition's message while the watchdog is blind where it is, or would be, a
    container's only memory tier: stable while it lasts (no count, no pid: the condition is
    patched whenever it changes)."""
    where = ", ".join(f"{uuid} ({reason})" for uuid, reason in gpus)
    return (f"the memory watchdog (--watchdog-policy=kill) cannot see the usage of GPU(s) "
            f"{where}, where it is the only GPU memory tier of fractional containers (no cgroup "
            "or MPS pinned limit): their caps are not in force, so the containers there, and "
            "any placed there meanwhile, are pending (WatchdogBlind: a new pod's gate waits, a "
            "running one's readiness marker is set aside) until it sees again; the node "
            "agent's log names the error, and what to do (docs/node-agent.md, \"What the "
            "watchdog sees and stops\")")


def limits_not_settable_message(gpus: tuple[tuple[str, str, str], ...]) -> str:
    """The condition's message while GPUs take no cgroup memory limit: each GPU and NVML's
    reason, the first one's NVML message, and the remedy; stable while it lasts (the condition
    is patched whenever it changes)."""
    where = ", ".join(f"{uuid} ({reason})" for uuid, reason, _ in gpus)
    first, _, message = gpus[0]
    return (f"no GPU memory limit can be set on GPU(s) {where}: the node agent's sets of "
            f"cgroup limits there fail, pass after pass (NVML's error on {first}: {message}), so "
            "the fractional containers there capped by a cgroup limit, and any placed there "
            "meanwhile, are pending (MemoryLimitNotInForce, or NVML's reason where the read "
            "failed: a new pod's gate waits) until one is in force; the node agent sets NVML "
            "memory limits only with root privileges (the chart runs it as root and "
            "privileged: check its securityContext), on a driver and GPU that support them "
            "(r615 or newer, no MIG: check the driver with nvidia-smi); its log names NVML's "
            "error")


def compute_mode_message(gpus: tuple[tuple[str, str, str], ...]) -> str:
    """The condition's message while GPUs sm-sharing needs in EXCLUSIVE_PROCESS are in another
    compute mode: each GPU, the mode read back, the set's reason, and the remedy; stable while
    it lasts (the condition is patched whenever it changes)."""
    where = ", ".join(f"{uuid} (reads back {mode}; the agent's set failed: {reason})"
                      for uuid, mode, reason in gpus)
    fix = "; ".join(f"nvidia-smi -i {uuid} -c EXCLUSIVE_PROCESS" for uuid, _, _ in gpus)
    return (f"GPU(s) {where} are not in the compute mode EXCLUSIVE_PROCESS that sm-sharing "
            "needs: a process that leaves MPS would run outside every MPS cap, so the sm-sharing "
            "containers there, and any placed there meanwhile, are pending "
            "(ComputeModeNotInForce: a new pod's gate waits, a running one's readiness marker "
            f"is set aside) until it is in force; run {fix}, or let the node agent set it "
            "(check its permissions: setting the mode is root-only, the chart runs it as root "
            "and privileged; its log names NVML's error)")
