"""The REAL agent process under faults, over kmock, the fake libnvidia-ml.so.1 (C) and the real
legacy MPS control daemon: NVML errors mid-reconcile, and the agent SIGKILLed at random points
while pods come and go. After each, the node converges exactly to what the cluster says; at no
moment is a container marked ready without its limits in the fake NVML state; no limit is left
on the cgroups of pods that went away."""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.agent_process import (
    GPU0,
    H100_MIB,
    AgentEnv,
    AgentRun,
    read_markers,
    wait_for,
)

pytestmark = [pytest.mark.faults, pytest.mark.integration]

GIB = 1 << 30
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_UNKNOWN = 999


def notes(mode: str) -> dict[str, str]:
    return {"nvidia.com/container.main.gpu-memory.request": "4Gi",
            "nvidia.com/container.main.gpu-memory.limit": "8Gi",
            "nvidia.com/container.main.gpu-compute.mode": mode,
            "nvidia.com/container.main.gpus.devices": GPU0,
            "nvidia.com/container.main.gpu-compute.portion": "0.1"}


class Node:
    """The cluster side of a test: pods created and deleted as the kubelet would see them."""

    def __init__(self, env: AgentEnv, mode: str = "time-slicing") -> None:
        self.env = env
        self.mode = mode
        self.live: dict[str, tuple[str, Path, Path]] = {}  # uid -> (name, slice, leaf)
        self.gone: dict[str, tuple[Path, Path]] = {}
        self.count = 0
        env.notes.append(self.describe)

    def create(self) -> str:
        name = f"p{self.count}"
        hex_id = f"{self.count + 1:02x}" * 32
        self.count += 1
        body = {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "namespace": "default",
                             "annotations": notes(self.mode)},
                "spec": {"nodeName": self.env.node, "containers": [{
                    "name": "main", "image": "registry.invalid/app:1",
                    "resources": {"requests": {"cpu": "100m"}}}]}}
        uid = self.env.kube.core.create_namespaced_pod("default", body).metadata.uid
        slice_, leaf = self.env.make_cgroups(uid, hex_id)
        self.env.kube.core.patch_namespaced_pod_status(name, "default", {"status": {
            "phase": "Running", "qosClass": "Burstable", "containerStatuses": [{
                "name": "main", "containerID": f"containerd://{hex_id}", "ready": False,
                "restartCount": 0, "image": "x", "imageID": "x"}]}})
        self.live[uid] = (name, slice_, leaf)
        return uid

    def delete(self, uid: str) -> None:
        name, slice_, leaf = self.live.pop(uid)
        self.env.kube.core.delete_namespaced_pod(name, "default")
        self.gone[uid] = (slice_, leaf)  # the kubelet removes the cgroups later

    # -- what the node says ------------------------------------------------------------------
    @staticmethod
    def applied_by(run: AgentRun) -> int | None:
        try:
            text = run.metrics()
        except OSError:  # not serving yet
            return None
        for line in text.splitlines():
            if line.startswith('kai_fractions_containers{node="gpu-node-1",state="applied"} '):
                return int(float(line.rsplit(" ", 1)[1]))
        return None

    def markers(self) -> dict[str, dict[str, Any]]:
        return read_markers(self.env.marker_dir)

    def limits(self) -> dict[str, tuple[int, int]]:
        return {path: (v.soft, v.hard) for (_gpu, path), v in self.env.nvml.limits().items()}

    def ready_without_limits(self) -> list[str]:
        """Pods marked applied while their limit is missing. The agent sets limits before it
        writes a marker and removes a marker before it clears limits, so reading limits, then
        markers, then limits again, a marker whose limit is in neither read was there without
        it (short of a whole pod life inside the few milliseconds of one look)."""
        before = self.limits()
        markers = self.markers()
        after = self.limits()
        want = (4 * GIB, 8 * GIB)
        return [uid for uid, body in markers.items()
                if body["containers"]["main"]["state"] == "applied"
                and want not in (before.get(str(self.slice_of(uid))),
                                 after.get(str(self.slice_of(uid))))]

    def slice_of(self, uid: str) -> Path:
        return self.env.pod_slice(uid)

    def expected_limits(self) -> dict[str, tuple[int, int]]:
        return {str(p): (4 * GIB, 8 * GIB)
                for _name, slice_, leaf in self.live.values() for p in (slice_, leaf)}

    def converged(self) -> bool:
        markers = self.markers()
        marker_dirs = {p.name for p in self.env.marker_dir.iterdir() if p.is_dir()} \
            if self.env.marker_dir.exists() else set()
        return (set(markers) == set(self.live) == marker_dirs
                and all(m["containers"]["main"]["state"] == "applied" for m in markers.values())
                and self.limits() == self.expected_limits())

    def describe(self) -> str:
        """Both sides of `converged` (and the last agent's count), for a failure report."""
        run = self.env.runs[-1] if self.env.runs else None
        markers = {uid: {n: c.get("state") for n, c in m.get("containers", {}).items()}
                   for uid, m in self.markers().items()}
        dirs = sorted(p.name for p in self.env.marker_dir.iterdir() if p.is_dir()) \
            if self.env.marker_dir.exists() else []
        return "\n".join([
            "the node as the test compares it:",
            f"live pods: {sorted((name, uid) for uid, (name, _s, _l) in self.live.items())}",
            f"deleted pods: {sorted(self.gone)}",
            f"applied (last agent's metrics): {self.applied_by(run) if run else None}",
            f"markers: {markers}",
            f"marker directories: {dirs}",
            f"limits: {sorted(self.limits().items())}",
            f"expected limits: {sorted(self.expected_limits().items())}"])

    def wait_converged(self, run: AgentRun, timeout: float = 30) -> None:
        """Until THIS agent has applied every live pod (its own metrics say so: the state a
        previous agent left may already look converged) and the node matches the cluster."""
        def check() -> bool:
            assert self.ready_without_limits() == [], "a marker vouches for missing limits"
            return self.applied_by(run) == len(self.live) and self.converged()
        try:
            wait_for(check, run=run, timeout=timeout,
                     what=f"convergence on {sorted(self.live)}")
        except AssertionError as e:  # CI shows a failure's first lines: both sides go first
            raise AssertionError(f"{self.describe()}\n{e}") from None
        leaked = [p for pair in self.gone.values() for p in pair if str(p) in self.limits()]
        assert leaked == [], f"limits left on the cgroups of deleted pods: {leaked}"


def one_pod_applied(env: AgentEnv) -> tuple[Node, AgentRun, str]:
    """A node with one GPU, its agent (time-slicing only) started, and one fractional pod whose
    limits it applied."""
    env.nvml.add_gpu(GPU0, memory_mib=H100_MIB)
    env.create_node()
    node = Node(env)
    run = env.start(sm_sharing=False)
    uid = node.create()
    node.wait_converged(run)
    return node, run, uid


def test_nvml_errors_mid_reconcile_delay_but_never_fake_readiness(agent_env: AgentEnv):
    env = agent_env
    node, run, first = one_pod_applied(env)
    # NVML starts refusing limit writes (and so clears): a new pod cannot be limited, the gone
    # one cannot be released yet
    error = env.nvml.inject_error("nvmlDeviceSetMemoryLimits_v1", NVML_ERROR_NO_PERMISSION)
    second = node.create()
    node.delete(first)
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        assert node.ready_without_limits() == []
        assert second not in node.markers()  # pending: never marked while not limited
        time.sleep(0.1)
    failed = [c for c in env.nvml.calls("SetMemoryLimits") if c.rc == NVML_ERROR_NO_PERMISSION]
    assert failed, "the agent did try (and fail) to write limits"
    assert not (env.marker_dir / first).exists()  # the gone pod's marker went at once
    env.nvml.errors.remove(error)
    env.nvml.write()
    node.wait_converged(run)
    assert node.limits() == node.expected_limits()
    assert run.stop() == 0


def test_nvml_failing_a_few_times_mid_reconcile_then_recovering(agent_env: AgentEnv):
    env = agent_env
    node, run, _uid = one_pod_applied(env)
    error = env.nvml.inject_error("nvmlDeviceGetMemoryLimits_v1", NVML_ERROR_UNKNOWN, times=3)
    node.create()
    node.wait_converged(run)
    assert env.nvml.error_hits(error) == 3
    assert run.stop() == 0


@pytest.mark.parametrize("mode", ["time-slicing", "sm-sharing"])
def test_agent_sigkilled_at_random_points_converges_every_time(agent_env: AgentEnv, mode):
    """Five rounds: pods change, the agent is SIGKILLed after a random delay (in the middle of
    whatever it was doing), the node is checked as the crash left it, a new agent starts."""
    env = agent_env
    env.nvml.add_gpu(GPU0, memory_mib=H100_MIB)
    env.create_node()
    node = Node(env, mode)
    rng = random.Random(5)
    sm = mode == "sm-sharing"
    run = env.start(sm_sharing=sm)
    for _ in range(2):
        node.create()
    node.wait_converged(run)
    for _round in range(5):
        node.create()
        node.delete(rng.choice(sorted(node.live)))
        time.sleep(rng.uniform(0.0, 0.8))
        run.proc.send_signal(signal.SIGKILL)
        assert run.proc.wait(10) == -signal.SIGKILL
        # as the crash left it: nothing vouches for limits that are not there
        assert node.ready_without_limits() == []
        run = env.start(sm_sharing=sm)
        node.wait_converged(run)
        if sm:  # the daemon the first agent started was adopted and holds the pinned cap
            # (asked until it answers: the legacy daemon turns a second concurrent client away
            # with "Cannot send command", and the agent talks to it too)
            wait_for(lambda: env.mps("get_default_device_pinned_mem_limit 0").stdout.strip()
                     == "8G", run=run, timeout=10, what="the pinned limit from the daemon")
    assert len(node.live) == 2 and len(node.gone) == 5
    assert run.stop() == 0
