"""`kai-fractions validate -f FILE [--output json]`: exit codes, error lines, input handling."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

from .helpers import cli, data

INVALID_POD_LINES = [  # after `<file>:<line>: `
    "default/bad/ghost: nvidia.com/container.ghost.gpu-memory.limit: names container 'ghost', "
    "which is not in the pod (containers: main) (got '1Gi')",
    "default/bad/main: nvidia.com/container.main.gpu-memory.request: GPU memory must be greater "
    "than zero (got '0')",
    "default/bad/main: nvidia.com/container.main.gpu-compute.mode: must be one of: "
    "time-slicing, sm-sharing (got 'turbo')",
]
INVALID_JOB_LINE = ("Job/ml/train/trainer: gpu-fraction: must be a portion of one GPU, 0 < x < 1 "
                    "(got '50')")


def located(out: str, where: str) -> list[str]:
    """The lines of `out`, each checked to start with `where: ` and returned without it."""
    lines = out.splitlines()
    assert all(line.startswith(f"{where}: ") for line in lines), lines
    return [line[len(where) + 2:] for line in lines]


def test_valid_pod_exits_0(capsys) -> None:
    code, out, err = cli(capsys, "validate", "-f", data("valid-pod.yaml"))
    assert code == 0
    assert out == ""
    assert "1 of 1 object(s) valid" in err


def test_valid_workloads_exit_0(capsys) -> None:
    code, out, err = cli(capsys, "validate", "-f", data("workloads.yaml"))
    assert code == 0
    assert out == ""
    assert "3 of 3 object(s) valid" in err  # the ConfigMap has no pod


def test_whole_gpu_pod_is_valid(capsys) -> None:
    code, _, _ = cli(capsys, "validate", "-f", data("plain-pod.yaml"))
    assert code == 0


def test_invalid_pod_exits_1_with_every_error_on_its_own_line(capsys) -> None:
    code, out, err = cli(capsys, "validate", "-f", data("invalid-pod.yaml"))
    assert code == 1
    assert sorted(located(out, data("invalid-pod.yaml") + ":2")) == sorted(INVALID_POD_LINES)
    assert "0 of 1 object(s) valid" in err


def test_workload_errors_name_the_workload(capsys) -> None:
    code, out, _ = cli(capsys, "validate", "-f", data("invalid-job.yaml"))
    assert code == 1
    assert located(out, data("invalid-job.yaml") + ":1") == [INVALID_JOB_LINE]


def test_error_line_shape(capsys) -> None:
    _, out, _ = cli(capsys, "validate", "-f", data("invalid-pod.yaml"), "-f",
                    data("invalid-job.yaml"))
    for line in out.splitlines():
        where, obj_container, key, rule = line.split(": ", 3)
        file, _, number = where.rpartition(":")
        assert Path(file).is_file() and int(number) >= 1
        assert obj_container.count("/") >= 2
        assert key and " " not in key
        assert rule


def test_repeated_files_and_one_invalid_exits_1(capsys) -> None:
    code, out, err = cli(capsys, "validate", "-f", data("valid-pod.yaml"), "-f",
                         data("invalid-job.yaml"))
    assert code == 1
    assert located(out, data("invalid-job.yaml") + ":1") == [INVALID_JOB_LINE]
    assert "1 of 2 object(s) valid" in err


def test_directory_reads_yaml_and_yml_recursively(capsys) -> None:
    # dir/a.yaml is valid, dir/nested/b.yml is not, dir/notes.txt is not YAML and is skipped.
    code, out, err = cli(capsys, "validate", "-f", data("dir"))
    assert code == 1
    assert located(out, data("dir/nested/b.yml") + ":1") == [INVALID_JOB_LINE]
    assert "1 of 2 object(s) valid" in err


def test_stdin(capsys, monkeypatch) -> None:
    text = (Path(data("invalid-job.yaml")).read_text() + "---\n"
            + Path(data("valid-pod.yaml")).read_text())
    monkeypatch.setattr(sys, "stdin", io.StringIO(text))
    code, out, err = cli(capsys, "validate", "-f", "-")
    assert code == 1
    assert located(out, "<stdin>:1") == [INVALID_JOB_LINE]
    assert "1 of 2 object(s) valid" in err


def test_stdin_valid(capsys, monkeypatch) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO(Path(data("valid-pod.yaml")).read_text()))
    code, _, _ = cli(capsys, "validate", "-f", "-")
    assert code == 0


def test_json_output_valid(capsys) -> None:
    code, out, _ = cli(capsys, "validate", "-f", data("workloads.yaml"), "--output", "json")
    assert code == 0
    where = data("workloads.yaml")
    doc = json.loads(out)
    # Their templates name no scheduler: a warning each (test_a_fractional_pod_kai_does_not_...).
    assert [[w["key"] for w in o.pop("warnings")] for o in doc["objects"]] == [
        ["spec.template.spec.schedulerName"], ["spec.template.spec.schedulerName"],
        ["spec.jobTemplate.spec.template.spec.schedulerName"]]
    assert doc == {
        "valid": True,
        "objects": [
            {"object": "Deployment/team/infer", "file": where, "line": 1,
             "fractional_containers": ["server"], "errors": []},
            {"object": "StatefulSet/default/db", "file": where, "line": 20,
             "fractional_containers": ["db"], "errors": []},
            {"object": "CronJob/team/nightly", "file": where, "line": 37,
             "fractional_containers": ["train"], "errors": []},
        ],
    }


def test_json_output_invalid(capsys) -> None:
    code, out, _ = cli(capsys, "validate", "-f", data("invalid-job.yaml"), "-o", "json")
    assert code == 1
    doc = json.loads(out)
    assert doc["valid"] is False
    (obj,) = doc["objects"]
    assert obj["object"] == "Job/ml/train"
    assert obj["errors"] == [{
        "container": "trainer",
        "key": "gpu-fraction",
        "rule": "must be a portion of one GPU, 0 < x < 1",
        "value": "50",
    }]


def test_json_output_collects_all_three_errors(capsys) -> None:
    code, out, _ = cli(capsys, "validate", "-f", data("invalid-pod.yaml"), "-o", "json")
    assert code == 1
    (obj,) = json.loads(out)["objects"]
    assert sorted(e["key"] for e in obj["errors"]) == sorted([
        "nvidia.com/container.ghost.gpu-memory.limit",
        "nvidia.com/container.main.gpu-memory.request",
        "nvidia.com/container.main.gpu-compute.mode",
    ])


def test_custom_annotation_prefix(capsys, tmp_path: Path) -> None:
    manifest = tmp_path / "pod.yaml"
    manifest.write_text(
        "kind: Pod\nmetadata:\n  name: p\n  annotations:\n"
        "    gpu.example.com/c.main.gpu-memory.request: '0'\n"
        "spec:\n  containers:\n  - name: main\n")
    code, out, _ = cli(capsys, "validate", "-f", str(manifest),
                       "--annotation-prefix", "gpu.example.com/c.")
    assert code == 1
    assert out.startswith(f"{manifest}:1: default/p/main: "
                          "gpu.example.com/c.main.gpu-memory.request: ")
    code, _, _ = cli(capsys, "validate", "-f", str(manifest))
    assert code == 0


# -- exit 2: usage and unreadable input -------------------------------------------------------


def test_missing_file(capsys, tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    code, out, err = cli(capsys, "validate", "-f", str(missing))
    assert code == 2
    assert out == ""
    assert err.strip() == f"kai-fractions validate: {missing}: no such file or directory"


def test_invalid_yaml_names_the_file_line_and_column(capsys) -> None:
    code, out, err = cli(capsys, "validate", "-f", data("bad-yaml.yaml"))
    assert code == 2
    assert out == ""
    assert err == (f"kai-fractions validate: {data('bad-yaml.yaml')}:6:1: not valid YAML: "
                   "expected ',' or '}', but got '<scalar>' (while parsing a flow mapping from "
                   "line 5)\n")


def test_yaml_the_reader_refuses_or_cannot_nest_is_a_clear_error(capsys, tmp_path) -> None:
    control = tmp_path / "bell.yaml"
    control.write_text("kind: Pod\x07\n")
    deep = tmp_path / "deep.yaml"
    deep.write_text("a: " + "[" * 5000 + "]" * 5000 + "\n")
    for path, said in ((control, "not valid YAML: unacceptable character #x0007"),
                       (deep, "not valid YAML: nested too deep to read")):
        code, out, err = cli(capsys, "validate", "-f", str(path))
        assert (code, out) == (2, "")
        assert err.startswith(f"kai-fractions validate: {path}: {said}"), err


def test_non_mapping_document(capsys) -> None:
    code, _, err = cli(capsys, "validate", "-f", data("not-mapping.yaml"))
    assert code == 2
    assert err.strip() == (f"kai-fractions validate: {data('not-mapping.yaml')}:1: a document "
                           "is not a Kubernetes object (a mapping)")


def test_scalar_document(capsys, monkeypatch) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("just a string\n"))
    code, _, err = cli(capsys, "validate", "-f", "-")
    assert code == 2
    assert "<stdin>" in err


def test_binary_file(capsys, tmp_path: Path) -> None:
    blob = tmp_path / "blob.yaml"
    blob.write_bytes(b"\xff\xfe\x00\x81garbage")
    code, _, err = cli(capsys, "validate", "-f", str(blob))
    assert code == 2
    assert str(blob) in err


def test_nothing_to_check_is_a_usage_error(capsys, tmp_path: Path) -> None:
    empty = tmp_path / "empty.yaml"
    empty.write_text("---\n")
    queue = tmp_path / "queue.yaml"
    queue.write_text("apiVersion: scheduling.run.ai/v2\nkind: Queue\nmetadata: {name: q}\n")
    code, out, err = cli(capsys, "validate", "-f", str(empty))
    assert (code, out) == (2, "")
    assert err == (f"kai-fractions validate: nothing to check: {empty} holds no Pod or workload "
                   "with a pod template (no objects)\n")
    code, out, err = cli(capsys, "validate", "-f", str(queue), "-f", str(empty))
    assert (code, out) == (2, "")
    assert err.endswith(f"nothing to check: {queue}, {empty} hold no Pod or workload with a "
                        "pod template (found: Queue)\n")


def test_a_named_file_with_nothing_to_check_is_a_warning(capsys, tmp_path: Path) -> None:
    queue = tmp_path / "queue.yaml"
    queue.write_text("kind: Queue\nmetadata: {name: q}\n")
    code, out, err = cli(capsys, "validate", "-f", str(queue), "-f", data("valid-pod.yaml"))
    assert (code, out) == (0, "")
    assert err.splitlines() == [
        f"warning: {queue}: no Pod or workload with a pod template (found: Queue): nothing in "
        "it to check",
        "1 of 1 object(s) valid"]
    # Found in a directory, it is skipped quietly: directories hold other objects too.
    (tmp_path / "pod.yaml").write_text(Path(data("valid-pod.yaml")).read_text())
    code, _, err = cli(capsys, "validate", "-f", str(tmp_path))
    assert (code, err) == (0, "1 of 1 object(s) valid\n")


def test_a_wrong_flag_shows_the_commands_usage(capsys) -> None:
    code, out, err = cli(capsys, "validate", "-f", "x.yaml", "--bogus")
    assert (code, out) == (2, "")
    assert err.startswith("usage: kai-fractions validate ")
    assert err.endswith("kai-fractions validate: error: unrecognized arguments: --bogus\n")
    code, _, err = cli(capsys, "plan", "--nope", "-f", "x.yaml", "--node-gpu-memory", "1",
                       "--devices", "GPU-x")
    assert code == 2 and err.startswith("usage: kai-fractions plan ")
    code, _, err = cli(capsys, "--bogus")
    assert code == 2 and err.startswith("usage: kai-fractions [-h]")


@pytest.mark.parametrize(
    "argv",
    [
        ["validate"],  # -f is required
        ["validate", "-f", "x.yaml", "--output", "xml"],
        ["validate", "-f", "x.yaml", "--bogus"],
        ["frobnicate"],
    ],
)
def test_bad_flags_exit_2(capsys, argv: list[str]) -> None:
    code, out, err = cli(capsys, *argv)
    assert code == 2
    assert out == ""
    assert "error:" in err


def test_no_command_exits_2(capsys) -> None:
    code, _, err = cli(capsys)
    assert code == 2
    assert "validate" in err and "plan" in err


def test_bad_annotation_prefix_exits_2(capsys) -> None:
    code, _, err = cli(capsys, "validate", "-f", data("valid-pod.yaml"),
                       "--annotation-prefix", "nope")
    assert code == 2
    assert err.startswith("kai-fractions validate: --annotation-prefix: ")


@pytest.mark.parametrize(
    "manifest",
    [
        "kind: Pod\nmetadata: {name: p}\nspec: not-a-mapping\n",
        "kind: Pod\nmetadata: [a, b]\nspec: {}\n",
        "kind: Pod\nmetadata: {name: p, annotations: [a, b]}\nspec: {}\n",
        "kind: Pod\nmetadata: {name: p}\nspec: {containers: [{name: main, resources: [x]}]}\n",
        "kind: Pod\nmetadata: {name: p}\n"
        "spec: {containers: [{name: main, resources: {limits: [x]}}]}\n",
        "kind: Pod\nmetadata: {name: p}\nspec: {containers: 3}\n",
        "kind: Deployment\nmetadata: {name: d}\nspec: {template: {spec: [x]}}\n",
        "kind: Deployment\nmetadata: {name: d}\nspec: {template: {metadata: x, spec: {}}}\n",
        "kind: Deployment\nmetadata: {name: d}\nspec: [x]\n",
        "kind: CronJob\nmetadata: {name: c}\nspec: {jobTemplate: [x]}\n",
        "kind: PodTemplate\nmetadata: {name: t}\ntemplate: just-text\n",
        "kind: List\nitems: 3\n",
    ],
    ids=["spec-scalar", "metadata-list", "annotations-list", "resources-list", "limits-list",
         "containers-int", "template-spec-list", "template-metadata-scalar", "workload-spec-list",
         "jobtemplate-list", "podtemplate-template-scalar", "list-items-int"],
)
def test_malformed_objects_exit_2_without_traceback(capsys, tmp_path: Path, manifest: str) -> None:
    """A mapping whose fields have the wrong shape is not a Kubernetes object we can read:
    unreadable input, exit 2 with a one-line message naming the file, never a traceback."""
    path = tmp_path / "m.yaml"
    path.write_text(manifest)
    code, _, err = cli(capsys, "validate", "-f", str(path))
    assert code == 2
    assert str(path) in err


def test_an_endless_or_huge_input_is_refused_not_read_for_ever(capsys, monkeypatch,
                                                                tmp_path) -> None:
    """`-f /dev/zero` read until memory ran out; past the cap the file is named instead."""
    from kai_fractions.cli import manifests
    monkeypatch.setattr(manifests, "MAX_FILE_BYTES", 1024)
    big = tmp_path / "big.yaml"
    big.write_text("# padding\n" * 200)
    code, out, err = cli(capsys, "validate", "-f", str(big))
    assert code == 2 and out == ""
    assert err.strip() == f"kai-fractions validate: {big}: larger than 1,024 bytes; split it"
    monkeypatch.setattr(sys, "stdin", io.StringIO("# padding\n" * 200))
    code, _, err = cli(capsys, "validate", "-f", "-")
    assert code == 2 and "<stdin>: larger than" in err


# -- pod templates nested below a kind's spec (PyTorchJob, LeaderWorkerSet, ...) ---------------

VALID_POD = """\
kind: Pod
metadata: {name: p, annotations: {gpu-memory: "2000"}}
spec:
  schedulerName: kai-scheduler
  containers: [{name: main, image: x}]
"""
PYTORCHJOB = """\
apiVersion: kubeflow.org/v1
kind: PyTorchJob
metadata: {name: ptj, namespace: ml}
spec:
  pytorchReplicaSpecs:
    Master:
      template:
        metadata: {annotations: {gpu-fraction: "0.5"}}
        spec: {schedulerName: kai-scheduler, containers: [{name: pytorch, image: x}]}
    Worker:
      template:
        metadata: {annotations: {gpu-fraction: "1.5"}}
        spec: {schedulerName: kai-scheduler, containers: [{name: pytorch, image: x}]}
"""
WORKER_LINE = ("PyTorchJob/ml/ptj spec.pytorchReplicaSpecs.Worker.template/pytorch: gpu-fraction: "
               "must be a portion of one GPU, 0 < x < 1 (got '1.5')")


def test_a_template_nested_below_spec_is_checked_in_a_file_a_mixed_file_and_a_directory(
        capsys, tmp_path: Path) -> None:
    """KAI schedules a PyTorchJob's pods, and KAI refuses gpu-fraction 1.5: validate said
    "nothing to check" for the job alone, and "1 of 1 object(s) valid" beside a Pod."""
    job = tmp_path / "dir" / "job.yaml"
    job.parent.mkdir()
    job.write_text(PYTORCHJOB)
    code, out, err = cli(capsys, "validate", "-f", str(job))
    assert (code, located(out, f"{job}:1")) == (1, [WORKER_LINE])
    assert err == "1 of 2 object(s) valid\n"  # each template is checked, Master too
    mixed = tmp_path / "mixed.yaml"
    mixed.write_text(VALID_POD + "---\n" + PYTORCHJOB)
    code, out, err = cli(capsys, "validate", "-f", str(mixed))
    assert (code, located(out, f"{mixed}:7"), err) == (1, [WORKER_LINE],
                                                        "2 of 3 object(s) valid\n")
    code, out, _ = cli(capsys, "validate", "-f", str(job.parent), "-o", "json")
    assert code == 1
    assert [(o["object"], [e["key"] for e in o["errors"]]) for o in json.loads(out)["objects"]] == [
        ("PyTorchJob/ml/ptj spec.pytorchReplicaSpecs.Master.template", []),
        ("PyTorchJob/ml/ptj spec.pytorchReplicaSpecs.Worker.template", ["gpu-fraction"])]


def test_a_spec_problem_of_a_nested_template_is_named_by_its_path(capsys, tmp_path) -> None:
    path = tmp_path / "lws.yaml"
    path.write_text("""\
kind: LeaderWorkerSet
metadata: {name: lws}
spec:
  leaderWorkerTemplate:
    workerTemplate:
      metadata: {annotations: {gpu-fraction: "0.5"}}
      spec:
        schedulerName: kai-scheduler
        hostPID: true
        containers: [{name: w, image: x}]
""")
    code, out, _ = cli(capsys, "validate", "-f", str(path))
    assert code == 1
    assert out.startswith(f"{path}:1: LeaderWorkerSet/default/lws "
                          "spec.leaderWorkerTemplate.workerTemplate: "
                          "spec.leaderWorkerTemplate.workerTemplate.spec.hostPID: "), out


def test_an_object_with_no_pod_template_found_is_a_warning_wherever_it_is(
        capsys, tmp_path: Path) -> None:
    """A kind whose templates are not where they are searched must not pass unseen: a warning
    in a named file, beside a Pod and in a directory. Kinds that hold no pods stay quiet."""
    vm = ("apiVersion: kubevirt.io/v1\nkind: VirtualMachine\nmetadata: {name: vm, namespace: v}\n"
          "spec: {template: {spec: {domain: {devices: {}}}}}\n")
    quiet = "kind: ConfigMap\nmetadata: {name: c}\n---\nkind: Queue\nmetadata: {name: q}\n"
    (tmp_path / "dir").mkdir()
    mixed = tmp_path / "dir" / "mixed.yaml"
    mixed.write_text(VALID_POD + "---\n" + quiet + "---\n" + vm)
    warning = (f"warning: {mixed}:13: VirtualMachine/v/vm: no pod template found in it (a mapping "
               "whose spec.containers is a list, at most 16 levels below spec), so nothing in it "
               "was checked; if it creates pods that ask for GPU fractions, validate one of them: "
               "kubectl get pod NAME -o yaml | kai-fractions validate -f -")
    for target in (mixed, mixed.parent):
        code, out, err = cli(capsys, "validate", "-f", str(target))
        assert (code, out, err.splitlines()) == (0, "", [warning, "1 of 1 object(s) valid"])
    alone = tmp_path / "vm.yaml"
    alone.write_text(vm)
    code, out, err = cli(capsys, "validate", "-f", str(alone), "-f", data("valid-pod.yaml"))
    assert (code, out) == (0, "")
    assert err.splitlines()[0].startswith(f"warning: {alone}:1: VirtualMachine/v/vm: no pod ")
    assert len(err.splitlines()) == 2  # not a second warning for the file


# -- a fractional pod that KAI's scheduler does not schedule -----------------------------------

NO_SCHEDULER = ("absent, so the default scheduler places the pod, and only {name} binds a GPU "
                "fraction (KAI skips the pods of other schedulers): the pod would never be "
                "released from its gate; set {key}: {name}")
OTHER_SCHEDULER = ("names another scheduler, and only {name} binds a GPU fraction (KAI skips the "
                   "pods of other schedulers): the pod would never be released from its gate; "
                   "set {key}: {name}")


def pod_file(tmp_path: Path, scheduler: str | None, fraction: str | None = "0.5") -> Path:
    path = tmp_path / "pod.yaml"
    annotations = f"{{gpu-fraction: '{fraction}'}}" if fraction else "{}"
    path.write_text(f"kind: Pod\nmetadata: {{name: p, annotations: {annotations}}}\nspec:\n"
                    + (f"  schedulerName: {scheduler}\n" if scheduler else "")
                    + "  containers: [{name: main, image: x}]\n")
    return path


def test_a_fractional_pod_kai_does_not_schedule_is_a_warning_naming_the_fix(
        capsys, tmp_path: Path) -> None:
    """Only KAI binds a fraction; another scheduler's pod waits in its gate for ever. A warning:
    the exit code stays 0."""
    path = pod_file(tmp_path, None)
    code, out, err = cli(capsys, "validate", "-f", str(path))
    key = "spec.schedulerName"
    assert (code, out, err.splitlines()) == (0, "", [
        f"warning: {path}:1: default/p: {key}: "
        + NO_SCHEDULER.format(name="kai-scheduler", key=key),
        "1 of 1 object(s) valid"])
    path = pod_file(tmp_path, "default-scheduler")
    code, out, _ = cli(capsys, "validate", "-f", str(path), "-o", "json")
    assert code == 0
    (obj,) = json.loads(out)["objects"]
    assert obj["warnings"] == [{"container": None, "key": key, "value": "default-scheduler",
                                "rule": OTHER_SCHEDULER.format(name="kai-scheduler", key=key)}]


def test_scheduler_name_names_kais_scheduler_where_it_is_renamed(capsys, tmp_path) -> None:
    path = pod_file(tmp_path, "kai-scheduler")
    assert cli(capsys, "validate", "-f", str(path)) == (0, "", "1 of 1 object(s) valid\n")
    code, _, err = cli(capsys, "validate", "-f", str(path), "--scheduler-name", "gpu-sched")
    assert (code, err.splitlines()) == (0, [
        f"warning: {path}:1: default/p: spec.schedulerName: "
        + OTHER_SCHEDULER.format(name="gpu-sched", key="spec.schedulerName")
        + " (got 'kai-scheduler')", "1 of 1 object(s) valid"])
    path = pod_file(tmp_path, "gpu-sched")
    assert cli(capsys, "validate", "-f", str(path), "--scheduler-name", "gpu-sched") == (
        0, "", "1 of 1 object(s) valid\n")


def test_the_scheduler_warning_is_for_fractional_pods_only_and_names_a_templates_field(
        capsys, tmp_path: Path) -> None:
    path = pod_file(tmp_path, None, fraction=None)
    assert cli(capsys, "validate", "-f", str(path)) == (0, "", "1 of 1 object(s) valid\n")
    job = tmp_path / "job.yaml"
    job.write_text(PYTORCHJOB.replace("schedulerName: kai-scheduler, ", "", 1))
    code, out, err = cli(capsys, "validate", "-f", str(job))
    key = "spec.pytorchReplicaSpecs.Master.template.spec.schedulerName"
    assert code == 1 and located(out, f"{job}:1") == [WORKER_LINE]
    assert err.splitlines()[0] == (
        f"warning: {job}:1: PyTorchJob/ml/ptj spec.pytorchReplicaSpecs.Master.template: {key}: "
        + NO_SCHEDULER.format(name="kai-scheduler", key=key))
