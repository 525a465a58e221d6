"""`kai-fractions demo --keep`: the endpoints it prints work; `inspect` against it shows the
plan; the first-call commands it prints work when pasted in another directory; SIGINT stops it
cleanly."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from kai_fractions.cli import main
from kai_fractions.demo.first_call import END

from .expected import MIB, NODE, expected_rows, gpu_uuid
from .test_demo_cli import CLI, group_members

START_TIMEOUT = 90
REPO = Path(__file__).resolve().parents[2]
ENDPOINTS = ("api", "kubeconfig", "mirror", "agent", "metrics", "mirror-metrics")


class Demo:
    def __init__(self) -> None:
        self.proc = subprocess.Popen([str(CLI), "demo", "--keep"], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.err: list[str] = []
        threading.Thread(target=self._read, args=(self.proc.stdout, self.lines.put),
                         daemon=True).start()
        threading.Thread(target=self._read, args=(self.proc.stderr, self.err.append),
                         daemon=True).start()

    @staticmethod
    def _read(stream, sink) -> None:
        for line in stream:
            sink(line.rstrip("\n"))
        sink(None)

    def endpoints(self) -> dict[str, str]:
        deadline = time.monotonic() + START_TIMEOUT
        found: dict[str, str] = {}
        keeping = False
        while set(found) != set(ENDPOINTS):
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError("the demo printed no endpoints:\n"
                                     + "\n".join(filter(None, self.err))) from None
            if line is None:
                raise AssertionError("the demo exited:\n" + "\n".join(filter(None, self.err)))
            if line == "The demo keeps running; Ctrl-C stops it.":
                keeping = True
            elif keeping:
                name, _, value = line.strip().partition(" ")
                if name in ENDPOINTS:
                    found[name] = value.strip()
        return found

    def until_end(self) -> list[str]:
        """The lines after the endpoints, up to the last one --keep prints."""
        lines: list[str] = []
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            if line is None:
                raise AssertionError("the demo exited:\n" + "\n".join(filter(None, self.err)))
            if line == END:
                return lines
            lines.append(line)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise


@pytest.fixture(scope="module")
def demo():
    d = Demo()
    try:
        d.endpoints_found = d.endpoints()
        d.keep_lines = d.until_end()
        d.first_call = first_call_blocks(d.keep_lines)
        yield d
    finally:
        d.stop()  # normally done by the last test already


def first_call_blocks(lines: list[str]) -> dict[str, str]:
    """The pasteable commands of the first-call section, by the first words of their comment."""
    text = "\n".join(lines).split("Paste these into another shell (any directory):\n", 1)[1]
    blocks = {}
    for block in text.strip().split("\n\n# "):
        title, _, command = block.removeprefix("# ").partition("\n")
        blocks[" ".join(title.split()[:2])] = command
    return blocks


def paste(command: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """As a user pastes it into a new shell: another directory, a bare PATH."""
    return subprocess.run(["/bin/bash", "-c", command], cwd=cwd, capture_output=True, text=True,
                          timeout=60, env={"PATH": "/usr/bin:/bin", "HOME": str(cwd)})


def _inspect(capsys, *args: str) -> tuple[int, str]:
    code = main(["inspect", *args])
    out, err = capsys.readouterr()
    assert err == ""
    return code, out


def test_endpoints(demo):
    e = demo.endpoints_found
    assert e["api"].startswith("http://127.0.0.1:")
    assert Path(e["kubeconfig"]).is_file() and Path(e["agent"]).is_socket()
    for metrics in (e["metrics"], e["mirror-metrics"]):
        assert metrics.startswith("http://127.0.0.1:") and metrics.endswith("/metrics")
    with urllib.request.urlopen(e["mirror-metrics"], timeout=10) as answer:
        # the demo's own calls, answered before it printed its endpoints
        assert 'kai_fractions_mirror_calls_total{code="OK",method="MirrorAllocation"}' \
            in answer.read().decode()
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(e["mirror"]) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="kai_fractions.v1.AllocationMirror"),
            timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_inspect_node_against_the_demo(demo, capsys):
    e = demo.endpoints_found
    code, out = _inspect(capsys, "node", NODE, "--kubeconfig", e["kubeconfig"],
                         "--agent-socket", e["agent"], "--output", "json")
    assert code == 0
    data = json.loads(out)
    assert data["node"] == NODE and data["gpu_memory_label"] == "81559"
    assert data["condition"]["status"] == "True" and data["notes"] == []
    assert data["agent"]["reachable"] is True
    expected = expected_rows()
    assert [(g["index"], g["uuid"]) for g in data["gpus"]] == [(0, gpu_uuid(0)),
                                                               (1, gpu_uuid(1))]
    for gpu in data["gpus"]:
        got = [(a["namespace"], a["pod"], a["container"], a["mode"], a["request_bytes"],
                a["limit_bytes"], a["active_thread_percentage"], a["used_bytes"], a["state"])
               for a in gpu["allocations"]]
        want = sorted(("default", x.pod, x.container, x.mode, x.request_mib * MIB,
                       x.limit_mib * MIB, x.atp, x.used_mib * MIB, "enforced")
                      for x in expected if x.gpus and gpu["index"] in x.gpus)
        assert got == want
    assert data["unplaced"] == []  # a pod that is on no node is not this node's


def test_inspect_the_unscheduled_pod(demo, capsys):
    e = demo.endpoints_found
    code, out = _inspect(capsys, "pod", "default/multi-device-fraction", "--kubeconfig",
                         e["kubeconfig"], "-o", "json")
    assert code == 0
    data = json.loads(out)
    [pending] = data["unplaced"]
    assert (data["gpus"], data["node"], data["agent"]) == ([], "", None)
    assert (pending["pod"], pending["state"], pending["reason"], pending["portion"],
            pending["device_count"]) == ("multi-device-fraction", "unscheduled",
                                         "Unschedulable", "0.5", 2)


def test_inspect_pod_with_metrics_only(demo, capsys):
    e = demo.endpoints_found
    code, out = _inspect(capsys, "pod", "default/sm-sharing", "--kubeconfig", e["kubeconfig"],
                         "--agent-metrics", e["metrics"], "-o", "json")
    assert code == 0
    data = json.loads(out)
    [gpu] = data["gpus"]
    [row] = gpu["allocations"]
    [want] = [x for x in expected_rows() if x.pod == "sm-sharing"]
    assert (gpu["uuid"], row["active_thread_percentage"], row["used_bytes"], row["state"],
            row["reason"]) == (gpu_uuid(1), want.atp, want.used_mib * MIB, "enforced",
                               "")


def test_inspect_mirror_against_the_demo(demo, capsys):
    code, out = _inspect(capsys, "mirror", demo.endpoints_found["mirror-metrics"], "-o", "json",
                         "--window", "0")  # one reading: no wait
    assert code == 0
    data = json.loads(out)
    [mirror] = data["replicas"]
    assert data["problems"] == [] and mirror["reachable"]
    assert mirror["calls"]["OK"] >= 1  # the demo's own calls
    assert mirror["rss_bytes"] > 0


def test_the_first_call_works_when_pasted_elsewhere(demo, tmp_path):
    blocks = demo.first_call
    assert list(blocks) == ["PreviewAllocation from", "MirrorAllocation from",
                            "MirrorAllocation with", "the pod"]
    grpcurl = REPO / ".tools" / "bin" / "grpcurl"
    request_key = "nvidia.com/container.main.gpu-memory.request"
    preview = paste(blocks["PreviewAllocation from"], tmp_path)
    assert preview.returncode == 0, preview.stderr
    assert preview.stdout.startswith("PreviewAllocation: OK, it would write:\n")
    assert f"\n  {request_key}: 8155Mi\n" in preview.stdout  # floor(81559 x 0.1)

    python = blocks["MirrorAllocation from"]
    result = paste(python, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("MirrorAllocation: OK, changed: True, resource_version: ")
    assert f"\n  {request_key}: 8155Mi\n" in result.stdout

    if grpcurl.exists():  # scripts/test-tools.sh fetches it (CI always has it)
        again = paste(blocks["MirrorAllocation with"], tmp_path)
        assert again.returncode == 0, again.stderr
        reply = json.loads(again.stdout)
        assert (reply["changed"], reply["annotations"][request_key]) == (False, "8155Mi")

    shown = paste(blocks["the pod"], tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert "\n  default/first-call/main  time-slicing  8155 MiB  8155 MiB  " in shown.stdout
    assert "unscheduled (NotBound)" in shown.stdout

    # A failed call is said, and the exit status says it too.
    uid = re.search(r'uid="([0-9a-f-]{36})"', python).group(1)
    wrong = paste(python.replace(uid, "00000000-0000-4000-8000-000000000000"), tmp_path)
    assert wrong.returncode == 1
    assert wrong.stderr.startswith("MirrorAllocation failed: ")


def _normalized(text: str) -> str:
    """Without what changes from run to run or machine to machine: the checkout and venv
    paths, the temp directory, ports, the pod's uid (and the group id made from it)."""
    text = text.replace(str(Path(sys.executable).parent), "/path/to/kai_fractions/.venv/bin")
    text = text.replace(str(REPO), "/path/to/kai_fractions")
    text = re.sub(r"\S*grpcurl ", "grpcurl ", text)  # .tools/bin's, or the bare name without
    text = re.sub(r"/tmp/kf-demo-\w+", "/tmp/kf-demo-X", text)
    text = re.sub(r"127\.0\.0\.1:\d+", "127.0.0.1:PORT", text)
    return re.sub(r"(?<![-\w])[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
                  "UUID", text)


def test_docs_mirror_shows_the_printed_commands(demo):
    doc = (REPO / "docs" / "mirror.md").read_text()
    block = doc.split("<!-- demo-first-call:begin", 1)[1].split("```bash\n", 1)[1]
    block = block.split("\n```", 1)[0]
    printed = "\n".join(demo.keep_lines).split("(any directory):\n\n", 1)[1].strip()
    assert _normalized(block) == _normalized(printed)


def test_sigint_stops_it_cleanly(demo):
    assert demo.stop() == 0
    assert group_members(demo.proc.pid) == []
    deadline = time.monotonic() + 10
    while demo.err[-1:] != [None] and time.monotonic() < deadline:
        time.sleep(0.05)
    lines = [line for line in demo.err if line is not None]
    assert lines[-1].endswith("] stopped")
