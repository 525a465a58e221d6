"""Every command's --help as argparse prints it: `help=` strings are %-formatted (so `%%` is
one `%` there), a `description` or `epilog` is printed verbatim, so a `%%` shows as written."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest

from kai_fractions.cli import build_parser


def parsers(parser: argparse.ArgumentParser, name: str = "kai-fractions"
            ) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, subparser in action.choices.items():
                yield from parsers(subparser, f"{name} {sub}")


def test_every_command_is_walked() -> None:
    names = {name for name, _ in parsers(build_parser())}
    assert {"kai-fractions node-agent", "kai-fractions inspect mirror"} <= names


@pytest.mark.parametrize(("name", "parser"), list(parsers(build_parser())),
                         ids=lambda x: x if isinstance(x, str) else "")
def test_no_help_shows_a_doubled_percent_sign(
        name: str, parser: argparse.ArgumentParser, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "10000")
    assert "%%" not in parser.format_help(), name


def test_inspect_mirror_says_five_percent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "10000")
    (parser,) = [p for name, p in parsers(build_parser()) if name == "kai-fractions inspect mirror"]
    assert "over 5% of a replica's API requests" in parser.format_help()


def test_node_agent_says_a_report_watchdog_caps_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "10000")
    (parser,) = [p for name, p in parsers(build_parser()) if name == "kai-fractions node-agent"]
    text = " ".join(parser.format_help().split())
    assert ("a container no enabled tier caps is refused: cgroup needs driver r615+, mps-pinned "
            "caps sm-sharing containers only, and only on an MPS daemon with namespaces (r615+: "
            "before, every tenant can change it), and the watchdog caps on its own only with "
            "--watchdog-policy=kill") in text
    assert "it stops nothing, so it is only a second line beside cgroup or mps-pinned" in text


@pytest.mark.parametrize(("name", "what"), [("node", "the node"), ("pod", "the pod")])
def test_inspect_node_and_pod_say_what_they_show_and_their_exit_codes(
        name: str, what: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "10000")
    (parser,) = [p for n, p in parsers(build_parser()) if n == f"kai-fractions inspect {name}"]
    assert parser.description
    text = " ".join(parser.format_help().split())
    assert (f"Exit codes: 0 the report printed, 1 {what} does not exist, 2 usage error or the "
            "cluster cannot be read.") in text
    assert "--release-namespace NS" in text
    if name == "node":
        assert "NODE the node's name (kubectl get nodes)" in text
    else:
        assert "--namespace NS, -n NS the pod's namespace, as kubectl's -n" in text
        # its default is kubectl's, not `default` alone; and the release's is another flag
        assert ("(default: as kubectl's, the kubeconfig's current context's namespace, in a "
                "pod its own namespace, else default). Not the release's namespace: that is "
                "--release-namespace") in text
        assert "(default: default)" not in text


def test_inspect_mirror_also_takes_release_namespace() -> None:
    args = build_parser().parse_args(["inspect", "mirror", "--release-namespace", "gpu"])
    assert args.namespace == "gpu"
