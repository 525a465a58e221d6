"""What a pass makes of the watchdog's blindness (`blindness`): its results and messages.

A container whose only memory tier is the watchdog there (`watchdog_only`) on a GPU in an
episode of blindness has no cap in force: the pass reports it pending under WATCHDOG_BLIND
(`pending_blind`), so no readiness marker vouches for it. A pass never vouches for such a
container on a GPU that no check judged with it planned (`vouches_unjudged`: a restarted agent,
a pod new on the GPU): it runs a check first. Apart from `blindness`, which finds what the
watchdog cannot see, so that the words a container's result says of it read in one place.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Set
from typing import TYPE_CHECKING

from ...contract import MIB
from ..config import Mechanism
from ..desired import ContainerDesired, ContainerKey, DesiredState
from ..engine_reports import WATCHDOG_BLIND, ContainerResult, ContainerState
from ..inventory import Inventory
from ..plan_refusals import hard_tiers_of

if TYPE_CHECKING:
    from .blindness import Blindness  # which builds on this module

USAGE_UNKNOWN = "usage unknown on "
"""How a message begins that names the GPUs where a container's usage is not known
(`usage_unknown`): GetNodeState's messages carry it, `kai-fractions inspect` reads it back."""


def watchdog_only(c: ContainerDesired, watchdog_stops: bool) -> bool:
    """Whether the container's GPU memory cap rests on the watchdog alone (on each of its GPUs:
    its mechanisms are the same on all of them): the watchdog stops what exceeds a cap (kill
    policy) and none of its other mechanisms caps it (`hard_tiers_of`: the cgroup tier, or
    mps-pinned in an MPS namespace of its own). A watchdog that only reports is no tier (the
    plan refuses a container it alone would watch)."""
    return (watchdog_stops and Mechanism.WATCHDOG in c.mechanisms
            and not hard_tiers_of(c.mechanisms, c.compute))


def vouches_unjudged(desired: DesiredState, results: Mapping[ContainerKey, ContainerResult],
                     inventory: Inventory, judged: Set[tuple[ContainerKey, str]],
                     watchdog_stops: bool) -> bool:
    """Whether a pass with these results would vouch for a container whose only memory
    tier is the watchdog (applied) on a GPU of the node that no check has judged with it
    planned (not in `judged`: (container, GPU uuid)): it must run a check first."""
    for c in desired.containers:
        r = results.get(c.key)
        if (r is None or r.state is not ContainerState.APPLIED
                or not watchdog_only(c, watchdog_stops)):
            continue
        if any((c.key, u) not in judged for u in c.plan.device_uuids
               if inventory.device(u) is not None):
            return True
    return False


def pending_blind(desired: DesiredState, results: Mapping[ContainerKey, ContainerResult],
                  blind: Mapping[str, Blindness], watchdog_stops: bool
                  ) -> tuple[dict[ContainerKey, ContainerResult], dict[str, str]]:
    """The pass's results with each container whose GPU memory cap rests on the watchdog
    alone (`watchdog_only`) on a GPU in an episode of blindness (`blind`) reported
    pending under WATCHDOG_BLIND (`ContainerResult.watchdog_blind`): nothing would stop a
    process of it over its cap there, so no readiness marker may vouch for it. A refused
    one stays refused; one known without an MPS cap too keeps that reason (its message
    says what to do first). Also returns GPU uuid -> blindness reason of each such GPU
    (with such a container)."""
    out = dict(results)
    gpus_out: dict[str, str] = {}
    for c in desired.containers:
        gpus = [u for u in c.plan.device_uuids if u in blind]
        if not gpus or not watchdog_only(c, watchdog_stops):
            continue
        gpus_out.update((u, blind[u].reason) for u in gpus)
        r = out.get(c.key)
        if r is None or r.state is ContainerState.REFUSED:
            continue
        out[c.key] = _blind_result(r, c, gpus, blind)
    return out, gpus_out


def usage_unknown(gpus: Iterable[tuple[str, str]]) -> str:
    """USAGE_UNKNOWN, then `GPU <uuid> (<reason>)` for each GPU (uuid, reason), comma-separated
    (a colon follows where it is used)."""
    return USAGE_UNKNOWN + ", ".join(f"GPU {uuid} ({reason})" for uuid, reason in gpus)


def blind_message(c: ContainerDesired, gpus: Iterable[str],
                  blind: Mapping[str, Blindness]) -> str:
    """Why a container whose only memory tier is the watchdog has no cap in force on `gpus`,
    and what to do (first: an event's message is cut at 1024 characters)."""
    gpus = list(gpus)
    seen = "; ".join(blind[u].detail for u in gpus)
    return (f"{usage_unknown((u, blind[u].reason) for u in gpus)}: the watchdog, this "
            "container's only GPU memory tier there (no cgroup or MPS pinned limit), cannot see "
            f"its use ({seen}), so its cap of {-(-c.plan.limit_bytes // MIB)} MiB is not in "
            "force: nothing stops a process over it until watchdog checks see the GPU again")


def _blind_result(r: ContainerResult, c: ContainerDesired, gpus: list[str],
                  blind: Mapping[str, Blindness]) -> ContainerResult:
    if r.mps_cap_missing or r.limit_missing:  # its own reason says what to do first
        return dataclasses.replace(r, watchdog_blind=True)
    message = blind_message(c, gpus, blind)
    if r.state is ContainerState.PENDING and r.reason:
        message += f" (this pass also: {r.reason}: {r.message})"
    return dataclasses.replace(r, state=ContainerState.PENDING, reason=WATCHDOG_BLIND,
                               message=message, watchdog_blind=True)
