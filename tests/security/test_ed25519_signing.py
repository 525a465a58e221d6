"""Issue 17, finding 8: with HMAC every node held the key that signs, so any node root (or any
reader of the Secret) could mint allocations every node accepted, and a signature named the pod
but not the node. Now the mirror signs with an Ed25519 private key, nodes hold only the public
key, and what is signed binds the pod UID AND the node.

Through the real components: MirrorService writes the signed allocation; the node agent's
reconciler (over the in-memory GPU, cgroup and MPS stand-ins) applies or refuses it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kai_fractions.mirror.service import MirrorService
from kai_fractions.mirror.signing import signing_annotations
from kai_fractions.signing import (
    Ed25519Key,
    Keyring,
    KeyringSource,
    SigningConfigError,
    SigningKey,
    load_ed25519,
    parse_signature,
)
from tests.agent.builders import NODE, Rig, leaf_of, marker_of
from tests.support.clock import FakeClock
from tests.support.fake_store import FakePodStore

from .allocations import KEY_A, UID, plans_of
from .test_mirror_signing import allocation

SIG = "kai-fractions.io/container.trainer.signature"


@pytest.fixture(scope="module")
def pair() -> Ed25519Key:
    return Ed25519Key.generate()


def public_only(key: Ed25519Key) -> Ed25519Key:
    return load_ed25519(key.public_pem())


async def mirrored(pair: Ed25519Key, node: str, gpu: str = "") -> dict:
    """A pod the mirror allocated on `node` with the Ed25519 key, as the API stores it."""
    store = FakePodStore(nodes={node: {}} if node else {})
    store.add_pod({"metadata": {"name": "train-0", "namespace": "team-a", "uid": UID,
                                "annotations": {"gpu-fraction": "0.5"}},
                   "spec": {"containers": [{"name": "trainer"}]}})
    service = MirrorService(store, clock=FakeClock(), extra_annotations=(
        signing_annotations(KeyringSource.fixed(Keyring.of(pair)))))
    await service.mirror(allocation(selected_node=node, gpu_ids=(gpu or GPU,)))
    return store.pods[("team-a", "train-0")]


GPU = "GPU-00000000-0000-4000-8000-000000000000"


def a_plan():
    """The plan of a bound 1Gi time-slicing container, as both sides compute it."""
    (plan,) = plans_of({"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": "p", "namespace": "team-a", "uid": UID, "annotations": {
            "nvidia.com/container.trainer.gpu-memory.request": "1Gi",
            "nvidia.com/container.trainer.gpus.devices": GPU}},
        "spec": {"containers": [{"name": "trainer"}]}})
    return plan


def test_v2_signatures_bind_the_node_and_only_the_private_key_signs(pair):
    plan = a_plan()
    value = Keyring.of(pair).sign(plan, node="node-a")
    assert value.startswith(f"v2;kid={pair.kid};sig=") and len(parse_signature(value).mac) == 64
    nodes = Keyring.of(public_only(pair))
    assert nodes.verify(plan, value, node="node-a").ok
    other = nodes.verify(plan, value, node="node-b")
    assert (other.ok, other.reason) == (False, "SignatureInvalid")
    assert "does not match the allocation for node node-b" in other.message
    with pytest.raises(SigningConfigError, match="is a public key: only the mirror"):
        nodes.sign(plan, node="node-a")
    # What a node root can try with what nodes hold: the public key as an HMAC secret.
    forged = Keyring.of(SigningKey(pair.public_pem())).sign(plan)
    assert not nodes.verify(plan, forged, node="node-a").ok


def test_an_hmac_signature_still_verifies_where_the_hmac_key_is_kept(pair):
    """One release of upgrades: a node with both keys accepts v1 (no node in it) and v2."""
    plan = a_plan()
    nodes = Keyring.of(public_only(pair), KEY_A)
    assert nodes.verify(plan, Keyring.of(KEY_A).sign(plan), node="node-a").ok
    assert nodes.verify(plan, Keyring.of(pair).sign(plan, node="node-a"), node="node-a").ok


@pytest.mark.parametrize(("signed_for", "applied"), [(NODE, True), ("node-b", False)])
async def test_the_agent_applies_a_signature_only_on_the_node_it_was_made_for(
        short_tmp: Path, pair, signed_for, applied):
    """The agent on node-a applies what the mirror signed for node-a; a signature the mirror
    made for node-b, carried to a pod on node-a, is refused and takes nothing."""
    public = short_tmp / "public"
    public.mkdir()
    (public / "current").write_bytes(pair.public_pem())  # all a node holds
    rig = Rig(short_tmp, sm_sharing=False, options={"signing_key_files": (str(public),)})
    obj = await mirrored(pair, signed_for, gpu=rig.gpu0)
    manifest = {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": "train-0", "namespace": "team-a", "uid": UID,
                             "annotations": obj["metadata"]["annotations"]},
                "spec": {"nodeName": NODE, "containers": [{"name": "trainer", "image": "x"}]},
                "status": {"phase": "Running", "qosClass": "Burstable", "containerStatuses": [
                    {"name": "trainer", "containerID": "containerd://" + "a" * 64}]}}
    uid = rig.add(manifest)["metadata"]["uid"]
    rig.cgroups.add(leaf_of(uid))
    rig.step()
    body = marker_of(rig, uid)
    state = body["containers"]["trainer"]
    assert state["state"] == ("applied" if applied else "refused"), body
    limits = [path for (_gpu, path) in rig.nvml.limits if uid.replace("-", "_") in path]
    if applied:
        assert limits
    else:
        assert state["reason"] == "SignatureInvalid" and limits == []


async def test_a_signed_allocation_needs_its_node(pair):
    from kai_fractions.mirror.errors import InvalidAllocation

    with pytest.raises(InvalidAllocation, match="selected_node: is required: a fractional "
                                                "allocation names the node it is for"):
        await mirrored(pair, node="")
