"""grpcurl (a real, non-Python gRPC client) finds the service through reflection and calls
PreviewAllocation with the JSON a scheduler author would write (the README's example)."""

from __future__ import annotations

import json
import subprocess

import pytest

from kai_fractions.contract import Dialect
from tests.api.test_protos import MIRROR_ALLOCATION_REQUEST_JSON

from .messages import node_plan

pytestmark = pytest.mark.integration

SM_POD = {"gpu-fraction": "0.5", "nvidia.com/container.trainer.gpu-compute.mode": "sm-sharing"}


def grpcurl(binary, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(binary), "-max-time", "20", *args], input=stdin,
                          capture_output=True, text=True, timeout=30, check=False)


def preview_json(uid: str) -> str:
    """The README's MirrorAllocation example as a PreviewAllocationRequest for this pod."""
    request = json.loads(MIRROR_ALLOCATION_REQUEST_JSON)
    request["allocation"]["pod"]["uid"] = uid
    return json.dumps({"allocation": request["allocation"]})


def test_reflection_lists_and_describes_the_service(grpcurl_bin, mirror):
    target = (["-unix", mirror.server.listen.unix_path] if mirror.server.listen.is_unix
              else [mirror.server.address])
    listed = grpcurl(grpcurl_bin, "-plaintext", *target, "list")
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.split() == ["grpc.health.v1.Health",
                                     "grpc.reflection.v1alpha.ServerReflection",
                                     "kai_fractions.v1.AllocationMirror"]
    methods = grpcurl(grpcurl_bin, "-plaintext", *target, "list",
                      "kai_fractions.v1.AllocationMirror")
    assert methods.stdout.split() == [
        "kai_fractions.v1.AllocationMirror.MirrorAllocation",
        "kai_fractions.v1.AllocationMirror.PreviewAllocation",
        "kai_fractions.v1.AllocationMirror.ReleaseAllocation"]


def test_preview_allocation_with_json(grpcurl_bin, mirror_factory):
    # A patched-dialect mirror also writes the compute portion, which caps the SMs at 50%.
    mirror_tcp = mirror_factory(transport="tcp", dialect=Dialect.PATCHED)
    pod = mirror_tcp.create_pod("train-0", SM_POD)
    result = grpcurl(grpcurl_bin, "-plaintext", "-d", "@", mirror_tcp.server.address,
                     "kai_fractions.v1.AllocationMirror/PreviewAllocation",
                     stdin=preview_json(pod["metadata"]["uid"]))
    assert result.returncode == 0, result.stderr
    reply = json.loads(result.stdout)
    gpu = "GPU-3f2a9c1e-7b4d-4e8a-b6c5-1d2e3f4a5b6c"
    annotations = reply["annotations"]
    assert {k: v for k, v in annotations.items() if k.startswith("nvidia.com/")} == {
        "nvidia.com/container.trainer.gpu-memory.request": "20Gi",
        "nvidia.com/container.trainer.gpus.devices": gpu,
        "nvidia.com/container.trainer.gpu-compute.portion": "0.5"}
    assert annotations["received-resource-type"] == "Fraction"
    # grpcurl prints the proto field names; int64 as strings (protobuf JSON).
    container = reply["containers"][0]
    assert (container["container"], container["compute_sharing_mode"],
            container["active_thread_percentage"], container["memory_request_bytes"],
            container["devices"]) == (
        "trainer", "COMPUTE_SHARING_MODE_SM_SHARING", 50, str(20480 << 20), [gpu])
    # Nothing was written: a preview.
    assert mirror_tcp.patches("team-a", "train-0") == 0
    # The digest it previews is the one the node will compute once the mirror has written.
    written = {**pod, "metadata": {**pod["metadata"], "annotations": {
        **pod["metadata"]["annotations"], **annotations}}}
    assert annotations["kai-fractions.io/container.trainer.plan-digest"] == \
        node_plan(written).digest


@pytest.mark.parametrize(("portion", "rule"), [
    ("-1", "must be greater than 0"),
    ("1.5", "is above 1: the memory request computed from it would exceed one GPU"),
])
def test_bad_json_request_names_the_field(grpcurl_bin, mirror_tcp, portion, rule):
    pod = mirror_tcp.create_pod("train-0", SM_POD)
    request = json.loads(preview_json(pod["metadata"]["uid"]))
    request["allocation"]["receivedGpu"]["portion"] = portion
    result = grpcurl(grpcurl_bin, "-plaintext", "-format-error", "-d", "@",
                     mirror_tcp.server.address,
                     "kai_fractions.v1.AllocationMirror/PreviewAllocation",
                     stdin=json.dumps(request))
    assert result.returncode != 0
    error = json.loads(result.stderr)
    assert error["code"] == 3  # INVALID_ARGUMENT
    assert error["message"] == f"allocation.received_gpu.portion: {rule} (got '{portion}')"
    assert error["details"] == [{
        "@type": "type.googleapis.com/google.rpc.BadRequest",
        "field_violations": [{"field": "allocation.received_gpu.portion",
                              "description": f"{rule} (got '{portion}')"}]}]
