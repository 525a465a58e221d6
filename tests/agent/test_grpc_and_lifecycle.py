"""The running agent in-process (threads, real gRPC on a unix socket, real HTTP metrics) over
the in-memory fakes: socket permissions, NodeEnforcer calls, metrics scrapes, shutdown."""

from __future__ import annotations

import os
import socket
import stat
import time
import urllib.request
from concurrent.futures import Future
from datetime import UTC, datetime
from pathlib import Path

import grpc
import pytest

from kai_fractions.api.v1 import allocation_pb2, node_pb2, node_pb2_grpc
from kai_fractions.node.agent.worker import WorkerStopped

from .builders import GIB, Rig, binder_annotations, leaf_of, pod, wait_for

pytestmark = pytest.mark.integration

DIRECT_UID = "0a1b2c3d-0000-4000-8000-000000000777"
ELSEWHERE = "GPU-deadbeef-0000-0000-0000-000000000000"


def stub(rig: Rig) -> node_pb2_grpc.NodeEnforcerStub:
    return node_pb2_grpc.NodeEnforcerStub(grpc.insecure_channel(f"unix:{rig.options.socket}"))


def scrape(rig: Rig) -> str:
    host, port = rig.agent.metrics_address or ("", 0)
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def applied(rig: Rig, uid: str) -> bool:
    result = rig.reconciler.view.results.get((uid, "main"))
    return result is not None and result.state.value == "applied" and \
        rig.marker_path(uid).exists()


def test_socket_is_root_only(running: Rig) -> None:
    path = running.options.socket
    assert path is not None
    st = os.stat(path)
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_uid == os.geteuid()
    if os.geteuid() != 0:
        return  # only root can switch to another user to try
    pid = os.fork()
    if pid == 0:  # the child: become nobody and try to connect
        code = 2
        try:
            os.setgid(65534)
            os.setuid(65534)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(path)
            code = 1  # connected: the permissions failed
        except PermissionError:
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "uid 65534 could connect to the socket"
    # root can
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(path)


def test_get_node_state_reports_devices_allocations_and_condition(running: Rig) -> None:
    rig = running
    uid = rig.add(pod(notes=binder_annotations(devices=rig.gpu0, mode="sm-sharing")))[
        "metadata"]["uid"]
    bad = rig.add(pod("bad", notes=binder_annotations(devices=ELSEWHERE)))["metadata"]["uid"]
    wait_for(lambda: applied(rig, uid), what="applied")
    wait_for(lambda: (c := rig.agent.condition()) is not None and c.ready, what="ready")

    def both() -> node_pb2.GetNodeStateResponse | None:
        """Once the pass that saw both pods is the one GetNodeState reads."""
        state = stub(rig).GetNodeState(node_pb2.GetNodeStateRequest(), timeout=5)
        return state if {a.pod.uid for a in state.allocations} >= {uid, bad} else None

    state = wait_for(both, what="both pods in GetNodeState")
    assert state.node_name == "node-a" and state.driver_version == "615.00.00"
    assert state.memory_limits_supported
    assert [(d.index, d.uuid, d.name, d.memory_total_bytes, d.compute_mode)
            for d in state.devices] == [
        (0, rig.gpu0, "NVIDIA H100 80GB HBM3", 81559 << 20, "ExclusiveProcess"),
        (1, rig.gpu1, "NVIDIA H100 80GB HBM3", 81559 << 20, "Default")]
    by_uid = {a.pod.uid: a for a in state.allocations}
    ok = by_uid[uid]
    assert (ok.pod.namespace, ok.pod.name, ok.container) == ("default", "p", "main")
    assert ok.state == node_pb2.ALLOCATION_STATE_APPLIED
    assert ok.compute_sharing_mode == allocation_pb2.COMPUTE_SHARING_MODE_SM_SHARING
    assert (ok.memory_request_bytes, ok.memory_limit_bytes) == (10 * GIB, 20 * GIB)
    assert ok.active_thread_percentage == 50 and ok.mps_namespace.startswith("kf_")
    assert list(ok.devices) == [rig.gpu0] and ok.plan_digest.startswith("sha256:")
    assert sorted((a.mechanism, a.soft_limit_bytes, a.hard_limit_bytes)
                  for a in ok.applied_limits) == [
        ("cgroup", 10 * GIB, 20 * GIB), ("cgroup", 10 * GIB, 20 * GIB),
        ("mps-pinned", 0, 20 * GIB)]  # the watchdog reports (default policy): it is no limit
    refused = by_uid[bad]
    assert (refused.state, refused.reason) == (node_pb2.ALLOCATION_STATE_REFUSED,
                                               "DeviceNotOnNode")
    assert refused.message.startswith(f"GPU {ELSEWHERE} assigned to this container is not on node")
    assert state.condition.type == "gpu-fractioning.nvidia.com/Ready"
    assert state.condition.ready and state.condition.reason == "AgentReady"


def test_provision_release_and_drain_through_the_socket(running: Rig) -> None:
    rig = running
    s = stub(rig)
    request = node_pb2.ProvisionRequest(
        pod=allocation_pb2.PodRef(namespace="jobs", name="direct", uid=DIRECT_UID),
        annotations=binder_annotations(devices=rig.gpu1, mode="sm-sharing"),
        containers=["main"])
    response = s.Provision(request, timeout=10)
    (alloc,) = response.allocations
    assert (alloc.pod.uid, alloc.container, alloc.state) == (
        DIRECT_UID, "main", node_pb2.ALLOCATION_STATE_APPLIED)
    assert rig.marker_path(DIRECT_UID).exists()
    assert s.Provision(request, timeout=10).allocations[0].state == \
        node_pb2.ALLOCATION_STATE_APPLIED  # idempotent
    assert len(rig.mps.control.namespaces) == 1

    drained = s.Drain(node_pb2.DrainRequest(pod=allocation_pb2.PodRef(uid=DIRECT_UID)),
                      timeout=10)
    assert list(drained.drained_pids) == []  # no process runs

    released = s.Release(node_pb2.ReleaseRequest(
        pod=allocation_pb2.PodRef(namespace="jobs", name="direct")), timeout=10)
    assert list(released.released_containers) == ["main"]
    assert rig.mps.control.namespaces == {}
    assert not rig.marker_path(DIRECT_UID).parent.exists()
    state = s.GetNodeState(node_pb2.GetNodeStateRequest(), timeout=5)
    assert [a.pod.uid for a in state.allocations] == []


def test_a_deleted_sm_sharing_pod_is_drained_before_its_grace_period_ends(
        running: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/node-agent.md, "Stopping an sm-sharing pod": the watch shows the pod's
    deletionTimestamp; its MPS client is drained 3 s (the default margin) before it, not at
    once, and the process is left to the kubelet."""
    rig = running
    uid = rig.add(pod(notes=binder_annotations(devices=rig.gpu0, mode="sm-sharing")))[
        "metadata"]["uid"]
    wait_for(lambda: applied(rig, uid), what="applied")
    (namespace,) = rig.mps.control.namespaces
    rig.proc_entry(4242, leaf_of(uid)[len("/sys/fs/cgroup"):])
    rig.nvml.add_process(4242, rig.gpu0, GIB)
    rig.mps.control.attach_client(4242, namespace)
    drained_at = []
    terminate = rig.mps.control.client_terminate
    monkeypatch.setattr(rig.mps.control, "client_terminate",
                        lambda pid: (drained_at.append(time.time()), terminate(pid))[1])

    deadline = int(time.time()) + 5  # the API server writes whole seconds
    meta = rig.cluster.pods[uid]["metadata"]
    rig.cluster.update_pod(uid, metadata={
        **meta, "deletionGracePeriodSeconds": 5,
        "deletionTimestamp": datetime.fromtimestamp(deadline, UTC).strftime(
            "%Y-%m-%dT%H:%M:%SZ")})
    wait_for(lambda: rig.mps.control.terminated == [4242], timeout=10, what="the drain")
    (when,) = drained_at
    assert deadline - 3 - 0.5 <= when < deadline  # not at SIGTERM, before the SIGKILL
    assert rig.killer.calls == []  # the process itself is the kubelet's to stop
    reg = rig.agent.metrics.registry
    assert [reg.get_sample_value("kai_fractions_agent_mps_drains_total", {"result": r})
            for r in ("drained", "nothing", "failed")] == [1, 0, 0]
    assert 'kai_fractions_agent_mps_drains_total{result="drained"} 1.0' in scrape(rig)
    assert rig.cluster.event_reasons(uid) == ["Applied", "MpsClientsDrained"]
    assert rig.cluster.events[-1]["type"] == "Normal"
    assert rig.cluster.events[-1]["message"].endswith("pids 4242")

    drains = rig.agent.worker.drains
    assert drains is not None and uid in drains.done
    rig.cluster.delete_pod(uid)
    wait_for(lambda: uid not in drains.done, what="the pod forgotten")
    assert rig.mps.control.terminated == [4242]  # drained once


def test_bad_calls_get_a_status_not_a_trace(running: Rig) -> None:
    s = stub(running)
    with pytest.raises(grpc.RpcError) as e:
        s.Provision(node_pb2.ProvisionRequest(pod=allocation_pb2.PodRef(name="x")), timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == ("Provision needs pod.uid, pod.namespace, containers (the uid "
                                 "names the pod's cgroup and MPS namespace)")
    with pytest.raises(grpc.RpcError) as e:
        s.Release(node_pb2.ReleaseRequest(pod=allocation_pb2.PodRef(namespace="a", name="b")),
                  timeout=5)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    # A uid names a directory and a cgroup: one that is not a pod UID changes nothing (it used
    # to be provisioned, and then every pass failed on its marker, the good pods' too).
    for call, request in (
            (s.Provision, node_pb2.ProvisionRequest(
                pod=allocation_pb2.PodRef(namespace="a", name="b", uid="../x"),
                annotations=binder_annotations(devices=running.gpu0), containers=["main"])),
            (s.Release, node_pb2.ReleaseRequest(pod=allocation_pb2.PodRef(uid="../x"))),
            (s.Drain, node_pb2.DrainRequest(pod=allocation_pb2.PodRef(uid="../x")))):
        with pytest.raises(grpc.RpcError) as e:
            call(request, timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details() == (
            "pod.uid: must be the pod's metadata.uid, a lower-case UUID (8-4-4-4-12 hexadecimal "
            "digits, as the API server writes it), "
            "got '../x': it names the pod's cgroup and marker directory")
    assert running.reconciler.pods.provisioned == {}


def test_metrics_scrape_and_series_of_a_deleted_pod_disappear(running: Rig) -> None:
    rig = running
    uid = rig.add(pod(notes=binder_annotations(devices=rig.gpu0, mode="sm-sharing")))[
        "metadata"]["uid"]
    wait_for(lambda: applied(rig, uid), what="applied")
    series = (f'{{container="main",gpu="0",gpu_uuid="{rig.gpu0}",namespace="default",'
              f'node="node-a",pod="p",pod_uuid="{uid}"}}')
    pod_series = f'{{gpu="0",gpu_uuid="{rig.gpu0}",namespace="default",pod="p",pod_uuid="{uid}"}}'
    text = wait_for(lambda: (t := scrape(rig)) and
                    f"kai_fractions_container_gpu_memory_limit_bytes{series}" in t and t,
                    what="series")
    assert f"kai_fractions_container_gpu_memory_used_bytes{series} 0.0" in text
    assert f"gpu_fractioning_gpu_sm_utilization_percent_normalized{pod_series} 0.0" in text
    assert 'kai_fractions_containers{node="node-a",state="applied"} 1.0' in text
    assert "kai_fractions_mps_daemon_restarts_total 0.0" in text
    rig.cluster.delete_pod(uid)
    wait_for(lambda: 'pod="p"' not in scrape(rig), what="series removed")


def test_shutdown_stops_only_a_daemon_it_started_and_removes_the_socket(
        short_tmp: Path) -> None:
    adopted = Rig(short_tmp, options={"socket": str(short_tmp / "a.sock")})
    adopted.agent.start()
    wait_for(lambda: adopted.reconciler.passes > 0, what="a pass")
    adopted.agent.stop(timeout=5)
    assert not adopted.mps.stopped  # it was running before: not ours
    assert not (short_tmp / "a.sock").exists()

    started = Rig(short_tmp, options={"socket": str(short_tmp / "b.sock")})
    started.mps.control.kill()  # no daemon: the agent starts one
    started.agent.start()
    wait_for(lambda: started.reconciler.passes > 0, what="a pass")
    started.agent.stop(timeout=5)
    assert started.mps.stopped
    cond = started.cluster.condition("node-a", "gpu-fractioning.nvidia.com/Ready")
    assert cond is not None and (cond["status"], cond["reason"]) == ("False", "NotReconciling")


def test_a_socket_path_taken_by_a_file_is_refused(short_tmp: Path) -> None:
    (short_tmp / "agent.sock").write_text("not a socket")
    rig = Rig(short_tmp, options={"socket": str(short_tmp / "agent.sock")})
    from kai_fractions.node.agent.grpc_service import SocketError

    with pytest.raises(SocketError, match="exists and is not a socket; remove it"):
        rig.agent.start()
    rig.agent.stop(timeout=2)


def test_a_stopping_worker_fails_every_queued_call_even_behind_a_cancelled_one(
        short_tmp: Path) -> None:
    """A call whose caller stopped waiting (its timeout) is cancelled; at shutdown it must not
    keep the calls queued behind it from being told the agent is stopping."""
    worker = Rig(short_tmp, sm_sharing=False).agent.worker
    gave_up, waiting = Future(), Future()
    gave_up.cancel()
    worker._calls.extend([(lambda: 1, gave_up), (lambda: 2, waiting)])
    worker._stopping = True
    worker.run()
    assert isinstance(waiting.exception(timeout=1), WorkerStopped)
