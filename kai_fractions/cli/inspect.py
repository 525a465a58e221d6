"""`kai-fractions inspect node NODE` / `inspect pod [NS/]NAME`: per-GPU allocations with their
request, limit, compute mode, active-thread percentage, used memory and whether they are in force.
`inspect mirror [URL...]`: the mirror's replicas as their metrics say (which one follows
BindRequests, calls, the pod cache, signature delays), for a cluster without Prometheus.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable

from ..contract import DEFAULT_KEYS, Keys
from ..contract import keys as k

EXIT_OK, EXIT_NOT_FOUND, EXIT_USAGE = 0, 1, 2
EXIT_CODES = ("Exit codes: 0 the report printed, 1 {what} does not exist, 2 usage error or the "
              "cluster cannot be read.")
RELEASE_NAMESPACE = "kai-fractions"
RELEASE_HELP = ("the release's namespace, where the node agents renew their heartbeat Leases "
                "(default: %(default)s)")
_sleep = time.sleep
"""`inspect mirror`'s wait between its two reads (tests replace it)."""


def register(sub) -> None:
    p = sub.add_parser(
        "inspect", help="show what each GPU of a node runs and under which limits",
        description="Per-GPU table of the fractional allocations of a node (or of one pod): "
        "request, limit, compute mode, active-thread percentage, used memory, state "
        "(enforced, refused with its reason, pending, waiting, unscheduled, ungated: no gate "
        "holds it, invalid: its annotations break the contract) and TIER, what holds each "
        "memory cap (cgroup, mps-pinned, watchdog; none; n/a without --agent-socket; - when "
        "neither enforced nor refused). The numbers come from the pods' annotations (the "
        "NvFractions contract), or, with --agent-socket, from the node agent's plan once it "
        "reports the container applied. The state comes from the node agent's socket "
        "(--agent-socket, on the node), its metrics for a refused container or a cap not in "
        "force (--agent-metrics), else, for inspect pod, "
        "from the agent's events on the pod, else from the gate init container's status "
        "(enforced (gate): only its exit says so); an enforced row has no reason, and the "
        "JSON's state_source says who said the state. Used memory comes from the agent (its "
        "socket, or --agent-metrics). Lines starting with ! below "
        "each GPU say why a row is not enforced, and what is wrong with one that is "
        "(OverLimit: it uses more memory than its limit; PlanChangeRefused: its annotations "
        "were edited on the running pod, and the plan in force is not theirs). Exit codes: "
        "0 ok, 1 the node or pod does not exist, 2 usage error or the cluster cannot be read.",
    )
    what = p.add_subparsers(dest="what", metavar="node|pod|mirror", required=True)
    node = what.add_parser(
        "node", help="every GPU of a node",
        description="Every GPU of NODE and the fractional allocations on it, as `inspect` "
        "describes; the node's gpu.memory label, the agent's condition and heartbeat.",
        epilog=EXIT_CODES.format(what="the node"))
    node.add_argument("name", metavar="NODE", help="the node's name (kubectl get nodes)")
    pod = what.add_parser(
        "pod", help="one pod",
        description="The fractional containers of one pod, on its node's GPUs, as `inspect` "
        "describes. Off the node (no agent socket or metrics read), the node agent's events on "
        "the pod say what its gate's status cannot: a limit set aside since the gate released, "
        "a signature awaited.",
        epilog=EXIT_CODES.format(what="the pod"))
    pod.add_argument("name", metavar="[NS/]NAME", help="the pod: NAME in -n's namespace, or "
                     "NS/NAME")
    pod.add_argument("--namespace", "-n", metavar="NS", help="the pod's namespace, as kubectl's "
                     "-n (default: as kubectl's, the kubeconfig's current context's namespace, "
                     "in a pod its own namespace, else default). Not the release's namespace: "
                     "that is --release-namespace")
    for q in (node, pod):
        q.add_argument("--kubeconfig", metavar="FILE",
                       help="kubeconfig to use (default: in-cluster, then $KUBECONFIG or "
                       "~/.kube/config); the demo prints one with --keep")
        q.add_argument("--agent-socket", metavar="PATH",
                       help="the node agent's NodeEnforcer unix socket (on the node; default: "
                       "/run/kai-fractions/agent.sock when it exists)")
        q.add_argument("--agent-metrics", metavar="URL",
                       help="the node agent's Prometheus endpoint (used memory, a refused "
                       "container with its reason, and one whose cap is not in force, as "
                       "pending): its pod's IP and port 9400, or http://127.0.0.1:9400 through "
                       "kubectl port-forward (the chart's agent has no host port); an endpoint "
                       "that is not this node's agent is noted and not used")
        q.add_argument("--output", "-o", default="table", choices=("table", "json", "yaml"),
                       help="(default: %(default)s)")
        q.add_argument("--annotation-prefix", default=DEFAULT_KEYS.prefix, metavar="P",
                       help="per-container key prefix (default: %(default)s)")
        q.add_argument("--condition-name", default=k.NODE_CONDITION, metavar="NAME",
                       help="the node condition the agent publishes (default: %(default)s)")
    # Nodes are not namespaced: there -n has always named the release's namespace.
    node.add_argument("--release-namespace", "--namespace", "-n", dest="release_namespace",
                      default=RELEASE_NAMESPACE, metavar="NS", help=RELEASE_HELP)
    pod.add_argument("--release-namespace", dest="release_namespace",
                     default=RELEASE_NAMESPACE, metavar="NS", help=RELEASE_HELP)
    p.set_defaults(func=run)
    _register_mirror(what)


def _register_mirror(what) -> None:
    from ..inspect.mirror_sources import DEFAULT_NAMESPACE, DEFAULT_SELECTOR
    from ..inspect.mirror_state import MIN_JUDGED

    q = what.add_parser(
        "mirror", help="the mirror's replicas: follower leader, calls, pod cache, signatures",
        description="One row per mirror replica, from its Prometheus metrics: whether it "
        "follows BindRequests (exactly one replica should), uptime, pod cache, calls and how "
        "many failed, requests to the API server, BindRequests checked, and how long pods "
        "waited for their signature (p50/p99 since the replica started), memory and CPU; "
        "then what is wrong, if anything. Without URL, the mirror's pods are found through "
        "the Kubernetes API and read through the API server's pod proxy (get on pods/proxy). "
        "Failing calls and API requests are judged on what each replica did between two "
        "reads --window seconds apart, not on its totals. Exit codes: 0 every replica read "
        "and nothing wrong, 1 a problem is reported (no replica found or read, no follower "
        "leader or several, a pod cache not synced, over 5% of a replica's API requests or "
        f"of its calls failed in the window, when it made {MIN_JUDGED} at least there), 2 "
        "usage error or the cluster cannot be read.")
    q.add_argument("urls", nargs="*", metavar="URL",
                   help="a replica's metrics endpoint, e.g. http://127.0.0.1:9401 after "
                   "kubectl port-forward (/metrics is added when the path is empty)")
    q.add_argument("--namespace", "-n", "--release-namespace", default=DEFAULT_NAMESPACE,
                   help="where the mirror runs, without URL (default: %(default)s)")
    q.add_argument("--selector", "-l", default=DEFAULT_SELECTOR,
                   help="the mirror pods' labels, without URL (default: %(default)s)")
    q.add_argument("--kubeconfig", metavar="FILE",
                   help="kubeconfig to use, without URL (default: in-cluster, then "
                   "$KUBECONFIG or ~/.kube/config)")
    q.add_argument("--output", "-o", default="table", choices=("table", "json", "yaml"),
                   help="(default: %(default)s)")
    q.add_argument("--window", type=float, default=5.0, metavar="SECONDS",
                   help="seconds between the two reads whose difference is judged (default: "
                   "%(default)g; 0: read once and judge the totals since each replica started)")
    q.set_defaults(func=run_mirror)


def _fail(message: str, code: int = EXIT_USAGE) -> int:
    print(f"kai-fractions inspect: {message}", file=sys.stderr)
    return code


def _heartbeat(reader, node: dict | None, node_name: str, args: argparse.Namespace):
    """The agent's last sign of life on the node; a Lease that cannot be read (RBAC: a user
    without get on Leases there) leaves the condition's time alone, and says so."""
    from ..inspect.heartbeat import heartbeat
    from ..inspect.sources import SourceError

    lease, ref, error = None, "", ""
    if node is not None:
        try:
            lease, ref = reader.heartbeat_lease(args.release_namespace, node_name)
        except SourceError as e:
            error = e.message
    return heartbeat(node, args.condition_name, lease, ref, time.time(), error)


def _usage_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the command line beyond argparse's checks; None when nothing."""
    from ..kube.objects import namespace_flag_problem

    if not args.name.strip():
        return f"{args.what}: {'NODE' if args.what == 'node' else 'the pod'} must not be empty"
    flags = [("--release-namespace", args.release_namespace)]
    if args.what == "pod" and args.namespace is not None:
        flags.append(("-n/--namespace", args.namespace))
    return next(filter(None, (namespace_flag_problem(f, v) for f, v in flags)), None)


def _pod_ref(args: argparse.Namespace) -> tuple[str | None, str] | str:
    """(namespace, name) of `inspect pod`'s [NS/]NAME and -n, the namespace None when neither
    gives one (the configuration's default then, see _pod_namespace); a usage problem as a
    string."""
    namespace, slash, name = args.name.rpartition("/")
    if not name or (slash and (not namespace or "/" in namespace)):
        return f"pod: expected NAME or NS/NAME, got {args.name!r}"
    if slash and args.namespace is not None and args.namespace != namespace:
        # Before -n was the pod's namespace it was the release's (NOTES.txt printed
        # `inspect pod default/memory-request -n kai-fractions`): say where that went.
        return (f"pod {args.name}: its namespace {namespace} is not -n/--namespace "
                f"{args.namespace}: give the namespace once. -n is now the pod's namespace, as "
                "kubectl's; the release's namespace (where the node agents' heartbeat Leases "
                f"are) is --release-namespace: inspect pod {args.name} --release-namespace "
                f"{args.namespace}")
    return namespace or args.namespace, name


def _pod_namespace(reader) -> str:
    """The namespace of a pod named without one, as kubectl's: the kubeconfig's current
    context's, in a pod its own (the service account's namespace file), else default."""
    return reader.default_namespace or "default"


def _node_of(reader, node_name: str) -> tuple[dict | None, str]:
    """The pod's node, and why it could not be read when a 403 forbids it (the pod's rows
    are still worth printing; its label, condition and heartbeat are then not shown)."""
    from ..inspect.sources import SourceError

    try:
        return reader.node(node_name), ""
    except SourceError as e:
        if e.status != 403:
            raise
        return None, e.message.removeprefix(f"node {node_name}: ")


def _events_of(reader, pod: dict, agent) -> tuple[list | None, tuple[str, ...]]:
    """The pod's Events when the agent itself was not read (None: not read, and a note why
    when the read failed: a user without list on events, say)."""
    from ..inspect.sources import SourceError

    meta = pod.get("metadata") or {}
    if agent is None or agent.reachable or not meta.get("uid"):
        return None, ()
    try:
        return reader.pod_events(meta.get("namespace") or "default", meta.get("name") or "",
                                 meta["uid"]), ()
    except SourceError as e:
        return None, (f"the pod's events not read ({e.message}): the node agent's word on it "
                      "(a limit set aside since its gate released, a signature awaited) is not "
                      "shown",)


def run(args: argparse.Namespace) -> int:
    from ..inspect.model import node_report, pod_report
    from ..inspect.render import render
    from ..inspect.sources import SourceError, agent_state, load_kube
    from ..kube.objects import namespace_flag_problem

    try:
        keys = Keys(prefix=args.annotation_prefix)
    except ValueError as e:
        return _fail(f"--annotation-prefix: {e}")
    problem = _usage_problem(args)
    if problem:
        return _fail(problem)
    namespace, name = None, args.name
    if args.what == "pod":
        ref = _pod_ref(args)
        if isinstance(ref, str):
            return _fail(ref)
        namespace, name = ref
    try:
        reader = load_kube(args.kubeconfig)
    except SourceError as e:
        return _fail(e.message)
    try:
        if args.what == "node":
            node = reader.node(name)
            if node is None:
                return _fail(f"node {name}: not found", EXIT_NOT_FOUND)
            pods = reader.pods_on(name)
            agent = agent_state(args.agent_socket, args.agent_metrics, node=name)
            report = node_report(name, node, pods, agent, keys=keys,
                                 condition_type=args.condition_name,
                                 beat=_heartbeat(reader, node, name, args))
        else:
            if namespace is None:
                namespace = _pod_namespace(reader)
                problem = namespace_flag_problem("the default namespace (the kubeconfig's "
                                                 "current context's, or in a pod its own)",
                                                 namespace)
                if problem:
                    return _fail(problem)
            pod = reader.pod(namespace, name)
            node_name = (pod.get("spec") or {}).get("nodeName") or ""
            node, node_error = _node_of(reader, node_name) if node_name else (None, "")
            agent = (agent_state(args.agent_socket, args.agent_metrics, node=node_name)
                     if node_name else None)
            events, notes = _events_of(reader, pod, agent)
            report = pod_report(pod, node, agent, keys=keys,
                                condition_type=args.condition_name,
                                beat=_heartbeat(reader, node, node_name, args),
                                events=events, node_error=node_error, notes=notes)
    except SourceError as e:
        return _fail(e.message, EXIT_NOT_FOUND if e.not_found else EXIT_USAGE)
    finally:
        reader.close()
    sys.stdout.write(render(report, args.output))
    return EXIT_OK


def run_mirror(args: argparse.Namespace) -> int:
    from ..inspect.mirror_sources import replica_from_url, replicas_in_cluster
    from ..inspect.sources import SourceError, load_kube

    if not math.isfinite(args.window) or args.window < 0:
        return _fail(f"--window: must be 0 or more seconds, got {args.window:g}")
    if args.urls:
        return _report_mirror(args, lambda: [replica_from_url(url) for url in args.urls], "")
    if not args.selector.strip():
        return _fail("--selector: must not be empty (it would take every pod of "
                     f"{args.namespace} for a mirror)")
    try:
        reader = load_kube(args.kubeconfig)
    except SourceError as e:
        return _fail(e.message)
    try:
        return _report_mirror(
            args, lambda: replicas_in_cluster(reader, args.namespace, args.selector),
            f" in namespace {args.namespace}")
    except SourceError as e:
        return _fail(e.message)
    finally:
        reader.close()


def _report_mirror(args: argparse.Namespace, read: Callable[[], list], where: str) -> int:
    """Reads the replicas twice, --window seconds apart, so that failures are judged on what
    they did in between (a replica's history neither hides an outage now nor keeps an old
    failure a problem for ever); once with --window 0."""
    from ..inspect.mirror_render import render
    from ..inspect.mirror_state import problems, windowed

    replicas = read()
    if args.window > 0:
        _sleep(args.window)
        replicas = windowed(replicas, read(), args.window)
    sys.stdout.write(render(replicas, args.output, where))
    return EXIT_NOT_FOUND if problems(replicas) else EXIT_OK
