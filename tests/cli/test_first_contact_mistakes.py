"""The mistakes a newcomer makes first, and what the CLI says about them.

GPU-sharing keys where no pod reads them (on a workload's own metadata; as a label) were
silently valid: `validate` said `1 of 1 object(s) valid` and the pods asked for no GPU. Now each
is a warning (the exit code unchanged) naming the field and where the key belongs; the
workloads' validating webhook gives the same warning for the templates it is sent.

`plan`'s exit code for a bad flag value depended on which check caught it (`--devices gpu0`:
1, reported as the manifest's error; `--portion 50%`: 2; `--portion 0`: 1). Now every flag
value is checked before any pod is read, and a bad one is a usage error (2) naming the flag;
only a decision that does not fit a pod (the number of devices it asks for) is that pod's (1).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from kai_fractions.admission.validate import validate

from ..admission.reviews import CONFIG, request
from .helpers import GPU_A, cli, data

REQUEST = "nvidia.com/container.vllm.gpu-memory.request"


def deployment(own: dict[str, str] | None = None, template: dict[str, str] | None = None,
               labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "infer", "namespace": "ns", "annotations": dict(own or {})},
        "spec": {"selector": {"matchLabels": {"app": "infer"}}, "template": {
            "metadata": {"labels": {"app": "infer", **(labels or {})},
                         "annotations": dict(template or {})},
            "spec": {"schedulerName": "kai-scheduler",
                     "containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]}}},
    }


def write(tmp_path: Path, *docs: dict[str, Any]) -> str:
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    return str(path)


def warnings(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("warning: ")]


# -- R10-2: keys where no pod reads them ------------------------------------------------------


def test_a_key_on_a_workloads_own_metadata_is_a_warning(capsys, tmp_path: Path) -> None:
    """Before: `1 of 1 object(s) valid`, no warning, and the Deployment's pods asked for no GPU.
    Now: still valid (exit 0), with a warning naming the field and where the key belongs."""
    path = write(tmp_path, deployment(own={REQUEST: "20Gi"}))
    code, out, err = cli(capsys, "validate", "-f", path)
    assert (code, out) == (0, "")
    assert warnings(err) == [
        f"warning: {path}:1: Deployment/ns/infer: metadata.annotations['{REQUEST}']: is on the "
        "Deployment's own metadata, which no pod gets, so it asks for nothing: put it on the "
        "annotations of the pod template whose pods are to ask for it "
        "(spec.template.metadata.annotations for this one)"]
    assert "1 of 1 object(s) valid" in err


def test_a_cronjobs_key_belongs_on_its_jobs_pod_template(capsys, tmp_path: Path) -> None:
    """Before: silently valid. Now: the warning names the CronJob's own template path."""
    cronjob = {"apiVersion": "batch/v1", "kind": "CronJob",
               "metadata": {"name": "nightly", "annotations": {"gpu-fraction": "0.5"}},
               "spec": {"schedule": "@daily", "jobTemplate": {"spec": {"template": {"spec": {
                   "schedulerName": "kai-scheduler",
                   "containers": [{"name": "main", "image": "img"}]}}}}}}
    code, _, err = cli(capsys, "validate", "-f", write(tmp_path, cronjob))
    assert code == 0
    [warning] = warnings(err)
    assert warning.endswith(": metadata.annotations['gpu-fraction']: is on the CronJob's own "
                            "metadata, which no pod gets, so it asks for nothing: put it on the "
                            "annotations of the pod template whose pods are to ask for it "
                            "(spec.jobTemplate.spec.template.metadata.annotations for this one)")


@pytest.mark.parametrize(("obj", "field"), [
    ({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "lab", "labels": {
        "gpu-fraction": "0.5"}}, "spec": {"containers": [{"name": "main", "image": "img"}]}},
     "metadata"),
    (deployment(labels={"gpu-memory": "8192"}), "spec.template.metadata"),
], ids=["pod", "template"])
def test_a_key_written_as_a_label_is_a_warning(capsys, tmp_path: Path, obj: dict[str, Any],
                                               field: str) -> None:
    """Before: a `gpu-fraction` (or any sharing key) label was silently valid, and the pod
    asked for no GPU. Now: a warning that it must be an annotation, and where."""
    key = next(k for k in obj_labels(obj) if k.startswith("gpu-"))
    code, out, err = cli(capsys, "validate", "-f", write(tmp_path, obj))
    assert (code, out) == (0, "")
    [warning] = warnings(err)
    assert warning.endswith(
        f": {field}.labels['{key}']: must be an annotation, not a label: GPU sharing is asked "
        f"for with annotations only, so this key asks for nothing; put it on "
        f"{field}.annotations"), warning


def obj_labels(obj: dict[str, Any]) -> dict[str, str]:
    if obj["kind"] == "Pod":
        return obj["metadata"]["labels"]
    return obj["spec"]["template"]["metadata"]["labels"]


def test_the_configured_prefix_decides_which_keys_are_sharing_keys(capsys,
                                                                   tmp_path: Path) -> None:
    """The per-container keys are those of `--annotation-prefix`: another prefix's key is no
    sharing key there (no warning), the configured one's is."""
    obj = deployment(own={"example.com/gpu.vllm.gpu-memory.request": "20Gi", REQUEST: "1Gi"})
    code, _, err = cli(capsys, "validate", "-f", write(tmp_path, obj),
                       "--annotation-prefix", "example.com/gpu.")
    assert code == 0
    [warning] = warnings(err)
    assert "metadata.annotations['example.com/gpu.vllm.gpu-memory.request']: " in warning


@pytest.mark.parametrize("obj", [
    # the same key on the template too (a chart that copies its annotations to both): the
    # pods ask for it
    deployment(own={REQUEST: "20Gi"}, template={REQUEST: "20Gi"}),
    # a label beside the annotation of the same key: the pod asks for it
    deployment(template={"gpu-fraction": "0.5"}, labels={"gpu-fraction": "0.5"}),
    # keys that ask for no GPU share, and the binder's own (no user writes those)
    deployment(own={"kai.scheduler/queue": "a", "nvidia.com/container.vllm.gpus.devices": "x"},
               labels={"gpu-group": "a"}),
], ids=["copied", "label-beside-annotation", "other-keys"])
def test_no_warning_where_the_pods_get_the_key(capsys, tmp_path: Path,
                                               obj: dict[str, Any]) -> None:
    """Only a key no pod gets is warned about (here beside one that is, which was not warned
    about before either)."""
    label = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "lab", "labels": {
        "gpu-fraction": "0.5"}}, "spec": {"containers": [{"name": "main", "image": "img"}]}}
    code, _, err = cli(capsys, "validate", "-f", write(tmp_path, obj, label))
    assert code == 0
    [warning] = [w for w in warnings(err) if "metadata." in w]
    assert "default/lab: metadata.labels['gpu-fraction']: " in warning, err


def test_json_output_carries_the_warning(capsys, tmp_path: Path) -> None:
    code, out, _ = cli(capsys, "validate", "-f", write(tmp_path, deployment(own={REQUEST: "2Gi"})),
                       "-o", "json")
    doc = json.loads(out)
    assert code == 0 and doc["valid"] is True
    [obj] = doc["objects"]
    assert obj["warnings"] == [{
        "container": None, "key": f"metadata.annotations['{REQUEST}']",
        "rule": "is on the Deployment's own metadata, which no pod gets, so it asks for "
                "nothing: put it on the annotations of the pod template whose pods are to ask "
                "for it (spec.template.metadata.annotations for this one)",
        "value": None}]


def test_the_warning_leaves_an_error_an_error(capsys, tmp_path: Path) -> None:
    obj = deployment(own={REQUEST: "20Gi"}, template={"gpu-fraction": "50"})
    code, out, err = cli(capsys, "validate", "-f", write(tmp_path, obj))
    assert code == 1
    assert "gpu-fraction: must be a portion" in out
    assert len(warnings(err)) == 1


def test_many_label_keys_are_listed_up_to_a_cap(capsys, tmp_path: Path) -> None:
    """A manifest may carry any number of such keys: the warnings are capped, the rest
    counted, as the contract's own warnings are (they travel in admission responses)."""
    labels = {f"nvidia.com/container.c{i}.gpu-compute.mode": "sm-sharing" for i in range(50)}
    code, _, err = cli(capsys, "validate", "-f", write(tmp_path, deployment(labels=labels)))
    assert code == 0
    found = warnings(err)
    assert len(found) == 21
    assert "and 30 more" in found[-1]


def test_the_workloads_webhook_gives_the_same_warning() -> None:
    """The webhook is sent a workload whose template carries a sharing key (its match
    condition); a key beside it on the workload's own metadata, or as a label, was admitted
    silently. Now it is admitted with the same warning as `validate` gives."""
    obj = deployment(own={"gpu-fraction-num-devices": "2"}, template={REQUEST: "20Gi"},
                     labels={"gpu-memory": "8192"})
    decision = validate(request(obj, kind="Deployment", group="apps"), CONFIG)
    assert decision.allowed, decision
    assert [w for w in decision.warnings if "metadata." in w] == [
        "metadata.annotations['gpu-fraction-num-devices']: is on the Deployment's own metadata, "
        "which no pod gets, so it asks for nothing: put it on the annotations of the pod "
        "template whose pods are to ask for it (spec.template.metadata.annotations for this "
        "one)",
        "spec.template.metadata.labels['gpu-memory']: must be an annotation, not a label: GPU "
        "sharing is asked for with annotations only, so this key asks for nothing; put it on "
        "spec.template.metadata.annotations"]


# -- R10-3: plan's bad flag values are usage errors -------------------------------------------


@pytest.mark.parametrize(("devices", "message"), [
    ("gpu0", "--devices (item 1): must be a GPU UUID (GPU-...), got 'gpu0'"),
    (f"{GPU_A},gpu1", "--devices (item 2): must be a GPU UUID (GPU-...), got 'gpu1'"),
    (f"{GPU_A},{GPU_A}", f"--devices: lists {GPU_A} twice"),
    (f"{GPU_A},{GPU_A.upper()}", f"--devices: lists {GPU_A.upper()} twice"),  # one GPU
    (",", "--devices: names no GPU: give the reserved GPU UUID of each fractional group"),
])
def test_bad_devices_exit_2_before_any_pod_is_read(capsys, devices: str, message: str) -> None:
    """Before: reported as the manifest's error (`file:line: pod: --devices ...`), exit 1. Now:
    a usage error, exit 2, naming the flag (and no pod: none was read)."""
    code, out, err = cli(capsys, "plan", "-f", data("valid-pod.yaml"), "--node-gpu-memory",
                         "2000", "--devices", devices)
    assert (code, out) == (2, "")
    assert err == f"kai-fractions plan: {message}\n"


@pytest.mark.parametrize(("portion", "message"), [
    ("0", "--portion: must be greater than 0, got '0'"),
    ("-0.5", "--portion: must be greater than 0, got '-0.5'"),
    ("1e-400", "--portion: must be greater than 0, got '1e-400'"),  # 0 as a float64
    ("1e-70", "--portion: is too small to be written as a decimal portion, got '1e-70'"),
])
def test_bad_portion_exits_2_before_any_pod_is_read(capsys, portion: str, message: str) -> None:
    """Before: `--portion 0` was the manifest's error (exit 1) while `--portion 50%` was a usage
    error (exit 2). Now a portion out of range is a usage error too, naming the flag."""
    code, out, err = cli(capsys, "plan", "-f", data("valid-pod.yaml"), "--node-gpu-memory",
                         "2000", "--devices", GPU_A, "--portion", portion)
    assert (code, out) == (2, "")
    assert err == f"kai-fractions plan: {message}\n"


def test_a_reserve_that_leaves_no_memory_exits_2(capsys) -> None:
    """Before: the pod's error, exit 1, though two flags alone decide it. Now: a usage error."""
    code, out, err = cli(capsys, "plan", "-f", data("valid-pod.yaml"), "--node-gpu-memory",
                         "2000", "--devices", GPU_A, "--reserve", "2000", "--dialect", "patched")
    assert (code, out) == (2, "")
    assert err == ("kai-fractions plan: --reserve: leaves no GPU memory to share: the node has "
                   "2000 MiB per GPU (--node-gpu-memory), got 2000\n")


def test_a_flag_check_runs_before_the_input_is_read(capsys) -> None:
    """A bad flag is said even when the file does not exist: the flags are checked first."""
    code, _, err = cli(capsys, "plan", "-f", "no-such.yaml", "--node-gpu-memory", "2000",
                       "--devices", "gpu0")
    assert code == 2
    assert err.startswith("kai-fractions plan: --devices (item 1): ")


def test_a_key_on_a_cronjobs_job_template_is_a_warning(capsys, tmp_path: Path) -> None:
    """A second look: a key on a CronJob's `spec.jobTemplate.metadata.annotations` lands on
    each Job, never on a pod, and nothing said so (the webhook's match condition never sends
    such a Job, and `validate` was silent). Now `validate` names the field."""
    cronjob = {"apiVersion": "batch/v1", "kind": "CronJob",
               "metadata": {"name": "nightly"},
               "spec": {"schedule": "@daily", "jobTemplate": {
                   "metadata": {"annotations": {"gpu-fraction": "0.5"}},
                   "spec": {"template": {"spec": {
                       "schedulerName": "kai-scheduler",
                       "containers": [{"name": "main", "image": "img"}]}}}}}}
    code, _, err = cli(capsys, "validate", "-f", write(tmp_path, cronjob))
    assert code == 0
    [warning] = warnings(err)
    assert warning.endswith(
        ": spec.jobTemplate.metadata.annotations['gpu-fraction']: is on the CronJob's "
        "spec.jobTemplate.metadata, which no pod gets, so it asks for nothing: put it on the "
        "annotations of the pod template whose pods are to ask for it "
        "(spec.jobTemplate.spec.template.metadata.annotations for this one)"), warning
