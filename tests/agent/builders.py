"""Builders for the agent's unit tests: pods bound to a node, and an agent over in-memory fakes
(FakeCluster, FakeNvml, FakeCgroupFs, FakeMpsSupervisor) that tests drive pass by pass.

Annotation keys are written out literally (never built from kai_fractions' key helpers).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kai_fractions.contract import DEFAULT_KEYS
from kai_fractions.gate.check import Outcome, judge
from kai_fractions.marker import read_marker
from kai_fractions.node.agent.agent import NodeAgent
from kai_fractions.node.agent.options import AgentOptions
from kai_fractions.node.config import NodeConfig
from kai_fractions.sim.cgroups import FakeCgroupFs
from kai_fractions.sim.killer import RecordingKiller
from kai_fractions.sim.mps import FakeMpsControl, FakeMpsSupervisor
from kai_fractions.sim.nvml import FakeNvml
from tests.support.fake_kube import FakeCluster

NODE = "node-a"
MIB = 1 << 20
GIB = 1 << 30
CID = "containerd://" + "a" * 64
SLICE = "/sys/fs/cgroup/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{u}.slice"
"""A Burstable pod's cgroup (systemd driver), by pod UID."""
LEAF = "cri-containerd-" + "a" * 64 + ".scope"
"""The cgroup of the container whose ID is CID, under its pod's slice."""


def binder_annotations(container: str = "main", *, request: str = "10Gi", limit: str = "20Gi",
                       mode: str | None = None, devices: str = "", portion: str = "0.5"
                       ) -> dict[str, str]:
    p = f"nvidia.com/container.{container}"
    out = {f"{p}.gpu-memory.request": request, f"{p}.gpu-memory.limit": limit,
           f"{p}.gpus.devices": devices, f"{p}.gpu-compute.portion": portion}
    if mode is not None:
        out[f"{p}.gpu-compute.mode"] = mode
    return out


def pod(name: str = "p", *, notes: Mapping[str, str] | None = None, node: str = NODE,
        uid: str | None = None, container_id: str | None = CID, qos: str = "Burstable",
        phase: str = "Running", namespace: str = "default") -> dict[str, Any]:
    status: dict[str, Any] = {"phase": phase, "qosClass": qos}
    if container_id:
        status["containerStatuses"] = [{"name": "main", "containerID": container_id}]
    meta: dict[str, Any] = {"name": name, "namespace": namespace,
                            "annotations": dict(notes or {})}
    if uid:
        meta["uid"] = uid
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
            "spec": {"nodeName": node, "containers": [{"name": "main", "image": "x"}]},
            "status": status}


class Rig:
    """One agent over in-memory fakes; nothing runs until a test says so."""

    def __init__(self, tmp_path: Path, *, sm_sharing: bool = True, mps_v3: bool = True,
                 nvml: FakeNvml | None = None, with_cluster: bool = True,
                 options: Mapping[str, Any] | None = None, **config: Any):
        self.tmp = tmp_path
        self.cluster = FakeCluster()
        self.cluster.add_node(NODE)
        self.nvml = nvml or FakeNvml.simulated(2, model="H100-80GB", seed=NODE)
        self.gpu0, self.gpu1 = (g.uuid for g in self.nvml.gpus[:2])
        self.cgroups = FakeCgroupFs(assume_present=True)
        self.mps = FakeMpsSupervisor(FakeMpsControl(protocol_v3=mps_v3,
                                                    pipe_dir=str(tmp_path / "mps")))
        self.killer = RecordingKiller()
        self.proc = tmp_path / "proc"
        self.proc.mkdir(exist_ok=True)
        self.config = NodeConfig(node_name=NODE, sm_sharing=sm_sharing,
                                 mps_pipe_dir=str(tmp_path / "mps"),
                                 proc_root=str(self.proc), **config)
        self.options = AgentOptions(**{"marker_dir": str(tmp_path / "markers"), "socket": None,
                                       "metrics_listen": None, **dict(options or {})})
        self.agent = NodeAgent(config=self.config, options=self.options, nvml=self.nvml,
                               cgroup_fs=self.cgroups,
                               source=self.cluster if with_cluster else None,
                               cluster=self.cluster if with_cluster else None,
                               mps=self.mps if sm_sharing else None, procfs=None,
                               killer=self.killer)
        self.reconciler = self.agent.reconciler

    def restarted(self, killer: RecordingKiller | None = None, **config: Any) -> Rig:
        """A new agent over the same cluster, GPUs, cgroup tree, MPS daemon, /proc and marker
        directory: it remembers nothing, only what those say. `config`: NodeConfig fields it
        runs with otherwise (an operator's changed flags)."""
        new = copy.copy(self)
        new.killer = killer or self.killer
        new.config = dataclasses.replace(self.config, **config)
        new.agent = NodeAgent(config=new.config, options=self.options, nvml=self.nvml,
                              cgroup_fs=self.cgroups, source=self.cluster, cluster=self.cluster,
                              mps=self.mps if new.config.sm_sharing else None, procfs=None,
                              killer=new.killer)
        new.reconciler = new.agent.reconciler
        return new

    # -- driving ------------------------------------------------------------------------------

    def sync(self) -> None:
        """One list, as the watcher does at start."""
        assert self.agent.watcher is not None
        self.agent.watcher.list_once()

    def step(self, **kw: Any):
        """A list, then one pass."""
        self.sync()
        return self.reconciler.reconcile(**kw)

    def add(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        return self.cluster.add_pod(manifest)

    def marker_path(self, uid: str) -> Path:
        return Path(self.options.marker_dir) / uid / "marker.json"

    def proc_entry(self, pid: int, cgroup: str) -> None:
        d = self.proc / str(pid)
        d.mkdir(parents=True, exist_ok=True)
        (d / "cgroup").write_text(f"0::{cgroup}\n")
        (d / "stat").write_text(f"{pid} (python) S 1 1 1 0 -1\n")


def wait_for(predicate: Callable[[], Any], timeout: float = 5.0, interval: float = 0.02,
             what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def slice_of(uid: str) -> str:
    return SLICE.format(u=uid.replace("-", "_"))


def leaf_of(uid: str) -> str:
    return f"{slice_of(uid)}/{LEAF}"


def marker_of(rig: Rig, uid: str) -> dict | None:
    """The pod's readiness marker as the agent wrote it, None when there is none."""
    path = rig.marker_path(uid)
    return json.loads(path.read_text()) if path.exists() else None


def gate_outcome(rig: Rig, uid: str) -> Outcome:
    """What the gate of a (restarted) sandbox of the pod's container `main` would do now."""
    marker = read_marker(rig.marker_path(uid).parent, expected_pod_uid=uid)
    return judge(rig.cluster.pods[uid]["metadata"]["annotations"], marker, pod_uid=uid,
                 keys=DEFAULT_KEYS, boot_id=rig.reconciler.markers.boot_id,
                 containers=["main"]).outcome


def condition(rig: Rig) -> tuple[bool, str, str]:
    """The node condition the agent would publish now: (ready, reason, message)."""
    cond = rig.agent.condition()
    assert cond is not None
    return cond.ready, cond.reason, cond.message


def result_of(rig: Rig, uid: str) -> Any:
    """The last pass's result for the pod's container `main`."""
    return rig.reconciler.view.results[(uid, "main")]


def limits_of(rig: Rig, uid: str) -> dict:
    """The memory limits the (fake) driver holds on the pod's cgroups: path -> (soft, hard)."""
    return {path: value for (_gpu, path), value in rig.nvml.limits.items()
            if uid.replace("-", "_") in path}
