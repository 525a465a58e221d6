"""A node whose agent went silent is set Unknown for KAI (`NodeLiveness`), through the real
client against kmock: a stale True condition becomes Unknown (reason NodeAgentSilent, the old
heartbeat kept), a fresh one, a False one and other conditions are left alone, a heartbeat that
lands in between wins (the node's resourceVersion guards the write), and a node is read at most
once per recheck period."""

from __future__ import annotations

import asyncio
import datetime

import pytest
from kubernetes import client as k8s

from kai_fractions.contract import keys as k
from kai_fractions.kube.client import Kube
from kai_fractions.kube.errors import KubeError
from kai_fractions.mirror.node_liveness import SILENT_REASON, NodeLiveness, silent_conditions
from tests.support.aio import until
from tests.support.kube import KubeServer

NOW = datetime.datetime(2026, 12, 2, 12, 0, tzinfo=datetime.UTC)
TYPES = (k.NODE_CONDITION, k.LEGACY_NODE_CONDITION)


def stamp(seconds_ago: float) -> str:
    return (NOW - datetime.timedelta(seconds=seconds_ago)).strftime("%Y-%m-%dT%H:%M:%SZ")


def condition(kind: str, status: str, heartbeat_ago: float | None) -> dict:
    c = {"type": kind, "status": status, "reason": "AgentReady", "message": "ready",
         "lastTransitionTime": stamp(3600)}
    if heartbeat_ago is not None:
        c["lastHeartbeatTime"] = stamp(heartbeat_ago)
    return c


def node(name: str, *conditions: dict) -> dict:
    return {"metadata": {"name": name}, "status": {"conditions": [
        {"type": "Ready", "status": "True", "reason": "KubeletReady",
         "lastHeartbeatTime": stamp(5)}, *conditions]}}


def test_only_our_true_conditions_past_their_heartbeat_are_silent():
    n = node("n", condition(k.NODE_CONDITION, "True", 400),
             condition(k.LEGACY_NODE_CONDITION, "True", 30))
    [silent] = silent_conditions(n, TYPES, NOW.timestamp(), 180)
    assert silent == {
        "type": k.NODE_CONDITION, "status": "Unknown", "reason": SILENT_REASON,
        "message": f"the kai-fractions node agent has not reported since {stamp(400)} (400 s): "
                   "KAI places no fractional pod here until it reports again",
        "lastHeartbeatTime": stamp(400), "lastTransitionTime": stamp(0)}
    assert silent_conditions(node("n", condition(k.NODE_CONDITION, "False", 400)), TYPES,
                             NOW.timestamp(), 180) == []
    no_time = silent_conditions(node("n", condition(k.NODE_CONDITION, "True", None)), TYPES,
                                NOW.timestamp(), 180)
    assert "with no heartbeat time" in no_time[0]["message"]
    # the kubelet's own Ready, however old, is not ours to judge
    assert silent_conditions(node("n"), TYPES, NOW.timestamp() + 10**6, 180) == []


@pytest.fixture
async def client(kube: KubeServer):
    client = Kube(k8s.ApiClient(kube.configuration()))
    yield client
    await client.close()


def liveness(client: Kube, marked: list[str], monotonic=lambda: 0.0) -> NodeLiveness:
    return NodeLiveness(client, TYPES, stale_after_seconds=180, recheck_seconds=60,
                        on_marked=marked.append, clock=NOW.timestamp, monotonic=monotonic)


def conditions_of(kube: KubeServer, name: str) -> dict[str, dict]:
    obj = kube.core.read_node(name).to_dict()
    return {c["type"]: c for c in obj["status"]["conditions"]}


async def test_a_silent_node_is_set_unknown_and_a_live_one_is_left_alone(kube, client):
    kube.core.create_node(node("silent", condition(k.NODE_CONDITION, "True", 400)))
    kube.core.create_node(node("live", condition(k.NODE_CONDITION, "True", 30)))
    marked: list[str] = []
    watcher = liveness(client, marked)
    assert await watcher.check("silent") is True
    assert await watcher.check("live") is False
    assert await watcher.check("no-such-node") is False
    assert marked == ["silent"]
    [patch] = kube.requests("PATCH", "/api/v1/nodes/silent/status")
    assert patch.headers["Content-Type"] == "application/strategic-merge-patch+json"
    body = patch.data
    assert body["metadata"]["resourceVersion"]  # guarded
    assert [(c["type"], c["status"], c["reason"]) for c in body["status"]["conditions"]] == [
        (k.NODE_CONDITION, "Unknown", SILENT_REASON)]
    ours = conditions_of(kube, "silent")[k.NODE_CONDITION]
    assert (ours["status"], ours["reason"]) == ("Unknown", SILENT_REASON)
    assert kube.count("PATCH", "/api/v1/nodes/live/status") == 0


async def test_a_heartbeat_that_lands_in_between_wins(kube, client):
    kube.core.create_node(node("n", condition(k.NODE_CONDITION, "True", 400)))
    watcher = liveness(client, [])
    original = client.request

    async def heartbeat_after_the_read(method, path, **kw):
        answer = await original(method, path, **kw)
        if method == "GET":  # the agent renews its condition right after our read
            kube.core.patch_node_status("n", {"status": {"conditions": [
                condition(k.NODE_CONDITION, "True", 0)]}})
        return answer

    client.request = heartbeat_after_the_read  # type: ignore[method-assign]
    assert await watcher.check("n") is False  # 409: the newer node wins
    assert conditions_of(kube, "n")[k.NODE_CONDITION]["status"] == "True"


async def test_a_node_is_read_at_most_once_per_recheck_period(kube, client):
    kube.core.create_node(node("n", condition(k.NODE_CONDITION, "True", 30)))
    now = [0.0]
    watcher = liveness(client, [], monotonic=lambda: now[0])
    for _ in range(5):
        watcher.saw("n")
    await until(lambda: kube.count("GET", "/api/v1/nodes/n") == 1)
    await asyncio.sleep(0.2)
    assert kube.count("GET", "/api/v1/nodes/n") == 1
    now[0] = 61.0
    watcher.saw("n")
    watcher.saw("")  # a bind with no node yet
    await until(lambda: kube.count("GET", "/api/v1/nodes/n") == 2)
    await watcher.close()


async def test_a_wave_over_many_nodes_reads_them_a_few_at_a_time(kube, client):
    from kai_fractions.mirror.node_liveness import READS_AT_ONCE

    watcher = liveness(client, [])
    reading, most, done = 0, 0, []

    async def slow_read(method, path, **kw):
        nonlocal reading, most
        reading += 1
        most = max(most, reading)
        await asyncio.sleep(0.01)
        reading -= 1
        done.append(path)
        return {"metadata": {"name": path}, "status": {}}

    client.request = slow_read  # type: ignore[method-assign]
    for i in range(20):
        watcher.saw(f"node-{i}")
    await until(lambda: len(done) == 20)
    assert most == READS_AT_ONCE
    await watcher.close()


# -- the agents' heartbeat Leases (node/agent/heartbeat.py) ---------------------------------

LEASES = "/apis/coordination.k8s.io/v1/namespaces/kf/leases"


def micro(seconds_ago: float) -> str:
    return (NOW - datetime.timedelta(seconds=seconds_ago)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


async def lease(client: Kube, node: str, renewed_ago: float) -> None:
    await client.request("POST", LEASES, what="create it", body={
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": f"kai-fractions-agent.{node}", "namespace": "kf"},
        "spec": {"holderIdentity": node, "renewTime": micro(renewed_ago)}})


def leased(client: Kube, marked: list[str]) -> NodeLiveness:
    return NodeLiveness(client, TYPES, stale_after_seconds=180, lease_namespace="kf",
                        on_marked=marked.append, clock=NOW.timestamp)


def test_a_renewed_lease_is_a_heartbeat_of_its_own():
    n = node("n", condition(k.NODE_CONDITION, "True", 290))  # the last 5-minute report
    assert silent_conditions(n, TYPES, NOW.timestamp(), 180,
                             alive_at=NOW.timestamp() - 60) == []
    [silent] = silent_conditions(n, TYPES, NOW.timestamp(), 180,
                                 alive_at=NOW.timestamp() - 200)
    assert silent["message"].startswith(
        f"the kai-fractions node agent has not reported since {stamp(200)} (200 s): ")
    assert silent["lastHeartbeatTime"] == stamp(290)  # the condition's own, kept


async def test_a_node_whose_agent_renews_its_lease_is_left_alone(kube, client):
    kube.core.create_node(node("leased", condition(k.NODE_CONDITION, "True", 290)))
    kube.core.create_node(node("lapsed", condition(k.NODE_CONDITION, "True", 290)))
    kube.core.create_node(node("fresh", condition(k.NODE_CONDITION, "True", 30)))
    kube.core.create_node(node("old-agent", condition(k.NODE_CONDITION, "True", 290)))
    await lease(client, "leased", 40)
    await lease(client, "lapsed", 250)
    marked: list[str] = []
    watcher = leased(client, marked)
    assert await watcher.check("leased") is False
    assert await watcher.check("lapsed") is True
    assert await watcher.check("fresh") is False
    assert await watcher.check("old-agent") is True  # no Lease: its condition's heartbeat
    assert marked == ["lapsed", "old-agent"]
    assert kube.count("GET", f"{LEASES}/kai-fractions-agent.fresh") == 0  # not needed


async def test_a_lease_that_cannot_be_read_marks_nothing(kube, client):
    kube.core.create_node(node("n", condition(k.NODE_CONDITION, "True", 290)))
    kube.fail("GET", f"{LEASES}/kai-fractions-agent.n", 403, message="leases is forbidden")
    marked: list[str] = []
    with pytest.raises(KubeError, match="leases is forbidden"):
        await leased(client, marked).check("n")
    assert marked == [] and kube.count("PATCH", "/api/v1/nodes/n/status") == 0


async def test_failures_are_logged_and_counted_never_raised(kube, client, caplog):
    from kai_fractions.mirror.metrics import MirrorMetrics

    kube.fail("GET", "/api/v1/nodes/n", 403, times=None, message="nodes is forbidden")
    metrics = MirrorMetrics()
    watcher = NodeLiveness(client, TYPES, stale_after_seconds=180, clock=NOW.timestamp,
                           on_failed=metrics.node_check_failed)
    watcher.saw("n")
    await until(lambda: "node n: its readiness not checked" in caplog.text)
    assert "nodes is forbidden" in caplog.text
    assert metrics.registry.get_sample_value(
        "kai_fractions_follower_node_checks_failed_total") == 1
    await watcher.close()


@pytest.mark.integration
@pytest.mark.parametrize("leased", [False, True], ids=["condition", "lease"])
def test_the_mirror_process_sets_a_silent_node_unknown_as_kai_binds_there(kube, tmp_path,
                                                                          leased):
    """`kai-fractions mirror --follow-bindrequests --mark-silent-nodes-after 120`: a bind to a
    node whose agent went silent sets its condition Unknown, counted in the metrics; with
    `--heartbeat-lease-namespace`, an agent that renews its Lease is alive however old its
    condition's heartbeat (the chart's agents write their Node every 5 min)."""
    from tests.support.agent_process import free_port
    from tests.support.mirror_kube import BINDREQUESTS, register_bindrequests, run_mirror_process
    from tests.support.promql import sample_value

    # the process's clock is the real one: an hour before now is long silent
    now = datetime.datetime.now(datetime.UTC)
    hour_ago = (now - datetime.timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
    kube.core.create_node({"metadata": {"name": "gpu-node-1"}})
    kube.core.patch_node_status("gpu-node-1", {"status": {"conditions": [
        {**condition(k.NODE_CONDITION, "True", None), "lastHeartbeatTime": hour_ago}]}})
    lease = "/apis/coordination.k8s.io/v1/namespaces/kf/leases/kai-fractions-agent.gpu-node-1"
    if leased:
        k8s.CoordinationV1Api(kube.api_client).create_namespaced_lease("kf", {
            "metadata": {"name": "kai-fractions-agent.gpu-node-1", "namespace": "kf"},
            "spec": {"holderIdentity": "gpu-node-1",
                     "renewTime": now.strftime("%Y-%m-%dT%H:%M:%S.%fZ")}})
    register_bindrequests(kube)
    k8s.CustomObjectsApi(kube.api_client).create_namespaced_custom_object(
        BINDREQUESTS.group, BINDREQUESTS.version, "team-a", BINDREQUESTS.plural, {
            "apiVersion": "scheduling.run.ai/v1alpha2", "kind": "BindRequest",
            "metadata": {"name": "br-0", "namespace": "team-a"},
            "spec": {"podName": "train-0", "selectedNode": "gpu-node-1",
                     "receivedResourceType": "Fraction",
                     "receivedGPU": {"count": 1, "portion": "0.5"},
                     "selectedFractionalGpuGroups": [{"id": "group-a"}]},
            "status": {"phase": "Pending"}})
    port = free_port()
    run = run_mirror_process(
        kube, tmp_path, "--follow-bindrequests", "--mark-silent-nodes-after", "120",
        "--heartbeat-lease-namespace", "kf",
        "--metrics-listen", f"127.0.0.1:{port}", metrics_url=f"http://127.0.0.1:{port}/metrics",
        metrics_ready=lambda text: kube.count("GET", lease) == 1 if leased else sample_value(
            text, "kai_fractions_follower_silent_nodes_total") == 1)
    assert run.returncode == 0 and "Traceback" not in run.err, run.err
    ours = conditions_of(kube, "gpu-node-1")[k.NODE_CONDITION]
    if leased:
        assert ours["status"] == "True"
        assert kube.count("PATCH", "/api/v1/nodes/gpu-node-1/status") == 1  # the test's own
    else:
        assert kube.count("GET", lease) == 1  # read; no Lease there: the condition decides
        assert (ours["status"], ours["reason"]) == ("Unknown", SILENT_REASON)
        assert f"node gpu-node-1: {k.NODE_CONDITION} set Unknown" in run.err
