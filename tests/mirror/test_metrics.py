"""The mirror's Prometheus metrics (`MirrorMetrics`): calls by method and status code, API
requests, the pod cache read at scrape time, the follower's results and signature delay, and
the registry served over HTTP."""

from __future__ import annotations

import asyncio
import datetime
import urllib.request

import grpc
import pytest

from kai_fractions.kube.objects import seconds_since
from kai_fractions.metrics_http import MetricsEndpoint
from kai_fractions.mirror.bindrequest_view import BindRequestView
from kai_fractions.mirror.follower import Follower
from kai_fractions.mirror.metrics import MirrorMetrics, check_result
from kai_fractions.mirror.pod_cache import PodCache
from kai_fractions.signing import Keyring, KeyringSource
from tests.support.agent_process import wait_for
from tests.support.fake_store import FakePodStore

from .messages import allocation, mirror_request
from .test_follower import BOUND, bind_request, one_group_store, pod, versioned


def sample(metrics: MirrorMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


# -- through the real server ------------------------------------------------------------------

@pytest.mark.integration
def test_calls_api_requests_and_the_pod_cache_are_counted(mirror_factory):
    metrics = MirrorMetrics()
    mirror = mirror_factory(pod_cache=True, metrics=metrics)
    created = mirror.create_pod("train-0", {"gpu-fraction": "0.5"})
    wait_for(lambda: sample(metrics, "kai_fractions_mirror_pod_cache_pods") == 1,
             what="the pod cache's list")
    mirror.stub.MirrorAllocation(mirror_request(allocation(created)))
    with pytest.raises(grpc.RpcError) as refused:
        mirror.stub.MirrorAllocation(mirror_request(allocation(created, portion="2")))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    def calls(code: str) -> float | None:
        return sample(metrics, "kai_fractions_mirror_calls_total", method="MirrorAllocation",
                      code=code)

    # A refusal reaches the caller as its handler unwinds, a moment before it is counted.
    wait_for(lambda: calls("INVALID_ARGUMENT") == 1, what="the refusal counted")
    assert calls("OK") == 1
    assert sample(metrics, "kai_fractions_mirror_call_duration_seconds_count",
                  method="MirrorAllocation") == 2
    assert sample(metrics, "kai_fractions_mirror_api_requests_total", verb="PATCH",
                  code="200") == 1
    assert sample(metrics, "kai_fractions_mirror_api_requests_total", verb="WATCH",
                  code="200") >= 1  # the cache's watch
    assert sample(metrics, "kai_fractions_mirror_api_requests_total", verb="GET",
                  code="200") >= 1  # its list
    assert sample(metrics, "kai_fractions_mirror_pod_cache_synced") == 1
    assert sample(metrics, "kai_fractions_mirror_pod_cache_lists_total") == 1
    assert sample(metrics, "kai_fractions_mirror_pod_cache_lookups_total", result="hit") >= 1


@pytest.mark.integration
def test_a_call_refused_for_its_token_is_counted_not_timed(mirror_factory, tmp_path):
    (tmp_path / "token").write_text("sesame")
    metrics = MirrorMetrics()
    mirror = mirror_factory(token_file=str(tmp_path / "token"), metrics=metrics)
    created = mirror.create_pod("train-0", {"gpu-fraction": "0.5"})
    with pytest.raises(grpc.RpcError) as refused:
        mirror.stub.MirrorAllocation(mirror_request(allocation(created)))
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    mirror.stub.MirrorAllocation(mirror_request(allocation(created)),
                                 metadata=(("authorization", "Bearer sesame"),))
    wait_for(lambda: sample(metrics, "kai_fractions_mirror_calls_total",
                            method="MirrorAllocation", code="OK") == 1)
    assert sample(metrics, "kai_fractions_mirror_calls_total", method="MirrorAllocation",
                  code="UNAUTHENTICATED") == 1
    assert sample(metrics, "kai_fractions_mirror_call_duration_seconds_count",
                  method="MirrorAllocation") == 1  # only the call that ran


def test_the_registry_is_served_over_http_with_the_process_figures():
    metrics = MirrorMetrics()
    metrics.call("ReleaseAllocation", "NOT_FOUND", 0.003)
    endpoint = MetricsEndpoint(metrics.registry)
    host, port = endpoint.serve("127.0.0.1:0")
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as answer:
            text = answer.read().decode()
    finally:
        endpoint.close()
    assert ('kai_fractions_mirror_calls_total{code="NOT_FOUND",method="ReleaseAllocation"} 1.0'
            in text)
    assert "process_resident_memory_bytes" in text


def test_a_bad_listen_address_names_the_flag():
    with pytest.raises(ValueError, match=r"^--metrics-listen: expected HOST:PORT, got 'x'$"):
        MetricsEndpoint(MirrorMetrics().registry).serve("x")


# -- read at scrape time ----------------------------------------------------------------------

def test_the_pod_cache_and_the_lease_are_read_when_scraped():
    metrics = MirrorMetrics()
    cache = PodCache()
    leading = [False]
    metrics.watch_pod_cache(cache)
    metrics.watch_leading(lambda: leading[0])
    assert (sample(metrics, "kai_fractions_mirror_pod_cache_pods"),
            sample(metrics, "kai_fractions_mirror_pod_cache_synced"),
            sample(metrics, "kai_fractions_follower_leading")) == (0, 0, 0)
    cache.replace([{**pod(f"p{i}", {}), "metadata": {
        "name": f"p{i}", "namespace": "team-a", "uid": f"u{i}", "resourceVersion": "1"}}
        for i in range(3)])
    cache.lookup("team-a", "p0")
    cache.lookup("team-a", "absent")
    leading[0] = True
    assert (sample(metrics, "kai_fractions_mirror_pod_cache_pods"),
            sample(metrics, "kai_fractions_mirror_pod_cache_synced"),
            sample(metrics, "kai_fractions_mirror_pod_cache_lists_total"),
            sample(metrics, "kai_fractions_mirror_pod_cache_lookups_total", result="hit"),
            sample(metrics, "kai_fractions_mirror_pod_cache_lookups_total", result="miss"),
            sample(metrics, "kai_fractions_follower_leading")) == (3, 1, 1, 1, 1, 1)


# -- the follower -----------------------------------------------------------------------------

def created_ago(br: dict, seconds: float) -> dict:
    then = datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=seconds)
    meta = {**br["metadata"], "creationTimestamp": then.strftime("%Y-%m-%dT%H:%M:%SZ")}
    return {**br, "metadata": meta}


@pytest.fixture
def store() -> FakePodStore:
    return one_group_store()


async def test_each_check_is_counted_by_its_result_and_a_signature_timed_from_the_bind(store):
    metrics = MirrorMetrics()
    follower = Follower(store, signer=KeyringSource.fixed(Keyring.of(b"k" * 32)))
    store.add_pod(pod("good-0", {"gpu-fraction": "0.5", **BOUND}))
    store.add_pod(pod("wrong-0", {"gpu-fraction": "0.5"}))

    async def check(br: dict):
        return await metrics.check(follower.follow_one, BindRequestView.from_object(br))

    signed = await check(created_ago(versioned(bind_request("br-1", "good-0")), 3))
    assert signed is not None and signed.signed
    assert await check(created_ago(versioned(bind_request("br-1", "good-0")), 3)) is None
    await check(bind_request("br-2", "wrong-0"))
    await check(bind_request("br-3", "good-0", phase="Pending"))

    def checks(result: str) -> float | None:
        return sample(metrics, "kai_fractions_follower_checks_total", result=result)

    assert [checks(r) for r in ("complete", "unchanged", "mismatch", "skipped")] == [1, 1, 1, 1]
    delay = "kai_fractions_follower_signature_delay_seconds"
    assert sample(metrics, f"{delay}_count") == 1  # only the check that signed
    assert sample(metrics, f"{delay}_bucket", le="2.0") == 0
    assert sample(metrics, f"{delay}_bucket", le="5.0") == 1  # 3 s, give or take a second


async def test_a_pod_signed_again_under_a_new_key_did_not_wait_and_is_not_timed(store):
    metrics = MirrorMetrics()
    store.add_pod(pod("good-0", {"gpu-fraction": "0.5", **BOUND}))
    view = BindRequestView.from_object(created_ago(versioned(bind_request("br-1", "good-0")),
                                                   3600))
    retired = Follower(store, signer=KeyringSource.fixed(Keyring.of(b"o" * 32)))
    assert (await retired.follow_one(view)).resigned is False
    follower = Follower(store, signer=KeyringSource.fixed(Keyring.of(b"n" * 32)))
    again = await metrics.check(follower.follow_one, view)  # the old key no longer verifies
    assert again.signed and again.resigned
    assert sample(metrics, "kai_fractions_follower_checks_total", result="complete") == 1
    assert sample(metrics, "kai_fractions_follower_signature_delay_seconds_count") == 0


async def test_a_check_in_progress_is_a_gauge_and_one_that_raises_an_error():
    metrics = MirrorMetrics()
    started, release = asyncio.Event(), asyncio.Event()

    async def slow(_br):
        started.set()
        await release.wait()
        raise RuntimeError("the API went away")

    view = BindRequestView.from_object(bind_request("br-1", "good-0"))
    task = asyncio.create_task(metrics.check(slow, view))
    await started.wait()
    assert sample(metrics, "kai_fractions_follower_checks_in_progress") == 1
    release.set()
    with pytest.raises(RuntimeError):
        await task
    assert sample(metrics, "kai_fractions_follower_checks_in_progress") == 0
    assert sample(metrics, "kai_fractions_follower_checks_total", result="error") == 1


def test_check_results_and_timestamps():
    from kai_fractions.contract import ContractError
    from kai_fractions.mirror.verification import Mismatch, Verification

    v = Verification("ns/br", "ns/p")
    assert [check_result(x) for x in (
        None, v, v.__class__("ns/br", "ns/p", mismatches=(Mismatch("k", "1", "2"),)),
        v.__class__("ns/br", "ns/p", errors=(ContractError("f", "bad"),)),
        v.__class__("ns/br", "ns/p", skipped="phase Pending"),
        v.__class__("ns/br", "ns/p", unsigned="no node"))] == [
        "unchanged", "complete", "mismatch", "invalid", "skipped", "unsigned"]
    noon = datetime.datetime(2026, 12, 2, 12, tzinfo=datetime.UTC).timestamp()
    assert seconds_since("2026-12-02T11:59:30Z", now=noon) == 30
    assert seconds_since("2026-12-02T12:00:05Z", now=noon) == 0  # the server's clock ahead
    assert seconds_since("", now=noon) is None
    assert seconds_since("yesterday", now=noon) is None
