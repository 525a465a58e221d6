"""The demo's stand-in for the kubelet and the container runtime of the simulated node.

It does what they would do for a pod bound to the node, through the same seams the agent reads:
- the pod's status: the gate init container running (with a container ID), then either the
  workload containers running or the gate's failure with its termination message;
- the gate itself: the REAL gate loop (`kai_fractions.gate.run_gate`) over the pod's own marker
  directory and a downward-API annotations file written the way the kubelet writes it;
- GPU processes of running containers: a process in the simulated NVML (with its memory use)
  plus its `/proc/<pid>/cgroup` under the agent's proc root, so the agent's watchdog maps it to
  its container exactly as on a real node.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..admission.config import GATE_CONTAINER
from ..contract import MIB, Keys
from ..contract import keys as k
from ..gate import GateOptions, run_gate
from ..marker import pod_marker_dir, read_boot_id
from ..node.cgroups import CgroupLayout, compute_qos_class
from ..sim.nvml import FakeNvml

GATE_TIMEOUT = 20.0
GATE_POLL = 0.05
_NOW = "1970-01-01T00:00:00Z"


def container_id(pod_uid: str, container: str) -> str:
    """A stable `containerd://<64 hex>` ID, as the runtime reports it in the pod's status."""
    return "containerd://" + hashlib.sha256(f"{pod_uid}/{container}".encode()).hexdigest()


def downward_annotations(annotations: Mapping[str, str]) -> str:
    """The kubelet's downward-API file for `metadata.annotations`: sorted `key="value"` lines,
    values quoted like Go's strconv.Quote (JSON's escapes are a subset the gate reads)."""
    return "\n".join(f"{key}={json.dumps(value, ensure_ascii=False)}"
                     for key, value in sorted(annotations.items()))


class CapHeld(Exception):
    """A simulated allocation refused by a hard memory tier; `tier` names it (cgroup or
    mps-pinned) and the message says which limit held."""

    def __init__(self, tier: str, message: str):
        self.tier = tier
        super().__init__(message)


def container_env(pod: Mapping[str, Any], container: str) -> dict[str, str]:
    """The container's env as the kubelet resolves it: plain values, and downward-API fieldRefs
    to the pod's annotations (how admission wires the enforced variables)."""
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    spec = next((c for c in (pod.get("spec") or {}).get("containers") or []
                 if isinstance(c, Mapping) and c.get("name") == container), {})
    env: dict[str, str] = {}
    for entry in spec.get("env") or []:
        if "value" in entry:
            env[entry["name"]] = str(entry["value"])
            continue
        path = ((entry.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath", "")
        if path.startswith("metadata.annotations['") and path.endswith("']"):
            env[entry["name"]] = str(annotations.get(path[len("metadata.annotations['"):-2], ""))
    return env


def pinned_limit_mib(env: Mapping[str, str], ordinal: int) -> int | None:
    """The MPS pinned device memory limit of in-container device `ordinal` (`0=8192M,1=...`),
    or None when the process is no MPS client (no pipe directory) or has no such entry."""
    if k.ENV_PIPE_DIRECTORY not in env:
        return None
    for item in env.get(k.ENV_PINNED_MEM_LIMIT, "").split(","):
        index, _, value = item.partition("=")
        if index.strip() == str(ordinal) and value.strip().endswith("M"):
            return int(value.strip()[:-1])
    return None


@dataclass(frozen=True, slots=True)
class GateResult:
    exit_code: int
    message: str

    @property
    def released(self) -> bool:
        return self.exit_code == 0


def _names(spec: Mapping[str, Any], field: str) -> list[str]:
    return [str(c.get("name")) for c in spec.get(field) or [] if isinstance(c, Mapping)]


def _running(name: str, pod_uid: str, image: str) -> dict[str, Any]:
    return {"name": name, "containerID": container_id(pod_uid, name), "image": image,
            "imageID": "", "ready": True, "restartCount": 0, "started": True,
            "state": {"running": {"startedAt": _NOW}}}


def _waiting(name: str, image: str, reason: str) -> dict[str, Any]:
    return {"name": name, "image": image, "imageID": "", "ready": False, "restartCount": 0,
            "started": False, "state": {"waiting": {"reason": reason}}}


def _images(spec: Mapping[str, Any], field: str) -> dict[str, str]:
    return {str(c.get("name")): str(c.get("image") or "") for c in spec.get(field) or []
            if isinstance(c, Mapping)}


class SimulatedKubelet:
    def __init__(self, core: Any, node: str, marker_dir: Path, workdir: Path, keys: Keys,
                 nvml: FakeNvml, proc_root: Path, layout: CgroupLayout):
        self.core = core
        self.node = node
        self.marker_dir = marker_dir
        self.workdir = workdir
        self.keys = keys
        self.nvml = nvml
        self.proc_root = proc_root
        self.layout = layout
        self._next_pid = 41000

    # -- pod status ------------------------------------------------------------------------------

    def _patch_status(self, pod: Mapping[str, Any], status: dict[str, Any]) -> dict[str, Any]:
        meta = pod["metadata"]
        body = {"metadata": {"uid": meta["uid"]}, "status": status}
        return self.core.api_client.sanitize_for_serialization(
            self.core.patch_namespaced_pod_status(meta["name"], meta["namespace"], body))

    def start(self, pod: Mapping[str, Any]) -> dict[str, Any]:
        """The pod's sandbox and cgroup exist, its first init container (the gate) runs."""
        spec = pod["spec"]
        uid = pod["metadata"]["uid"]
        init = _images(spec, "initContainers")
        main = _images(spec, "containers")
        return self._patch_status(pod, {
            "phase": "Pending", "qosClass": compute_qos_class(spec).value,
            "conditions": [{"type": "PodScheduled", "status": "True"},
                           {"type": "Initialized", "status": "False"}],
            "initContainerStatuses": [
                _running(n, uid, img) if n == GATE_CONTAINER else _waiting(n, img, "Waiting")
                for n, img in init.items()],
            "containerStatuses": [_waiting(n, img, "PodInitializing") for n, img in main.items()],
        })

    def finish(self, pod: Mapping[str, Any], gate: GateResult) -> dict[str, Any]:
        """The gate exited: the workload starts, or the pod stays in Init:Error with the gate's
        termination message (what `kubectl describe pod` shows)."""
        spec = pod["spec"]
        uid = pod["metadata"]["uid"]
        init = _images(spec, "initContainers")
        main = _images(spec, "containers")
        terminated = {"exitCode": gate.exit_code, "reason": "Completed" if gate.released
                      else "Error", "message": gate.message, "startedAt": _NOW,
                      "finishedAt": _NOW, "containerID": container_id(uid, GATE_CONTAINER)}
        gate_status = {"name": GATE_CONTAINER, "image": init.get(GATE_CONTAINER, ""),
                       "imageID": "", "ready": gate.released, "restartCount": 0,
                       "containerID": container_id(uid, GATE_CONTAINER),
                       "state": {"terminated": terminated}}
        others = [n for n in init if n != GATE_CONTAINER]
        if gate.released:
            init_statuses = [gate_status] + [
                {**_waiting(n, init[n], ""), "ready": True, "containerID": container_id(uid, n),
                 "state": {"terminated": {"exitCode": 0, "reason": "Completed"}}}
                for n in others]
            return self._patch_status(pod, {
                "phase": "Running",
                "conditions": [{"type": "PodScheduled", "status": "True"},
                               {"type": "Initialized", "status": "True"},
                               {"type": "Ready", "status": "True"}],
                "initContainerStatuses": init_statuses,
                "containerStatuses": [_running(n, uid, img) for n, img in main.items()],
            })
        return self._patch_status(pod, {
            "phase": "Pending",
            "initContainerStatuses": [gate_status] + [_waiting(n, init[n], "PodInitializing")
                                                      for n in others],
        })

    # -- the gate --------------------------------------------------------------------------------

    def run_gate(self, pod: Mapping[str, Any], timeout: float = GATE_TIMEOUT) -> GateResult:
        """The gate as the pod's first init container runs it: its own marker directory, the
        pod's annotations through the downward API, its termination-message file."""
        meta, spec = pod["metadata"], pod["spec"]
        uid = meta["uid"]
        here = self.workdir / "pods" / uid
        here.mkdir(parents=True, exist_ok=True)
        annotations = here / "annotations"
        annotations.write_text(downward_annotations(meta.get("annotations") or {}))
        termination = here / "termination-log"
        options = GateOptions(
            marker_dir=pod_marker_dir(self.marker_dir, uid), annotations_file=annotations,
            pod_uid=uid, timeout=timeout, poll_interval=GATE_POLL,
            termination_log=termination, keys=self.keys, boot_id=read_boot_id(),
            containers=tuple(_names(spec, "containers")),
            init_containers=tuple(n for n in _names(spec, "initContainers")
                                  if n != GATE_CONTAINER))
        code = run_gate(options, stdout=io.StringIO(), stderr=io.StringIO())
        message = termination.read_text().strip() if termination.exists() else ""
        return GateResult(code, message)

    # -- GPU processes -----------------------------------------------------------------------

    def start_process(self, pod: Mapping[str, Any], container: str, gpu: str,
                      used_bytes: int) -> int:
        """A CUDA process of `container` on `gpu` using `used_bytes`; returns its pid."""
        uid = pod["metadata"]["uid"]
        qos = compute_qos_class(pod["spec"])
        path = self.layout.container_path(uid, qos, container_id(uid, container))
        pid = self._next_pid
        self._next_pid += 1
        proc = self.proc_root / str(pid)
        proc.mkdir(parents=True, exist_ok=True)
        relative = path[len(self.layout.root.rstrip("/")):]
        (proc / "cgroup").write_text(f"0::{relative}\n")
        (proc / "stat").write_text(f"{pid} (python) S 1 {pid} {pid} 0\n")
        (proc / "comm").write_text("python\n")
        self.nvml.add_process(pid, gpu, used_bytes, cgroup=path)
        return pid

    def allocate(self, pod: Mapping[str, Any], container: str, gpu: str, pid: int,
                 extra: int, mechanisms: Collection[str]) -> None:
        """Process `pid` of `container` asks for `extra` bytes more on `gpu`, as a CUDA
        allocation would; raises CapHeld (and nothing changes) when a hard tier the node agent
        reports in force for it (`mechanisms`, what the TIER column shows) stops it, strongest
        first: the driver's cgroup limits, then the MPS client's pinned device memory limit
        (sm-sharing). The pinned limit counts only when the agent applied it: the env is wired
        into every fractional container, and the demo's verdict must follow the agent's.
        Raises GpuOutOfMemory when the driver refuses it for another reason (the GPU's memory
        is full, or a cgroup limit the agent does not report)."""
        if "cgroup" in mechanisms:
            refused = self.nvml.over_hard_limit(pid, gpu, extra)
            if refused is not None:
                raise CapHeld("cgroup", f"the allocation fails (out of memory): the NVML "
                              f"cgroup hard limit of {refused.hard // MIB} MiB on "
                              f"{refused.cgroup} holds it (simulated NVML, as an r615 "
                              "driver refuses it)")
        if "mps-pinned" in mechanisms:
            env = container_env(pod, container)
            devices = [d.rsplit("=", 1)[-1]
                       for d in env.get(k.ENV_VISIBLE_DEVICES, "").split(",")]
            ordinal = devices.index(gpu) if gpu in devices else 0
            pinned = pinned_limit_mib(env, ordinal)
            used = next((p.used_bytes or 0 for p in self.nvml.processes
                         if p.pid == pid and p.gpu == gpu), 0)
            if pinned is not None and used + extra > pinned * MIB:
                raise CapHeld("mps-pinned", f"the allocation fails (out of memory): the MPS "
                              f"client's pinned device memory limit ({k.ENV_PINNED_MEM_LIMIT} "
                              f"{ordinal}={pinned}M) holds it (simulated, as the MPS client "
                              "refuses it)")
        self.nvml.allocate(pid, gpu, extra)
