"""kube.blocking.BlockingKube against kmock: the same requests, results and errors from a
thread, a list + watch spawned on its loop, and close."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from kai_fractions.kube import MERGE_PATCH, Conflict, NotFound, objects
from kai_fractions.kube.blocking import BlockingKube
from kai_fractions.kube.listwatch import Collection, list_watch
from tests.support.kube import pod_manifest

pytestmark = pytest.mark.integration

NS, NAME = "team-a", "train-0"
TIMEOUT = 5.0


@pytest.fixture
def blocking(kube):
    face = BlockingKube(kube.api_client, name="kube-test-loop")
    yield face
    face.close()


def until(predicate, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert predicate(), what


def test_request_and_call_return_what_the_kube_returns(kube, blocking):
    created = kube.core.create_namespaced_pod(NS, pod_manifest(NAME, NS)).metadata
    read = blocking.request("GET", objects.pod_path(NS, NAME), what="read pod")
    assert read["metadata"]["uid"] == created.uid
    written = blocking.call(lambda k: k.request(
        "PATCH", objects.pod_path(NS, NAME), what="patch pod", content_type=MERGE_PATCH,
        body=objects.annotation_patch({"a": "1"}, uid=created.uid,
                                      resource_version=created.resource_version)))
    assert written["metadata"]["annotations"] == {"a": "1"}


def test_errors_are_raised_in_the_callers_thread_as_the_kube_raised_them(kube, blocking):
    created = kube.core.create_namespaced_pod(NS, pod_manifest(NAME, NS)).metadata
    with pytest.raises(NotFound, match=r"^read pod team-a/gone: 404"):
        blocking.request("GET", objects.pod_path(NS, "gone"), what="read pod team-a/gone")
    kube.core.patch_namespaced_pod(NAME, NS, {"metadata": {"labels": {"x": "y"}}})
    with pytest.raises(Conflict):
        blocking.request("PATCH", objects.pod_path(NS, NAME), what="patch pod",
                         content_type=MERGE_PATCH, body=objects.annotation_patch(
                             {"a": "1"}, resource_version=created.resource_version))


def test_requests_run_on_the_faces_own_thread(blocking):
    ran_on: list[str] = []

    async def work(kube: Any) -> str:
        ran_on.append(threading.current_thread().name)
        return "done"

    assert blocking.call(work) == "done"
    assert ran_on == ["kube-test-loop"]


def spawn_watch(kube, blocking, names: set[str]):
    kube.core.create_namespaced_pod(NS, pod_manifest("before", NS))

    def track(items: list[Any]) -> None:
        names.update(item["metadata"]["name"] for item in items)

    return blocking.spawn(lambda k: list_watch(
        Collection(k, objects.pods_path(NS), what="pod(s)", watch_seconds=5), track,
        lambda kind, obj: names.add(obj["metadata"]["name"])))


@pytest.mark.parametrize("ended_by", ["close", "cancel"])
def test_a_spawned_list_watch_runs_until_close_or_cancel_ends_it(kube, ended_by):
    face = BlockingKube(kube.api_client)
    names: set[str] = set()
    try:
        future = spawn_watch(kube, face, names)
        until(lambda: "before" in names, "listed")
        kube.core.create_namespaced_pod(NS, pod_manifest("after", NS))
        until(lambda: "after" in names, "watched")
        assert not future.done()
        if ended_by == "cancel":
            future.cancel()
            until(future.done, "cancelled")
            # the face goes on serving requests
            assert face.request("GET", objects.pod_path(NS, "after"), what="read pod")
    finally:
        face.close()
    assert future.cancelled()
    assert not face._thread.is_alive()


def test_close_is_idempotent_and_ends_the_thread(kube):
    face = BlockingKube(kube.api_client)
    face.request("GET", objects.pods_path(NS), what="list pods")
    face.close()
    face.close()
    assert not face._thread.is_alive()
