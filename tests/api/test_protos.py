"""The committed API: generated code matches protos/, buf lint and format pass, JSON shape."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import json_format

from kai_fractions.api.v1 import (
    allocation_pb2,
    allocation_pb2_grpc,
    node_pb2,
    node_pb2_grpc,
)

ROOT = Path(__file__).resolve().parents[2]
GENERATED_DIR = ROOT / "kai_fractions" / "api" / "v1"
GENERATED_PATTERNS = ("*_pb2.py", "*_pb2.pyi", "*_pb2_grpc.py")

# What a grpcurl user sends to AllocationMirror/MirrorAllocation (protobuf's canonical JSON:
# camelCase names, enum names, int64 as strings). Reused in the README.
MIRROR_ALLOCATION_REQUEST_JSON = """\
{
  "allocation": {
    "pod": {
      "namespace": "team-a",
      "name": "train-0",
      "uid": "5f0c7a52-3b8e-4c1d-9a6f-2e7b1d4c8a90"
    },
    "selectedNode": "gpu-node-1",
    "receivedResourceType": "RECEIVED_RESOURCE_TYPE_FRACTION",
    "receivedGpu": {
      "count": 1,
      "portion": "0.5"
    },
    "selectedFractionalGpuGroups": [
      {
        "id": "0b4e6f2a-8d1c-4e7b-9f3a-5c2d7e1b6a48",
        "computeSharingMode": "COMPUTE_SHARING_MODE_SM_SHARING"
      }
    ],
    "reservedGpuIds": [
      "GPU-3f2a9c1e-7b4d-4e8a-b6c5-1d2e3f4a5b6c"
    ],
    "nodeGpuMemoryMib": "40960",
    "containerName": "trainer"
  },
  "idempotencyKey": "team-a/train-0/attempt-1"
}
"""


def _generated_files(directory: Path) -> dict[str, bytes]:
    files: dict[str, bytes] = {}
    for pattern in GENERATED_PATTERNS:
        for path in directory.glob(pattern):
            files[path.name] = path.read_bytes()
    return files


def _buf() -> str:
    candidates = [Path(sys.executable).parent / "buf", ROOT / ".venv" / "bin" / "buf"]
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("buf")
    if found:
        return found
    pytest.fail(
        "buf not found (looked next to sys.executable, in .venv/bin and on PATH); "
        "install it with `.venv/bin/pip install buf-bin` (part of the `test` extra)"
    )


def _run(argv: list[str], **kwargs) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=False, **kwargs)


def test_committed_code_matches_protos(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    result = _run(["bash", str(ROOT / "scripts" / "gen-protos"), str(tmp_path)], env=env)
    assert result.returncode == 0, f"scripts/gen-protos failed:\n{result.stdout}{result.stderr}"

    fresh = _generated_files(tmp_path)
    committed = _generated_files(GENERATED_DIR)
    assert fresh, "scripts/gen-protos produced no files"
    hint = "generated code is stale: run scripts/gen-protos and commit kai_fractions/api/v1"
    assert sorted(committed) == sorted(fresh), hint
    stale = [name for name in sorted(fresh) if committed[name] != fresh[name]]
    assert not stale, f"{hint} (differs: {', '.join(stale)})"


def test_buf_lint() -> None:
    result = _run([_buf(), "lint"])
    assert result.returncode == 0, f"buf lint failed:\n{result.stdout}{result.stderr}"


def test_buf_format() -> None:
    result = _run([_buf(), "format", "--diff", "--exit-code"])
    assert result.returncode == 0, (
        f"buf format wants changes (apply with `buf format -w`):\n{result.stdout}{result.stderr}"
    )


@pytest.mark.parametrize(
    ("module", "grpc_module", "service", "methods"),
    [
        (
            allocation_pb2,
            allocation_pb2_grpc,
            "AllocationMirror",
            {
                "MirrorAllocation": ("MirrorAllocationRequest", "MirrorAllocationResponse"),
                "ReleaseAllocation": ("ReleaseAllocationRequest", "ReleaseAllocationResponse"),
                "PreviewAllocation": ("PreviewAllocationRequest", "PreviewAllocationResponse"),
            },
        ),
        (
            node_pb2,
            node_pb2_grpc,
            "NodeEnforcer",
            {
                "GetNodeState": ("GetNodeStateRequest", "GetNodeStateResponse"),
                "Provision": ("ProvisionRequest", "ProvisionResponse"),
                "Release": ("ReleaseRequest", "ReleaseResponse"),
                "Drain": ("DrainRequest", "DrainResponse"),
            },
        ),
    ],
)
def test_services(module, grpc_module, service, methods) -> None:
    descriptor = module.DESCRIPTOR.services_by_name[service]
    assert descriptor.full_name == f"kai_fractions.v1.{service}"
    assert module.DESCRIPTOR.package == "kai_fractions.v1"
    found = {
        method.name: (method.input_type.full_name, method.output_type.full_name)
        for method in descriptor.methods
    }
    expected = {
        name: (f"kai_fractions.v1.{request}", f"kai_fractions.v1.{response}")
        for name, (request, response) in methods.items()
    }
    assert found == expected
    for method in descriptor.methods:
        assert not method.client_streaming
        assert not method.server_streaming
    for suffix in ("Stub", "Servicer"):
        assert hasattr(grpc_module, f"{service}{suffix}")
    assert hasattr(grpc_module, f"add_{service}Servicer_to_server")


def test_mirror_allocation_request_json_round_trip() -> None:
    request = json_format.Parse(
        MIRROR_ALLOCATION_REQUEST_JSON, allocation_pb2.MirrorAllocationRequest()
    )

    allocation = request.allocation
    assert allocation.pod == allocation_pb2.PodRef(
        namespace="team-a", name="train-0", uid="5f0c7a52-3b8e-4c1d-9a6f-2e7b1d4c8a90"
    )
    assert allocation.selected_node == "gpu-node-1"
    assert allocation.received_resource_type == allocation_pb2.RECEIVED_RESOURCE_TYPE_FRACTION
    assert allocation.received_gpu.count == 1
    assert allocation.received_gpu.portion == "0.5"
    [group] = allocation.selected_fractional_gpu_groups
    assert group.id == "0b4e6f2a-8d1c-4e7b-9f3a-5c2d7e1b6a48"
    assert group.compute_sharing_mode == allocation_pb2.COMPUTE_SHARING_MODE_SM_SHARING
    assert list(allocation.reserved_gpu_ids) == ["GPU-3f2a9c1e-7b4d-4e8a-b6c5-1d2e3f4a5b6c"]
    assert allocation.node_gpu_memory_mib == 40960
    assert not allocation.HasField("reserve_mib")  # the mirror's own (0 for upstream KAI)
    assert not allocation.cdi
    assert allocation.container_name == "trainer"
    assert request.idempotency_key == "team-a/train-0/attempt-1"
    assert not request.replace

    # Back to JSON: exactly the example (it is canonical), and back to the same message.
    assert json.loads(json_format.MessageToJson(request)) == json.loads(
        MIRROR_ALLOCATION_REQUEST_JSON
    )
    again = json_format.Parse(json_format.MessageToJson(request), request.__class__())
    assert again == request
    assert allocation_pb2.MirrorAllocationRequest.FromString(request.SerializeToString()) == request


def test_reserve_mib_unset_is_distinguishable_from_zero() -> None:
    unset = allocation_pb2.Allocation()
    zero = allocation_pb2.Allocation(reserve_mib=0)
    assert not unset.HasField("reserve_mib")
    assert zero.HasField("reserve_mib")
    assert json_format.MessageToDict(zero) == {"reserveMib": "0"}
