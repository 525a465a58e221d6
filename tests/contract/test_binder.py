"""Binder arithmetic: the contract doc's worked numbers and the exact annotation map written."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest

from kai_fractions.contract import (
    ComputeMode,
    ContractViolation,
    Keys,
    binder_annotations,
    parse_group_modes,
    parse_pod,
)
from kai_fractions.contract.binder import as_scheduler_sizes
from kai_fractions.contract.quantity import MIB

from .builders import GPU_A, GPU_B, bind, decision, patched, pod

REQ = "nvidia.com/container.main.gpu-memory.request"
LIM = "nvidia.com/container.main.gpu-memory.limit"
DEV = "nvidia.com/container.main.gpus.devices"
POR = "nvidia.com/container.main.gpu-compute.portion"
MODE = "nvidia.com/container.main.gpu-compute.mode"
PORTION_LIMIT = "kai.scheduler/container.main.gpu-memory.portion.limit"
RRT = "received-resource-type"


def written(annotations: dict, d=None) -> dict:
    return binder_annotations(parse_pod(pod(annotations)), d or decision())


# -- worked numbers (contract doc section 3) -------------------------------------------------


def test_2000_mib_half_is_1000mi() -> None:
    # Upstream KAI main (pkg/binder/plugins/nvfractions/nv_fractions.go) writes no portion.
    assert written({"gpu-fraction": "0.5"}, decision(2000, portion="0.5")) == {
        REQ: "1000Mi",
        DEV: GPU_A,
        RRT: "Fraction",
    }


def test_patched_dialect_also_writes_the_compute_portion() -> None:
    assert written({"gpu-fraction": "0.5"}, patched(2000, portion="0.5")) == {
        REQ: "1000Mi",
        DEV: GPU_A,
        POR: "0.5",
        RRT: "Fraction",
    }


def test_reserve_1024_gives_488mi() -> None:
    out = written({"gpu-fraction": "0.5"}, decision(2000, portion="0.5", reserve=1024))
    assert out[REQ] == "488Mi"


def test_portion_limit_08_with_reserve_gives_780mi_via_kai_key() -> None:
    out = written(
        {"gpu-fraction": "0.5", PORTION_LIMIT: "0.8"}, decision(2000, portion="0.5", reserve=1024)
    )
    assert out[REQ] == "488Mi"
    assert out[LIM] == "780Mi"


def test_portion_limit_08_with_reserve_gives_780mi_via_gpu_fraction_limit() -> None:
    out = written(
        {"gpu-fraction": "0.5", "gpu-fraction.limit": "0.8"},
        decision(2000, portion="0.5", reserve=1024),
    )
    assert out[REQ] == "488Mi"
    assert out[LIM] == "780Mi"


def test_a100_40gb_reserve_1024_half_gives_19968mi() -> None:
    out = written({"gpu-fraction": "0.5"}, decision(40960, portion="0.5", reserve=1024))
    assert out[REQ] == "19968Mi"


def test_nvfractions_pod_without_request_gets_portion_of_memory() -> None:
    # Only a compute mode: the request comes from the received portion.
    out = written({MODE: "sm-sharing", DEV: GPU_B}, decision(2000, portion="0.5"))
    assert out[REQ] == "1000Mi"
    assert out[DEV] == GPU_A  # binder-owned: always rewritten


# -- what is and is not written --------------------------------------------------------------


def test_user_request_is_never_overwritten() -> None:
    out = written({REQ: "3000Mi"}, patched(40960, portion="0.5"))
    assert REQ not in out
    assert LIM not in out
    assert out[POR] == "0.5"


def test_user_request_in_decimal_units_is_never_overwritten() -> None:
    out = written({REQ: "1000M"}, decision(2000, portion="0.5"))
    assert REQ not in out


def test_only_limit_means_request_is_the_limit_on_the_node_side() -> None:
    out, bound = bind(pod({LIM: "1Gi"}), decision(20000, portion=None))
    assert REQ not in out and LIM not in out
    share = bound.share
    assert share is not None
    assert share.node_request_bytes == share.node_limit_bytes == 1 << 30


def test_only_request_means_limit_is_the_request_on_the_node_side() -> None:
    out, bound = bind(pod({REQ: "2Gi"}), decision(20000, portion=None))
    assert LIM not in out
    share = bound.share
    assert share is not None
    assert share.node_limit_bytes == share.node_request_bytes == 2 << 30


def test_compute_portion_from_request_when_no_portion_received() -> None:
    # request / (M - reserve): 1 MiB of 20000 MiB.
    out = written({REQ: "1Mi"}, patched(20000, portion=None))
    assert out[POR] == "0.00005"


def test_compute_portion_is_plain_decimal_never_exponent() -> None:
    out = written({REQ: "1Mi"}, patched(20000, portion="0.00005"))
    assert out[POR] == "0.00005"
    out = written({REQ: "1Mi"}, patched(20000, portion="5e-5"))
    assert out[POR] == "0.00005"
    out = written({REQ: "1Mi"}, patched(20000, portion="0.0000001"))
    assert out[POR] == "0.0000001"
    assert "e" not in out[POR].lower()


def test_self_declared_compute_portion_is_overwritten() -> None:
    out = written({REQ: "1000Mi", POR: "1"}, patched(2000, portion="0.25"))
    assert out[POR] == "0.25"


def test_devices_joined_with_commas_for_multi_device() -> None:
    out = written(
        {"gpu-fraction": "0.5", "gpu-fraction-num-devices": "2"},
        decision(2000, gpus=(GPU_A, GPU_B), portion="0.5"),
    )
    assert out[DEV] == f"{GPU_A},{GPU_B}"


def test_cdi_device_names() -> None:
    out = written(
        {"gpu-fraction": "0.5", "gpu-fraction-num-devices": "2"},
        decision(2000, gpus=(GPU_A, GPU_B), portion="0.5", cdi=True),
    )
    assert out[DEV] == (
        f"k8s.device-plugin.nvidia.com/gpu={GPU_A},k8s.device-plugin.nvidia.com/gpu={GPU_B}"
    )


def test_regular_bind_writes_only_received_resource_type() -> None:
    out = binder_annotations(
        parse_pod(pod({"some": "thing"})), decision(resource_type="Regular", gpus=())
    )
    assert out == {"received-resource-type": "Regular"}


def test_regular_bind_of_a_fractional_pod_is_refused() -> None:
    with pytest.raises(ContractViolation) as info:
        written({"gpu-fraction": "0.5"}, decision(resource_type="Regular"))
    assert info.value.errors[0].key == "received_resource_type"


def test_fraction_bind_of_a_pod_without_fraction_is_refused() -> None:
    with pytest.raises(ContractViolation) as info:
        binder_annotations(parse_pod(pod({})), decision())
    assert info.value.errors[0].key == "received_resource_type"


def test_unknown_resource_type_is_refused() -> None:
    with pytest.raises(ContractViolation) as info:
        written({"gpu-fraction": "0.5"}, decision(resource_type="Whole"))
    assert info.value.errors[0].key == "received_resource_type"
    assert "Regular or Fraction" in info.value.errors[0].rule


def test_legacy_gpu_memory_request_and_limit() -> None:
    out = written({"gpu-memory": "1000", "gpu-memory.limit": "2Gi"}, patched(8000, portion=None))
    assert out[REQ] == "1000Mi"
    assert out[LIM] == "2Gi"  # 2048 MiB, as Kubernetes spells it
    assert out[POR] == "0.125"


@pytest.mark.parametrize("limit", ["8G", "8000Mi", "7.5Gi", "8000M"])
def test_gpu_memory_limit_is_written_as_the_user_wrote_it(limit: str) -> None:
    """KAI's mutating webhook copies gpu-memory.limit into the limit key verbatim (upstream
    KAI-Scheduler pkg/admission/webhook/v1alpha2/nvfractions/mutation.go,
    translateLegacyMemoryLimit), so an unmodified KAI's pod says "8G", not 7630Mi: the follower
    compares what it expects with that."""
    out = written({"gpu-memory": "1000", "gpu-memory.limit": limit}, patched(80000, portion=None))
    assert out[LIM] == limit


def test_gpu_memory_limit_below_the_request_is_refused() -> None:
    errors = _violation({"gpu-memory": "1000", "gpu-memory.limit": "1G"},
                        decision(8000, portion=None))
    assert errors and errors[0][0] == "gpu-memory.limit"  # the parse refuses it first


def test_custom_prefix_is_written() -> None:
    keys = Keys(prefix="gpu.example.com/c.")
    out = binder_annotations(parse_pod(pod({"gpu-fraction": "0.5"}), keys), patched(), keys)
    assert set(out) == {
        "gpu.example.com/c.main.gpu-memory.request",
        "gpu.example.com/c.main.gpus.devices",
        "gpu.example.com/c.main.gpu-compute.portion",
        "received-resource-type",
    }


def test_invalid_pod_is_refused_with_its_errors() -> None:
    with pytest.raises(ContractViolation) as info:
        written({"gpu-fraction": "50"})
    assert [e.key for e in info.value.errors] == ["gpu-fraction"]


def test_request_rounding_down_to_zero_is_an_error() -> None:
    with pytest.raises(ContractViolation) as info:
        written({"gpu-fraction": "0.0001"}, decision(2000, portion="0.0001"))
    assert info.value.errors[0].key == REQ
    assert "0 MiB" in info.value.errors[0].rule


# -- decision errors name the field (contract doc section 4) ---------------------------------


def _violation(annotations: dict, d) -> list[tuple[str, str]]:
    with pytest.raises(ContractViolation) as info:
        written(annotations, d)
    return [(e.key, e.rule) for e in info.value.errors]


@pytest.mark.parametrize("node_mib", [0, -1])
def test_missing_node_gpu_memory(node_mib: int) -> None:
    errors = _violation({"gpu-fraction": "0.5"}, decision(node_mib))
    assert errors[0][0] == "node_gpu_memory_mib"
    assert "nvidia.com/gpu.memory" in errors[0][1]


@pytest.mark.parametrize("reserve", [2000, 4000])
def test_reserve_at_or_above_memory(reserve: int) -> None:
    errors = _violation({"gpu-fraction": "0.5"}, decision(2000, reserve=reserve))
    assert [key for key, _ in errors] == ["reserve_mib"]


def test_negative_reserve() -> None:
    errors = _violation({"gpu-fraction": "0.5"}, decision(2000, reserve=-1))
    assert [key for key, _ in errors] == ["reserve_mib"]


@pytest.mark.parametrize("portion", ["-0.5", "0"])
def test_received_portion_not_above_zero(portion: str) -> None:
    errors = _violation({REQ: "100Mi"}, decision(2000, portion=portion))
    assert [key for key, _ in errors] == ["received_gpu.portion"]
    assert errors[0][1] == "must be greater than 0"


@pytest.mark.parametrize("portion", ["1.5", "50"])
def test_received_portion_above_one_is_refused_when_it_sizes_the_request(portion: str) -> None:
    # KAI would write portion x M MiB, more than the GPU has.
    errors = _violation({"gpu-fraction": "0.5"}, decision(2000, portion=portion))
    assert [key for key, _ in errors] == ["received_gpu.portion"]
    assert "is above 1" in errors[0][1]


@pytest.mark.parametrize("portion", ["1.5", "50"])
def test_received_portion_above_one_caps_the_compute_portion_at_one(portion: str) -> None:
    # The patched binder writes min(portion, 1) (its resolveComputePortion).
    assert written({REQ: "100Mi"}, patched(2000, portion=portion))[POR] == "1"
    assert POR not in written({REQ: "100Mi"}, decision(2000, portion=portion))


def test_missing_portion_and_no_request() -> None:
    errors = _violation({MODE: "time-slicing", DEV: GPU_A}, decision(2000, portion=None))
    assert [key for key, _ in errors] == ["received_gpu.portion"]


@pytest.mark.parametrize("gpus", [(), (GPU_A, GPU_B)])
def test_wrong_number_of_reserved_ids(gpus: tuple[str, ...]) -> None:
    errors = _violation({"gpu-fraction": "0.5"}, decision(gpus=gpus))
    assert [key for key, _ in errors] == ["reserved_gpu_ids"]


def test_reserved_ids_for_num_devices() -> None:
    errors = _violation(
        {"gpu-fraction": "0.5", "gpu-fraction-num-devices": "2"}, decision(gpus=(GPU_A,))
    )
    assert [key for key, _ in errors] == ["reserved_gpu_ids"]
    assert "gpu-fraction-num-devices" in errors[0][1]


@pytest.mark.parametrize("bad", ["gpu0", "MIG-1234", "", "GPU-xyz"])
def test_reserved_id_must_be_a_gpu_uuid(bad: str) -> None:
    errors = _violation({"gpu-fraction": "0.5"}, decision(gpus=(bad,)))
    assert ("reserved_gpu_ids[0]", "must be a GPU UUID (GPU-...)") in errors


def test_duplicate_reserved_ids() -> None:
    errors = _violation(
        {"gpu-fraction": "0.5", "gpu-fraction-num-devices": "2"}, decision(gpus=(GPU_A, GPU_A))
    )
    assert ("reserved_gpu_ids", "lists the same GPU twice") in errors


def test_mode_mix_across_groups_names_the_group() -> None:
    errors = _violation(
        {"gpu-fraction": "0.5", "gpu-fraction-num-devices": "2"},
        decision(gpus=(GPU_A, GPU_B), modes=(ComputeMode.TIME_SLICING, ComputeMode.SM_SHARING)),
    )
    assert [key for key, _ in errors] == ["selected_fractional_gpu_groups[1].compute_sharing_mode"]
    assert "one GPU runs one compute mode" in errors[0][1]


def test_group_mode_differs_from_the_containers_mode() -> None:
    errors = _violation(
        {"gpu-fraction": "0.5", MODE: "sm-sharing"}, decision(modes=(ComputeMode.TIME_SLICING,))
    )
    assert [key for key, _ in errors] == ["selected_fractional_gpu_groups[0].compute_sharing_mode"]


def test_matching_group_modes_are_accepted() -> None:
    out = written(
        {"gpu-fraction": "0.5", MODE: "sm-sharing"}, patched(modes=(ComputeMode.SM_SHARING,))
    )
    assert out[POR] == "0.5"


def test_request_larger_than_the_gpu() -> None:
    errors = _violation({REQ: "3000Mi"}, decision(2000, portion=None))
    assert [key for key, _ in errors] == [REQ]
    assert "2000 MiB" in errors[0][1]


def test_request_larger_than_the_gpu_after_reserve() -> None:
    errors = _violation({REQ: "1000Mi"}, decision(2000, portion="0.5", reserve=1024))
    assert [key for key, _ in errors] == [REQ]


def test_portion_limit_below_user_request_is_refused() -> None:
    errors = _violation({"gpu-fraction": "0.5", REQ: "900Mi", PORTION_LIMIT: "0.6"},
                        decision(2000, portion="0.5", reserve=1024))
    assert [key for key, _ in errors] == [LIM]


def test_all_decision_errors_are_collected() -> None:
    errors = _violation({"gpu-fraction": "0.5"}, decision(0, gpus=("bad", "bad"),
                                                           portion="2", reserve=-5))
    keys = {key for key, _ in errors}
    assert {"node_gpu_memory_mib", "reserve_mib", "received_gpu.portion", "reserved_gpu_ids",
            "reserved_gpu_ids[0]", "reserved_gpu_ids[1]"} <= keys


def test_parse_group_modes() -> None:
    assert parse_group_modes(["sm-sharing", "", "time-slicing"]) == (
        ComputeMode.SM_SHARING,
        ComputeMode.TIME_SLICING,
        ComputeMode.TIME_SLICING,
    )


def test_parse_group_modes_reports_unknown_mode_as_contract_violation() -> None:
    """A BindRequest group with an unknown computeSharingMode is a contract error naming the
    group's field, like every other decision error (not a bare ValueError from the enum)."""
    with pytest.raises(ContractViolation) as info:
        parse_group_modes(["time-slicing", "exclusive"])
    assert info.value.errors[0].key == "selected_fractional_gpu_groups[1].compute_sharing_mode"
    assert info.value.errors[0].value == "exclusive"


def test_received_portion_of_one_is_written_as_1() -> None:
    out = written({REQ: "100Mi"}, patched(2000, portion=Fraction(1)))
    assert out[POR] == "1"


def test_compute_portion_written_is_always_in_0_1() -> None:
    """The binder writes `.gpu-compute.portion` as a plain decimal in (0,1]. A received portion
    so small that it prints as `0` must be refused (naming received_gpu.portion), never written
    as `0`, a value the contract's own parser then rejects on the bound pod."""
    tiny = Fraction(1, 10**400)
    try:
        out = written({REQ: "100Mi"}, patched(2000, portion=tiny))
    except ContractViolation as e:
        assert e.errors[0].key == "received_gpu.portion"
    else:
        assert Fraction(out[POR]) > 0, out[POR]


# -- a decision never grants more than the pod asked for (issue 17, finding 1) -----------------


@pytest.mark.parametrize("dialect_of", [decision, patched])
def test_a_portion_above_the_pods_gpu_fraction_is_refused(dialect_of) -> None:
    """The review's attack: portion 1 mirrored onto a pod that asked for gpu-fraction 0.1."""
    errors = _violation({"gpu-fraction": "0.1"}, dialect_of(81559, portion="1"))
    assert errors == [("received_gpu.portion",
                       "grants more than container 'main' asks for (at most 0.1 of a GPU)")]


@pytest.mark.parametrize(("fraction", "portion", "memory"), [
    ("0.375", "0.38", "30992Mi"), ("0.875", "0.88", "71771Mi"), ("0.667", "0.67", "54644Mi"),
    ("0.999", "1.00", "81559Mi"), ("0.125", "0.12", "9787Mi")])
def test_the_portion_kai_writes_with_two_decimals_is_accepted(fraction, portion, memory):
    # Upstream KAI main, pkg/scheduler/cache/cache.go (createBindRequest): the BindRequest's
    # portion is fmt.Sprintf("%.2f", GpuFractionalPortion()), so a gpu-fraction of 0.375 is
    # bound as "0.38", and the binder writes uint64(M * 0.38) (pkg/binder/plugins/nvfractions).
    assert written({"gpu-fraction": fraction}, decision(81559, portion=portion))[REQ] == memory


def test_a_portion_above_both_the_fraction_and_its_rounding_is_refused() -> None:
    errors = _violation({"gpu-fraction": "0.375"}, decision(81559, portion="0.39"))
    assert errors == [("received_gpu.portion", "grants more than container 'main' asks for "
                       "(at most 0.375 of a GPU, or 0.38 as KAI's scheduler writes it)")]
    # 0.125 rounds down (ties to even, as Go's %.2f does): nothing above 0.125 is granted.
    errors = _violation({"gpu-fraction": "0.125"}, decision(81559, portion="0.13"))
    assert errors == [("received_gpu.portion",
                       "grants more than container 'main' asks for (at most 0.125 of a GPU)")]


# -- nor less than a memory-sized pod keeps (its own request, which the binder never rewrites) -


def _kai_portion(mib: int, node_mib: int) -> str:
    """Upstream KAI main's portion for a memory request: whole MiB over the node's GPU memory,
    rounded up to a hundredth (pkg/scheduler/api/node_info/gpu_sharing_node_info.go,
    getGpuMemoryFractionalOnNode), printed with %.2f (pkg/scheduler/cache/cache.go)."""
    return format(math.ceil(mib / node_mib * 100) / 100, ".2f")


@pytest.mark.parametrize("annotations", [
    {REQ: "20000Mi"}, {LIM: "20000Mi"}, {REQ: "20000Mi", LIM: "30000Mi"},
    {"gpu-memory": "20000"}])
def test_a_portion_below_a_memory_sized_pods_share_is_refused(annotations) -> None:
    """A request raised between scheduling and the bind (the freeze starts at the bind), or a
    caller's slip: the node would guarantee 20000 MiB on a GPU where the scheduler counted
    0.48 of 40960 (19660 MiB)."""
    assert _kai_portion(20000, 40960) == "0.49"
    errors = _violation(annotations, decision(40960, portion="0.48"))
    assert errors == [("received_gpu.portion", (
        "is too small for container 'main': its own request of 20000 MiB of GPU memory (the "
        "binder keeps it) needs at least 0.49 of a 40960 MiB GPU, as KAI's scheduler sizes "
        "it"))]


@pytest.mark.parametrize(("mib", "node_mib"), [
    (20000, 40960), (1, 81559), (10240, 81920), (45600, 80000), (40960, 40960),
    (22528, 40960), (9787, 81559)])
def test_the_portion_kai_sizes_for_a_memory_request_is_accepted(mib, node_mib) -> None:
    # 22528/40960 is 0.55 exactly, and float64 puts it at 0.56: above the share is accepted
    portion = _kai_portion(mib, node_mib)
    assert written({REQ: f"{mib}Mi"}, decision(node_mib, portion=portion)) == {
        DEV: GPU_A, RRT: "Fraction"}
    assert written({REQ: f"{mib}Mi"}, decision(node_mib, portion="1"))[DEV] == GPU_A


def test_the_patched_dialects_portion_is_a_compute_share_not_held_to_the_memory() -> None:
    assert written({REQ: "20000Mi"}, patched(40960, portion="0.1"))[POR] == "0.1"


def test_a_portion_at_or_below_the_pods_gpu_fraction_is_accepted() -> None:
    assert written({"gpu-fraction": "0.1"}, decision(81559, portion="0.1"))[REQ] == "8155Mi"
    assert written({"gpu-fraction": "0.1"}, decision(81559, portion="0.05"))[REQ] == "4077Mi"


@pytest.mark.parametrize(("request_mib", "label", "portion"), [
    (10240, 40960, "0.26"),   # ceil(10240 / 40900 * 100) / 100: the label floored to 100s
    (20480, 40960, "0.51"),   # a first bind's 20Gi, sized on a rebind
    (46489, 81559, "0.58"),   # 46489 / 81500 = 0.5704...
    (40900, 40960, "1.00"),
    (1, 40960, "0.01"),
])
def test_as_scheduler_sizes_a_memory_request_as_kai_does(request_mib, label, portion) -> None:
    # KAI-Scheduler pkg/scheduler/api/node_info/node_info.go (getNodeGpuMemory floors the
    # label to a multiple of 100), gpu_sharing_node_info.go (getGpuMemoryFractionalOnNode:
    # math.Ceil(float64(memory) / float64(M) * 100) / 100), pkg/scheduler/cache/cache.go
    # (createBindRequest: "%.2f").
    assert as_scheduler_sizes(request_mib * MIB, label) == Fraction(portion)


@pytest.mark.parametrize("label", [0, -1, 99, 40960.5, 1 << 20, float("nan")])
def test_as_scheduler_sizes_knows_no_portion_for_a_label_kai_reads_otherwise(label) -> None:
    assert as_scheduler_sizes(10240 * MIB, label) is None
