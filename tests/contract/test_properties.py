"""Property tests (hypothesis) over the quantity parser, decimals and the annotation parser.

Budgets are modest so the whole file runs in a few seconds on two cores.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kai_fractions.contract import (
    BindDecision,
    ComputeMode,
    ContractError,
    ContractViolation,
    NumberError,
    PodRequest,
    QuantityError,
    binder_annotations,
    derived_annotations,
    env_sources,
    format_plain,
    memory_bytes,
    mib_ceil,
    parse_decimal,
    parse_pod,
    parse_quantity,
    plan_pod,
)
from kai_fractions.contract.numbers import MAX_NUMBER_LENGTH

from .builders import bind, pod

FAST = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
MIB = 1 << 20
MULTIPLIERS = {
    "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50, "Ei": 1 << 60,
    "m": Fraction(1, 1000), "": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
    "P": 10**15, "E": 10**18,
}
QUANTITY_ALPHABET = "0123456789.+-eEKMGTPEimk \n_xNaInf"
quantity_like = st.one_of(
    st.text(),
    st.text(alphabet=QUANTITY_ALPHABET, max_size=12),
    st.builds(lambda n, s: f"{n}{s}", st.integers(-(10**6), 10**6),
              st.sampled_from([*MULTIPLIERS, "e3", "E-1", "e", "i", "Mb", "e+99", "e101"])),
)
decimal_like = st.one_of(
    st.text(),
    st.text(alphabet="0123456789.+-eE _xpnaNIfy", max_size=14),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.floats().map(str),
)


# -- quantities and decimals ----------------------------------------------------------------


@FAST
@given(quantity_like)
def test_parse_quantity_raises_only_quantity_error(text: str) -> None:
    try:
        value = parse_quantity(text)
    except QuantityError as e:
        assert str(e)
    else:
        assert isinstance(value, Fraction)


@FAST
@given(quantity_like)
def test_memory_bytes_is_a_positive_int_or_quantity_error(text: str) -> None:
    try:
        value = memory_bytes(text)
    except QuantityError as e:
        assert str(e)
    else:
        assert type(value) is int and value > 0
        assert value - 1 < parse_quantity(text) <= value  # rounded up to whole bytes


@FAST
@given(st.integers(0, 10**12), st.sampled_from(sorted(MULTIPLIERS)),
       st.sampled_from(["", "+", "-"]))
def test_parse_quantity_round_trips_canonical_forms(n: int, suffix: str, sign: str) -> None:
    expected = n * MULTIPLIERS[suffix] * (-1 if sign == "-" else 1)
    assert parse_quantity(f"{sign}{n}{suffix}") == expected


@FAST
@given(st.integers(0, 10**6), st.integers(0, 10**6), st.sampled_from(sorted(MULTIPLIERS)))
def test_parse_quantity_round_trips_decimal_forms(whole: int, frac: int, suffix: str) -> None:
    text = f"{whole}.{frac}"
    assert parse_quantity(f"{text}{suffix}") == Fraction(text) * MULTIPLIERS[suffix]


@FAST
@given(st.integers(0, 10**6), st.integers(-30, 30), st.sampled_from(["e", "E"]))
def test_parse_quantity_exponent_forms_are_exact(n: int, exp: int, e: str) -> None:
    assert parse_quantity(f"{n}{e}{exp}") == n * Fraction(10) ** exp


@FAST
@given(st.integers(1, 10**15))
def test_mib_ceil_rounds_up(n_bytes: int) -> None:
    mib = mib_ceil(n_bytes)
    assert mib >= 1
    assert mib * MIB >= n_bytes > (mib - 1) * MIB


@FAST
@given(decimal_like)
def test_parse_decimal_raises_only_number_error(text: str) -> None:
    try:
        value = parse_decimal(text)
    except NumberError as e:
        assert str(e)
    else:
        assert isinstance(value, Fraction)


@FAST
@given(st.from_regex(r"[+-]?[0-9]{1,20}(\.[0-9]{0,20})?", fullmatch=True),
       st.integers(-(10**30), 10**30), st.sampled_from(["e", "E"]))
def test_parse_decimal_bounds_every_exponent(mantissa: str, exponent: int, e: str) -> None:
    """Any number of exponent digits is read (as Go's ParseFloat reads them), but no value
    that passes has an exponent beyond float64's range, so the exact value stays small."""
    text = f"{mantissa}{e}{exponent}"
    try:
        value = parse_decimal(text)
    except NumberError as err:
        assert str(err)
        return
    assert value.numerator.bit_length() < 2000 and value.denominator.bit_length() < 2000
    assert float(value) == float(text)


@FAST
@given(st.one_of(
    st.floats(min_value=0, max_value=1e6, allow_nan=False, allow_infinity=False).map(Fraction),
    st.fractions(min_value=0, max_value=1, max_denominator=10**9),
    st.decimals(min_value=0, max_value=1, places=5, allow_nan=False).map(Fraction),
))
def test_format_plain_is_plain_and_parses_back(value: Fraction) -> None:
    text = format_plain(value)
    assert "e" not in text.lower()
    if len(text) > MAX_NUMBER_LENGTH:  # e.g. 1.4e-123 in plain digits: refused, never misread
        with pytest.raises(NumberError):
            parse_decimal(text)
        return
    assert float(parse_decimal(text)) == float(value)


# -- the annotation parser --------------------------------------------------------------------

NAMES = ["main", "side", "setup", "a-1"]
SUFFIXES = [".gpu-memory.request", ".gpu-memory.limit", ".gpu-compute.mode", ".gpus.devices",
            ".gpu-compute.portion"]
LEGACY = ["gpu-fraction", "gpu-fraction.limit", "gpu-memory", "gpu-memory.limit",
          "gpu-fraction-num-devices", "gpu-fraction-container-name",
          "kai.scheduler/gpu-compute-sharing-mode", "received-resource-type"]
GPU_IDS = ["GPU-3f2a1b4c", "GPU-77b1c2d3", "GPU-0a1b", "MIG-1a2b", "gpu0",
           "k8s.device-plugin.nvidia.com/gpu=GPU-3f2a1b4c"]
VALUES = ["0.5", "0.8", "1", "0", "-1", "50", "NaN", "Inf", "", " ", "1e3", "5e-1", "500m",
          "1Gi", "1000Mi", "1000M", "2048", "1000", "2", "sm-sharing", "time-slicing", "main",
          "side", "ghost", "0.123456", *GPU_IDS, ",".join(GPU_IDS[:2])]

container_name = st.one_of(st.sampled_from([*NAMES, "", "ghost", "Main"]), st.text(max_size=8))
suffix = st.one_of(st.sampled_from([*SUFFIXES, "", ".gpu-memory", ".x"]), st.text(max_size=8))
annotation_key = st.one_of(
    st.builds(lambda c, s: f"nvidia.com/container.{c}{s}", container_name, suffix),
    st.builds(lambda c: f"kai.scheduler/container.{c}.gpu-memory.portion.limit", container_name),
    st.sampled_from(LEGACY),
    st.text(max_size=20),
)
annotation_value = st.one_of(st.sampled_from(VALUES), st.text(max_size=12))
annotation_map = st.dictionaries(annotation_key, annotation_value, max_size=8)
containers = st.lists(st.sampled_from(NAMES), min_size=0, max_size=3, unique=True)


@st.composite
def any_pod_request(draw) -> PodRequest:
    names = draw(containers)
    init = [n for n in draw(containers) if n not in names]
    whole = draw(st.dictionaries(st.sampled_from(NAMES), st.integers(-1, 2), max_size=2))
    return parse_pod(pod(draw(annotation_map), names, init=init, whole_gpus=whole))


@FAST
@given(any_pod_request())
def test_parse_pod_never_raises_and_reports_error_values(request: PodRequest) -> None:
    assert isinstance(request, PodRequest)
    for problem in (*request.errors, *request.warnings):
        assert isinstance(problem, ContractError)
        assert isinstance(problem.key, str) and problem.key
        assert isinstance(problem.rule, str) and problem.rule.strip()
        assert str(problem).startswith(f"{problem.key}: ")
    assert len(request.shares) <= 1 or request.errors
    names = {c.name for c in request.pod.all_containers}
    assert all(s.container in names for s in request.shares)


decisions = st.builds(
    BindDecision,
    node_gpu_memory_mib=st.integers(-10, 100_000),
    gpu_ids=st.lists(st.one_of(st.sampled_from(GPU_IDS), st.text(max_size=6)), max_size=3).map(
        tuple),
    received_portion=st.one_of(st.none(), st.fractions(min_value=-2, max_value=2),
                               st.sampled_from([Fraction(1, 10**400), Fraction(10**30)])),
    group_modes=st.lists(st.sampled_from(list(ComputeMode)), max_size=3).map(tuple),
    reserve_mib=st.integers(-5, 5000),
    cdi=st.booleans(),
    resource_type=st.sampled_from(["Fraction", "Fraction", "Regular", "Whole", ""]),
)


@FAST
@given(any_pod_request(), decisions)
def test_binder_returns_or_raises_contract_violation(request: PodRequest, d: BindDecision) -> None:
    try:
        out = binder_annotations(request, d)
    except ContractViolation as e:
        assert e.errors and all(isinstance(x, ContractError) for x in e.errors)
        return
    assert out["received-resource-type"] in ("Regular", "Fraction")
    for key, value in out.items():
        assert isinstance(value, str)
        if key.endswith(".gpu-compute.portion"):
            assert "e" not in value.lower()
        if key.endswith((".gpu-memory.request", ".gpu-memory.limit")):
            # Kubernetes' canonical spelling of whole MiB, as KAI writes it (20480 -> 20Gi).
            assert value[-2:] in ("Mi", "Gi", "Ti", "Pi", "Ei") and int(value[:-2]) > 0
            assert key not in request.pod.annotations  # a user value is never overwritten


# -- valid pods: bind, re-parse, plan ---------------------------------------------------------

UUIDS = ["GPU-3f2a1b4c-0d5e", "GPU-77b1c2d3-e4f5", "GPU-0a1b2c3d-4e5f"]
QUANTITY_UNITS = [("Mi", MIB), ("Gi", 1 << 30), ("M", 10**6), ("k", 1000)]


@st.composite
def valid_pod_and_decision(draw, kai_portion_limit: bool):
    node_mib = draw(st.integers(4096, 81920))
    reserve = draw(st.sampled_from([0, 0, 512, 1024]))
    usable = node_mib - reserve
    annotations: dict[str, str] = {}
    mode = draw(st.sampled_from([None, "time-slicing", "sm-sharing"]))
    if mode:
        annotations["nvidia.com/container.main.gpu-compute.mode"] = mode
    num_devices = 1
    portion = Fraction(draw(st.integers(1, 1000)), 1000)
    if kai_portion_limit:
        fraction = draw(st.integers(1, 98))
        annotations["gpu-fraction"] = format_plain(Fraction(fraction, 100))
        limit = draw(st.integers(fraction + 1, 99))
        annotations["kai.scheduler/container.main.gpu-memory.portion.limit"] = format_plain(
            Fraction(limit, 100))
        portion = Fraction(fraction, 100)
    else:
        shape = draw(st.sampled_from(["request", "limit", "both", "fraction", "memory"]))
        if shape in ("request", "limit", "both"):
            unit, size = draw(st.sampled_from(QUANTITY_UNITS))
            # At least 1 MiB: less is refused (the node enforces whole MiB).
            request_n = draw(st.integers(-(-MIB // size), (usable * MIB // 2) // size))
            if shape in ("request", "both"):
                annotations["nvidia.com/container.main.gpu-memory.request"] = f"{request_n}{unit}"
            if shape in ("limit", "both"):
                limit_n = draw(st.integers(request_n, (usable * MIB) // size))
                annotations["nvidia.com/container.main.gpu-memory.limit"] = f"{limit_n}{unit}"
            # KAI's scheduler sizes the portion of such a pod from its memory: whole MiB over
            # the node's, rounded up to a hundredth (binder.py, _portion_short_of_memory)
            kept_mib = (request_n if shape != "limit" else limit_n) * size // MIB
            portion = (None if draw(st.booleans())
                       else Fraction(-(-kept_mib * 100 // node_mib), 100))
        elif shape == "fraction":
            fraction = draw(st.integers(1, 99))
            annotations["gpu-fraction"] = format_plain(Fraction(fraction, 100))
            portion = Fraction(fraction, 100)
            num_devices = draw(st.integers(1, 3))
            if num_devices > 1:
                annotations["gpu-fraction-num-devices"] = str(num_devices)
            if fraction < 99 and draw(st.booleans()):
                annotations["gpu-fraction.limit"] = format_plain(
                    Fraction(draw(st.integers(fraction + 1, 99)), 100))
        else:
            mib = draw(st.integers(1, usable // 2))
            annotations["gpu-memory"] = str(mib)
            if draw(st.booleans()):
                annotations["gpu-memory.limit"] = f"{draw(st.integers(mib, usable))}Mi"
            portion = None
    d = BindDecision(
        node_gpu_memory_mib=node_mib,
        gpu_ids=tuple(UUIDS[:num_devices]),
        received_portion=portion,
        reserve_mib=reserve,
        cdi=draw(st.booleans()),
    )
    return pod(annotations, ("main", "side"), uid=draw(st.sampled_from(["", "0f8e-uid"]))), d


def _check_bound_plan(view, d: BindDecision) -> None:
    assert parse_pod(view).ok, parse_pod(view).errors
    written, bound = bind(view, d)
    assert bound.errors == (), bound.errors
    for key in view.annotations:
        if key.endswith((".gpu-memory.request", ".gpu-memory.limit")):
            assert key not in written
    (plan,) = plan_pod(bound)
    assert 1 <= plan.request_mib <= plan.limit_mib
    assert plan.request_bytes <= plan.limit_bytes
    assert plan.env["NVIDIA_GPU_MEMORY_REQUEST"] == str(plan.request_mib)
    assert plan.env["NVIDIA_GPU_MEMORY_LIMIT"] == str(plan.limit_mib)
    assert plan.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == ",".join(
        f"{i}={plan.limit_mib}M" for i in range(len(d.gpu_ids)))
    assert plan.device_uuids == d.gpu_ids
    if plan.compute_mode is ComputeMode.SM_SHARING:
        assert plan.active_thread_percentage is not None
        assert 1 <= plan.active_thread_percentage <= 100
        assert len(str(plan.mps_pipe_directory).encode()) <= 83
    else:
        assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in plan.env
        assert "CUDA_MPS_PIPE_DIRECTORY" not in plan.env
    merged = {**bound.pod.annotations, **derived_annotations(plan)}
    sources = env_sources(plan.container, plan.compute_mode)
    assert set(sources) == set(plan.env)
    for var, value in plan.env.items():
        assert merged[sources[var]] == value, var


@FAST
@given(valid_pod_and_decision(kai_portion_limit=False))
def test_valid_pods_bind_and_plan_consistently(case) -> None:
    view, d = case
    _check_bound_plan(view, d)


@FAST
@given(valid_pod_and_decision(kai_portion_limit=True))
def test_valid_pods_with_kai_portion_limit_bind_and_plan_consistently(case) -> None:
    view, d = case
    _check_bound_plan(view, d)
