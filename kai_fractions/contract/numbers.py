"""Decimal numbers of the contract (portions, fractions): read as KAI reads them, written plainly.

KAI reads these with Go's strconv.ParseFloat, so the decimal forms it accepts are accepted here,
exponent forms included (`5e-1`, `5e-0001`: any number of exponent digits, as Go takes them).
Each has two readings: the float64 KAI sees (`parse_float64`: Python's float is an IEEE double,
correctly rounded as ParseFloat rounds), which is what its range and ordering checks compare, so
`0.99999999999999999` is 1 and `1e-400` is 0 here as there; and the exact value
(`parse_decimal`), which the arithmetic uses. Hex floats (`0x1p-1`) are refused on purpose,
although ParseFloat reads them: no KAI manifest needs one, and a decimal says the same. NaN, Inf,
underscores and blanks are refused too. Values are always written as plain decimals, never in
exponent form.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal
from fractions import Fraction
from functools import lru_cache

_DECIMAL = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_HEX = re.compile(r"[+-]?0[xX]")


MAX_NUMBER_LENGTH = 64
"""Characters a contract number may have. Longer values are refused before any conversion:
Python refuses ints of more than 4300 digits with a plain ValueError, and no portion or MiB
count needs more than a few dozen characters. It also bounds the exact value: a number whose
float64 is finite and not 0 is within about 2.5e-324 .. 1.8e308 in magnitude, so with at most
this many digits its exponent is within a few hundred either way, whatever its exponent digits
say (`parse_decimal` builds no exact value for any other)."""

NOT_DECIMAL = "must be a finite decimal number such as 0.5 (no NaN, Inf or hex)"
HEX_REFUSED = ("must be a decimal number such as 0.5: hex floats are refused on purpose, "
               "although Go's strconv.ParseFloat (KAI) reads them")
OUT_OF_RANGE = ("is out of the range of a 64-bit float, as KAI reads it (strconv.ParseFloat "
                "fails on it)")


class NumberError(ValueError):
    """The string is not a decimal number; the message says why."""


def _check_length(text: str) -> None:
    if len(text) > MAX_NUMBER_LENGTH:
        raise NumberError(f"must be at most {MAX_NUMBER_LENGTH} characters long "
                          f"(got {len(text)})")


def parse_float64(text: str) -> float:
    """The float64 KAI reads (strconv.ParseFloat, correctly rounded): what its range and
    ordering checks compare. 0.0 for a number below the smallest float64 (`1e-400`), as Go
    reads it; an overflow is refused, as ParseFloat refuses it."""
    if not isinstance(text, str):
        raise NumberError("must be a decimal number string")
    return _parse_float64(text)


@lru_cache(maxsize=4096)  # pure, and clusters repeat the same few portions
def _parse_float64(text: str) -> float:
    if text.strip() == "":
        raise NumberError("must be a decimal number, not blank")
    _check_length(text)
    if not _DECIMAL.fullmatch(text):
        raise NumberError(HEX_REFUSED if _HEX.match(text) else NOT_DECIMAL)
    value = float(text)  # never slow: no exact value is built for it
    if math.isinf(value):
        raise NumberError(OUT_OF_RANGE)
    return value


def parse_decimal(text: str) -> Fraction:
    """The exact value, for the arithmetic. The float64 is checked first (`parse_float64`): an
    overflow is refused and an underflow is 0, as KAI reads them, before any exact value is
    built, so an exponent such as `1e-99999999` never becomes a huge integer."""
    if not isinstance(text, str):
        raise NumberError("must be a decimal number string")
    return _parse_decimal(text)


@lru_cache(maxsize=4096)  # pure, and clusters repeat the same few portions
def _parse_decimal(text: str) -> Fraction:
    if _parse_float64(text) == 0.0:
        return Fraction(0)  # 0 as written, or below the smallest float64: 0 to KAI as well
    return Fraction(text)


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
