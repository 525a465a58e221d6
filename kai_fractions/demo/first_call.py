"""`demo --keep`: one more pod, Pending and not bound, ready for a first `MirrorAllocation` made
by hand, and the exact commands that make it from another shell, in any directory.

The pod asks for `gpu-fraction: "0.1"` (time-slicing, small enough for the room the examples
leave on the default node) and goes through admission like the examples. The demo's scheduler
sizes it (`PreviewAllocation`) and picks the GPU it would give it, but stops before the mirror:
that call is the user's. The commands use absolute paths only (the venv's python and
kai-fractions, grpcurl from the checkout's `.tools/bin`, the checkout's `protos/`), the mirror's
real address and the pod's real uid. Preview, the first MirrorAllocation and inspect need only
the venv `scripts/demo` made; the grpcurl repeat needs grpcurl (`scripts/test-tools.sh`).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from google.protobuf import json_format

from ..api.v1 import allocation_pb2 as pb
from ..contract import keys as k

POD = "first-call"
CONTAINER = "main"
PORTION = "0.1"
CHECKOUT = Path(__file__).resolve().parents[2]
"""The repository root when the package runs from a checkout (scripts/demo's editable install)."""
END = "(The demo keeps running until Ctrl-C.)"
"""The last line `--keep` prints."""


def manifest(namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": POD, "namespace": namespace,
                     "labels": {"kai.scheduler/queue": "team-a"},
                     "annotations": {k.GPU_FRACTION: PORTION}},
        "spec": {"schedulerName": k.KAI_SCHEDULER_NAME, "containers": [
            {"name": CONTAINER, "image": "nvcr.io/nvidia/pytorch:24.08-py3",
             "command": ["python", "train.py"]}]},
    }


@dataclass(frozen=True, slots=True)
class FirstCall:
    namespace: str
    name: str
    uid: str
    node: str
    gpu_index: int
    gpu_uuid: str
    fits: bool
    """False: no GPU has the room left; the GPU is the first one, for the call's sake."""
    request: pb.MirrorAllocationRequest

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True, slots=True)
class Tools:
    """Absolute commands; a tool that is not there is named with how to get it."""

    python: str
    cli: str
    grpcurl: str
    protos: str | None

    @classmethod
    def here(cls, checkout: Path = CHECKOUT) -> Tools:
        python = Path(sys.executable)
        cli = python.parent / "kai-fractions"
        grpcurl = checkout / ".tools" / "bin" / "grpcurl"
        protos = checkout / "protos"
        return cls(python=str(python),
                   cli=str(cli) if cli.exists() else "kai-fractions",
                   grpcurl=str(grpcurl) if grpcurl.exists() else "grpcurl",
                   protos=str(protos) if (protos / "kai_fractions").is_dir() else None)


def _json(message: Any) -> str:
    return json.dumps(json.loads(json_format.MessageToJson(message)), indent=2)


def _python(call: FirstCall, mirror: str) -> str:
    a = call.request.allocation
    g = a.selected_fractional_gpu_groups[0]
    mode = pb.ComputeSharingMode.Name(g.compute_sharing_mode)
    return f'''import sys

import grpc

from kai_fractions.api.v1 import allocation_pb2 as pb
from kai_fractions.api.v1 import allocation_pb2_grpc as pb_grpc

request = pb.MirrorAllocationRequest(
    allocation=pb.Allocation(
        pod=pb.PodRef(namespace="{a.pod.namespace}", name="{a.pod.name}",
                      uid="{a.pod.uid}"),
        selected_node="{a.selected_node}",
        received_resource_type=pb.RECEIVED_RESOURCE_TYPE_FRACTION,
        received_gpu=pb.ReceivedGpu(count={a.received_gpu.count},
                                    portion="{a.received_gpu.portion}"),
        selected_fractional_gpu_groups=[pb.FractionalGpuGroup(
            id="{g.id}",
            compute_sharing_mode=pb.{mode})],
        reserved_gpu_ids=["{a.reserved_gpu_ids[0]}"],
    ),
    idempotency_key="{call.request.idempotency_key}",
)
with grpc.insecure_channel("{mirror}") as channel:
    try:
        reply = pb_grpc.AllocationMirrorStub(channel).MirrorAllocation(request, timeout=10)
    except grpc.RpcError as error:
        print(f"MirrorAllocation failed: {{error.code().name}}: {{error.details()}}",
              file=sys.stderr)
        sys.exit(1)
print(f"MirrorAllocation: OK, changed: {{reply.changed}}, resource_version: "
      f"{{reply.resource_version}}")
for key, value in sorted(reply.annotations.items()):
    print(f"  {{key}}: {{value}}")'''


def _python_preview(call: FirstCall, mirror: str) -> str:
    preview = pb.PreviewAllocationRequest(allocation=call.request.allocation)
    return f'''import sys

import grpc
from google.protobuf import json_format

from kai_fractions.api.v1 import allocation_pb2 as pb
from kai_fractions.api.v1 import allocation_pb2_grpc as pb_grpc

request = json_format.Parse("""
{_json(preview)}
""", pb.PreviewAllocationRequest())
with grpc.insecure_channel("{mirror}") as channel:
    try:
        reply = pb_grpc.AllocationMirrorStub(channel).PreviewAllocation(request, timeout=10)
    except grpc.RpcError as error:
        print(f"PreviewAllocation failed: {{error.code().name}}: {{error.details()}}",
              file=sys.stderr)
        sys.exit(1)
print("PreviewAllocation: OK, it would write:")
for key, value in sorted(reply.annotations.items()):
    print(f"  {{key}}: {{value}}")'''


def commands(call: FirstCall, mirror: str, kubeconfig: str, agent_socket: str,
             tools: Tools) -> list[tuple[str, str]]:
    """(what it does, the shell command) for the first call, in the order to paste them."""
    grpcurl = f"{tools.grpcurl} -plaintext -emit-defaults -d @ {mirror} "
    inspect = (f"{tools.cli} inspect pod {call.ref} --kubeconfig {kubeconfig} "
               f"--agent-socket {agent_socket}")
    return [
        ("PreviewAllocation from Python: what the mirror would write (nothing is written)",
         f"{tools.python} - <<'EOF'\n{_python_preview(call, mirror)}\nEOF"),
        ("MirrorAllocation from Python: prints the status, exits 1 on an error",
         f"{tools.python} - <<'EOF'\n{_python(call, mirror)}\nEOF"),
        ("MirrorAllocation with grpcurl: the same decision again (same idempotency key), so "
         '"changed": false',
         f"{grpcurl}kai_fractions.v1.AllocationMirror/MirrorAllocation <<'EOF'\n"
         f"{_json(call.request)}\nEOF"),
        ("the pod afterwards: its annotations, planned (not bound, so on no GPU yet)", inspect),
    ]


def render(call: FirstCall, mirror: str, kubeconfig: str, agent_socket: str,
           tools: Tools) -> str:
    where = (f"GPU {call.gpu_index} ({call.gpu_uuid})" if call.fits else
             f"GPU {call.gpu_index} ({call.gpu_uuid}; no GPU has room left, so the call "
             "succeeds but a real scheduler would not place it)")
    lines = [
        "",
        f"First call: pod {call.ref} (uid {call.uid}) is Pending and not bound; it asks for "
        f'gpu-fraction: "{PORTION}". The demo\'s scheduler would put it on {call.node} '
        f"{where}. Paste these into another shell (any directory):",
    ]
    for what, command in commands(call, mirror, kubeconfig, agent_socket, tools):
        lines += ["", f"# {what}", command]
    if tools.grpcurl == "grpcurl":
        lines += ["", "(grpcurl is not in .tools/bin: scripts/test-tools.sh fetches it)"]
    return "\n".join(lines) + "\n"
