"""The GpuFractioningConfig reporter: KAI's operator (upstream KAI-Scheduler
`pkg/operator/operands/gpu_sharing/gpu_sharing.go`) treats the NvFractions dependency as met only
when the cluster-scoped GpuFractioningConfig `default` has `Ready=True`. The condition must follow
the node agents' DaemonSet, never be a constant: the pure logic case by case, then the loop
against the API stand-in (kmock) while the DaemonSet's status changes."""

from __future__ import annotations

import asyncio
import datetime
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import kmock
import pytest
from kubernetes import client as k8s

from kai_fractions.cli import main
from kai_fractions.kube.client import Kube
from kai_fractions.mirror import kai_dependency as kd
from kai_fractions.mirror.kai_dependency import (
    Readiness,
    Reporter,
    Rollout,
    next_status,
    readiness,
)
from tests.support.kube import KubeServer

DS = "kai-fractions/kai-fractions-node-agent"
T0 = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)
T1 = T0 + datetime.timedelta(minutes=5)


# -- readiness: every case -------------------------------------------------------------------

@pytest.mark.parametrize(("rollout", "expected"), [
    (Rollout(desired=3, ready=3, updated=3),
     Readiness("True", "AllNodeAgentsReady", "3/3 node agents ready")),
    (Rollout(desired=1, ready=1, updated=1, generation=4, observed_generation=4),
     Readiness("True", "AllNodeAgentsReady", "1/1 node agents ready")),
    (Rollout(desired=3, ready=2, updated=3),
     Readiness("False", "NodeAgentsNotReady", "2/3 node agents ready")),
    (Rollout(desired=3, ready=0, updated=3),
     Readiness("False", "NodeAgentsNotReady", "0/3 node agents ready")),
    # a rolling update: every agent ready, but one still runs the old template
    (Rollout(desired=3, ready=3, updated=2),
     Readiness("False", "RolloutInProgress", "3/3 node agents ready, 2/3 updated")),
    (Rollout(desired=3, ready=1, updated=2),
     Readiness("False", "RolloutInProgress", "1/3 node agents ready, 2/3 updated")),
    # the controller has not looked at the new spec yet: its counts are about the old one
    (Rollout(desired=2, ready=2, updated=2, generation=5, observed_generation=4),
     Readiness("False", "RolloutInProgress", f"2/2 node agents ready; DaemonSet {DS} "
               "generation 5 not yet observed by its controller")),
    # no GPU node matches: nothing enforces fractions, so KAI must not place them
    (Rollout(desired=0, ready=0, updated=0),
     Readiness("False", "NoNodeAgents", f"0/0 node agents ready: no node matches the node "
               f"agent DaemonSet {DS}'s node selector and tolerations")),
    (None, Readiness("False", "NodeAgentDaemonSetMissing",
                     f"node agent DaemonSet {DS} not found")),
])
def test_readiness(rollout: Rollout | None, expected: Readiness):
    assert readiness(rollout, DS) == expected


def test_readiness_when_the_daemonset_cannot_be_read_is_unknown():
    assert readiness(None, DS, error="403 Forbidden") == Readiness(
        "Unknown", "NodeAgentStatusUnavailable",
        f"cannot read node agent DaemonSet {DS}: 403 Forbidden")


def test_rollout_from_a_daemonset_the_controller_has_not_written_yet():
    assert Rollout.from_object({"metadata": {"generation": 1}}) == Rollout(0, 0, 0, 1, None)
    assert Rollout.from_object({"metadata": {"generation": 2}, "status": {
        "desiredNumberScheduled": 3, "numberReady": 2, "updatedNumberScheduled": 1,
        "observedGeneration": 2}}) == Rollout(3, 2, 1, 2, 2)


# -- next_status: written only on change, transition time only on a status change ------------

READY = Readiness("True", "AllNodeAgentsReady", "3/3 node agents ready")
NOT_READY = Readiness("False", "NodeAgentsNotReady", "2/3 node agents ready")


def _ready_of(status: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == "Ready")


def test_first_status_is_written_with_the_generation():
    status = next_status(None, NOT_READY, 1, T0)
    assert status == {"observedGeneration": 1, "conditions": [{
        "type": "Ready", "status": "False", "reason": "NodeAgentsNotReady",
        "message": "2/3 node agents ready", "observedGeneration": 1,
        "lastTransitionTime": "2026-01-02T03:04:05Z"}]}


def test_nothing_to_write_when_the_object_already_says_it():
    current = next_status(None, READY, 1, T0)
    assert next_status(current, READY, 1, T1) is None


def test_a_new_message_keeps_the_transition_time():
    current = next_status(None, NOT_READY, 1, T0)
    fewer = Readiness("False", "NodeAgentsNotReady", "1/3 node agents ready")
    status = next_status(current, fewer, 1, T1)
    assert _ready_of(status)["message"] == "1/3 node agents ready"
    assert _ready_of(status)["lastTransitionTime"] == "2026-01-02T03:04:05Z"


def test_a_status_change_moves_the_transition_time():
    current = next_status(None, NOT_READY, 1, T0)
    status = next_status(current, READY, 1, T1)
    assert _ready_of(status)["status"] == "True"
    assert _ready_of(status)["lastTransitionTime"] == "2026-01-02T03:09:05Z"


def test_a_new_generation_is_written_even_when_the_condition_is_the_same():
    current = next_status(None, READY, 1, T0)
    status = next_status(current, READY, 2, T1)
    assert status["observedGeneration"] == 2
    assert _ready_of(status)["observedGeneration"] == 2
    assert _ready_of(status)["lastTransitionTime"] == "2026-01-02T03:04:05Z"


def test_other_conditions_are_kept():
    other = {"type": "DriverUpgradeInProgress", "status": "False", "reason": "None",
             "message": "", "lastTransitionTime": "2025-01-01T00:00:00Z"}
    status = next_status({"conditions": [other]}, READY, None, T0)
    assert status["conditions"][0] == other
    assert _ready_of(status)["status"] == "True"
    assert "observedGeneration" not in status  # unknown generation: not invented


# -- the loop against the API stand-in ---------------------------------------------------------

NS, NAME = "kai-fractions", "kai-fractions-node-agent"
DS_PATH = f"/apis/apps/v1/namespaces/{NS}/daemonsets/{NAME}"
GFC_STATUS_PATH = f"/apis/{kd.GROUP}/{kd.VERSION}/{kd.PLURAL}/{kd.NAME}/status"


def _register_gpu_fractioning_configs(kube: KubeServer) -> None:
    kube.emulator.resources[f"{kd.GROUP}/{kd.VERSION}/{kd.PLURAL}"] = kmock.ResourceInfo(
        namespaced=False, kind="GpuFractioningConfig", singular="gpufractioningconfig",
        verbs={"list", "watch", "get", "create", "patch", "delete"})


def _create_gpu_fractioning_config(kube: KubeServer) -> None:
    k8s.CustomObjectsApi(kube.api_client).create_cluster_custom_object(
        kd.GROUP, kd.VERSION, kd.PLURAL, {
            "apiVersion": f"{kd.GROUP}/{kd.VERSION}", "kind": "GpuFractioningConfig",
            # kmock does not stamp generations; a real API server starts at 1
            "metadata": {"name": kd.NAME, "generation": 1},
            "spec": {"nodeSelector": {"nvidia.com/gpu.present": "true"}}})


def _create_daemonset(kube: KubeServer) -> None:
    labels = {"app.kubernetes.io/component": "node-agent"}
    k8s.AppsV1Api(kube.api_client).create_namespaced_daemon_set(NS, {
        "apiVersion": "apps/v1", "kind": "DaemonSet",
        "metadata": {"name": NAME, "namespace": NS, "generation": 1},
        "spec": {"selector": {"matchLabels": labels}, "template": {
            "metadata": {"labels": labels},
            "spec": {"containers": [{"name": "node-agent", "image": "registry.invalid/kf:1"}]}}}},
        _preload_content=False)


def _set_daemonset_status(kube: KubeServer, desired: int, ready: int, updated: int) -> None:
    k8s.AppsV1Api(kube.api_client).patch_namespaced_daemon_set_status(NAME, NS, {"status": {
        "desiredNumberScheduled": desired, "numberReady": ready,
        "updatedNumberScheduled": updated, "currentNumberScheduled": desired,
        "numberMisscheduled": 0, "observedGeneration": 1}}, _preload_content=False)


def _ready(kube: KubeServer) -> dict[str, Any] | None:
    obj = k8s.CustomObjectsApi(kube.api_client).get_cluster_custom_object(
        kd.GROUP, kd.VERSION, kd.PLURAL, kd.NAME)
    conditions = (obj.get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == "Ready"), None)


def _wait_for(kube: KubeServer, status: str, message: str, timeout: float = 10) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        condition = _ready(kube)
        if condition and (condition["status"], condition["message"]) == (status, message):
            return condition
        assert time.monotonic() < deadline, f"Ready is {condition}, not {status} ({message})"
        time.sleep(0.02)


async def _await(kube: KubeServer, status: str, message: str, timeout: float = 10) -> dict:
    """_wait_for in a thread, so the loop's reporter runs meanwhile."""
    return await asyncio.to_thread(_wait_for, kube, status, message, timeout)


@pytest.fixture
def cluster(kube: KubeServer) -> KubeServer:
    _register_gpu_fractioning_configs(kube)
    _create_gpu_fractioning_config(kube)
    _create_daemonset(kube)
    return kube


@pytest.fixture
async def client(kube: KubeServer):
    """The reporter's way to the API stand-in, as the mirror reaches it."""
    client = Kube(k8s.ApiClient(kube.configuration()))
    yield client
    await client.close()


async def test_the_loop_writes_ready_false_then_true_as_the_agents_come_up(
        cluster: KubeServer, client: Kube):
    ticks = iter(range(1_000_000))  # a clock one second further on each round
    reporter = Reporter(client, NS, NAME, interval=0.02,
                        now=lambda: T0 + datetime.timedelta(seconds=next(ticks)))
    task = asyncio.create_task(reporter.run())
    try:
        # a DaemonSet its controller has not counted yet: no agent, not ready
        await _await(cluster, "False", f"0/0 node agents ready: no node matches the node "
                     f"agent DaemonSet {DS}'s node selector and tolerations")
        _set_daemonset_status(cluster, desired=3, ready=2, updated=3)
        not_ready = await _await(cluster, "False", "2/3 node agents ready")
        assert not_ready["reason"] == "NodeAgentsNotReady"
        assert not_ready["observedGeneration"] == 1
        _set_daemonset_status(cluster, desired=3, ready=3, updated=3)
        ready = await _await(cluster, "True", "3/3 node agents ready")
        assert ready["reason"] == "AllNodeAgentsReady"
        assert ready["lastTransitionTime"] != not_ready["lastTransitionTime"]
        # nothing changes any more: rounds go on, writes do not
        writes = cluster.count("PATCH", GFC_STATUS_PATH)
        rounds = cluster.count("GET", DS_PATH)
        while cluster.count("GET", DS_PATH) < rounds + 5:
            await asyncio.sleep(0.02)
        assert cluster.count("PATCH", GFC_STATUS_PATH) == writes
        _set_daemonset_status(cluster, desired=3, ready=1, updated=3)  # an agent crashed
        await _await(cluster, "False", "1/3 node agents ready")
        assert not task.done()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert task.cancelled()


async def test_one_round_writes_only_what_changed(cluster: KubeServer, client: Kube):
    _set_daemonset_status(cluster, desired=2, ready=2, updated=2)
    reporter = Reporter(client, NS, NAME, now=lambda: T0)
    assert await reporter.report_once() is True
    assert await reporter.report_once() is False
    assert cluster.count("PATCH", GFC_STATUS_PATH) == 1
    request = cluster.requests("PATCH", GFC_STATUS_PATH)[0]
    assert request.headers["Content-Type"] == "application/merge-patch+json"
    assert request.data["metadata"]["resourceVersion"]  # conditional on what was read
    assert _ready(cluster)["status"] == "True"


async def test_a_missing_daemonset_is_not_ready(cluster: KubeServer, client: Kube):
    k8s.AppsV1Api(cluster.api_client).delete_namespaced_daemon_set(NAME, NS,
                                                                   _preload_content=False)
    assert await Reporter(client, NS, NAME).report_once() is True
    assert _ready(cluster)["reason"] == "NodeAgentDaemonSetMissing"


async def test_read_errors_turn_unknown_only_when_they_persist(cluster: KubeServer,
                                                               client: Kube):
    _set_daemonset_status(cluster, desired=1, ready=1, updated=1)
    reporter = Reporter(client, NS, NAME, unknown_after=3, request_timeout=2)
    assert await reporter.report_once() is True
    cluster.fail("GET", DS_PATH, 500, times=None)
    assert await reporter.report_once() is False  # one failed read says nothing yet
    assert await reporter.report_once() is False
    assert _ready(cluster)["status"] == "True"
    assert await reporter.report_once() is True
    condition = _ready(cluster)
    assert (condition["status"], condition["reason"]) == ("Unknown", "NodeAgentStatusUnavailable")
    assert condition["message"].startswith(f"cannot read node agent DaemonSet {DS}: 500 ")
    cluster.emulator.clear_faults()
    assert await reporter.report_once() is True
    assert _ready(cluster)["status"] == "True"


async def test_a_missing_config_object_is_logged_not_raised(kube: KubeServer, client: Kube,
                                                            caplog: pytest.LogCaptureFixture):
    _register_gpu_fractioning_configs(kube)
    _create_daemonset(kube)
    assert await Reporter(client, NS, NAME).report_once() is False
    assert "GpuFractioningConfig default not found" in caplog.text


def test_interval_must_be_positive(kube: KubeServer):
    with pytest.raises(ValueError, match="interval must be positive"):
        Reporter(Kube(kube.api_client), NS, NAME, interval=0)


# -- the mirror process runs it ---------------------------------------------------------------

@pytest.mark.parametrize(("argv", "message"), [
    (["--node-agent-daemonset", "kai-fractions-node-agent"],
     "--node-agent-daemonset must be NAMESPACE/NAME, got 'kai-fractions-node-agent'"),
    (["--node-agent-daemonset", "kai-fractions/"],
     "--node-agent-daemonset must be NAMESPACE/NAME, got 'kai-fractions/'"),
    (["--report-interval", "0"], "--report-interval must be a positive, finite number of "
     "seconds, got 0.0"),
])
def test_reporter_flags_are_refused_with_a_reason(capsys, argv, message):
    assert main(["mirror", *argv]) == 2
    assert capsys.readouterr().err == f"kai-fractions mirror: {message}\n"


@pytest.mark.integration
def test_the_mirror_process_reports_with_the_flag(cluster: KubeServer, tmp_path):
    _set_daemonset_status(cluster, desired=2, ready=1, updated=2)
    kubeconfig = cluster.write_kubeconfig(tmp_path / "kubeconfig")
    socket_dir = tempfile.mkdtemp(prefix="kfm-")  # short: a socket path fits in 107 bytes
    process = subprocess.Popen(
        [sys.executable, "-c", "import sys; from kai_fractions.cli import main; "
         "sys.exit(main())", "mirror", "--listen", f"unix://{socket_dir}/mirror.sock",
         "--kubeconfig", str(kubeconfig), "--no-pod-cache", "--report-gpu-fractioning-config",
         f"--node-agent-daemonset={NS}/{NAME}", "--report-interval=0.05"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(cluster, "False", "1/2 node agents ready", timeout=60)
        _set_daemonset_status(cluster, desired=2, ready=2, updated=2)
        _wait_for(cluster, "True", "2/2 node agents ready", timeout=30)
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=20)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
        shutil.rmtree(socket_dir, ignore_errors=True)
    assert process.returncode == 0, err
    assert f"reporting node agent DaemonSet {NS}/{NAME}" in err
