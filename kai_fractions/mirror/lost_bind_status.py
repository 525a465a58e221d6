"""A fractional BindRequest KAI's binder has not reported Succeeded yet: the follower's wait for
it, and its check once that wait is over and the pod is bound anyway.

A BindRequest still Pending (or Failed with bind attempts left) is normally on its way to
Succeeded: the follower waits for a grace (its PENDING_GRACE) from its creation or first sight,
the longer ago (`waiting`). Past it, the binder's update of its status may have been lost: the
pod is read, and one bound to the node the BindRequest selected is checked as a Succeeded one
(KAI's binder binds a pod only after writing its annotations); one not bound yet is checked
again later, and one bound elsewhere was not bound by KAI's binder (`not_bound`).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable

from ..kube.objects import seconds_since
from ..kube.retry import Deadline
from .bindrequest_view import BindRequestView
from .follower_signing import UNSIGNED_REASON, Report
from .store import PodSnapshot
from .verification import Verification

# The follower's logger, not this module's: its log lines keep the name they were always
# filtered and collected under.
log = logging.getLogger("kai_fractions.mirror.follower")


def waiting(br: BindRequestView, first_seen: OrderedDict[str, float], *, grace: float,
            now: Callable[[], float], monotonic: Callable[[], float], kept: int) -> bool:
    """Whether `br`, not Succeeded yet, is within `grace`: by its creationTimestamp (against
    the wall clock `now`) and by the follower's first sight of it (`monotonic`, remembered in
    `first_seen`, at most `kept`): a wall clock behind the API server's would make the first
    alone wait for as long as it is behind. Without a creationTimestamp (never from the API
    server), not: it is read at once."""
    age = seconds_since(br.created, now())
    if age is None:
        return False
    key, now_m = br.uid or br.ref, monotonic()
    first = first_seen.setdefault(key, now_m)
    while len(first_seen) > kept:
        first_seen.popitem(last=False)
    return max(age, now_m - first) < grace


async def not_bound(br: BindRequestView, pod: PodSnapshot, *, signing: bool, report: Report,
                    said: OrderedDict[tuple[str, str, str], None], remember: int,
                    deadline: Deadline) -> Verification | None:
    """For a BindRequest not Succeeded past the grace: None when its pod is bound to the
    node it selected (check it as a Succeeded one: the binder binds only after writing its
    annotations), else why it is not checked. A pod not bound yet may be bound any moment
    (rechecked); one bound elsewhere was not bound by this BindRequest's binder: with
    `signing` on, that is an event (the node agent holds the pod for its signature). The
    line that says it is checked anyway is logged once per BindRequest (`said`, the
    follower's memory of what it reported, at most `remember`)."""
    pod_ref = f"{br.namespace}/{br.pod_name}"
    node = pod.spec.get("nodeName")
    if not node:
        return Verification(br.ref, pod_ref, skipped=f"{pending_phase(br)}: pod {pod_ref} "
                            "is not bound yet", recheck=True)
    if node != br.selected_node:
        reason = (f"{pending_phase(br)}: pod {pod_ref} is bound to node {node}, not to the "
                  f"node the BindRequest selected ({br.selected_node or 'none'})")
        if signing:
            await report(pod, UNSIGNED_REASON, f"not signed: its BindRequest {br.ref} "
                         f"is still {pending_state(br)} and the pod is bound to node "
                         f"{node}, not to the node KAI selected "
                         f"({br.selected_node or 'none'}): "
                         "something other than KAI's binder bound it", deadline)
        return Verification(br.ref, pod_ref, skipped=reason)
    key = (br.uid or br.ref, "pending-bound", "")  # logged once per BindRequest
    if key not in said:
        log.info("BindRequest %s (created %s) still %s, its pod %s bound to %s: "
                 "checked anyway (KAI's binder binds a pod only after writing its "
                 "annotations; its update of the BindRequest's status was lost or is late)",
                 br.ref, br.created or "at an unknown time", pending_state(br), pod_ref, node)
        said[key] = None
        while len(said) > remember:
            said.popitem(last=False)
    return None


def pending_phase(br: BindRequestView) -> str:
    """How its checks name a BindRequest's phase until it is Succeeded."""
    return f"phase {pending_state(br)}"


def pending_state(br: BindRequestView) -> str:
    if br.phase == "Failed":
        return (f"Failed ({br.failed_attempts} of {br.backoff_limit} bind attempts failed; "
                "KAI's binder tries again)")
    return "Pending"
