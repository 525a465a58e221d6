"""Everything the demo runs, started and stopped in one place.

In this process, each on its own thread(s), talking over real sockets:
- the Kubernetes API: kmock on 127.0.0.1 (`apiserver.EmbeddedApiServer`), with the Node
  object of the simulated node (its `nvidia.com/gpu.memory` label from the simulated GPUs);
- the mirror: the real AllocationMirror gRPC server on 127.0.0.1, over the API with the real
  Kubernetes client (`KubePodStore`);
- the node agent: the real `NodeAgent` (pod watch, reconcile worker, node condition, NodeEnforcer
  on a unix socket, Prometheus metrics on 127.0.0.1) on a simulated node: NVML is `FakeNvml`
  (the GPUs of the config), the MPS control daemon `FakeMpsControl`, the cgroup tree
  `FakeCgroupFs(assume_present=True)` (no kubelet creates cgroups here; FakeNvml takes limits
  only on paths of that tree, under the agent's cgroup root), /proc a temp directory, and the
  watchdog's process killer `RecordingKiller` (`killer`): the demo's GPU processes exist only in
  the simulated NVML and that /proc, so a stop by a `kill` watchdog is recorded, no signal sent.

Everything lives in one temp directory, `kf-demo-*` under TMPDIR, or under /tmp when TMPDIR is
too long for the unix socket paths below it (the agent's socket, the MPS pipe directory).
`stop()` undoes `start()` in reverse order and is safe to call after a partial start; it leaves
no thread but daemon threads of libraries that end with the process, and no file outside the
session's temp directory. A constructor that fails removes the directory it made.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..contract import MIB, Keys
from ..contract import keys as k
from ..node.config import NodeConfig
from ..node.errors import ConfigError
from ..sim.cgroups import FakeCgroupFs
from ..sim.mps import FakeMpsControl
from ..sim.nvml import FakeGpu, FakeNvml
from .config import DemoConfig

log = logging.getLogger(__name__)

WATCHDOG_INTERVAL = 0.2
"""The agent's --watchdog-interval here: a violation shows up within a fraction of a second."""
SOCKET_PATH_MAX = 107
"""Bytes of a unix socket's path (sun_path, with its terminating NUL: 108)."""
SHORT_TMP = "/tmp"
"""Where the session's directory goes when TMPDIR is too long for its socket paths."""


def gpu_summary(gpus: Sequence[FakeGpu]) -> str:
    """`2 x NVIDIA H100 80GB HBM3`, or per model in order of first appearance on a mixed node:
    `1 x NVIDIA H100 80GB HBM3, 1 x Tesla T4`."""
    return ", ".join(f"{n} x {name}" for name, n in Counter(g.name for g in gpus).items())


def _node_config(config: DemoConfig, workdir: Path, keys: Keys) -> NodeConfig:
    return NodeConfig(
        node_name=config.node, proc_root=str(workdir / "proc"),
        sm_sharing=config.sm_sharing, mps_pipe_dir=str(workdir / "mps"),
        mps_log_dir=str(workdir / "mps-log"), memory_enforcement=config.memory_enforcement,
        watchdog_policy=config.watchdog_policy, watchdog_interval=WATCHDOG_INTERVAL, keys=keys)


def _fits(workdir: Path, config: DemoConfig, keys: Keys) -> bool:
    """Whether the session's unix sockets fit below `workdir`: the agent's, and those of the
    MPS pipe directories (the node agent's own rule)."""
    if len(str(workdir / "agent.sock").encode()) > SOCKET_PATH_MAX:
        return False
    try:
        _node_config(config, workdir, keys)
    except ConfigError:
        return False
    return True


def make_workdir(config: DemoConfig, keys: Keys = k.DEFAULT_KEYS) -> Path:
    """A new `kf-demo-*` directory under TMPDIR, or under /tmp when the socket paths below it
    would not fit (a TMPDIR longer than about 30 bytes)."""
    prefix = "kf-demo-"
    longest = prefix + "x" * 8  # mkdtemp's 8 random characters
    base = tempfile.gettempdir()
    if not _fits(Path(base) / longest, config, keys):
        base = SHORT_TMP
    return Path(tempfile.mkdtemp(prefix=prefix, dir=base))


@dataclass(frozen=True, slots=True)
class Endpoints:
    api_url: str
    kubeconfig: Path
    mirror: str
    agent_socket: Path
    metrics_url: str
    mirror_metrics_url: str


class DemoSession:
    def __init__(self, config: DemoConfig, *, keys: Keys = k.DEFAULT_KEYS,
                 progress: Callable[[str], None] = lambda line: None,
                 workdir: Path | None = None):
        self.config = config
        self.keys = keys
        self.progress = progress
        self._own_workdir = workdir is None
        self.workdir = workdir or make_workdir(config, keys)
        try:
            self._build()
        except BaseException:
            if self._own_workdir:  # nothing else is made yet
                shutil.rmtree(self.workdir, ignore_errors=True)
            raise

    def _build(self) -> None:
        config = self.config
        self.nvml: FakeNvml = config.nvml()
        # MPS v3 namespaces came with the same r615 release as the memory limits: an older
        # simulated driver has neither, as a real one would.
        self.mps = FakeMpsControl(pipe_dir=str(self.workdir / "mps"),
                                  log_dir=str(self.workdir / "mps-log"),
                                  protocol_v3=self.nvml.has_memory_limits,
                                  devices=len(self.nvml.gpus))
        try:
            self.node_config = _node_config(config, self.workdir, self.keys)
        except ConfigError as e:  # only a workdir given by the caller can be too long
            raise ValueError(f"the demo's directory {self.workdir} is too long for the unix "
                             f"sockets below it: {e.message}") from None
        self.cgroup_fs = FakeCgroupFs(assume_present=True)
        self.nvml.use_cgroups(self.node_config.layout.root, self.cgroup_fs)
        self.marker_dir = self.workdir / "markers"
        self.proc_root = self.workdir / "proc"
        self.proc_root.mkdir(parents=True, exist_ok=True)
        self.api: Any = None
        self.api_client: Any = None
        self.core: Any = None
        self.mirror: Any = None
        self._mirror_client: Any = None
        self._mirror_metrics: Any = None
        self._mirror_metrics_url = ""
        self.agent: Any = None
        self.killer: Any = None
        """The agent's RecordingKiller once started: the pids a `kill` watchdog stopped."""
        self._agent_client: Any = None
        self._agent_cluster: Any = None
        self.channel: Any = None
        self.stub: Any = None
        self.endpoints: Endpoints | None = None

    # -- facts -----------------------------------------------------------------------------------

    @property
    def gpu_memory_mib(self) -> int:
        """The node label: MiB of the smallest GPU, as GPU feature discovery publishes it."""
        return min(g.memory_total for g in self.nvml.gpus) // MIB

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> DemoSession:
        try:
            self._start_api()
            self._start_mirror()
            self._start_agent()
        except BaseException:
            self.stop()
            raise
        assert self.agent is not None
        host, port = self.agent.metrics_address
        self.endpoints = Endpoints(
            api_url=self.api.url, kubeconfig=self.workdir / "kubeconfig",
            mirror=self.mirror.address, agent_socket=self.workdir / "agent.sock",
            metrics_url=f"http://{host}:{port}/metrics",
            mirror_metrics_url=self._mirror_metrics_url)
        return self

    def _start_api(self) -> None:
        from kubernetes import client as k8s

        from ..sim.apiserver import EmbeddedApiServer

        self.api = EmbeddedApiServer().start()
        self.api.write_kubeconfig(self.workdir / "kubeconfig", namespace=self.config.namespace)
        self.api_client = k8s.ApiClient(self.api.configuration())
        self.core = k8s.CoreV1Api(self.api_client)
        gpus = self.nvml.gpus
        # GPU feature discovery labels product, count and memory per model, and on a node with
        # several models writes one model's three labels over the others' (whichever its map
        # iteration visits last: it can change from run to run). The demo keeps the model its
        # memory label already names, the smallest GPU's (KAI's fractions of it fit every GPU).
        smallest = min(gpus, key=lambda g: g.memory_total)
        self.core.create_node({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": self.config.node, "labels": {
                k.NODE_GPU_MEMORY_LABEL: str(self.gpu_memory_mib),
                "nvidia.com/gpu.count": str(sum(g.name == smallest.name for g in gpus)),
                "nvidia.com/gpu.product": smallest.name.replace(" ", "-"),
                "kubernetes.io/hostname": self.config.node,
            }},
            "status": {"capacity": {"nvidia.com/gpu": str(len(gpus))},
                       "allocatable": {"nvidia.com/gpu": str(len(gpus))}},
        })
        self.progress(f"Kubernetes API (kmock) on {self.api.url}; node {self.config.node}: "
                      f"{gpu_summary(gpus)} (simulated), "
                      f"{k.NODE_GPU_MEMORY_LABEL}={self.gpu_memory_mib}")

    def _start_mirror(self) -> None:
        import grpc
        from kubernetes import client as k8s

        from ..api.v1 import allocation_pb2_grpc as pb_grpc
        from ..kube.client import Kube
        from ..metrics_http import MetricsEndpoint
        from ..mirror.grpc.server import MirrorServer, ServerOptions
        from ..mirror.kube_store import KubePodStore
        from ..mirror.metrics import MirrorMetrics
        from ..mirror.service import MirrorService

        self._mirror_client = k8s.ApiClient(self.api.configuration())
        metrics = MirrorMetrics()
        service = MirrorService(
            KubePodStore(Kube(self._mirror_client, observe=metrics.api_request)),
            keys=self.keys, default_reserve_mib=self.config.mirror_reserve_mib,
            dialect=self.config.dialect)
        self.mirror = MirrorServer(service, ServerOptions(listen="127.0.0.1:0",
                                                          grace_seconds=1.0),
                                   observe=metrics.call).start()
        self._mirror_metrics = MetricsEndpoint(metrics.registry)
        host, port = self._mirror_metrics.serve("127.0.0.1:0")
        self._mirror_metrics_url = f"http://{host}:{port}/metrics"
        self.channel = grpc.insecure_channel(self.mirror.address)
        self.stub = pb_grpc.AllocationMirrorStub(self.channel)
        self.progress(f"mirror (kai_fractions.v1.AllocationMirror) on {self.mirror.address}, "
                      f"reserve {self.config.mirror_reserve_mib} MiB per GPU, "
                      f"{self.config.dialect.value} KAI binder")

    def _start_agent(self) -> None:
        from kubernetes import client as k8s

        from ..node.agent.agent import NodeAgent
        from ..node.agent.kube import KubeCluster
        from ..node.agent.options import AgentOptions
        from ..node.procfs import Procfs
        from ..sim.killer import RecordingKiller
        from ..sim.mps import FakeMpsSupervisor

        self._agent_client = k8s.ApiClient(self.api.configuration())
        self._agent_cluster = KubeCluster(self._agent_client, request_timeout=5.0)
        options = AgentOptions(
            marker_dir=str(self.marker_dir), socket=str(self.workdir / "agent.sock"),
            metrics_listen="127.0.0.1:0", retry_seconds=0.2, retry_max_seconds=1.0,
            status_tick_seconds=0.2)
        self.agent = NodeAgent(
            config=self.node_config, options=options, nvml=self.nvml,
            cgroup_fs=self.cgroup_fs, source=self._agent_cluster,
            cluster=self._agent_cluster,
            mps=FakeMpsSupervisor(self.mps) if self.config.sm_sharing else None,
            procfs=Procfs(self.proc_root), killer=(killer := RecordingKiller()))
        self.killer = killer
        self.agent.start()
        host, port = self.agent.metrics_address
        self.progress(f"node agent on {self.config.node}: NodeEnforcer on unix://"
                      f"{options.socket}, metrics on http://{host}:{port}/metrics, "
                      f"sm-sharing {'on' if self.config.sm_sharing else 'off'}, memory tiers "
                      f"{self.config.memory_enforcement}, watchdog policy "
                      f"{self.node_config.watchdog_policy.value}")

    def stop(self) -> None:
        """Reverse order; every step runs even when an earlier one failed."""
        steps: list[tuple[str, Callable[[], Any]]] = [
            ("node agent", lambda: self.agent.stop(timeout=5.0) if self.agent else None),
            ("agent client", lambda: self._agent_client.close() if self._agent_client else None),
            ("mirror channel", lambda: self.channel.close() if self.channel else None),
            ("mirror", lambda: self.mirror.stop(grace=0) if self.mirror else None),
            ("mirror metrics",
             lambda: self._mirror_metrics.close() if self._mirror_metrics else None),
            ("mirror client",
             lambda: self._mirror_client.close() if self._mirror_client else None),
            ("API client", lambda: self.api_client.close() if self.api_client else None),
            ("Kubernetes API", lambda: self.api.stop() if self.api else None),
        ]
        for what, step in steps:
            try:
                step()
            except Exception as e:  # keep stopping the rest; say what was left
                log.warning("stopping the %s failed: %s", what, e)
        self.agent = self.mirror = self.channel = self.api = None
        self._agent_client = self._mirror_client = self.api_client = None
        self._mirror_metrics = None
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> DemoSession:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
