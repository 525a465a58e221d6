"""The schema's rule for `annotationPrefix` is the code's (`Keys`, which every component applies at
start): a prefix the chart renders is one every component accepts, and the other way round, so
a bad prefix fails at `helm install`, not in a crash-looping pod."""

from __future__ import annotations

import json
import re

import pytest

from kai_fractions.contract import Keys

from .render import CHART, render_text, template_error

SCHEMA = json.loads((CHART / "values.schema.json").read_text())["properties"]["annotationPrefix"]

CORPUS = [
    "nvidia.com/container.", "gpu.example.com/c.", "example.com/x_.", "a/b.", "a/.",
    "example.com/.", "example.com/-x.", "example.com/_x.", "example.com/x y.", "example.com/a/b.",
    "example..com/x.", "Example.com/x.", "-example.com/x.", "example-.com/x.", "example.com./x.",
    "example.com/A.b-c_d.", "example.com/" + "a" * 41 + ".", "example.com/" + "a" * 42 + ".",
    ".".join(["a" * 63, "b" * 63, "c" * 63, "d" * 61]) + "/x.",
    ".".join(["a" * 63, "b" * 63, "c" * 63, "d" * 62]) + "/x.",
    "nope", "example.com/x", "/x.",
]


def schema_accepts(value: str) -> bool:
    patterns = [SCHEMA["pattern"], *(part["pattern"] for part in SCHEMA.get("allOf", ()))]
    # The schema's patterns are RE2 (Helm's validator); these use nothing Python reads otherwise.
    return all(re.search(p, value) is not None for p in patterns)


def code_accepts(value: str) -> bool:
    try:
        Keys(prefix=value)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("prefix", CORPUS)
def test_the_schema_and_the_code_agree(prefix: str):
    assert schema_accepts(prefix) == code_accepts(prefix), prefix


@pytest.mark.parametrize("prefix", ["a/.", "example.com/.", "example..com/x.",
                                    "example.com/" + "a" * 42 + "."])
def test_helm_refuses_what_the_code_refuses_naming_the_value(prefix: str):
    err = template_error(f"annotationPrefix={prefix}")
    assert "/annotationPrefix" in err, err


def test_helm_renders_the_longest_name_part():
    prefix = "example.com/" + "a" * 41 + "."
    assert prefix in render_text(sets=(f"annotationPrefix={prefix}",))
