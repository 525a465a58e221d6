"""The image every component runs (no Docker here to build it): the Dockerfile is parsed for its
stages, user and entrypoint, and checked against what the chart and the package expect."""

from __future__ import annotations

import configparser
import json
import re

from .render import REPO, container, one, render

DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), " ".join(rest.split())))
    return out


def stages() -> dict[str, list[tuple[str, str]]]:
    result: dict[str, list[tuple[str, str]]] = {}
    current = None
    for word, rest in instructions():
        if word == "FROM":
            m = re.fullmatch(r"(\S+) AS (\S+)", rest, re.IGNORECASE)
            assert m, f"every stage is named: FROM {rest}"
            current = m.group(2)
            result[current] = [(word, m.group(1))]
        elif current is not None:
            result[current].append((word, rest))
    return result


def test_two_stages_on_python_311_slim():
    args = [rest for word, rest in instructions() if word == "ARG"]
    assert "PYTHON_IMAGE=python:3.11-slim" in args
    s = stages()
    assert list(s) == ["build", "runtime"]
    assert s["build"][0] == ("FROM", "${PYTHON_IMAGE}")
    assert s["runtime"][0] == ("FROM", "${PYTHON_IMAGE}")
    build_runs = [rest for word, rest in s["build"] if word == "RUN"]
    assert any(r.startswith("pip wheel") and "--wheel-dir /wheels ." in r for r in build_runs)
    [install] = [rest for word, rest in s["runtime"] if word == "RUN"]
    assert "--mount=type=bind,from=build,source=/wheels,target=/wheels" in install
    assert "--no-index --find-links=/wheels kai-fractions" in install


def test_runtime_is_non_root_and_runs_the_cli():
    runtime = dict(stages()["runtime"][1:])  # last value of each instruction
    assert runtime["USER"] == "10001:10001"
    assert json.loads(runtime["ENTRYPOINT"]) == ["kai-fractions"]
    assert json.loads(runtime["CMD"]) == ["--help"]
    # the same uid the chart's non-root components run as
    docs = render()
    for name in ("kai-fractions-mirror", "kai-fractions-admission"):
        pod = one(docs, "Deployment", name)["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsUser"] == 10001
    # and the node agent overrides it with root (NVML device management, MPS)
    ds = one(docs, "DaemonSet", "kai-fractions-node-agent")
    assert container(ds, "node-agent")["securityContext"]["runAsUser"] == 0


def test_entrypoint_is_the_package_console_script():
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    scripts = cfg["options.entry_points"]["console_scripts"]
    assert "kai-fractions = kai_fractions.cli:main" in scripts


def test_build_context_is_an_allow_list_that_covers_every_copy():
    patterns = [p.strip() for p in DOCKERIGNORE.read_text().splitlines()
                if p.strip() and not p.startswith("#")]
    assert patterns[0] == "*"  # everything else (.venv, .tools, .git, tests) stays out
    allowed = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    copied = []
    for stage in stages().values():
        for word, rest in stage:
            if word == "COPY" and "--from" not in rest:
                copied += rest.split()[:-1]
    assert copied and set(copied) <= allowed
    for path in copied:
        assert (REPO / path).exists(), path
