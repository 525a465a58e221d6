"""The pod watcher and the worker over the in-memory cluster: client-side filtering, deletion,
410 relists, reconnects with backoff, a prompt stop, coalesced passes, retries and calls on the
worker; and KubeCluster (the watcher's list + watch and the agent's writes) against kmock."""

from __future__ import annotations

import asyncio
import copy
import random
import threading
import time
from pathlib import Path

import pytest
from kubernetes import client as k8s

from kai_fractions.kube.errors import Conflict, KubeError, NotFound
from kai_fractions.kube.listwatch import WATCH_BACKOFF
from kai_fractions.kube.retry import Backoff
from kai_fractions.node.agent.kube import KubeCluster
from kai_fractions.node.agent.watch import PodCache, PodWatcher
from tests.kube.standin import Answer, StandIn, Stream, events, status
from tests.support.aio import until
from tests.support.fake_kube import FakeCluster

from .builders import NODE, Rig, binder_annotations, pod, wait_for
from .test_reconcile import add_pod


class Counter:
    def __init__(self) -> None:
        self.n = 0

    def __call__(self) -> None:
        self.n += 1


def watcher(cluster: FakeCluster, cache: PodCache, on_change=None, **kw) -> PodWatcher:
    return PodWatcher(cluster, NODE, cache, on_change or Counter(),
                      backoff=Backoff(attempts=1_000_000, base=0.01, cap=0.05), **kw)


def run_in_thread(w: PodWatcher) -> tuple[threading.Event, threading.Thread]:
    stop = threading.Event()
    thread = threading.Thread(target=w.run, args=(stop,), daemon=True)
    thread.start()
    return stop, thread


def test_only_pods_of_this_node_are_kept_and_deletions_remove_them() -> None:
    cluster = FakeCluster()
    mine = cluster.add_pod(pod("mine"))["metadata"]["uid"]
    cluster.add_pod(pod("other", node="node-b"))
    cache = PodCache()
    changes = Counter()
    stop, thread = run_in_thread(watcher(cluster, cache, changes))
    try:
        wait_for(lambda: cache.synced, what="first list")
        assert set(cache.snapshot()) == {mine}
        later = cluster.add_pod(pod("later"))["metadata"]["uid"]
        cluster.add_pod(pod("elsewhere", node="node-b"))
        wait_for(lambda: later in cache.snapshot(), what="ADDED")
        cluster.delete_pod(mine)
        wait_for(lambda: mine not in cache.snapshot(), what="DELETED")
        assert set(cache.snapshot()) == {later}
        assert changes.n >= 3
    finally:
        stop.set()
        thread.join(2)


def test_watch_expiry_relists_at_once() -> None:
    cluster = FakeCluster()
    cache = PodCache()
    stop, thread = run_in_thread(watcher(cluster, cache))
    try:
        wait_for(lambda: cluster.calls["watch_pods"] == 1, what="watching")
        uid = cluster.add_pod(pod("a"))["metadata"]["uid"]
        wait_for(lambda: uid in cache.snapshot(), what="the pod")
        # the history is compacted and a deletion happens while nobody watches
        cluster.expire()
        cluster.pods.pop(uid)
        wait_for(lambda: cluster.calls["list_pods"] == 2, what="a relist")
        wait_for(lambda: uid not in cache.snapshot(), what="the relist's truth")
        assert cache.api_down_since is None  # 410 is no outage
    finally:
        stop.set()
        thread.join(2)


def test_failures_back_off_then_reconnect_and_clear_the_outage() -> None:
    cluster = FakeCluster()
    cluster.fail("list_pods", KubeError("list pods: 503 ServiceUnavailable", 503), times=3)
    cache = PodCache()
    w = watcher(cluster, cache)
    stop, thread = run_in_thread(w)
    try:
        wait_for(lambda: cache.api_down_since is not None, what="the outage")
        assert cache.last_error == "list pods: 503 ServiceUnavailable"
        wait_for(lambda: cache.synced, what="the reconnect")
        assert cluster.calls["list_pods"] == 4
        assert cache.api_down_since is None and cache.last_error is None
        cluster.fail("watch_pods", KubeError("watch: connection reset"))
        cluster.end_watches()  # an empty watch ended at once is a failure too (backed off)
        wait_for(lambda: cluster.calls["list_pods"] >= 5, what="a relist after a watch error")
    finally:
        stop.set()
        thread.join(2)


class WaitingClock:
    """A clock whose waits are recorded and never end (the watcher is stopped in one)."""

    def __init__(self) -> None:
        self.waits: list[float] = []

    def monotonic(self) -> float:
        return time.monotonic()

    async def asleep(self, seconds: float) -> None:
        self.waits.append(seconds)
        await asyncio.Event().wait()


def test_the_first_list_waits_a_random_part_of_the_jitter() -> None:
    cluster = FakeCluster()
    clock = WaitingClock()
    stop, thread = run_in_thread(watcher(cluster, PodCache(), first_list_jitter=10.0,
                                         rng=random.Random(7), clock=clock))
    try:
        wait_for(lambda: clock.waits, what="the wait")
        assert clock.waits == [random.Random(7).uniform(0, 10.0)]
    finally:
        stop.set()  # stopped during the wait: it never lists
        thread.join(2)
    assert cluster.calls["list_pods"] == 0
    cache = PodCache()
    stop, thread = run_in_thread(watcher(cluster, cache, first_list_jitter=0.05))
    try:
        wait_for(lambda: cache.synced, what="the list after the wait")
    finally:
        stop.set()
        thread.join(2)


def test_stop_ends_the_watch_at_once() -> None:
    cluster = FakeCluster()
    cache = PodCache()
    stop, thread = run_in_thread(watcher(cluster, cache))
    wait_for(lambda: cluster.watching == 1, what="watching")
    started = time.monotonic()
    stop.set()
    thread.join(2)
    assert not thread.is_alive() and time.monotonic() - started < 1.0
    wait_for(lambda: cluster.watching == 0, timeout=1.0, what="the watch cancelled")
    cluster.add_pod(pod("late"))
    time.sleep(0.05)
    assert cache.snapshot() == {} and cluster.calls["list_pods"] == 1


def test_a_handler_that_raises_ends_the_watch_and_says_so(caplog) -> None:
    cluster = FakeCluster()
    cache = PodCache()

    def broken() -> None:
        raise RuntimeError("a bug")

    stop, thread = run_in_thread(watcher(cluster, cache, broken))
    try:
        wait_for(lambda: cache.last_error, what="the failure")
        assert cache.last_error == "the pod watch stopped: RuntimeError: a bug"
        assert cache.api_down_since is not None  # the condition reports it in time
        assert "the watch of node node-a's pods stopped: a bug" in caplog.text
    finally:
        stop.set()
        thread.join(2)


def test_cached_lists_ask_the_watch_cache_but_not_right_after_an_expiry() -> None:
    cluster = FakeCluster()
    cache = PodCache()
    stop, thread = run_in_thread(watcher(cluster, cache, cached_lists=True))
    try:
        wait_for(lambda: cluster.calls["watch_pods"] == 1, what="watching")
        cluster.expire()  # 410: a cache behind it could send the watcher round again
        wait_for(lambda: cluster.calls["watch_pods"] == 2, what="watching again")
        cluster.fail("watch_pods", KubeError("watch: connection reset"))
        cluster.end_watches()
        wait_for(lambda: cluster.calls["list_pods"] >= 3, what="a relist after an error")
        assert cluster.list_versions[:3] == ["0", "", "0"]
        wait_for(lambda: cache.generation >= 3, what="the third list handed on")
        assert not cache.consistent  # the reconciler confirms what it lacks before clearing
    finally:
        stop.set()
        thread.join(2)
    uncached, cache = FakeCluster(), PodCache()
    stop, thread = run_in_thread(watcher(uncached, cache))
    try:
        wait_for(lambda: uncached.calls["list_pods"] == 1, what="a list")
        assert uncached.list_versions == [""]
        wait_for(lambda: cache.synced, what="the list handed on")
        assert cache.consistent
    finally:
        stop.set()
        thread.join(2)


def test_the_agent_cli_spreads_its_first_list_by_default_and_refuses_a_negative_jitter(
        capsys) -> None:
    from kai_fractions.cli import build_parser, main

    args = build_parser().parse_args(["node-agent"])
    assert (args.first_list_jitter, args.list_from_watch_cache) == (2.0, False)
    for bad in ("-1", "inf"):
        assert main(["node-agent", "--node-name", "n1", "--first-list-jitter", bad]) == 2
        assert capsys.readouterr().err.endswith(
            f"--first-list-jitter must be 0 or more seconds (and finite), got {float(bad)}\n")


def test_backoff_grows_and_is_capped() -> None:
    w = PodWatcher(FakeCluster(), NODE, PodCache(), Counter())
    assert w.backoff == WATCH_BACKOFF  # 0.5 s doubling to 30 s, never giving up
    rng = random.Random(1)
    delays = [w.backoff.delay(failures, rng) for failures in range(10)]
    assert 0.25 <= delays[0] <= 0.5
    assert all(d <= 30.0 for d in delays) and max(delays) >= 15.0


def test_an_older_version_never_replaces_a_newer_one() -> None:
    cache = PodCache()
    newer = pod("a", uid="u1")
    newer["metadata"]["resourceVersion"] = "7"
    older = pod("a", uid="u1")
    older["metadata"]["resourceVersion"] = "5"
    assert cache.upsert(newer)
    assert not cache.upsert(older)
    assert cache.get("u1")["metadata"]["resourceVersion"] == "7"


def test_a_pod_the_watch_saw_deleted_is_not_brought_back_by_an_older_read() -> None:
    """A read begun before the deletion (a consistent list confirming pods, the answer to an
    annotation patch) lands after the watch's DELETED: no ghost until the next relist."""
    cache = PodCache()
    listed = pod("a", uid="u1")
    listed["metadata"]["resourceVersion"] = "5"
    cache.replace([listed])
    gone = copy.deepcopy(listed)
    gone["metadata"]["resourceVersion"] = "9"
    watcher(FakeCluster(), cache)._event("DELETED", gone)
    read_before = copy.deepcopy(listed)
    read_before["metadata"]["resourceVersion"] = "7"
    assert not cache.upsert(read_before)
    cache.confirm(cache.generation, [read_before])
    assert "u1" not in cache and cache.snapshot() == {}


def test_a_pod_deleted_while_its_annotations_are_patched_is_released(short_tmp: Path) -> None:
    rig = Rig(short_tmp, sm_sharing=False)
    uid = rig.add(pod(notes=binder_annotations(devices=rig.gpu0)))["metadata"]["uid"]
    rig.sync()
    real = rig.cluster.patch_pod_annotations

    def patch_then_delete(*args, **kw):
        answer = real(*args, **kw)
        rig.cluster.delete_pod(uid)  # its DELETED event is handled before the answer lands
        rig.agent.watcher._event("DELETED", rig.cluster.history[-1][2])
        return answer

    rig.cluster.patch_pod_annotations = patch_then_delete
    rig.reconciler.reconcile()
    assert uid not in rig.agent.cache
    rig.reconciler.reconcile()  # no relist: the watch is all there is
    assert uid not in rig.reconciler.pods.known
    assert rig.nvml.limits == {}
    assert not rig.marker_path(uid).parent.exists()


# -- the worker -------------------------------------------------------------------------------


def test_worker_coalesces_changes_and_retries_until_converged(short_tmp: Path) -> None:
    rig = Rig(short_tmp, sm_sharing=False, options={"retry_seconds": 0.05,
                                                    "retry_max_seconds": 0.1})
    rig.nvml.fail("set_memory_limits", "NoPermission", times=3)
    rig.sync()
    passes = []
    real = rig.reconciler.reconcile
    rig.reconciler.reconcile = lambda **kw: passes.append(kw) or real(**kw)
    rig.add(pod(notes=binder_annotations(devices=rig.gpu0)))
    for _ in range(20):
        rig.agent.worker.mark_dirty()
    rig.sync()
    rig.agent.worker.start()
    try:
        wait_for(lambda: rig.agent.worker.last_pass and rig.agent.worker.last_pass.converged,
                 what="converged")
        assert 2 <= len(passes) <= 8  # one per burst of changes plus the retries
    finally:
        assert rig.agent.worker.stop(2)


def test_calls_run_on_the_worker_thread(short_tmp: Path) -> None:
    rig = Rig(short_tmp, sm_sharing=False)
    rig.sync()
    rig.agent.worker.start()
    try:
        name = rig.agent.worker.call(lambda: threading.current_thread().name, timeout=5)
        assert name == "agent-worker"
    finally:
        rig.agent.worker.stop(2)


def test_a_stuck_pass_is_reported_as_not_reconciling(short_tmp: Path) -> None:
    rig = Rig(short_tmp, sm_sharing=False, options={"stale_after_seconds": 0.2})
    rig.step()
    release = threading.Event()
    real = rig.reconciler.reconcile
    rig.reconciler.reconcile = lambda **kw: release.wait(5) and real(**kw)
    rig.agent.worker.start()
    try:
        rig.agent.worker.mark_dirty()
        wait_for(lambda: (c := rig.agent.condition()) is not None
                 and c.reason == "NotReconciling", what="NotReconciling")
        assert "a reconcile pass has been running for" in rig.agent.condition().message
    finally:
        release.set()
        rig.agent.worker.stop(2)


def test_an_unreachable_api_is_reported_after_the_stale_time(short_tmp: Path) -> None:
    rig = Rig(short_tmp, sm_sharing=False, options={"stale_after_seconds": 0.1})
    rig.step()
    assert rig.agent.condition().ready
    rig.agent.cache.failed("list pods: connection refused")
    time.sleep(0.15)
    cond = rig.agent.condition()
    assert (cond.ready, cond.reason) == (False, "NotReconciling")
    assert cond.message.startswith("the Kubernetes API has been unreachable for ")
    assert cond.message.endswith("s or more: list pods: connection refused")


# -- KubeCluster against kmock ---------------------------------------------------------------


@pytest.fixture
def kube_cluster(kube):
    from kai_fractions.node.agent.kube import KubeCluster

    cluster = KubeCluster(kube.api_client, request_timeout=5.0)
    yield cluster
    cluster.close()


def test_a_cached_list_asks_the_api_server_for_resource_version_0(kube, kube_cluster) -> None:
    pods = kube_cluster.node_pods(NODE)
    kube_cluster.spawn(pods.list("0")).result(10)
    kube_cluster.spawn(pods.list()).result(10)
    lists = kube.requests("GET", "/api/v1/pods")
    assert [r.params.get("resourceVersion") for r in lists] == ["0", None]
    assert {r.params.get("fieldSelector") for r in lists} == {f"spec.nodeName={NODE}"}


def bare(name: str, node: str = NODE) -> dict:
    """A pod as a client creates it (no status)."""
    manifest = pod(name, node=node)
    del manifest["status"]
    return manifest


def test_the_watcher_over_kube_cluster_follows_the_api_and_stops_at_once(
        kube, kube_cluster) -> None:
    mine = kube.core.create_namespaced_pod("default", bare("mine")).metadata.uid
    kube.core.create_namespaced_pod("default", bare("other", node="node-b"))
    cache = PodCache()
    stop, thread = run_in_thread(PodWatcher(kube_cluster, NODE, cache, Counter()))
    try:
        wait_for(lambda: set(cache.snapshot()) == {mine}, what="the list")
        wait_for(lambda: kube.count("GET", "/api/v1/pods") == 2, what="the watch")
        later = kube.core.create_namespaced_pod("default", bare("later")).metadata.uid
        wait_for(lambda: later in cache.snapshot(), what="ADDED")
        kube.core.delete_namespaced_pod("mine", "default")
        wait_for(lambda: mine not in cache.snapshot(), what="DELETED")
    finally:
        started = time.monotonic()
        stop.set()
        thread.join(2)
    assert not thread.is_alive() and time.monotonic() - started < 1.0
    watch = kube.requests("GET", "/api/v1/pods")[1]
    assert watch.params.get("watch") == "true"
    assert watch.params.get("fieldSelector") == f"spec.nodeName={NODE}"


def test_kube_cluster_writes_and_their_errors(kube, kube_cluster) -> None:
    kube.core.create_node({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
    uid = kube.core.create_namespaced_pod("default", bare("a")).metadata.uid
    patched = kube_cluster.patch_pod_annotations("default", "a", uid, {"k": "v"})
    assert patched["metadata"]["annotations"] == {"k": "v"}
    with pytest.raises(Conflict) as conflict:  # a recreated pod of the same name
        kube_cluster.patch_pod_annotations("default", "a", "another-uid", {"k": "w"})
    assert conflict.value.message.startswith("patch the annotations of pod default/a: 409 ")
    with pytest.raises(NotFound) as missing:
        kube_cluster.patch_pod_annotations("default", "gone", uid, {"k": "v"})
    assert missing.value.message.startswith("patch the annotations of pod default/gone: 404 ")
    condition = {"type": "Example", "status": "True", "reason": "Fine"}
    kube_cluster.patch_node_status(NODE, [condition])
    kube_cluster.patch_node_labels(NODE, {"example.com/gpu-memory": "81920"})
    node = kube_cluster.get_node(NODE)
    assert node["status"]["conditions"] == [condition]
    assert node["metadata"]["labels"] == {"example.com/gpu-memory": "81920"}
    status = kube.requests("PATCH", f"/api/v1/nodes/{NODE}/status")[0]
    assert status.headers["Content-Type"] == "application/strategic-merge-patch+json"
    with pytest.raises(NotFound, match=r"^read node nope: 404 "):
        kube_cluster.get_node("nope")
    event = {"apiVersion": "v1", "kind": "Event",
             "metadata": {"name": "a.1", "namespace": "default"}, "reason": "Applied",
             "involvedObject": {"kind": "Pod", "namespace": "default", "name": "a", "uid": uid}}
    kube_cluster.create_event("default", event)
    assert kube.core.read_namespaced_event("a.1", "default").reason == "Applied"
    kube.fail("POST", "/api/v1/namespaces/default/events", 403, message="no events for you")
    with pytest.raises(KubeError) as refused:
        kube_cluster.create_event("default", event)
    message = refused.value.message  # the request, the status and the server's words
    assert message.startswith("record event Applied in default: ")
    assert "403" in message and "no events for you" in message


def test_kube_cluster_renews_a_lease_it_creates_the_first_time(kube, kube_cluster) -> None:
    name, path = "kai-fractions-agent.n1", "/apis/coordination.k8s.io/v1/namespaces/kf/leases"
    kube_cluster.renew_lease("kf", name, {"holderIdentity": "n1", "renewTime": "t1"})
    kube_cluster.renew_lease("kf", name, {"renewTime": "t2"})
    lease = kube_cluster.blocking.request("GET", f"{path}/{name}", what="read it")
    assert lease["spec"] == {"holderIdentity": "n1", "renewTime": "t2"}
    assert lease["metadata"]["labels"] == {  # what docs/chart.md deletes them by
        "app.kubernetes.io/name": "kai-fractions",
        "app.kubernetes.io/component": "node-agent-heartbeat"}
    assert kube.count("POST", path) == 1  # created once, then one merge patch a renewal
    [patch] = kube.requests("PATCH", f"{path}/{name}")
    assert patch.data == {"spec": {"renewTime": "t2"}}
    assert patch.headers["Content-Type"] == "application/merge-patch+json"
    # A restarted agent: its first renewal finds the Lease there (409), and patches it; no
    # PATCH is ever refused with 404 (the agent's refused-writes alert counts those).
    kube_cluster._leases.clear()
    kube_cluster.renew_lease("kf", name, {"renewTime": "t3"})
    assert kube.count("POST", path) == 2 and kube.count("PATCH", f"{path}/{name}") == 2
    kube_cluster.blocking.request("DELETE", f"{path}/{name}", what="delete it")
    kube_cluster.renew_lease("kf", name, {"holderIdentity": "n1", "renewTime": "t4"})  # made
    assert kube.count("POST", path) == 3
    assert kube_cluster.blocking.request("GET", f"{path}/{name}", what="read it")["spec"][
        "renewTime"] == "t4"
    kube.fail("PATCH", f"{path}/{name}", 403, message="not your lease")
    with pytest.raises(KubeError, match=rf"^renew lease kf/{name}: .*403 Forbidden: not your"):
        kube_cluster.renew_lease("kf", name, {"renewTime": "t5"})


@pytest.mark.integration
async def test_a_gateways_answer_to_a_relist_keeps_the_agents_pods_and_limits(
        short_tmp: Path) -> None:
    # A 200 `{"status": "ok"}` (a gateway's, an auth proxy's) was taken for a consistent list
    # of no pods: the cache emptied and the next pass released every pod's limits and marker.
    rig = Rig(short_tmp, sm_sharing=False)
    uid = add_pod(rig)
    assert rig.step().converged
    limits, written = dict(rig.nvml.limits), rig.marker_path(uid).read_text()
    listed = {"kind": "PodList", "metadata": {"resourceVersion": "5"},
              "items": rig.cluster.pods_on(NODE)}
    expired = Stream(events(("ERROR", status(410, "Expired", "too old"))))
    cache = rig.agent.cache
    async with StandIn(Answer(200, listed), expired, Answer(200, {"status": "ok"})) as api:
        cluster = KubeCluster(k8s.ApiClient(k8s.Configuration(host=api.url)),
                              request_timeout=5.0)
        stop, thread = run_in_thread(PodWatcher(cluster, NODE, cache, Counter(),
                                                backoff=Backoff(base=0.01, cap=0.05)))
        try:
            await until(lambda: len(api.seen) >= 4, "two answers of the gateway")
        finally:
            stop.set()
            await asyncio.to_thread(thread.join, 2)
            cluster.close()
    assert set(cache.snapshot()) == {uid} and cache.synced
    assert cache.api_down_since is not None
    assert (cache.last_error or "").startswith(
        f"list pods of node {NODE}: the API server's answer is not a list: no `items`")
    assert (await asyncio.to_thread(rig.reconciler.reconcile)).converged
    assert rig.nvml.limits == limits and rig.marker_path(uid).read_text() == written
