"""The benchmark API stand-in's LIST and WATCH of pods, through the official `kubernetes` client
the way the mirror's watch cache uses them: a list, then a watch from the list's
resourceVersion that carries every change, the client's own writes included."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException
from kubernetes.watch import Watch
from kubernetes.watch.watch import iter_resp_lines

from benchmarks.stub_apiserver import kubeconfig, pod_uid, running, seed
from kai_fractions.kube.config import load_api_client

SCHEDULER = "kai-scheduler"
SELECTOR = f"spec.schedulerName={SCHEDULER}"
TEMPLATE = {"apiVersion": "v1", "kind": "Pod", "metadata": {"labels": {"app": "t"}},
            "spec": {"schedulerName": SCHEDULER, "containers": [{"name": "main"}]}}
MERGE_PATCH = "application/merge-patch+json"
TIMEOUT_S = 5  # any one request; a watch that should have ended or spoken by then is a failure


class Stub:
    def __init__(self, url: str, tmp: Path) -> None:
        self.url = url
        self.api = load_api_client(str(kubeconfig(url, tmp / "kubeconfig")))
        self.core = k8s.CoreV1Api(self.api)

    def stats(self) -> dict:
        with urllib.request.urlopen(self.url + "/stats", timeout=TIMEOUT_S) as response:
            return json.loads(response.read())

    def list(self, selector: str | None = SELECTOR) -> dict:
        response = self.core.list_pod_for_all_namespaces(
            field_selector=selector, _preload_content=False, _request_timeout=TIMEOUT_S)
        return json.loads(response.data)

    def watch(self, resource_version: str, timeout_s: int = TIMEOUT_S,
              selector: str | None = SELECTOR):
        """An open watch (the response, headers read); its events come from `events`."""
        return self.core.list_pod_for_all_namespaces(
            field_selector=selector, watch=True, allow_watch_bookmarks=True,
            resource_version=resource_version, timeout_seconds=timeout_s,
            _preload_content=False, _request_timeout=TIMEOUT_S + 2)

    def patch(self, namespace: str, name: str, metadata: dict) -> dict:
        response = self.core.patch_namespaced_pod(
            name, namespace, {"metadata": metadata}, _content_type=MERGE_PATCH,
            _preload_content=False, _request_timeout=TIMEOUT_S)
        return json.loads(response.data)


def events(response) -> Iterator[tuple[str, dict]]:
    for line in iter_resp_lines(response):
        event = json.loads(line)
        yield event["type"], event["object"]


def watchers_drained(stub: Stub) -> bool:
    """Whether the stub's open watches drop to none (a close reaches it a moment later)."""
    deadline = time.monotonic() + TIMEOUT_S
    while stub.stats()["watchers"] and time.monotonic() < deadline:
        time.sleep(0.01)
    return stub.stats()["watchers"] == 0


def names_of(pods: list[dict]) -> set[tuple[str, str]]:
    return {(p["metadata"]["namespace"], p["metadata"]["name"]) for p in pods}


@pytest.fixture(scope="module")
def stub(tmp_path_factory) -> Iterator[Stub]:
    with running(TEMPLATE) as url:
        stub = Stub(url, tmp_path_factory.mktemp("stub"))
        yield stub
        stub.api.close()


def test_list_with_and_without_the_scheduler_selector(stub: Stub):
    seed(stub.url, "list", ["a", "b"])
    for selector in (SELECTOR, None, "", f"spec.schedulerName=={SCHEDULER}",
                     f"{SELECTOR},status.phase=Pending", "status.phase=Pending"):
        listed = stub.list(selector)
        assert (listed["apiVersion"], listed["kind"]) == ("v1", "PodList")
        assert {("list", "a"), ("list", "b")} <= names_of(listed["items"]), selector
    assert stub.list("spec.schedulerName=nobody-uses-this")["items"] == []
    for unsupported in ("spec.nodeName=n1", f"spec.schedulerName!={SCHEDULER}",
                        f"{SELECTOR},spec.nodeName=n1", "status.phase=Running"):
        with pytest.raises(ApiException) as refused:
            stub.list(unsupported)
        assert refused.value.status == 400
        assert json.loads(refused.value.body)["kind"] == "Status"


def test_a_seeded_pod_is_listed_with_its_own_resource_version(stub: Stub):
    assert seed(stub.url, "seeded", ["p0", "p1"]) == 2
    assert seed(stub.url, "seeded", ["p1", "p2"]) == 1  # p1 is there already
    listed = stub.list()
    pods = {p["metadata"]["name"]: p for p in listed["items"]
            if p["metadata"]["namespace"] == "seeded"}
    assert sorted(pods) == ["p0", "p1", "p2"]
    p0 = pods["p0"]["metadata"]
    assert p0["uid"] == pod_uid("seeded", "p0")
    assert p0["labels"] == {"app": "t"}
    versions = [int(pods[n]["metadata"]["resourceVersion"]) for n in ("p0", "p1", "p2")]
    assert versions == sorted(set(versions))  # one revision each, in creation order
    assert int(listed["metadata"]["resourceVersion"]) >= versions[-1]
    # The typed client reads the same answer.
    typed = stub.core.list_pod_for_all_namespaces(field_selector=SELECTOR,
                                                  _request_timeout=TIMEOUT_S)
    assert {("seeded", "p0"), ("seeded", "p2")} <= {
        (p.metadata.namespace, p.metadata.name) for p in typed.items}


def test_a_patch_is_modified_on_an_open_watch(stub: Stub):
    seed(stub.url, "patched", ["p0"])
    listed = stub.list()
    before = next(p for p in listed["items"]
                  if names_of([p]) == {("patched", "p0")})["metadata"]["resourceVersion"]
    response = stub.watch(listed["metadata"]["resourceVersion"])
    try:
        answered = stub.patch("patched", "p0", {
            "uid": pod_uid("patched", "p0"), "resourceVersion": before,
            "annotations": {"k": "v"}})
        seen = next(events(response))
    finally:
        response.close()
    event_type, pod = seen
    assert event_type == "MODIFIED"
    assert names_of([pod]) == {("patched", "p0")}
    assert pod["metadata"]["annotations"] == {"k": "v"}
    assert pod["metadata"]["resourceVersion"] == answered["metadata"]["resourceVersion"]
    assert int(pod["metadata"]["resourceVersion"]) > int(before)


def test_a_pod_made_by_its_first_get_is_added_and_is_not_kais(stub: Stub):
    """Unseeded pods belong to another scheduler: a watch of KAI's pods never sees them."""
    kais = stub.watch(stub.list()["metadata"]["resourceVersion"], timeout_s=1)
    response = stub.watch(stub.list()["metadata"]["resourceVersion"], selector=None)
    try:
        read = stub.core.read_namespaced_pod("p0", "lazy", _preload_content=False,
                                             _request_timeout=TIMEOUT_S)
        version = json.loads(read.data)["metadata"]["resourceVersion"]
        event_type, pod = next(events(response))
        assert list(events(kais)) == []  # the stream ends after its second, empty
    finally:
        response.close()
        kais.close()
    assert (event_type, names_of([pod])) == ("ADDED", {("lazy", "p0")})
    assert pod["metadata"]["resourceVersion"] == version != "1"
    assert pod["spec"]["schedulerName"] == "default-scheduler"


def test_a_watch_from_an_old_resource_version_replays_what_it_missed(stub: Stub):
    seed(stub.url, "replay", ["p0"])
    since = stub.list()["metadata"]["resourceVersion"]
    seed(stub.url, "replay", ["p1", "p2"])
    patched = stub.patch("replay", "p1", {"annotations": {"k": "v"}})
    response = stub.watch(since)
    try:
        seen: list[tuple[str, str, str]] = []
        for event_type, pod in events(response):
            if pod["metadata"]["namespace"] == "replay":  # other tests share the stub
                seen.append((event_type, pod["metadata"]["name"],
                             pod["metadata"]["resourceVersion"]))
            if len(seen) == 3:
                break
    finally:
        response.close()
    assert [(t, n) for t, n, _ in seen] == [("ADDED", "p1"), ("ADDED", "p2"),
                                           ("MODIFIED", "p1")]
    assert seen[-1][2] == patched["metadata"]["resourceVersion"]
    assert all(int(v) > int(since) for _, _, v in seen)


def test_the_stream_ends_after_timeout_seconds(stub: Stub):
    begin = time.monotonic()
    response = stub.watch(stub.list()["metadata"]["resourceVersion"], timeout_s=1)
    try:
        assert list(events(response)) == []
    finally:
        response.release_conn()
    assert 0.9 <= time.monotonic() - begin < 3
    # The connection served the watch to its end: it is reused for the next request.
    assert stub.list()["kind"] == "PodList"


def test_a_closed_connection_drops_its_watcher(stub: Stub):
    assert watchers_drained(stub)  # earlier tests' closes are seen by now
    response = stub.watch(stub.list()["metadata"]["resourceVersion"], timeout_s=60)
    assert stub.stats()["watchers"] == 1
    response.close()
    assert watchers_drained(stub)
    seed(stub.url, "after-close", ["p0"])  # nothing is written to the dropped watcher
    assert stub.stats()["watchers"] == 0


def test_the_typed_watch_follows_a_list(stub: Stub):
    """The client's own Watch helper (what a watch cache runs): events as V1Pod objects."""
    listed = stub.core.list_pod_for_all_namespaces(field_selector=SELECTOR,
                                                   _request_timeout=TIMEOUT_S)
    seed(stub.url, "typed", ["p0"])
    watch = Watch()
    for event in watch.stream(stub.core.list_pod_for_all_namespaces,
                              field_selector=SELECTOR, allow_watch_bookmarks=True,
                              resource_version=listed.metadata.resource_version,
                              timeout_seconds=TIMEOUT_S, _request_timeout=TIMEOUT_S + 2):
        pod = event["object"]
        if pod.metadata.namespace == "typed":
            watch.stop()
            break
    assert (event["type"], pod.metadata.name, pod.spec.scheduler_name) == (
        "ADDED", "p0", SCHEDULER)


def test_a_resource_version_older_than_the_history_is_gone(tmp_path):
    with running(TEMPLATE, history=2) as url:
        stub = Stub(url, tmp_path)
        try:
            since = stub.list()["metadata"]["resourceVersion"]
            seed(url, "old", ["p0", "p1", "p2"])  # three changes: the first one is forgotten
            response = stub.watch(since)
            try:
                seen = list(events(response))  # the stream ends by itself
            finally:
                response.release_conn()
            assert len(seen) == 1
            event_type, status = seen[0]
            assert event_type == "ERROR"
            assert (status["kind"], status["code"], status["reason"]) == ("Status", 410,
                                                                          "Expired")
            # One later is still in the history: replayed, not gone.
            response = stub.watch(str(int(since) + 1))
            try:
                first = next(events(response))
            finally:
                response.close()
            assert (first[0], first[1]["metadata"]["name"]) == ("ADDED", "p1")
            assert watchers_drained(stub)  # the one that got 410 was never one
        finally:
            stub.api.close()


def test_the_scheduler_of_a_pod_cannot_change(stub: Stub):
    """What watches select on stays put, as on a real API server (spec.schedulerName is
    immutable)."""
    seed(stub.url, "immutable", ["p0"])
    with pytest.raises(ApiException) as refused:
        stub.core.patch_namespaced_pod("p0", "immutable", {"spec": {"schedulerName": "other"}},
                                       _content_type=MERGE_PATCH, _request_timeout=TIMEOUT_S)
    assert refused.value.status == 422
    assert stub.patch("immutable", "p0", {"labels": {"x": "y"}})["spec"]["schedulerName"] == (
        SCHEDULER)


def test_a_list_with_a_limit_comes_in_pages_of_one_snapshot(stub: Stub):
    seed(stub.url, "paged", [f"p{i}" for i in range(5)])
    everything = stub.list()
    pages, token = [], None
    while True:
        response = stub.core.list_pod_for_all_namespaces(
            field_selector=SELECTOR, limit=2, _continue=token, _preload_content=False,
            _request_timeout=TIMEOUT_S)
        page = json.loads(response.data)
        pages.append(page)
        if len(pages) == 1:
            seed(stub.url, "paged", ["late"])  # after the snapshot: not in this list
        token = page["metadata"].get("continue")
        if not token:
            break
    assert all(len(p["items"]) == 2 for p in pages[:-1]) and len(pages[-1]["items"]) <= 2
    assert {p["metadata"]["resourceVersion"] for p in pages} == {
        everything["metadata"]["resourceVersion"]}
    assert names_of([i for p in pages for i in p["items"]]) == names_of(everything["items"])
    with pytest.raises(ApiException) as used:  # a token serves its page once
        stub.core.list_pod_for_all_namespaces(field_selector=SELECTOR, limit=2,
                                              _continue=pages[0]["metadata"]["continue"],
                                              _request_timeout=TIMEOUT_S)
    assert used.value.status == 410


def test_expire_ends_every_watch_with_410(stub: Stub):
    response = stub.watch(stub.list()["metadata"]["resourceVersion"])
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while stub.stats()["watchers"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        request = urllib.request.Request(stub.url + "/expire", data=b"", method="POST")
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as answer:
            assert json.loads(answer.read())["expired"] >= 1
        seen = list(events(response))
    finally:
        response.close()
    assert [(kind, obj.get("code")) for kind, obj in seen] == [("ERROR", 410)]
    # The history went with it: a watch from before the expiry is told so at once.
    late = stub.watch("2")
    try:
        assert [(kind, obj.get("code")) for kind, obj in events(late)] == [("ERROR", 410)]
    finally:
        late.close()


def test_a_namespace_is_listed_by_label_and_seeded_pods_carry_their_own(stub: Stub):
    seed(stub.url, "reservations", ["r-a"], labels={"group": "a"},
         annotations={"gpu": "GPU-a"})
    seed(stub.url, "reservations", ["r-b"], labels={"group": "b"})
    seed(stub.url, "elsewhere", ["r-c"], labels={"group": "a"})
    found = stub.core.list_namespaced_pod("reservations", label_selector="group=a",
                                          _request_timeout=TIMEOUT_S)
    (pod,) = found.items
    assert (pod.metadata.name, pod.metadata.labels, pod.metadata.annotations) == (
        "r-a", {"app": "t", "group": "a"}, {"gpu": "GPU-a"})
    every = stub.core.list_namespaced_pod("reservations", _request_timeout=TIMEOUT_S)
    assert sorted(p.metadata.name for p in every.items) == ["r-a", "r-b"]
    with pytest.raises(ApiException) as refused:
        stub.core.list_namespaced_pod("reservations", label_selector="group!=a",
                                      _request_timeout=TIMEOUT_S)
    assert refused.value.status == 400


def test_with_a_latency_every_api_answer_comes_that_much_later(tmp_path):
    with running(TEMPLATE, latency_ms=50) as url:
        slow = Stub(url, tmp_path)
        seed(url, "default", ["p0"])  # setting the scene is not delayed
        began = time.perf_counter()
        slow.core.read_namespaced_pod("p0", "default", _request_timeout=TIMEOUT_S)
        slow.core.read_namespaced_pod("p0", "default", _request_timeout=TIMEOUT_S)
        assert time.perf_counter() - began >= 0.1  # each answer waited, in order
        slow.api.close()


def test_an_indexed_jobs_completion_index_is_each_pods_own(tmp_path):
    """P6's queue is an Indexed Job's pods (round seventeen): the template's completion index,
    label and annotation, becomes each pod's own, from the number its name ends with."""
    from benchmarks.stub_apiserver import COMPLETION_INDEX

    template = {**TEMPLATE, "metadata": {**TEMPLATE["metadata"],
                                         "labels": {"app": "t", COMPLETION_INDEX: "x"},
                                         "annotations": {COMPLETION_INDEX: "x"}}}
    with running(template) as url:
        stub = Stub(url, tmp_path)
        try:
            seed(url, "indexed", ["train-7", "train-12"])
            pods = {p["metadata"]["name"]: p["metadata"] for p in stub.list()["items"]
                    if p["metadata"]["namespace"] == "indexed"}
        finally:
            stub.api.close()
    assert {n: (m["labels"][COMPLETION_INDEX], m["annotations"][COMPLETION_INDEX])
            for n, m in pods.items()} == {"train-7": ("7", "7"), "train-12": ("12", "12")}
    assert pods["train-7"]["labels"]["app"] == "t"
