"""Every value the chart has is in docs/chart.md's values table (and the table names no value the
chart lacks), with its default where the table gives one plainly; and values typed the way
`helm --set` types them are accepted: an all-digit image tag arrives as an integer, a decimal as
a string."""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from kai_fractions.cli import build_parser

from .render import CHART, REPO, container, one, render, template_error

DOC = (REPO / "docs" / "chart.md").read_text()
VALUES = yaml.safe_load((CHART / "values.yaml").read_text())
SCHEMA = json.loads((CHART / "values.schema.json").read_text())
APP_VERSION = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
COMPONENTS = ("mirror", "nodeAgent", "webhook")


def _values_table() -> list[tuple[list[str], str]]:
    """(the value names of a row, its default cell), for each row of the "## Values" table."""
    section = DOC.split("\n## Values\n", 1)[1]
    table = section[section.index("| value | default | meaning |"):].split("\n\n", 1)[0]
    rows = []
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        names, base = [], ""
        for name in re.findall(r"`([^`]+)`", cells[0]):
            if name.startswith("."):  # `.tag` after `image.repository`: under its parent
                name = base.rsplit(".", 1)[0] + name
            else:
                base = name
            names.append(name)
        rows.append((names, cells[1]))
    return rows


def _generic_keys() -> set[str]:
    """The keys "Each component also has ..." documents for the mirror, the node agent and the
    webhook."""
    sentence = DOC.split("Each component also has", 1)[1].split("\n\n", 1)[0]
    return set(re.findall(r"`([^`]+)`", sentence))


def _leaves(values: dict[str, Any], prefix: str = "") -> Iterator[str]:
    for key, value in values.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            yield from _leaves(value, path + ".")
        else:
            yield path


def _documented() -> set[str]:
    return {name for names, _ in _values_table() for name in names}


def _covered(path: str, documented: set[str]) -> bool:
    parts = path.split(".")
    if parts[0] in COMPONENTS and len(parts) > 1 and parts[1] in _generic_keys():
        return True
    # the value itself, a wildcard over its parent (`hostPaths.*`), or a documented map whose
    # entries are free-form (`nodeAgent.updateStrategy`, `webhook.namespaceSelector`)
    return path in documented or f"{parts[0]}.*" in documented or any(
        ".".join(parts[:i]) in documented for i in range(2, len(parts)))


def test_every_value_is_in_the_table():
    documented = _documented()
    missing = [p for p in _leaves(VALUES) if not _covered(p, documented)]
    assert not missing, f"values.yaml keys missing from docs/chart.md's values table: {missing}"


def test_the_table_names_only_values_the_chart_has():
    def exists(name: str) -> bool:
        node: Any = VALUES
        for part in name.removesuffix(".*").split("."):
            if not isinstance(node, dict) or part not in node:
                return False
            node = node[part]
        return True
    unknown = sorted(n for n in _documented() if not exists(n))
    assert not unknown, f"docs/chart.md's values table names values the chart lacks: {unknown}"


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if value == "":
        return '""'
    return str(value)


def test_plain_defaults_in_the_table_are_the_charts():
    """Where a row gives one backticked default per name (`a` / `b`), each is values.yaml's."""
    checked = 0
    for names, default in _values_table():
        shown = [d.strip() for d in default.split(" / ")]
        if len(shown) != len(names) or not all(re.fullmatch(r"`[^`]*`", d) for d in shown):
            continue
        for name, cell in zip(names, shown, strict=True):
            node: Any = VALUES
            for part in name.split("."):
                node = node[part]
            if isinstance(node, (dict, list)):
                continue
            assert cell.strip("`") == _shown(node), f"{name}: table {cell}, values.yaml {node!r}"
            checked += 1
    assert checked >= 40  # most rows are plain
    # the three the table once lacked
    for name, default in (("mirror.port", "`50051`"), ("webhook.replicas", "`2`")):
        assert ([name], default) in _values_table()
    assert (["mirror.tls.enabled", "mirror.tls.secretName", "mirror.tls.validityDays"],
            "`true` / generated / `3650`") in _values_table()


# -- --set typing -----------------------------------------------------------------------------

def _number_values(schema: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict]]:
    """Every value whose schema takes a (non-integer) number."""
    for key, sub in schema.get("properties", {}).items():
        alternatives = sub.get("anyOf", [sub])
        if any(a.get("type") == "number" for a in alternatives):
            yield f"{path}{key}", sub
        yield from _number_values(sub, f"{path}{key}.")


NUMBER_VALUES = dict(_number_values(SCHEMA))


def test_every_fractional_value_also_takes_the_string_set_makes_of_it():
    assert set(NUMBER_VALUES) == {"watchdog.intervalSeconds",
                                  "gpuFractioningConfig.reportIntervalSeconds",
                                  "nodeAgent.firstListJitterSeconds",
                                  "nodeAgent.mpsDrainBeforeKillSeconds"}
    for name, sub in NUMBER_VALUES.items():
        assert any(a.get("type") == "string" and a.get("pattern")
                   for a in sub.get("anyOf", [])), name


def _flag(args: list[str], flag: str) -> str:
    [value] = [a.split("=", 1)[1] for a in args if a.startswith(f"{flag}=")]
    return value


@pytest.mark.parametrize(("value", "kind", "name", "component", "flag"), [
    ("watchdog.intervalSeconds", "DaemonSet", "kai-fractions-node-agent", "node-agent",
     "--watchdog-interval"),
    ("gpuFractioningConfig.reportIntervalSeconds", "Deployment", "kai-fractions-mirror",
     "mirror", "--report-interval"),
    ("nodeAgent.firstListJitterSeconds", "DaemonSet", "kai-fractions-node-agent", "node-agent",
     "--first-list-jitter"),
    ("nodeAgent.mpsDrainBeforeKillSeconds", "DaemonSet", "kai-fractions-node-agent",
     "node-agent", "--mps-drain-before-kill"),
])
def test_a_decimal_from_set_is_accepted_and_reaches_the_flag(value, kind, name, component, flag):
    """`--set watchdog.intervalSeconds=0.5` hands the schema the string "0.5" (helm types only
    integers, booleans and null): it was refused ("got string, want number")."""
    args = container(one(render(sets=(f"{value}=0.5",)), kind, name), component)["args"]
    assert _flag(args, flag) == "0.5"
    build_parser().parse_args(args)  # the component takes it
    args = container(one(render(sets=(f"{value}=2",)), kind, name), component)["args"]
    assert _flag(args, flag) == "2"


@pytest.mark.parametrize("text", ["fast", "0.5s", "-1", "1e3", " 1", ".", "1."])
def test_a_string_that_is_no_plain_decimal_is_still_refused(text: str):
    error = template_error(set_string=[f"watchdog.intervalSeconds={text}"])
    assert "/watchdog/intervalSeconds" in error and "does not match pattern" in error


def test_the_lower_bounds_hold_for_strings_too():
    for text in ("0", "0.0", "00.000"):
        error = template_error(set_string=[f"watchdog.intervalSeconds={text}"])
        assert "/watchdog/intervalSeconds" in error, text
    assert "/watchdog/intervalSeconds" in template_error("watchdog.intervalSeconds=0")
    # 0 turns the drain off, and a jitter of 0 waits not at all: both allowed
    args = container(one(render(sets=(), image=True), "DaemonSet", "kai-fractions-node-agent"),
                     "node-agent")["args"]
    assert args  # the default renders
    render_args = render(sets=("nodeAgent.mpsDrainBeforeKillSeconds=0",
                               "nodeAgent.firstListJitterSeconds=0"))
    agent = container(one(render_args, "DaemonSet", "kai-fractions-node-agent"), "node-agent")
    assert _flag(agent["args"], "--first-list-jitter") == "0"


def _images(docs: list[dict]) -> set[str]:
    images = {c["image"] for d in docs if d["kind"] in ("Deployment", "DaemonSet")
              for c in d["spec"]["template"]["spec"]["containers"]}
    gate = _flag(container(one(docs, "Deployment", "kai-fractions-admission"),
                           "admission")["args"], "--gate-image")
    return images | {gate}


def test_an_all_digit_image_tag_is_accepted_as_set_types_it(tmp_path):
    """`--set image.tag=20240101` types the tag as an integer (schema: "got number, want
    string"); a values file's `tag: 20240101` reaches the template as a float. Either is the
    tag's text, in every image the chart renders (the gate's too)."""
    from .render import TEST_IMAGE
    assert _images(render(sets=("image.tag=20240101",))) == {f"{TEST_IMAGE}:20240101"}
    values = tmp_path / "tag.yaml"
    values.write_text("image:\n  tag: 20240101\n")
    assert _images(render(values)) == {f"{TEST_IMAGE}:20240101"}
    # a leading zero keeps --set's string (helm never types 0100 as a number)
    assert _images(render(sets=("image.tag=0100",))) == {f"{TEST_IMAGE}:0100"}
    error = template_error("image.tag=-1")
    assert "/image/tag" in error


@pytest.mark.parametrize("tag", ["0.1.0:extra", "v1 2", ".hidden", "-x", "a" * 129,
                                 "sha256:abc", "sha256:" + "AB" * 32])
def test_an_image_tag_that_is_no_oci_tag_or_digest_is_refused(tag: str):
    """image.tag is rendered into every image reference and the gate image of every fractional
    pod: one that is no OCI tag (nor sha256:<64 hex>, which pins by digest) would make every
    pod unpullable, or name another image, so the schema refuses it."""
    error = template_error(set_string=(f"image.tag={tag}",))
    assert "/image/tag" in error and "does not match pattern" in error


@pytest.mark.parametrize("tag", ["", "v1.2.3_rc-1", "_x", "a" * 128, "sha256:" + "ab" * 32])
def test_oci_tags_and_digests_are_accepted(tag: str):
    from .render import TEST_IMAGE
    joiner = "@" if tag.startswith("sha256:") else ":"
    assert _images(render(sets=(f"image.tag={tag}",))) == {
        f"{TEST_IMAGE}{joiner}{tag or APP_VERSION}"}


def test_set_commands_in_the_docs_render_as_written():
    """The forms the docs suggest with --set render (no schema refusal)."""
    for command in ("--set image.tag=20240101", "--set watchdog.intervalSeconds=0.5"):
        sets = tuple(shlex.split(command)[1::2])
        assert render(sets=sets)
