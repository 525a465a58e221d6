"""Every key kai_fractions writes for a container is one Kubernetes accepts, whatever the
container's name (a DNS label: up to 63 characters), while KAI's own keys stay exactly KAI's.

kai_fractions' per-container keys are `kai-fractions.io/container.<id><suffix>`: the id is the
name itself when every such key fits (a name of at most 24), so keys of ordinary names are
byte-for-byte those of earlier releases; a longer name gets a shortened, deterministic id. A
name too long for KAI's own keys is refused by the contract, naming the key, the rule and the
longest name that fits (KAI itself checks no length, and its binder's patch would fail)."""

from __future__ import annotations

import hashlib
import re

import pytest

from kai_fractions.contract import (
    DEFAULT_KEYS,
    ComputeMode,
    ContainerShare,
    ContractViolation,
    Keys,
    binder_annotations,
    derived_annotations,
    env_sources,
    parse_pod,
    plan_container,
)
from kai_fractions.contract import keys as k
from kai_fractions.signing import signature_key

from .builders import GPU_A, decision, patched, pod

# Kubernetes' rule for an annotation key (apimachinery IsQualifiedName of the lower-cased key),
# typed here on purpose.
_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def is_valid_key(key: str) -> bool:
    parts = key.lower().split("/")
    if len(parts) > 2:
        return False
    if len(parts) == 2 and not (len(parts[0]) <= 253 and _SUBDOMAIN.fullmatch(parts[0])):
        return False
    return len(parts[-1]) <= 63 and _NAME.fullmatch(parts[-1]) is not None


KAI_LONGEST = 63 - len("container.") - len(".gpu-compute.portion")
"""33: the longest container name every KAI's keys hold with the default prefix."""
UPSTREAM_LONGEST = 63 - len("container.") - len(".gpu-memory.request")
"""34: the longest upstream KAI's keys hold (it writes no `.gpu-compute.portion`)."""
NAMES = [
    "main",
    "a" * 24,  # the longest that is its own id
    "b" * 25,
    "tensorrt-llm-inference-server",  # 29: fine with KAI
    "c" * KAI_LONGEST,
    "d" * UPSTREAM_LONGEST,
    "e" * 63,  # the longest a container may have
]


def sm_plan(container: str):
    share = ContainerShare(container=container, request_bytes=8 << 30, limit_bytes=8 << 30,
                           devices=(GPU_A,), devices_value=GPU_A,
                           compute_mode=ComputeMode.SM_SHARING,
                           mps_namespace="kf_" + "5a" * 10, source_key="x")
    return plan_container(share, "uid-1")


@pytest.mark.parametrize("name", NAMES, ids=len)
def test_every_key_kai_fractions_writes_is_valid(name: str):
    keys = DEFAULT_KEYS
    plan = sm_plan(name)
    sources = env_sources(name, ComputeMode.SM_SHARING, keys)
    # The devices are KAI's key (checked below, for the names KAI takes); the rest are ours.
    assert sources.pop("NVIDIA_VISIBLE_DEVICES") == f"nvidia.com/container.{name}.gpus.devices"
    written = [
        *(keys.derived(name, suffix) for suffix in k.PROJECT_SUFFIXES),
        *derived_annotations(plan, keys),
        *sources.values(),
        signature_key(plan, keys),
    ]
    assert set(derived_annotations(plan, keys)) == {
        keys.derived(name, s) for s in k.DERIVED_SUFFIXES}
    bad = [key for key in written if not is_valid_key(key)]
    assert bad == []


@pytest.mark.parametrize("name", [n for n in NAMES if len(n) <= KAI_LONGEST], ids=len)
def test_kais_own_keys_are_kais_and_valid_for_the_names_kai_accepts(name: str):
    for suffix in k.SUFFIXES:
        key = DEFAULT_KEYS.container(name, suffix)
        assert key == f"nvidia.com/container.{name}{suffix}"
        assert is_valid_key(key)


def test_keys_of_names_that_fit_are_unchanged_byte_for_byte():
    """Pods in flight during an upgrade keep their keys."""
    assert DEFAULT_KEYS.derived("main", ".mps-active-thread-percentage") == (
        "kai-fractions.io/container.main.mps-active-thread-percentage")
    fits = "x" * 24
    for suffix in k.PROJECT_SUFFIXES:
        assert DEFAULT_KEYS.derived(fits, suffix) == f"kai-fractions.io/container.{fits}{suffix}"


def test_a_long_name_gets_a_short_deterministic_id_no_container_can_have():
    name = "tensorrt-llm-inference-server"
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    assert DEFAULT_KEYS.container_id(name) == "tensorrt-llm-in_" + digest
    assert DEFAULT_KEYS.derived(name, ".plan-digest") == (
        f"kai-fractions.io/container.tensorrt-llm-in_{digest}.plan-digest")
    assert Keys().container_id(name) == DEFAULT_KEYS.container_id(name)
    # Two names with the same head differ; an id is never a container name (it holds '_').
    twin = "tensorrt-llm-inference-server-2"
    assert DEFAULT_KEYS.container_id(twin) != DEFAULT_KEYS.container_id(name)
    assert not k.is_container_name(DEFAULT_KEYS.container_id(name))
    assert len(DEFAULT_KEYS.container_id("e" * 63)) == 24


def test_a_derived_key_maps_back_to_its_container_by_derived_not_by_parsing():
    long, other = "tensorrt-llm-inference-server", "sidecar"
    key = DEFAULT_KEYS.derived(long, ".signature")
    assert DEFAULT_KEYS.derived_container(key, [other, long]) == long
    assert DEFAULT_KEYS.derived_container(key, [other]) is None  # unknown: not read back
    assert DEFAULT_KEYS.derived_container(
        DEFAULT_KEYS.derived("main", ".signature"), [other]) == "main"  # its own id
    assert DEFAULT_KEYS.derived_container(DEFAULT_KEYS.container("main", k.DEVICES),
                                          ["main"]) is None


def test_a_project_prefix_without_room_for_a_shortened_id_is_refused():
    # 63 - 29 (the longest project suffix) - 10 (one character, '_', 8 hex digits) = 24
    with pytest.raises(ValueError, match="it may be at most 24 characters"):
        Keys(project_prefix="example.com/" + "p" * 24 + ".")
    Keys(project_prefix="example.com/" + "p" * 23 + ".")


def _parse(name: str, notes: dict[str, str]):
    return parse_pod(pod(notes, containers=(name, "sidecar")))


def test_a_name_too_long_for_kais_request_key_is_refused_naming_key_rule_and_fit():
    name = "f" * (UPSTREAM_LONGEST + 1)
    request = _parse(name, {"gpu-fraction": "0.5", "gpu-fraction-container-name": name})
    (error,) = request.errors
    assert error.key == f"nvidia.com/container.{name}.gpu-memory.request"
    assert error.container == name
    assert error.rule == (
        f"container {name!r} has a 35-character name, too long for this key: Kubernetes "
        "refuses an annotation key whose name (after the '/') is over 63 characters, and this "
        "one's is 64; KAI's binder writes it when it binds the pod (or the user does), so KAI "
        "cannot bind the pod. Name the fractional container with at most 34 characters")


def test_the_portion_limit_kai_writes_from_gpu_fraction_limit_is_checked_too():
    name = "g" * 29  # kai.scheduler/container.<29>.gpu-memory.portion.limit: 64
    request = _parse(name, {"gpu-fraction": "0.25", "gpu-fraction.limit": "0.5",
                            "gpu-fraction-container-name": name})
    (error,) = request.errors
    assert error.key == f"kai.scheduler/container.{name}.gpu-memory.portion.limit"
    assert "KAI's admission writes it from gpu-fraction.limit" in error.rule
    assert error.rule.endswith("at most 28 characters")
    assert _parse("g" * 28, {"gpu-fraction": "0.25", "gpu-fraction.limit": "0.5",
                             "gpu-fraction-container-name": "g" * 28}).errors == ()


def test_a_name_only_the_patched_binders_portion_key_cannot_hold_is_a_warning():
    name = "h" * UPSTREAM_LONGEST
    request = _parse(name, {"gpu-fraction": "0.5", "gpu-fraction-container-name": name})
    assert request.errors == ()
    (warning,) = request.warnings
    assert warning.key == f"nvidia.com/container.{name}.gpu-compute.portion"
    assert "patched KAI binder" in warning.rule and "at most 33 characters" in warning.rule


def test_names_kai_takes_parse_as_before():
    for name in ("c" * KAI_LONGEST, "tensorrt-llm-inference-server"):
        request = _parse(name, {"gpu-fraction": "0.5", "gpu-fraction-container-name": name})
        assert (request.errors, request.warnings) == ((), ())
        assert request.share is not None and request.share.container == name


def test_a_long_non_fractional_container_changes_nothing():
    request = parse_pod(pod({"gpu-fraction": "0.5"}, containers=("main", "z" * 63)))
    assert (request.errors, request.warnings) == ((), ())


def test_a_configured_prefix_sets_the_fit():
    keys = Keys(prefix="gpu.example.com/c.")  # name part "c." (2): 63 - 2 - 19 = 42
    name = "q" * 43
    request = parse_pod(pod({"gpu-fraction": "0.5"}, containers=(name,)), keys)
    (error,) = request.errors
    assert error.key == f"gpu.example.com/c.{name}.gpu-memory.request"
    assert error.rule.endswith("at most 42 characters")


def test_the_patched_binders_portion_key_refuses_a_name_it_cannot_hold() -> None:
    """34 characters fit every key upstream KAI writes but not the patched binder's
    `.gpu-compute.portion` (33 at most): the mirror refuses that decision, naming the key and
    the rule, rather than send a patch the API server refuses whole."""
    name = "p" * 34
    view = pod({"gpu-fraction": "0.5"}, containers=(name,))
    upstream = binder_annotations(parse_pod(view, DEFAULT_KEYS), decision(2000), DEFAULT_KEYS)
    assert all(is_valid_key(key) for key in upstream)
    with pytest.raises(ContractViolation) as refused:
        binder_annotations(parse_pod(view, DEFAULT_KEYS), patched(2000), DEFAULT_KEYS)
    [error] = refused.value.errors
    assert error.key == f"nvidia.com/container.{name}.gpu-compute.portion"
    assert "over 63 characters" in error.rule and "at most 33 characters" in error.rule
    short = pod({"gpu-fraction": "0.5"}, containers=("p" * 33,))
    assert all(is_valid_key(key) for key in binder_annotations(
        parse_pod(short, DEFAULT_KEYS), patched(2000), DEFAULT_KEYS))
