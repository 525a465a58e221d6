"""The node agent in-process over the REAL Kubernetes client (KubeCluster) talking to kmock
through a FaultProxy, with the in-memory NVML and cgroup tree: what a fault test needs to break
the API under the agent's list/watch and writes, and to check the GPU state afterwards."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes import client as k8s

from kai_fractions.node.agent.agent import NodeAgent
from kai_fractions.node.agent.kube import KubeCluster
from kai_fractions.node.agent.options import AgentOptions
from kai_fractions.node.config import NodeConfig
from kai_fractions.sim.cgroups import FakeCgroupFs
from kai_fractions.sim.nvml import FakeNvml
from tests.agent.builders import binder_annotations, pod, wait_for
from tests.support.agent_process import read_markers
from tests.support.kube import KubeServer

from .proxy import FaultProxy

NODE = "gpu-node-1"
GIB = 1 << 30
SLICE = ("/sys/fs/cgroup/kubepods.slice/kubepods-burstable.slice/"
         "kubepods-burstable-pod{u}.slice")


def slice_of(uid: str) -> str:
    return SLICE.format(u=uid.replace("-", "_"))


@dataclass
class AgentRig:
    kube: KubeServer
    proxy: FaultProxy
    agent: NodeAgent
    nvml: FakeNvml
    cgroups: FakeCgroupFs
    marker_dir: Path
    gpu: str

    def create_pod(self, name: str) -> str:
        body = {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "namespace": "default", "annotations": {
                    "nvidia.com/container.main.gpu-memory.request": "10Gi",
                    "nvidia.com/container.main.gpu-memory.limit": "20Gi",
                    "nvidia.com/container.main.gpus.devices": self.gpu,
                    "nvidia.com/container.main.gpu-compute.portion": "0.25"}},
                "spec": {"nodeName": NODE, "containers": [{
                    "name": "main", "image": "registry.invalid/app:1",
                    "resources": {"requests": {"cpu": "100m"}}}]}}
        uid = self.kube.core.create_namespaced_pod("default", body).metadata.uid
        self.cgroups.add(slice_of(uid))  # what the kubelet does when the pod lands
        return uid

    def delete_pod(self, name: str) -> None:
        self.kube.core.delete_namespaced_pod(name, "default")

    def limits(self) -> dict[str, tuple[int, int]]:
        return {path: value for (_gpu, path), value in self.nvml.limits.items()}

    def markers(self) -> dict[str, dict[str, Any]]:
        return read_markers(self.marker_dir)

    def marker_dirs(self) -> set[str]:
        """The pods' directories (beside them lies the agent's record of its limits)."""
        return {p.name for p in self.marker_dir.iterdir() if p.is_dir()} \
            if self.marker_dir.exists() else set()

    def ready_without_limits(self) -> list[str]:
        """Pods whose marker says applied while the GPU holds no limit on their slice: the
        one outcome that must never be seen, at any moment."""
        before = self.limits()  # limits, markers, limits: see test_agent_process_faults
        markers = self.markers()
        after = self.limits()
        return [uid for uid, body in markers.items()
                if any(c["state"] == "applied" for c in body["containers"].values())
                and slice_of(uid) not in before and slice_of(uid) not in after]


@contextlib.contextmanager
def agent_over_proxy(kube: KubeServer, tmp: Path, **options: Any) -> Iterator[AgentRig]:
    proxy = FaultProxy(kube.url)
    configuration = k8s.Configuration(host=proxy.url)
    configuration.retries = False
    api_client = k8s.ApiClient(configuration)
    # a silent watch connection is given up quickly
    cluster = KubeCluster(api_client, request_timeout=1.0, watch_seconds=30, read_timeout=2.0)
    nvml = FakeNvml.simulated(1, model="H100-80GB", seed=NODE)
    cgroups = FakeCgroupFs(assume_present=True)
    marker_dir = tmp / "markers"
    config = NodeConfig(node_name=NODE, sm_sharing=False, proc_root=str(tmp))
    agent = NodeAgent(
        config=config,
        options=AgentOptions(marker_dir=str(marker_dir), socket=None, metrics_listen=None,
                             api_timeout_seconds=1.0, watch_seconds=30, **options),
        nvml=nvml, cgroup_fs=cgroups, source=cluster, cluster=cluster)
    kube.core.create_node({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
    rig = AgentRig(kube, proxy, agent, nvml, cgroups, marker_dir, nvml.gpus[0].uuid)
    agent.start()
    try:
        yield rig
    finally:
        agent.stop(timeout=10)
        cluster.close()
        proxy.close()
        api_client.close()


def first_daemon_then_sm_pod(daemon: Any, cluster: Any, markers: Path, gpu: str
                             ) -> tuple[int, str]:
    """Waits for the agent's first MPS daemon, then adds an sm-sharing pod on `gpu` and waits
    for its marker: (the daemon's pid, the pod's uid)."""
    wait_for(lambda: daemon.pid() is not None, timeout=20, what="the first daemon")
    first = daemon.pid()
    uid = cluster.add_pod(pod("sm", node="node-a", notes=binder_annotations(
        devices=gpu, mode="sm-sharing", request="8Gi", limit="20Gi")))["metadata"]["uid"]
    wait_for((markers / uid / "marker.json").exists, timeout=30, what="the marker")
    return first, uid
