"""`kai-fractions validate` reports what the validating webhook refuses in a pod's spec (host
paths, ways past the containers), from the webhook's own rules: a manifest that validates is not
refused at `kubectl apply` for its spec."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from kai_fractions.admission.config import AdmissionConfig
from kai_fractions.admission.validate import validate

from .helpers import cli

FRACTIONAL_TEMPLATE = {
    "metadata": {"labels": {"app": "infer"}, "annotations": {"gpu-fraction": "0.5"}},
    "spec": {
        "schedulerName": "kai-scheduler",
        "containers": [{"name": "main", "image": "img",
                        "securityContext": {"privileged": True}}],
        "volumes": [{"name": "k", "hostPath": {"path": "/var/lib/kubelet"}}],
    },
}
DEPLOYMENT = {"apiVersion": "apps/v1", "kind": "Deployment",
              "metadata": {"name": "infer", "namespace": "ml"},
              "spec": {"selector": {"matchLabels": {"app": "infer"}},
                       "template": FRACTIONAL_TEMPLATE}}
CRONJOB = {"apiVersion": "batch/v1", "kind": "CronJob",
           "metadata": {"name": "nightly", "namespace": "ml"},
           "spec": {"schedule": "@daily", "jobTemplate": {"spec": {
               "template": FRACTIONAL_TEMPLATE}}}}
EXPORTER = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "exporter", "namespace": "mon"},
            "spec": {"containers": [{"name": "e", "image": "img"}],
                     "volumes": [{"name": "root", "hostPath": {"path": "/"}}]}}
NO_EXEMPTION = ("(no namespace exemption lifts this for a pod with NvFractions keys: mount a "
                "narrower host directory, or run the host agent as a pod of its own without them)")
EXEMPTION = ("(to admit a trusted host agent without NvFractions keys, exempt its namespace: "
             "the label kai-fractions.io/webhook=disabled, or the chart's "
             "webhook.hostPathExemptNamespaces)")


def write(tmp_path: Path, *objects: dict) -> str:
    path = tmp_path / "manifests.yaml"
    path.write_text(yaml.safe_dump_all(objects))
    return str(path)


def test_a_workloads_spec_problems_name_the_template_field(tmp_path, capsys) -> None:
    f = write(tmp_path, DEPLOYMENT)
    code, out, err = cli(capsys, "validate", "-f", f)
    assert code == 1
    assert out.splitlines() == [
        f"{f}:1: Deployment/ml/infer: spec.template.spec.volumes[0].hostPath.path: "
        "'/var/lib/kubelet' reaches the kubelet's pods directory '/var/lib/kubelet/pods'; no "
        "volume may: the kubelet mounts every pod's subPath volumes read-write under it, the "
        f"gate's marker directory and the MPS namespaces included {NO_EXEMPTION}",
        f"{f}:1: Deployment/ml/infer: spec.template.spec.containers[0].securityContext."
        "privileged: must not be true in a pod with a GPU fraction: a privileged container "
        "gets every GPU of the node, whatever NVIDIA_VISIBLE_DEVICES says",
    ]
    assert "0 of 1 object(s) valid" in err


def test_a_cronjobs_template_field_is_under_its_job_template(tmp_path, capsys) -> None:
    code, out, _ = cli(capsys, "validate", "-f", write(tmp_path, CRONJOB))
    assert code == 1
    assert ": CronJob/ml/nightly: spec.jobTemplate.spec.template.spec.volumes[0].hostPath.path: " \
        in out


def test_a_pod_without_fraction_keys_gets_the_exemption_hint_once(tmp_path, capsys) -> None:
    code, out, _ = cli(capsys, "validate", "-f", write(tmp_path, EXPORTER))
    assert code == 1
    lines = out.splitlines()
    assert len(lines) == 4  # the marker root, the MPS pipes, the socket, the kubelet's pods
    assert all(": mon/exporter: spec.volumes[0].hostPath.path: '/' reaches " in ln
               for ln in lines)
    assert [ln.endswith(EXEMPTION) for ln in lines] == [False, False, False, True]


def test_json_output_keys_each_problem_by_its_field(tmp_path, capsys) -> None:
    code, out, _ = cli(capsys, "validate", "-f", write(tmp_path, DEPLOYMENT), "-o", "json")
    assert code == 1
    errors = json.loads(out)["objects"][0]["errors"]
    assert [e["key"] for e in errors] == [
        "spec.template.spec.volumes[0].hostPath.path",
        "spec.template.spec.containers[0].securityContext.privileged"]
    assert errors[1]["rule"].startswith("must not be true in a pod with a GPU fraction")


def test_the_host_directories_follow_the_flags(tmp_path, capsys) -> None:
    """As the webhook is configured (`--kubelet-root-dir` and the chart's hostPaths)."""
    moved = {**EXPORTER, "spec": {**EXPORTER["spec"], "volumes": [
        {"name": "k", "hostPath": {"path": "/var/lib/kubelet"}}]}}
    f = write(tmp_path, moved)
    assert cli(capsys, "validate", "-f", f)[0] == 1
    assert cli(capsys, "validate", "-f", f, "--kubelet-root-dir", "/srv/kubelet")[0] == 0
    code, _, err = cli(capsys, "validate", "-f", f, "--kubelet-root-dir", "srv")
    assert code == 2
    assert err == ("kai-fractions validate: --kubelet-root-dir: must be an absolute host "
                   "directory other than /, got 'srv'\n")


@pytest.mark.parametrize("obj", [
    {**EXPORTER, "metadata": {**EXPORTER["metadata"], "annotations": {"gpu-fraction": "0.5"}},
     "spec": {**EXPORTER["spec"], "hostPID": True}},
    {**EXPORTER, "metadata": {**EXPORTER["metadata"], "annotations": {
        "nvidia.com/container.e.gpu-memory.request": "4Gi"}},
     "spec": {"containers": [{"name": "e", "image": "img", "securityContext": {
         "capabilities": {"add": ["SYS_ADMIN", "IPC_LOCK"]}}}]}},
    EXPORTER,
])
def test_every_line_is_the_webhooks_own_rule(tmp_path, capsys, obj: dict) -> None:
    """The offline check and the webhook word each problem the same: one set of rules."""
    code, out, _ = cli(capsys, "validate", "-f", write(tmp_path, obj))
    assert code == 1
    denial = validate({"uid": "u", "kind": {"group": "", "version": "v1", "kind": "Pod"},
                       "namespace": "mon", "operation": "CREATE",
                       "userInfo": {"username": "alice"}, "object": obj},
                      AdmissionConfig(gate_image="img")).message
    for ln in out.splitlines():
        assert ln.split(": mon/exporter: ", 1)[1] in denial


def test_the_examples_still_validate(capsys) -> None:
    examples = Path(__file__).resolve().parents[2] / "examples"
    code, out, _ = cli(capsys, "validate", "-f", str(examples))
    assert (code, out) == (0, "")


def test_a_mount_at_cudas_default_mps_pipe_directory_is_warned_as_the_webhooks_warn(
        tmp_path, capsys) -> None:
    """Upstream KAI's MPS example (a fractional pod mounting the host's /tmp/nvidia-mps): both
    webhooks admit it with a warning (`admission.default_mps`); `validate` said nothing."""
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {
               "name": "mps", "namespace": "ml", "annotations": {"gpu-fraction": "0.5"}},
           "spec": {"schedulerName": "kai-scheduler",
                    "containers": [{"name": "main", "image": "img", "volumeMounts": [
                        {"name": "mps", "mountPath": "/tmp/nvidia-mps"}]}],
                    "volumes": [{"name": "mps", "hostPath": {"path": "/tmp/nvidia-mps"}}]}}
    f = write(tmp_path, pod)
    code, out, err = cli(capsys, "validate", "-f", f)
    assert code == 0, out
    assert (f"warning: {f}:1: ml/mps: spec: container 'main' mounts the host's "
            "'/tmp/nvidia-mps', CUDA's default MPS pipe directory: it asks for an MPS daemon "
            "kai_fractions does not manage; the container runs time-sliced") in err, err
