"""`kai-fractions <command>`: one entry point; each command lives in its own module.

A command module exposes `register(subparsers)`, which adds its parser and sets `func` to a
callable taking the parsed args and returning the exit code. Exit codes across commands:
0 success, 1 the command's own failure (a contract error, a refusal, not found, a failed demo
step: each command's help says which), 2 usage or unreadable input, 130 interrupted.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from .. import __version__

# Add a line here to plug in a command; modules are imported only to build the parser.
_COMMAND_MODULES = (
    "kai_fractions.cli.validate",
    "kai_fractions.cli.plan",
    "kai_fractions.cli.mirror",
    "kai_fractions.cli.admission",
    "kai_fractions.cli.gate",
    "kai_fractions.cli.node_agent",
    "kai_fractions.cli.inspect",
    "kai_fractions.cli.demo",
    "kai_fractions.cli.signing_keys",
    "kai_fractions.cli.retire_nodes",
)

EXIT_OK, EXIT_CONTRACT, EXIT_USAGE = 0, 1, 2


def add_log_level(parser: argparse.ArgumentParser) -> None:
    """`--log-level` for the long-running services (mirror, node agent, admission)."""
    parser.add_argument("--log-level", default="info",
                        choices=("debug", "info", "warning", "error"),
                        help="(default: %(default)s)")


def add_metrics_listen(parser: argparse.ArgumentParser, exports: str) -> None:
    """`--metrics-listen` for the mirror and the admission server (off by default); `exports`
    says what they export and where the docs list it."""
    parser.add_argument("--metrics-listen", default="", metavar="ADDR",
                        help="serve Prometheus metrics at http://ADDR/metrics, ADDR being "
                        f"HOST:PORT ({exports}). Default: off")


def setup_logging(args: argparse.Namespace) -> None:
    """One log format for every service, on stderr, at `--log-level`."""
    import logging

    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's own errors: one line, exit 2, no traceback
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kai-fractions",
        description="Enforce KAI Scheduler NvFractions GPU shares: validate and plan manifests, "
        "run the allocation mirror, the node agent, the admission webhook and the gate.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="<command>", parser_class=_Parser)
    for name in _COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    parser.set_defaults(_commands=sub.choices)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["gate"]:
        # Before the commands' imports (about 0.1 s): no process may attach to the gate while
        # it starts (kai_fractions.undumpable).
        from ..undumpable import undumpable_once

        undumpable_once()
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # A flag the command does not know: that command's usage, not the top-level one.
        command = getattr(args, "_commands", {}).get(getattr(args, "command", None), parser)
        command.error(f"unrecognized arguments: {' '.join(unknown)}")
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
