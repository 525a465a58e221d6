"""`kai-fractions gate` as the kubelet runs it: a real process, files, exit code, message."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kai_fractions.marker import read_boot_id, write_marker

from .pods import UID, bound_annotations, downward_file, plan_of
from .test_gate import applied

CLI = Path(sys.executable).parent / "kai-fractions"


def pod_files(tmp_path: Path, with_marker: bool) -> list[str]:
    if with_marker:  # the process reads this host's boot ID: the marker is of this boot
        write_marker(tmp_path / "markers", applied(boot_id=read_boot_id()))
    (tmp_path / "annotations").write_text(downward_file(bound_annotations()))
    return ["--marker-dir", str(tmp_path / "markers" / UID),
            "--annotations-file", str(tmp_path / "annotations"),
            "--termination-log", str(tmp_path / "termination-log"),
            "--containers", "main,metrics", "--init-containers", "fetch-model"]


def gate(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(CLI), "gate", *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "POD_UID": UID, **(env or {})})


def test_the_gate_process_releases_a_pod_whose_limits_are_applied(tmp_path: Path) -> None:
    result = gate(pod_files(tmp_path, with_marker=True))
    line = f"limits applied: main {plan_of(bound_annotations()).digest}\n"
    assert (result.returncode, result.stdout, result.stderr) == (0, line, "")
    assert (tmp_path / "termination-log").read_text() == line


def test_the_gate_process_times_out_with_the_reason_in_the_termination_log(
        tmp_path: Path) -> None:
    args = [*pod_files(tmp_path, with_marker=False),
            "--timeout", "0.05", "--poll-interval", "0.01"]
    result = gate(args)
    line = ("timed out after 0.05s waiting for the node agent to apply this pod's GPU limits: "
            "the node agent has not written this pod's readiness marker yet; it writes none "
            "while it holds the pod pending (the pod's node not ready for it, its limits not in "
            "force yet) or does not run (the node agent's reason: `kai-fractions inspect pod "
            "NS/NAME`, and the condition gpu-fractioning.nvidia.com/Ready of the pod's node "
            "(`kubectl describe node`), which is missing or Unknown where no node agent runs) "
            f"(marker: {tmp_path}/markers/{UID}/marker.json)\n")
    assert result.returncode == 1
    assert (tmp_path / "termination-log").read_text() == line
    assert result.stderr.endswith(line)


def test_usage_errors_exit_2(tmp_path: Path) -> None:
    result = gate(pod_files(tmp_path, with_marker=True), env={"POD_UID": ""})
    assert (result.returncode, result.stderr) == (2, (
        "kai-fractions gate: no pod UID: set env POD_UID (fieldRef metadata.uid) or pass "
        "--pod-uid\n"))
    result = gate(["--poll-interval", "0"])
    assert result.returncode == 2
    assert "argument --poll-interval: must be more than 0, got '0'" in result.stderr


def test_the_gate_imports_no_grpc_and_no_kubernetes_client(tmp_path: Path) -> None:
    """The gate starts in every fractional pod: it must not pay for the other commands'
    dependencies. Every CLI command module is imported to build the parser, so this also
    holds the other commands to importing their heavy dependencies lazily."""
    args = pod_files(tmp_path, with_marker=True)
    code = ("import sys\n"
            "from kai_fractions.cli import main\n"
            f"rc = main(['gate', *{args!r}])\n"
            "heavy = sorted({m.split('.')[0] for m in sys.modules} & "
            "{'grpc', 'kubernetes', 'google', 'pynvml', 'prometheus_client'})\n"
            "print(rc, heavy)\n")
    result = subprocess.run([sys.executable, "-X", "importtime", "-c", code],
                            capture_output=True, text=True, timeout=60,
                            env={**os.environ, "POD_UID": UID})
    assert result.stdout.splitlines()[-1] == "0 []", result.stdout
    # -X importtime reports every module imported; none of the heavy ones may appear.
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines()
                if line.startswith("import time:")}
    assert not {m for m in imported if m.split(".")[0] in ("grpc", "kubernetes")}


def test_the_gate_process_names_a_marker_the_agent_set_aside(tmp_path: Path) -> None:
    """The node agent moved this pod's marker aside in this boot (an MPS cap not in force): the
    gate waits, and its message says why rather than asking whether the agent runs."""
    args = [*pod_files(tmp_path, with_marker=True), "--timeout", "0.05", "--poll-interval", "0.01"]
    pod_dir = tmp_path / "markers" / UID
    (pod_dir / "marker.json").rename(pod_dir / "set-aside.json")
    result = gate(args)
    line = ("timed out after 0.05s waiting for the node agent to apply this pod's GPU limits: "
            "the node agent set this pod's readiness marker aside: a limit it had vouched for is "
            "not in force now (such as an MPS cap after an MPS daemon restart); it writes the "
            "marker again once the limit is back (the reason: `kai-fractions inspect pod "
            f"NS/NAME` or the pod's events) (marker: {pod_dir}/marker.json, set aside as "
            f"{pod_dir}/set-aside.json)\n")
    assert result.returncode == 1
    assert (tmp_path / "termination-log").read_text() == line
    assert result.stderr.endswith(line)
    assert "is the kai-fractions node agent running" not in result.stderr
