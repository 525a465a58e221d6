"""Read a downward-API `metadata.annotations` file.

The kubelet writes a map as sorted lines `key="value"` joined by newlines (no newline after the
last), the value quoted by Go's `strconv.Quote` (`%q`): `\\"`, `\\\\`, `\\n`, `\\t`, ... for
special characters, `\\xHH` for bytes that are not UTF-8, `\\uHHHH` / `\\UHHHHHHHH` for
non-printable runes. Keys are qualified names, so they hold no `=`, quote or newline, and the
first `=` of a line ends the key.
"""

from __future__ import annotations

_SIMPLE = {"a": 0x07, "b": 0x08, "f": 0x0C, "n": 0x0A, "r": 0x0D, "t": 0x09, "v": 0x0B,
           "\\": 0x5C, '"': 0x22, "'": 0x27}
_HEX = frozenset("0123456789abcdefABCDEF")


class DownwardError(ValueError):
    """The file is not in the kubelet's format: the message names the line."""


def go_unquote(quoted: str) -> str:
    """The string a Go double-quoted literal denotes; raises ValueError when malformed."""
    if len(quoted) < 2 or quoted[0] != '"' or quoted[-1] != '"':
        raise ValueError("not a double-quoted string")
    body = quoted[1:-1]
    out = bytearray()
    i = 0
    while i < len(body):
        ch = body[i]
        if ch == '"':
            raise ValueError("unescaped quote inside the value")
        if ch != "\\":
            out += ch.encode("utf-8", "surrogateescape")
            i += 1
            continue
        if i + 1 >= len(body):
            raise ValueError("a backslash ends the value")
        esc = body[i + 1]
        if esc in _SIMPLE:
            out.append(_SIMPLE[esc])
            i += 2
        elif esc in "xuU":
            width = {"x": 2, "u": 4, "U": 8}[esc]
            digits = body[i + 2 : i + 2 + width]
            if len(digits) != width or not set(digits) <= _HEX:
                raise ValueError(f"bad \\{esc} escape")
            number = int(digits, 16)
            if esc == "x":
                out.append(number)  # a raw byte: Go strings may hold invalid UTF-8
            else:
                if number > 0x10FFFF or 0xD800 <= number <= 0xDFFF:
                    raise ValueError(f"\\{esc}{digits} is not a Unicode code point")
                out += chr(number).encode()
            i += 2 + width
        elif esc in "01234567":
            digits = body[i + 1 : i + 4]
            if len(digits) != 3 or not set(digits) <= set("01234567") or int(digits, 8) > 255:
                raise ValueError("bad octal escape")
            out.append(int(digits, 8))
            i += 4
        else:
            raise ValueError(f"unknown escape \\{esc}")
    # Bytes that are not UTF-8 cannot be in an annotation (the API stores JSON strings);
    # replace rather than fail so one odd value cannot hide every other annotation.
    return out.decode("utf-8", "replace")


def parse_annotations(text: str) -> dict[str, str]:
    """`key="value"` lines -> {key: value}; raises DownwardError naming the bad line."""
    out: dict[str, str] = {}
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        key, eq, quoted = line.partition("=")
        if not eq or not key:
            raise DownwardError(f"line {number}: expected key=\"value\"")
        try:
            out[key] = go_unquote(quoted)
        except ValueError as e:
            raise DownwardError(f"line {number} ({key}): {e}") from None
    return out


def read_annotations(path: str) -> dict[str, str] | None:
    """The annotations in the downward-API file, None while it does not exist yet."""
    try:
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
            text = f.read()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise DownwardError(f"{path}: cannot read: {e.strerror or e}") from None
    try:
        return parse_annotations(text)
    except DownwardError as e:
        raise DownwardError(f"{path}: {e}") from None
