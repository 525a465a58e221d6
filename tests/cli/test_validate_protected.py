"""`kai-fractions validate` refuses what the validating webhook refuses from a user: protected
keys (binder-owned, kai-fractions.io derived, the mirror's record) on a Pod or a pod template,
decided by the same `Keys.is_protected` the webhook uses."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from kai_fractions.admission.validate import validate
from kai_fractions.contract import DEFAULT_KEYS, Keys
from kai_fractions.contract import keys as k
from tests.admission.reviews import CONFIG, request

from .helpers import cli

REQUEST = DEFAULT_KEYS.container("main", k.MEMORY_REQUEST)
DEVICES = DEFAULT_KEYS.container("main", k.DEVICES)
PORTION = DEFAULT_KEYS.container("main", k.COMPUTE_PORTION)
DIGEST = DEFAULT_KEYS.derived("main", k.DERIVED_PLAN_DIGEST)
MODE = DEFAULT_KEYS.container("main", k.COMPUTE_MODE)
POD_RULE = ("is a protected key: only KAI's binder and the kai-fractions mirror and node agent "
            "may create it; the validating webhook refuses it from anyone else")
TEMPLATE_RULE = ("a pod template may not carry a protected key; the binder writes it on each pod "
                 "after scheduling")


def pod(annotations: dict[str, str], **metadata: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "pick", "namespace": "ns", "annotations": annotations,
                         **metadata},
            "spec": {"containers": [{"name": "main", "image": "registry.example.com/a:1"}]}}


def deployment(annotations: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "serve", "namespace": "ns"},
            "spec": {"selector": {"matchLabels": {"app": "serve"}},
                     "template": {"metadata": {"labels": {"app": "serve"},
                                               "annotations": annotations},
                                  "spec": pod({})["spec"]}}}


def write(tmp_path: Path, *docs: dict[str, Any]) -> str:
    path = tmp_path / "manifest.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    return str(path)


def test_a_pod_choosing_its_own_gpu_is_an_error(capsys, tmp_path: Path) -> None:
    manifest = write(tmp_path, pod({REQUEST: "8Gi", DEVICES: "GPU-1", DIGEST: "sha256:x",
                                    k.MIRRORED_RECORD: "{}"}))
    code, out, err = cli(capsys, "validate", "-f", manifest)
    assert code == 1
    assert out.splitlines() == [
        f"{manifest}:1: ns/pick/main: {DIGEST}: {POD_RULE}",
        f"{manifest}:1: ns/pick: {k.MIRRORED_RECORD}: {POD_RULE}",
        f"{manifest}:1: ns/pick/main: {DEVICES}: {POD_RULE}",
    ]
    assert "0 of 1 object(s) valid" in err


def test_the_webhook_refuses_the_same_keys() -> None:
    """The CLI reports exactly the keys the webhook names for a user's new pod."""
    annotations = {REQUEST: "8Gi", DEVICES: "GPU-1", DIGEST: "sha256:x", PORTION: "0.5"}
    decision = validate(request(pod(annotations)), CONFIG)
    assert not decision.allowed
    refused = {part.split(": ", 1)[0] for part in decision.message.split("; ")
               if "is a protected key" in part}
    assert refused == {DEVICES, DIGEST, PORTION}


def test_a_pod_template_may_carry_none(capsys, tmp_path: Path) -> None:
    manifest = write(tmp_path, deployment({"gpu-fraction": "0.5", PORTION: "0.5"}))
    code, out, _ = cli(capsys, "validate", "-f", manifest, "--output", "json")
    assert code == 1
    report = json.loads(out)
    assert report["valid"] is False
    [obj] = report["objects"]
    assert obj["errors"] == [{"container": "main", "key": PORTION, "rule": TEMPLATE_RULE,
                              "value": None}]


def test_a_pod_read_back_from_the_cluster_carries_them_legitimately(capsys,
                                                                    tmp_path: Path) -> None:
    """`kubectl get pod -o yaml | kai-fractions validate -f -` checks the contract of a pod
    the binder already wrote: its keys are not the user's."""
    manifest = write(tmp_path, pod({REQUEST: "8Gi", DEVICES: "GPU-1", DIGEST: "sha256:x"},
                                   uid="5f0c7a52-3b8e-4c1d-9a6f-2e7b1d4c8a90"))
    code, out, _ = cli(capsys, "validate", "-f", manifest)
    assert (code, out) == (0, "")


def test_a_new_sm_sharing_pod_may_name_its_own_mps_namespace(capsys, tmp_path: Path) -> None:
    own = DEFAULT_KEYS.derived("main", k.ADMITTED_MPS_NAMESPACE)
    other = DEFAULT_KEYS.derived("sidecar", k.ADMITTED_MPS_NAMESPACE)
    sm = {REQUEST: "8Gi", MODE: "sm-sharing", own: "kf_0123456789abcdef0123"}
    manifest = write(tmp_path, pod(sm))
    assert cli(capsys, "validate", "-f", manifest)[0] == 0
    # as the webhook (which refuses this unmutated pod for its missing gate, not for the key)
    assert "protected key" not in validate(request(pod(sm)), CONFIG).message
    manifest = write(tmp_path, pod({**sm, other: "kf_0123456789abcdef0124"}))
    code, out, _ = cli(capsys, "validate", "-f", manifest)
    assert code == 1
    assert out == f"{manifest}:1: ns/pick/sidecar: {other}: {POD_RULE}\n"
    # time-slicing: no MPS namespace at all
    manifest = write(tmp_path, pod({REQUEST: "8Gi", own: "kf_0123456789abcdef0123"}))
    assert cli(capsys, "validate", "-f", manifest)[0] == 1


@pytest.mark.parametrize("prefix", ["gpus.example.com/c."])
def test_protected_keys_follow_the_annotation_prefix(capsys, tmp_path: Path,
                                                     prefix: str) -> None:
    custom = Keys(prefix=prefix)
    devices = custom.container("main", k.DEVICES)
    manifest = write(tmp_path, pod({custom.container("main", k.MEMORY_REQUEST): "8Gi",
                                    devices: "GPU-1"}))
    code, out, _ = cli(capsys, "validate", "-f", manifest, "--annotation-prefix", prefix)
    assert code == 1
    assert out == f"{manifest}:1: ns/pick/main: {devices}: {POD_RULE}\n"
