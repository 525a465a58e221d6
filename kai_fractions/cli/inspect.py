"""`kai-fractions inspect node NODE` / `inspect pod NS/NAME`: per-GPU allocations with their
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
        "(--agent-socket, on the node), else from the gate init container's status; used "
        "memory from the agent (its socket, or --agent-metrics). Lines starting with ! below "
        "each GPU say why a row is not enforced, and what is wrong with one that is "
        "(OverLimit: it uses more memory than its limit; PlanChangeRefused: its annotations "
        "were edited on the running pod, and the plan in force is not theirs). Exit codes: "
        "0 ok, 1 the node or pod does not exist, 2 usage error or the cluster cannot be read.",
    )
    what = p.add_subparsers(dest="what", metavar="node|pod|mirror", required=True)
    node = what.add_parser("node", help="every GPU of a node")
    node.add_argument("name", metavar="NODE")
    pod = what.add_parser("pod", help="one pod")
    pod.add_argument("name", metavar="NS/NAME", help="namespace/name (namespace default "
                     "when omitted)")
    for q in (node, pod):
        q.add_argument("--kubeconfig", metavar="FILE",
                       help="kubeconfig to use (default: in-cluster, then $KUBECONFIG or "
                       "~/.kube/config); the demo prints one with --keep")
        q.add_argument("--agent-socket", metavar="PATH",
                       help="the node agent's NodeEnforcer unix socket (on the node; default: "
                       "/run/kai-fractions/agent.sock when it exists)")
        q.add_argument("--agent-metrics", metavar="URL",
                       help="the node agent's Prometheus endpoint (used memory, and a "
                       "container whose MPS cap is not in force, as pending): its "
                       "pod's IP and port 9400, or http://127.0.0.1:9400 through kubectl "
                       "port-forward (the chart's agent has no host port)")
        q.add_argument("--output", "-o", default="table", choices=("table", "json", "yaml"),
                       help="(default: %(default)s)")
        q.add_argument("--annotation-prefix", default=DEFAULT_KEYS.prefix, metavar="P",
                       help="per-container key prefix (default: %(default)s)")
        q.add_argument("--condition-name", default=k.NODE_CONDITION, metavar="NAME",
                       help="the node condition the agent publishes (default: %(default)s)")
        q.add_argument("--namespace", "-n", default="kai-fractions", metavar="NS",
                       help="the release's namespace, where the node agents renew their "
                       "heartbeat Leases (default: %(default)s)")
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
    q.add_argument("--namespace", "-n", default=DEFAULT_NAMESPACE,
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
    import time

    from ..inspect.model import heartbeat
    from ..inspect.sources import SourceError

    lease, ref, error = None, "", ""
    if node is not None:
        try:
            lease, ref = reader.heartbeat_lease(args.namespace, node_name)
        except SourceError as e:
            error = e.message
    return heartbeat(node, args.condition_name, lease, ref, time.time(), error)


def run(args: argparse.Namespace) -> int:
    from ..inspect.model import node_report, pod_report
    from ..inspect.render import render
    from ..inspect.sources import SourceError, agent_state, load_kube

    try:
        keys = Keys(prefix=args.annotation_prefix)
    except ValueError as e:
        return _fail(f"--annotation-prefix: {e}")
    namespace, name = "", args.name
    if args.what == "pod":
        namespace, _, name = args.name.rpartition("/")
        namespace = namespace or "default"
        if not name or "/" in namespace:
            return _fail(f"pod: expected NS/NAME, got {args.name!r}")
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
            pod = reader.pod(namespace, name)
            node_name = (pod.get("spec") or {}).get("nodeName") or ""
            node = reader.node(node_name) if node_name else None
            agent = (agent_state(args.agent_socket, args.agent_metrics, node=node_name)
                     if node_name else None)
            report = pod_report(pod, node, agent, keys=keys,
                                condition_type=args.condition_name,
                                beat=_heartbeat(reader, node, node_name, args))
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
