"""The real AllocationMirror gRPC server (loopback TCP and a unix socket) writing through the
real `kubernetes` client into kmock: mirror, preview and release, with the exact annotations
left on the pod afterwards."""

from __future__ import annotations

import json

import grpc
import pytest
from google.rpc import error_details_pb2

from kai_fractions.api.v1 import allocation_pb2 as pb
from kai_fractions.contract import Dialect, mps_namespace_name
from kai_fractions.mirror.record import MIRRORED_ANNOTATION

from .messages import (
    GPU_A,
    GPU_B,
    SM,
    TS,
    allocation,
    detail,
    expected_record,
    mirror_request,
    node_plan,
    record,
)

pytestmark = pytest.mark.integration

T = "nvidia.com/container.trainer"
D = "kai-fractions.io/container.trainer"

CASES = {
    # Upstream KAI main (the default dialect): canonical quantities, no compute portion key.
    "single-gpu": (
        {"gpu-fraction": "0.5"}, ("trainer",), {},
        {f"{T}.gpu-memory.request": "20Gi", f"{T}.gpus.devices": GPU_A,
         "received-resource-type": "Fraction",
         f"{D}.memory-request-mib": "20480", f"{D}.memory-limit-mib": "20480",
         f"{D}.mps-pinned-mem-limit": "0=20480M"}),
    "multi-device": (
        {"gpu-fraction": "0.5", "gpu-fraction-num-devices": "2"}, ("trainer",),
        {"modes": (TS, TS), "gpus": (GPU_A, GPU_B)},
        {f"{T}.gpu-memory.request": "20Gi", f"{T}.gpus.devices": f"{GPU_A},{GPU_B}",
         "received-resource-type": "Fraction",
         f"{D}.memory-request-mib": "20480", f"{D}.memory-limit-mib": "20480",
         f"{D}.mps-pinned-mem-limit": "0=20480M,1=20480M"}),
    "sm-sharing": (  # no compute portion from upstream KAI: no compute cap (100%)
        {"gpu-fraction": "0.5", f"{T}.gpu-compute.mode": "sm-sharing"}, ("trainer",),
        {"modes": (SM,)},
        {f"{T}.gpu-memory.request": "20Gi", f"{T}.gpus.devices": GPU_A,
         "received-resource-type": "Fraction",
         f"{D}.memory-request-mib": "20480", f"{D}.memory-limit-mib": "20480",
         f"{D}.mps-pinned-mem-limit": "0=20480M", f"{D}.mps-active-thread-percentage": "100",
         f"{D}.mps-pipe-directory": "/run/kai-fractions/mps/shared/<ns>"}),
    "sm-sharing-admitted": (  # the namespace our admission webhook named when it was created
        {"gpu-fraction": "0.5", f"{T}.gpu-compute.mode": "sm-sharing",
         f"{D}.mps-namespace": "kf_" + "5a" * 10}, ("trainer",), {"modes": (SM,)},
        {f"{T}.gpu-memory.request": "20Gi", f"{T}.gpus.devices": GPU_A,
         "received-resource-type": "Fraction",
         f"{D}.memory-request-mib": "20480", f"{D}.memory-limit-mib": "20480",
         f"{D}.mps-pinned-mem-limit": "0=20480M", f"{D}.mps-active-thread-percentage": "100",
         f"{D}.mps-pipe-directory": "/run/kai-fractions/mps/shared/kf_" + "5a" * 10}),
    "sm-sharing-patched": (  # the patched KAI: the MPS reserve and the compute portion
        {"gpu-fraction": "0.5", f"{T}.gpu-compute.mode": "sm-sharing"}, ("trainer",),
        {"modes": (SM,), "reserve": 1024, "dialect": Dialect.PATCHED},
        {f"{T}.gpu-memory.request": "19968Mi", f"{T}.gpus.devices": GPU_A,
         f"{T}.gpu-compute.portion": "0.5", "received-resource-type": "Fraction",
         f"{D}.memory-request-mib": "19968", f"{D}.memory-limit-mib": "19968",
         f"{D}.mps-pinned-mem-limit": "0=19968M", f"{D}.mps-active-thread-percentage": "50",
         f"{D}.mps-pipe-directory": "/run/kai-fractions/mps/shared/<ns>"}),
    "cdi-names": (
        {"gpu-fraction": "0.5"}, ("trainer",), {"cdi": True},
        {f"{T}.gpu-memory.request": "20Gi",
         f"{T}.gpus.devices": f"k8s.device-plugin.nvidia.com/gpu={GPU_A}",
         "received-resource-type": "Fraction",
         f"{D}.memory-request-mib": "20480", f"{D}.memory-limit-mib": "20480",
         f"{D}.mps-pinned-mem-limit": "0=20480M"}),
    "legacy-gpu-fraction": (
        {"gpu-fraction": "0.25", "gpu-fraction.limit": "0.5",
         "gpu-fraction-container-name": "trainer"}, ("sidecar", "trainer"),
        {"portion": "0.25", "memory": 0},  # node memory from the node's label (16384)
        {f"{T}.gpu-memory.request": "4Gi", f"{T}.gpu-memory.limit": "8Gi",
         f"{T}.gpus.devices": GPU_A, "received-resource-type": "Fraction",
         f"{D}.memory-request-mib": "4096", f"{D}.memory-limit-mib": "8192",
         f"{D}.mps-pinned-mem-limit": "0=8192M"}),
    "legacy-gpu-fraction-patched": (
        {"gpu-fraction": "0.25", "gpu-fraction.limit": "0.5",
         "gpu-fraction-container-name": "trainer"}, ("sidecar", "trainer"),
        {"portion": "0.25", "memory": 0, "dialect": Dialect.PATCHED},
        {f"{T}.gpu-memory.request": "4Gi", f"{T}.gpu-memory.limit": "8Gi",
         f"{T}.gpus.devices": GPU_A, f"{T}.gpu-compute.portion": "0.25",
         "received-resource-type": "Fraction",
         f"{D}.memory-request-mib": "4096", f"{D}.memory-limit-mib": "8192",
         f"{D}.mps-pinned-mem-limit": "0=8192M"}),
    "user-request-kept": (
        {f"{T}.gpu-memory.request": "8Gi", f"{T}.gpu-memory.limit": "12Gi"}, ("trainer",),
        {"portion": "0.25"},
        {f"{T}.gpus.devices": GPU_A, "received-resource-type": "Fraction",
         f"{D}.memory-request-mib": "8192", f"{D}.memory-limit-mib": "12288",
         f"{D}.mps-pinned-mem-limit": "0=12288M"}),
    "user-request-kept-patched": (
        {f"{T}.gpu-memory.request": "8Gi", f"{T}.gpu-memory.limit": "12Gi"}, ("trainer",),
        {"portion": "0.25", "dialect": Dialect.PATCHED},
        {f"{T}.gpus.devices": GPU_A, f"{T}.gpu-compute.portion": "0.25",
         "received-resource-type": "Fraction",
         f"{D}.memory-request-mib": "8192", f"{D}.memory-limit-mib": "12288",
         f"{D}.mps-pinned-mem-limit": "0=12288M"}),
}


def owned_annotations(expected: dict[str, str], pod: dict) -> dict[str, str]:
    """The case's literal values plus the two that hang on the pod's random uid (the pipe
    directory only when no admitted namespace names it)."""
    out = dict(expected)
    pipe = f"{D}.mps-pipe-directory"
    if pipe in out and f"{D}.mps-namespace" not in pod["metadata"]["annotations"]:
        out[pipe] = "/run/kai-fractions/mps/shared/" + mps_namespace_name(
            pod["metadata"]["uid"], "trainer")
    out[f"{D}.plan-digest"] = node_plan(pod).digest
    return dict(sorted(out.items()))


@pytest.mark.parametrize("case", list(CASES))
def test_mirror_preview_release(mirror, case):
    user, containers, kwargs, expected = CASES[case]
    kwargs = dict(kwargs)
    mirror.service.dialect = kwargs.pop("dialect", Dialect.UPSTREAM)  # read on every call
    mirror.create_node("gpu-node-1", "16384")
    pod = mirror.create_pod("train-0", user, containers=containers)
    alloc = allocation(pod, **kwargs)

    preview = mirror.stub.PreviewAllocation(pb.PreviewAllocationRequest(allocation=alloc),
                                            timeout=10)
    assert mirror.patches("team-a", "train-0") == 0

    response = mirror.stub.MirrorAllocation(mirror_request(alloc, key=f"{case}/1"), timeout=10)
    after = mirror.pod("team-a", "train-0")
    owned = owned_annotations(expected, after)
    assert dict(response.annotations) == owned
    assert dict(preview.annotations) == owned
    assert response.changed is True
    assert response.resource_version == after["metadata"]["resourceVersion"]
    assert mirror.annotations("team-a", "train-0") == {
        **user, **owned, MIRRORED_ANNOTATION: after["metadata"]["annotations"][
            MIRRORED_ANNOTATION]}
    assert record(after) == expected_record(after, owned, key=f"{case}/1")
    assert mirror.patches("team-a", "train-0") == 1
    assert [c.container for c in response.containers] == ["trainer"]
    assert response.containers == preview.containers

    released = mirror.stub.ReleaseAllocation(pb.ReleaseAllocationRequest(
        pod=alloc.pod, idempotency_key=f"{case}/rollback"), timeout=10)
    assert released.changed is True
    assert list(released.removed_keys) == sorted(owned)
    # The record gives way to what the release leaves: the keys of the calls now over.
    left = mirror.annotations("team-a", "train-0")
    assert json.loads(left.pop(MIRRORED_ANNOTATION)) == {
        "v": 1, "released": True, "uid": after["metadata"]["uid"],
        "idempotencyKey": f"{case}/rollback", "spentKeys": [f"{case}/1"]}
    assert left == user
    for key in (f"{case}/rollback", ""):  # its retry, or a release without a key: no-ops
        again = mirror.stub.ReleaseAllocation(pb.ReleaseAllocationRequest(
            pod=alloc.pod, idempotency_key=key), timeout=10)
        assert (again.changed, list(again.removed_keys)) == (False, [])
    assert mirror.patches("team-a", "train-0") == 2


def test_a_repeat_writes_nothing_and_answers_the_same(mirror_tcp):
    # The first answer is built while its write is in flight, the repeat's after its read:
    # both say the same.
    pod = mirror_tcp.create_pod("train-0", {"gpu-fraction": "0.5",
                                            f"{T}.gpu-compute.mode": "sm-sharing"})
    request = mirror_request(allocation(pod, modes=(SM,)))
    first = mirror_tcp.stub.MirrorAllocation(request, timeout=10)
    again = mirror_tcp.stub.MirrorAllocation(request, timeout=10)
    assert (first.changed, again.changed) == (True, False)
    assert dict(again.annotations) == dict(first.annotations)
    assert list(again.containers) == list(first.containers)
    assert again.resource_version == first.resource_version == mirror_tcp.pod(
        "team-a", "train-0")["metadata"]["resourceVersion"]
    assert mirror_tcp.patches("team-a", "train-0") == 1


def test_container_plan_in_the_response(mirror_factory):
    mirror_tcp = mirror_factory(transport="tcp", dialect=Dialect.PATCHED)
    pod = mirror_tcp.create_pod("train-0", {"gpu-fraction": "0.5",
                                            f"{T}.gpu-compute.mode": "sm-sharing"})
    response = mirror_tcp.stub.MirrorAllocation(
        mirror_request(allocation(pod, modes=(SM,), reserve=1024)), timeout=10)
    pipe = "/run/kai-fractions/mps/shared/" + mps_namespace_name(pod["metadata"]["uid"],
                                                                  "trainer")
    assert list(response.containers) == [pb.ContainerPlan(
        container="trainer",
        env={"NVIDIA_VISIBLE_DEVICES": GPU_A, "NVIDIA_GPU_MEMORY_REQUEST": "19968",
             "NVIDIA_GPU_MEMORY_LIMIT": "19968", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=19968M",
             "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50", "CUDA_MPS_PIPE_DIRECTORY": pipe},
        memory_request_bytes=19968 << 20, memory_limit_bytes=19968 << 20,
        compute_sharing_mode=SM, active_thread_percentage=50, devices=[GPU_A])]


def test_container_plan_without_a_compute_portion_has_no_compute_cap(mirror_tcp):
    pod = mirror_tcp.create_pod("train-0", {"gpu-fraction": "0.5",
                                            f"{T}.gpu-compute.mode": "sm-sharing"})
    response = mirror_tcp.stub.MirrorAllocation(
        mirror_request(allocation(pod, modes=(SM,))), timeout=10)
    pipe = "/run/kai-fractions/mps/shared/" + mps_namespace_name(pod["metadata"]["uid"],
                                                                  "trainer")
    assert list(response.containers) == [pb.ContainerPlan(
        container="trainer",
        env={"NVIDIA_VISIBLE_DEVICES": GPU_A, "NVIDIA_GPU_MEMORY_REQUEST": "20480",
             "NVIDIA_GPU_MEMORY_LIMIT": "20480", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=20480M",
             "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100", "CUDA_MPS_PIPE_DIRECTORY": pipe},
        memory_request_bytes=20480 << 20, memory_limit_bytes=20480 << 20,
        compute_sharing_mode=SM, active_thread_percentage=100, devices=[GPU_A])]
    assert f"{T}.gpu-compute.portion" not in mirror_tcp.annotations("team-a", "train-0")


def test_rebind_with_replace_recomputes_what_the_mirror_wrote(mirror_tcp):
    pod = mirror_tcp.create_pod("train-0", {"gpu-fraction": "0.5"})
    mirror_tcp.stub.MirrorAllocation(mirror_request(allocation(pod), key="a1"), timeout=10)
    response = mirror_tcp.stub.MirrorAllocation(mirror_request(
        allocation(pod, portion="0.25", gpus=(GPU_B,)), key="a2", replace=True), timeout=10)
    assert response.changed
    now = mirror_tcp.annotations("team-a", "train-0")
    assert now[f"{T}.gpu-memory.request"] == "10Gi"
    assert now[f"{T}.gpus.devices"] == GPU_B
    assert now[f"{D}.memory-limit-mib"] == "10240"
    assert record(mirror_tcp.pod("team-a", "train-0"))["idempotencyKey"] == "a2"


def test_preview_checks_a_conflict_when_asked(mirror_tcp):
    pod = mirror_tcp.create_pod("train-0", {"gpu-fraction": "0.5"})
    mirror_tcp.stub.MirrorAllocation(mirror_request(allocation(pod), key="a1"), timeout=10)
    other = allocation(pod, gpus=(GPU_B,))
    rebind = mirror_tcp.stub.PreviewAllocation(pb.PreviewAllocationRequest(allocation=other),
                                               timeout=10)
    assert rebind.annotations[f"{T}.gpus.devices"] == GPU_B
    with pytest.raises(grpc.RpcError) as e:
        mirror_tcp.stub.PreviewAllocation(pb.PreviewAllocationRequest(
            allocation=other, check_conflict=True), timeout=10)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "already carries a different mirrored allocation" in e.value.details()
    assert mirror_tcp.patches("team-a", "train-0") == 1


def test_a_retry_of_a_release_keeps_the_binders_own_rebind(mirror):
    """Mirror (bind-1), release (rollback-1), then an unmodified KAI binder binds the pod
    again itself (its keys, under the record rollback-1 left): rollback-1's retry answered
    changed and stripped the binder's allocation. It is a no-op: nothing removed or sent."""
    pod = mirror.create_pod("train-0", {"gpu-fraction": "0.5"})
    ref = pb.PodRef(namespace="team-a", name="train-0")
    rollback = pb.ReleaseAllocationRequest(pod=ref, idempotency_key="rollback-1")
    mirror.stub.MirrorAllocation(mirror_request(allocation(pod), key="bind-1"), timeout=10)
    assert mirror.stub.ReleaseAllocation(rollback, timeout=10).changed
    mirror.kube.core.patch_namespaced_pod("train-0", "team-a", {"metadata": {"annotations": {
        f"{T}.gpu-memory.request": "20Gi", f"{T}.gpus.devices": GPU_B,
        "received-resource-type": "Fraction"}}})
    before, patches = mirror.annotations("team-a", "train-0"), mirror.patches("team-a", "train-0")
    again = mirror.stub.ReleaseAllocation(rollback, timeout=10)
    assert (again.changed, list(again.removed_keys)) == (False, [])
    assert mirror.annotations("team-a", "train-0") == before
    assert before[f"{T}.gpus.devices"] == GPU_B
    assert mirror.patches("team-a", "train-0") == patches


def test_a_late_retry_of_a_release_is_refused_not_applied(mirror):
    """Mirror (bind-1), release (rollback-1), mirror a new decision (bind-2): rollback-1's
    late retry answered OK and stripped bind-2 from the pod."""
    pod = mirror.create_pod("train-0", {"gpu-fraction": "0.5"})
    ref = pb.PodRef(namespace="team-a", name="train-0")
    rollback = pb.ReleaseAllocationRequest(pod=ref, idempotency_key="rollback-1")
    mirror.stub.MirrorAllocation(mirror_request(allocation(pod), key="bind-1"), timeout=10)
    assert mirror.stub.ReleaseAllocation(rollback, timeout=10).changed
    assert not mirror.stub.ReleaseAllocation(rollback, timeout=10).changed  # its retry
    assert mirror.stub.MirrorAllocation(mirror_request(
        allocation(pod, gpus=(GPU_B,)), key="bind-2"), timeout=10).changed
    before = mirror.annotations("team-a", "train-0")
    with pytest.raises(grpc.RpcError) as e:
        mirror.stub.ReleaseAllocation(rollback, timeout=10)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    (violation,) = detail(e.value, error_details_pb2.PreconditionFailure).violations
    assert (violation.type, violation.subject) == ("IDEMPOTENCY_KEY_SUPERSEDED",
                                                   "team-a/train-0")
    assert mirror.annotations("team-a", "train-0") == before
    assert before[f"{T}.gpus.devices"] == GPU_B
    assert record(mirror.pod("team-a", "train-0"))["spentKeys"] == ["bind-1", "rollback-1"]
    assert mirror.patches("team-a", "train-0") == 3


def test_health_and_reflection_are_served(mirror):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    health = health_pb2_grpc.HealthStub(mirror.channel)
    for service in ("", "kai_fractions.v1.AllocationMirror"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
