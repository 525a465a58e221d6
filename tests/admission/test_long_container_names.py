"""A KAI manifest works unchanged whatever its fractional container's name, as long as KAI's own
keys can hold it: the mutating webhook's annotation and the env's downward-API sources are keys
Kubernetes accepts (kai_fractions' keys use a shortened id for a long name), and the validating
webhook takes the wired pod. A name KAI's keys cannot hold is refused by both webhooks, naming
the key, the 63-character rule and the longest name that fits."""

from __future__ import annotations

import copy
import re
from typing import Any

import jsonpatch
import pytest

from kai_fractions.admission.mutate import mutate
from kai_fractions.admission.validate import validate

from .reviews import CONFIG, pod, request

# Kubernetes' rule for an annotation key (IsQualifiedName of the lower-cased key), typed here.
_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_FIELD = re.compile(r"metadata\.annotations\['(.+)'\]")


def is_valid_key(key: str) -> bool:
    prefix, slash, name = key.lower().rpartition("/")
    return ((not slash or (len(prefix) <= 253 and _SUBDOMAIN.fullmatch(prefix) is not None))
            and len(name) <= 63 and _NAME.fullmatch(name) is not None)


def wired(obj: dict[str, Any]) -> dict[str, Any]:
    decision = mutate(request(obj), CONFIG)
    assert decision.allowed, decision.message
    return jsonpatch.apply_patch(copy.deepcopy(obj), list(decision.patch))


def referenced_keys(obj: dict[str, Any]) -> list[str]:
    """The annotation keys the pod's env reads through the downward API (the API server checks
    each as an annotation key)."""
    out = []
    for container in obj["spec"].get("initContainers", []) + obj["spec"]["containers"]:
        for item in container.get("env") or []:
            path = ((item.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath", "")
            if match := _FIELD.fullmatch(path):
                out.append(match.group(1))
    return out


def fractional(name: str, mode: str) -> dict[str, str]:
    p = f"nvidia.com/container.{name}"
    return {f"{p}.gpu-memory.request": "8Gi", f"{p}.gpu-compute.mode": mode}


@pytest.mark.parametrize(("name", "mode"), [
    ("tensorrt-llm-inference-server", "sm-sharing"),  # 29: sm-sharing's keys need a short id
    ("c" * 33, "time-slicing"),  # the longest every KAI takes
    ("c" * 33, "sm-sharing"),
])
def test_a_wired_pod_carries_and_reads_only_keys_kubernetes_accepts(name: str, mode: str):
    obj = wired(pod(fractional(name, mode), containers=(name, "sidecar")))
    keys = [*obj["metadata"]["annotations"], *referenced_keys(obj)]
    assert any(key.startswith("kai-fractions.io/container.") for key in referenced_keys(obj))
    assert [key for key in keys if not is_valid_key(key)] == []
    decision = validate(request(obj), CONFIG)
    assert decision.allowed, decision.message
    assert decision.warnings == ()


def test_the_mps_namespace_key_is_found_by_the_webhooks_under_the_short_id():
    name = "tensorrt-llm-inference-server"
    obj = wired(pod(fractional(name, "sm-sharing"), containers=(name,)))
    (key,) = [k for k in obj["metadata"]["annotations"] if k.endswith(".mps-namespace")]
    assert key.startswith("kai-fractions.io/container.tensorrt-llm-in_")
    # Reinvoked on its own output, the webhook keeps the name (it found its key).
    assert wired(obj) == obj


def test_a_name_kais_keys_cannot_hold_is_refused_by_both_webhooks():
    name = "a-very-long-inference-server-container"  # 38 characters
    obj = pod({"gpu-fraction": "0.5"}, containers=(name,))
    key = f"nvidia.com/container.{name}.gpu-memory.request"
    for decision in (mutate(request(obj), CONFIG), validate(request(obj), CONFIG)):
        assert not decision.allowed
        assert decision.message.startswith(f"{key}: container {name!r} has a 38-character "
                                           "name, too long for this key")
        assert "over 63 characters" in decision.message
        assert "at most 34 characters" in decision.message


def test_a_name_only_the_patched_binder_cannot_hold_is_a_warning():
    name = "d" * 34
    obj = wired(pod({"gpu-fraction": "0.5"}, containers=(name,)))
    decision = validate(request(obj), CONFIG)
    assert decision.allowed
    (warning,) = decision.warnings
    assert warning.startswith(f"nvidia.com/container.{name}.gpu-compute.portion: ")
    assert "patched KAI binder" in warning
