"""`kai-fractions node-agent`: one per GPU node (a DaemonSet); watches the pods bound to the node,
enforces their GPU shares, writes their readiness markers and publishes the node's condition.
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import signal
import sys

from ..contract import DEFAULT_KEYS
from ..contract import keys as k
from . import add_log_level, setup_logging

log = logging.getLogger("kai_fractions.node.agent")


NOFILE_CEILING = 1 << 20
"""The most open files the agent asks for (the kernel's default `fs.nr_open`)."""


def _seconds(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {value!r}") from None


def _positive(value: str) -> float:
    number = _seconds(value)
    if not 0 < number < float("inf"):
        raise argparse.ArgumentTypeError(f"must be more than 0, got {value!r}")
    return number


def _nonnegative_seconds(value: str) -> float:
    number = _seconds(value)
    if not 0 <= number < float("inf"):
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value!r}")
    return number


def register(sub) -> None:
    p = sub.add_parser(
        "node-agent", help="run the node agent (one per GPU node)",
        description="Watch the pods bound to this node, enforce their NvFractions GPU shares "
        "(cgroup memory limits, MPS, watchdog), write each pod's readiness marker for its gate, "
        "publish the node condition KAI reads, serve NodeEnforcer on a root-only unix socket and "
        "Prometheus metrics. Stops gracefully on SIGTERM. Exit codes: 0 stopped, 2 usage or "
        "configuration error.",
    )
    p.add_argument("--node-name", default=os.environ.get("NODE_NAME", ""), metavar="NAME",
                   help="this node's name (default: env NODE_NAME)")
    p.add_argument("--socket", default="/run/kai-fractions/agent.sock", metavar="PATH",
                   help="NodeEnforcer unix socket, created 0600 (default: %(default)s)")
    p.add_argument("--marker-dir", default="/var/lib/kai-fractions/markers", metavar="DIR",
                   help="readiness markers, one directory per pod UID (default: %(default)s)")
    p.add_argument("--cgroup-root", default="/sys/fs/cgroup", metavar="DIR",
                   help="the host's cgroup v2 root; the agent does not start on a directory "
                   "without cgroup.controllers (a v1 hierarchy) (default: %(default)s)")
    p.add_argument("--cgroup-driver", default="systemd", choices=("systemd", "cgroupfs"),
                   help="the kubelet's cgroup driver (default: %(default)s)")
    p.add_argument("--proc-root", default="/proc", metavar="DIR",
                   help="the host's /proc, to map GPU processes to containers (default: "
                   "%(default)s)")
    p.add_argument("--sm-sharing", action=argparse.BooleanOptionalAction, default=True,
                   help="supervise an MPS control daemon and serve sm-sharing (default: on)")
    p.add_argument("--mps-control-binary", default="nvidia-cuda-mps-control", metavar="PATH",
                   help="(default: %(default)s)")
    p.add_argument("--mps-pipe-dir", default="/run/kai-fractions/mps", metavar="DIR",
                   help="the MPS pipe directory on the host (default: %(default)s)")
    p.add_argument("--mps-log-dir", default="/var/log/kai-fractions/mps", metavar="DIR",
                   help="(default: %(default)s)")
    p.add_argument("--mps-drain-before-kill", type=float, default=3.0, metavar="SECONDS",
                   help="drain a deleted sm-sharing pod's MPS clients (client terminate) this "
                   "long before its grace period ends, so the kubelet's SIGKILL does not stop "
                   "them in the middle of a kernel (which can wedge the GPU's MPS server for "
                   "every tenant); 0 turns it off (default: %(default)g)")
    p.add_argument("--memory-enforcement", default="cgroup,mps-pinned,watchdog", metavar="LIST",
                   help="comma-separated subset of cgroup,mps-pinned,watchdog, used "
                   "strongest first; a container no enabled tier caps is refused: cgroup needs "
                   "driver r615+, mps-pinned caps sm-sharing containers only, and only on an "
                   "MPS daemon with namespaces (r615+: before, every tenant can change it), and "
                   "the watchdog caps on its own only with --watchdog-policy=kill (default: "
                   "%(default)s)")
    p.add_argument("--watchdog-policy", default="report", choices=("report", "kill"),
                   help="what the watchdog does with a container over its cap: report (an "
                   "event and a metric; it stops nothing, so it is only a second line beside "
                   "cgroup or mps-pinned) or kill (stops the process) (default: %(default)s)")
    p.add_argument("--watchdog-interval", type=_positive, default=1.0, metavar="SECONDS",
                   help="(default: %(default)g)")
    p.add_argument("--metrics-listen", default="0.0.0.0:9400", metavar="ADDR",
                   help="HOST:PORT of the Prometheus endpoint (default: %(default)s)")
    p.add_argument("--condition-name", default=k.NODE_CONDITION, metavar="NAME",
                   help="node condition type to publish (default: %(default)s)")
    p.add_argument("--legacy-condition", action="store_true",
                   help=f"also publish {k.LEGACY_NODE_CONDITION}")
    p.add_argument("--publish-gpu-memory-label", action="store_true",
                   help=f"set the node label {k.NODE_GPU_MEMORY_LABEL} (MiB of the smallest "
                   "GPU) when it is missing")
    p.add_argument("--resync-seconds", type=_positive, default=300.0, metavar="N",
                   help="full resync period: relist pods and re-read every limit (default: "
                   "%(default)g)")
    p.add_argument("--first-list-jitter", type=float, default=2.0, metavar="SECONDS",
                   help="wait a random 0..SECONDS before the first list of the node's pods, so "
                   "agents restarted together (a DaemonSet rollout) list apart; 0 lists at "
                   "once (default: %(default)s)")
    p.add_argument("--list-from-watch-cache", action="store_true",
                   help="list the node's pods with resourceVersion=0: the API server answers "
                   "from its watch cache instead of reading every pod from etcd (what the "
                   "kubelet does; the list may be a moment old, the watch then catches up); "
                   "the list after an expired watch stays a consistent read, and pods a cached "
                   "list lacks are cleared only once a consistent list confirms them gone")
    p.add_argument("--heartbeat-lease-namespace", default="", metavar="NS",
                   help="say the agent is alive by renewing the Lease kai-fractions-agent.<node> "
                   "in NS every 60 s, and write the node condition only when it changes and "
                   "every 5 min (as the kubelet does since node Leases); the mirror's "
                   "silent-node check reads it (its --heartbeat-lease-namespace). Default: "
                   "beat on the node condition every 60 s")
    p.add_argument("--annotation-prefix", default=DEFAULT_KEYS.prefix, metavar="P",
                   help="per-container key prefix (default: %(default)s)")
    p.add_argument("--signing-key-file", action="append", default=[], metavar="FILE",
                   help="apply only allocations signed by the kai-fractions mirror with these "
                   "keys: wait while the signature is missing (SignatureMissing; with an "
                   "unmodified KAI the mirror's BindRequest follower signs) or names a key "
                   "this node does not hold yet (SignatureKeyUnknown; --signature-key-wait), "
                   "refuse a bad one (SignatureInvalid). FILE holds the mirror's Ed25519 "
                   "public key (PEM), or is a directory with `current` and optionally "
                   "`previous` (the ConfigMap kai-fractions-signing-public that the chart's "
                   "mirror publishes). Anything else there is refused, never read as an HMAC "
                   "key (whoever can write that ConfigMap could sign with it): a legacy HMAC "
                   "key goes to --signing-hmac-key-file. A private key is refused (PEM, DER, "
                   "base64 DER or JWK; at start and when re-read): only the mirror may hold "
                   "one. Repeatable; re-read when it changes. Default: no check")
    p.add_argument("--signing-hmac-key-file", action="append", default=[], metavar="FILE",
                   help="also accept allocations signed (v1) with the legacy HMAC key(s) in "
                   "FILE, so that pods signed before the upgrade to Ed25519 keep verifying: "
                   "the raw key bytes, or a directory with `current` and optionally `previous` "
                   "(the Secret of the releases that signed with HMAC, which the chart mounts "
                   "with signing.legacyHmac.enabled). A PEM key is refused there, and a "
                   "private key as with --signing-key-file; a raw 32-byte Ed25519 seed cannot "
                   "be told from an HMAC key, so give only the Secret the chart mounts. Alone, "
                   "it turns the signature check on with HMAC keys only. Repeatable; re-read "
                   "when it changes. Default: none")
    p.add_argument("--signature-key-wait", type=_nonnegative_seconds, default=300.0,
                   metavar="SECONDS",
                   help="with --signing-key-file: how long a signature under a key this node "
                   "does not hold waits for it (SignatureKeyUnknown, pending: right after a key "
                   "rotation the mirror signs with its new key before the node has its public "
                   "half) before it is refused (default: %(default)g)")
    p.add_argument("--kubeconfig", metavar="FILE",
                   help="kubeconfig to use (default: in-cluster, then $KUBECONFIG or "
                   "~/.kube/config)")
    p.add_argument("--nvml-library", metavar="PATH",
                   help="libnvidia-ml.so.1 to load (default: the system's)")
    add_log_level(p)
    p.set_defaults(func=run)


def cgroup_v2_problem(root: str) -> str | None:
    """Why `root` is not a cgroup v2 hierarchy, or None. NVML's GPU memory limits name cgroup
    v2 directories, and the watchdog reads a process's container from its v2 line (`0::`) in
    /proc: on a v1 (or hybrid) host's v1 hierarchy neither would hold, while the agent would
    go on as if they did."""
    if os.path.isfile(os.path.join(root, "cgroup.controllers")):
        return None
    return (f"--cgroup-root {root}: not a cgroup v2 hierarchy (no cgroup.controllers there): "
            "GPU memory limits and the watchdog need cgroup v2; on a hybrid host give its "
            "unified hierarchy (often /sys/fs/cgroup/unified), or boot the node with cgroup "
            "v2 (systemd.unified_cgroup_hierarchy=1)")


def marker_dir_problem(path: str) -> str | None:
    """Why the readiness markers cannot be kept under `path`, or None; the directory is made
    when it is missing (the first marker would make it). An agent that can write no marker
    would hold every gate on the node while its condition says Ready."""
    from ..marker import ROOT_MODE

    try:
        os.makedirs(path, mode=ROOT_MODE, exist_ok=True)
    except FileExistsError:
        return f"--marker-dir {path}: exists and is not a directory"
    except OSError as e:
        return f"--marker-dir {path}: cannot be created: {e.strerror or e}"
    if not os.path.isdir(path):
        return f"--marker-dir {path}: exists and is not a directory"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"--marker-dir {path}: the agent cannot write in it"
    return None


def _fail(message: str) -> int:
    print(f"kai-fractions node-agent: {message}", file=sys.stderr)
    return 2


def raise_open_file_limit() -> tuple[int, int]:
    """Takes the hard limit of open files as the soft one; returns (before, after). The
    watchdog holds a pidfd per GPU process between its checks, and container runtimes start a
    process at 1,024 open files with a far higher hard limit (Go programs take it by
    themselves)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = NOFILE_CEILING if hard == resource.RLIM_INFINITY else min(hard, NOFILE_CEILING)
    if soft == resource.RLIM_INFINITY or soft >= want:
        return soft, soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ValueError, OSError):
        return soft, soft
    return soft, want


def run(args: argparse.Namespace) -> int:
    # Imported here: `kai-fractions --help` must not pay for grpc, kubernetes and pynvml.
    from ..contract import Keys
    from ..kube.config import ConfigError as KubeConfigError
    from ..kube.config import load_api_client
    from ..kube.objects import namespace_flag_problem
    from ..marker import MarkerError
    from ..metrics_http import parse_listen
    from ..node.agent.agent import NodeAgent, StartError
    from ..node.agent.grpc_service import SocketError
    from ..node.agent.kube import KubeCluster
    from ..node.agent.options import AgentOptions
    from ..node.cgroups import HostCgroupFs
    from ..node.config import NodeConfig
    from ..node.errors import ConfigError
    from ..node.mps import MpsDaemon, SubprocessRunner
    from ..node.nvml import PynvmlNvml
    from ..node.procfs import Procfs

    setup_logging(args)
    if not args.node_name:
        return _fail("--node-name (or env NODE_NAME) is required")
    try:
        keys = Keys(prefix=args.annotation_prefix)
    except ValueError as e:
        return _fail(f"--annotation-prefix: {e}")
    if not 0 <= args.first_list_jitter < float("inf"):
        # inf would put the first list off for ever: every gate on the node would time out.
        return _fail("--first-list-jitter must be 0 or more seconds (and finite), got "
                     f"{args.first_list_jitter}")
    if not 0 <= args.mps_drain_before_kill < float("inf"):
        return _fail("--mps-drain-before-kill must be 0 or more seconds, got "
                     f"{args.mps_drain_before_kill}")
    if not args.condition_name.strip():
        return _fail("--condition-name must not be empty")
    problem = args.heartbeat_lease_namespace and namespace_flag_problem(
        "--heartbeat-lease-namespace", args.heartbeat_lease_namespace)
    if problem:
        return _fail(problem)
    try:
        config = NodeConfig(
            node_name=args.node_name, cgroup_root=args.cgroup_root,
            cgroup_driver=args.cgroup_driver, proc_root=args.proc_root,
            sm_sharing=args.sm_sharing, mps_control_binary=args.mps_control_binary,
            mps_pipe_dir=args.mps_pipe_dir, mps_log_dir=args.mps_log_dir,
            memory_enforcement=args.memory_enforcement, watchdog_policy=args.watchdog_policy,
            watchdog_interval=args.watchdog_interval, keys=keys,
            nvml_library=args.nvml_library)
        parse_listen(args.metrics_listen)
    except (ConfigError, ValueError) as e:
        return _fail(str(e))
    options = AgentOptions(
        marker_dir=args.marker_dir, socket=args.socket, metrics_listen=args.metrics_listen,
        condition_name=args.condition_name, legacy_condition=args.legacy_condition,
        publish_gpu_memory_label=args.publish_gpu_memory_label,
        resync_seconds=args.resync_seconds,
        first_list_jitter_seconds=args.first_list_jitter,
        list_from_watch_cache=args.list_from_watch_cache,
        mps_drain_before_kill_seconds=args.mps_drain_before_kill,
        heartbeat_lease_namespace=args.heartbeat_lease_namespace or None,
        signing_key_files=tuple(args.signing_key_file),
        signing_hmac_key_files=tuple(args.signing_hmac_key_file),
        signature_key_wait_seconds=args.signature_key_wait)
    if options.signing:
        from ..signing import SigningConfigError, load_keyring
        try:
            # verify_only: a private key is refused, never reduced to its public half, and the
            # public-key files hold PEM public keys only (HMAC keys only from their own flag).
            keyring = load_keyring(options.signing_key_files, verify_only=True,
                                   hmac_paths=options.signing_hmac_key_files)
        except SigningConfigError as e:
            return _fail(str(e))
        log.info("applying only signed allocations (keys: %s)", ", ".join(keyring.kids))
    try:
        api_client = load_api_client(args.kubeconfig)
        cluster = KubeCluster(api_client, request_timeout=options.api_timeout_seconds,
                              watch_seconds=options.watch_seconds)
    except KubeConfigError as e:
        return _fail(str(e))
    problem = cgroup_v2_problem(config.cgroup_root) or marker_dir_problem(options.marker_dir)
    if problem:
        api_client.close()
        return _fail(problem)
    before, after = raise_open_file_limit()
    if after != before:
        log.info("open file limit raised from %d to %d", before, after)
    mps = None
    if config.sm_sharing:
        # The daemon's own pid is found in the real /proc (its lock), not under --proc-root.
        mps = MpsDaemon(config.mps_control_binary, config.mps_pipe_dir, config.mps_log_dir,
                        SubprocessRunner())
    try:
        agent = NodeAgent(config=config, options=options,
                          nvml=PynvmlNvml(config.nvml_library), cgroup_fs=HostCgroupFs(),
                          source=cluster, cluster=cluster, mps=mps,
                          procfs=Procfs(config.proc_root))
    except MarkerError as e:  # the boot ID: without it no marker can be told from a stale one
        api_client.close()
        return _fail(f"cannot start: {e}")
    cluster.observe_requests(agent.metrics.api_request)

    def on_signal(signum, _frame) -> None:
        log.info("%s received: shutting down", signal.Signals(signum).name)
        agent.request_stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        agent.start()
    except (SocketError, StartError, OSError) as e:
        # SocketError and StartError name their flag; any other error is said as it came.
        why = (str(e) if isinstance(e, SocketError | StartError) else
               f"cannot start: {e.strerror or e}")
        agent.stop(timeout=5, start_error=why)  # closes the cluster too
        api_client.close()
        return _fail(why)
    try:
        while not agent.wait(1.0):
            pass
    finally:
        agent.stop()  # closes the cluster too
        api_client.close()
    return 0
