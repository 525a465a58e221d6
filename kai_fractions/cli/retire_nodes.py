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
   on a conflict): the nodes listed in pages, written a few at a time
   (`retire_node_conditions.py`).

Pods still there at the deadline do not stop step 3 (an unreachable node keeps its agent's pod
Terminating for ever, and its condition is exactly what must not stay True), but the command
then exits 1, naming them (and saying that they can no longer write their condition), as it
does naming every node it could not set Unknown: Helm fails the uninstall, and the operator sees
why (docs/chart.md, "Uninstalling"). Each thing left is said as soon as it is known, and the
last line says what to do. `--deadline-seconds` (the chart's: a little less than its Job's
activeDeadlineSeconds) bounds the whole run: at it the command stops, says what is left, and
exits 1, rather than being killed with nothing said.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..contract import keys as k
from . import EXIT_OK, EXIT_USAGE

EXIT_LEFT = 1
REASON = "KaiFractionsUninstalled"
MESSAGE = ("kai-fractions was uninstalled (or its gpuSharing set to Disabled): no node agent "
           "puts GPU memory limits in force here any more, so KAI places no fractional pod "
           "here; a kai-fractions node agent sets this condition again when it runs here")
POLL_SECONDS = 1.0
"""How often the agents' pods are listed while they stop, and the pause after a request to a
node, or the nodes' list, that got no answer (tests shorten it)."""
TRIES = 5
"""Lists of the nodes, and reads and patches of one node, at most: a list or a request with no
answer is tried again, and a node written in between (409) is read again."""
CONCURRENCY = 10
"""Nodes written at a time: thousands one after another would outlast the deadline."""
REQUEST_SECONDS = 10.0
"""Of each request (a list: of each page); tests shorten it."""
REVOKE_SECONDS = 1.0
"""The pause between deleting the agents' binding and writing the nodes: each API server stops
honouring a deleted binding once its RBAC cache has seen the delete, a moment later (tests
shorten it). A survivor's write in between is a conflict for our guarded patch, read again."""
RBAC = ("rbac.authorization.k8s.io", "v1", "clusterrolebindings")
ADVICE = ("to do: fix what is named above and run `helm uninstall` again; agent pods left on "
          "unreachable nodes: deal with those nodes first, then `helm uninstall --no-hooks` and "
          "delete the hook's objects (docs/chart.md, \"Uninstalling\")")
"""The last line of a run that leaves something: the steps it points to say how."""


def register(sub) -> None:
    from .mirror import DEFAULT_NODE_AGENT_DAEMONSET

    p = sub.add_parser(
        "retire-nodes", help="before an uninstall: stop the node agents, then set every "
        "node's readiness condition still True Unknown",
        description="Run by the chart's pre-delete hook (and pre-upgrade, to gpuSharing: "
        "Disabled) so that no GPU node is left ready for KAI's fractional pods with no node "
        "agent behind it: deletes the node agent DaemonSet (foreground) and waits until its "
        "pods are gone (each agent publishes its condition False as it stops, while it may "
        "still write it); with pods still there after that wait, deletes the node agent's "
        "ClusterRoleBinding, so that none of them writes its condition again; then sets the "
        f"condition of every node where it still says True Unknown (reason {REASON}). Exit "
        "codes: 0 done, 1 something is left (agent pods still there after --wait-seconds, nodes "
        "not set Unknown, the DaemonSet or the binding not deleted, --deadline-seconds "
        "reached: each named as soon as known, the last line saying what to do), 2 usage "
        "error or no cluster configuration.")
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
    p.add_argument("--deadline-seconds", type=float, default=None, metavar="SECONDS",
                   help="the whole run's limit, more than --wait-seconds: then it stops, says "
                   "what is left and exits 1 (the chart: a little less than its Job's "
                   "activeDeadlineSeconds; default: none)")
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
    deadline = args.deadline_seconds
    if problem is None and deadline is not None and not (
            args.wait_seconds < deadline < float("inf")):
        problem = (f"--deadline-seconds must be more than --wait-seconds ("
                   f"{args.wait_seconds:g}), to leave time for the nodes, got {deadline:g}")
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
        kube = Kube(api_client, request_timeout=REQUEST_SECONDS)
    except ConfigError as e:
        _say(str(e), error=True)
        return EXIT_USAGE
    namespace, name = args.node_agent_daemonset.split("/")

    report = Report()

    async def work() -> None:
        try:
            async with asyncio.timeout(deadline) as limit:
                await retire(kube, report, namespace, name, args.node_agent_selector, types,
                             args.wait_seconds, bindings or (name,))
        except TimeoutError:
            if not limit.expired():
                raise
            report.left_over(f"stopped at the deadline ({deadline:g} s, --deadline-seconds): "
                             f"{report.pending() or 'nothing else was left'}")
        finally:
            await kube.close()

    asyncio.run(work())
    if report.left:
        _say(ADVICE, error=True)
        return EXIT_LEFT
    _say("done: no node agent runs, and no node's condition says True")
    return EXIT_OK


class Report:
    """What a run leaves, each line said as soon as it is known (a run stopped at its deadline
    has said all it found), and `pending`: what a stop now would leave, for the deadline's
    line."""

    def __init__(self) -> None:
        self.left: list[str] = []
        self.pending: Callable[[], str] = lambda: ""

    def left_over(self, line: str) -> None:
        self.left.append(line)
        _say(line, error=True)

    def say(self, line: str) -> None:
        _say(line)


async def retire(kube, report: Report, namespace: str, name: str, selector: str,
                 types: Sequence[str], wait_seconds: float, bindings: Sequence[str] = ()) -> None:
    """Steps 1 to 3 of the module's docstring (`bindings`: the node agent's
    ClusterRoleBindings); what is left goes to `report`, one line each."""
    from ..kube.errors import KubeError
    from .retire_node_conditions import set_unknown

    report.pending = lambda: (f"daemonset {namespace}/{name} not deleted: the node agents may "
                              "still run, and no node's condition was changed")
    try:
        selector = await _delete_daemonset(kube, namespace, name) or selector
    except KubeError as e:
        # Its agents run on and would write True again: setting nodes Unknown would not hold.
        report.left_over(f"daemonset {namespace}/{name} not deleted ({e.message}); no node's "
                         "condition was changed: the node agents still run")
        return
    # Each agent, on its SIGTERM, publishes its condition False (NotReconciling: NodeAgent.stop,
    # with liveness `stopping`) while its RBAC still stands: the nodes are judged only after.
    left = await _wait_for_pods(kube, report, namespace, selector, wait_seconds) if selector else ""
    if left:  # with every agent gone, their binding is Helm's to delete with the release
        report.pending = lambda: (f"{left}; clusterrolebinding {', '.join(bindings)} maybe not "
                                  "deleted, and no node's condition was changed")
        problems = await _revoke(kube, bindings)
        if bindings and not problems:
            left += (f"; they can no longer write their condition (clusterrolebinding "
                     f"{', '.join(bindings)} deleted)")
        report.left_over(left + "; the conditions still True are set Unknown all the same")
        for problem in problems:
            report.left_over(problem)
    await set_unknown(kube, report, types, reason=REASON, message=MESSAGE, at_once=CONCURRENCY,
                      tries=TRIES, pause=POLL_SECONDS)


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


def _pod_line(namespace: str, pod: Any) -> str | None:
    """An agent pod as a line names it: namespace/name (node N)."""
    if not isinstance(pod, dict):
        return None
    return (f"{namespace}/{(pod.get('metadata') or {}).get('name')} (node "
            f"{(pod.get('spec') or {}).get('nodeName') or 'none'})")


async def _wait_for_pods(kube, report: Report, namespace: str, selector: str,
                         wait_seconds: float) -> str:
    """Lists the agents' pods until none is left, or `wait_seconds` passed; what is left ("" when
    nothing)."""
    from ..kube.errors import KubeError
    from ..kube.listwatch import Collection
    from ..kube.objects import pods_path

    # In pages, each pod kept as its line: one per GPU node, thousands of them, listed again and
    # again.
    source = Collection(kube, pods_path(namespace), {"labelSelector": selector},
                        what=f"pods {selector} in {namespace}", request_timeout=REQUEST_SECONDS,
                        keep=lambda pod: _pod_line(namespace, pod))
    deadline = time.monotonic() + wait_seconds
    pods: list[str] = []
    error = ""
    report.pending = lambda: (f"node agent pods ({selector}) still there: "
                              f"{', '.join(pods) or 'not listed yet'}; no node's condition was "
                              "changed")
    while True:
        try:
            pods = sorted((await source.list())[0])
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
