"""Kubernetes quantities and contract decimals: exact values, MiB rounding, rejections."""

from __future__ import annotations

from fractions import Fraction

import pytest

from kai_fractions.contract import (
    MIB,
    NumberError,
    QuantityError,
    format_plain,
    memory_bytes,
    mib_ceil,
    parse_decimal,
    parse_quantity,
)

KI, MI, GI, TI, PI, EI = (1 << 10), (1 << 20), (1 << 30), (1 << 40), (1 << 50), (1 << 60)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # binary SI
        ("1Ki", KI),
        ("8Gi", 8 * GI),
        ("7680Mi", 7680 * MI),
        ("2Ti", 2 * TI),
        ("1Pi", PI),
        ("1Ei", EI),
        # decimal SI
        ("1", 1),
        ("1k", 1000),
        ("1000M", 1_000_000_000),
        ("3G", 3 * 10**9),
        ("1T", 10**12),
        ("1P", 10**15),
        ("2E", 2 * 10**18),
        # milli
        ("1500m", Fraction(3, 2)),
        ("500m", Fraction(1, 2)),
        ("1.5m", Fraction(3, 2000)),
        # exponent forms, as resource.ParseQuantity reads them
        ("1e3", 1000),
        ("1E3", 1000),
        ("1e+3", 1000),
        ("1.5e3", 1500),
        ("5E-1", Fraction(1, 2)),
        ("5e-1", Fraction(1, 2)),
        ("12e0", 12),
        # signs
        ("+1Ki", KI),
        ("-1Ki", -KI),
        ("-0", 0),
        # partial decimals
        (".5Gi", GI // 2),
        ("1.", 1),
        ("1.Mi", MI),
        ("0.5Mi", MI // 2),
        ("1.25Ki", 1280),
    ],
)
def test_parse_quantity_exact(text: str, expected: int | Fraction) -> None:
    value = parse_quantity(text)
    assert isinstance(value, Fraction)
    assert value == expected


def test_parse_quantity_integers_are_exact_beyond_float_precision() -> None:
    # 2**53 + 1 is not a float; the parser must not go through one.
    assert parse_quantity("9007199254740993") == 9007199254740993
    assert parse_quantity("8191.999999999999999Mi") == Fraction("8191.999999999999999") * MI


@pytest.mark.parametrize(
    "text",
    ["", " ", "Gi", ".", "1 Gi", " 1Gi", "1Gi ", "1gi", "1KI", "1Kb", "1MiB", "0x10", "1_000",
     "NaN", "Inf", "+Inf", "-Inf", "1e", "e3", "1e3.5", "1.2.3", "--1", "+-1", "1Mi\n", "\uff11"],
)
def test_parse_quantity_rejects(text: str) -> None:
    with pytest.raises(QuantityError):
        parse_quantity(text)


def test_parse_quantity_blank_message() -> None:
    with pytest.raises(QuantityError, match="not blank"):
        parse_quantity("")


def test_parse_quantity_rejects_non_strings() -> None:
    with pytest.raises(QuantityError):
        parse_quantity(None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("n_bytes", "mib"),
    [
        (1000 * MI, 1000),
        (1_000_000_000, 954),
        (1, 1),
        (MI, 1),
        (MI + 1, 2),
        (2 * MI - 1, 2),
        (0, 1),
        (8 * GI, 8192),
    ],
)
def test_mib_ceil(n_bytes: int, mib: int) -> None:
    assert mib_ceil(n_bytes) == mib


def test_mib_ceil_of_worked_quantities() -> None:
    assert mib_ceil(memory_bytes("1000Mi")) == 1000
    assert mib_ceil(memory_bytes("1000M")) == 954
    assert mib_ceil(memory_bytes("1")) == 1
    assert MIB == 1 << 20


@pytest.mark.parametrize(
    ("text", "expected"),
    [("1000Mi", 1000 * MI), ("1000M", 10**9), ("1e3", 1000), ("1500m", 2), ("500m", 1),
     ("1", 1), ("2000m", 2), (".5Ki", 512), ("2.3Gi", 2469606196), ("1.2Gi", 1288490189),
     # nano and micro: suffixes ParseQuantity knows (apimachinery resource/suffix.go)
     ("8589934592000000u", 8 << 30), ("1000000000n", 1), ("1500000001n", 2)],
)
def test_memory_bytes_rounds_up_to_whole_bytes(text: str, expected: int) -> None:
    """As Kubernetes' `Quantity.Value()` (rounded up), which KAI's node side takes before it
    rounds up to whole MiB (kai-scheduler/kai-gpu-fractioning,
    fractioning-manager/fractiond/internal/annotations/annotations.go, quantityToMemoryMiB);
    KAI's admission accepts any positive quantity (kai-scheduler/api,
    utilities/resources/gpu_sharing_nvfractions.go, parseNvFractionsAnnotationValue)."""
    value = memory_bytes(text)
    assert type(value) is int
    assert value == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0", "must be greater than zero"),
        ("0Mi", "must be greater than zero"),
        ("-1", "must be greater than zero"),
        ("-1Gi", "must be greater than zero"),
        ("", "must be a Kubernetes quantity such as 8Gi or 7680Mi, not blank"),
        (" ", "must be a Kubernetes quantity such as 8Gi, 7680Mi or 1000M"),
        ("NaN", "must be a Kubernetes quantity such as 8Gi, 7680Mi or 1000M"),
        ("Inf", "must be a Kubernetes quantity such as 8Gi, 7680Mi or 1000M"),
        ("eight gigs", "must be a Kubernetes quantity such as 8Gi, 7680Mi or 1000M"),
    ],
)
def test_memory_bytes_rejects_with_message(text: str, message: str) -> None:
    with pytest.raises(QuantityError) as info:
        memory_bytes(text)
    assert str(info.value) == message


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0.5", Fraction(1, 2)),
        (".5", Fraction(1, 2)),
        ("5.", 5),
        ("1", 1),
        ("0.00005", Fraction(5, 100000)),
        ("5e-1", Fraction(1, 2)),
        ("5E-1", Fraction(1, 2)),
        ("+0.25", Fraction(1, 4)),
        ("-1", -1),
        ("50", 50),
        ("0.1", Fraction(1, 10)),  # exactly one tenth, not the float nearest to it
    ],
)
def test_parse_decimal_exact(text: str, expected: Fraction | int) -> None:
    assert parse_decimal(text) == expected


@pytest.mark.parametrize(
    "text", ["", " ", "NaN", "nan", "Inf", "+Inf", "-inf", "infinity", "0x1p-1", "1_0", "1/2",
             "0.5 ", " 0.5", "half", "1e", "e1", "0.5\n", "\u0660.\u0665"],
)
def test_parse_decimal_rejects(text: str) -> None:
    with pytest.raises(NumberError):
        parse_decimal(text)


@pytest.mark.parametrize(("text", "expected"), [
    ("5e-0001", Fraction(1, 2)),  # any number of exponent digits, as Go's ParseFloat takes
    ("1e+0000000000000000000000000000000000000000000000000000000003", 1000),
    ("1e-400", 0),  # below the smallest float64: 0, as ParseFloat reads it
    ("1e-99999999", 0),  # ... never built as an exact value
    ("0e99999999", 0),
    ("5e-324", Fraction(5, 10**324)),  # the smallest float64 is not 0: kept exactly
])
def test_parse_decimal_reads_exponents_as_go_does(text: str, expected: Fraction | int) -> None:
    """kai-scheduler/api utilities/resources/gpu_sharing.go reads portions with
    strconv.ParseFloat(value, 64)."""
    assert parse_decimal(text) == expected


@pytest.mark.parametrize("text", ["1e309", "1e99999999", "-1e400", "1" * 40 + "e" + "9" * 20])
def test_parse_decimal_refuses_what_float64_overflows(text: str) -> None:
    with pytest.raises(NumberError) as info:
        parse_decimal(text)
    assert str(info.value).startswith("is out of the range of a 64-bit float")


def test_parse_decimal_says_hex_is_refused_on_purpose() -> None:
    with pytest.raises(NumberError) as info:
        parse_decimal("0x1p-1")
    assert "refused on purpose" in str(info.value)


def test_parse_decimal_messages() -> None:
    with pytest.raises(NumberError) as blank:
        parse_decimal("")
    assert str(blank.value) == "must be a decimal number, not blank"
    with pytest.raises(NumberError) as nan:
        parse_decimal("NaN")
    assert str(nan.value) == "must be a finite decimal number such as 0.5 (no NaN, Inf or hex)"


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (Fraction(1, 2), "0.5"),
        (Fraction(5, 100000), "0.00005"),
        (Fraction(1, 10**7), "0.0000001"),
        (Fraction(1), "1"),
        (Fraction(1, 3), "0.3333333333333333"),
        (Fraction(1, 100), "0.01"),
        (Fraction(488, 976), "0.5"),
        (Fraction(10**20), "100000000000000000000"),
    ],
)
def test_format_plain_never_uses_an_exponent(value: Fraction, text: str) -> None:
    assert format_plain(value) == text
