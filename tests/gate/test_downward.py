"""Reading the kubelet's downward-API annotations file (Go %q quoting)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kai_fractions.gate.downward import (
    DownwardError,
    go_unquote,
    parse_annotations,
    read_annotations,
)


def test_a_kubelet_file_is_parsed() -> None:
    text = ('kubernetes.io/config.seen="2025-01-31T12:00:00.000000000Z"\n'
            'nvidia.com/container.main.gpu-memory.request="8Gi"\n'
            'nvidia.com/container.main.gpus.devices="GPU-1,GPU-2"')
    assert parse_annotations(text) == {
        "kubernetes.io/config.seen": "2025-01-31T12:00:00.000000000Z",
        "nvidia.com/container.main.gpu-memory.request": "8Gi",
        "nvidia.com/container.main.gpus.devices": "GPU-1,GPU-2",
    }


@pytest.mark.parametrize(("quoted", "value"), [
    ('""', ""),
    ('"a=b"', "a=b"),
    (r'"say \"hi\""', 'say "hi"'),
    (r'"C:\\path"', "C:\\path"),
    (r'"line1\nline2\ttab\r"', "line1\nline2\ttab\r"),
    (r'"\a\b\f\v"', "\a\b\f\v"),
    ('"caf\u00e9 \u4e2d"', "caf\u00e9 \u4e2d"),  # printable runes stay as they are
    (r'"zero\u200bwidth"', "zero\u200bwidth"),
    (r'"\U0001f600"', "\U0001f600"),
    (r'"\x01\x7f"', "\x01\x7f"),
    (r'"\xc3\xa9"', "\u00e9"),  # bytes that form UTF-8 together
    (r'"\101"', "A"),
    ('"{\\"json\\": [1, 2]}"', '{"json": [1, 2]}'),
])
def test_go_quoted_values_are_unquoted(quoted: str, value: str) -> None:
    assert go_unquote(quoted) == value


@pytest.mark.parametrize(("quoted", "message"), [
    ("plain", "not a double-quoted string"),
    ('"open', "not a double-quoted string"),
    ('"a"b"', "unescaped quote inside the value"),
    ('"\\"', "a backslash ends the value"),
    (r'"\q"', "unknown escape \\q"),
    (r'"\x4"', "bad \\x escape"),
    (r'"\ud800"', "\\ud800 is not a Unicode code point"),
    (r'"\400"', "bad octal escape"),
])
def test_malformed_values_are_refused(quoted: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        go_unquote(quoted)
    assert str(info.value) == message


def test_a_value_with_an_equals_sign_and_a_trailing_newline() -> None:
    assert parse_annotations('a.io/x="k=v"\n') == {"a.io/x": "k=v"}


@pytest.mark.parametrize(("text", "message"), [
    ("no-equals-sign", 'line 1: expected key="value"'),
    ('a="1"\n="2"', 'line 2: expected key="value"'),
    ('a="1"\nb=2', "line 2 (b): not a double-quoted string"),
])
def test_a_malformed_file_names_the_line(text: str, message: str) -> None:
    with pytest.raises(DownwardError) as info:
        parse_annotations(text)
    assert str(info.value) == message


def test_read_annotations(tmp_path: Path) -> None:
    assert read_annotations(str(tmp_path / "missing")) is None
    (tmp_path / "annotations").write_text('a="1"')
    assert read_annotations(str(tmp_path / "annotations")) == {"a": "1"}
    (tmp_path / "annotations").write_text("junk")
    with pytest.raises(DownwardError) as info:
        read_annotations(str(tmp_path / "annotations"))
    assert str(info.value) == f'{tmp_path}/annotations: line 1: expected key="value"'
