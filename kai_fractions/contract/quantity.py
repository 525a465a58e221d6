"""Kubernetes resource quantities with exact arithmetic (no floats anywhere).

Grammar (k8s.io/apimachinery resource.ParseQuantity):
    quantity       ::= sign? number suffix
    number         ::= digits | digits "." digits? | "." digits
    suffix         ::= binarySI | decimalSI | decimalExponent
    binarySI       ::= Ki | Mi | Gi | Ti | Pi | Ei
    decimalSI      ::= n | u | m | "" | k | M | G | T | P | E
    decimalExponent::= ("e" | "E") sign? digits
Exponent forms (`1e3`, `5E-1`) are valid quantities that KAI reads through ParseQuantity, so they
are accepted here and evaluated exactly; nothing in kai_fractions ever writes one.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from functools import lru_cache

MIB = 1 << 20

_BINARY = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50, "Ei": 1 << 60}
_DECIMAL = {
    "n": Fraction(1, 10**9),
    "u": Fraction(1, 10**6),
    "m": Fraction(1, 1000),
    "": Fraction(1),
    "k": Fraction(10**3),
    "M": Fraction(10**6),
    "G": Fraction(10**9),
    "T": Fraction(10**12),
    "P": Fraction(10**15),
    "E": Fraction(10**18),
}
_UNIT_DECIMAL = frozenset("kMGTPE")
_QUANTITY = re.compile(
    r"(?P<sign>[+-]?)(?P<int>[0-9]*)(?:\.(?P<frac>[0-9]*))?"
    r"(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?[0-9]+|)"
)
# Kubernetes caps the number of digits it will read; anything longer is an error there too.
_MAX_LEN = 64


class QuantityError(ValueError):
    """The string is not a Kubernetes quantity; the message says why."""


# Clusters carry few distinct values ("8Gi", "20Gi", ...): caching the pure parse makes the
# contract's per-pod cost mostly dictionary work (benchmarks/ P4 measures it).
def parse_quantity(text: str) -> Fraction:
    """Parse a quantity exactly; raise QuantityError with the rule it breaks."""
    if not isinstance(text, str):
        raise QuantityError("must be a Kubernetes quantity string")
    return _parse_quantity(text)


@lru_cache(maxsize=4096)
def _parse_quantity(text: str) -> Fraction:
    if text == "":
        raise QuantityError("must be a Kubernetes quantity such as 8Gi or 7680Mi, not blank")
    if len(text) > _MAX_LEN:
        raise QuantityError(f"is longer than {_MAX_LEN} characters")
    m = _QUANTITY.fullmatch(text)
    if not m or (not m["int"] and not m["frac"]):
        raise QuantityError("must be a Kubernetes quantity such as 8Gi, 7680Mi or 1000M")
    digits = (m["int"] or "0") + "." + (m["frac"] or "0")
    number = Fraction(digits)
    if m["sign"] == "-":
        number = -number
    suffix = m["suffix"]
    if suffix in _BINARY:
        return number * _BINARY[suffix]
    if suffix in _DECIMAL:
        return number * _DECIMAL[suffix]
    exponent = int(suffix[1:])
    if abs(exponent) > 100:
        raise QuantityError("has an exponent outside what Kubernetes accepts")
    return number * Fraction(10) ** exponent


def has_unit(text: str) -> bool:
    """True when the quantity carries a unit suffix (binary or decimal SI, not milli/exponent)."""
    m = _QUANTITY.fullmatch(text)
    return m is not None and (m["suffix"] in _BINARY or m["suffix"] in _UNIT_DECIMAL)


def memory_bytes(text: str) -> int:
    """A GPU memory amount: a positive quantity, in bytes rounded up, as `Quantity.Value()`
    rounds it for KAI's node side (`2.3Gi` is 2469606196 bytes: Gi amounts with a decimal
    are rarely whole bytes)."""
    if not isinstance(text, str):
        raise QuantityError("must be a Kubernetes quantity string")
    return _memory_bytes(text)


@lru_cache(maxsize=4096)
def _memory_bytes(text: str) -> int:
    value = _parse_quantity(text)
    if value <= 0:
        raise QuantityError("must be greater than zero")
    return math.ceil(value)


_BINARY_BY_EXPONENT = ("", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei")


def canonical_mib(mib: int) -> str:
    """`<mib>Mi` as Kubernetes prints it (`resource.MustParse("<n>Mi").String()`): the largest
    binary suffix that keeps the number whole, so 20480 MiB is `20Gi` and 1000 MiB `1000Mi`.
    This is the spelling KAI's binder writes; writing the same bytes keeps pods comparable."""
    if mib <= 0:
        raise ValueError(f"a memory amount must be positive, got {mib} MiB")
    exponent = 2
    while mib % 1024 == 0 and exponent < len(_BINARY_BY_EXPONENT) - 1:
        mib //= 1024
        exponent += 1
    return f"{mib}{_BINARY_BY_EXPONENT[exponent]}"


def mib_ceil(n_bytes: int) -> int:
    """Whole MiB, rounding up, at least 1 (the contract's conversion: 1000M -> 954)."""
    return max(1, -(-n_bytes // MIB))
