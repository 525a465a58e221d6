"""`kai-fractions inspect` against kmock (the `kube` fixture) with hand-made pods, and against
a node agent reached through a NodeEnforcer unix socket or a Prometheus endpoint."""

from __future__ import annotations

import contextlib
import json
import re
import threading
from collections.abc import Iterator
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc
import pytest
from kubernetes import client as k8s

from kai_fractions.api.v1 import allocation_pb2, node_pb2, node_pb2_grpc
from kai_fractions.cli import main
from kai_fractions.inspect.model import GATE_ONLY
from tests.support.kube import KubeServer

from .pods import GPU0, GPU1, MIB, NODE, bind, gate_status, memory_pod, node

UID = "cccccccc-0000-4000-8000-000000000003"


def _create(kube: KubeServer, pod: dict) -> None:
    status = pod.pop("status", None)
    meta = pod["metadata"]
    kube.core.create_namespaced_pod(meta["namespace"], pod)
    if status:
        kube.core.patch_namespaced_pod_status(meta["name"], meta["namespace"],
                                              {"status": status})


@pytest.fixture
def cluster(kube: KubeServer, tmp_path: Path) -> Path:
    kube.core.create_node(node())
    kube.core.create_node(node(name="other-node"))
    _create(kube, gate_status(bind(memory_pod("notebook", UID, "8Gi", "16Gi"), (GPU0,)),
                              exit_code=0, message="limits applied"))
    _create(kube, gate_status(bind(memory_pod("elsewhere", UID, "4Gi"), (GPU0,),
                                   node="other-node"), exit_code=0))
    _create(kube, memory_pod("waiting", UID, "4Gi"))  # not bound: on no node
    return kube.write_kubeconfig(tmp_path / "kubeconfig")


def _inspect(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["inspect", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_node_as_json(cluster: Path, capsys) -> None:
    code, out, err = _inspect(capsys, "node", NODE, "--kubeconfig", str(cluster),
                              "--output", "json")
    assert (code, err) == (0, "")
    data = json.loads(out)
    [gpu] = data["gpus"]
    [row] = gpu["allocations"]
    assert (row["namespace"], row["pod"], row["container"], row["gpu_uuid"]) == (
        "team-a", "notebook", "main", GPU0)
    assert (row["request_bytes"], row["limit_bytes"], row["state"], row["reason"],
            row["message"], row["state_source"]) == (
        8192 * MIB, 16384 * MIB, "enforced", "", "limits applied", "gate")
    assert data["unplaced"] == []  # pods of other nodes and unbound pods are not this node's
    assert data["notes"] == ["used: n/a (agent not reachable: give --agent-socket PATH (on the "
                             "node) or --agent-metrics URL)", GATE_ONLY]


def test_pod_as_table(cluster: Path, capsys) -> None:
    code, out, _ = _inspect(capsys, "pod", "team-a/notebook", "--kubeconfig", str(cluster))
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == ("pod team-a/notebook  on node gpu-node-1  nvidia.com/gpu.memory=40960  "
                        "gpu-fractioning.nvidia.com/Ready=True")
    assert lines[1].startswith("note: used: n/a (agent not reachable: ")
    row = next(line for line in lines if "team-a/notebook/main" in line).split()
    assert row == ["team-a/notebook/main", "time-slicing", "8192", "MiB", "16384", "MiB", "-",
                   "n/a", "enforced", "(gate)", "n/a"]  # only the gate says so
    assert f"note: {GATE_ONLY}" in lines


def test_unbound_pod(cluster: Path, capsys) -> None:
    code, out, _ = _inspect(capsys, "pod", "team-a/waiting", "--kubeconfig", str(cluster),
                            "-o", "yaml")
    assert code == 0
    assert "state: unscheduled" in out and "reason: NotBound" in out


def test_missing_objects_exit_1(cluster: Path, capsys) -> None:
    assert _inspect(capsys, "node", "nope", "--kubeconfig", str(cluster)) == (
        1, "", "kai-fractions inspect: node nope: not found\n")
    assert _inspect(capsys, "pod", "team-a/nope", "--kubeconfig", str(cluster)) == (
        1, "", "kai-fractions inspect: pod team-a/nope: not found\n")


def _ago(seconds: float, micro: bool = False) -> str:
    import datetime

    then = datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=seconds)
    return then.strftime("%Y-%m-%dT%H:%M:%S.%fZ" if micro else "%Y-%m-%dT%H:%M:%SZ")


def test_the_agents_heartbeat_is_shown_and_a_silent_one_noted(kube: KubeServer, tmp_path: Path,
                                                               capsys) -> None:
    """What the follower's silent-node check reads: the agent's heartbeat Lease (chart) or its
    condition's lastHeartbeatTime, the later; a quiet agent gets a note before KAI's next bind
    sets the node Unknown."""
    cond = {"type": "gpu-fractioning.nvidia.com/Ready", "status": "True", "reason": "AgentReady",
            "message": "ok", "lastHeartbeatTime": _ago(290)}  # the 5-minute report
    kube.core.create_node(node(conditions=[cond]))
    config = kube.write_kubeconfig(tmp_path / "kubeconfig")
    leases = "/apis/coordination.k8s.io/v1/namespaces/kai-fractions/leases"
    lease = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
             "metadata": {"name": f"kai-fractions-agent.{NODE}", "namespace": "kai-fractions"},
             "spec": {"holderIdentity": NODE, "renewTime": _ago(20, micro=True)}}
    k8s.CoordinationV1Api(kube.api_client).create_namespaced_lease("kai-fractions", lease)
    code, out, _ = _inspect(capsys, "node", NODE, "--kubeconfig", str(config))
    assert code == 0
    heading = out.splitlines()[0]
    assert re.search(rf"agent alive (19|20|21) s ago \(lease kai-fractions/kai-fractions-agent"
                     rf"\.{NODE}\)$", heading), heading
    assert "note: the node agent last said" not in out
    # another namespace has no Lease: the condition's time, and the note
    code, out, _ = _inspect(capsys, "node", NODE, "--kubeconfig", str(config), "-n", "other",
                            "-o", "json")
    data = json.loads(out)
    assert data["heartbeat"]["from"] == "condition" and 285 <= data["heartbeat"][
        "seconds_ago"] <= 295
    assert data["notes"][0].startswith("the node agent last said it is alive 29")
    assert data["notes"][0].endswith("(condition): the mirror's follower sets "
                                     "gpu-fractioning.nvidia.com/Ready Unknown at KAI's next "
                                     "bind here (mirror.markSilentNodesAfterSeconds, 180 s by "
                                     "default)")
    # a user who may not read Leases: the condition's time, and why
    kube.fail("GET", f"{leases}/kai-fractions-agent.{NODE}", 403, times=None,
              message="leases is forbidden")
    code, out, _ = _inspect(capsys, "node", NODE, "--kubeconfig", str(config), "-o", "json")
    data = json.loads(out)
    assert code == 0 and data["heartbeat"]["from"] == "condition"
    assert any(n.startswith("heartbeat Lease not read (") and "leases is forbidden" in n
               for n in data["notes"]), data["notes"]


def test_usage_errors_exit_2(tmp_path: Path, capsys) -> None:
    code, _, err = _inspect(capsys, "node", NODE, "--kubeconfig", str(tmp_path / "missing"))
    assert code == 2
    assert err == f"kai-fractions inspect: --kubeconfig {tmp_path / 'missing'}: no such file\n"
    code, _, err = _inspect(capsys, "pod", "a/b/c", "--kubeconfig", str(tmp_path / "x"))
    assert (code, err) == (2, "kai-fractions inspect: pod: expected NAME or NS/NAME, got "
                           "'a/b/c'\n")


def test_api_not_reachable_exit_2(tmp_path: Path, capsys) -> None:
    with KubeServer() as gone:
        kubeconfig = gone.write_kubeconfig(tmp_path / "kubeconfig")
    code, out, err = _inspect(capsys, "node", NODE, "--kubeconfig", str(kubeconfig))
    assert (code, out) == (2, "")
    assert err.startswith(f"kai-fractions inspect: node {NODE}: the Kubernetes API is not "
                          "reachable: ")
    assert err.count("\n") == 1


# -- the agent ----------------------------------------------------------------------------------


class _Agent(node_pb2_grpc.NodeEnforcerServicer):
    uid = UID
    condition = node_pb2.NodeCondition(type="gpu-fractioning.nvidia.com/Ready", ready=True)

    def GetNodeState(self, request, context):
        return node_pb2.GetNodeStateResponse(
            node_name=NODE, driver_version="615.00.00", memory_limits_supported=True,
            devices=[node_pb2.Device(index=0, uuid=GPU0, name="NVIDIA A100-SXM4-40GB",
                                     memory_total_bytes=40960 * MIB, compute_mode="Default"),
                     node_pb2.Device(index=1, uuid=GPU1, name="NVIDIA A100-SXM4-40GB",
                                     memory_total_bytes=40960 * MIB, compute_mode="Default")],
            allocations=[node_pb2.ContainerAllocation(
                pod=allocation_pb2.PodRef(namespace="team-a", name="notebook", uid=self.uid),
                container="main", state=node_pb2.ALLOCATION_STATE_REFUSED,
                reason="MemoryOvercommitted", message="GPU full", memory_used_bytes=0)],
            condition=self.condition)


@pytest.fixture
def agent_socket(kube: KubeServer, cluster: Path, tmp_path: Path):
    path = tmp_path / "agent.sock"
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    agent = _Agent()
    agent.uid = kube.core.read_namespaced_pod("notebook", "team-a").metadata.uid
    node_pb2_grpc.add_NodeEnforcerServicer_to_server(agent, server)
    server.add_insecure_port(f"unix:{path}")
    server.start()
    yield path
    server.stop(0).wait()


def test_agent_socket(cluster: Path, agent_socket: Path, capsys) -> None:
    code, out, _ = _inspect(capsys, "node", NODE, "--kubeconfig", str(cluster),
                            "--agent-socket", str(agent_socket), "-o", "json")
    assert code == 0
    data = json.loads(out)
    assert data["agent"] == {"source": f"socket unix://{agent_socket}", "reachable": True,
                             "error": "", "driver_version": "615.00.00", "condition": {
                                 "type": "gpu-fractioning.nvidia.com/Ready", "status": "True",
                                 "reason": "", "message": ""}}
    assert [(g["index"], g["name"], len(g["allocations"])) for g in data["gpus"]] == [
        (0, "NVIDIA A100-SXM4-40GB", 1), (1, "NVIDIA A100-SXM4-40GB", 0)]
    row = data["gpus"][0]["allocations"][0]
    assert (row["state"], row["reason"], row["message"], row["used_bytes"]) == (
        "refused", "MemoryOvercommitted", "GPU full", None)
    assert data["notes"] == []


def test_agent_state_of_another_pod_with_that_name_is_not_used(
        cluster: Path, tmp_path: Path, capsys) -> None:
    path = tmp_path / "stale.sock"
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    node_pb2_grpc.add_NodeEnforcerServicer_to_server(_Agent(), server)  # UID: not the pod's
    server.add_insecure_port(f"unix:{path}")
    server.start()
    try:
        code, out, _ = _inspect(capsys, "node", NODE, "--kubeconfig", str(cluster),
                                "--agent-socket", str(path), "-o", "json")
    finally:
        server.stop(0).wait()
    row = json.loads(out)["gpus"][0]["allocations"][0]
    assert (code, row["state"], row["reason"], row["used_bytes"], row["state_source"]) == (
        0, "enforced", "", None, "gate")


def test_the_agents_own_condition_is_shown_beside_the_nodes_stale_copy(
        kube: KubeServer, cluster: Path, tmp_path: Path, capsys) -> None:
    """The agent cannot reach the API server: its socket says NotReconciling, the Node still
    says the True it last wrote. inspect, on the node to debug that, showed the True alone."""
    path = tmp_path / "cut-off.sock"
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    agent = _Agent()
    agent.uid = kube.core.read_namespaced_pod("notebook", "team-a").metadata.uid
    agent.condition = node_pb2.NodeCondition(
        type="gpu-fractioning.nvidia.com/Ready", ready=False, reason="NotReconciling",
        message="the Kubernetes API has been unreachable for 60s or more")
    node_pb2_grpc.add_NodeEnforcerServicer_to_server(agent, server)
    server.add_insecure_port(f"unix:{path}")
    server.start()
    try:
        code, out, _ = _inspect(capsys, "node", NODE, "--kubeconfig", str(cluster),
                                "--agent-socket", str(path))
        _, as_json, _ = _inspect(capsys, "node", NODE, "--kubeconfig", str(cluster),
                                 "--agent-socket", str(path), "-o", "json")
    finally:
        server.stop(0).wait()
    assert code == 0
    assert out.splitlines()[0].endswith("gpu-fractioning.nvidia.com/Ready=True")
    assert ("note: the node agent itself says now: gpu-fractioning.nvidia.com/Ready is False: "
            "NotReconciling: the Kubernetes API has been unreachable for 60s or more; the "
            "Node's copy, which KAI reads, is stale (gpu-fractioning.nvidia.com/Ready is True: "
            "Reconciling): ") in out
    data = json.loads(as_json)
    assert data["agent"]["condition"] == {
        "type": "gpu-fractioning.nvidia.com/Ready", "status": "False",
        "reason": "NotReconciling", "message": "the Kubernetes API has been unreachable for "
        "60s or more"}
    assert data["condition"]["status"] == "True"


def test_the_socket_of_another_nodes_agent_is_not_taken_for_this_nodes(
        cluster: Path, agent_socket: Path, capsys) -> None:
    """Run on one node (whose socket is found at the default path), `inspect node other` showed
    this node's GPUs and state under the other's name."""
    code, out, _ = _inspect(capsys, "node", "other-node", "--kubeconfig", str(cluster),
                            "--agent-socket", str(agent_socket), "-o", "json")
    data = json.loads(out)
    assert (code, data["agent"]["reachable"]) == (0, False)
    assert data["agent"]["error"] == (
        f"this socket is node {NODE}'s agent, not other-node's: run inspect on other-node, or "
        "give --agent-metrics")
    assert "A100" not in json.dumps(data["gpus"])  # none of the socket's GPUs


def test_agent_socket_missing(cluster: Path, tmp_path: Path, capsys) -> None:
    code, out, _ = _inspect(capsys, "node", NODE, "--kubeconfig", str(cluster),
                            "--agent-socket", str(tmp_path / "none.sock"))
    assert code == 0
    assert (f"note: used: n/a (agent not reachable: no socket at {tmp_path / 'none.sock'} (run "
            "inspect on the node, or give --agent-metrics))") in out.splitlines()


METRICS = f"""\
# HELP kai_fractions_container_gpu_memory_used_bytes GPU memory used by the container's processes on the GPU.
# TYPE kai_fractions_container_gpu_memory_used_bytes gauge
kai_fractions_container_gpu_memory_used_bytes{{container="main",gpu="0",gpu_uuid="{GPU0}",namespace="team-a",node="n",pod="notebook",pod_uuid="u1"}} 4.294967296e+09
kai_fractions_container_gpu_memory_used_bytes{{container="x",gpu="1",gpu_uuid="{GPU1}",namespace="team-a",node="n",pod="other",pod_uuid="u2"}} 1.0
# HELP kai_fractions_node_ready 1 when the agent reports the node ready for fractional pods.
# TYPE kai_fractions_node_ready gauge
kai_fractions_node_ready{{node="{NODE}",reason="Reconciling"}} 1.0
"""  # noqa: E501


CAP_NOT_IN_FORCE = """\
# HELP kai_fractions_container_cap_not_in_force 1 for each container an MPS cap it relies on is known not to be in force for.
# TYPE kai_fractions_container_cap_not_in_force gauge
kai_fractions_container_cap_not_in_force{{container="main",namespace="team-a",node="n",pod="notebook",pod_uuid="{uid}",reason="MpsPinnedLimitLost"}} 1.0
"""  # noqa: E501


@contextlib.contextmanager
def serving(text: str) -> Iterator[str]:
    """HOST:PORT of a Prometheus endpoint serving `text` at /metrics."""
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = text.encode() if self.path == "/metrics" else b"nope"
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def metrics_url():
    with serving(METRICS) as url:
        yield url


def test_agent_metrics(cluster: Path, metrics_url: str, capsys) -> None:
    code, out, _ = _inspect(capsys, "node", NODE, "--kubeconfig", str(cluster),
                            "--agent-metrics", metrics_url, "-o", "json")
    assert code == 0
    data = json.loads(out)
    assert data["agent"]["source"] == f"metrics http://{metrics_url}/metrics"
    row = data["gpus"][0]["allocations"][0]
    assert (row["used_bytes"], row["state"]) == (4096 * MIB, "enforced")


def test_agent_metrics_say_an_mps_cap_is_not_in_force(cluster: Path, kube: KubeServer,
                                                      capsys) -> None:
    """Off the node (no socket), the gate's exit 0 of long ago is not taken for enforced while
    the agent's metrics say an MPS cap of the container is not in force now; a pod of the same
    name but another uid (recreated) is not that container."""
    uid = kube.core.read_namespaced_pod("notebook", "team-a").metadata.uid
    for pod_uuid, state, reason in ((uid, "pending", "MpsPinnedLimitLost"),
                                    ("dddddddd-0000-4000-8000-000000000004", "enforced",
                                     "")):
        with serving(METRICS + CAP_NOT_IN_FORCE.format(uid=pod_uuid)) as url:
            code, out, _ = _inspect(capsys, "pod", "team-a/notebook", "--kubeconfig",
                                    str(cluster), "--agent-metrics", url, "-o", "json")
            assert code == 0
            row = json.loads(out)["gpus"][0]["allocations"][0]
            assert (row["state"], row["reason"]) == (state, reason)
            if state == "enforced":
                continue
            assert (row["used_bytes"], row["tier"]) == (4096 * MIB, "-")
            assert row["message"].startswith(
                "the node agent's metrics say an MPS cap this container relies on is not in "
                "force: its readiness marker is set aside")
            code, out, _ = _inspect(capsys, "pod", "team-a/notebook", "--kubeconfig",
                                    str(cluster), "--agent-metrics", url)
            assert "pending (MpsPinnedLimitLost)" in out and "enforced" not in out


def test_agent_metrics_not_reachable(cluster: Path, capsys) -> None:
    code, out, _ = _inspect(capsys, "node", NODE, "--kubeconfig", str(cluster),
                            "--agent-metrics", "http://127.0.0.1:9/metrics")
    assert code == 0
    note = next(line for line in out.splitlines() if line.startswith("note: used: n/a"))
    assert note.startswith("note: used: n/a (agent not reachable: URLError: ")


def test_agent_socket_and_metrics_together(cluster: Path, agent_socket: Path,
                                           metrics_url: str, capsys) -> None:
    code, out, _ = _inspect(capsys, "node", NODE, "--kubeconfig", str(cluster),
                            "--agent-socket", str(agent_socket), "--agent-metrics",
                            metrics_url, "-o", "json")
    assert code == 0
    data = json.loads(out)
    assert data["agent"]["source"] == (f"socket unix://{agent_socket} + metrics "
                                       f"http://{metrics_url}/metrics")
    row = data["gpus"][0]["allocations"][0]
    assert (row["state"], row["used_bytes"]) == ("refused", 4096 * MIB)  # usage per GPU


def test_the_help_names_every_state(capsys) -> None:
    from kai_fractions.inspect import model

    with pytest.raises(SystemExit):
        main(["inspect", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for state in (model.ENFORCED, model.REFUSED, model.PENDING, model.WAITING,
                  model.UNSCHEDULED, model.UNGATED, model.INVALID):
        assert re.search(rf"\b{state}\b", text), state
    # The plan and the state need the socket (the metrics give used memory, and a container
    # whose MPS cap is not in force).
    assert "or, with --agent-socket, from the node agent's plan" in text
    assert "The state comes from the node agent's socket (--agent-socket" in text
    for said in ("n/a without --agent-socket", "OverLimit", "PlanChangeRefused"):
        assert said in text, said
