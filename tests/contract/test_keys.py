"""Every key string, label, value and env name of the contract, pinned as literal text.

The expected strings are typed here from the contract doc on purpose (never imported), so a
change in kai_fractions/contract/keys.py that drifts from KAI's spelling fails a test.
"""

from __future__ import annotations

import pytest

from kai_fractions.contract import DEFAULT_KEYS, ComputeMode, Keys
from kai_fractions.contract import keys as k


def test_default_prefix() -> None:
    assert k.DEFAULT_PREFIX == "nvidia.com/container."
    assert Keys().prefix == "nvidia.com/container."
    assert DEFAULT_KEYS.prefix == "nvidia.com/container."


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("MEMORY_REQUEST", ".gpu-memory.request"),
        ("MEMORY_LIMIT", ".gpu-memory.limit"),
        ("COMPUTE_MODE", ".gpu-compute.mode"),
        ("DEVICES", ".gpus.devices"),
        ("COMPUTE_PORTION", ".gpu-compute.portion"),
    ],
)
def test_per_container_suffixes(name: str, expected: str) -> None:
    assert getattr(k, name) == expected


def test_suffix_groups() -> None:
    assert set(k.USER_SUFFIXES) == {".gpu-memory.request", ".gpu-memory.limit", ".gpu-compute.mode"}
    assert set(k.BINDER_SUFFIXES) == {".gpus.devices", ".gpu-compute.portion"}
    assert set(k.SUFFIXES) == set(k.USER_SUFFIXES) | set(k.BINDER_SUFFIXES)


def test_full_per_container_keys() -> None:
    keys = Keys()
    assert keys.container("main", k.MEMORY_REQUEST) == (
        "nvidia.com/container.main.gpu-memory.request"
    )
    assert keys.container("main", k.MEMORY_LIMIT) == "nvidia.com/container.main.gpu-memory.limit"
    assert keys.container("main", k.COMPUTE_MODE) == "nvidia.com/container.main.gpu-compute.mode"
    assert keys.container("main", k.DEVICES) == "nvidia.com/container.main.gpus.devices"
    assert keys.container("main", k.COMPUTE_PORTION) == (
        "nvidia.com/container.main.gpu-compute.portion"
    )
    assert keys.portion_limit("main") == "kai.scheduler/container.main.gpu-memory.portion.limit"


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("GPU_FRACTION", "gpu-fraction"),
        ("GPU_FRACTION_LIMIT", "gpu-fraction.limit"),
        ("GPU_MEMORY", "gpu-memory"),
        ("GPU_MEMORY_LIMIT", "gpu-memory.limit"),
        ("GPU_FRACTION_NUM_DEVICES", "gpu-fraction-num-devices"),
        ("GPU_FRACTION_CONTAINER_NAME", "gpu-fraction-container-name"),
        ("RECEIVED_RESOURCE_TYPE", "received-resource-type"),
        ("PORTION_LIMIT_PREFIX", "kai.scheduler/container."),
        ("PORTION_LIMIT_SUFFIX", ".gpu-memory.portion.limit"),
        ("LEGACY_COMPUTE_MODE", "kai.scheduler/gpu-compute-sharing-mode"),
        ("RESERVE_FOR_GPU", "run.ai/reserve_for_gpu_index"),
    ],
)
def test_pod_level_and_legacy_annotations(name: str, expected: str) -> None:
    assert getattr(k, name) == expected


def test_legacy_pod_keys_are_the_six_legacy_annotations() -> None:
    assert set(k.LEGACY_POD_KEYS) == {
        "gpu-fraction",
        "gpu-fraction.limit",
        "gpu-memory",
        "gpu-memory.limit",
        "gpu-fraction-num-devices",
        "gpu-fraction-container-name",
    }


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("GPU_GROUP_LABEL", "runai-gpu-group"),
        ("QUEUE_LABEL", "kai.scheduler/queue"),
        ("NODE_GPU_MEMORY_LABEL", "nvidia.com/gpu.memory"),
    ],
)
def test_labels(name: str, expected: str) -> None:
    assert getattr(k, name) == expected


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("RESOURCE_TYPE_REGULAR", "Regular"),
        ("RESOURCE_TYPE_FRACTION", "Fraction"),
        ("WHOLE_GPU_RESOURCE", "nvidia.com/gpu"),
        ("CDI_DEVICE_PREFIX", "k8s.device-plugin.nvidia.com/gpu="),
        ("KAI_BINDER_IDENTITY", "system:serviceaccount:kai-scheduler:binder"),
        ("KAI_SCHEDULER_NAME", "kai-scheduler"),
    ],
)
def test_values(name: str, expected: str) -> None:
    assert getattr(k, name) == expected


def test_compute_modes() -> None:
    assert ComputeMode.TIME_SLICING.value == "time-slicing"
    assert ComputeMode.SM_SHARING.value == "sm-sharing"
    assert {m.value for m in ComputeMode} == {"time-slicing", "sm-sharing"}


def test_node_conditions() -> None:
    assert k.NODE_CONDITION == "gpu-fractioning.nvidia.com/Ready"
    assert k.LEGACY_NODE_CONDITION == "gpu-sharing.nvidia.com/Ready"


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("ENV_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"),
        ("ENV_MEMORY_REQUEST", "NVIDIA_GPU_MEMORY_REQUEST"),
        ("ENV_MEMORY_LIMIT", "NVIDIA_GPU_MEMORY_LIMIT"),
        ("ENV_PINNED_MEM_LIMIT", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"),
        ("ENV_ACTIVE_THREAD_PERCENTAGE", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
        ("ENV_PIPE_DIRECTORY", "CUDA_MPS_PIPE_DIRECTORY"),
    ],
)
def test_env_names(name: str, expected: str) -> None:
    assert getattr(k, name) == expected


def test_enforced_env_is_exactly_the_six_variables() -> None:
    assert set(k.ENFORCED_ENV) == {
        "NVIDIA_VISIBLE_DEVICES",
        "NVIDIA_GPU_MEMORY_REQUEST",
        "NVIDIA_GPU_MEMORY_LIMIT",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
        "CUDA_MPS_PIPE_DIRECTORY",
    }


def test_split_is_unambiguous_after_the_prefix() -> None:
    keys = Keys()
    assert keys.split("nvidia.com/container.main.gpu-memory.request") == (
        "main",
        ".gpu-memory.request",
    )
    assert keys.split("nvidia.com/container.my-app-2.gpus.devices") == ("my-app-2", ".gpus.devices")
    assert keys.split("nvidia.com/container.main") == ("main", "")
    assert keys.split("nvidia.com/container..gpu-memory.request") == ("", ".gpu-memory.request")
    assert keys.split("gpu-fraction") is None
    assert keys.split_portion_limit("kai.scheduler/container.main.gpu-memory.portion.limit") == (
        "main"
    )
    assert keys.split_portion_limit("kai.scheduler/container.main.gpu-memory.limit") is None


def test_binder_owned_and_protected_keys() -> None:
    keys = Keys()
    assert keys.is_binder_owned("nvidia.com/container.main.gpus.devices")
    assert keys.is_binder_owned("nvidia.com/container.main.gpu-compute.portion")
    assert not keys.is_binder_owned("nvidia.com/container.main.gpu-memory.request")
    assert not keys.is_binder_owned("nvidia.com/container.main.gpu-memory.limit")
    assert not keys.is_binder_owned("nvidia.com/container.main.gpu-compute.mode")
    assert keys.is_protected("nvidia.com/container.main.gpus.devices")
    assert keys.is_protected("kai-fractions.io/container.main.memory-limit-mib")
    assert not keys.is_protected("gpu-fraction")


def test_custom_prefix_moves_every_per_container_key() -> None:
    keys = Keys(prefix="gpu.example.com/c.")
    assert keys.container("main", k.DEVICES) == "gpu.example.com/c.main.gpus.devices"
    assert keys.split("gpu.example.com/c.main.gpu-compute.mode") == ("main", ".gpu-compute.mode")
    assert keys.split("nvidia.com/container.main.gpu-compute.mode") is None
    # The portion-limit key is KAI's own, not under the configurable prefix.
    assert keys.portion_limit("main") == "kai.scheduler/container.main.gpu-memory.portion.limit"


@pytest.mark.parametrize("bad", ["", "nvidia.com/container", "container.", "nvidia.com"])
def test_bad_prefix_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="prefix"):
        Keys(prefix=bad)


@pytest.mark.parametrize("prefix", ["kai-fractions.io/container.", "kai-fractions.io/container.x."])
def test_a_prefix_over_the_derived_keys_is_refused(prefix: str) -> None:
    """The derived keys would read as the user's and the binder's."""
    with pytest.raises(ValueError, match="overlaps the keys kai_fractions derives"):
        Keys(prefix=prefix)


def test_container_names_are_dns_labels() -> None:
    assert k.is_container_name("main")
    assert k.is_container_name("a" * 63)
    assert not k.is_container_name("a" * 64)
    assert not k.is_container_name("Main")
    assert not k.is_container_name("ma.in")
    assert not k.is_container_name("-main")
    assert not k.is_container_name("")
