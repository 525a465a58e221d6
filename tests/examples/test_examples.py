"""The manifests users copy: valid for the NvFractions contract (`kai-fractions validate`) and for
Kubernetes (`kubernetes-validate --strict`), scheduled by KAI into a queue that queue.yaml
defines, and explained in examples/README.md."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType

import pytest
import yaml

from kai_fractions.cli import main
from kai_fractions.contract import (
    DEFAULT_KEYS,
    BindDecision,
    ComputeMode,
    Dialect,
    binder_annotations,
    keys,
    parse_pod,
    plan_pod,
    pod_views,
)
from tests.chart.render import EXAMPLES, kube_validate, yaml_files

FILES = tuple(yaml_files(EXAMPLES))
EXPECTED = {"memory-request.yaml", "request-and-limit.yaml", "gpu-fraction-with-limit.yaml",
            "sm-sharing.yaml", "multi-device-fraction.yaml", "inference-deployment.yaml",
            "job.yaml", "queue.yaml"}
# The Queue fields of KAI's CRD (scheduling.run.ai/v2, queues.scheduling.run.ai).
QUEUE_SPEC_FIELDS = {"displayName", "parentQueue", "priority", "resources",
                     "preemptMinRuntime", "reclaimMinRuntime"}
QUEUE_RESOURCE_FIELDS = {"quota", "limit", "overQuotaWeight"}
GPU = "GPU-00000000-0000-0000-0000-000000000001"


def load(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def all_docs() -> list[tuple[Path, dict]]:
    return [(p, d) for p in FILES for d in load(p)]


def test_every_scenario_has_its_example():
    assert {p.name for p in FILES} == EXPECTED


def test_kai_fractions_validate_accepts_every_example(capsys):
    assert main(["validate", "-f", str(EXAMPLES), "--output", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["valid"] is True
    assert len(report["objects"]) == 7  # every Pod and workload (the Queue has no pod)
    for obj in report["objects"]:
        assert obj["fractional_containers"], obj["object"]
        # The one known upstream limit (docs/mirror.md): KAI main's own webhook refuses the
        # limit its binder writes beside gpu-fraction, and validate says so.
        expected = (["gpu-fraction.limit"] if obj["object"] == "default/gpu-fraction-with-limit"
                    else [])
        assert [w["key"] for w in obj["warnings"]] == expected, obj["object"]


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_examples_pass_kubernetes_validate_strict(path: Path):
    assert kube_validate(load(path), path.name) == []


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_examples_are_commented(path: Path):
    assert path.read_text().startswith("# "), f"{path.name} should open with what it shows"


def test_every_workload_is_scheduled_by_kai_into_a_defined_leaf_queue():
    queues = {d["metadata"]["name"]: d for _, d in all_docs() if d["kind"] == "Queue"}
    parents = {q["spec"].get("parentQueue") for q in queues.values()}
    for path, doc in all_docs():
        if doc["kind"] == "Queue":
            continue
        template = doc if doc["kind"] == "Pod" else doc["spec"]["template"]
        spec = template["spec"]
        assert spec["schedulerName"] == keys.KAI_SCHEDULER_NAME, path.name
        queue = template["metadata"]["labels"][keys.QUEUE_LABEL]
        assert queue in queues and queue not in parents, f"{path.name}: {queue} is no leaf"
        for c in spec["containers"] + spec.get("initContainers", []):
            assert keys.is_container_name(c["name"]), f"{path.name}: {c['name']}"
            assert "/" in c["image"] and ":" in c["image"], f"{path.name}: pin a real image"
            # a fraction is never a whole-GPU request too
            assert keys.WHOLE_GPU_RESOURCE not in (c.get("resources") or {}).get("limits", {})


def test_queue_matches_kais_crd():
    queues = [d for _, d in all_docs() if d["kind"] == "Queue"]
    assert queues
    for q in queues:
        assert q["apiVersion"] == "scheduling.run.ai/v2"
        assert "namespace" not in q["metadata"]  # cluster-scoped
        assert set(q["spec"]) <= QUEUE_SPEC_FIELDS
        for resource, fields in q["spec"]["resources"].items():
            assert resource in {"cpu", "gpu", "memory"}
            assert set(fields) <= QUEUE_RESOURCE_FIELDS
            assert all(isinstance(v, int | float) for v in fields.values())


def test_memory_request_example_asks_for_gpu_memory_only():
    [pod] = load(EXAMPLES / "memory-request.yaml")
    [container] = pod["spec"]["containers"]
    assert pod["kind"] == "Pod"
    assert pod["metadata"]["annotations"] == {
        DEFAULT_KEYS.container(container["name"], keys.MEMORY_REQUEST): "8Gi"}


def test_each_scenario_asks_for_what_its_name_says():
    requests = {}
    for path, doc in all_docs():
        for view in pod_views(doc):
            requests[path.name] = parse_pod(view, DEFAULT_KEYS)
    share = {name: r.share for name, r in requests.items()}
    assert share["request-and-limit.yaml"].request_bytes == 8 * 2**30
    assert share["request-and-limit.yaml"].limit_bytes == 16 * 2**30
    assert str(share["gpu-fraction-with-limit.yaml"].fraction) == "1/4"
    assert str(share["gpu-fraction-with-limit.yaml"].limit_portion) == "1/2"
    assert share["sm-sharing.yaml"].compute_mode == "sm-sharing"
    assert share["multi-device-fraction.yaml"].num_devices == 2
    assert share["job.yaml"].legacy_memory_bytes == 10240 * 2**20
    assert share["inference-deployment.yaml"].limit_bytes == 24 * 2**30


def test_the_demo_plans_memory_request(capsys):
    # what scripts/demo runs
    assert main(["plan", "-f", str(EXAMPLES / "memory-request.yaml"), "--node-gpu-memory",
                 "81920", "--devices", "GPU-00000000-0000-0000-0000-000000000001"]) == 0
    out = capsys.readouterr().out
    assert "memory: request 8192 MiB, limit 8192 MiB" in out


def test_sm_sharing_example_gets_half_the_sms_with_the_mps_reserve():
    # The patched KAI (MPS reserve 1024 MiB) writes the compute portion 19968 / 39936 = 0.5.
    [view] = pod_views(load(EXAMPLES / "sm-sharing.yaml")[0])
    request = parse_pod(view, DEFAULT_KEYS)
    decision = BindDecision(node_gpu_memory_mib=40960, gpu_ids=(GPU,), reserve_mib=1024,
                            group_modes=(ComputeMode.SM_SHARING,), dialect=Dialect.PATCHED)
    written = binder_annotations(request, decision)
    assert written["nvidia.com/container.server.gpu-compute.portion"] == "0.5"
    bound = replace(view, annotations=MappingProxyType({**view.annotations, **written}))
    [plan] = plan_pod(parse_pod(bound, DEFAULT_KEYS))
    assert (plan.request_mib, plan.active_thread_percentage) == (19968, 50)
    assert plan.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"


def test_sm_sharing_example_has_no_compute_cap_from_upstream_kai(capsys):
    # `plan` plays upstream KAI main, which writes no compute portion: the SMs are not capped,
    # the memory still is.
    assert main(["plan", "-f", str(EXAMPLES / "sm-sharing.yaml"), "--node-gpu-memory", "40960",
                 "--devices", GPU]) == 0
    out = capsys.readouterr().out
    assert "gpu-compute.portion" not in out
    assert "env CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100" in out
    assert "memory: request 19968 MiB, limit 19968 MiB" in out


def test_readme_explains_every_example():
    readme = (EXAMPLES / "README.md").read_text()
    for name in EXPECTED:
        assert f"`{name}`" in readme, name


def test_readme_says_which_example_validate_warns_on(capsys):
    """Someone who runs `kai-fractions validate -f examples/` and sees a warning finds why in
    the example's row, and the rows of the others promise no warning."""
    main(["validate", "-f", str(EXAMPLES), "--output", "json"])
    report = json.loads(capsys.readouterr().out)
    warned = {Path(o["file"]).name for o in report["objects"] if o["warnings"]}
    assert warned == {"gpu-fraction-with-limit.yaml"}
    rows = {m.group(1): m.group(0) for m in re.finditer(
        r"^\| `([\w-]+\.yaml)` \|.*$", (EXAMPLES / "README.md").read_text(), flags=re.M)}
    for name, row in rows.items():
        says = "`validate` warns" in row
        assert says is (name in warned), name
    assert "upstream KAI main may never bind it" in rows["gpu-fraction-with-limit.yaml"]
