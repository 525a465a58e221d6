"""The mirror writes a long-named container's keys through the API server, which refuses an
annotation key over 63 characters (the stand-in does too): KAI's keys under the container's
name, kai_fractions' derived keys under its shortened id, read back by the node agent's plan. A
name KAI's keys cannot hold is refused before anything is written, naming the rule."""

from __future__ import annotations

import grpc
import pytest

from kai_fractions.contract import DEFAULT_KEYS, Dialect

from .messages import SM, TS, allocation, mirror_request, node_plan

pytestmark = pytest.mark.integration

TRT = "tensorrt-llm-inference-server"  # 29 characters


@pytest.mark.parametrize(("name", "mode", "dialect"), [
    (TRT, SM, Dialect.UPSTREAM),
    ("c" * 33, TS, Dialect.PATCHED),  # the longest every KAI takes, compute portion included
    ("c" * 33, SM, Dialect.PATCHED),
    ("d" * 34, SM, Dialect.UPSTREAM),  # the longest upstream KAI takes
])
def test_a_long_named_container_is_mirrored_with_keys_the_api_server_takes(
        mirror_tcp, name: str, mode, dialect: Dialect):
    mirror_tcp.service.dialect = dialect
    user = {"gpu-fraction": "0.5"}
    if mode == SM:
        user[f"nvidia.com/container.{name}.gpu-compute.mode"] = "sm-sharing"
    pod = mirror_tcp.create_pod("llm-0", user, containers=(name, "sidecar"))
    reserve = 1024 if dialect is Dialect.PATCHED else None
    response = mirror_tcp.stub.MirrorAllocation(mirror_request(allocation(
        pod, modes=(mode,), container=name, reserve=reserve)), timeout=10)
    assert response.changed and [c.container for c in response.containers] == [name]
    after = mirror_tcp.pod("team-a", "llm-0")
    notes = after["metadata"]["annotations"]
    assert notes[f"nvidia.com/container.{name}.gpus.devices"]
    plan = node_plan(after)
    assert plan.container == name
    assert notes[DEFAULT_KEYS.derived(name, ".plan-digest")] == plan.digest
    assert notes[DEFAULT_KEYS.derived(name, ".memory-limit-mib")] == str(plan.limit_mib)
    if len(name) > 24:
        assert not any(f".{name}." in key for key in notes if key.startswith(
            "kai-fractions.io/container."))


def test_a_name_kais_keys_cannot_hold_is_refused_and_nothing_written(mirror_tcp):
    name = "e" * 35
    pod = mirror_tcp.create_pod("llm-0", {"gpu-fraction": "0.5"}, containers=(name,))
    with pytest.raises(grpc.RpcError) as e:
        mirror_tcp.stub.MirrorAllocation(mirror_request(allocation(pod, container=name)),
                                         timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"nvidia.com/container.{name}.gpu-memory.request" in e.value.details()
    assert "at most 34 characters" in e.value.details()
    assert mirror_tcp.patches("team-a", "llm-0") == 0
