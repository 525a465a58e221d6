"""`kai-fractions demo`: the whole flow on one machine, with no GPU, cluster or Docker.

An embedded Kubernetes API (kmock, the `demo` extra), the real mirror gRPC server, the admission
webhooks' logic, the real node agent on a simulated node (simulated GPUs at the NVML seam), the
real gate; the example pods go through all of it and a table per GPU shows what is enforced.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED, EXIT_TERMINATED = 0, 1, 2, 130, 143
_DEMO_MODULES = {"kmock", "aiohttp", "attrs", "jsonpatch", "jsonpointer", "yarl"}


def register(sub) -> None:
    p = sub.add_parser(
        "demo", help="run the whole system on simulated GPUs and show what it enforces",
        description="Start an embedded Kubernetes API (kmock), the AllocationMirror gRPC "
        "server, the admission webhooks' logic and the node agent on a simulated node "
        "(default: demo-node with 2 x H100 80GB, simulated at the NVML seam); create the pods "
        "of examples/, schedule them (PreviewAllocation, MirrorAllocation, bind), run their "
        "gates, and print a table per GPU: request, limit, compute mode, active-thread "
        "percentage, used memory, state and the memory tier that holds each cap. Then let one "
        "container ask for more than its cap (a hard tier refuses it, or the watchdog catches "
        "it) and show one manifest admission refuses. With --keep, also create a Pending pod "
        "and print the commands for a first MirrorAllocation on it. Progress goes to stderr, "
        "the results to stdout. Needs the demo extra: pip install 'kai-fractions[demo]'. Exit "
        "codes: 0 done (with --keep: stopped by Ctrl-C or SIGTERM), 1 a step of the demo "
        "failed, 2 usage error, bad --config, a bad example manifest or the extra is missing, "
        "130 interrupted (Ctrl-C) before the end, 143 terminated (SIGTERM) before the end; "
        "either way everything it started is stopped and its temp directory removed.",
    )
    p.add_argument("--config", metavar="FILE",
                   help="YAML settings of the simulated node: node, gpus (model/count), "
                   "driver_version, sm_sharing, memory_enforcement, watchdog_policy, "
                   "reserve_mib, namespace, examples (see kai_fractions/demo/config.py)")
    p.add_argument("--keep", action="store_true",
                   help="keep everything running afterwards and print the endpoints (API URL, "
                   "kubeconfig, mirror address, agent socket, metrics URL), commands to try and "
                   "a first MirrorAllocation to paste, until Ctrl-C")
    p.add_argument("--verbose", "-v", action="store_true",
                   help="also log the components' own messages (info level) to stderr")
    p.set_defaults(func=run)


class Terminated(BaseException):
    """SIGTERM before the end: unwinds the run like Ctrl-C's KeyboardInterrupt, through the
    same cleanup (a BaseException, so no `except Exception` on the way stops it)."""


class _Signals:
    """Handlers that raise Terminated / KeyboardInterrupt and also remember the signal: a
    library may catch what a handler raises and raise its own error instead (the kubernetes
    client's pydantic builds its validators on first use, and wraps anything raised meanwhile
    in a SchemaError), and the exit code must still say the run was stopped, not failed."""

    def __init__(self) -> None:
        self.received: int | None = None

    def on_sigterm(self, signum, _frame) -> None:
        # Once: a second SIGTERM must not cut the cleanup short (stop() has its own timeouts).
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        self.received = signal.SIGTERM
        raise Terminated

    def on_sigint(self, signum, _frame) -> None:
        self.received = self.received or signal.SIGINT
        raise KeyboardInterrupt


def progress_writer(started: float, stream):
    """`progress(line)`: one timed line on `stream`, in ONE write. SIGTERM's handler raises
    between bytecodes: `print` writes the text and the newline apart, so a signal between them
    left a line without its end, and the run's last message glued to it."""
    def progress(line: str) -> None:
        stream.write(f"[demo {time.monotonic() - started:5.2f}s] {line}\n")
        stream.flush()

    return progress


def _fail(message: str, code: int = EXIT_USAGE) -> int:
    print(f"kai-fractions demo: {message}", file=sys.stderr)
    return code


def _missing_extra() -> str | None:
    try:
        import kmock  # noqa: F401
    except ImportError as e:
        name = (getattr(e, "name", None) or "kmock").split(".")[0]
        return name if name in _DEMO_MODULES else None
    return None


def _keep_running(session, call, out) -> None:
    from ..demo.first_call import END, Tools, render

    e = session.endpoints
    node = session.config.node
    tools = Tools.here()
    node_state = (f"  {tools.grpcurl} -plaintext -unix -import-path {tools.protos} -proto "
                  f"kai_fractions/v1/node.proto {e.agent_socket} "
                  "kai_fractions.v1.NodeEnforcer/GetNodeState\n" if tools.protos else "")
    out.write(
        "\nThe demo keeps running; Ctrl-C stops it.\n"
        f"  api             {e.api_url}\n"
        f"  kubeconfig      {e.kubeconfig}\n"
        f"  mirror          {e.mirror}\n"
        f"  agent           {e.agent_socket}\n"
        f"  metrics         {e.metrics_url}\n"
        f"  mirror-metrics  {e.mirror_metrics_url}\n"
        "Try (from any directory):\n"
        f"  {tools.cli} inspect node {node} --kubeconfig {e.kubeconfig} "
        f"--agent-socket {e.agent_socket}\n"
        f"  {tools.cli} inspect mirror {e.mirror_metrics_url}\n"
        f"  {tools.grpcurl} -plaintext {e.mirror} list\n"
        f"{node_state}"
        f"  curl -s {e.api_url}/api/v1/namespaces/{session.config.namespace}/pods\n"
        f"  curl -s {e.api_url}/api/v1/nodes/{node}\n"
        f"  curl -s {e.metrics_url}\n"
        f"  curl -s {e.mirror_metrics_url}\n")
    out.write(render(call, e.mirror, str(e.kubeconfig), str(e.agent_socket), tools))
    out.write(f"\n{END}\n")
    out.flush()
    stop = threading.Event()

    def on_signal(signum, _frame) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stop.wait(0.5):
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run(args: argparse.Namespace) -> int:
    missing = _missing_extra()
    if missing is not None:
        return _fail(f"needs the demo extra ({missing} is not installed): "
                     "pip install 'kai-fractions[demo]'")
    from ..demo.config import DemoConfigError, load_config
    from ..demo.scenario import Scenario
    from ..demo.session import DemoSession
    from ..demo.workloads import WorkloadError, load_examples

    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = load_config(args.config)
    except DemoConfigError as e:
        return _fail(f"--config {e}")
    try:  # before anything starts: a bad manifest costs nothing
        examples = load_examples(config.examples, config.namespace)
    except WorkloadError as e:
        return _fail(str(e))
    progress = progress_writer(time.monotonic(), sys.stderr)

    # SIGTERM ends the run as Ctrl-C does, through the cleanup below (--keep's wait installs
    # its own handlers and puts these back). Python allows handlers in the main thread only.
    main = threading.current_thread() is threading.main_thread()
    signals = _Signals()
    previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, signals.on_sigterm)} if main else {}
    if main and signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not if ignored
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, signals.on_sigint)
    session = None
    try:
        session = DemoSession(config, progress=progress)
        session.start()
        scenario = Scenario(session, sys.stdout, progress)
        scenario.run(examples)
        if args.keep:
            _keep_running(session, scenario.first_call(), sys.stdout)
    except (Exception, KeyboardInterrupt, Terminated) as e:
        code = _exit_code(e, signals.received, args.verbose)
    else:
        code = EXIT_OK
    finally:
        if main:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the cleanup runs to its end
        if session is not None:
            progress("stopping")
            session.stop()
            progress("stopped")
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
    return code


def _exit_code(error: BaseException, received: int | None, verbose: bool) -> int:
    """The run's exit code and its one line on stderr, from what stopped it: a signal first,
    whatever a library made of what its handler raised."""
    from ..demo.scenario import DemoFailure
    from ..demo.workloads import WorkloadError

    if received == signal.SIGTERM or isinstance(error, Terminated):
        return _fail("terminated (SIGTERM) before the end", EXIT_TERMINATED)
    if received == signal.SIGINT or isinstance(error, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    if isinstance(error, WorkloadError):
        return _fail(str(error))
    if isinstance(error, DemoFailure):
        return _fail(str(error), EXIT_FAILED)
    # One line for a user; the trace with --verbose.
    logging.getLogger(__name__).debug("the demo failed", exc_info=error)
    if verbose:
        logging.getLogger(__name__).error("the demo failed", exc_info=error)
    return _fail(f"{type(error).__name__}: {error}", EXIT_FAILED)
