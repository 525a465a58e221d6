"""What a pod's own status says before any agent is asked: the gate init container's state
(`gate_state`, `gate_released_at`), whether the pod has a gate, why it is not scheduled.

Apart from the row logic (`container_rows`) because it reads the kubelet's and the scheduler's
words only: no contract, no node agent.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..admission.config import GATE_CONTAINER
from ..kube.objects import epoch_seconds
from .report_types import ENFORCED, REFUSED, UNSCHEDULED, WAITING


def _statuses(pod: Mapping[str, Any], field_name: str) -> dict[str, Mapping[str, Any]]:
    status = pod.get("status") or {}
    return {str(s.get("name")): s for s in status.get(field_name) or []
            if isinstance(s, Mapping)}


STUCK = frozenset({"ErrImagePull", "ImagePullBackOff", "CreateContainerConfigError",
                   "CreateContainerError", "InvalidImageName", "RunContainerError"})
"""The kubelet's reasons for a container it cannot start: the gate never gets to wait for
the agent, and this is what to fix."""


def _gate_status(pod: Mapping[str, Any]) -> Mapping[str, Any] | None:
    return _statuses(pod, "initContainerStatuses").get(GATE_CONTAINER)


def gate_released_at(pod: Mapping[str, Any]) -> float | None:
    """When the gate exited 0 (its current state), in seconds since the epoch; else None."""
    terminated = ((_gate_status(pod) or {}).get("state") or {}).get("terminated") or {}
    if not terminated or int(terminated.get("exitCode") or 0) != 0:
        return None
    return epoch_seconds(terminated.get("finishedAt"))


def gate_state(pod: Mapping[str, Any]) -> tuple[str, str, str] | None:
    """(state, reason, message) from the gate init container's status; None when the pod has
    no gate status yet (or no gate at all)."""
    status = _gate_status(pod)
    if status is None:
        return None
    st = status.get("state") or {}
    waiting = st.get("waiting") or {}
    if waiting.get("reason") in STUCK:
        return WAITING, str(waiting["reason"]), " ".join(
            str(waiting.get("message") or "the kubelet cannot start the gate container").split())
    # The current state decides: a gate that runs again (a node reboot, a new sandbox) waits
    # again, whatever its last run said; lastState only tells why it is being retried.
    if "running" in st:
        return WAITING, "GateWaiting", "the gate waits for the node agent to apply the limits"
    terminated = st.get("terminated") or (
        (status.get("lastState") or {}).get("terminated") if "waiting" in st or not st else None)
    if terminated:
        message = " ".join(str(terminated.get("message") or "").split())
        if int(terminated.get("exitCode") or 0) == 0 and "terminated" in st:
            return ENFORCED, "", message
        if int(terminated.get("exitCode") or 0) == 0:
            return WAITING, "GateWaiting", "the gate is about to run again (it released the " \
                "pod before; a new sandbox runs it anew)"
        return REFUSED, "GateFailed", message or str(terminated.get("reason") or "")
    return None


def _has_gate(pod: Mapping[str, Any]) -> bool:
    spec = pod.get("spec") or {}
    return any(isinstance(c, Mapping) and c.get("name") == GATE_CONTAINER
               for c in spec.get("initContainers") or [])


def _unscheduled(pod: Mapping[str, Any]) -> tuple[str, str, str]:
    for c in (pod.get("status") or {}).get("conditions") or []:
        if isinstance(c, Mapping) and c.get("type") == "PodScheduled" and c.get(
                "status") == "False":
            return UNSCHEDULED, str(c.get("reason") or "Unschedulable"), str(
                c.get("message") or "")
    return UNSCHEDULED, "NotBound", "not bound to a node yet"
