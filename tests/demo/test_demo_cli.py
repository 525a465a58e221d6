"""`kai-fractions demo` as a user runs it: a subprocess, its table checked row by row against
the plan computed from examples/ with the contract package, and nothing left behind."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from .expected import PLACEMENT, RESERVE_MIB, expected_rows, gpu_uuid, parse_tables, row_cells

CLI = Path(sys.executable).parent / "kai-fractions"
TIMEOUT = 120


def group_members(pgid: int) -> list[int]:
    """Live processes of a process group (the demo's session), from /proc."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry.name))
    return members


GRPC_CORE_LOG = re.compile(r"[IWE]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+\.cc:\d+\] ")
"""A line gRPC's C core writes itself (absl's format). At the demo's stop, with the machine
loaded, its client transport once logged "Got goaway [2] ... Cancelling all calls" as the
mirror's server shut down: gRPC's own shutdown message (grpc/grpc#27112 lowered its level once;
ray-project/ray#51673 met it at shutdown too), not the demo's output; everything else on stderr
must be the demo's."""


def run_demo(*args: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.Popen([str(CLI), "demo", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"the demo did not finish in {TIMEOUT}s:\n{err}") from None
    assert group_members(proc.pid) == [], "the demo left processes behind"
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_demo_prints_the_plan_and_exits_clean():
    result = run_demo()
    assert result.returncode == 0, result.stderr
    out, err = result.stdout, result.stderr
    expected = expected_rows()

    assert out.startswith("kai-fractions demo: 7 fractional containers from examples/ on node "
                          "demo-node (2 x NVIDIA H100 80GB HBM3, simulated)\n")
    assert "\nnode demo-node  nvidia.com/gpu.memory=81559  gpu-fractioning.nvidia.com/Ready=True"\
        in out

    gpus, unplaced, reasons = parse_tables(out)
    assert sorted(gpus) == [0, 1]
    for index, (uuid, mode, rows) in gpus.items():
        assert uuid == gpu_uuid(index)
        want = sorted(row_cells(e) for e in expected if e.gpus and index in e.gpus)
        assert rows == want, f"GPU {index}"
        assert mode == {0: "time-slicing", 1: "sm-sharing"}[index]

    [pending] = [e for e in expected if e.gpus is None]
    assert unplaced == [[pending.ref, "time-slicing", "0.5 GPU x2", "-", "-", "n/a",
                         "unscheduled (Unschedulable)", "-"]]
    # GPU 0's free memory when the two-GPU pod came (file order), from the expected plan.
    order = list(PLACEMENT)
    before = [e for e in expected if e.gpus == (0,)
              and order.index(e.pod) < order.index(pending.pod)]
    free0 = 81559 - RESERVE_MIB - sum(e.request_mib for e in before)
    need = (81559 - RESERVE_MIB) // 2
    # What keeps it off each GPU: GPU 0's free memory (its mode would do), GPU 1 fits.
    assert reasons == [
        f"{pending.ref}: Unschedulable: default/multi-device-fraction needs 2 GPU(s) with "
        f"{need} MiB free that run time-slicing or nothing yet; 1 of 2 fit (GPU 0: only "
        f"{free0} MiB free; GPU 1: fits ({81559 - RESERVE_MIB} MiB free))"]

    # Over the cap: the first container of GPU 0's table asks for 1024 MiB above its cap, and
    # the driver's cgroup hard limit (r615) refuses it.
    victim = min((e for e in expected if e.gpus == (0,)), key=lambda e: e.ref)
    section = out.split("\nCap held:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    extra = victim.limit_mib - victim.used_mib + 1024
    assert re.fullmatch(rf"  {victim.ref} on GPU 0 \(tier cgroup\): its process \(pid \d+\) "
                        rf"asks for {extra} MiB more, which would take it to "
                        rf"{victim.limit_mib + 1024} MiB, over its cap of {victim.limit_mib} MiB",
                        section[0]), section[0]
    assert re.fullmatch(
        rf"  cgroup -> the allocation fails \(out of memory\): the NVML cgroup hard limit of "
        rf"{victim.limit_mib} MiB on /sys/fs/cgroup/kubepods.slice/\S+ holds it "
        r"\(simulated NVML, as an r615 driver refuses it\)",
        section[1]), section[1]
    assert "Violation caught" not in out

    assert out.endswith(
        "\nRejected by admission:\n"
        "  pod default/pick-my-own-gpu (created by kubernetes-admin, sets the binder's key "
        "itself): 403 Forbidden: nvidia.com/container.app.gpus.devices: is a protected key: "
        "only system:serviceaccount:kai-scheduler:binder, "
        "system:serviceaccount:kai-fractions:kai-fractions-mirror may create it, not "
        "kubernetes-admin\n")

    progress = [line for line in err.splitlines() if not GRPC_CORE_LOG.match(line)]
    assert all(line.startswith("[demo ") for line in progress), err
    for e in expected:
        if e.gpus is not None:
            where = ", ".join(f"GPU {i}" for i in e.gpus)
            assert any(f"] scheduled default/{e.pod} on {where} ({e.request_mib} MiB, {e.mode})"
                       in line for line in progress), e.pod
            assert any(line.endswith(f"] gate default/{e.pod}: released, containers running")
                       for line in progress), e.pod
    assert progress[-1].endswith("] stopped")


def test_without_the_demo_extra_one_line_and_exit_2():
    code = ("import sys; sys.modules['kmock'] = None\n"
            "from kai_fractions.cli import main\n"
            "sys.exit(main(['demo']))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == ("kai-fractions demo: needs the demo extra (kmock is not "
                             "installed): pip install 'kai-fractions[demo]'\n")


def test_a_bad_config_is_a_usage_error(tmp_path: Path):
    config = tmp_path / "demo.yaml"
    config.write_text("gpus: [{model: B300, count: 2}]\n")
    result = subprocess.run([str(CLI), "demo", "--config", str(config)], capture_output=True,
                            text=True, timeout=60)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr.startswith(f"kai-fractions demo: --config {config}: gpus: "
                                    "gpus[0].model: unknown GPU model 'B300'; known: ")
    assert result.stderr.count("\n") == 1


def _kf_demo_dirs(where: Path) -> set[Path]:
    return set(where.glob("kf-demo-*"))


def test_a_long_tmpdir_still_runs_and_leaves_nothing(tmp_path: Path):
    """TMPDIR too long for the unix sockets below it: the demo puts its directory under /tmp
    instead, says nothing about flags its user does not have, and removes it at the end."""
    long = tmp_path / ("a-rather-long-temporary-directory-" * 2)
    long.mkdir()
    env = {**os.environ, "TMPDIR": str(long)}
    proc = subprocess.run([str(CLI), "demo"], capture_output=True, text=True, timeout=TIMEOUT,
                          env=env)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "--mps-pipe-dir" not in proc.stderr
    used = re.search(r"agent: socket unix://(/tmp/kf-demo-\w+)/agent\.sock ", proc.stdout)
    assert used, proc.stdout
    assert not Path(used.group(1)).exists()
    assert list(long.iterdir()) == []


def test_sigterm_ends_a_run_through_its_cleanup():
    short = Path(tempfile.mkdtemp(prefix="kft-", dir="/tmp"))  # short enough to be used
    try:
        proc = subprocess.Popen([str(CLI), "demo"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True,
                                env={**os.environ, "TMPDIR": str(short)})
        try:
            lines = []
            for line in proc.stderr:  # until the agent is up: everything is started
                lines.append(line)
                if "] node agent on " in line:
                    break
            assert _kf_demo_dirs(short), "".join(lines)
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=60)
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
        assert proc.returncode == 143, err
        progress = (("".join(lines)) + err).splitlines()
        assert "kai-fractions demo: terminated (SIGTERM) before the end" in progress
        assert progress[-1].endswith("] stopped")
        assert list(short.iterdir()) == []
        assert group_members(proc.pid) == []
    finally:
        shutil.rmtree(short, ignore_errors=True)


def test_a_bad_example_is_a_usage_error_before_anything_starts(tmp_path: Path):
    (tmp_path / "ex").mkdir()
    (tmp_path / "ex" / "pod.yaml").write_text(
        "kind: Pod\nmetadata:\n  generateName: trainer-\nspec: {containers: [{name: c}]}\n")
    config = tmp_path / "demo.yaml"
    config.write_text("examples: ex\n")
    result = subprocess.run([str(CLI), "demo", "--config", str(config)], capture_output=True,
                            text=True, timeout=60)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (
        f"kai-fractions demo: {tmp_path / 'ex' / 'pod.yaml'}: Pod: metadata.name: must be a "
        "non-empty string, got None (generateName 'trainer-' is not enough: the demo creates "
        "each pod by name)\n")  # one line: no progress, nothing was started


def test_a_progress_line_is_one_write():
    """SIGTERM's handler raises between bytecodes: a line written in two parts (print's text,
    then its newline) was cut by it, and the run's last message glued to it."""
    from kai_fractions.cli.demo import progress_writer

    class Stream:
        def __init__(self) -> None:
            self.writes: list[str] = []

        def write(self, text: str) -> int:
            self.writes.append(text)
            return len(text)

        def flush(self) -> None:
            pass

    stream = Stream()
    progress_writer(0.0, stream)("stopping")
    assert len(stream.writes) == 1 and stream.writes[0].endswith("] stopping\n")
