"""The node-side plan: env values, memory in bytes, compute mode, ATP, derived annotations."""

from __future__ import annotations

from fractions import Fraction

import pytest

from kai_fractions.contract import (
    ComputeMode,
    ContractViolation,
    Keys,
    active_thread_percentage,
    derived_annotations,
    env_sources,
    parse_pod,
    plan_pod,
)

from .builders import GPU_A, GPU_B, bind, decision, patched, pod

MIB = 1 << 20
REQ = "nvidia.com/container.main.gpu-memory.request"
LIM = "nvidia.com/container.main.gpu-memory.limit"
DEV = "nvidia.com/container.main.gpus.devices"
POR = "nvidia.com/container.main.gpu-compute.portion"
MODE = "nvidia.com/container.main.gpu-compute.mode"


def planned(annotations: dict, d=None, *, uid: str = "", keys: Keys | None = None):
    view = pod(annotations, uid=uid)
    written, bound = bind(view, d or decision(), keys)
    (plan,) = plan_pod(bound, keys=keys or Keys())
    merged = {**view.annotations, **written, **derived_annotations(plan, keys or Keys())}
    return plan, merged


def test_time_slicing_env_exactly() -> None:
    plan, _ = planned({"gpu-fraction": "0.5"}, decision(2000, portion="0.5"))
    assert plan.env == {
        "NVIDIA_VISIBLE_DEVICES": GPU_A,
        "NVIDIA_GPU_MEMORY_REQUEST": "1000",
        "NVIDIA_GPU_MEMORY_LIMIT": "1000",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=1000M",
    }
    assert plan.compute_mode is ComputeMode.TIME_SLICING
    assert plan.active_thread_percentage is None
    assert plan.mps_namespace is None
    assert plan.mps_pipe_directory is None
    assert plan.request_bytes == 1000 * MIB
    assert plan.limit_bytes == 1000 * MIB
    assert plan.device_uuids == (GPU_A,)


def test_sm_sharing_half_gives_atp_50_and_a_pipe_directory() -> None:
    plan, _ = planned({"gpu-fraction": "0.5", MODE: "sm-sharing"}, patched(), uid="uid-1")
    assert plan.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    assert plan.active_thread_percentage == 50
    pipe = plan.env["CUDA_MPS_PIPE_DIRECTORY"]
    assert pipe == plan.mps_pipe_directory
    assert pipe.startswith("/run/kai-fractions/mps/")
    assert pipe.endswith("/" + str(plan.mps_namespace))
    assert len(pipe.encode()) <= 83
    assert set(plan.env) == {
        "NVIDIA_VISIBLE_DEVICES",
        "NVIDIA_GPU_MEMORY_REQUEST",
        "NVIDIA_GPU_MEMORY_LIMIT",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
        "CUDA_MPS_PIPE_DIRECTORY",
    }


def test_mps_namespace_is_a_short_stable_name() -> None:
    a, _ = planned({"gpu-fraction": "0.5", MODE: "sm-sharing"}, uid="uid-1")
    b, _ = planned({"gpu-fraction": "0.5", MODE: "sm-sharing"}, uid="uid-1")
    c, _ = planned({"gpu-fraction": "0.5", MODE: "sm-sharing"}, uid="uid-2")
    assert a.mps_namespace == b.mps_namespace != c.mps_namespace
    assert a.mps_namespace is not None
    assert all(ch.isalnum() or ch == "_" for ch in a.mps_namespace)
    assert a.mps_namespace == a.mps_namespace.lower()


NS = "kai-fractions.io/container.main.mps-namespace"


def test_the_namespace_the_admission_webhook_named_wins_over_the_uid() -> None:
    """The webhook names it at CREATE (the pod has no UID then) and mounts only that
    directory; every plan of the pod (mirror, agent, gate) must name the same one."""
    plan, merged = planned({"gpu-fraction": "0.5", MODE: "sm-sharing", NS: "kf_" + "5a" * 10},
                           uid="uid-1")
    assert plan.mps_namespace == "kf_" + "5a" * 10
    assert plan.env["CUDA_MPS_PIPE_DIRECTORY"] == (
        "/run/kai-fractions/mps/shared/kf_5a5a5a5a5a5a5a5a5a5a")
    other, _ = planned({"gpu-fraction": "0.5", MODE: "sm-sharing"}, uid="uid-1")
    assert other.digest != plan.digest
    assert merged[NS] == "kf_" + "5a" * 10  # the binder and the plan leave it alone


@pytest.mark.parametrize("value", ["", "kf_5A5A5A5A5A5A5A5A5A5A", "kf_5a", "../legacy",
                                   "kf_" + "5a" * 10 + "\n"])
def test_a_malformed_admitted_namespace_is_a_contract_error(value: str) -> None:
    parsed = parse_pod(pod({"gpu-fraction": "0.5", MODE: "sm-sharing", NS: value}))
    assert [(e.key, e.rule) for e in parsed.errors] == [(NS, (
        "must be kf_ and 20 lowercase hex digits, as the admission webhook names an MPS "
        "namespace"))]


def test_an_admitted_namespace_on_a_time_slicing_container_changes_nothing() -> None:
    plan, _ = planned({"gpu-fraction": "0.5", NS: "kf_" + "5a" * 10})
    assert plan.mps_namespace is None and "CUDA_MPS_PIPE_DIRECTORY" not in plan.env


@pytest.mark.parametrize(
    ("portion", "atp"),
    [("0.001", 1), ("0.004", 1), ("0.005", 1), ("0.006", 1), ("0.01", 1), ("0.014", 1),
     ("0.015", 2), ("0.125", 13), ("0.5", 50), ("0.994", 99), ("0.995", 100), ("1", 100)],
)
def test_active_thread_percentage_is_1_to_100_never_0(portion: str, atp: int) -> None:
    assert active_thread_percentage(Fraction(portion)) == atp


def test_portion_0001_gives_atp_1_through_the_binder() -> None:
    plan, merged = planned({REQ: "1Gi", MODE: "sm-sharing"}, patched(40960, portion="0.001"))
    assert merged[POR] == "0.001"
    assert plan.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "1"


def test_multi_device_pinned_limit_by_ordinal_inside_the_container() -> None:
    plan, merged = planned(
        {"gpu-fraction": "0.5", "gpu-fraction-num-devices": "2"},
        decision(2000, gpus=(GPU_A, GPU_B), portion="0.5"),
    )
    assert merged[DEV] == f"{GPU_A},{GPU_B}"
    assert plan.env["NVIDIA_VISIBLE_DEVICES"] == f"{GPU_A},{GPU_B}"
    assert plan.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=1000M,1=1000M"
    assert plan.device_uuids == (GPU_A, GPU_B)


def test_cdi_devices_are_verbatim_in_env_and_plain_in_uuids() -> None:
    plan, _ = planned({"gpu-fraction": "0.5"}, decision(2000, portion="0.5", cdi=True))
    assert plan.env["NVIDIA_VISIBLE_DEVICES"] == f"k8s.device-plugin.nvidia.com/gpu={GPU_A}"
    assert plan.device_uuids == (GPU_A,)
    assert plan.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=1000M"


def test_limit_from_gpu_fraction_limit() -> None:
    plan, _ = planned(
        {"gpu-fraction": "0.5", "gpu-fraction.limit": "0.8"}, decision(2000, reserve=1024)
    )
    assert (plan.request_mib, plan.limit_mib) == (488, 780)
    assert plan.env["NVIDIA_GPU_MEMORY_REQUEST"] == "488"
    assert plan.env["NVIDIA_GPU_MEMORY_LIMIT"] == "780"
    assert plan.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=780M"


def test_limit_from_kai_portion_limit_key_survives_the_bind() -> None:
    """After the binder turns `kai.scheduler/container.<c>.gpu-memory.portion.limit` into an
    absolute `.gpu-memory.limit`, the bound pod (both keys present) is still valid and the node
    plans the binder's limit: the binder's absolute limit takes precedence."""
    plan, merged = planned(
        {"gpu-fraction": "0.5", "kai.scheduler/container.main.gpu-memory.portion.limit": "0.8"},
        decision(2000, reserve=1024),
    )
    assert merged[LIM] == "780Mi"
    assert (plan.request_mib, plan.limit_mib) == (488, 780)


def test_gpu_fraction_is_planned_on_the_container_a_compute_mode_names() -> None:
    """The binder (ours, or KAI's: GetFractionContainerRef) writes the request and the devices
    for the container the mode names, and the node plans that one, in sm-sharing."""
    mode = "nvidia.com/container.trainer.gpu-compute.mode"
    view = pod({"gpu-fraction": "0.5", mode: "sm-sharing"}, ("sidecar", "trainer"))
    written, bound = bind(view, decision(2000, portion="0.5"))
    assert set(written) >= {"nvidia.com/container.trainer.gpu-memory.request",
                            "nvidia.com/container.trainer.gpus.devices"}
    (plan,) = plan_pod(bound, keys=Keys())
    assert (plan.container, plan.compute_mode, plan.request_mib) == (
        "trainer", ComputeMode.SM_SHARING, 1000)


def test_decimal_units_round_up_to_whole_mib() -> None:
    plan, _ = planned({REQ: "1000M", LIM: "1500M"}, decision(2000, portion=None))
    assert (plan.request_mib, plan.limit_mib) == (954, 1431)
    assert plan.request_bytes == 954 * MIB


def test_only_limit_plans_request_equal_to_limit() -> None:
    plan, _ = planned({LIM: "1Gi"}, decision(20000, portion=None))
    assert (plan.request_mib, plan.limit_mib) == (1024, 1024)


def test_only_request_plans_limit_equal_to_request() -> None:
    plan, _ = planned({REQ: "1Gi"}, decision(20000, portion=None))
    assert (plan.request_mib, plan.limit_mib) == (1024, 1024)


@pytest.mark.parametrize(
    "annotations",
    [
        {"gpu-fraction": "0.5"},
        {"gpu-fraction": "0.5", MODE: "sm-sharing"},
        {REQ: "300Mi", LIM: "900Mi", MODE: "sm-sharing"},
        {"gpu-memory": "700", "gpu-memory.limit": "1Gi"},
        {"gpu-fraction": "0.5", "gpu-fraction.limit": "0.75", MODE: "time-slicing"},
    ],
)
@pytest.mark.parametrize("cdi", [False, True])
def test_env_sources_agree_with_env(annotations: dict, cdi: bool) -> None:
    plan, merged = planned(annotations, decision(2000, portion="0.5", cdi=cdi), uid="u-1")
    sources = env_sources("main", plan.compute_mode)
    assert set(sources) == set(plan.env)
    for var, value in plan.env.items():
        assert merged[sources[var]] == value, var


def test_env_sources_exact_keys() -> None:
    assert env_sources("main", ComputeMode.SM_SHARING) == {
        "NVIDIA_VISIBLE_DEVICES": "nvidia.com/container.main.gpus.devices",
        "NVIDIA_GPU_MEMORY_REQUEST": "kai-fractions.io/container.main.memory-request-mib",
        "NVIDIA_GPU_MEMORY_LIMIT": "kai-fractions.io/container.main.memory-limit-mib",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "kai-fractions.io/container.main.mps-pinned-mem-limit",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE":
            "kai-fractions.io/container.main.mps-active-thread-percentage",
        "CUDA_MPS_PIPE_DIRECTORY": "kai-fractions.io/container.main.mps-pipe-directory",
    }
    assert set(env_sources("main", ComputeMode.TIME_SLICING)) == {
        "NVIDIA_VISIBLE_DEVICES",
        "NVIDIA_GPU_MEMORY_REQUEST",
        "NVIDIA_GPU_MEMORY_LIMIT",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
    }


def test_derived_annotations_carry_the_digest() -> None:
    plan, merged = planned({"gpu-fraction": "0.5"})
    assert merged["kai-fractions.io/container.main.plan-digest"] == plan.digest
    assert plan.digest.startswith("sha256:") and len(plan.digest) == 7 + 64


def test_digest_changes_with_what_is_enforced() -> None:
    a, _ = planned({"gpu-fraction": "0.5"}, decision(2000))
    b, _ = planned({"gpu-fraction": "0.5"}, decision(4000))
    c, _ = planned({"gpu-fraction": "0.5"}, decision(2000))
    assert a.digest == c.digest != b.digest


def test_to_dict_shape() -> None:
    plan, _ = planned({"gpu-fraction": "0.5", MODE: "sm-sharing"}, patched(), uid="u")
    assert plan.to_dict() == {
        "env": plan.env,
        "memory": {"request_bytes": 1000 * MIB, "limit_bytes": 1000 * MIB},
        "compute": {"mode": "sm-sharing", "active_thread_percentage": 50},
        "devices": [GPU_A],
    }


def test_pod_supplied_env_values_are_not_read() -> None:
    # Only annotations feed the plan; a value the user put in a derived key is replaced.
    plan, merged = planned({"gpu-fraction": "0.5",
                            "kai-fractions.io/container.main.memory-limit-mib": "999999"})
    assert merged["kai-fractions.io/container.main.memory-limit-mib"] == "1000"
    assert plan.env["NVIDIA_GPU_MEMORY_LIMIT"] == "1000"


def test_unbound_pod_cannot_be_planned() -> None:
    with pytest.raises(ContractViolation) as info:
        plan_pod(parse_pod(pod({"gpu-fraction": "0.5"})))
    assert [e.key for e in info.value.errors] == [DEV, REQ]


def test_sm_sharing_bound_by_upstream_kai_has_no_compute_cap() -> None:
    # Upstream KAI main writes no `.gpu-compute.portion` (pkg/binder/plugins/nvfractions/
    # nv_fractions.go): the container gets its own MPS namespace and memory cap, and all SMs.
    plan, merged = planned({"gpu-fraction": "0.5", MODE: "sm-sharing"}, uid="u")
    assert POR not in merged
    assert plan.active_thread_percentage == 100
    assert plan.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "100"
    assert plan.mps_namespace and plan.env["CUDA_MPS_PIPE_DIRECTORY"] == plan.mps_pipe_directory
    assert plan.limit_mib == 1000


def test_long_pipe_root_is_refused() -> None:
    view = pod({"gpu-fraction": "0.5", MODE: "sm-sharing"})
    _, bound = bind(view, decision())
    with pytest.raises(ContractViolation) as info:
        plan_pod(bound, mps_pipe_root="/" + "x" * 80)
    assert [e.key for e in info.value.errors] == ["mps_pipe_root"]


def test_invalid_pod_cannot_be_planned() -> None:
    with pytest.raises(ContractViolation):
        plan_pod(parse_pod(pod({REQ: "0", DEV: GPU_A})))


def test_non_fractional_pod_has_no_plan() -> None:
    assert plan_pod(parse_pod(pod({}))) == ()
