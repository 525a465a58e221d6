"""`kai-fractions retire-nodes`: take every node out of KAI's fractional placement before the
release goes (the chart's pre-delete hook, and its pre-upgrade hook to `gpuSharing: Disabled`).

KAI places fractional pods only on nodes whose condition (`gpu-fractioning.nvidia.com/Ready`)
says True. On `helm uninstall`, Helm deletes the node agents' DaemonSet and, in the same pass,
their RBAC: an agent stopping then may no longer write its condition False, and the mirror, the
only other writer (a silent agent's Unknown), is gone first. Every GPU node would keep saying
True with nothing behind it, and KAI would go on placing fractional pods there, which would run
with no limit. So, before Helm deletes anything:

1. the DaemonSet is deleted (foreground: it stays until its pods are gone), and its pods are
   waited for, `--wait-seconds` at most. Each agent stops as on any SIGTERM, its RBAC still in
   place, and its last act is to publish its condition False, reason NotReconciling
   (`NodeAgent.stop`, kai_fractions/node/agent/agent.py);
2. then every node whose condition of ours still says True (its agent killed before that
   publish, its node unreachable, no agent there) has it set Unknown, reason
   `KaiFractionsUninstalled`, in the patch the mirror sends for a silent agent
   (`kube/node_conditions.py`: guarded by the node's resourceVersion, read again and retried
   on a conflict).

Pods still there at the deadline do not stop step 2 (an unreachable node keeps its agent's pod
Terminating for ever, and its condition is exactly what must not stay True), but the command
then exits 1, naming them, as it does naming every node it could not set Unknown: Helm fails the
uninstall, and the operator sees why (docs/chart.md, "Uninstalling").
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from ..contract import keys as k
from . import EXIT_USAGE

EXIT_OK, EXIT_LEFT = 0, 1
REASON = "KaiFractionsUninstalled"
MESSAGE = ("kai-fractions was uninstalled (or its gpuSharing set to Disabled): no node agent "
           "puts GPU memory limits in force here any more, so KAI places no fractional pod "
           "here; a kai-fractions node agent sets this condition again when it runs here")
POLL_SECONDS = 1.0
"""How often the agents' pods are listed while they stop (tests shorten it)."""
TRIES = 5
"""Reads and patches of one node at most: a node written in between (409) is read again."""


def register(sub) -> None:
    from .mirror import DEFAULT_NODE_AGENT_DAEMONSET

    p = sub.add_parser(
        "retire-nodes", help="before an uninstall: stop the node agents, then set every "
        "node's readiness condition still True Unknown",
        description="Run by the chart's pre-delete hook (and pre-upgrade, to gpuSharing: "
        "Disabled) so that no GPU node is left ready for KAI's fractional pods with no node "
        "agent behind it: deletes the node agent DaemonSet (foreground) and waits until its "
        "pods are gone (each agent publishes its condition False as it stops, while it may "
        "still write it), then sets the condition of every node where it still says True "
        f"Unknown (reason {REASON}). Exit codes: 0 done, 1 something is left (agent pods "
        "still there at the deadline, nodes not set Unknown, the DaemonSet not deleted: each "
        "named), 2 usage error or no cluster configuration.")
    p.add_argument("--node-agent-daemonset", default=DEFAULT_NODE_AGENT_DAEMONSET,
                   metavar="NAMESPACE/NAME", help="the node agent DaemonSet (default: "
                   "%(default)s)")
    p.add_argument("--node-agent-selector", default="", metavar="LABELS",
                   help="the node agent pods' labels (k=v,...), to wait for them when the "
                   "DaemonSet is already gone (a second run); default: the DaemonSet's own "
                   "selector, and no wait without one")
    p.add_argument("--node-condition", action="append", default=None, metavar="TYPE",
                   help="a node condition the node agents publish (repeatable; default: "
                   f"{k.NODE_CONDITION} and {k.LEGACY_NODE_CONDITION})")
    p.add_argument("--wait-seconds", type=float, default=120.0, metavar="SECONDS",
                   help="how long to wait for the node agents' pods to go (default: "
                   "%(default)g)")
    p.add_argument("--kubeconfig", metavar="FILE",
                   help="kubeconfig to use (default: in-cluster, then $KUBECONFIG or "
                   "~/.kube/config)")
    p.set_defaults(func=run)


def _say(message: str, *, error: bool = False) -> None:
    print(f"kai-fractions retire-nodes: {message}", file=sys.stderr if error else sys.stdout,
          flush=True)


def run(args: argparse.Namespace) -> int:
    from ..kube.client import Kube
    from ..kube.config import ConfigError, load_api_client
    from .mirror import object_flag_problem

    problem = object_flag_problem("--node-agent-daemonset", args.node_agent_daemonset)
    if problem is None and not 0 <= args.wait_seconds < float("inf"):
        problem = f"--wait-seconds must be 0 or more seconds, got {args.wait_seconds:g}"
    types = tuple(args.node_condition or (k.NODE_CONDITION, k.LEGACY_NODE_CONDITION))
    if problem is None and not all(t.strip() for t in types):
        problem = "--node-condition must not be empty"
    if problem:
        _say(problem, error=True)
        return EXIT_USAGE
    try:
        api_client = load_api_client(args.kubeconfig)
        kube = Kube(api_client)
    except ConfigError as e:
        _say(str(e), error=True)
        return EXIT_USAGE
    namespace, name = args.node_agent_daemonset.split("/")

    async def work() -> list[str]:
        try:
            return await retire(kube, namespace, name, args.node_agent_selector, types,
                                args.wait_seconds)
        finally:
            await kube.close()

    left = asyncio.run(work())
    for line in left:
        _say(line, error=True)
    if left:
        return EXIT_LEFT
    _say("done: no node agent runs, and no node's condition says True")
    return EXIT_OK


async def retire(kube, namespace: str, name: str, selector: str, types: Sequence[str],
                 wait_seconds: float) -> list[str]:
    """Steps 1 and 2 of the module's docstring; what is left, one line each ([] when
    nothing)."""
    from ..kube.errors import KubeError

    try:
        selector = await _delete_daemonset(kube, namespace, name) or selector
    except KubeError as e:
        # Its agents run on and would write True again: setting nodes Unknown would not hold.
        return [f"daemonset {namespace}/{name} not deleted ({e.message}); no node's "
                "condition was changed: the node agents still run"]
    # Each agent, on its SIGTERM, publishes its condition False (NotReconciling: NodeAgent.stop,
    # with liveness `stopping`) while its RBAC still stands: the nodes are judged only after.
    left = await _wait_for_pods(kube, namespace, selector, wait_seconds) if selector else []
    return left + await _set_nodes_unknown(kube, types)


async def _delete_daemonset(kube, namespace: str, name: str) -> str:
    """Deletes the DaemonSet (foreground: its pods first); the label selector of its pods, ""
    when it is gone already."""
    from ..kube.errors import NotFound
    from ..kube.objects import namespaced_path

    path = namespaced_path("apps", "v1", "daemonsets", namespace, name)
    try:
        ds = await kube.request("GET", path, what=f"read daemonset {namespace}/{name}")
        await kube.request("DELETE", path, what=f"delete daemonset {namespace}/{name}",
                           query={"propagationPolicy": "Foreground"})
    except NotFound:
        _say(f"daemonset {namespace}/{name} not found: no node agent to stop")
        return ""
    _say(f"daemonset {namespace}/{name} deleted; waiting for its pods to stop")
    return label_selector((ds.get("spec") or {}).get("selector") or {})


def label_selector(selector: Mapping[str, Any]) -> str:
    """A LabelSelector (matchLabels, matchExpressions) as the `labelSelector` query says it."""
    parts = [f"{key}={value}" for key, value in (selector.get("matchLabels") or {}).items()]
    for e in selector.get("matchExpressions") or []:
        key, op, values = e.get("key"), e.get("operator"), ",".join(e.get("values") or [])
        parts.append({"In": f"{key} in ({values})", "NotIn": f"{key} notin ({values})",
                      "Exists": f"{key}", "DoesNotExist": f"!{key}"}.get(op, ""))
    return ",".join(p for p in parts if p)


async def _wait_for_pods(kube, namespace: str, selector: str, wait_seconds: float) -> list[str]:
    """Lists the agents' pods until none is left, or `wait_seconds` passed; what is left."""
    from ..kube.errors import KubeError
    from ..kube.objects import pods_path

    deadline = time.monotonic() + wait_seconds
    pods: list[str] = []
    error = ""
    while True:
        try:
            answer = await kube.request("GET", pods_path(namespace), query={
                "labelSelector": selector}, what=f"list pods {selector} in {namespace}")
            pods = sorted(f"{namespace}/{(p.get('metadata') or {}).get('name')} (node "
                          f"{(p.get('spec') or {}).get('nodeName') or 'none'})"
                          for p in answer.get("items") or [])
            error = ""
        except KubeError as e:  # read again until the deadline; said if it lasts
            error = e.message
        if not pods and not error:
            _say("every node agent pod is gone")
            return []
        if time.monotonic() >= deadline:
            break
        await asyncio.sleep(POLL_SECONDS)
    if error:
        return [f"node agent pods ({selector}) not listed ({error}): whether their agents "
                "stopped is unknown"]
    return [f"{len(pods)} node agent pod(s) still there after {wait_seconds:g} s: "
            f"{', '.join(pods)}; their nodes' conditions were set Unknown all the same"]


async def _set_nodes_unknown(kube, types: Sequence[str]) -> list[str]:
    """Sets our True conditions of every node Unknown; the nodes it could not, one line
    each."""
    from ..kube.errors import KubeError

    try:
        nodes = await kube.request("GET", "/api/v1/nodes", what="list nodes")
    except KubeError as e:
        return [f"nodes not listed ({e.message}): no node's condition was changed"]
    left, done = [], []
    for node in nodes.get("items") or []:
        name = (node.get("metadata") or {}).get("name") or ""
        problem = await _retire_node(kube, name, node, types)
        if problem:
            left.append(f"node {name}: {problem}")
        elif problem is not None:
            done.append(name)
    if done:
        _say(f"set Unknown ({REASON}) on {len(done)} node(s): {', '.join(done)}")
    return left


async def _retire_node(kube, name: str, node: Mapping[str, Any] | None,
                       types: Sequence[str]) -> str | None:
    """Sets the True conditions of `types` of node `name` (`node`: as listed) Unknown. None:
    nothing to do; "": done; else why not."""
    from ..kube.errors import Conflict, KubeError, NotFound, Transient
    from ..kube.node_conditions import patch_conditions, true_conditions, unknown_condition
    from ..kube.objects import node_path

    why = ""
    for _ in range(TRIES):
        try:
            if node is None:
                node = await kube.request("GET", node_path(name), what=f"read node {name}")
            ready = true_conditions(node, types)
            if not ready:
                return None  # False or Unknown already (read again: the agent's last word)
            now = time.time()
            await patch_conditions(kube, name, node, [
                unknown_condition(c, reason=REASON, message=MESSAGE, at=now) for c in ready],
                what=f"set the conditions of node {name} Unknown")
            return ""
        except NotFound:
            return None  # gone: nothing left to place pods on
        except (Conflict, Transient) as e:  # changed since read, or no answer: read again
            why, node = e.message, None
            if isinstance(e, Transient):
                await asyncio.sleep(POLL_SECONDS)
        except KubeError as e:
            return f"its condition still says True ({e.message})"
    return f"its condition still says True after {TRIES} tries (last: {why})"
