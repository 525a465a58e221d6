"""The dialect corpus: upstream's own worked values, run through our contract.

Every case names the upstream test it comes from (repository, path, and the commit the values
were read at). Nothing of upstream's code is here: only its inputs and expected outputs, so a
change on either side that breaks agreement fails one named case.

- KAI main binder:   kai-scheduler/KAI-Scheduler pkg/binder/plugins/nvfractions/nv_fractions_test.go
  @bf1bdd57 (no reserve, no compute portion).
- Patched binder:    the same file @e396c876 (KAI-Scheduler#2368: reserve + .gpu-compute.portion).
- Quantities:        kai-scheduler/api utilities/resources/gpu_sharing_nvfractions_test.go
  @556f51ba (GpuMemoryAnnotationToNvFractionsMemoryRequest).
- Pod requests:      kai-scheduler/api utilities/resources/gpu_sharing_test.go @556f51ba
  (ParsePodGPUFractionRequest); KAI-Scheduler pkg/admission/webhook/v1alpha2/nvfractions/
  nvfractions_test.go @10eae30d (TestValidate); pkg/common/resources/
  gpu_sharing_container_ref_test.go @45103d4c (GetFractionContainerRef). The last rows of the
  refused and admitted lists come from the code those tests exercise: kai-scheduler/api
  utilities/resources/gpu_sharing_validation.go (ValidateGPUFractionRequest) and KAI-Scheduler
  pkg/admission/webhook/v1alpha2/nvfractions/mutation.go (what the webhook writes).
- Node side:         kai-scheduler/kai-gpu-fractioning fractioning-manager/fractiond/internal/
  annotations/annotations_test.go (TestParseToMemoryMiB, TestParseComputePortion).
"""

from __future__ import annotations

from fractions import Fraction

import pytest

from kai_fractions.contract import (
    ContractViolation,
    Dialect,
    active_thread_percentage,
    binder_annotations,
    parse_pod,
    plan_pod,
)
from kai_fractions.contract.dialect import compute_portion_of, memory_mib
from kai_fractions.contract.quantity import MIB, canonical_mib, memory_bytes, mib_ceil

from .builders import bind, decision, pod

C = "container-0"
P = f"nvidia.com/container.{C}"
REQ, LIM, DEV, POR = (f"{P}.gpu-memory.request", f"{P}.gpu-memory.limit", f"{P}.gpus.devices",
                      f"{P}.gpu-compute.portion")
PORTION_LIMIT = f"kai.scheduler/container.{C}.gpu-memory.portion.limit"
GPU_0 = "GPU-0a0a0a0a-0000-4000-8000-000000000000"
GPU_1 = "GPU-1b1b1b1b-0000-4000-8000-000000000001"
TWO = {"gpu-fraction": "0.5", "gpu-fraction-num-devices": "2"}
"""Upstream's binder tests reserve two GPUs for a pod that asks for one; KAI's scheduler gives
two groups only to a two-device fraction, and our binder checks that they agree."""
RRT = "received-resource-type"
BOTH = pytest.mark.parametrize("dialect", list(Dialect))

MAIN_BINDER = "KAI-Scheduler nv_fractions_test.go @bf1bdd57"
PATCHED_BINDER = "KAI-Scheduler nv_fractions_test.go @e396c876"


def written(annotations: dict[str, str], *, dialect: Dialect, node_mib: float = 2000,
            portion: str | None = "0.5", reserve: int = 0, gpus=(GPU_0,), cdi: bool = False
            ) -> dict[str, str]:
    d = decision(node_mib, gpus, portion, reserve=reserve, cdi=cdi, dialect=dialect)
    return binder_annotations(parse_pod(pod(annotations, (C,))), d)


# -- the binder, both dialects ----------------------------------------------------------------


@BOTH
def test_shared_allocation_2000_mib_at_half(dialect):
    """TestPreBindSetsAnnotationsForSharedAllocation (both versions): request `1000Mi`."""
    out = written(TWO, dialect=dialect, gpus=(GPU_0, GPU_1))
    assert out[REQ] == "1000Mi"
    assert out[DEV] == f"{GPU_0},{GPU_1}"
    assert out[RRT] == "Fraction"
    assert (POR in out) is (dialect is Dialect.PATCHED)
    if dialect is Dialect.PATCHED:
        assert out[POR] == "0.5"


@BOTH
def test_cdi_device_names(dialect):
    """TestPreBindQualifiesVisibleDevicesAsCdiWhenEnabled."""
    out = written(TWO, dialect=dialect, gpus=(GPU_0, GPU_1), cdi=True)
    assert out[DEV] == (f"k8s.device-plugin.nvidia.com/gpu={GPU_0},"
                        f"k8s.device-plugin.nvidia.com/gpu={GPU_1}")


@BOTH
def test_portion_limit_08_of_2000_is_1600mi(dialect):
    """TestPreBindSetsGpuMemoryPortionLimitAnnotation: Value() == 1600Mi, source key kept."""
    out = written({"gpu-fraction": "0.5", PORTION_LIMIT: "0.8"}, dialect=dialect)
    assert memory_bytes(out[LIM]) == 1600 * MIB
    assert PORTION_LIMIT not in out  # the source annotation is left as the user wrote it


@BOTH
def test_no_portion_limit_no_limit(dialect):
    """TestPreBindNoGpuMemoryPortionLimitAnnotationIsNoOp."""
    assert LIM not in written({"gpu-fraction": "0.5"}, dialect=dialect)


@BOTH
def test_whole_gpu_bind_writes_no_fraction_key(dialect):
    """TestPreBindNoOpForWholeGpuAllocation / TestPreBindWritesNoComputePortionForWholeGpu...:
    only the binder's `received-resource-type` (Binder.Bind writes it on every bind)."""
    d = decision(2000, (), "1", resource_type="Regular", dialect=dialect, reserve=1024)
    assert binder_annotations(parse_pod(pod({}, (C,))), d) == {RRT: "Regular"}


def test_patched_reserve_1024_gives_exactly_488mi():
    """TestPreBindSubtractsReservedGpuMemoryFromRequest: the exact map."""
    assert written({"gpu-fraction": "0.5"}, dialect=Dialect.PATCHED, reserve=1024) == {
        REQ: "488Mi", POR: "0.5", DEV: GPU_0, RRT: "Fraction"}


def test_patched_reserve_leaving_half_a_mib_is_a_zero_request():
    """TestPreBindFailsWhenReserveLeavesLessThanTheRequestedFraction: (2000-1999) x 0.5 -> 0."""
    with pytest.raises(ContractViolation) as info:
        written({"gpu-fraction": "0.5"}, dialect=Dialect.PATCHED, reserve=1999)
    assert info.value.errors[0].key == REQ and "0 MiB" in info.value.errors[0].rule


def test_patched_reserve_1024_portion_limit_08_is_780mi():
    """TestPreBindSubtractsReservedGpuMemoryFromPortionLimit: 976 x 0.8 = 780.8 -> 780."""
    out = written({"gpu-fraction": "0.5", PORTION_LIMIT: "0.8"}, dialect=Dialect.PATCHED,
                  reserve=1024)
    assert out[LIM] == "780Mi"


@pytest.mark.parametrize("reserve", [2000, 4096])
def test_patched_reserve_leaving_no_memory_is_refused(reserve):
    """TestPreBindFailsWhenReserveLeavesNoGpuMemory."""
    with pytest.raises(ContractViolation) as info:
        written({"gpu-fraction": "0.5"}, dialect=Dialect.PATCHED, reserve=reserve)
    assert [e.key for e in info.value.errors] == ["reserve_mib"]


@pytest.mark.parametrize(("node_mib", "portion", "expected"), [
    (2000, "0.5", "0.5"), (2000, "0.25", "0.25"), (2000, "1", "1"),
    (40000, "0.00005", "0.00005"), (2000, "1.5", "1"),
])
def test_patched_compute_portion_from_the_received_portion(node_mib, portion, expected):
    """TestPreBindWritesComputePortionFromReceivedPortion: min(portion, 1), never exponent."""
    out = written({REQ: "1Mi"}, dialect=Dialect.PATCHED, node_mib=node_mib, portion=portion)
    assert out[POR] == expected and "e" not in out[POR]


def test_patched_compute_portion_falls_back_to_the_memory_request():
    """TestPreBindComputePortionFallsBackToMemoryRequest: 488 / (2000 - 1024) = 0.5."""
    out = written({REQ: "488Mi"}, dialect=Dialect.PATCHED, reserve=1024, portion=None)
    assert out[POR] == "0.5"


def test_patched_received_portion_wins_over_the_memory_request():
    """TestPreBindComputePortionPrefersReceivedPortionOverMemoryRequest."""
    assert written({REQ: "1900Mi"}, dialect=Dialect.PATCHED, portion="0.1")[POR] == "0.1"


def test_patched_fallback_stays_in_decimal_notation():
    """TestPreBindComputePortionFallbackStaysInDecimalNotation: 1Mi of 40000 -> 0.000025."""
    out = written({REQ: "1Mi"}, dialect=Dialect.PATCHED, node_mib=40000, portion=None)
    assert out[POR] == "0.000025"


def test_patched_fallback_is_capped_at_one():
    """TestPreBindComputePortionFallbackIsCappedAtOne: 4000Mi on a 2000 MiB GPU -> 1. Our
    binder refuses that request outright (no GPU holds it), so the cap is pinned on the
    arithmetic it shares with the binder."""
    assert compute_portion_of(4000 * MIB, 2000) == 1.0
    with pytest.raises(ContractViolation):
        written({REQ: "4000Mi"}, dialect=Dialect.PATCHED, portion=None)


def test_patched_sub_mib_request_gives_no_compute_portion():
    """TestPreBindSkipsComputePortionWhenUnresolvable (512Ki): floor(bytes / MiB) = 0, no key.
    Such a request never gets that far here: it is refused, as fractiond refuses it."""
    assert compute_portion_of(512 * 1024, 2000) == 0.0
    assert parse_pod(pod({REQ: "512Ki"}, (C,))).errors


def test_patched_self_declared_compute_portion_is_overwritten():
    """TestPreBindOverwritesSelfDeclaredComputePortionAnnotation."""
    out = written({REQ: "1000Mi", POR: "1"}, dialect=Dialect.PATCHED, portion="0.5")
    assert out[POR] == "0.5"


def test_float_truncation_as_kai_computes_it():
    """uint64(ParseFloat(label) * ParseFloat(portion)): 10000 x 0.57 is 5699.999... -> 5699."""
    assert memory_mib(10000, 0, Fraction("0.57")) == 5699
    assert written({"gpu-fraction": "0.57"}, dialect=Dialect.UPSTREAM, node_mib=10000,
                   portion="0.57")[REQ] == "5699Mi"


# -- quantities as KAI prints them ------------------------------------------------------------


@pytest.mark.parametrize(("mib", "text"), [
    (2048, "2Gi"),  # TestGpuMemoryAnnotationToNvFractionsMemoryRequest
    (1000, "1000Mi"), (488, "488Mi"), (780, "780Mi"),  # binder tests' exact strings
    (20480, "20Gi"), (1536, "1536Mi"), (1024 * 1024, "1Ti"),
])
def test_canonical_quantity(mib, text):
    assert canonical_mib(mib) == text
    assert memory_bytes(text) == mib * MIB


# -- pod requests (ParsePodGPUFractionRequest, admission TestValidate) ------------------------


def test_gpu_fraction_quarter():
    share = parse_pod(pod({"gpu-fraction": "0.25"}, (C,))).share
    assert share is not None and share.fraction == Fraction(1, 4) and share.num_devices == 1


def test_gpu_memory_2048_is_2gi():
    share = parse_pod(pod({"gpu-memory": "2048"}, (C,))).share
    assert share is not None and share.legacy_memory_bytes == memory_bytes("2Gi")


def test_nvfractions_request_with_num_devices_3():
    """Row 4 without its legacy keys: NvFractions request 1Gi, limit 2Gi, num-devices 3."""
    share = parse_pod(pod({REQ: "1Gi", LIM: "2Gi", "gpu-fraction-num-devices": "3"},
                          (C,))).share
    assert share is not None
    assert (share.request_bytes, share.limit_bytes, share.num_devices) == (1 << 30, 2 << 30, 3)


def test_nvfractions_request_with_sm_sharing():
    share = parse_pod(pod({REQ: "1Gi", f"{P}.gpu-compute.mode": "sm-sharing"}, (C,))).share
    assert share is not None and share.compute_mode.value == "sm-sharing"


@pytest.mark.parametrize("annotations", [
    {"gpu-fraction": "1.2"}, {"gpu-memory": "0"}, {"gpu-fraction": "Nan"},
    {"gpu-memory": "Nan"}, {"gpu-fraction-num-devices": "0", "gpu-fraction": "0.5"},
    {"gpu-fraction": "half"}, {"gpu-memory": "2Gi"},
    {"gpu-fraction": "0.5", "gpu-memory": "2000"},
    {REQ: "not-a-quantity"}, {REQ: "NaN"}, {REQ: ""}, {REQ: "0"}, {REQ: "-1Gi"},
    {LIM: "not-a-quantity"}, {LIM: "NaN"}, {REQ: "2Gi", LIM: "1Gi"},
    {f"{P}.gpu-memory": "1Gi"}, {"nvidia.com/container..gpu-memory.request": "1Gi"},
    {REQ: "1Gi", "nvidia.com/container.container-1.gpu-memory.request": "1Gi"},
    {REQ: "1Gi", "gpu-memory": "2000"},
    {"gpu-fraction-num-devices": "2"},
    # ParseInt(v, 10, 64) overflows (kai-scheduler/api utilities/resources/gpu_sharing.go,
    # parseNumGPUFractionDevices)
    {"gpu-fraction": "0.5", "gpu-fraction-num-devices": "9223372036854775808"},
    {REQ: "1Gi", "gpu-fraction-container-name": "container-1"},
    {"gpu-fraction": "0.5 "}, {REQ: " 1Gi"},  # no trimming on KAI's side (ParseFloat/Quantity)
    {LIM: "1Gi", "gpu-fraction": "0.5"},  # "rejects nvfractions limit combined with gpu-fraction"
    {PORTION_LIMIT: "0.8"}, {REQ: "1Gi", PORTION_LIMIT: "0.8"},  # portion limit needs gpu-fraction
    {"gpu-fraction": "0.5", PORTION_LIMIT: "0.800000"},  # 6 characters after the point
    {REQ: "1Gi", "nvidia.com/container.container-1.gpu-compute.mode": "sm-sharing"},
])
def test_what_kai_refuses_is_refused(annotations):
    """ParsePodGPUFractionRequest error rows and TestValidate's refusals."""
    assert parse_pod(pod(annotations, (C, "container-1"))).errors


@pytest.mark.parametrize("annotations", [
    {REQ: "1Gi"}, {"gpu-fraction": "0.5"}, {"gpu-memory": "2000"},
    {"gpu-memory": "2000", "gpu-fraction-container-name": C},
    {REQ: "2000Mi", "gpu-memory": "2000"},  # what KAI's mutating webhook makes of gpu-memory
    # ... of gpu-memory.limit and of gpu-fraction.limit (nvfractions/mutation.go)
    {"gpu-memory": "2000", "gpu-memory.limit": "4G", REQ: "2000Mi", LIM: "4G"},
    {"gpu-fraction": "0.5", "gpu-fraction.limit": "0.8", PORTION_LIMIT: "0.8"},
    # the fraction goes where a compute mode names (GetFractionContainerRef)
    {"gpu-fraction": "0.5", "nvidia.com/container.container-1.gpu-compute.mode": "sm-sharing"},
    {},
])
def test_what_kai_admits_is_admitted(annotations):
    assert parse_pod(pod(annotations, (C, "container-1"))).errors == ()


def test_gpu_memory_beside_an_nvfractions_limit_alone_is_the_request():
    """KAI's admission writes gpu-memory as the request when the pod has none, whatever
    limit the pod gives (KAI-Scheduler pkg/admission/webhook/v1alpha2/nvfractions/mutation.go,
    translateLegacyMemory): 2000 MiB here, not the 4 GiB limit a request defaults to."""
    share = parse_pod(pod({"gpu-memory": "2000", "gpu-memory.limit": "4Gi", LIM: "4Gi"},
                          (C,))).share
    assert share is not None
    assert (share.node_request_bytes, share.node_limit_bytes) == (2000 * MIB, 4 << 30)


def test_the_largest_device_count_kai_reads_is_admitted():
    share = parse_pod(pod({"gpu-fraction": "0.5",
                           "gpu-fraction-num-devices": "9223372036854775807"}, (C,))).share
    assert share is not None and share.num_devices == (1 << 63) - 1


@pytest.mark.parametrize(("annotations", "containers", "init", "target"), [
    ({}, (C, "container-1"), (), C),
    ({"gpu-fraction-container-name": "container-1"}, (C, "container-1"), (), "container-1"),
    ({"gpu-fraction-container-name": "init-container"}, (C,), ("init-container",),
     "init-container"),
    ({"nvidia.com/container.container-1.gpu-memory.request": "1Gi"}, (C, "container-1"), (),
     "container-1"),
    ({"gpu-fraction-container-name": "container-1",
      "nvidia.com/container.container-1.gpu-memory.request": "1Gi"}, (C, "container-1"), (),
     "container-1"),
])
def test_the_fraction_container(annotations, containers, init, target):
    """GetFractionContainerRef rows (with a fraction to place)."""
    annotations = {"gpu-fraction": "0.5", **annotations} if not any(
        key.startswith("nvidia.com/") for key in annotations) else annotations
    request = parse_pod(pod(annotations, containers, init=init))
    assert request.errors == () and request.share is not None
    assert request.share.container == target


def test_a_container_name_that_does_not_exist_is_refused():
    request = parse_pod(pod({"gpu-fraction": "0.5",
                             "gpu-fraction-container-name": "non-existent"}, (C,)))
    assert [e.key for e in request.errors] == ["gpu-fraction-container-name"]


# -- the node side: MiB and the active-thread percentage (fractiond) ---------------------------


@pytest.mark.parametrize(("text", "mib"), [
    ("4Gi", 4096), ("2048Mi", 2048), ("7680Mi", 7680), ("1Gi", 1024), ("512Mi", 512),
    ("100Mi", 100), ("1000Mi", 1000), ("100M", 96), ("1024Ki", 1), ("4096M", 3907),
    ("1024M", 977), ("1000M", 954), ("500M", 477), ("1G", 954), ("5G", 4769),
    ("4294967296", 4096), ("2048M", 1954),
    # not whole bytes: quantityToMemoryMiB takes qty.Value() (rounded up) first
    ("2.3Gi", 2356), ("1.2Gi", 1229), ("7.8Gi", 7988), ("0.3Gi", 308), ("10.3Mi", 11),
])
def test_node_mib_rounds_up(text, mib):
    """TestParseToMemoryMiB: whole MiB, rounding up; our plan's request and limit agree. KAI's
    admission accepts any positive quantity (kai-scheduler/api,
    utilities/resources/gpu_sharing_nvfractions.go, parseNvFractionsAnnotationValue)."""
    assert mib_ceil(memory_bytes(text)) == mib
    (plan,) = plan_pod(parse_pod(pod({REQ: text, DEV: GPU_0}, (C,))))
    assert (plan.request_mib, plan.limit_mib) == (mib, mib)


@pytest.mark.parametrize("text", ["1M", "4096", "0", "500Ki", "1048575", "", "  2048Mi  ",
                                  "notanumber"])
def test_node_refuses_what_fractiond_refuses(text):
    assert parse_pod(pod({LIM: text}, (C,))).errors


@pytest.mark.parametrize(("portion", "atp"), [
    ("0.5", 50), ("1", 100), ("1.0", 100), ("0.333", 33), ("0.125", 13), ("0.005", 1),
    ("0.0049", 1), ("0.0000001", 1), ("1e-3", 1), ("5e-1", 50),
])
def test_active_thread_percentage_of_a_patched_portion(portion, atp):
    """TestParseComputePortion, where fractiond's floor and our round-half-up agree except
    `0.125` (fractiond 12, ours 13) and `0.336`/`0.29` (33/28 there, 34/29 here): the contract
    rounds; README "choices" says so."""
    assert active_thread_percentage(Fraction(portion)) == atp
    _, bound = bind(pod({REQ: "1Gi", f"{P}.gpu-compute.mode": "sm-sharing"}, (C,), uid="u"),
                    decision(40960, portion=portion, dialect=Dialect.PATCHED))
    (plan,) = plan_pod(bound)
    assert plan.active_thread_percentage == atp


@pytest.mark.parametrize("value", ["50", "100", "1.5", "1.0000001", "0", "0.0", "-0.5", "-0",
                                   "", "   ", "abc", "50%", "500m", "NaN", "nan", "Inf",
                                   "+Infinity", "-Inf"])
def test_a_malformed_portion_on_the_pod_is_refused(value):
    """TestParseComputePortion's error rows."""
    assert parse_pod(pod({REQ: "1Gi", POR: value, DEV: GPU_0,
                          f"{P}.gpu-compute.mode": "sm-sharing"}, (C,))).errors


def test_no_portion_means_no_compute_cap():
    """TestCreateContainerInjectsMPSEnforcementCaps ("limit 4Gi, no portion"): no cap. The
    plan says 100 (all SMs) explicitly, so the env a downward-API reference reads is never
    empty."""
    (plan,) = plan_pod(parse_pod(pod({LIM: "4Gi", DEV: GPU_0,
                                      f"{P}.gpu-compute.mode": "sm-sharing"}, (C,), uid="u")))
    assert plan.active_thread_percentage == 100
    assert (plan.request_mib, plan.limit_mib, plan.pinned_mem_limit) == (4096, 4096, "0=4096M")
