"""The node agent's word on a pod from the pod's Events, for `inspect pod` when the agent itself
was not read (off the node): per container, the newest of its events that tell a state decides
it, so a readiness marker set aside after the gate released (MpsCapNotInForce,
MemoryLimitNotInForce, WatchdogBlind) or a pod held for its signature is not shown as the
gate's word alone.
The agent names the container at the head of each message (`container NAME: ...`); an event
that names none is the whole pod's."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..kube.objects import epoch_seconds
from ..node.agent import events as ev
from ..node.agent.options import COMPONENT
from ..node.engine_reports import WATCHDOG_BLIND
from ..node.memory_limits import MEMORY_LIMIT_NOT_IN_FORCE

PENDING_REASONS = frozenset({ev.SIGNATURE_MISSING, ev.SIGNATURE_KEY_UNKNOWN,
                             ev.MPS_CAP_NOT_IN_FORCE, MEMORY_LIMIT_NOT_IN_FORCE,
                             WATCHDOG_BLIND})
"""Held back: no marker yet, or the marker set aside (Warning events)."""
UNPLANNED_REASONS = frozenset({ev.SIGNATURE_MISSING, ev.SIGNATURE_KEY_UNKNOWN})
"""Held back before planning: the agent accounts no memory for it yet."""
STATES = {ev.APPLIED: "applied", ev.REFUSED: "refused",
          **dict.fromkeys(PENDING_REASONS, "pending")}
"""Each reason that tells a container's state, and the agent's state it tells (the others,
LimitViolation, PlanChangeRefused, ..., say nothing of whether its limits are in force)."""

_CONTAINER = re.compile(r"container ([^\s:]+): (.*)", re.DOTALL)
_REASON = re.compile(r"([A-Za-z][A-Za-z0-9]*): (.*)", re.DOTALL)


@dataclass(frozen=True, slots=True)
class AgentEvent:
    container: str
    """"" for an event about the whole pod."""
    state: str
    """applied | refused | pending"""
    reason: str
    """The event's reason; a Refused event's is the refusal's own (its message's head)."""
    message: str
    """Without the `container NAME: ` head (nor, for a refusal, its reason)."""
    at: float
    """When it was last seen, in seconds since the epoch."""
    order: tuple[float, int, int, int]
    """(at, not a summary, resourceVersion, position in the list): the newest is the largest.
    Times are whole seconds; within one, a summary of folded events (count > 1) ranks below a
    single event, since it is created at its window's end (a higher resourceVersion) but
    stamped with its last folded event's time, which may share the second of a later event."""


def _when(event: Mapping[str, Any]) -> float | None:
    """The latest of the times the event carries (series.lastObservedTime, eventTime,
    lastTimestamp; else its creation): core/v1 and events.k8s.io writers set different ones."""
    series = event.get("series") if isinstance(event.get("series"), Mapping) else {}
    found = [t for t in (epoch_seconds(series.get("lastObservedTime")),
                         epoch_seconds(event.get("eventTime")),
                         epoch_seconds(event.get("lastTimestamp"))) if t is not None]
    if found:
        return max(found)
    return epoch_seconds((event.get("metadata") or {}).get("creationTimestamp"))


def _version(event: Mapping[str, Any]) -> int:
    try:
        return int((event.get("metadata") or {}).get("resourceVersion") or -1)
    except (TypeError, ValueError):
        return -1


def _count(event: Mapping[str, Any]) -> int:
    count = event.get("count")
    return count if isinstance(count, int) else 1


def _is_agents(event: Mapping[str, Any]) -> bool:
    source = event.get("source") if isinstance(event.get("source"), Mapping) else {}
    return COMPONENT in (source.get("component"), event.get("reportingComponent"))


def agent_events(events: Iterable[Mapping[str, Any]], uid: str) -> tuple[AgentEvent, ...]:
    """The node agent's events about the pod `uid` that tell a container's state."""
    out = []
    for position, e in enumerate(events):
        reason = str(e.get("reason") or "")
        at = _when(e)
        if (reason not in STATES or at is None or not _is_agents(e)
                or (e.get("involvedObject") or {}).get("uid") != uid):
            continue
        message = " ".join(str(e.get("message") or "").split())
        named = _CONTAINER.fullmatch(message)
        container, message = (named[1], named[2]) if named else ("", message)
        if reason == ev.REFUSED and (why := _REASON.fullmatch(message)):
            reason, message = why[1], why[2]
        single = int(not _count(e) > 1)
        out.append(AgentEvent(container, STATES[str(e.get("reason"))], reason, message, at,
                              (at, single, _version(e), position)))
    return tuple(out)


def newest(events: Iterable[AgentEvent], container: str) -> AgentEvent | None:
    """The newest event about `container`, or about its whole pod."""
    return max((e for e in events if e.container in ("", container)),
               key=lambda e: e.order, default=None)
