"""A node whose agent went silent is set Unknown for KAI (`NodeLiveness`), through the real
client against kmock: a True condition whose heartbeat the mirror has read unchanged for
stale_after (by its own monotonic clock; the agent's times are only compared, never trusted)
becomes Unknown (reason NodeAgentSilent, the old heartbeat kept), one that changes, a False one
and other conditions are left alone, a heartbeat that lands in between wins (the node's
resourceVersion guards the write), and a node is read at most once per recheck period, or after
a failed check, once the short backoff has passed."""

from __future__ import annotations

import asyncio
import datetime
import re

import pytest
from kubernetes import client as k8s

from kai_fractions.contract import keys as k
from kai_fractions.kube.client import MERGE_PATCH, Kube
from kai_fractions.kube.errors import KubeError
from kai_fractions.mirror.node_liveness import SILENT_REASON, NodeLiveness
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


def test_only_our_true_conditions_whose_heartbeat_stood_still_are_silent():
    """What the mirror read decides (`seen`: each heartbeat as written, and when the mirror's
    monotonic clock first read it), never the time it says: it was once the condition's
    lastHeartbeatTime 400 s before the mirror's wall clock that made it silent, which an agent
    whose clock runs behind the mirror's got at every report."""
    from kai_fractions.mirror.node_liveness import Sighting, silent_conditions

    n = node("n", condition(k.NODE_CONDITION, "True", 30),
             condition(k.LEGACY_NODE_CONDITION, "True", 30))
    seen = {k.NODE_CONDITION: Sighting(stamp(30), since=1000.0),
            k.LEGACY_NODE_CONDITION: Sighting(stamp(30), since=1100.0)}
    [silent] = silent_conditions(n, TYPES, seen, 1180.0, 180, at=NOW.timestamp())
    assert silent == {
        "type": k.NODE_CONDITION, "status": "Unknown", "reason": SILENT_REASON,
        "message": "the kai-fractions node agent has not reported for 180 s by the mirror's "
                   f"clock (its lastHeartbeatTime still {stamp(30)}): KAI places no fractional "
                   "pod here until it reports again",
        "lastHeartbeatTime": stamp(30), "lastTransitionTime": stamp(0)}
    assert silent_conditions(n, TYPES, seen, 1179.0, 180, at=NOW.timestamp()) == []
    assert silent_conditions(node("n", condition(k.NODE_CONDITION, "False", 400)), TYPES,
                             {}, 10**6, 180, at=NOW.timestamp()) == []
    no_time = silent_conditions(node("n", condition(k.NODE_CONDITION, "True", None)), TYPES,
                                {}, 0.0, 180, at=NOW.timestamp())
    assert "with no heartbeat time" in no_time[0]["message"]
    # the kubelet's own Ready, however old, is not ours to judge
    assert silent_conditions(node("n"), TYPES, {}, 10**6, 180, at=NOW.timestamp()) == []


def test_a_heartbeat_is_dated_by_when_the_mirror_first_read_it():
    from kai_fractions.mirror.node_liveness import Sighting, sighted

    first = sighted(None, stamp(3600), 10.0)  # however old it says it is
    assert first == Sighting(stamp(3600), since=10.0)
    assert sighted(first, stamp(3600), 500.0) is first  # unchanged: still from 10
    assert sighted(first, stamp(-3600), 500.0) == Sighting(stamp(-3600), since=500.0)
    assert sighted(first, None, 500.0) is None


@pytest.fixture
async def client(kube: KubeServer):
    client = Kube(k8s.ApiClient(kube.configuration()))
    yield client
    await client.close()


class Clock:
    """The mirror's clocks in a test: monotonic seconds `t`, and a wall clock NOW + t."""

    def __init__(self) -> None:
        self.t = 0.0

    def monotonic(self) -> float:
        return self.t

    def wall(self) -> float:
        return NOW.timestamp() + self.t


def liveness(client: Kube, marked: list[str], monotonic=lambda: 0.0, *,
             lease_namespace: str = "", clock=NOW.timestamp) -> NodeLiveness:
    return NodeLiveness(client, TYPES, stale_after_seconds=180, recheck_seconds=60,
                        lease_namespace=lease_namespace, on_marked=marked.append, clock=clock,
                        monotonic=monotonic)


def conditions_of(kube: KubeServer, name: str) -> dict[str, dict]:
    obj = kube.core.read_node(name).to_dict()
    return {c["type"]: c for c in obj["status"]["conditions"]}


def beat(kube: KubeServer, name: str, heartbeat: str) -> None:
    """The agent writes its condition, True, with `heartbeat` (by its own clock)."""
    kube.core.patch_node_status(name, {"status": {"conditions": [
        {**condition(k.NODE_CONDITION, "True", None), "lastHeartbeatTime": heartbeat}]}})


async def checks(watcher: NodeLiveness, name: str, clock: Clock, at: list[float],
                 report=None) -> list[bool]:
    """`watcher.check(name)` at each of the mirror's monotonic times `at`, after
    `report(t)` (the agent reporting, or not) when given."""
    answers = []
    for t in at:
        clock.t = t
        if report is not None:
            await report(t)
        answers.append(await watcher.check(name))
    return answers


async def test_a_silent_node_is_set_unknown_and_a_live_one_is_left_alone(kube, client):
    # Both read first at 0 (each heartbeat counts from there, however old it says it is: it
    # was once the first check that marked "silent", by its heartbeat 400 s before the
    # mirror's wall clock); by 180, the agent on "live" reported and the one on "silent" not.
    kube.core.create_node(node("silent", condition(k.NODE_CONDITION, "True", 400)))
    kube.core.create_node(node("live", condition(k.NODE_CONDITION, "True", 30)))
    marked: list[str] = []
    clock = Clock()
    watcher = liveness(client, marked, clock.monotonic)
    assert await watcher.check("silent") is False
    assert await watcher.check("live") is False
    clock.t = 180
    beat(kube, "live", stamp(0))
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
    assert kube.count("PATCH", "/api/v1/nodes/live/status") == 1  # the agent's report alone


async def test_a_heartbeat_that_lands_in_between_wins(kube, client):
    # First read at 0, silent at 180 (it was silent at once, by the mirror's wall clock).
    kube.core.create_node(node("n", condition(k.NODE_CONDITION, "True", 400)))
    clock = Clock()
    watcher = liveness(client, [], clock.monotonic)
    assert await watcher.check("n") is False
    clock.t = 180
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


@pytest.mark.parametrize("fails", ["node", "lease"])
async def test_a_failed_check_is_tried_again_after_a_short_backoff(kube, client, fails):
    """A check that fails (the node or the agent's Lease unreadable) is not remembered as
    done: a bind RETRY_AFTER_FAILURE_SECONDS later reads the node again (it waited the whole
    recheck period, 60 s), one before it does not; a check that succeeds waits the period."""
    from kai_fractions.mirror.node_liveness import RETRY_AFTER_FAILURE_SECONDS as RETRY

    kube.core.create_node(node("n", condition(k.NODE_CONDITION, "True", None)))  # read its Lease
    kube.fail("GET", "/api/v1/nodes/n" if fails == "node" else f"{LEASES}/kai-fractions-agent.n",
              503, message="the server is currently unable to handle the request")
    now, failed = [100.0], []
    watcher = NodeLiveness(client, TYPES, stale_after_seconds=180, recheck_seconds=60,
                           lease_namespace="kf", on_failed=failed.append, clock=NOW.timestamp,
                           monotonic=lambda: now[0])
    reads = lambda: kube.count("GET", "/api/v1/nodes/n")  # noqa: E731
    watcher.saw("n")
    await until(lambda: failed == ["n"])
    now[0] = 100 + RETRY - 1
    watcher.saw("n")
    await asyncio.sleep(0.2)
    assert reads() == 1
    now[0] = 100 + RETRY
    watcher.saw("n")
    await until(lambda: reads() == 2, what="the node read again")
    await until(lambda: not watcher._tasks)
    assert failed == ["n"]  # it went through this time (no Lease, no heartbeat: marked)
    assert kube.count("PATCH", "/api/v1/nodes/n/status") == 1
    now[0] = 100 + RETRY + 59
    watcher.saw("n")
    await asyncio.sleep(0.2)
    assert reads() == 2  # done: the next in the full recheck period
    await watcher.close()


async def test_a_mark_whose_term_ran_out_during_its_read_is_not_sent(kube, client):
    """Under leader election the patch goes only while the follower's term runs by the clock
    (`in_term`, the elector's): a read answered after the renew deadline (the process paused)
    sends nothing, counts no mark, and leaves the node to be read again at its next bind."""
    kube.core.create_node(node("n", condition(k.NODE_CONDITION, "True", None)))  # silent
    term, marked = [False], []
    watcher = NodeLiveness(client, TYPES, stale_after_seconds=180, on_marked=marked.append,
                           clock=NOW.timestamp, monotonic=lambda: 0.0,
                           in_term=lambda: term[0])
    watcher.saw("n")
    await until(lambda: kube.count("GET", "/api/v1/nodes/n") == 1 and not watcher._tasks)
    assert kube.count("PATCH", "/api/v1/nodes/n/status") == 0 and marked == []
    term[0] = True  # a term again: the next bind reads it at once (not a recheck period on)
    watcher.saw("n")
    await until(lambda: marked == ["n"], what="marked in a term")
    assert kube.count("GET", "/api/v1/nodes/n") == 2
    assert kube.count("PATCH", "/api/v1/nodes/n/status") == 1
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


# -- the agent's clock is not the mirror's ----------------------------------------------------


def agent_stamp(clock: Clock, skew: float, lease: bool = False) -> str:
    """What an agent writes at the mirror's time `clock.t` by its own clock, `skew` seconds
    ahead of the mirror's (behind when negative), as a condition's time or a Lease's."""
    then = NOW + datetime.timedelta(seconds=clock.t + skew)
    return then.strftime("%Y-%m-%dT%H:%M:%S.%fZ" if lease else "%Y-%m-%dT%H:%M:%SZ")


async def test_an_agent_whose_clock_runs_behind_is_alive_while_its_heartbeat_changes(
        kube, client):
    """The reviewer's probe: the agent reports 2 s before each check by a clock 190 s behind
    the mirror's, so by the mirror's wall clock its heartbeat is 192 s old (stale_after 180) at
    every check; it changes each time, and the node is never marked."""
    kube.core.create_node(node("n"))
    clock, marked = Clock(), []
    watcher = liveness(client, marked, clock.monotonic, clock=clock.wall)

    async def report(t: float) -> None:
        beat(kube, "n", agent_stamp(clock, -192))

    assert await checks(watcher, "n", clock, [60.0 * i for i in range(8)], report) == [False] * 8
    assert marked == [] and conditions_of(kube, "n")[k.NODE_CONDITION]["status"] == "True"


async def test_an_agent_whose_clock_runs_ahead_is_marked_once_its_heartbeat_stands_still(
        kube, client):
    """An hour ahead, its heartbeat never looked old by the mirror's wall clock, however long
    the agent was dead; the mirror's monotonic clock says when it stopped changing."""
    kube.core.create_node(node("n"))
    clock, marked = Clock(), []
    watcher = liveness(client, marked, clock.monotonic, clock=clock.wall)

    async def report(t: float) -> None:
        if t <= 60:  # then the agent dies
            beat(kube, "n", agent_stamp(clock, 3600))

    assert await checks(watcher, "n", clock, [0, 60, 120, 180, 239, 240], report) == [
        False, False, False, False, False, True]
    assert marked == ["n"]
    clock.t = 60
    message = conditions_of(kube, "n")[k.NODE_CONDITION]["message"]
    assert message.startswith("the kai-fractions node agent has not reported for 180 s by the "
                              "mirror's clock (its lastHeartbeatTime still "
                              f"{agent_stamp(clock, 3600)}): ")


async def test_a_heartbeat_read_for_the_first_time_counts_from_then(kube, client):
    """A node first seen (the mirror started, a new leader) with a heartbeat an hour old: not
    marked at once (the agent's clock may be an hour behind), but once it has not changed for
    stale_after of the mirror's monotonic clock."""
    kube.core.create_node(node("n", condition(k.NODE_CONDITION, "True", 3600)))
    clock, marked = Clock(), []
    watcher = liveness(client, marked, clock.monotonic)
    # the mirror's monotonic clock is not 0 at its start
    assert await checks(watcher, "n", clock, [5000, 5179, 5180]) == [False, False, True]
    assert marked == ["n"]
    assert "not reported for 180 s by the mirror's clock" in conditions_of(
        kube, "n")[k.NODE_CONDITION]["message"]


# -- the agents' heartbeat Leases (node/agent/heartbeat.py) ---------------------------------

LEASES = "/apis/coordination.k8s.io/v1/namespaces/kf/leases"


def micro(seconds_ago: float) -> str:
    return (NOW - datetime.timedelta(seconds=seconds_ago)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


async def lease(client: Kube, node: str, renewed_ago: float) -> None:
    await client.request("POST", LEASES, what="create it", body={
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": f"kai-fractions-agent.{node}", "namespace": "kf"},
        "spec": {"holderIdentity": node, "renewTime": micro(renewed_ago)}})


async def renew(client: Kube, node: str, renew_time: str) -> None:
    """The agent renews its Lease, writing `renew_time` (by its own clock)."""
    await client.request("PATCH", f"{LEASES}/kai-fractions-agent.{node}", what="renew it",
                         body={"spec": {"renewTime": renew_time}}, content_type=MERGE_PATCH)


def leased(client: Kube, marked: list[str], clock: Clock) -> NodeLiveness:
    return liveness(client, marked, clock.monotonic, lease_namespace="kf", clock=clock.wall)


def test_a_renewed_lease_is_a_heartbeat_of_its_own():
    from kai_fractions.mirror.node_liveness import Sighting, silent_conditions

    n = node("n", condition(k.NODE_CONDITION, "True", 290))  # the last 5-minute report
    seen = {k.NODE_CONDITION: Sighting(stamp(290), since=0.0)}
    renewed = Sighting(micro(60), since=100.0)  # the Lease had changed when read at 100
    assert silent_conditions(n, TYPES, seen, 200.0, 180, renewed, at=NOW.timestamp()) == []
    [silent] = silent_conditions(n, TYPES, seen, 300.0, 180, renewed, at=NOW.timestamp())
    assert silent["message"].startswith(
        "the kai-fractions node agent has not reported for 200 s by the mirror's clock (its "
        f"heartbeat Lease's renewTime still {micro(60)}): ")
    assert silent["lastHeartbeatTime"] == stamp(290)  # the condition's own, kept


async def test_a_node_whose_agent_renews_its_lease_is_left_alone(kube, client):
    # The mirror's monotonic clock judges (it was the agent's times against the mirror's wall
    # clock, all at one check): read at 0, 180 and 360; a Lease is read only once the
    # condition has stood still for 180, and a Lease read the first time counts from then.
    names = ("leased", "lapsed", "fresh", "old-agent")
    for name in names:
        kube.core.create_node(node(name, condition(k.NODE_CONDITION, "True", 290)))
    await lease(client, "leased", 40)
    await lease(client, "lapsed", 250)
    marked: list[str] = []
    clock = Clock()
    watcher = leased(client, marked, clock)

    async def round_at(t: float) -> list[bool]:
        clock.t = t
        if t:
            await renew(client, "leased", agent_stamp(clock, 0, lease=True))
            beat(kube, "fresh", agent_stamp(clock, 0))
        return [await watcher.check(name) for name in names]

    assert await round_at(0) == [False, False, False, False]  # all first read now
    assert kube.count("GET", re.compile(re.escape(LEASES) + "/.*")) == 0  # not needed yet
    assert await round_at(180) == [False, False, False, True]  # no Lease: its condition
    assert await round_at(360) == [False, True, False, False]  # lapsed's Lease stood still
    assert marked == ["old-agent", "lapsed"]
    assert kube.count("GET", f"{LEASES}/kai-fractions-agent.fresh") == 0  # not needed


async def test_a_lease_renewed_by_a_clock_behind_keeps_its_node_alive(kube, client):
    """The probe, with the Lease: renewed 2 s before each check by a clock 190 s behind (192 s
    old by the mirror's wall clock), the condition's own heartbeat older still."""
    kube.core.create_node(node("n", condition(k.NODE_CONDITION, "True", 290)))
    await lease(client, "n", 192)
    clock, marked = Clock(), []
    watcher = leased(client, marked, clock)

    async def report(t: float) -> None:
        await renew(client, "n", agent_stamp(clock, -192, lease=True))

    assert await checks(watcher, "n", clock, [60.0 * i for i in range(9)], report) == [
        False] * 9
    assert marked == []
    # read at 180 (the condition stood still) and at 360 (the Lease read at 180 is that old)
    assert kube.count("GET", f"{LEASES}/kai-fractions-agent.n") == 2


async def test_a_lease_renewed_by_a_clock_ahead_is_marked_once_it_stands_still(kube, client):
    kube.core.create_node(node("n", condition(k.NODE_CONDITION, "True", 290)))
    await lease(client, "n", -3600)
    clock, marked = Clock(), []
    watcher = leased(client, marked, clock)

    async def report(t: float) -> None:
        if t <= 120:  # then the agent dies
            await renew(client, "n", agent_stamp(clock, 3600, lease=True))

    # the Lease first read at 180 (the condition stood still since 0), unchanged at 360
    assert await checks(watcher, "n", clock, [0, 60, 120, 180, 240, 359, 360], report) == [
        False, False, False, False, False, False, True]
    assert marked == ["n"]
    clock.t = 120
    assert (f"for 180 s by the mirror's clock (its heartbeat Lease's renewTime still "
            f"{agent_stamp(clock, 3600, lease=True)})") in conditions_of(
        kube, "n")[k.NODE_CONDITION]["message"]


async def test_a_lease_read_for_the_first_time_counts_from_then(kube, client):
    """An hour-old Lease and condition at the mirror's start: the Lease is read once the
    condition stood still for 180, and the node marked once the Lease did too (after a restart
    a dead agent with a Lease is found 2 x stale_after after the first bind)."""
    kube.core.create_node(node("n", condition(k.NODE_CONDITION, "True", 3600)))
    await lease(client, "n", 3600)
    clock, marked = Clock(), []
    watcher = leased(client, marked, clock)
    assert await checks(watcher, "n", clock, [0, 179, 180, 359, 360]) == [
        False, False, False, False, True]
    assert kube.count("GET", f"{LEASES}/kai-fractions-agent.n") == 2  # at 180 and 360
    assert f"heartbeat Lease's renewTime still {micro(3600)}" in conditions_of(
        kube, "n")[k.NODE_CONDITION]["message"]


async def test_a_lease_that_cannot_be_read_marks_nothing(kube, client):
    # read first at 0: the Lease is read once the condition has stood still for 180
    kube.core.create_node(node("n", condition(k.NODE_CONDITION, "True", 290)))
    marked: list[str] = []
    clock = Clock()
    watcher = leased(client, marked, clock)
    assert await watcher.check("n") is False
    clock.t = 180
    kube.fail("GET", f"{LEASES}/kai-fractions-agent.n", 403, message="leases is forbidden")
    with pytest.raises(KubeError, match="leases is forbidden"):
        await watcher.check("n")
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
    node whose condition says True with no heartbeat time, and whose agent has no Lease, sets it
    Unknown at once, counted in the metrics; with `--heartbeat-lease-namespace`, the agent's
    Lease is read, and a Lease read for the first time is a heartbeat however old its renewTime
    (the mirror judges by what it sees change, by its own clock). A heartbeat must stand still
    for 120 s at least before it is old, longer than this test runs on the process's real
    clocks, so no case here marks by time. (It was a condition heartbeat an hour old, and a
    Lease renewed now, both read against the process's wall clock: the agent's clock trusted.)"""
    from tests.support.agent_process import free_port
    from tests.support.mirror_kube import create_pending_bind_request, run_mirror_process
    from tests.support.promql import sample_value

    hour_ago = (datetime.datetime.now(datetime.UTC) - datetime.timedelta(hours=1)).strftime(
        "%Y-%m-%dT%H:%M:%S.%fZ")
    kube.core.create_node({"metadata": {"name": "gpu-node-1"}})
    kube.core.patch_node_status("gpu-node-1", {"status": {"conditions": [
        condition(k.NODE_CONDITION, "True", None)]}})
    lease = "/apis/coordination.k8s.io/v1/namespaces/kf/leases/kai-fractions-agent.gpu-node-1"
    if leased:
        k8s.CoordinationV1Api(kube.api_client).create_namespaced_lease("kf", {
            "metadata": {"name": "kai-fractions-agent.gpu-node-1", "namespace": "kf"},
            "spec": {"holderIdentity": "gpu-node-1", "renewTime": hour_ago}})
    create_pending_bind_request(kube, "team-a", "br-0", "train-0", "gpu-node-1")
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
