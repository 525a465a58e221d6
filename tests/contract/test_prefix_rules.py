"""The per-container prefix must make valid annotation keys: the part before '/' a DNS subdomain
(at most 253), the part after it a qualified name that, with a container name and the longest
suffix appended, stays within 63 characters. `Keys` refuses any other prefix with one line that
names the value and the rule; every component takes its prefix through `Keys`."""

from __future__ import annotations

import re

import pytest

from kai_fractions.contract import Keys
from kai_fractions.contract import keys as k

# Kubernetes' own rules for an annotation key (apimachinery IsQualifiedName), typed here.
_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def is_annotation_key(key: str) -> bool:
    prefix, _, name = key.rpartition("/")
    return ((not prefix or (len(prefix) <= 253 and _SUBDOMAIN.fullmatch(prefix) is not None))
            and len(name) <= 63 and _NAME.fullmatch(name) is not None)


LONGEST_NAME_PART = 42  # 63 - ".gpu-compute.portion" (20) - a one-character container

ACCEPTED = ["nvidia.com/container.", "gpu.example.com/c.", "example.com/x_.", "a/b.",
            "example.com/A.b-c_d.", "example.com/" + "a" * (LONGEST_NAME_PART - 1) + ".",
            ".".join(["a" * 63, "b" * 63, "c" * 63, "d" * 61]) + "/x."]


@pytest.mark.parametrize("prefix", ACCEPTED)
def test_an_accepted_prefix_makes_valid_keys_for_every_suffix(prefix: str):
    keys = Keys(prefix=prefix)
    for suffix in k.SUFFIXES:
        assert is_annotation_key(keys.container("c", suffix)), (prefix, suffix)


def test_the_project_prefix_makes_valid_keys_for_every_suffix():
    keys = Keys()
    for suffix in k.PROJECT_SUFFIXES:
        assert is_annotation_key(keys.derived("c", suffix)), suffix


@pytest.mark.parametrize(("prefix", "rule"), [
    ("a/.", "the part after '/' must start with a letter or digit and hold only letters, "
     "digits, '-', '_' and '.' (an annotation key's name)"),
    ("example.com/.", "the part after '/' must start with a letter or digit"),
    ("example.com/-x.", "the part after '/' must start with a letter or digit"),
    ("example.com/x y.", "the part after '/' must start with a letter or digit"),
    ("example.com/a/b.", "the part after '/' must start with a letter or digit"),
    ("example..com/x.", "the part before '/' must be a DNS subdomain (lower-case letters, "
     "digits, '-' and '.'; each dot-separated part starts and ends with a letter or digit; at "
     "most 253 characters)"),
    ("Example.com/x.", "the part before '/' must be a DNS subdomain"),
    ("-example.com/x.", "the part before '/' must be a DNS subdomain"),
    ("example-.com/x.", "the part before '/' must be a DNS subdomain"),
    ("a" * 254 + "/x.", "the part before '/' must be a DNS subdomain"),
    ("example.com/" + "a" * LONGEST_NAME_PART + ".", "the part after '/' is 43 characters, and "
     "a container name and a suffix of up to 20 ('.gpu-compute.portion') are appended to it in "
     "an annotation key whose name holds at most 63: it may be at most 42 characters"),
])
def test_a_prefix_that_cannot_make_a_valid_key_is_refused_naming_the_rule(prefix: str,
                                                                          rule: str):
    with pytest.raises(ValueError) as e:
        Keys(prefix=prefix)
    assert str(e.value).startswith(f"prefix {prefix!r}: {rule}"), str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("prefix", ["", "nope", "example.com/x", "example.com."])
def test_the_shape_is_still_checked_first(prefix: str):
    with pytest.raises(ValueError, match=re.escape("must look like 'example.com/container.'")):
        Keys(prefix=prefix)
