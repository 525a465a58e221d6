"""The REAL node agent (`kai-fractions node-agent`) as a subprocess, wired to test doubles: the
kmock API (kubeconfig), the fake libnvidia-ml.so.1 (`--nvml-library` + its config env), a temp
cgroup tree, a fake /proc, and the real `nvidia-cuda-mps-control` on short temp pipe/log dirs.

Fixture: ``agent_env`` (needs ``kube``). ``agent_env.start(...)`` launches an agent and returns an
``AgentRun``; everything is stopped and removed at teardown (agents killed, an MPS daemon left by
a killed agent quit). A failed test that uses it gets an "agent diagnostics" report section
(``AgentEnv.diagnostics``): the agent processes run outside pytest's capture, so without it a
rare failure in CI would leave nothing to read.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Generator, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kai_fractions.marker import GONE_PREFIX
from tests.support import tools
from tests.support.fake_nvml import FakeNvml
from tests.support.kube import KubeServer
from tests.support.mps import mps_command

CLI = Path(sys.executable).parent / "kai-fractions"
NODE = "gpu-node-1"
GPU0 = "GPU-00000000-0000-0000-0000-0000000000a0"
H100_MIB = 81559


def read_markers(marker_dir: Path) -> dict[str, dict[str, Any]]:
    """Each pod's marker under `marker_dir`, by uid, as a gate would find it. A directory the
    agent is removing is renamed `GONE_PREFIX...` first and is no gate's, so it is skipped; a
    marker gone or replaced between the glob and the read is read again at the next look."""
    out = {}
    for path in sorted(marker_dir.glob("*/marker.json")):
        if path.parent.name.startswith(GONE_PREFIX):
            continue
        try:
            out[path.parent.name] = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
    return out


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(predicate: Callable[[], Any], timeout: float = 10.0, interval: float = 0.05,
             what: str = "condition", run: AgentRun | None = None) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if run is not None and run.proc.poll() is not None:
            raise AssertionError(f"the agent exited ({run.proc.returncode}) while waiting for "
                                 f"{what}:\n{run.log()}")
        if time.monotonic() >= deadline:
            tail = f"\nagent log:\n{run.log()}" if run is not None else ""
            raise AssertionError(f"timed out after {timeout}s waiting for {what}{tail}")
        time.sleep(interval)


@dataclass
class AgentRun:
    proc: subprocess.Popen[bytes]
    argv: list[str]
    log_path: Path
    metrics_port: int
    socket: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 80) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
            raise AssertionError(
                f"the agent ignored signal {sig} for {timeout}s:\n{self.log()}") from None

    def metrics(self) -> str:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.read().decode()


@dataclass
class AgentEnv:
    kube: KubeServer
    tmp: Path
    node: str = NODE
    runs: list[AgentRun] = field(default_factory=list)
    notes: list[Callable[[], str]] = field(default_factory=list)
    """What a test compares, described for its failure report (see `diagnostics`)."""

    def __post_init__(self) -> None:
        self.cgroup_root = self.tmp / "cgroup"
        self.proc_root = self.tmp / "proc"
        self.marker_dir = self.tmp / "markers"
        for d in (self.cgroup_root, self.proc_root):
            d.mkdir(parents=True, exist_ok=True)
        # what makes a directory a cgroup v2 root to the agent (it refuses to start on another)
        (self.cgroup_root / "cgroup.controllers").write_text("cpu memory pids\n")
        # unix sockets (MPS pipes, the agent's socket) need short paths: not pytest's tmp_path
        self.short = Path(tempfile.mkdtemp(prefix="kfa-", dir="/tmp"))
        self.mps_pipe_dir = self.short / "mps"
        self.mps_log_dir = self.short / "mpslog"
        self.socket = self.short / "agent.sock"
        self.nvml = FakeNvml(self.tmp / "nvml")
        self.kubeconfig = self.kube.write_kubeconfig(self.tmp / "kubeconfig")

    # -- cluster ------------------------------------------------------------------------------

    def create_node(self, labels: Mapping[str, str] | None = None) -> dict[str, Any]:
        body = {"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": self.node, "labels": dict(labels or {})},
                "status": {"conditions": []}}
        return self.kube.core.create_node(body).to_dict()

    def node_object(self) -> dict[str, Any]:
        obj = self.kube.get_object("v1/nodes", None, self.node)
        assert obj is not None
        return obj

    def condition(self, kind: str = "gpu-fractioning.nvidia.com/Ready") -> dict[str, Any] | None:
        for c in (self.node_object().get("status") or {}).get("conditions") or []:
            if c.get("type") == kind:
                return c
        return None

    def events(self, uid: str | None = None) -> list[dict[str, Any]]:
        return [e.to_dict() for e in self.kube.core.list_event_for_all_namespaces().items
                if uid is None or e.involved_object.uid == uid]

    # -- node side ----------------------------------------------------------------------------

    def pod_slice(self, uid: str) -> Path:
        u = uid.replace("-", "_")
        return (self.cgroup_root / "kubepods.slice" / "kubepods-burstable.slice"
                / f"kubepods-burstable-pod{u}.slice")

    def make_cgroups(self, uid: str, container_hex: str) -> tuple[Path, Path]:
        slice_ = self.pod_slice(uid)
        leaf = slice_ / f"cri-containerd-{container_hex}.scope"
        leaf.mkdir(parents=True, exist_ok=True)
        return slice_, leaf

    def proc_entry(self, pid: int, cgroup: str) -> None:
        d = self.proc_root / str(pid)
        d.mkdir(parents=True, exist_ok=True)
        (d / "cgroup").write_text(f"0::{cgroup}\n")
        (d / "stat").write_text(f"{pid} (python3) S 1 1 1 0 -1\n")

    def marker(self, uid: str) -> Path:
        return self.marker_dir / uid / "marker.json"

    @property
    def mps_daemon_dir(self) -> Path:
        """Where the agent's MPS daemon listens: the pipe root for a v3 binary, the legacy
        directory under shared/ for one without namespaces (the test tools' own)."""
        from kai_fractions.node.mps.daemon import legacy_pipe_dir

        legacy = Path(legacy_pipe_dir(str(self.mps_pipe_dir), "shared"))
        return legacy if (legacy / "control").exists() else self.mps_pipe_dir

    def mps(self, line: str) -> subprocess.CompletedProcess[str]:
        return mps_command(tools.mps_control(), self.mps_daemon_dir, line,
                           log_dir=self.mps_log_dir, timeout=5)

    # -- the agent ----------------------------------------------------------------------------

    def argv(self, *extra: str, sm_sharing: bool = True, metrics_port: int) -> list[str]:
        return [
            str(CLI), "node-agent",
            f"--node-name={self.node}",
            f"--kubeconfig={self.kubeconfig}",
            f"--nvml-library={tools.fake_nvml_library('full')}",
            f"--cgroup-root={self.cgroup_root}",
            f"--proc-root={self.proc_root}",
            f"--marker-dir={self.marker_dir}",
            f"--socket={self.socket}",
            f"--metrics-listen=127.0.0.1:{metrics_port}",
            "--sm-sharing" if sm_sharing else "--no-sm-sharing",
            f"--mps-control-binary={tools.mps_control()}",
            f"--mps-pipe-dir={self.mps_pipe_dir}",
            f"--mps-log-dir={self.mps_log_dir}",
            "--watchdog-interval=0.2",
            "--first-list-jitter=0",  # one agent: nothing to spread
            "--log-level=debug",
            *extra,
        ]

    def start(self, *extra: str, sm_sharing: bool = True,
              env: Mapping[str, str] | None = None) -> AgentRun:
        port = free_port()
        argv = self.argv(*extra, sm_sharing=sm_sharing, metrics_port=port)
        log_path = self.tmp / f"agent-{len(self.runs)}.log"
        full_env = self.nvml.env()
        full_env.update(env or {})
        with log_path.open("wb") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=full_env,
                                    stdin=subprocess.DEVNULL)
        run = AgentRun(proc, argv, log_path, port, self.socket)
        self.runs.append(run)
        return run

    def diagnostics(self, lines: int = 80) -> str:
        """The tails of the last two agents' logs (a killed agent's last words explain what its
        successor found), the MPS control daemon's log, the marker directories and NVML limits
        as they are now, and each test note. Every part is read defensively: this runs when a
        test has already failed."""
        parts = []
        for i, run in list(enumerate(self.runs))[-2:]:
            rc = run.proc.poll()
            state = "running" if rc is None else f"exited {rc}"
            parts.append(f"--- agent run {i} (pid {run.proc.pid}, {state}; {run.log_path}), "
                         f"last {lines} lines:\n{run.log_tail(lines)}")
        control_log = self.mps_log_dir / "control.log"
        if control_log.exists():
            tail = control_log.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- MPS {control_log}, last {lines} lines:\n" + "\n".join(tail))
        dirs = []
        for d in sorted(self.marker_dir.iterdir()) if self.marker_dir.is_dir() else []:
            try:
                dirs.append(f"{d.name}: {sorted(e.name for e in d.iterdir())}")
            except OSError as e:
                dirs.append(f"{d.name}: {e}")
        parts.append("--- marker directories:\n" + ("\n".join(dirs) or "(none)"))
        try:
            limits = "\n".join(f"{path}: {v.soft}/{v.hard}"
                               for (_gpu, path), v in sorted(self.nvml.limits().items()))
        except (OSError, ValueError) as e:
            limits = f"unreadable: {e}"
        parts.append("--- NVML limits (soft/hard):\n" + (limits or "(none)"))
        for note in self.notes:
            try:
                parts.append(f"--- {note()}")
            except Exception as e:  # a broken note must not hide the rest of the report
                parts.append(f"--- note {note!r} failed: {e!r}")
        return "\n".join(parts)

    def cleanup(self) -> None:
        for run in self.runs:
            if run.proc.poll() is None:
                run.proc.kill()
                run.proc.wait(5)
        if (self.mps_daemon_dir / "control").exists():
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                self.mps("quit")
        shutil.rmtree(self.short, ignore_errors=True)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]
                              ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed test that used `agent_env` gets `AgentEnv.diagnostics` as a report section,
    taken before teardown kills the agents."""
    report: pytest.TestReport = yield
    env = getattr(item, "funcargs", {}).get("agent_env")
    if report.when == "call" and report.failed and isinstance(env, AgentEnv):
        try:
            text = env.diagnostics()
        except Exception as e:  # the report of the real failure must survive
            text = f"diagnostics failed: {e!r}"
        report.sections.append(("agent diagnostics", text))
    return report


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A temp directory with a short path (MPS pipe directories and unix sockets must fit in
    107 bytes; pytest's tmp_path is too long), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="kfa-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def agent_env(kube: KubeServer, tmp_path: Path) -> Iterator[AgentEnv]:
    tools.fake_nvml_library("full")  # fail early (an error, not a skip) when tools are missing
    tools.mps_control()
    env = AgentEnv(kube, tmp_path)
    try:
        yield env
    finally:
        env.cleanup()


__all__ = [
    "GPU0",
    "H100_MIB",
    "NODE",
    "AgentEnv",
    "AgentRun",
    "agent_env",
    "free_port",
    "short_tmp",
    "wait_for",
]
