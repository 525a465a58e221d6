"""`kai-fractions admission`: the validating and mutating webhooks over HTTPS.

Heavy imports stay inside `run`: the CLI imports every command module to build its parser.
"""

from __future__ import annotations

import argparse
import threading
import time
from typing import TYPE_CHECKING, Any

from ..admission.config import (
    DEFAULT_AGENT_SOCKET_HOST_DIR,
    DEFAULT_ALLOWED_IDENTITIES,
    DEFAULT_KUBELET_ROOT_DIR,
    DEFAULT_MARKER_HOST_DIR,
    DEFAULT_MPS_PIPE_HOST_DIR,
)
from ..contract.keys import NODE_CONDITION
from ..contract.scheduler import DEFAULT_SCHEDULER_NAME
from . import add_log_level, add_metrics_listen, setup_logging

if TYPE_CHECKING:
    from ..admission.config import AdmissionConfig


def register(sub) -> None:
    p = sub.add_parser(
        "admission", help="serve the validating and mutating admission webhooks",
        description="Serve POST /validate and POST /mutate (AdmissionReview v1) and GET "
        "/healthz over HTTPS. The certificate and key are reloaded when they change on disk. "
        "See docs/admission.md for the webhook configuration (failurePolicy, selectors).",
    )
    p.add_argument("--listen", default="0.0.0.0:8443", metavar="ADDR",
                   help="HOST:PORT to listen on (default: %(default)s)")
    p.add_argument("--tls-cert", required=True, metavar="FILE", help="serving certificate")
    p.add_argument("--tls-key", required=True, metavar="FILE", help="its private key")
    p.add_argument("--allowed-identity", action="append", default=None, metavar="NAME",
                   help="a username that may write protected annotation keys (repeatable; "
                   "default: " + ", ".join(DEFAULT_ALLOWED_IDENTITIES) + ")")
    p.add_argument("--gate-image", required=True, metavar="IMAGE",
                   help="image of the gate init container (has `kai-fractions` on its PATH)")
    add_host_dirs(p)
    p.add_argument("--annotation-prefix", default=None, metavar="P",
                   help="per-container key prefix (default: nvidia.com/container.)")
    p.add_argument("--runtime-class", default="", metavar="NAME",
                   help="the RuntimeClass of the NVIDIA runtime, given to fractional pods that "
                   "name none: their container reaches its GPU through that runtime (default: "
                   "none, the node's default runtime)")
    p.add_argument("--scheduler-name", default=DEFAULT_SCHEDULER_NAME, metavar="NAME",
                   help="KAI's scheduler (the chart's mirror.schedulerName): a fractional pod "
                   "of another is admitted with a warning, as it would wait in its gate for "
                   "ever; '' warns of none (default: %(default)s)")
    p.add_argument("--condition-name", default=NODE_CONDITION, metavar="NAME",
                   help="the node condition the node agents publish (their --condition-name, "
                   "the chart's nodeCondition.name): the gate names it where it says the "
                   "agent's reason is, and is passed it when it is not the default (default: "
                   "%(default)s)")
    p.add_argument("--shutdown-delay", type=_seconds, default=5.0, metavar="SECONDS",
                   help="on SIGTERM, go on serving this long with GET /healthz answering 503, "
                   "so that the pod leaves the Service's endpoints while it still answers; then "
                   "stop accepting and finish the reviews in flight (at most 15 s more). A "
                   "second signal skips what is left of the delay (default: %(default)g)")
    add_metrics_listen(p, "reviews by outcome and their latency, refusals by reason, "
                       "connections, the process; docs/admission.md")
    add_log_level(p)
    p.set_defaults(func=run)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 3600:
        raise argparse.ArgumentTypeError(
            f"must be a number of seconds from 0 to 3600, got {text!r}")
    return value


def add_host_dirs(p: argparse.ArgumentParser) -> None:
    """The host directories no pod's hostPath may reach, as the webhook is configured (the
    chart's `hostPaths` and `webhook.kubeletRootDir`); `kai-fractions validate` takes them too."""
    p.add_argument("--marker-host-dir", default=DEFAULT_MARKER_HOST_DIR, metavar="DIR",
                   help="the node agent's marker root on the host (default: %(default)s)")
    p.add_argument("--mps-pipe-host-dir", default=DEFAULT_MPS_PIPE_HOST_DIR, metavar="DIR",
                   help="the node agent's MPS pipe root on the host (default: %(default)s)")
    p.add_argument("--agent-socket-dir", default=DEFAULT_AGENT_SOCKET_HOST_DIR, metavar="DIR",
                   help="the directory of the node agent's socket on the host; no pod's "
                   "hostPath may reach it (default: %(default)s)")
    p.add_argument("--kubelet-root-dir", default=DEFAULT_KUBELET_ROOT_DIR, metavar="DIR",
                   help="the kubelet's --root-dir on the nodes; no pod's hostPath may reach it "
                   "(the kubelet bind-mounts the gate's marker directory and the MPS namespaces "
                   "under it) (default: %(default)s)")


_FLAGS = {"marker_host_dir": "--marker-host-dir", "mps_pipe_host_dir": "--mps-pipe-host-dir",
          "agent_socket_host_dir": "--agent-socket-dir", "kubelet_root_dir": "--kubelet-root-dir",
          "gate_image": "--gate-image", "runtime_class": "--runtime-class",
          "allowed_identities": "--allowed-identity", "condition_name": "--condition-name"}
"""The flag that sets each `AdmissionConfig` field, for its errors."""


def admission_config(args: argparse.Namespace, **fields: Any) -> AdmissionConfig:
    """`AdmissionConfig` from `fields` and the flags of `add_host_dirs`; a ValueError names the
    flag at fault, as a user typed it."""
    from ..admission.config import AdmissionConfig

    try:
        return AdmissionConfig(
            marker_host_dir=args.marker_host_dir, mps_pipe_host_dir=args.mps_pipe_host_dir,
            agent_socket_host_dir=args.agent_socket_dir, kubelet_root_dir=args.kubelet_root_dir,
            **fields)
    except ValueError as e:
        field, said, rule = str(e).partition(": ")
        raise ValueError(f"{_FLAGS.get(field, field)}: {rule}" if said else str(e)) from None


def run(args: argparse.Namespace) -> int:
    import logging
    import signal
    import sys

    from ..admission.server import DRAIN_TIMEOUT, make_server
    from ..admission.tls import ReloadingContext, TLSError
    from ..contract import DEFAULT_KEYS, Keys
    from ..metrics_http import MetricsEndpoint, parse_listen

    setup_logging(args)
    metrics = None
    try:
        try:
            keys = Keys(prefix=args.annotation_prefix) \
                if args.annotation_prefix is not None else DEFAULT_KEYS
        except ValueError as e:  # said as every component says it
            raise ValueError(f"--annotation-prefix: {e}") from None
        config = admission_config(
            args, gate_image=args.gate_image, keys=keys,
            allowed_identities=tuple(args.allowed_identity or DEFAULT_ALLOWED_IDENTITIES),
            runtime_class=args.runtime_class, scheduler_name=args.scheduler_name,
            condition_name=args.condition_name)
        if args.metrics_listen:
            from ..admission.metrics import AdmissionMetrics

            parse_listen(args.metrics_listen)  # names the flag
            metrics = AdmissionMetrics()
        tls = ReloadingContext(args.tls_cert, args.tls_key)
        server = make_server(args.listen, config, tls, metrics)
    except (ValueError, TLSError, OSError) as e:
        print(f"kai-fractions admission: {e}", file=sys.stderr)
        return 2
    # Bound before the webhook serves: a port it cannot have is a usage error, not a replica
    # that serves unseen.
    endpoint, metrics_at = None, ""
    if metrics is not None:
        endpoint = MetricsEndpoint(metrics.registry)
        try:
            metrics_host, metrics_port = endpoint.serve(args.metrics_listen)
            metrics_at = f"http://{metrics_host}:{metrics_port}/metrics"
        except OSError as e:
            server.server_close()
            print(f"kai-fractions admission: --metrics-listen {args.metrics_listen}: "
                  f"{e.strerror or e}", file=sys.stderr)
            return 2
    stop, hurry = threading.Event(), threading.Event()

    def on_signal(*_: Any) -> None:
        (hurry if stop.is_set() else stop).set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    thread = threading.Thread(target=server.serve_forever, name="admission", daemon=True)
    thread.start()
    host, port = server.server_address[:2]
    log = logging.getLogger("kai_fractions.admission")
    log.info("serving /validate, /mutate and /healthz on https://%s:%s", host, port)
    if metrics_at:
        log.info("metrics at %s", metrics_at)
    _wait(stop)
    # The API server keeps sending reviews here until the endpoint is gone: go on answering
    # them (a fail-closed pod would be refused), saying "not ready" meanwhile.
    server.draining = True
    log.info("stopping: serving %g s more with /healthz answering 503, then finishing the "
             "reviews in flight", args.shutdown_delay)
    _wait(hurry, args.shutdown_delay)
    if not server.drain():
        log.warning("stopped with requests still being served after %g s", DRAIN_TIMEOUT)
    else:
        log.info("stopped")
    if endpoint is not None:  # served until the drain ended: a scrape sees it draining
        endpoint.close()
    return 0


def _wait(event: threading.Event, timeout: float | None = None) -> None:
    """Waits until `event` is set or `timeout` passes, in short steps: a signal the kernel gives
    another thread (the serving one) runs its Python handler only once the main thread wakes,
    and a wait without a timeout may never wake (SIGTERM was lost so, under load)."""
    deadline = float("inf") if timeout is None else time.monotonic() + timeout
    while not event.wait(min(0.25, max(0.0, deadline - time.monotonic()))):
        if time.monotonic() >= deadline:
            return
