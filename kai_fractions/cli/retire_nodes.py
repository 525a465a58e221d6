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
2. if agent pods are still there at the deadline (an unreachable node: its kubelet down, its
   agent possibly running and reaching the API), the node agent's ClusterRoleBinding
   (`--node-agent-binding`, its one grant of nodes/status) is deleted: a survivor would
   otherwise write its condition True again at its next heartbeat, over the Unknown of step 3,
   and keep it True once the release is gone. With every pod gone it is left to Helm;
3. then every node whose condition of ours still says True (its agent killed before that
   publish, its node unreachable, no agent there) has it set Unknown, reason
   `KaiFractionsUninstalled`, in the patch the mirror sends for a silent agent
   (`kube/node_conditions.py`: guarded by the node's resourceVersion, read again and retried
   on a conflict).

Pods still there at the deadline do not stop step 3 (an unreachable node keeps its agent's pod
Terminating for ever, and its condition is exactly what must not stay True), but the command
then exits 1, naming them (and saying that they can no longer write their condition), as it
does naming every node it could not set Unknown: Helm fails the uninstall, and the operator sees
why (docs/chart.md, "Uninstalling").
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
REVOKE_SECONDS = 1.0
"""The pause between deleting the agents' binding and writing the nodes: each API server stops
honouring a deleted binding once its RBAC cache has seen the delete, a moment later (tests
shorten it). A survivor's write in between is a conflict for our guarded patch, read again."""
RBAC = ("rbac.authorization.k8s.io", "v1", "clusterrolebindings")


def register(sub) -> None:
    from .mirror import DEFAULT_NODE_AGENT_DAEMONSET

    p = sub.add_parser(
        "retire-nodes", help="before an uninstall: stop the node agents, then set every "
        "node's readiness condition still True Unknown",
        description="Run by the chart's pre-delete hook (and pre-upgrade, to gpuSharing: "
        "Disabled) so that no GPU node is left ready for KAI's fractional pods with no node "
        "agent behind it: deletes the node agent DaemonSet (foreground) and waits until its "
        "pods are gone (each agent publishes its condition False as it stops, while it may "
        "still write it); with pods still there at the deadline, deletes the node agent's "
        "ClusterRoleBinding, so that none of them writes its condition again; then sets the "
        f"condition of every node where it still says True Unknown (reason {REASON}). Exit "
        "codes: 0 done, 1 something is left (agent pods still there at the deadline, nodes not "
        "set Unknown, the DaemonSet or the binding not deleted: each named), 2 usage error or "
        "no cluster configuration.")
    p.add_argument("--node-agent-daemonset", default=DEFAULT_NODE_AGENT_DAEMONSET,
                   metavar="NAMESPACE/NAME", help="the node agent DaemonSet (default: "
                   "%(default)s)")
    p.add_argument("--node-agent-selector", default="", metavar="LABELS",
                   help="the node agent pods' labels (k=v,...), to wait for them when the "
                   "DaemonSet is already gone (a second run); default: the DaemonSet's own "
                   "selector, and no wait without one")
    p.add_argument("--node-agent-binding", action="append", default=None, metavar="NAME",
                   help="the node agent's ClusterRoleBinding that grants it nodes/status "
                   "(repeatable), deleted when agent pods are still there at the deadline; "
                   "default: the DaemonSet's name, as the chart names it")
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
    bindings = tuple(args.node_agent_binding or ())
    bad = [b for b in bindings if not b.strip() or "/" in b]
    if problem is None and bad:
        problem = f"--node-agent-binding must be a ClusterRoleBinding's name, got {bad[0]!r}"
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
                                args.wait_seconds, bindings or (name,))
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
                 wait_seconds: float, bindings: Sequence[str] = ()) -> list[str]:
    """Steps 1 to 3 of the module's docstring (`bindings`: the node agent's
    ClusterRoleBindings); what is left, one line each ([] when nothing)."""
    from ..kube.errors import KubeError

    try:
        selector = await _delete_daemonset(kube, namespace, name) or selector
    except KubeError as e:
        # Its agents run on and would write True again: setting nodes Unknown would not hold.
        return [f"daemonset {namespace}/{name} not deleted ({e.message}); no node's "
                "condition was changed: the node agents still run"]
    # Each agent, on its SIGTERM, publishes its condition False (NotReconciling: NodeAgent.stop,
    # with liveness `stopping`) while its RBAC still stands: the nodes are judged only after.
    left = await _wait_for_pods(kube, namespace, selector, wait_seconds) if selector else ""
    if not left:  # every agent gone: their binding is Helm's to delete with the release
        return await _set_nodes_unknown(kube, types)
    problems = await _revoke(kube, bindings)
    if bindings and not problems:
        left += (f"; they can no longer write their condition (clusterrolebinding "
                 f"{', '.join(bindings)} deleted)")
    left += "; the conditions still True are set Unknown all the same"
    return [left, *problems, *await _set_nodes_unknown(kube, types)]


async def _revoke(kube, bindings: Sequence[str]) -> list[str]:
    """Deletes the node agent's ClusterRoleBindings (one already gone is fine), before any node
    is written; the ones it could not, one line each."""
    from ..kube.errors import KubeError, NotFound
    from ..kube.objects import namespaced_path

    problems, deleted = [], False
    for binding in bindings:
        try:
            await kube.request("DELETE", namespaced_path(*RBAC, None, binding),
                               what=f"delete clusterrolebinding {binding}")
            deleted = True
        except NotFound:
            pass  # gone already (a retry): nothing left to take
        except KubeError as e:
            problems.append(f"clusterrolebinding {binding} not deleted ({e.message}): the node "
                            "agents still there may write their condition True again")
    if deleted:
        _say(f"clusterrolebinding {', '.join(bindings)} deleted: the node agents still there "
             "can no longer write their condition")
        await asyncio.sleep(REVOKE_SECONDS)
    return problems


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


async def _wait_for_pods(kube, namespace: str, selector: str, wait_seconds: float) -> str:
    """Lists the agents' pods until none is left, or `wait_seconds` passed; what is left ("" when
    nothing)."""
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
            return ""
        if time.monotonic() >= deadline:
            break
        await asyncio.sleep(POLL_SECONDS)
    if error:
        return (f"node agent pods ({selector}) not listed ({error}): whether their agents "
                "stopped is unknown")
    return f"{len(pods)} node agent pod(s) still there after {wait_seconds:g} s: {', '.join(pods)}"


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
