"""Our readiness conditions of a Node set Unknown, in one patch guarded by the node's
resourceVersion: what the mirror sends for a node whose agent went silent
(`mirror/node_liveness.py`) and `kai-fractions retire-nodes` for every node the release leaves.

KAI places fractional pods only where the condition says True; Unknown stops that without saying
anything the node agent alone may say (True, False). The patch is a strategic merge: the API
server merges conditions by type, so the kubelet's and anyone else's stay as they are. The
resourceVersion makes a write of the node between the read and the patch win (409 Conflict):
the caller reads again and decides again. `ready_view` is all of a listed node such a patch
needs: a caller listing thousands of nodes keeps that, not the node.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .client import STRATEGIC_MERGE_PATCH, Kube
from .objects import condition_time, node_path


def true_conditions(node: Mapping[str, Any], types: Sequence[str]) -> list[Mapping[str, Any]]:
    """The conditions of `types` on `node` that say True."""
    return [c for c in (node.get("status") or {}).get("conditions") or []
            if isinstance(c, dict) and c.get("type") in types and c.get("status") == "True"]


def ready_view(node: Any, types: Sequence[str]) -> dict[str, Any] | None:
    """`node` (as listed) cut down to what `patch_conditions` needs (its name and
    resourceVersion, its conditions of `types` that say True); None when none says True. A node
    of a large cluster is mostly images and labels: a list of thousands is held as these."""
    if not isinstance(node, dict):
        return None
    meta = node.get("metadata") or {}
    ready = true_conditions(node, types)
    if not ready or not meta.get("name"):
        return None
    return {"metadata": {"name": meta["name"], "resourceVersion": meta.get("resourceVersion")},
            "status": {"conditions": ready}}


def unknown_condition(old: Mapping[str, Any], *, reason: str, message: str,
                      at: float) -> dict[str, Any]:
    """`old` (a condition) as Unknown, with `reason` and `message`, changed at `at` (the
    writer's wall clock); its lastHeartbeatTime kept: the agent's last report, not ours."""
    return {"type": old["type"], "status": "Unknown", "reason": reason, "message": message,
            "lastHeartbeatTime": old.get("lastHeartbeatTime"),
            "lastTransitionTime": condition_time(at)}


async def patch_conditions(kube: Kube, name: str, node: Mapping[str, Any],
                           conditions: Sequence[Mapping[str, Any]], *, what: str) -> None:
    """Writes `conditions` into the status of node `name`, guarded by the resourceVersion of
    `node` (the node as read). Raises KubeError; Conflict when it changed since it was read."""
    version = (node.get("metadata") or {}).get("resourceVersion")
    body = {"metadata": {"resourceVersion": version}, "status": {"conditions": list(conditions)}}
    await kube.request("PATCH", node_path(name) + "/status", body=body, what=what,
                       content_type=STRATEGIC_MERGE_PATCH)
