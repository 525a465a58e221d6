"""resolve_decision: request fields -> the contract's BindDecision, every error by field path."""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction

import pytest

from kai_fractions.contract import BindDecision, ComputeMode, Dialect
from kai_fractions.mirror.decision import AllocationInput, check_idempotency_key, resolve_decision
from kai_fractions.mirror.errors import InvalidAllocation

BASE = AllocationInput(
    namespace="team-a", pod_name="train-0", selected_node="node-1", resource_type="Fraction",
    gpu_count=2, portion="0.5", group_ids=("g-1", "g-2"), group_modes=("sm-sharing", ""),
    gpu_ids=("GPU-1111aaaa", "GPU-2222bbbb"), node_gpu_memory_mib=40960, cdi=True)


def no_nodes(_node: str):
    raise AssertionError("the node must not be read")


def exists(node: str):
    """node-1 exists (with no GPU memory label: the allocation gives the memory itself)."""
    return {} if node == "node-1" else None


def errors_of(allocation: AllocationInput, node_labels=exists, **kw) -> list[tuple]:
    with pytest.raises(InvalidAllocation) as e:
        resolve_decision(allocation, node_labels, **kw)
    return [(x.key, x.rule, x.value) for x in e.value.errors]


def test_fields_become_a_bind_decision():
    assert resolve_decision(BASE, exists, default_reserve_mib=1024) == BindDecision(
        node_gpu_memory_mib=40960, gpu_ids=("GPU-1111aaaa", "GPU-2222bbbb"),
        received_portion=Fraction(1, 2),
        group_modes=(ComputeMode.SM_SHARING, ComputeMode.TIME_SLICING),
        reserve_mib=1024, cdi=True, resource_type="Fraction")


def test_the_dialect_is_carried_into_the_decision():
    assert resolve_decision(BASE, exists).dialect is Dialect.UPSTREAM
    assert resolve_decision(BASE, exists, dialect=Dialect.PATCHED).dialect is Dialect.PATCHED


def test_explicit_reserve_wins_over_the_default():
    decision = resolve_decision(replace(BASE, reserve_mib=0), exists, default_reserve_mib=1024)
    assert decision.reserve_mib == 0


def test_empty_portion_means_from_the_pod():
    assert resolve_decision(replace(BASE, portion=""), exists).received_portion is None


def test_node_memory_label_is_read_when_zero():
    seen = []

    def labels(node):
        seen.append(node)
        return {"nvidia.com/gpu.memory": "81920"}

    decision = resolve_decision(replace(BASE, node_gpu_memory_mib=0), labels)
    assert (decision.node_gpu_memory_mib, seen) == (81920, ["node-1"])


@pytest.mark.parametrize(("label", "mib"), [("40960", 40960), ("40960.0", 40960),
                                           ("40960.5", 40960.5)])
def test_node_memory_label_is_read_as_a_number(label, mib):
    decision = resolve_decision(replace(BASE, node_gpu_memory_mib=0),
                                lambda n: {"nvidia.com/gpu.memory": label})
    assert decision.node_gpu_memory_mib == mib


def test_missing_label_is_left_to_the_contract_which_names_it():
    decision = resolve_decision(replace(BASE, node_gpu_memory_mib=0), lambda n: {})
    assert decision.node_gpu_memory_mib == 0  # binder_annotations reports node_gpu_memory_mib


@pytest.mark.parametrize(("changes", "labels", "expected"), [
    ({"portion": "NaN"}, exists, [("received_gpu.portion", "must be a finite decimal number "
                                     "such as 0.5 (no NaN, Inf or hex)", "NaN")]),
    ({"portion": " "}, exists, [("received_gpu.portion", "must be a decimal number, not "
                                   "blank", " ")]),
    ({"gpu_count": 3}, exists, [("received_gpu.count", "is 3 but reserved_gpu_ids lists 2 "
                                   "GPU(s)", "3")]),
    ({"gpu_count": -1}, exists, [("received_gpu.count", "must not be negative", "-1")]),
    ({"group_modes": ("sm-sharing",), "gpu_count": 0}, exists, [(
        "reserved_gpu_ids", "lists 2 GPU(s) for 1 selected group(s): one per group, same order",
        "GPU-1111aaaa,GPU-2222bbbb")]),
    ({"group_modes": ("mps", "")}, exists, [(
        "selected_fractional_gpu_groups[0].compute_sharing_mode",
        "must be one of: time-slicing, sm-sharing (empty means time-slicing)", "mps")]),
    ({"node_gpu_memory_mib": -5}, exists, [(
        "node_gpu_memory_mib", "must not be negative (0 reads the node's nvidia.com/gpu.memory "
        "label)", "-5")]),
    ({"reserve_mib": 1024}, exists, [(
        "reserve_mib", "is 1024 MiB, but upstream KAI main subtracts no reserve: use 0, or the "
        "patched dialect for a KAI that does", None)]),
    ({"node_gpu_memory_mib": 0, "selected_node": ""}, exists, [(
        "selected_node", "is required: a fractional allocation names the node it is for (and "
        "that node's GPU memory comes from its nvidia.com/gpu.memory label when "
        "node_gpu_memory_mib is 0)", None)]),
    # Issue 17, finding 9: the node must exist even when the caller gives its memory.
    ({"selected_node": "node-that-is-not"}, exists, [(
        "selected_node", "names a node that does not exist", "node-that-is-not")]),
    # Issue 17, finding 9: bounds on what a caller may send, checked before anything else.
    ({"node_gpu_memory_mib": 2**63 - 1}, exists, [(
        "node_gpu_memory_mib", "must be at most 1099511627776 MiB", str(2**63 - 1))]),
    ({"gpu_ids": ("GPU-1",) * 5000, "gpu_count": 0}, exists, [
        ("reserved_gpu_ids", "must list at most 64 (got 5000)", None),
        ("reserved_gpu_ids", "lists 5000 GPU(s) for 2 selected group(s): one per group, same "
         "order", ",".join(["GPU-1"] * 5000))]),
    # a name no node could have is not looked up (nor sent to the API server)
    ({"selected_node": "n" * 300}, exists, [
        ("selected_node", "must be at most 253 characters (got 300)", None)]),
    ({"reserve_mib": -1}, exists, [("reserve_mib", "must be between 0 and 1099511627776",
                                    "-1")]),
    ({"node_gpu_memory_mib": 0}, lambda n: None, [(
        "selected_node", "names a node that does not exist", "node-1")]),
    ({"node_gpu_memory_mib": 0}, lambda n: {"nvidia.com/gpu.memory": "40GB"}, [(
        "node_gpu_memory_mib", "cannot be read from node node-1: its nvidia.com/gpu.memory "
        "label is not a positive number of MiB (at most 1099511627776)", "40GB")]),
    ({"resource_type": ""}, exists, [("received_resource_type",
                                         "is required: Fraction or Regular", None)]),
    ({"resource_type": "7"}, exists, [("received_resource_type",
                                          "must be Fraction or Regular", "7")]),
    ({"namespace": "", "pod_name": ""}, exists, [("pod.namespace", "is required", None),
                                                   ("pod.name", "is required", None)]),
])
def test_request_field_errors(changes, labels, expected):
    assert errors_of(replace(BASE, **changes), labels) == expected


def test_regular_binds_read_no_node():
    decision = resolve_decision(replace(BASE, resource_type="Regular", node_gpu_memory_mib=0),
                                no_nodes)
    assert decision.resource_type == "Regular"


def test_idempotency_key_limits():
    check_idempotency_key("team-a/train-0/attempt-1")
    with pytest.raises(InvalidAllocation):
        check_idempotency_key("x" * 257)
    with pytest.raises(InvalidAllocation):
        check_idempotency_key("bad\nkey")
