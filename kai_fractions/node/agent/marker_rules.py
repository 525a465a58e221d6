"""The pure rules of the readiness marker: what a pod's marker must say from the engine's
results (`decide`), and when one already there still holds (`still_valid`, `may_restore`,
`entry_relies_on_mps`, `entry_watchdog_only`).

Apart from the file store (`marker_store`) and the writer that settles pods (`markers`): no I/O,
no clock, no state, so each rule is read and tested on its own.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

from ...marker import MARKER_FILE, ContainerMarker, Marker, MarkerState, is_temp_file
from ..config import HARD_TIERS, Mechanism
from ..desired import ComputeEnforcement
from ..engine import ContainerResult, ContainerState
from ..engine_reports import NOT_IN_FORCE_REASONS, WATCHDOG_BLIND
from ..memory_limits import MEMORY_LIMIT_NOT_IN_FORCE
from ..plan_refusals import hard_tiers_of
from . import events as ev

REFUSED_DEFAULT_REASON = "Refused"


@dataclass(frozen=True, slots=True)
class MarkerDecision:
    write: Mapping[str, ContainerMarker] | None = None
    """The entries to write (None: write nothing)."""
    keep_existing: bool = False
    """Pending: an existing marker that still matches may stay."""


def _applied_message(result: ContainerResult, watchdog_stops: bool) -> str:
    # Deterministic (no times, no counters): an agent restart compares equal and rewrites
    # nothing. `entry_relies_on_mps` and `entry_watchdog_only` read it back: keep them in step.
    compute = result.compute.value if result.compute is not None else "time-slicing"
    hard = hard_tiers_of(result.mechanisms, compute)
    mechanisms = ",".join(sorted(
        f"{m.value} (reports, stops nothing)" if m is Mechanism.WATCHDOG and not watchdog_stops
        else f"{m.value} (tenants can change it)" if m in HARD_TIERS and m not in hard
        else m.value for m in result.mechanisms)) or "none"
    return f"limits in force: memory {mechanisms}; compute {compute}"


_APPLIED_MESSAGE = re.compile(r"limits in force: memory (?P<memory>.+); compute (?P<compute>\S+)")
_COMPUTE = frozenset(c.value for c in ComputeEnforcement)


def entry_relies_on_mps(entry: ContainerMarker) -> bool:
    """Whether an applied marker entry vouches for caps that rely on the MPS control daemon
    (`engine.relies_on_mps`), as the entry itself records it: for an agent with no plan yet
    (a fresh start) that finds the daemon not running. Every agent release wrote an applied
    entry's message as `_applied_message` does, `limits in force: memory <mechanisms>; compute
    <compute>`, so the rule reads it: compute other than `time-slicing` (`mps-namespace`,
    `mps-client-env`: an MPS namespace or the MPS server enforces its share of the SMs), or
    `mps-pinned` among the comma-separated memory mechanisms (its GPU's default pinned limit
    is the daemon's). An entry that does not read so (another message, a compute this release
    does not know) counts as relying on MPS: set aside, it only makes a gate wait until the
    agent has applied the plan again, while kept it could release a workload uncapped. A
    refused entry vouches for nothing (False)."""
    return _reads(entry, lambda mechanisms, compute: (
        compute != ComputeEnforcement.TIME_SLICING.value  # (with or without a qualifier)
        or any(m.partition(" (")[0] == Mechanism.MPS_PINNED.value for m in mechanisms)))


def entry_watchdog_only(entry: ContainerMarker) -> bool:
    """Whether an applied marker entry vouches for a GPU memory cap the watchdog alone enforces
    (`blind_results.watchdog_only`), as the entry itself records it: `watchdog` (a kill-policy
    watchdog's name; a report-only one's says it stops nothing) among its memory mechanisms,
    and none that caps with its compute (`hard_tiers_of`: `cgroup`, or `mps-pinned` with
    `mps-namespace`; one a tenant can change is recorded so). For an agent with no plan
    naming the pod (a fresh start whose passes fail before they plan): no watchdog check of
    it watches the pod. Read
    as `entry_relies_on_mps` reads it: an entry that does not read so counts as watchdog-only
    (set aside, it only makes a gate wait), a refused one vouches for nothing (False)."""
    return _reads(entry, lambda mechanisms, compute: (
        Mechanism.WATCHDOG.value in mechanisms and not hard_tiers_of(mechanisms, compute)))


def _reads(entry: ContainerMarker, rule: Callable[[frozenset[str], str], bool]) -> bool:
    """`rule` of an applied entry's (memory mechanisms, compute) as its message records them;
    True for an applied entry whose message does not read so (set aside, it only makes a gate
    wait), False for a refused one (it vouches for nothing)."""
    if entry.state is not MarkerState.APPLIED:
        return False
    recorded = _recorded(entry)
    return True if recorded is None else rule(*recorded)


def _recorded(entry: ContainerMarker) -> tuple[frozenset[str], str] | None:
    """(memory mechanisms, compute) as an entry's message records them (`_applied_message`);
    None when it does not read so, or names a compute this release does not know."""
    m = _APPLIED_MESSAGE.fullmatch(entry.message)
    if m is None or m["compute"] not in _COMPUTE:
        return None
    return frozenset(part.strip() for part in m["memory"].split(",")), m["compute"]


def decide(results: Mapping[str, ContainerResult], *, watchdog_stops: bool = True
           ) -> MarkerDecision:
    """`results`: container name -> the agent's result for each fractional container;
    `watchdog_stops`: the watchdog's policy is `kill` (with `report` the marker says so)."""
    refused = {n: r for n, r in results.items() if r.state is ContainerState.REFUSED}
    applied = {n: r for n, r in results.items() if r.state is ContainerState.APPLIED}
    if refused:
        entries = {n: ContainerMarker.refused(
            r.reason or REFUSED_DEFAULT_REASON,
            r.message or "refused by the node agent", r.plan_digest or "")
            for n, r in refused.items()}
        entries.update({n: ContainerMarker.applied(r.plan_digest or "",
                                                   _applied_message(r, watchdog_stops))
                        for n, r in applied.items() if r.plan_digest})
        return MarkerDecision(write=entries)
    if len(applied) < len(results) or not results:
        return MarkerDecision(keep_existing=not any(r.not_in_force for r in results.values()))
    return MarkerDecision(write={n: ContainerMarker.applied(r.plan_digest or "",
                                                            _applied_message(r, watchdog_stops))
                                 for n, r in applied.items()})


def _written(names: Collection[str]) -> bool:
    """Whether an agent of this boot wrote in a pod's directory: a marker, or a marker's temp
    file (an earlier boot's marker set aside is not)."""
    return any(name == MARKER_FILE or is_temp_file(name) for name in names)


def still_valid(existing: Marker, results: Mapping[str, ContainerResult]) -> bool:
    """An existing marker may stay while something is pending only if it is an applied
    marker for exactly the current plans, and no container of the pod is known to lack
    something its plan needs (`ContainerResult.not_in_force`: an MPS cap, its namespace's
    percentage or its GPU's pinned limit; the memory limit on its pod's slice): a gate (a
    restarted sandbox's) would let a client start uncapped."""
    if set(existing.containers) != set(results):
        return False
    if any(r.not_in_force for r in results.values()):
        return False
    for name, entry in existing.containers.items():
        if entry.state is not MarkerState.APPLIED or entry.plan_digest != results[name].plan_digest:
            return False
    return True


def may_restore(set_aside: Marker, results: Mapping[str, ContainerResult]) -> bool:
    """Whether a marker the agent's stop set aside for the watchdog (`WATCHDOG_STOPPED`) may
    come back for these results: it vouches for exactly the current plans (`still_valid`), and
    every container is applied or pending for an ordinary reason, one that says nothing of what
    is in force (a failed call); none refused, none known not in force (NOT_IN_FORCE_REASONS).
    It then stays as a marker a running agent had kept (`MarkerDecision.keep_existing`)."""
    return (all(r.state is ContainerState.APPLIED or (
        r.state is ContainerState.PENDING and r.reason not in NOT_IN_FORCE_REASONS)
        for r in results.values()) and still_valid(set_aside, results))


@dataclass(frozen=True, slots=True)
class _NotInForce:
    """One kind of thing a container's marker is set aside for (`ContainerResult.not_in_force`):
    the result's flag, the Warning sent once per episode (`MarkerWriter._cap_events`), and how
    the event and the log say it."""

    flag: Callable[[ContainerResult], bool]
    event: str
    what: str
    """As the event says it."""
    logged: str
    """As the log says it."""
    it: str
    """What comes back."""


_NOT_IN_FORCE = (
    _NotInForce(lambda r: r.mps_cap_missing, ev.MPS_CAP_NOT_IN_FORCE,
                "an MPS cap it relies on", "an MPS cap", "the cap"),
    # With an MPS cap missing too, the container's reason and message are the cap's
    # (`engine.ContainerResult.limit_missing`): told as that, until the cap is back.
    _NotInForce(lambda r: r.limit_missing and not r.mps_cap_missing, MEMORY_LIMIT_NOT_IN_FORCE,
                "the GPU memory limit on its pod's cgroup",
                "the GPU memory limit on the pod's cgroup", "the limit"),
    # Likewise: a container without an MPS cap is told as that until the cap is back.
    _NotInForce(lambda r: r.watchdog_blind and not r.mps_cap_missing and not r.limit_missing,
                WATCHDOG_BLIND, "its GPU memory cap (the watchdog, its only memory tier there)",
                "the watchdog's GPU memory cap (its only memory tier)",
                "the watchdog's view of its GPU"),
)
