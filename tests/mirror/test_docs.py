"""docs/mirror.md stays true: its grpcurl JSON is the API's example, its reply is what the code
returns, and its Python client runs against a real mirror."""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

from google.protobuf import json_format

from kai_fractions.api.v1 import allocation_pb2 as pb
from kai_fractions.mirror.grpc.proto import allocation_from_proto, plan_to_proto
from kai_fractions.mirror.service import MirrorService
from tests.api.test_protos import MIRROR_ALLOCATION_REQUEST_JSON
from tests.support.fake_store import FakePodStore

DOC = (Path(__file__).resolve().parents[2] / "docs" / "mirror.md").read_text()
UID = "5f0c7a52-3b8e-4c1d-9a6f-2e7b1d4c8a90"
SM_POD = {"gpu-fraction": "0.5", "nvidia.com/container.trainer.gpu-compute.mode": "sm-sharing"}


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", DOC, flags=re.S)


def test_grpcurl_example_is_the_apis_example():
    (shell,) = [b for b in blocks("sh") if "MirrorAllocation <<'EOF'" in b]
    body = shell.split("<<'EOF'\n", 1)[1].split("\nEOF", 1)[0]
    assert json.loads(body) == json.loads(MIRROR_ALLOCATION_REQUEST_JSON)


async def test_example_reply_is_what_the_mirror_returns():
    store = FakePodStore(nodes={"gpu-node-1": {}})
    store.add_pod({"metadata": {"name": "train-0", "namespace": "team-a", "uid": UID,
                                "annotations": SM_POD},
                   "spec": {"containers": [{"name": "trainer"}]}})
    request = json_format.Parse(MIRROR_ALLOCATION_REQUEST_JSON, pb.MirrorAllocationRequest())
    # The documented reply is a mirror's with its defaults: upstream KAI's dialect.
    result = await MirrorService(store).mirror(
        allocation_from_proto(request.allocation), idempotency_key=request.idempotency_key)
    reply = pb.MirrorAllocationResponse(
        annotations=dict(result.annotations), changed=result.changed,
        resource_version=result.resource_version,
        containers=[plan_to_proto(p) for p in result.plans])
    (documented,) = [b for b in blocks("json") if '"changed": true' in b]
    assert json.loads(documented) == json.loads(json_format.MessageToJson(
        reply, preserving_proto_field_name=True))


def test_python_client_runs_against_a_mirror(mirror_tcp):
    snippet = DOC.split("<!-- python-client:begin", 1)[1].split("```python\n", 1)[1]
    snippet = snippet.split("```", 1)[0]
    pod = mirror_tcp.create_pod("train-0", SM_POD)
    code = (snippet.replace('"127.0.0.1:50051"', repr(mirror_tcp.server.address))
            .replace(UID, pod["metadata"]["uid"]))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "docs/mirror.md", "exec"), {})
    assert out.getvalue() == "changed: True 20Gi\n"
    assert mirror_tcp.patches("team-a", "train-0") == 1
