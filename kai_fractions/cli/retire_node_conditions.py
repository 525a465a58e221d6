"""`kai-fractions retire-nodes`, its last step: every node whose readiness condition of ours still
says True has it set Unknown (`kube/node_conditions.py`), on a cluster of thousands of nodes, in
a Job with a memory limit and a deadline.

The nodes are listed in pages (`kube/listwatch.Collection`), each page cut down as it arrives
to the nodes still True and the little a patch needs (`ready_view`): no list is held whole. A
list that fails transiently (no answer in time, a 5xx, a continue token expired) is listed again,
`tries` times at most. The nodes are then written `at_once` at a time, each read again and
retried on a conflict or no answer, `tries` times at most. What is left is said as soon as it is
known, and `report.pending` says at every moment what a stop at the deadline would leave.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .retire_nodes import Report


async def set_unknown(kube, report: Report, types: Sequence[str], *, reason: str, message: str,
                      at_once: int, tries: int, pause: float) -> None:
    """Sets our True conditions of every node Unknown (`reason`, `message`); each node it could
    not is a line of `report`. `pause`: after a try with no answer."""
    from ..kube.errors import KubeError

    report.pending = lambda: "nodes not listed: no node's condition was changed"
    try:
        nodes = await _ready_nodes(kube, types, tries, pause)
    except KubeError as e:
        report.left_over(f"nodes not listed ({e.message}): no node's condition was changed")
        return
    waiting = {node["metadata"]["name"]: node for node in nodes}
    del nodes
    done: list[str] = []
    report.pending = lambda: (f"{len(waiting)} node(s) not set Unknown yet (their condition "
                              f"still says True): {', '.join(sorted(waiting))}; {len(done)} set "
                              "Unknown")
    queue = iter(list(waiting.items()))

    async def writer() -> None:
        for name, node in queue:  # one iterator shared: each node taken by one writer
            try:
                problem = await _retire_node(kube, name, node, types, reason, message, tries,
                                             pause)
            except Exception as e:  # one node's surprise must not cancel the others
                problem = f"its condition may still say True ({type(e).__name__}: {e})"
            del waiting[name]
            if problem:
                report.left_over(f"node {name}: {problem}")
            elif problem is not None:
                done.append(name)

    async with asyncio.TaskGroup() as writers:
        for _ in range(min(max(1, at_once), len(waiting))):
            writers.create_task(writer())
    if done:
        report.say(f"set Unknown ({reason}) on {len(done)} node(s): {', '.join(sorted(done))}")


async def _ready_nodes(kube, types: Sequence[str], tries: int,
                       pause: float) -> list[dict[str, Any]]:
    """Every node with a condition of `types` that says True, as `ready_view` cuts it."""
    from ..kube.errors import Gone, Transient
    from ..kube.listwatch import Collection
    from ..kube.node_conditions import ready_view
    from ..kube.retry import Backoff, retrying

    async def listed(timeout: float) -> list[dict[str, Any]]:
        source = Collection(kube, "/api/v1/nodes", what="nodes", request_timeout=timeout,
                            keep=lambda node: ready_view(node, types))
        try:
            return (await source.list())[0]
        except Gone as e:  # a continue token expired between two pages: list again
            raise Transient(e.message, e.status, answer=e.answer) from None

    return await retrying(listed, what="list nodes",
                          backoff=Backoff(attempts=tries, base=pause, cap=4 * pause),
                          request_timeout=kube.request_timeout)


async def _retire_node(kube, name: str, node: Mapping[str, Any] | None, types: Sequence[str],
                       reason: str, message: str, tries: int, pause: float) -> str | None:
    """Sets the True conditions of `types` of node `name` (`node`: as listed) Unknown. None:
    nothing to do; "": done; else why not."""
    from ..kube.errors import Conflict, KubeError, NotFound, Transient
    from ..kube.node_conditions import patch_conditions, true_conditions, unknown_condition
    from ..kube.objects import node_path

    why = ""
    for _ in range(tries):
        try:
            if node is None:
                node = await kube.request("GET", node_path(name), what=f"read node {name}")
                if not isinstance(node, dict) or \
                        (node.get("metadata") or {}).get("name") != name:
                    # A proxy's answer: nothing True in it would read as "already retired".
                    return (f"its condition may still say True (the answer to read node {name} "
                            "is not that node)")
            ready = true_conditions(node, types)
            if not ready:
                return None  # False or Unknown already (read again: the agent's last word)
            now = time.time()
            await patch_conditions(kube, name, node, [
                unknown_condition(c, reason=reason, message=message, at=now) for c in ready],
                what=f"set the conditions of node {name} Unknown")
            return ""
        except NotFound:
            return None  # gone: nothing left to place pods on
        except (Conflict, Transient) as e:  # changed since read, or no answer: read again
            why, node = e.message, None
            if isinstance(e, Transient):
                await asyncio.sleep(pause)
        except KubeError as e:
            return f"its condition still says True ({e.message})"
    return f"its condition still says True after {tries} tries (last: {why})"
