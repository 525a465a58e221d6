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
            "caps sm-sharing containers only, and the watchdog caps on its own only with "
            "--watchdog-policy=kill") in text
    assert "it stops nothing, so it is only a second line beside cgroup or mps-pinned" in text
