"""The KAI follower with a signing key, on kmock: it signs a pod whose annotations match what the
binder should have written (one guarded merge patch carrying only the signature, which verifies
exactly as the node agent checks it), never a mismatching one, never twice, and never a pod that
changed between its read and its patch."""

from __future__ import annotations

import re

import pytest
from kubernetes import client as k8s

from kai_fractions.contract import DEFAULT_KEYS, parse_pod, plan_container, pod_views
from kai_fractions.kube.client import Kube
from kai_fractions.kube.retry import Backoff
from kai_fractions.mirror.bindrequest_view import BindRequestView
from kai_fractions.mirror.follower import Follower
from kai_fractions.mirror.kube_store import KubePodStore
from kai_fractions.mirror.metrics import MirrorMetrics
from kai_fractions.mirror.rechecks import wants_recheck
from kai_fractions.node.agent.signatures import SignatureCheck
from kai_fractions.node.desired import NodePod
from kai_fractions.signing import Keyring, KeyringSource
from tests.support.mirror_kube import honour_label_selectors

from .test_follower import BOUND, GPU_A, GPU_B, NS, T, bind_request, pod, reservation_pod

pytestmark = pytest.mark.integration

KEY = b"k" * 32
SIG = "kai-fractions.io/container.trainer.signature"
PATCHES = re.compile(r"/api/v1/namespaces/team-a/pods/[^/]+")


@pytest.fixture
def cluster(kube):
    honour_label_selectors(kube)
    kube.core.create_node({"metadata": {"name": "gpu-node-1",
                                        "labels": {"nvidia.com/gpu.memory": "40960"}}})
    for group, gpu in (("group-a", GPU_A), ("group-b", GPU_B)):
        kube.core.create_namespaced_pod("kai-resource-reservation", reservation_pod(group, gpu))
    return kube


@pytest.fixture
async def client(cluster):
    """The follower's way to the cluster: `kube` as the mirror reaches it."""
    client = Kube(k8s.ApiClient(cluster.configuration()))
    yield client
    await client.close()


KEYRING = Keyring.of(KEY)


def follower(client: Kube, store_cls=KubePodStore, keyring: Keyring | None = KEYRING):
    store = store_cls(client, backoff=Backoff(attempts=3, base=0.01, cap=0.05))
    return Follower(store, signer=KeyringSource.fixed(keyring) if keyring else None)


async def check(f: Follower, pod_name: str):
    return await f.verify(BindRequestView.from_object(bind_request("br-1", pod_name)))


def stored(kube, name: str) -> dict:
    return kube.api_client.sanitize_for_serialization(kube.core.read_namespaced_pod(name, NS))


def agent_verdict(obj: dict, keyring: Keyring = KEYRING):
    """What the node agent decides (node.agent.signatures.SignatureCheck): plan each bound
    share with the pod's uid and verify the signature annotation."""
    view = next(pod_views({"apiVersion": "v1", "kind": "Pod", **obj}))
    (share,) = parse_pod(view).shares
    plan = plan_container(share, obj["metadata"]["uid"])
    return keyring.verify(plan, view.annotations.get(SIG))


def patches(kube) -> list:
    return kube.requests("PATCH", PATCHES)


async def test_a_matching_pod_is_signed_in_one_guarded_patch(cluster, client):
    created = cluster.core.create_namespaced_pod(NS, pod("good-0", {"gpu-fraction": "0.5",
                                                                    **BOUND}))
    result = await check(follower(client), "good-0")
    assert (result.mismatches, result.errors, result.skipped) == ((), (), "")
    assert result.signed == (SIG,)
    (request,) = patches(cluster)
    body = request.data
    assert body == {"metadata": {"annotations": {SIG: body["metadata"]["annotations"][SIG]},
                                 "uid": created.metadata.uid,
                                 "resourceVersion": created.metadata.resource_version}}
    obj = stored(cluster, "good-0")
    assert agent_verdict(obj).ok
    # The node agent's own check takes it (nothing refused, nothing pending).
    screened = SignatureCheck(KeyringSource.fixed(KEYRING), DEFAULT_KEYS).screen(
        [NodePod.from_manifest({"apiVersion": "v1", "kind": "Pod", **obj})])
    assert (len(screened.pods), screened.refusals) == (1, ())
    # Nothing else was written: the pod's annotations are the user's and binder's plus SIG.
    assert obj["metadata"]["annotations"] == {"gpu-fraction": "0.5", **BOUND, SIG: body[
        "metadata"]["annotations"][SIG]}
    assert cluster.core.list_namespaced_event(NS).items == []


async def test_a_signature_the_api_server_did_not_store_is_not_signed(cluster, client):
    """A mutating webhook on pod UPDATE drops the signature from the patch: the follower must
    not count the pod signed (the node agent would refuse it, with no event to say why)."""

    class Dropping(KubePodStore):
        async def patch_annotations(self, namespace, name, changes, **kw):
            await super().patch_annotations(namespace, name, changes, **kw)
            return await super().patch_annotations(namespace, name, {SIG: None}, uid="",
                                                   resource_version="")

    cluster.core.create_namespaced_pod(NS, pod("good-0", {"gpu-fraction": "0.5", **BOUND}))
    result = await check(follower(client, store_cls=Dropping), "good-0")
    assert result.signed == () and not result.complete
    assert f"{SIG} is absent, not " in result.unsigned
    assert "mutating admission webhook" in result.unsigned
    (event,) = cluster.core.list_namespaced_event(NS).items
    assert event.reason == "NvFractionsUnsigned" and SIG in event.message
    assert SIG not in stored(cluster, "good-0")["metadata"]["annotations"]


async def test_a_signed_pod_is_not_signed_again(cluster, client):
    cluster.core.create_namespaced_pod(NS, pod("good-0", {"gpu-fraction": "0.5", **BOUND}))
    f = follower(client)
    assert (await check(f, "good-0")).signed == (SIG,)
    again = await check(f, "good-0")  # a relist replays every BindRequest
    assert (again.signed, again.mismatches) == ((), ())
    assert (await check(follower(client), "good-0")).signed == ()  # a restarted mirror too
    assert len(patches(cluster)) == 1


async def test_a_signature_under_a_retired_key_is_replaced(cluster, client):
    cluster.core.create_namespaced_pod(NS, pod("good-0", {"gpu-fraction": "0.5", **BOUND}))
    await check(follower(client, keyring=Keyring.of(b"o" * 32)), "good-0")
    assert (await check(follower(client), "good-0")).signed == (SIG,)
    assert agent_verdict(stored(cluster, "good-0")).ok
    assert len(patches(cluster)) == 2


async def test_a_mismatching_pod_is_not_signed(cluster, client):
    cluster.core.create_namespaced_pod(NS, pod("bad-0", {"gpu-fraction": "0.5", **{
        **BOUND, f"{T}.gpus.devices": GPU_B}}))
    result = await check(follower(client), "bad-0")
    assert [m.key for m in result.mismatches] == [f"{T}.gpus.devices"]
    assert result.signed == ()
    assert patches(cluster) == []
    assert SIG not in stored(cluster, "bad-0")["metadata"]["annotations"]
    assert [e.reason for e in cluster.core.list_namespaced_event(NS).items] == [
        "NvFractionsMismatch"]


async def test_without_a_key_the_follower_writes_nothing(cluster, client):
    cluster.core.create_namespaced_pod(NS, pod("good-0", {"gpu-fraction": "0.5", **BOUND}))
    result = await check(follower(client, keyring=None), "good-0")
    assert (result.mismatches, result.signed) == ((), ())
    assert patches(cluster) == []


async def test_a_conflict_reads_the_pod_again_before_signing(cluster, client):
    cluster.core.create_namespaced_pod(NS, pod("good-0", {"gpu-fraction": "0.5", **BOUND}))
    conflict = cluster.fail("PATCH", PATCHES, 409, times=1)
    result = await check(follower(client), "good-0")
    assert conflict.hits == 1
    assert result.signed == (SIG,)
    assert len(patches(cluster)) == 2
    assert cluster.count("GET", "/api/v1/namespaces/team-a/pods/good-0") == 2
    assert agent_verdict(stored(cluster, "good-0")).ok


def editing_after_first_read(cluster, annotations: dict[str, str], then=lambda: None):
    """A KubePodStore class whose first read is followed at once by someone else's edit of the
    pod's `annotations` (then `then()`); `.reads` counts its reads."""

    class EditingStore(KubePodStore):
        reads = 0

        async def get_pod(self, namespace, name, deadline=None, **kw):
            snapshot = await super().get_pod(namespace, name, **({"deadline": deadline}
                                                                 if deadline else {}))
            EditingStore.reads += 1
            if EditingStore.reads == 1:
                cluster.core.patch_namespaced_pod(name, namespace, {"metadata": {
                    "annotations": annotations}})
                then()
            return snapshot

    return EditingStore


async def test_a_pod_changed_between_the_read_and_the_patch_is_not_signed(cluster, client):
    """Someone moves the pod to a GPU the binder did not pick right after the follower read it,
    and the follower's patch meets an injected 409: the re-read and re-check find the mismatch
    and nothing is signed."""
    cluster.core.create_namespaced_pod(NS, pod("edit-0", {"gpu-fraction": "0.5", **BOUND}))
    faults = []
    EditingStore = editing_after_first_read(
        cluster, {f"{T}.gpus.devices": GPU_B},
        then=lambda: faults.append(cluster.fail("PATCH", PATCHES, 409, times=1)))
    result = await check(follower(client, store_cls=EditingStore), "edit-0")
    assert faults[0].hits == 1 and EditingStore.reads == 2
    assert [m.key for m in result.mismatches] == [f"{T}.gpus.devices"]
    assert result.signed == ()
    assert SIG not in stored(cluster, "edit-0")["metadata"]["annotations"]
    # Only the user's edit and the refused signing patch reached the server.
    assert len(patches(cluster)) == 2


async def test_the_resource_version_guard_refuses_a_stale_signature(cluster, client):
    """No injected fault: the edit after the read makes the server refuse the signing patch by
    its resourceVersion (409); the re-check sees the edit and signs nothing."""
    cluster.core.create_namespaced_pod(NS, pod("edit-1", {"gpu-fraction": "0.5", **BOUND}))
    EditingStore = editing_after_first_read(
        cluster, {f"{T}.gpu-compute.portion": "0.9"})
    result = await check(follower(client, store_cls=EditingStore), "edit-1")
    assert [m.key for m in result.mismatches] == [f"{T}.gpu-compute.portion"]
    assert result.signed == ()
    assert SIG not in stored(cluster, "edit-1")["metadata"]["annotations"]
    assert EditingStore.reads == 2


TOO_LONG = "metadata.annotations: Too long: must have at most 262144 bytes"


async def test_a_patch_the_api_server_refuses_as_invalid_is_reported_not_rechecked(
        cluster, client):
    """A 422 on the pod that was read (its annotations over the API server's limit, a policy)
    is no change under the write: it would be refused at every retry. One patch, one re-read to
    tell it from a recreated pod, then reported with the server's words and what to do, and
    counted unsigned; no recheck."""
    cluster.core.create_namespaced_pod(NS, pod("big-0", {"gpu-fraction": "0.5", **BOUND}))
    refusal = cluster.fail("PATCH", PATCHES, 422, times=None, message=TOO_LONG)
    metrics = MirrorMetrics()
    f = follower(client)
    result = await metrics.check(f.follow_one, BindRequestView.from_object(
        bind_request("br-1", "big-0")))
    assert refusal.hits == 1 and len(patches(cluster)) == 1
    assert cluster.count("GET", "/api/v1/namespaces/team-a/pods/big-0") == 2
    assert result.recheck is False and not wants_recheck(result)
    assert result.signed == () and TOO_LONG in result.unsigned
    assert "kept changing" not in result.unsigned
    assert metrics.registry.get_sample_value("kai_fractions_follower_checks_total",
                                             {"result": "unsigned"}) == 1
    (event,) = cluster.core.list_namespaced_event(NS).items
    assert event.reason == "NvFractionsUnsigned"
    assert TOO_LONG in event.message and "256 KiB" in event.message
    assert "delete the pod" in event.message and "changed" not in event.message
    assert SIG not in stored(cluster, "big-0")["metadata"]["annotations"]


async def test_an_invalid_patch_of_a_recreated_pod_checks_the_new_pod(cluster, client):
    """The pod deleted and created again between the read and the patch: the uid guard's 422
    is a change, as a 409 is. The re-read finds the new uid and the new pod is checked and
    signed (under its own uid), with no event."""
    cluster.core.create_namespaced_pod(NS, pod("again-0", {"gpu-fraction": "0.5", **BOUND}))
    faults = []

    def recreate():
        cluster.core.delete_namespaced_pod("again-0", NS)
        cluster.core.create_namespaced_pod(NS, pod("again-0", {"gpu-fraction": "0.5",
                                                               **BOUND}))
        faults.append(cluster.fail("PATCH", PATCHES, 422, times=1,
                                   message="metadata.uid: Invalid value: field is immutable"))

    EditingStore = editing_after_first_read(cluster, {}, then=recreate)
    result = await check(follower(client, store_cls=EditingStore), "again-0")
    assert faults[0].hits == 1
    assert result.signed == (SIG,) and result.unsigned == ""
    assert agent_verdict(stored(cluster, "again-0")).ok
    assert cluster.core.list_namespaced_event(NS).items == []
