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
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..admission.config import GATE_CONTAINER
from ..contract import Keys
from ..gate import GateOptions, run_gate
from ..marker import pod_marker_dir
from ..node.cgroups import CgroupLayout, compute_qos_class
from ..node.nvml_fake import FakeNvml

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
            termination_log=termination, keys=self.keys,
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

    def stop_process(self, pid: int) -> None:
        self.nvml.remove_process(pid)
        for name in ("cgroup", "stat", "comm"):
            (self.proc_root / str(pid) / name).unlink(missing_ok=True)
        (self.proc_root / str(pid)).rmdir()
