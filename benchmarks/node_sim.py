"""A simulated GPU node for P2 and P3: the REAL node agent (`NodeAgent`: watcher, worker,
reconciler, engine, marker store, status publisher) in this process, over

* the project's fake `libnvidia-ml.so.1` loaded into the real pynvml (`PynvmlNvml`), configured
  in its file format (tests/fakes/nvml/README.md) by `FakeNvmlConfig` below, a few lines rather
  than `tests/support/fake_nvml.py`, which imports pytest: P3 weighs this process. The fake
  re-reads its config file on every call, so an NVML call costs a stat (and a parse after a
  change): more than a real driver's ioctl;
* the real MPS control daemon (`nvidia-cuda-mps-control`, the 535 legacy protocol) supervised by
  `MpsDaemon` (it starts without a GPU; servers never start here);
* `HostCgroupFs` over a temporary cgroup tree in which this module plays the kubelet (pod slice
  when a pod is bound, container scope when it runs);
* the agent's in-memory Kubernetes (`FakeCluster`: pods, watch, events, node status);
* a temporary /proc tree for the watchdog's pid -> container lookups.

Pods carry exactly what the mirror writes before the bind (`compute_outcome` + `mirror_patch`
over the pod's own request): the agent finds its derived annotations in place and patches none.
Needs `scripts/test-tools.sh` to have run (.tools/).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
import uuid as uuid_mod
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

from kai_fractions.contract import BindDecision, ComputeMode
from kai_fractions.contract import keys as k
from kai_fractions.node.agent.agent import NodeAgent
from kai_fractions.node.agent.options import AgentOptions
from kai_fractions.node.cgroups import ContainerId, HostCgroupFs, QosClass
from kai_fractions.node.config import NodeConfig
from kai_fractions.node.mps import MpsDaemon, SubprocessRunner
from kai_fractions.node.nvml import PynvmlNvml
from kai_fractions.node.procfs import Procfs
from tests.support.fake_kube import FakeCluster

REPO = Path(__file__).resolve().parent.parent
TOOLS = REPO / ".tools"
NODE = "gpu-node-1"
GPU_MIB = 81559
"""An H100 80GB as NVML reports it; also the node's `nvidia.com/gpu.memory` label."""
RESERVE_MIB = 1024
"""What the chart has the mirror withhold per GPU when sm-sharing is enabled."""
PORTION = "0.07"
"""13 of these fit one GPU, so 100 pods fit 8 GPUs."""
MIB = 1 << 20
ENV_CONFIG, ENV_STATE, ENV_LOG = "KAI_FAKE_NVML_CONFIG", "KAI_FAKE_NVML_STATE", "KAI_FAKE_NVML_LOG"


def tool(relative: str) -> Path:
    path = TOOLS / relative
    if not path.exists():
        raise RuntimeError(f"{path} is missing: run scripts/test-tools.sh")
    return path


class FakeNvmlConfig:
    """GPUs and processes for the fake library, written atomically (it may be reading)."""

    def __init__(self, directory: Path, driver_version: str = "615.48.02") -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / "fake-nvml.conf"
        self.driver_version = driver_version
        self.gpus: list[str] = []
        self.uuids: list[str] = []
        self.processes: list[str] = []

    def add_gpu(self, memory_mib: int, name: str = "NVIDIA H100 80GB HBM3") -> str:
        index = len(self.gpus)
        uuid = gpu_uuid(index)
        self.gpus.append(f"gpu index={index} uuid={uuid} memory={memory_mib * MIB} reserved=0 "
                         f"compute_mode=0 mig=0 lost=0 util_memory=0 name={name}")
        self.uuids.append(uuid)
        return uuid

    def add_process(self, gpu: int, pid: int, used_bytes: int, sm: int, cgroup: str) -> None:
        self.processes.append(f"process gpu={gpu} pid={pid} used={used_bytes} mem=0 sm={sm} "
                              f"cgroup={cgroup}")

    def write(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("\n".join([f"driver_version {self.driver_version}", *self.gpus,
                                  *self.processes]) + "\n")
        os.replace(tmp, self.path)

    def env(self) -> dict[str, str]:
        return {ENV_CONFIG: str(self.path), ENV_STATE: f"{self.path}.state",
                ENV_LOG: f"{self.path}.log"}


@dataclass
class SimNode:
    root: Path
    nvml_fake: FakeNvmlConfig
    gpus: list[str]
    cluster: FakeCluster
    agent: NodeAgent
    config: NodeConfig
    options: AgentOptions
    proc_root: Path
    _next_pid: int = 10_000

    @property
    def markers(self) -> Path:
        return Path(self.options.marker_dir)

    def mode_of(self, gpu: int) -> ComputeMode:
        return mode_of(gpu, self.config.sm_sharing)

    def pod(self, index: int, gpu: int, *, running: bool) -> dict[str, Any]:
        return bound_pod(index, self.gpus[gpu], self.mode_of(gpu), running=running,
                         keys=self.config.keys)

    # -- playing the kubelet ------------------------------------------------------------------

    def make_cgroups(self, manifest: Mapping[str, Any]) -> None:
        """The pod slice, and a scope per container with an ID (what kubelet creates)."""
        layout = self.config.layout
        uid = manifest["metadata"]["uid"]
        Path(layout.pod_path(uid, QosClass.BURSTABLE)).mkdir(parents=True, exist_ok=True)
        status = manifest.get("status") or {}
        for cs in (status.get("initContainerStatuses") or []) + \
                (status.get("containerStatuses") or []):
            Path(layout.container_path(uid, QosClass.BURSTABLE, cs["containerID"])).mkdir(
                parents=True, exist_ok=True)

    def remove_cgroups(self, uid: str) -> None:
        shutil.rmtree(self.config.layout.pod_path(uid, QosClass.BURSTABLE), ignore_errors=True)

    def gpu_process(self, manifest: Mapping[str, Any], gpu: int, used_mib: int) -> int:
        """A CUDA process of the pod's main container: in NVML's process list (written by the
        next `nvml_fake.write()`) and in /proc."""
        pid = self._next_pid
        self._next_pid += 1
        uid = manifest["metadata"]["uid"]
        path = self.config.layout.container_path(uid, QosClass.BURSTABLE, container_id(uid))
        relative = "/" + os.path.relpath(path, self.config.cgroup_root)
        entry = self.proc_root / str(pid)
        entry.mkdir(parents=True, exist_ok=True)
        (entry / "cgroup").write_text(f"0::{relative}\n")
        (entry / "stat").write_text(f"{pid} (python) S 1 {pid} {pid} 0 -1\n")
        self.nvml_fake.add_process(gpu, pid, used_mib * MIB, sm=7, cgroup=relative)
        return pid


def wait_until(predicate: Callable[[], object], what: str, timeout: float,
               interval: float = 0.002) -> None:
    """Polls `predicate` until it holds; RuntimeError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what} ({timeout:g} s)")
        time.sleep(interval)


def gpu_uuid(index: int) -> str:
    return f"GPU-00000000-0000-0000-0000-{index + 1:012d}"


def mode_of(gpu: int, sm_sharing: bool = True) -> ComputeMode:
    """Even GPUs sm-sharing (MPS), odd ones time-slicing: one mode per GPU, both paths."""
    return ComputeMode.SM_SHARING if gpu % 2 == 0 and sm_sharing else ComputeMode.TIME_SLICING


def bound_pod(index: int, gpu: str, mode: ComputeMode, *, running: bool,
              keys: k.Keys = k.DEFAULT_KEYS) -> dict[str, Any]:
    """Pod `index` on GPU `gpu` as it is once bound: the mirror's annotations on it (what
    `compute_outcome` + `mirror_patch` write); with `running` its container has an ID (else only
    the gate init container runs)."""
    # Imported here: the agent process of P3 must not carry the mirror's modules.
    from kai_fractions.mirror.compute import compute_outcome, mirror_patch
    from kai_fractions.mirror.store import PodSnapshot

    uid = str(uuid_mod.UUID(int=index + 1, version=4))
    notes = {k.GPU_FRACTION: PORTION, "team": "bench"}
    if mode is ComputeMode.SM_SHARING:
        notes[keys.container("main", k.COMPUTE_MODE)] = mode.value
    metadata = {"name": f"train-{index}", "namespace": "bench", "uid": uid,
                "annotations": notes}
    spec = {"nodeName": NODE, "schedulerName": k.KAI_SCHEDULER_NAME,
            "initContainers": [{"name": "kai-fractions-gate", "image": "gate"}],
            "containers": [{"name": "main", "image": "train",
                            "resources": {"requests": {"cpu": "1"}}}]}
    snapshot = PodSnapshot(metadata=metadata, spec=spec)
    decision = BindDecision(node_gpu_memory_mib=GPU_MIB, gpu_ids=(gpu,),
                            received_portion=Fraction(PORTION), group_modes=(mode,),
                            reserve_mib=RESERVE_MIB)
    outcome = compute_outcome(snapshot, decision, container="main", keys=keys)
    notes.update({key: value for key, value in mirror_patch(
        snapshot, outcome, keys=keys).changes.items() if value is not None})
    status: dict[str, Any] = {"phase": "Running" if running else "Pending",
                              "qosClass": QosClass.BURSTABLE.value}
    if running:
        status["containerStatuses"] = [{"name": "main", "containerID": container_id(uid)}]
    else:
        status["initContainerStatuses"] = [{"name": "kai-fractions-gate",
                                            "containerID": container_id(uid, "gate")}]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec,
            "status": status}


def container_id(uid: str, salt: str = "main") -> str:
    digest = uuid_mod.uuid5(uuid_mod.NAMESPACE_OID, f"{uid}/{salt}").hex
    return str(ContainerId.parse("containerd://" + (digest * 2)))


@contextmanager
def sim_node(gpus: int = 8, *, watchdog_interval: float = 1.0, sm_sharing: bool = True,
             serve: bool = False, start: bool = True,
             options: Mapping[str, Any] | None = None) -> Iterator[SimNode]:
    """A started agent on a simulated node with `gpus` GPUs and no pod. `serve` also opens its
    gRPC socket and metrics endpoint (as the real process does); stopped on the way out (the
    agent stops the MPS daemon it started)."""
    logger = logging.getLogger("kai_fractions")
    level = logger.level
    logger.setLevel(logging.WARNING)  # no per-pod INFO lines; put back on the way out
    # Short: the MPS pipe directory holds unix sockets (107-byte path limit).
    root = Path(tempfile.mkdtemp(prefix="kfn-", dir="/tmp"))
    saved = {name: os.environ.get(name) for name in (ENV_CONFIG, ENV_STATE, ENV_LOG)}
    try:
        nvml_fake = FakeNvmlConfig(root / "nvml")
        for _ in range(gpus):
            nvml_fake.add_gpu(GPU_MIB)
        nvml_fake.write()
        os.environ.update(nvml_fake.env())
        proc_root = root / "proc"
        proc_root.mkdir()
        config = NodeConfig(
            node_name=NODE, cgroup_root=str(root / "cg"), proc_root=str(proc_root),
            sm_sharing=sm_sharing,
            mps_control_binary=str(tool("mps/usr/bin/nvidia-cuda-mps-control")),
            mps_pipe_dir=str(root / "mps"), mps_log_dir=str(root / "mpslog"),
            watchdog_interval=watchdog_interval,
            nvml_library=str(tool("nvml/full/libnvidia-ml.so.1")))
        Path(config.cgroup_root).mkdir()
        agent_options = AgentOptions(
            marker_dir=str(root / "markers"),
            socket=str(root / "agent.sock") if serve else None,
            metrics_listen="127.0.0.1:0" if serve else None, **dict(options or {}))
        cluster = FakeCluster()
        cluster.add_node(NODE)
        mps = (MpsDaemon(config.mps_control_binary, config.mps_pipe_dir, config.mps_log_dir,
                         SubprocessRunner()) if sm_sharing else None)
        agent = NodeAgent(config=config, options=agent_options,
                          nvml=PynvmlNvml(config.nvml_library), cgroup_fs=HostCgroupFs(),
                          source=cluster, cluster=cluster, mps=mps, procfs=Procfs(str(proc_root)))
        node = SimNode(root, nvml_fake, list(nvml_fake.uuids), cluster, agent, config,
                       agent_options, proc_root)
        if start:
            agent.start()
        try:
            yield node
        finally:
            if start:
                agent.stop(timeout=20)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        shutil.rmtree(root, ignore_errors=True)
        logger.setLevel(level)


__all__ = ["NODE", "PORTION", "FakeNvmlConfig", "SimNode", "bound_pod", "container_id",
           "gpu_uuid", "mode_of", "sim_node"]
