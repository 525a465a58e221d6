"""`kai-fractions plan`: the binder's annotations and the node plan, text and JSON, exit codes."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

from .helpers import GPU_A, GPU_B, cli, data

MIB = 1 << 20


def plan_json(capsys, manifest: str, *extra: str) -> tuple[int, dict | list, str]:
    code, out, err = cli(capsys, "plan", "-f", data(manifest), "--output", "json", *extra)
    return code, (json.loads(out) if out.strip() else {}), err


PATCHED = ("--dialect", "patched")


def test_json_shape_sm_sharing(capsys) -> None:
    code, doc, _ = plan_json(capsys, "valid-pod.yaml", "--node-gpu-memory", "2000",
                             "--devices", GPU_A, "--portion", "0.5", *PATCHED)
    assert code == 0
    assert isinstance(doc, dict)
    assert set(doc) >= {"annotations", "containers"}
    annotations = doc["annotations"]
    assert {k: v for k, v in annotations.items() if not k.startswith("kai-fractions.io/")} == {
        "nvidia.com/container.main.gpu-memory.request": "1000Mi",
        "nvidia.com/container.main.gpus.devices": GPU_A,
        "nvidia.com/container.main.gpu-compute.portion": "0.5",
        "received-resource-type": "Fraction",
    }
    (name,) = doc["containers"]
    assert name == "main"
    container = doc["containers"]["main"]
    assert set(container) == {"env", "memory", "compute", "devices"}
    pipe = container["env"]["CUDA_MPS_PIPE_DIRECTORY"]
    assert container["env"] == {
        "NVIDIA_VISIBLE_DEVICES": GPU_A,
        "NVIDIA_GPU_MEMORY_REQUEST": "1000",
        "NVIDIA_GPU_MEMORY_LIMIT": "1000",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=1000M",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50",
        "CUDA_MPS_PIPE_DIRECTORY": pipe,
    }
    assert pipe.startswith("/run/kai-fractions/mps/") and len(pipe.encode()) <= 83
    assert container["memory"] == {"request_bytes": 1000 * MIB, "limit_bytes": 1000 * MIB}
    assert container["compute"] == {"mode": "sm-sharing", "active_thread_percentage": 50}
    assert container["devices"] == [GPU_A]
    # The derived annotations the env reads are part of what is written.
    assert annotations["kai-fractions.io/container.main.memory-limit-mib"] == "1000"
    assert annotations["kai-fractions.io/container.main.mps-pipe-directory"] == pipe
    assert annotations["kai-fractions.io/container.main.plan-digest"].startswith("sha256:")


def test_upstream_kai_writes_no_compute_portion(capsys) -> None:
    code, doc, _ = plan_json(capsys, "valid-pod.yaml", "--node-gpu-memory", "2000",
                             "--devices", GPU_A, "--portion", "0.5")
    assert code == 0
    assert isinstance(doc, dict)
    assert "nvidia.com/container.main.gpu-compute.portion" not in doc["annotations"]
    assert doc["annotations"]["nvidia.com/container.main.gpu-memory.request"] == "1000Mi"
    assert doc["containers"]["main"]["compute"] == {"mode": "sm-sharing",
                                                    "active_thread_percentage": 100}


def test_reserve_1024_gives_488mi(capsys) -> None:
    code, doc, _ = plan_json(capsys, "valid-pod.yaml", "--node-gpu-memory", "2000",
                             "--devices", GPU_A, "--portion", "0.5", "--reserve", "1024",
                             *PATCHED)
    assert code == 0
    assert isinstance(doc, dict)
    assert doc["annotations"]["nvidia.com/container.main.gpu-memory.request"] == "488Mi"
    assert doc["containers"]["main"]["memory"]["limit_bytes"] == 488 * MIB


def test_a100_40gb(capsys) -> None:
    code, doc, _ = plan_json(capsys, "valid-pod.yaml", "--node-gpu-memory", "40960",
                             "--devices", GPU_A, "--portion", "0.5", "--reserve", "1024",
                             *PATCHED)
    assert code == 0
    assert isinstance(doc, dict)
    assert doc["annotations"]["nvidia.com/container.main.gpu-memory.request"] == "19968Mi"


def test_portion_defaults_to_the_pods_own_fraction(capsys) -> None:
    code, doc, _ = plan_json(capsys, "valid-pod.yaml", "--node-gpu-memory", "2000",
                             "--devices", GPU_A, *PATCHED)
    assert code == 0
    assert isinstance(doc, dict)
    assert doc["annotations"]["nvidia.com/container.main.gpu-memory.request"] == "1000Mi"
    assert doc["annotations"]["nvidia.com/container.main.gpu-compute.portion"] == "0.5"


def fraction_pod(tmp_path: Path, fraction: str, limit: str | None = None) -> str:
    extra = f"\n    gpu-fraction.limit: \"{limit}\"" if limit else ""
    path = tmp_path / "pod.yaml"
    path.write_text(f"""apiVersion: v1
kind: Pod
metadata:
  name: p
  annotations:
    gpu-fraction: "{fraction}"{extra}
spec:
  schedulerName: kai-scheduler
  containers:
  - name: main
    image: x
""")
    return str(path)


def test_a_gpu_fraction_is_planned_at_the_portion_kai_writes(capsys, tmp_path: Path) -> None:
    """KAI's scheduler puts the fraction in its BindRequest with two decimals (upstream
    pkg/scheduler/cache/cache.go, createBindRequest: `fmt.Sprintf("%.2f", ...)`) and the binder
    sizes the request from that portion (pkg/binder/plugins/nvfractions/nv_fractions.go,
    setNvFractionsMemoryAnnotation): 0.125 of 80 GiB is 9,830 MiB there, not 10,240."""
    code, out, err = cli(capsys, "plan", "-f", fraction_pod(tmp_path, "0.125"), "--output",
                         "json", "--node-gpu-memory", "81920", "--devices", GPU_A)
    assert code == 0, err
    assert json.loads(out)["annotations"][
        "nvidia.com/container.main.gpu-memory.request"] == "9830Mi"


def test_a_limit_the_rounding_puts_below_the_request_shows_in_the_plan(
        capsys, tmp_path: Path) -> None:
    """gpu-fraction 0.335 is bound at 0.34, above its own gpu-fraction.limit of 0.336: the
    binder's request exceeds the limit, and the plan says so as the cluster will."""
    code, out, err = cli(capsys, "plan", "-f", fraction_pod(tmp_path, "0.335", "0.336"),
                         "--node-gpu-memory", "81920", "--devices", GPU_A)
    assert code == 1 and out == ""
    assert "below the request" in err


def test_portion_limit_key_gives_780mi(capsys) -> None:
    code, doc, err = plan_json(capsys, "portion-limit.yaml", "--node-gpu-memory", "2000",
                               "--devices", GPU_A, "--reserve", "1024", *PATCHED)
    assert code == 0, err
    assert isinstance(doc, dict)
    assert doc["annotations"]["nvidia.com/container.main.gpu-memory.request"] == "488Mi"
    assert doc["annotations"]["nvidia.com/container.main.gpu-memory.limit"] == "780Mi"
    assert doc["containers"]["main"]["memory"] == {"request_bytes": 488 * MIB,
                                                   "limit_bytes": 780 * MIB}


def test_two_devices_and_cdi(capsys) -> None:
    code, doc, _ = plan_json(capsys, "two-devices.yaml", "--node-gpu-memory", "2000",
                             "--devices", f"{GPU_A},{GPU_B}", "--cdi")
    assert code == 0
    assert isinstance(doc, dict)
    cdi = "k8s.device-plugin.nvidia.com/gpu="
    assert doc["annotations"]["nvidia.com/container.main.gpus.devices"] == (
        f"{cdi}{GPU_A},{cdi}{GPU_B}")
    container = doc["containers"]["main"]
    assert container["env"]["NVIDIA_VISIBLE_DEVICES"] == f"{cdi}{GPU_A},{cdi}{GPU_B}"
    assert container["env"]["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=1000M,1=1000M"
    assert container["devices"] == [GPU_A, GPU_B]
    assert container["compute"] == {"mode": "time-slicing", "active_thread_percentage": None}
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in container["env"]
    assert "CUDA_MPS_PIPE_DIRECTORY" not in container["env"]


def test_compute_portion_is_never_an_exponent(capsys, tmp_path: Path) -> None:
    manifest = tmp_path / "tiny.yaml"
    manifest.write_text(
        "kind: Pod\nmetadata:\n  name: tiny\n  annotations:\n"
        "    nvidia.com/container.main.gpu-memory.request: 1Mi\n"
        "spec:\n  containers:\n  - name: main\n")
    code, out, _ = cli(capsys, "plan", "-f", str(manifest), "--node-gpu-memory", "20000",
                       "--devices", GPU_A, "-o", "json", *PATCHED)
    assert code == 0
    assert json.loads(out)["annotations"]["nvidia.com/container.main.gpu-compute.portion"] == (
        "0.00005")


def test_several_fractional_objects_give_a_json_list(capsys) -> None:
    code, doc, _ = plan_json(capsys, "workloads.yaml", "--node-gpu-memory", "40960",
                             "--devices", GPU_A, "--portion", "0.25")
    assert code == 0
    assert isinstance(doc, list)
    assert [d["object"] for d in doc] == ["Deployment/team/infer", "StatefulSet/default/db",
                                          "CronJob/team/nightly"]
    by_object = {d["object"]: d for d in doc}
    infer = by_object["Deployment/team/infer"]
    assert "nvidia.com/container.server.gpu-memory.request" not in infer["annotations"]
    assert infer["containers"]["server"]["memory"] == {"request_bytes": 8192 * MIB,
                                                       "limit_bytes": 10240 * MIB}
    db = by_object["StatefulSet/default/db"]
    # KAI writes canonical quantities: 4096 MiB is 4Gi.
    assert db["annotations"]["nvidia.com/container.db.gpu-memory.request"] == "4Gi"


def test_text_output(capsys) -> None:
    code, out, _ = cli(capsys, "plan", "-f", data("valid-pod.yaml"), "--node-gpu-memory",
                       "2000", "--devices", GPU_A, "--portion", "0.5", *PATCHED)
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "team/half:"
    assert "    nvidia.com/container.main.gpu-memory.request: 1000Mi" in lines
    assert "  container main (sm-sharing):" in lines
    assert "    memory: request 1000 MiB, limit 1000 MiB" in lines
    assert f"    env NVIDIA_VISIBLE_DEVICES={GPU_A}" in lines
    assert "    env CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50" in lines


def test_stdin(capsys, monkeypatch) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO(Path(data("valid-pod.yaml")).read_text()))
    code, out, _ = cli(capsys, "plan", "-f", "-", "--node-gpu-memory", "2000", "--devices",
                       GPU_A, "-o", "json")
    assert code == 0
    assert json.loads(out)["containers"]["main"]["memory"]["request_bytes"] == 1000 * MIB


def test_non_fractional_pods_are_skipped(capsys) -> None:
    code, out, _ = cli(capsys, "plan", "-f", data("plain-pod.yaml"), "--node-gpu-memory", "2000",
                       "--devices", GPU_A)
    assert code == 0
    assert out == ""


# -- exit 1: contract errors ------------------------------------------------------------------


def test_invalid_pod_exits_1(capsys) -> None:
    code, out, err = cli(capsys, "plan", "-f", data("invalid-job.yaml"), "--node-gpu-memory",
                         "2000", "--devices", GPU_A)
    assert code == 1
    assert out == ""
    assert err.splitlines() == [
        f"{data('invalid-job.yaml')}:1: Job/ml/train/trainer: gpu-fraction: must be a portion of "
        "one GPU, 0 < x < 1 (got '50')"]


@pytest.mark.parametrize(
    ("extra", "flag"),
    [
        (["--portion", "1.5"], "--portion"),
        (["--devices", f"{GPU_A},{GPU_B}"], "--devices"),
    ],
)
def test_bad_decision_exits_1_naming_the_flag(capsys, extra: list[str], flag: str) -> None:
    """The scheduler's decision comes from flags here: a decision that does not fit the pod
    (more than it asks for) names the flag and the pod's file:line, not the mirror's field
    names, and no container (the decision is the pod's). A flag value bad on its own is a
    usage error (test_first_contact_mistakes.py)."""
    argv = ["--node-gpu-memory", "2000", "--devices", GPU_A, *extra]
    code, out, err = cli(capsys, "plan", "-f", data("valid-pod.yaml"), *argv)
    assert code == 1
    assert out.strip() in ("", "[]")
    where = f"{data('valid-pod.yaml')}:2: team/half"
    assert any(line.startswith(f"{where}: {flag}: ") for line in err.splitlines()), err
    assert "reserved_gpu_ids" not in err and "/-:" not in err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--node-gpu-memory", "0"], "--node-gpu-memory: must be the GPU memory in MiB, greater "
                                     "than 0, got 0"),
        (["--node-gpu-memory", "2000", "--reserve", "1024"],
         "--reserve: is 1024 MiB, but upstream KAI main subtracts no reserve: use 0, or the "
         "patched dialect for a KAI that does"),
    ],
)
def test_bad_decision_flags_exit_2(capsys, extra: list[str], message: str) -> None:
    code, out, err = cli(capsys, "plan", "-f", data("valid-pod.yaml"), "--devices", GPU_A,
                         *extra)
    assert (code, out) == (2, "")
    assert err == f"kai-fractions plan: {message}\n"


def test_request_larger_than_the_gpu_exits_1(capsys) -> None:
    code, _, err = cli(capsys, "plan", "-f", data("workloads.yaml"), "--node-gpu-memory", "4096",
                       "--devices", GPU_A, "--portion", "0.5")
    assert code == 1
    assert (f"{data('workloads.yaml')}:1: Deployment/team/infer/server: "
            "nvidia.com/container.server.gpu-memory.request: asks for 8192 MiB but a GPU on "
            "this node shares only 4096 MiB") in err.splitlines()


# -- exit 2: usage and unreadable input -------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["plan", "-f", "x.yaml", "--devices", GPU_A],  # --node-gpu-memory required
        ["plan", "-f", "x.yaml", "--node-gpu-memory", "2000"],  # --devices required
        ["plan", "-f", "x.yaml", "--node-gpu-memory", "lots", "--devices", GPU_A],
        ["plan", "-f", "x.yaml", "--node-gpu-memory", "2000", "--devices", GPU_A, "--reserve",
         "x"],
        ["plan", "--node-gpu-memory", "2000", "--devices", GPU_A],  # -f required
    ],
)
def test_bad_flags_exit_2(capsys, argv: list[str]) -> None:
    code, out, err = cli(capsys, *argv)
    assert code == 2
    assert out == ""
    assert "error:" in err


@pytest.mark.parametrize("portion", ["half", "NaN", "Inf", ""])
def test_bad_portion_flag_exits_2(capsys, portion: str) -> None:
    code, _, err = cli(capsys, "plan", "-f", data("valid-pod.yaml"), "--node-gpu-memory", "2000",
                       "--devices", GPU_A, "--portion", portion)
    assert code == 2
    assert err.startswith("kai-fractions plan: --portion: ")


@pytest.mark.parametrize(
    ("name", "message"),
    [("bad-yaml.yaml", "6:1: not valid YAML: expected ',' or '}', but got '<scalar>' (while "
                       "parsing a flow mapping from line 5)"),
     ("not-mapping.yaml", "1: a document is not a Kubernetes object (a mapping)")],
)
def test_unreadable_input_exits_2(capsys, name: str, message: str) -> None:
    code, out, err = cli(capsys, "plan", "-f", data(name), "--node-gpu-memory", "2000",
                         "--devices", GPU_A)
    assert code == 2
    assert out == ""
    assert err == f"kai-fractions plan: {data(name)}:{message}\n"


def test_missing_file_exits_2(capsys, tmp_path: Path) -> None:
    missing = tmp_path / "gone.yaml"
    code, _, err = cli(capsys, "plan", "-f", str(missing), "--node-gpu-memory", "2000",
                       "--devices", GPU_A)
    assert code == 2
    assert err.strip() == f"kai-fractions plan: {missing}: no such file or directory"


def test_directory(capsys) -> None:
    # dir/a.yaml plans, dir/nested/b.yml breaks the contract: exit 1, the good one still printed.
    code, out, err = cli(capsys, "plan", "-f", data("dir"), "--node-gpu-memory", "2000",
                         "--devices", GPU_A, "-o", "json")
    assert code == 1
    assert json.loads(out)["object"] == "team/half"
    assert "Job/ml/train/trainer: gpu-fraction:" in err


def test_malformed_object_exits_2_without_traceback(capsys, tmp_path: Path) -> None:
    path = tmp_path / "m.yaml"
    path.write_text("kind: Pod\nmetadata: {name: p}\nspec: not-a-mapping\n")
    code, _, err = cli(capsys, "plan", "-f", str(path), "--node-gpu-memory", "2000",
                       "--devices", GPU_A)
    assert code == 2
    assert str(path) in err
