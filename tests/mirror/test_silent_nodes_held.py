"""The nodes the follower holds silent (`NodeLiveness.silent_nodes`, the gauge
`kai_fractions_follower_node_silent{node}`): a node whose condition it set Unknown has a series
while its condition still says so, and none once its agent writes it again, the node is deleted,
or the follower stops (its term ended: `close()`); a standby, which never marked, has none. KAI
binds nothing more to such a node, so no bind ever reads it again: the follower reads the nodes
it holds every `recheck_seconds` on its own. Through the real client against kmock, wired to
`MirrorMetrics` as `kai-fractions mirror` wires them (cli/mirror_background.py)."""

from __future__ import annotations

import datetime

import pytest
from kubernetes import client as k8s
from prometheus_client import generate_latest

from kai_fractions.contract import keys as k
from kai_fractions.kube.client import Kube
from kai_fractions.mirror.metrics import MirrorMetrics
from kai_fractions.mirror.node_liveness import SILENT_REASON, NodeLiveness
from tests.support.aio import until
from tests.support.kube import KubeServer

GAUGE = "kai_fractions_follower_node_silent"
TYPES = (k.NODE_CONDITION, k.LEGACY_NODE_CONDITION)
NOW = datetime.datetime(2026, 12, 2, 12, 0, tzinfo=datetime.UTC)


def agent_condition(status: str = "True", reason: str = "AgentReady") -> dict:
    """The agent's condition as it writes it (no heartbeat time here: with no Lease either,
    a True one is silent at the first check)."""
    return {"type": k.NODE_CONDITION, "status": status, "reason": reason, "message": "ready",
            "lastTransitionTime": "2026-12-02T11:00:00Z"}


def add_node(kube: KubeServer, name: str) -> None:
    kube.core.create_node({"metadata": {"name": name}})
    kube.core.patch_node_status(name, {"status": {"conditions": [agent_condition()]}})


def agent_writes(kube: KubeServer, name: str, status: str = "True",
                 reason: str = "AgentReady") -> None:
    kube.core.patch_node_status(name, {"status": {"conditions": [
        {**agent_condition(status, reason), "lastHeartbeatTime": "2026-12-02T12:00:00Z"}]}})


def held(metrics: MirrorMetrics) -> dict[str, float]:
    """The gauge's series: node -> value."""
    return {s.labels["node"]: s.value for family in metrics.registry.collect()
            if family.name == GAUGE for s in family.samples}


@pytest.fixture
async def client(kube: KubeServer):
    client = Kube(k8s.ApiClient(kube.configuration()))
    yield client
    await client.close()


def wired(client: Kube, metrics: MirrorMetrics, recheck: float = 0.05) -> NodeLiveness:
    """As mirror_background.py builds it (no Lease namespace: the condition decides)."""
    return NodeLiveness(client, TYPES, stale_after_seconds=180, recheck_seconds=recheck,
                        on_marked=metrics.node_marked_silent,
                        on_failed=metrics.node_check_failed,
                        on_cleared=metrics.node_no_longer_silent,
                        clock=NOW.timestamp, monotonic=lambda: 0.0)


async def test_a_marked_node_has_a_series_until_its_agent_writes_its_condition_again(
        kube, client):
    add_node(kube, "a")
    add_node(kube, "b")
    metrics = MirrorMetrics()
    watcher = wired(client, metrics)
    assert held(metrics) == {}  # the family is there (HELP, TYPE), with no series
    assert f"# TYPE {GAUGE} gauge" in generate_latest(metrics.registry).decode()
    assert await watcher.check("a") is True and await watcher.check("b") is True
    assert held(metrics) == {"a": 1.0, "b": 1.0}
    assert watcher.silent_nodes == {"a", "b"}
    assert metrics.registry.get_sample_value("kai_fractions_follower_silent_nodes_total") == 2
    # read again and again on its own (no bind goes there now): still Unknown, still held
    reads = kube.count("GET", "/api/v1/nodes/a")
    await until(lambda: kube.count("GET", "/api/v1/nodes/a") >= reads + 3, "re-reads of a")
    assert held(metrics) == {"a": 1.0, "b": 1.0}
    # a's agent is back: it writes its condition (True, or False for a reason of its own)
    agent_writes(kube, "a", "False", "NVMLUnavailable")
    await until(lambda: "a" not in held(metrics), "a let go")
    assert held(metrics) == {"b": 1.0} and watcher.silent_nodes == {"b"}
    # the counter stays: it counts marks, not nodes held
    assert metrics.registry.get_sample_value("kai_fractions_follower_silent_nodes_total") == 2
    agent_writes(kube, "b")
    await until(lambda: held(metrics) == {}, "b let go")
    assert watcher.silent_nodes == frozenset()
    # nothing held: the nodes are read no more
    await until(lambda: watcher._watching is not None and watcher._watching.done(),
                "the re-reads stopped")
    await watcher.close()


async def test_a_deleted_node_is_let_go(kube, client):
    add_node(kube, "a")
    metrics = MirrorMetrics()
    watcher = wired(client, metrics)
    assert await watcher.check("a") is True
    assert held(metrics) == {"a": 1.0}
    kube.core.delete_node("a")
    await until(lambda: held(metrics) == {}, "a deleted, let go")
    await watcher.close()


async def test_losing_the_lease_lets_every_node_go_and_a_new_term_holds_its_own(kube, client):
    """The follower's work is cancelled when its term ends, and closes its NodeLiveness
    (cli/mirror_background.py): the replica, a standby now, reports no node; the same
    NodeLiveness serves its next term."""
    add_node(kube, "a")
    add_node(kube, "b")
    metrics = MirrorMetrics()
    watcher = wired(client, metrics, recheck=60.0)
    assert await watcher.check("a") is True and await watcher.check("b") is True
    await watcher.close()
    assert held(metrics) == {} and watcher.silent_nodes == frozenset()
    # the nodes still say Unknown: the next term marks nothing it did not mark itself...
    assert held(metrics) == {}
    # ...and holds what it marks
    agent_writes(kube, "a")
    add_node(kube, "c")
    assert await watcher.check("c") is True
    assert held(metrics) == {"c": 1.0}
    await watcher.close()
    assert held(metrics) == {}


async def test_a_bind_that_reads_a_held_node_back_in_service_lets_it_go(kube, client):
    """Its agent is back and KAI places there again: the bind's check lets it go at once,
    before the next re-read."""
    add_node(kube, "a")
    metrics = MirrorMetrics()
    watcher = wired(client, metrics, recheck=60.0)
    assert await watcher.check("a") is True
    agent_writes(kube, "a")
    assert await watcher.check("a") is False
    assert held(metrics) == {}
    await watcher.close()


async def test_a_re_read_that_fails_keeps_the_node_held(kube, client, caplog):
    add_node(kube, "a")
    metrics = MirrorMetrics()
    watcher = wired(client, metrics)
    assert await watcher.check("a") is True
    kube.fail("GET", "/api/v1/nodes/a", 503, times=3,
              message="the server is currently unable to handle the request")
    agent_writes(kube, "a")
    await until(lambda: "whether it is still silent not read" in caplog.text)
    assert held(metrics) == {"a": 1.0}  # proves nothing either way
    await until(lambda: held(metrics) == {}, "a let go once read")
    await watcher.close()


def test_another_condition_of_the_node_does_not_count():
    from kai_fractions.mirror.node_liveness import marked_silent

    def node(*conditions: dict) -> dict:
        return {"status": {"conditions": list(conditions)}}

    ours = {"type": k.NODE_CONDITION, "status": "Unknown", "reason": SILENT_REASON}
    assert marked_silent(node(ours), TYPES)
    assert marked_silent(node({**ours, "type": k.LEGACY_NODE_CONDITION}), TYPES)
    assert not marked_silent(node({**ours, "reason": "NodeStatusUnknown"}), TYPES)
    assert not marked_silent(node({**ours, "type": "Ready"}), TYPES)
    assert not marked_silent(node({**ours, "status": "True"}), TYPES)
    assert not marked_silent({"status": {}}, TYPES)


@pytest.mark.integration
def test_the_mirror_process_reports_the_node_it_holds_silent(kube, tmp_path):
    """`kai-fractions mirror --follow-bindrequests --mark-silent-nodes-after 120` marks a node
    whose condition says True with no heartbeat time at KAI's bind there, and its /metrics has
    that node's series (the process wires NodeLiveness to its metrics)."""
    from tests.support.agent_process import free_port
    from tests.support.mirror_kube import create_pending_bind_request, run_mirror_process
    from tests.support.promql import sample_value

    add_node(kube, "gpu-node-1")
    create_pending_bind_request(kube, "team-a", "br-0", "train-0", "gpu-node-1")
    port = free_port()
    run = run_mirror_process(
        kube, tmp_path, "--follow-bindrequests", "--mark-silent-nodes-after", "120",
        "--metrics-listen", f"127.0.0.1:{port}", metrics_url=f"http://127.0.0.1:{port}/metrics",
        metrics_ready=lambda text: sample_value(text, GAUGE, node="gpu-node-1") == 1)
    assert run.returncode == 0 and "Traceback" not in run.err, run.err
    assert sample_value(run.metrics, GAUGE, node="gpu-node-1") == 1


async def test_a_mark_whose_answer_was_lost_is_held_once_read_back(kube, client):
    """The PATCH landed but its answer did not come (a 503 after the write, as a timeout or a
    proxy would lose it): the node is Unknown, and KAI binds nothing there, so no bind would
    read it again. It is held, and the re-read that finds the mark counts it and gives it its
    series (the reviewer's probe p5_node_liveness.py (a))."""
    add_node(kube, "a")
    metrics = MirrorMetrics()
    watcher = wired(client, metrics)
    kube.next_requests("PATCH", "/api/v1/nodes/a/status") << 503
    watcher.saw("a")
    await until(lambda: held(metrics) == {"a": 1.0}, "a held once read back")
    assert watcher.silent_nodes == {"a"}
    assert metrics.registry.get_sample_value("kai_fractions_follower_silent_nodes_total") == 1
    conditions = kube.core.read_node_status("a").status.conditions
    assert [(c.status, c.reason) for c in conditions] == [("Unknown", SILENT_REASON)]
    agent_writes(kube, "a")
    await until(lambda: held(metrics) == {}, "a let go")
    await watcher.close()


async def test_a_mark_that_did_not_land_is_let_go_at_the_read_and_marked_again(kube, client):
    add_node(kube, "a")
    metrics = MirrorMetrics()
    watcher = wired(client, metrics)
    kube.fail("PATCH", "/api/v1/nodes/a/status", 503, times=1)  # refused before the write
    reads = kube.count("GET", "/api/v1/nodes/a")
    watcher.saw("a")
    await until(lambda: kube.count("GET", "/api/v1/nodes/a") >= reads + 2, "a read back")
    await until(lambda: watcher._silent == set(), "a let go")
    assert held(metrics) == {} and watcher.silent_nodes == frozenset()
    assert metrics.registry.get_sample_value("kai_fractions_follower_silent_nodes_total") == 0
    assert await watcher.check("a") is True  # the next bind marks it
    assert held(metrics) == {"a": 1.0}
    await watcher.close()
