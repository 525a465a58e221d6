"""The pod-independent rules of a bind decision: each rule's key, message and value, and the
binder reporting them in the same words and order among the rules that need the pod."""

from __future__ import annotations

from fractions import Fraction

import pytest

from kai_fractions.contract import ContractError, ContractViolation
from kai_fractions.contract.decision_rules import received_portion_errors, reserved_gpu_errors

from .builders import GPU_A, GPU_B, bind, decision, pod

NONE_NAMED = "must name the reserved GPU of each fractional group"
NOT_UUID = "must be a GPU UUID (GPU-...)"
TWICE = "lists the same GPU twice"
NOT_ABOVE_0 = "must be greater than 0"
TOO_SMALL = "is too small to be written as a decimal portion"


@pytest.mark.parametrize("gpu_ids", [(GPU_A,), (GPU_A, GPU_B), ("GPU-0",)])
def test_reserved_gpus_that_keep_the_rules(gpu_ids: tuple[str, ...]) -> None:
    assert reserved_gpu_errors(gpu_ids) == []


@pytest.mark.parametrize(("gpu_ids", "errors"), [
    ((), [ContractError("reserved_gpu_ids", NONE_NAMED)]),
    (("gpu0",), [ContractError("reserved_gpu_ids[0]", NOT_UUID, "gpu0")]),
    ((GPU_A, "MIG-1234", ""), [ContractError("reserved_gpu_ids[1]", NOT_UUID, "MIG-1234"),
                               ContractError("reserved_gpu_ids[2]", NOT_UUID, "")]),
    ((GPU_A, GPU_B, GPU_A), [ContractError("reserved_gpu_ids", TWICE,
                                           f"{GPU_A},{GPU_B},{GPU_A}")]),
    # One GPU in upper and lower case (NVML prints lower; the node matches exactly).
    ((GPU_A, GPU_A.upper()), [
        ContractError("reserved_gpu_ids", TWICE, f"{GPU_A},{GPU_A.upper()}")]),
    # Each UUID first, by its index, then the list as a whole.
    (("x", "x"), [ContractError("reserved_gpu_ids[0]", NOT_UUID, "x"),
                  ContractError("reserved_gpu_ids[1]", NOT_UUID, "x"),
                  ContractError("reserved_gpu_ids", TWICE, "x,x")]),
])
def test_reserved_gpus_that_break_a_rule(gpu_ids: tuple[str, ...],
                                         errors: list[ContractError]) -> None:
    assert reserved_gpu_errors(gpu_ids) == errors


@pytest.mark.parametrize("portion", [None, Fraction(1, 2), Fraction(1), Fraction(50),
                                     Fraction(1, 10**20)])
def test_portions_that_keep_the_rules(portion: Fraction | None) -> None:
    assert received_portion_errors(portion) == []


@pytest.mark.parametrize(("portion", "rule", "value"), [
    (Fraction(0), NOT_ABOVE_0, "0"),
    (Fraction(-1, 2), NOT_ABOVE_0, "-0.5"),
    (Fraction(-10**15), NOT_ABOVE_0, "huge"),
    # 0 as a float64: the binder would write "0".
    (Fraction(1, 10**400), TOO_SMALL, f"1/{10**400}"),
    # More characters than a contract number may have.
    (Fraction(1, 10**70), TOO_SMALL, f"1/{10**70}"),
])
def test_portions_that_break_a_rule(portion: Fraction, rule: str, value: str) -> None:
    assert received_portion_errors(portion) == [
        ContractError("received_gpu.portion", rule, value)]


def _binder_errors(annotations: dict[str, str], **kw) -> tuple[ContractError, ...]:
    with pytest.raises(ContractViolation) as e:
        bind(pod(annotations), decision(2000, **kw))
    return e.value.errors


def test_the_binder_reports_the_same_errors_after_the_count_of_gpus() -> None:
    errors = _binder_errors({"gpu-fraction": "0.5"}, gpus=("gpu0", "gpu0"))
    assert errors == (
        ContractError("reserved_gpu_ids", "lists 2 GPU(s) but the pod asks for 1 "
                      "(gpu-fraction-num-devices)", "gpu0,gpu0"),
        *reserved_gpu_errors(("gpu0", "gpu0")),
    )


def test_the_binder_reports_no_count_when_no_gpu_is_named() -> None:
    errors = _binder_errors({"gpu-fraction": "0.5"}, gpus=())
    assert errors == tuple(reserved_gpu_errors(()))


@pytest.mark.parametrize("portion", ["0", "-0.5", "0." + "0" * 70 + "1"])
def test_the_binder_reports_the_same_portion_error(portion: str) -> None:
    errors = _binder_errors({"nvidia.com/container.main.gpu-memory.request": "100Mi"},
                            portion=portion)
    assert errors == tuple(received_portion_errors(Fraction(portion)))
    assert len(errors) == 1
