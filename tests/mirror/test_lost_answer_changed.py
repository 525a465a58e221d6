"""A write whose answer was lost after it landed: the store's retry meets the version that very
write made (409), and the call still answers `changed` as the write would have.

The API server applies a PATCH and the answer is lost (a timeout, a reset): KubePodStore sends
the same PATCH again, still guarded by the old resourceVersion, and the API server refuses it
409. The service re-reads the pod, finds its allocation there, and used to answer
`changed=false` for a call that wrote it (the proto: "True when this call wrote the
allocation's annotations"). A 409 after a try that WAS answered is another writer's, and is
answered as before.
"""

from __future__ import annotations

import contextlib
import copy
import json
import random
import socket
from dataclasses import replace

import grpc
import pytest
from kubernetes import client as k8s

from kai_fractions.api.v1 import allocation_pb2 as pb
from kai_fractions.kube import errors as kerr
from kai_fractions.kube.client import Kube
from kai_fractions.kube.retry import Backoff
from kai_fractions.mirror.decision import AllocationInput
from kai_fractions.mirror.kube_store import KubePodStore
from kai_fractions.mirror.pod_cache import PodCache
from kai_fractions.mirror.record import MIRRORED_ANNOTATION
from kai_fractions.mirror.service import MirrorService
from kai_fractions.mirror.store import PodSnapshot, WriteConflict
from tests.support.clock import FakeClock
from tests.support.fake_store import FakePodStore

from .messages import allocation as grpc_allocation
from .messages import mirror_request

NS, POD = "team-a", "train-0"
UID = "11111111-2222-3333-4444-555555555555"
DEVICES = "nvidia.com/container.trainer.gpus.devices"


# -- the real store over the API stand-in, two replicas (the review's case D) ----------------


def lose_answers(harness, pod: str, times: int = 1) -> list[str]:
    """The next `times` PATCHes of `pod` through `harness`'s store land, and their answers are
    lost (a timeout at this end). Returns the methods whose answers were lost, as they go."""
    kube = harness.store.kube
    send = kube.request
    lost: list[str] = []

    async def request(method, path, **kw):
        answer = await send(method, path, **kw)
        if method == "PATCH" and path.endswith(f"/pods/{pod}") and len(lost) < times:
            lost.append(method)
            raise kerr.unreachable(kw.get("what", "patch"), TimeoutError())
        return answer

    kube.request = request
    return lost


def mirror_call(harness, request) -> tuple[str, bool | str]:
    try:
        return "OK", harness.stub.MirrorAllocation(request, timeout=10).changed
    except grpc.RpcError as e:
        return e.code().name, e.details()


@pytest.mark.integration
def test_a_mirror_whose_answer_was_lost_answers_changed_and_its_retries_do_not(
        mirror_factory):
    """Before: the call that wrote the allocation answered changed=false (its retried PATCH
    was refused 409 by its own write's version, the re-read found nothing to write). Now it
    answers changed=true; KAI's retry of the call, to this replica or the other, writes nothing
    and answers changed=false."""
    r1, r2 = mirror_factory(), mirror_factory(pod_cache=True)
    pod = r1.create_pod("lost", {"gpu-fraction": "0.5"})
    request = mirror_request(grpc_allocation(pod), key="bind-lost")
    lost = lose_answers(r1, "lost")
    assert mirror_call(r1, request) == ("OK", True)
    assert lost == ["PATCH"]  # the answer was lost, once
    assert r1.patches(NS, "lost") == 2  # the write, and its retry refused 409
    written = r1.annotations(NS, "lost")
    assert json.loads(written[MIRRORED_ANNOTATION])["idempotencyKey"] == "bind-lost"
    for replica in (r2, r1):  # KAI's retry, to either replica: nothing new to write
        assert mirror_call(replica, request) == ("OK", False)
    assert r1.patches(NS, "lost") == 2
    assert r1.annotations(NS, "lost") == written


@pytest.mark.integration
def test_a_release_whose_answer_was_lost_answers_what_it_removed(mirror_factory):
    """Before: a release whose write landed unanswered answered changed=false and no removed
    keys. Now it answers what it removed; its retry removes nothing and says so."""
    r1 = mirror_factory()
    pod = r1.create_pod("gone", {"gpu-fraction": "0.5"})
    alloc = grpc_allocation(pod)
    assert mirror_call(r1, mirror_request(alloc, key="bind-1")) == ("OK", True)
    owned = sorted(json.loads(r1.annotations(NS, "gone")[MIRRORED_ANNOTATION])["keys"])
    lose_answers(r1, "gone")
    release = pb.ReleaseAllocationRequest(pod=alloc.pod, idempotency_key="release-1")
    released = r1.stub.ReleaseAllocation(release, timeout=10)
    assert (released.changed, list(released.removed_keys)) == (True, owned)
    again = r1.stub.ReleaseAllocation(release, timeout=10)
    assert (again.changed, list(again.removed_keys)) == (False, [])
    assert r1.patches(NS, "gone") == 3  # the bind, the release and its refused retry


# -- the store: which 409 may be the write's own -----------------------------------------------


class ScriptedPatches:
    """Answers PATCHes from `script`: "ok", "lost" (applied, answer lost: a timeout) or
    "409" (refused for its resourceVersion)."""

    def __init__(self, *script: str) -> None:
        self.script = list(script)

    async def request(self, method, path, *, what, **_):
        step = self.script.pop(0)
        if step == "409":
            raise kerr.refused(what, 409, "Conflict", b'{"message":"the object has been '
                                                      b'modified"}')
        if step == "lost":
            raise kerr.unreachable(what, TimeoutError())
        return {"metadata": {"name": "p", "namespace": "ns", "uid": "u",
                             "resourceVersion": "4"}}

    async def close(self) -> None:
        pass


async def conflict_from(*script: str) -> WriteConflict:
    store = KubePodStore(ScriptedPatches(*script), backoff=Backoff(attempts=3, base=0.001),
                         clock=FakeClock(), rng=random.Random(0))
    with pytest.raises(WriteConflict) as info:
        await store.patch_annotations("ns", "p", {"a": "1"}, uid="u", resource_version="3")
    return info.value


async def test_a_retry_refused_409_after_a_lost_answer_may_be_the_writes_own():
    """Before: the store's WriteConflict did not say that the try before got no answer. Now
    it does (may_have_landed), and its message says why."""
    conflict = await conflict_from("lost", "409")
    assert conflict.may_have_landed is True
    assert "a try before it failed, no answer in time, and may have landed" in str(conflict)


async def test_a_409_to_the_first_try_is_another_writers():
    conflict = await conflict_from("409")
    assert conflict.may_have_landed is False


# -- the service over the in-memory store ------------------------------------------------------


def pod(annotations: dict[str, str]) -> dict:
    return {"metadata": {"name": POD, "namespace": NS, "uid": UID,
                         "annotations": dict(annotations)},
            "spec": {"containers": [{"name": "trainer"}]}}


def allocation(**changes) -> AllocationInput:
    return replace(AllocationInput(
        namespace=NS, pod_name=POD, pod_uid=UID, selected_node="node-1",
        resource_type="Fraction", gpu_count=1, portion="0.5", group_ids=("g-1",),
        group_modes=("time-slicing",), gpu_ids=("GPU-1111aaaa",), node_gpu_memory_mib=40960),
        **changes)


class RacedStore(FakePodStore):
    """The next write of a pod goes as `race` says: "lost" applies it and raises the store's
    409 for a retry after a lost answer; "twin" lets another replica write the same changes
    first, then refuses this write 409 as an API server would; "other" lets another writer
    change a user annotation first, likewise."""

    race: str = ""

    async def patch_annotations(self, namespace, name, changes, *, uid, resource_version,
                                deadline=None, **kw) -> PodSnapshot:
        race, self.race = self.race, ""
        if race == "lost":
            await super().patch_annotations(namespace, name, changes, uid=uid,
                                            resource_version=resource_version)
            raise WriteConflict("the object has been modified", may_have_landed=True)
        if race == "twin":
            await super().patch_annotations(namespace, name, changes, uid="",
                                            resource_version="")
        if race == "other":
            await super().patch_annotations(namespace, name, {"team": "a"}, uid="",
                                            resource_version="")
        return await super().patch_annotations(namespace, name, changes, uid=uid,
                                               resource_version=resource_version)


@pytest.fixture
def store() -> RacedStore:
    store = RacedStore(nodes={"node-1": {}})
    store.add_pod(pod({"gpu-fraction": "0.5"}))
    return store


@pytest.fixture
def service(store: RacedStore) -> MirrorService:
    return MirrorService(store, clock=FakeClock())


async def test_the_service_answers_changed_for_its_own_write_met_by_its_retry(store, service):
    """Before: changed=false for the call whose write landed. Now changed=true, one write;
    the call's retry answers changed=false and writes nothing."""
    store.race = "lost"
    result = await service.mirror(allocation(), idempotency_key="bind-1")
    assert result.changed is True
    assert result.resource_version == store.pods[(NS, POD)]["metadata"]["resourceVersion"]
    assert len(store.patches) == 1
    again = await service.mirror(allocation(), idempotency_key="bind-1")
    assert again.changed is False and len(store.patches) == 1


async def test_a_409_from_another_replicas_identical_write_still_answers_unchanged(
        store, service):
    """The same pod as after a lost answer, but this call's write was answered 409: another
    replica wrote the same call first. As before, this one answers changed=false."""
    store.race = "twin"
    result = await service.mirror(allocation(), idempotency_key="bind-1")
    assert result.changed is False
    assert len(store.patches) == 2  # the twin's write, this one's refused
    assert store.annotations(NS, POD)[DEVICES] == "GPU-1111aaaa"


async def test_a_409_from_another_writer_rereads_and_writes_as_before(store, service):
    """Another writer changed the pod before this call's answered write: as before, the call
    re-reads, writes and answers changed=true."""
    store.race = "other"
    result = await service.mirror(allocation(), idempotency_key="bind-1")
    assert result.changed is True
    assert len(store.patches) == 3  # the other's, this one's refused, this one's again
    assert store.annotations(NS, POD)["team"] == "a"


async def test_a_repeat_under_a_new_key_whose_answer_was_lost_stays_unchanged(store, service):
    """A repeat of the allocation under a new key writes only that key into the record and
    answers changed=false: still so when its answer was lost."""
    await service.mirror(allocation(), idempotency_key="bind-1")
    store.race = "lost"
    result = await service.mirror(allocation(), idempotency_key="bind-2")
    assert result.changed is False
    assert json.loads(store.annotations(NS, POD)[MIRRORED_ANNOTATION])["aliasKeys"] == [
        "bind-2"]


async def test_the_service_answers_a_release_met_by_its_retry_as_done_by_it(store, service):
    """Before: changed=false and no removed keys for the release whose write landed. Now
    what it removed; its retry removes nothing."""
    await service.mirror(allocation(), idempotency_key="bind-1")
    store.race = "lost"
    released = await service.release(NS, POD, UID, idempotency_key="release-1")
    assert released.changed is True and DEVICES in released.removed_keys
    again = await service.release(NS, POD, UID, idempotency_key="release-1")
    assert (again.changed, again.removed_keys) == (False, ())


# -- only a try the API server may have applied makes a 409 the write's own ------------------


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def connection_refused(what: str) -> kerr.Transient:
    """What the real client raises for a request to a port nobody listens on: the connection
    is refused, the request never sent."""
    kube = Kube(k8s.ApiClient(k8s.Configuration(host=f"http://127.0.0.1:{closed_port()}")))
    try:
        await kube.request("PATCH", "/api/v1/namespaces/ns/pods/p", what=what, body=b"{}")
    except kerr.Transient as e:
        return e
    finally:
        await kube.close()
        kube.api_client.close()
    raise AssertionError("a closed port answered")


async def test_the_client_says_which_failures_the_server_may_have_applied():
    """Before: every transient failure looked alike. Now a refused connection says it was not
    sent, and a 429 that the server did not apply it; a lost answer and a 5xx may have been
    applied."""
    refused = await connection_refused("patch pod ns/p")
    assert (refused.sent, refused.may_have_applied) == (False, False)
    assert kerr.refused("x", 429, "TooManyRequests").may_have_applied is False
    for status in (500, 502, 503, 504):
        assert kerr.refused("x", status, "Error").may_have_applied is True
    for error in (TimeoutError(), ConnectionResetError(104, "Connection reset by peer")):
        assert kerr.unreachable("x", error).may_have_applied is True


async def scripted_conflict(*script: str) -> WriteConflict:
    """`conflict_from`, where "refused" is a connection the real client found refused,
    "429" a throttled try and "500" a server error."""
    store = KubePodStore(FailingFirst(*script), backoff=Backoff(attempts=4, base=0.001),
                         clock=FakeClock(), rng=random.Random(0))
    with pytest.raises(WriteConflict) as info:
        await store.patch_annotations("ns", "p", {"a": "1"}, uid="u", resource_version="3")
    return info.value


class FailingFirst(ScriptedPatches):
    async def request(self, method, path, *, what, **kw):
        step = self.script[0]
        if step == "refused":
            self.script.pop(0)
            raise await connection_refused(what)
        if step.isdigit() and step != "409":
            self.script.pop(0)
            raise kerr.refused(what, int(step), "Failure", b'{"message":"injected"}')
        return await super().request(method, path, what=what, **kw)


@pytest.mark.parametrize("first", ["429", "refused"])
async def test_a_409_after_a_try_the_server_did_not_apply_is_another_writers(first):
    """Before: a 409 after a throttled try (429: the API server's flow control refuses before
    any handler runs) or a refused connection (never sent) said the write may have landed,
    and the call answered changed=true for another replica's write. Now it does not."""
    conflict = await scripted_conflict(first, "409")
    assert conflict.may_have_landed is False
    assert "may have landed" not in str(conflict)


@pytest.mark.parametrize("script", [("500", "409"), ("lost", "429", "409"),
                                    ("lost", "refused", "409")])
async def test_a_409_after_any_try_the_server_may_have_applied_may_be_the_writes_own(script):
    """A 5xx may follow a write the server made (a 504 leaves its handler running), and a
    lost answer stays a possible landing however the tries after it failed."""
    conflict = await scripted_conflict(*script)
    assert conflict.may_have_landed is True


class PodApi:
    """One pod behind a scripted API server: guarded merge patches of its annotations, each
    PATCH first meeting the next of `faults`: "twin" (another replica's identical PATCH
    lands first, then this one goes on), "429" (throttled, not applied), "refused" (the
    connection refused: never sent), "lost" (the server acts on it, applying it or refusing
    it 409, and the answer is lost: a timeout), "reset" (likewise, the connection reset)."""

    def __init__(self, *faults: str) -> None:
        self.obj = {"metadata": {"name": POD, "namespace": NS, "uid": UID,
                                 "resourceVersion": "1",
                                 "annotations": {"gpu-fraction": "0.5"}},
                    "spec": {"containers": [{"name": "trainer"}]}}
        self.faults = list(faults)
        self.log: list[str] = []

    def snapshot(self) -> PodSnapshot:
        return PodSnapshot.from_object(copy.deepcopy(self.obj))

    def _apply(self, body: dict) -> dict:
        meta = self.obj["metadata"]
        if body["metadata"].get("resourceVersion") not in (None, meta["resourceVersion"]):
            self.log.append("409")
            raise kerr.refused("patch", 409, "Conflict", b'{"message":"the object has been '
                                                         b'modified"}')
        for key, value in body["metadata"]["annotations"].items():
            if value is None:
                meta["annotations"].pop(key, None)
            else:
                meta["annotations"][key] = value
        meta["resourceVersion"] = str(int(meta["resourceVersion"]) + 1)
        self.log.append("applied")
        return copy.deepcopy(self.obj)

    async def request(self, method, path, *, what, body=None, **_):
        if method == "GET" and "/nodes/" in path:
            return {"metadata": {"name": "node-1", "uid": "n", "labels": {}}}
        if method == "GET":
            return copy.deepcopy(self.obj)
        patch = json.loads(body)
        fault = self.faults.pop(0) if self.faults else ""
        if fault == "twin":
            self._apply(patch)
            fault = self.faults.pop(0) if self.faults else ""
        if fault == "429":
            self.log.append("429")
            raise kerr.refused(what, 429, "TooManyRequests", b'{"message":"throttled"}')
        if fault == "refused":
            self.log.append("refused")
            raise await connection_refused(what)
        if fault in ("lost", "reset"):
            with contextlib.suppress(kerr.Conflict):
                self._apply(patch)
            raise kerr.unreachable(what, TimeoutError() if fault == "lost" else
                                   ConnectionResetError(104, "Connection reset by peer"))
        return self._apply(patch)

    async def close(self) -> None:
        pass


def service_over(api: PodApi, cache: PodCache | None = None) -> MirrorService:
    store = KubePodStore(api, backoff=Backoff(attempts=3, base=0.001), clock=FakeClock(),
                         rng=random.Random(0))
    return MirrorService(store, clock=FakeClock(), cache=cache)


@pytest.mark.parametrize("first", ["429", "refused"])
async def test_a_call_whose_write_the_server_never_applied_answers_unchanged(first):
    """Before: the twin replica's identical write landed, this call's PATCH was throttled
    (429) or its connection refused, the retry met the twin's version (409), and this call
    answered changed=true though it wrote nothing. Now changed=false."""
    api = PodApi("twin", first)
    result = await service_over(api).mirror(allocation(), idempotency_key="bind-1")
    assert api.log == ["applied", first, "409"]
    assert result.changed is False


@pytest.mark.parametrize("lost", ["lost", "reset"])
async def test_a_call_whose_write_from_a_read_landed_unanswered_still_answers_changed(lost):
    """The case answered changed=true on purpose: the write, computed from the pod read from
    the API, landed, its answer lost to a timeout or a reset; the retry met its version."""
    api = PodApi(lost)
    result = await service_over(api).mirror(allocation(), idempotency_key="bind-1")
    assert api.log == ["applied", "409"]
    assert result.changed is True


@pytest.mark.parametrize("first", ["lost", "429"])
async def test_kais_retry_to_a_replica_whose_cache_lags_the_write_answers_unchanged(first):
    """Before: replica X wrote the call (changed=true) and its answer was lost to KAI; KAI's
    retry went to replica Y, whose pod cache still held the pod before X's write. Y's write,
    computed from that stale pod, was refused 409 with its answer lost (or throttled), the
    store's retry met X's version, and Y answered changed=true as well. Now Y's write from
    the cache proves nothing of its own: changed=false."""
    api = PodApi()
    stale = api.snapshot()
    assert (await service_over(api).mirror(allocation(), idempotency_key="bind-1")).changed
    cache = PodCache()
    cache.remember(stale)
    api.faults = [first]
    again = await service_over(api, cache).mirror(allocation(), idempotency_key="bind-1")
    assert api.log == ["applied", first if first == "429" else "409", "409"]
    assert again.changed is False


async def test_a_write_from_the_cache_whose_answer_was_lost_answers_unchanged():
    """The price of the rule above: a write computed from a cached pod that was current, which
    landed unanswered, looks exactly like Y's (a 409 to the retry, the allocation on the pod):
    it answers changed=false, as a retry of the call would."""
    api = PodApi("lost")
    cache = PodCache()
    cache.remember(api.snapshot())
    result = await service_over(api, cache).mirror(allocation(), idempotency_key="bind-1")
    assert api.log == ["applied", "409"]
    assert result.changed is False
