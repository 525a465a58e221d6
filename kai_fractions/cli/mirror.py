"""`kai-fractions mirror`: the AllocationMirror gRPC service a scheduler calls, optionally
following KAI's BindRequests (`--follow-bindrequests`) for clusters that run an unmodified KAI."""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import math
import os
import signal
import sys
import threading

from ..contract import DEFAULT_DIALECT, DEFAULT_KEYS, DIALECTS, Dialect, Keys
from ..contract.dialect import check_reserve
from ..contract.keys import (
    KAI_BINDER_IDENTITY,
    KAI_SCHEDULER_NAME,
    LEGACY_NODE_CONDITION,
    NODE_CONDITION,
    RESERVATION_NAMESPACE,
)
from . import add_log_level, add_metrics_listen, setup_logging

DEFAULT_LISTEN = "127.0.0.1:50051"
DEFAULT_NODE_AGENT_DAEMONSET = "kai-fractions/kai-fractions-node-agent"
log = logging.getLogger("kai_fractions.mirror")


def register(sub) -> None:
    p = sub.add_parser(
        "mirror", help="run the AllocationMirror gRPC service (the scheduler's side)",
        description="Serve kai_fractions.v1.AllocationMirror: a scheduler (or KAI's binder) "
        "calls MirrorAllocation with its decision for a pod; the mirror computes the "
        "NvFractions annotations (binder arithmetic and the derived values the node reads) and "
        "writes them on the pod in ONE merge patch guarded by the pod's uid and "
        "resourceVersion. ReleaseAllocation removes them, PreviewAllocation computes without "
        "writing. Serves the standard gRPC health service and server reflection. Stops "
        "gracefully on SIGTERM. Exit codes: 0 stopped, 2 usage or configuration error.",
    )
    p.add_argument("--listen", default=DEFAULT_LISTEN, metavar="ADDR",
                   help="HOST:PORT or unix:///abs/path.sock (default: %(default)s); a "
                   "non-loopback address needs TLS or --insecure")
    p.add_argument("--tls-cert", metavar="FILE", help="server certificate (PEM) for TLS")
    p.add_argument("--tls-key", metavar="FILE", help="private key (PEM) of --tls-cert")
    p.add_argument("--tls-client-ca", metavar="FILE",
                   help="CA bundle (PEM): require client certificates it signed (mutual TLS)")
    p.add_argument("--token-file", metavar="FILE",
                   help="require `authorization: Bearer <token>` metadata on every call but "
                   "health checks; the file holds the token and is re-read when it changes")
    p.add_argument("--signing-key-file", action="append", default=[], metavar="FILE",
                   help="sign every container's allocation (annotation "
                   "kai-fractions.io/container.<c>.signature) so node agents apply only what "
                   "the mirror wrote. FILE is an Ed25519 private key (PEM; `kai-fractions "
                   "signing-keys generate` writes one, the chart generates one): Ed25519 "
                   "signatures, which node agents verify with the public half alone "
                   "(--publish-public-key). A FILE of raw bytes (>= 16) is an HMAC-SHA256 key, "
                   "the format of releases before Ed25519, kept for upgrades: anyone holding it "
                   "can sign, and the mirror signs with it only when it is the first key. FILE "
                   "may be a directory with `current` and optionally `previous` (the chart's "
                   "Secret); repeatable: the first key signs, every key is accepted as still "
                   "valid. Re-read when it changes. Default: no signatures")
    p.add_argument("--publish-public-key", default="", metavar="NAMESPACE/NAME",
                   help="write the public half of the Ed25519 signing key(s) into this "
                   "ConfigMap (`current`, `previous`), which node agents mount as their "
                   "--signing-key-file: nodes verify, only the mirror signs (needs "
                   "--signing-key-file with an Ed25519 private key)")
    p.add_argument("--insecure", action="store_true",
                   help="allow plaintext on a non-loopback address (inside a trusted network "
                   "only)")
    p.add_argument("--kai-dialect", choices=DIALECTS, default=DEFAULT_DIALECT.value,
                   help="which KAI binder the annotations match: `upstream` (KAI main: no "
                   "compute portion, no reserve) or `patched` (the KAI + gpu-fractioning "
                   "forks that also write .gpu-compute.portion; default: %(default)s)")
    p.add_argument("--reserve-mib", type=int, default=0, metavar="N",
                   help="GPU memory (MiB) withheld per GPU before a portion becomes memory, "
                   "when the caller does not say (default: %(default)s in both dialects). "
                   "Upstream KAI withholds none; a patched KAI binder withholds 1024 by "
                   "default, so pass --reserve-mib 1024 with --kai-dialect patched")
    p.add_argument("--write-as", default="", metavar="USER",
                   help="impersonate USER for every pod write (Impersonate-User), e.g. "
                   f"{KAI_BINDER_IDENTITY}: KAI's NvFractions admission webhook lets only its "
                   "binder's service account write .gpus.devices; needs RBAC `impersonate` on "
                   "exactly that service account (default: write as the mirror itself)")
    p.add_argument("--annotation-prefix", default=DEFAULT_KEYS.prefix, metavar="P",
                   help="per-container key prefix (default: %(default)s)")
    p.add_argument("--kubeconfig", metavar="FILE",
                   help="kubeconfig to use (default: in-cluster, then $KUBECONFIG or "
                   "~/.kube/config)")
    p.add_argument("--follow-bindrequests", action="store_true",
                   help="also watch KAI's BindRequests (scheduling.run.ai/v1alpha2) and report "
                   "pods whose annotations differ from what the binder should have written as "
                   "events (reason NvFractionsMismatch); with --signing-key-file it signs the pods "
                   "whose annotations match (and writes nothing else)")
    p.add_argument("--reservation-namespace", default=RESERVATION_NAMESPACE, metavar="NS",
                   help="with --follow-bindrequests: where KAI's binder creates the GPU "
                   "groups' reservation pods (KAI's binder.resourceReservation.namespace; "
                   "default: %(default)s)")
    p.add_argument("--mark-silent-nodes-after", type=float, default=0.0, metavar="SECONDS",
                   help="with --follow-bindrequests: when a bind is checked, set its node's "
                   "readiness condition Unknown if it still says True but its node agent has not "
                   "said it is alive for SECONDS (it renews its heartbeat Lease, or without one "
                   "the condition, every 60 s; judged by the mirror's own clock, as a heartbeat "
                   "that has not changed for SECONDS), so KAI stops placing fractional pods where "
                   "nothing would apply their limits; at least 120, 0 for off (default: "
                   "%(default)s)")
    p.add_argument("--heartbeat-lease-namespace", default="", metavar="NS",
                   help="with --mark-silent-nodes-after: where the node agents renew their "
                   "heartbeat Leases (their --heartbeat-lease-namespace); a node whose agent "
                   "has no Lease there is judged by its condition's lastHeartbeatTime "
                   "(default: $POD_NAMESPACE, else the service account's namespace)")
    p.add_argument("--node-condition", action="append", default=None, metavar="TYPE",
                   help="with --mark-silent-nodes-after: a node condition the node agent "
                   f"publishes (repeatable; default: {NODE_CONDITION} and {LEGACY_NODE_CONDITION})")
    p.add_argument("--follow-concurrency", type=int, default=8, metavar="N",
                   help="with --follow-bindrequests: BindRequests checked at once; with an "
                   "unmodified KAI every fractional pod waits for its check and signature, and "
                   "a check waits on the API server (default: %(default)s)")
    p.add_argument("--leader-elect", action="store_true",
                   help="with --follow-bindrequests: follow only while holding a "
                   "coordination.k8s.io Lease, so one replica of several checks and signs each "
                   "BindRequest (every replica still serves MirrorAllocation)")
    p.add_argument("--leader-elect-lease-name", default="kai-fractions-mirror-follower",
                   metavar="NAME", help="the Lease (default: %(default)s)")
    p.add_argument("--leader-elect-lease-namespace", default="", metavar="NS",
                   help="the Lease's namespace (default: $POD_NAMESPACE, else the service "
                   "account's namespace, else \"default\")")
    p.add_argument("--leader-elect-identity", default="", metavar="ID",
                   help="this replica's holderIdentity (default: $POD_NAME, else the host "
                   "name and process id)")
    p.add_argument("--leader-elect-lease-duration", type=float, default=15.0, metavar="S",
                   help="seconds a silent holder keeps the Lease (default: %(default)s)")
    p.add_argument("--leader-elect-renew-deadline", type=float, default=10.0, metavar="S",
                   help="seconds without a renewal after which a holder stops following "
                   "(default: %(default)s)")
    p.add_argument("--leader-elect-retry-period", type=float, default=2.0, metavar="S",
                   help="seconds between attempts to acquire or renew (default: %(default)s)")
    p.add_argument("--scheduler-name", default=KAI_SCHEDULER_NAME, metavar="NAME",
                   help="the scheduler whose Pending pods the mirror keeps in its pod cache "
                   "(a field selector, so the API server sends no others); \"\" caches every "
                   "Pending pod (default: %(default)s)")
    p.add_argument("--no-pod-cache", dest="pod_cache", action="store_false",
                   help="read every pod from the API server before writing it, instead of "
                   "keeping a list + watch cache of pods (one API request per call instead of "
                   "two; the write stays guarded by uid and resourceVersion either way)")
    p.add_argument("--report-gpu-fractioning-config", action="store_true",
                   help="keep the Ready condition of the cluster-scoped GpuFractioningConfig "
                   "`default` (gpu-fractioning.kai.scheduler/v1alpha1, which KAI's operator "
                   "reads in NvFractions mode) in step with the node agent DaemonSet: True only "
                   "when every scheduled agent is updated and ready")
    p.add_argument("--node-agent-daemonset", default=DEFAULT_NODE_AGENT_DAEMONSET,
                   metavar="NAMESPACE/NAME",
                   help="the node agent DaemonSet whose readiness --report-gpu-fractioning-"
                   "config reports (default: %(default)s)")
    p.add_argument("--report-interval", type=float, default=10.0, metavar="SECONDS",
                   help="how often --report-gpu-fractioning-config re-reads the DaemonSet; the "
                   "object is written only when its condition changes (default: %(default)s)")
    add_metrics_listen(p, "calls, API requests, the pod cache, the follower, the process; "
                       "docs/mirror.md")
    add_log_level(p)
    p.set_defaults(func=run)


def _fail(message: str) -> int:
    print(f"kai-fractions mirror: {message}", file=sys.stderr)
    return 2


def object_flag_problem(flag: str, value: str) -> str | None:
    """Why `value` cannot name a namespaced object (NAMESPACE/NAME: a namespace, then a DNS
    subdomain, as the API server names DaemonSets and ConfigMaps), as the CLI says it; None
    when it can."""
    from ..contract.names import is_dns_subdomain
    from ..kube.objects import namespace_flag_problem

    parts = value.split("/")
    if len(parts) != 2 or not all(parts):
        return f"{flag} must be NAMESPACE/NAME, got {value!r}"
    namespace, name = parts
    problem = namespace_flag_problem(f"{flag} {value!r}: the namespace", namespace)
    if problem:
        return problem
    if not is_dns_subdomain(name):
        return (f"{flag} {value!r}: the name {name!r}: not an object name (lower-case letters, "
                "digits, '-' and '.', at most 253)")
    return None


def signing_key_problem(keyring, first_file: str) -> str | None:
    """Why the mirror cannot sign with `keyring` (its first key is the one that signs): a
    public key verifies only, and every allocation would fail as it is signed."""
    key = keyring.current
    if key.can_sign:
        return None
    return (f"--signing-key-file {getattr(key, 'source', '') or first_file}: a public key; the "
            "mirror needs the private key (the chart's Secret kai-fractions-signing-key, or "
            "DIR/private/current from `kai-fractions signing-keys generate DIR`); the public "
            "key is the node agents' --signing-key-file")


def run(args: argparse.Namespace) -> int:
    # Imported here: `kai-fractions --help` must not pay for grpc and the kubernetes client.
    from ..kube.client import Kube
    from ..kube.config import ConfigError, load_api_client
    from ..metrics_http import MetricsEndpoint, parse_listen
    from ..mirror.compute import user_request
    from ..mirror.grpc.security import SecurityConfigError
    from ..mirror.grpc.server import MirrorServer, ServerOptions
    from ..mirror.kube_store import KubePodStore
    from ..mirror.pod_cache import PodCache
    from ..mirror.pod_feed import pod_feed
    from ..mirror.service import MirrorService
    from ..mirror.signing import signing_annotations
    from ..signing import KeyringSource, SigningConfigError
    from .mirror_background import background, first_publish

    setup_logging(args)
    try:
        keys = Keys(prefix=args.annotation_prefix)
    except ValueError as e:
        return _fail(f"--annotation-prefix: {e}")
    dialect = Dialect(args.kai_dialect)
    problem = check_reserve(dialect, args.reserve_mib)
    if problem:
        return _fail(f"--reserve-mib {problem}")
    daemonset = args.node_agent_daemonset.split("/")
    problem = object_flag_problem("--node-agent-daemonset", args.node_agent_daemonset)
    if problem:
        return _fail(problem)
    if not 0 < args.report_interval < math.inf:
        return _fail(f"--report-interval must be a positive, finite number of seconds, got "
                     f"{args.report_interval}")
    publish_to = args.publish_public_key.split("/") if args.publish_public_key else []
    problem = object_flag_problem("--publish-public-key", args.publish_public_key) \
        if publish_to else None
    if problem:
        return _fail(problem)
    if publish_to and not args.signing_key_file:
        return _fail("--publish-public-key publishes the signing key's public half: it needs "
                     "--signing-key-file")
    if args.follow_concurrency < 1:
        return _fail(f"--follow-concurrency {args.follow_concurrency}: at least 1")
    if args.mark_silent_nodes_after and (not args.follow_bindrequests
                                         or not 120 <= args.mark_silent_nodes_after < math.inf):
        return _fail(f"--mark-silent-nodes-after {args.mark_silent_nodes_after:g}: "
                     + ("at least 120 seconds (twice the node agent's heartbeat) and finite, or "
                        "0 for off"
                        if args.follow_bindrequests else
                        "it needs --follow-bindrequests (nodes are checked as binds are)"))
    from ..kube.objects import namespace_flag_problem

    problem = (args.heartbeat_lease_namespace and namespace_flag_problem(
        "--heartbeat-lease-namespace", args.heartbeat_lease_namespace)) or \
        namespace_flag_problem("--reservation-namespace", args.reservation_namespace)
    if problem:
        return _fail(problem)
    metrics = None
    if args.metrics_listen:
        from ..mirror.metrics import MirrorMetrics

        try:
            parse_listen(args.metrics_listen)
        except ValueError as e:
            return _fail(str(e))
        metrics = MirrorMetrics()
    election = None
    if args.leader_elect:
        from ..mirror.leader import election_config

        election = election_config(args, os.environ)
        if not args.follow_bindrequests:
            return _fail("--leader-elect elects the BindRequest follower: it needs "
                         "--follow-bindrequests")
        if election.problems():
            return _fail("--leader-elect: " + "; ".join(election.problems()))
    options = ServerOptions(listen=args.listen, tls_cert=args.tls_cert, tls_key=args.tls_key,
                            tls_client_ca=args.tls_client_ca, token_file=args.token_file,
                            insecure=args.insecure)
    try:
        MirrorServer.check(options)  # flags before the cluster: usage errors come first
        signer, keyring = None, None
        if args.signing_key_file:
            keyring = KeyringSource(args.signing_key_file)
            problem = signing_key_problem(keyring.current(), args.signing_key_file[0])
            if problem:
                return _fail(problem)
            signer = signing_annotations(keyring, keys)
            log.info("signing allocations with key %s (accepted: %s)",
                     keyring.current().current.kid, ", ".join(keyring.current().kids))
        api_client = load_api_client(args.kubeconfig)
        kube = Kube(api_client, observe=metrics.api_request if metrics else None)
        # Each pod the cache learns of is parsed as the service will read it, before it is
        # bound: an allocation for it starts from that.
        cache = PodCache(prepare=functools.partial(user_request, keys=keys)) \
            if args.pod_cache else None
        if cache is not None and metrics is not None:
            metrics.watch_pod_cache(cache)
        if args.write_as:
            log.info("pod writes impersonate %s", args.write_as)
        service = MirrorService(KubePodStore(kube, write_as=args.write_as), keys=keys,
                                default_reserve_mib=args.reserve_mib, dialect=dialect,
                                extra_annotations=signer, cache=cache)
        feeds = [pod_feed(kube, cache, args.scheduler_name)] if cache is not None else []
        work, publisher = background(args, kube, keys=keys, dialect=dialect, keyring=keyring,
                                    election=election, publish_to=publish_to,
                                    daemonset=daemonset, metrics=metrics)
        server = MirrorServer(service, options, tasks=[*feeds, *work],
                              observe=metrics.call if metrics else None)
    except (SecurityConfigError, ConfigError, SigningConfigError) as e:
        return _fail(str(e))

    # Everything is built before the server starts: once it serves, start-up work (imports,
    # configuration) no longer competes with the first calls.
    stop = threading.Event()
    if publisher is not None:
        # Before the server signs anything, so that nodes can check at once. On a loop of its
        # own: the session it opens is closed here, the server's loop opens its own.
        asyncio.run(first_publish(publisher, kube))
    endpoint = MetricsEndpoint(metrics.registry) if metrics is not None else None
    if endpoint is not None:
        try:
            host, port = endpoint.serve(args.metrics_listen)
        except OSError as e:
            api_client.close()
            return _fail(f"--metrics-listen {args.metrics_listen}: {e.strerror or e}")
        log.info("metrics at http://%s:%d/metrics", host, port)
    try:
        server.start()
    except SecurityConfigError as e:
        if endpoint is not None:
            endpoint.close()
        return _fail(str(e))

    def on_signal(signum, _frame) -> None:
        log.info("%s received: shutting down", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if args.report_gpu_fractioning_config:
        log.info("reporting node agent DaemonSet %s as GpuFractioningConfig default's Ready",
                 "/".join(daemonset))
    if args.follow_bindrequests:
        log.info("following BindRequests (scheduling.run.ai/v1alpha2), reservation pods in "
                 "%s%s%s", args.reservation_namespace,
                 "; signing the pods whose annotations match" if keyring else "",
                 f" while holding lease {election.namespace}/{election.name} as "
                 f"{election.identity}" if election is not None else "")
    try:
        while not stop.wait(1.0):
            pass
    finally:
        server.stop()  # cancels the follower (a leader releases its Lease), then closes kube
        api_client.close()
        if endpoint is not None:
            endpoint.close()
    return 0
