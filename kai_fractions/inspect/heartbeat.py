"""When the node agent last said it was alive, as the mirror's follower reads it for its
silent-node check: its heartbeat Lease's renewTime or its node condition's lastHeartbeatTime."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..kube.objects import epoch_seconds

SILENT_AFTER_SECONDS = 180
"""The chart's `mirror.markSilentNodesAfterSeconds`: a quieter agent's node is set Unknown."""


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """When the node agent last said it was alive, as the follower's silent-node check reads
    it: its heartbeat Lease's renewTime or its condition's lastHeartbeatTime, the later."""

    seconds_ago: float | None
    """None: neither carries a time."""
    source: str = ""
    """`lease NS/NAME` or `condition`."""
    error: str = ""
    """Why the Lease could not be read (the condition's time is used alone)."""

    def to_dict(self) -> dict[str, Any]:
        return {"seconds_ago": None if self.seconds_ago is None else round(self.seconds_ago),
                "from": self.source, "error": self.error}


def heartbeat(node: Mapping[str, Any] | None, condition_type: str,
              lease: Mapping[str, Any] | None, lease_ref: str, now: float,
              error: str = "") -> Heartbeat | None:
    """The agent's last sign of life on `node` (None without a node); `lease` is its heartbeat
    Lease as read (None: there is none, or it could not be read: `error`)."""
    if not node:
        return None
    beat = None
    for c in (node.get("status") or {}).get("conditions") or []:
        if isinstance(c, Mapping) and c.get("type") == condition_type:
            beat = epoch_seconds(c.get("lastHeartbeatTime"))
    renewed = epoch_seconds(((lease or {}).get("spec") or {}).get("renewTime"))
    if renewed is not None and (beat is None or renewed >= beat):
        return Heartbeat(max(0.0, now - renewed), f"lease {lease_ref}", error)
    if beat is not None:
        return Heartbeat(max(0.0, now - beat), "condition", error)
    return Heartbeat(None, "", error)
