"""Decimal numbers of the contract (portions, fractions): read exactly, written plainly.

KAI reads these with Go's strconv.ParseFloat, so the decimal forms it accepts are accepted here,
exponent forms included (`5e-1`), and evaluated exactly. Hex floats, NaN, Inf, underscores and
blanks are rejected. Values are always written as plain decimals, never in exponent form.
"""

from __future__ import annotations

import re
from decimal import Decimal
from fractions import Fraction
from functools import lru_cache

_DECIMAL = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]{1,3})?")


MAX_NUMBER_LENGTH = 64
"""Characters a contract number may have. Longer values are refused before any conversion:
Python refuses ints of more than 4300 digits with a plain ValueError, and no portion or MiB
count needs more than a few dozen characters."""


class NumberError(ValueError):
    """The string is not a decimal number; the message says why."""


def _check_length(text: str) -> None:
    if len(text) > MAX_NUMBER_LENGTH:
        raise NumberError(f"must be at most {MAX_NUMBER_LENGTH} characters long "
                          f"(got {len(text)})")


def parse_decimal(text: str) -> Fraction:
    if not isinstance(text, str):
        raise NumberError("must be a decimal number string")
    return _parse_decimal(text)


@lru_cache(maxsize=4096)  # pure, and clusters repeat the same few portions
def _parse_decimal(text: str) -> Fraction:
    if text.strip() == "":
        raise NumberError("must be a decimal number, not blank")
    _check_length(text)
    if not _DECIMAL.fullmatch(text):
        raise NumberError("must be a finite decimal number such as 0.5 (no NaN, Inf or hex)")
    return Fraction(text)


def at_most(a: Fraction, b: Fraction) -> bool:
    """a <= b by integer cross-multiplication (denominators are positive): the same answer as
    Fraction's own comparison at a fraction of its cost, which parsing pays per pod."""
    return a.numerator * b.denominator <= b.numerator * a.denominator


def after_point(text: str) -> int:
    """Characters after the decimal point as written (`0.123450` has 6, `5e-1` has 0): what
    KAI's 5-decimals rule on portion limits counts (upstream validatePortionLimitDecimalPrecision
    cuts the raw value at its first '.'), trailing zeros and exponents included."""
    return len(text.partition(".")[2])


def format_plain(value: Fraction) -> str:
    """The shortest float64 round-trip form, in plain notation (0.00005, never 5e-05).

    This is what Go's strconv.FormatFloat(x, 'f', -1, 64) prints, so the mirror writes the same
    bytes as KAI's binder for the same portion.
    """
    return _format_plain(value.numerator, value.denominator)


@lru_cache(maxsize=4096)  # keyed by integers: hashing a Fraction costs more than formatting it
def _format_plain(numerator: int, denominator: int) -> str:
    text = format(Decimal(repr(numerator / denominator)), "f")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return text or "0"


def parse_positive_int(text: str, *, plus: bool = False) -> int:
    """A whole number > 0 in decimal digits; `plus` also takes a leading '+', as Go's
    strconv.ParseInt does (and ParseUint does not)."""
    if not isinstance(text, str) or not re.fullmatch(r"\+?[0-9]+" if plus else r"[0-9]+", text):
        raise NumberError("must be a positive whole number")
    _check_length(text)
    value = int(text)
    if value <= 0:
        raise NumberError("must be a positive whole number")
    return value
