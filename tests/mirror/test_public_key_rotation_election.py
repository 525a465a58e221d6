"""The public-key ConfigMap during a rotation under leader election (the chart's default with
`mirror.followBindRequests`): every replica signs with its own mounted Secret, which the kubelet
refreshes in each pod in its own time, so the ConfigMap must hold the newest keys any replica
signs with, whichever replica holds the Lease (review R11-1)."""

from __future__ import annotations

import logging

import pytest
from kubernetes import client as k8s

from kai_fractions.kube.client import Kube
from kai_fractions.mirror.public_key import Publisher
from kai_fractions.signing import Ed25519Key, KeyringSource, load_keyring
from tests.security.allocations import plan_of, time_slicing

pytestmark = pytest.mark.integration

NAMESPACE, NAME = "kai-fractions", "kai-fractions-signing-public"


def mount(tmp_path, replica: str, *keys: Ed25519Key):
    """Writes a replica's mounted signing Secret (`current`, then `previous`), as the kubelet
    does when it refreshes it; a key file no longer given is removed."""
    d = tmp_path / replica
    d.mkdir(exist_ok=True)
    for file in ("current", "previous"):
        (d / file).unlink(missing_ok=True)
    for file, key in zip(("current", "previous"), keys, strict=False):
        (d / file).write_bytes(key.private_pem())
    return d


def public(*keys: Ed25519Key) -> dict[str, str]:
    return {file: key.public_pem().decode()
            for file, key in zip(("current", "previous"), keys, strict=False)}


def stored(kube) -> dict[str, str] | None:
    found = {c.metadata.name: c for c in kube.core.list_namespaced_config_map(NAMESPACE).items}
    return found[NAME].data if NAME in found else None


def replica(client: Kube, keys, in_term) -> Publisher:
    return Publisher(client, NAMESPACE, NAME, KeyringSource([str(keys)]), in_term=in_term)


def node_keyring(tmp_path, data: dict[str, str]):
    """What a node agent that mounts the ConfigMap verifies with."""
    d = tmp_path / f"node-{len(list(tmp_path.iterdir()))}"
    d.mkdir()
    for file, pem in data.items():
        (d / file).write_text(pem)
    return load_keyring([str(d)])


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


async def test_a_replica_not_holding_the_lease_publishes_the_key_it_signs_with(
        kube, tmp_path, caplog):
    """Before, only the Lease's holder wrote a ConfigMap that differed: the replica whose mount
    was refreshed first signed with the new key, which no node could verify
    (SignatureKeyUnknown, refused after --signature-key-wait), until the holder's mount caught
    up. Now it publishes both keys itself, and the holder, whose mount is older, leaves them."""
    caplog.set_level(logging.INFO)
    old, new = Ed25519Key.generate(), Ed25519Key.generate()
    client = Kube(k8s.ApiClient(kube.configuration()))
    leader = replica(client, mount(tmp_path, "a", old), in_term=lambda: True)
    follower = replica(client, mount(tmp_path, "b", old), in_term=lambda: False)
    try:
        assert await leader.publish() is True
        assert await follower.publish() is False
        mount(tmp_path, "b", new, old)  # the kubelet refreshes the follower's mount first
        assert await follower.publish() is True
        assert stored(kube) == public(new, old)
        for _round in range(3):
            assert await leader.publish() is False  # its mount is older: it leaves them
        assert stored(kube) == public(new, old)
    finally:
        await client.close()
    plan = plan_of(time_slicing())
    signature = follower.source.current().sign(plan, node="node-1")
    assert node_keyring(tmp_path, stored(kube)).verify(plan, signature, node="node-1").ok
    assert warnings_of(caplog) == []
    older = [m for m in caplog.messages if "mount of the signing Secret is older" in m]
    assert len(older) == 1, older  # said once, not every round


async def test_a_lease_holder_with_an_older_mount_does_not_remove_the_newer_key(
        kube, tmp_path, caplog):
    """Before, a handover to a replica whose mount was not refreshed yet took `current` back to
    the old key and dropped the new one (the previous holder's signatures failed on every
    node), with a WARNING blaming an outside edit. Now it leaves the newer keys, and says
    nothing above INFO."""
    caplog.set_level(logging.INFO)
    old, new = Ed25519Key.generate(), Ed25519Key.generate()
    holder = {"a": True}
    client = Kube(k8s.ApiClient(kube.configuration()))
    a = replica(client, mount(tmp_path, "a", old), in_term=lambda: holder["a"])
    b = replica(client, mount(tmp_path, "b", old), in_term=lambda: not holder["a"])
    try:
        assert await a.publish() is True
        assert await b.publish() is False
        mount(tmp_path, "b", new, old)
        holder["a"] = False  # B takes the Lease, and publishes its rotated keys
        assert await b.publish() is True
        holder["a"] = True  # back to A, whose mount is still the old one
        assert await a.publish() is False
        assert stored(kube) == public(new, old)
        mount(tmp_path, "a", new, old)  # A's mount catches up: nothing left to write
        assert await a.publish() is False
    finally:
        await client.close()
    assert stored(kube) == public(new, old)
    assert warnings_of(caplog) == []


async def test_replicas_taking_turns_at_the_lease_move_the_keys_forward_only(
        kube, tmp_path, caplog):
    """Two replicas whose mounts are refreshed a round or two apart, through a rotation, the
    retirement of the old key and a second rotation, while the Lease changes hands every round:
    the ConfigMap moves one step forward at a time, each step written once, and never back
    (before, each holder wrote its own mount's keys, older or not)."""
    k0, k1, k2 = (Ed25519Key.generate() for _ in range(3))
    steps = [(k0,), (k1, k0), (k1,), (k2, k1)]
    refreshed = {"b": {1: 1, 4: 2, 7: 3}, "a": {2: 1, 6: 2, 9: 3}}  # round -> step
    holder = {"name": "a"}
    client = Kube(k8s.ApiClient(kube.configuration()))
    replicas = {name: replica(client, mount(tmp_path, name, k0),
                              in_term=lambda name=name: holder["name"] == name)
                for name in ("a", "b")}
    seen, writes = [], 0
    try:
        for round_ in range(12):
            holder["name"] = "ab"[round_ % 2]
            for name, at in refreshed.items():
                if round_ in at:
                    mount(tmp_path, name, *steps[at[round_]])
            order = ("a", "b") if round_ % 3 else ("b", "a")
            for name in order:
                writes += await replicas[name].publish()
                seen.append([public(*step) for step in steps].index(stored(kube)))
    finally:
        await client.close()
    assert seen == sorted(seen), seen  # never a step back
    assert seen[-1] == len(steps) - 1
    assert writes == len(steps)  # the create, then each step once
    assert warnings_of(caplog) == []


async def test_a_rotation_undone_in_the_secret_is_published_again(kube, tmp_path, caplog):
    """Keys one step ahead of a replica's are left only while its mount may be catching up: a
    rotation undone in the Secret (the new key withdrawn, leaked perhaps) looks the same, and
    left for good the withdrawn key would stay trusted on every node. A replica that saw its
    own files go back publishes them at once; one restarted meanwhile, which remembers
    nothing, once `catch_up` has passed (with or without election)."""
    caplog.set_level(logging.INFO)
    k0, k1 = Ed25519Key.generate(), Ed25519Key.generate()
    now = [0.0]
    client = Kube(k8s.ApiClient(kube.configuration()))
    try:
        for in_term in (None, lambda: True):
            first = replica(client, mount(tmp_path, "a", k1, k0), in_term=in_term)
            assert await first.publish() is True
            mount(tmp_path, "a", k0)  # the rotation undone
            assert await first.publish() is True
            assert stored(kube) == public(k0)
            kube.core.delete_namespaced_config_map(NAME, NAMESPACE)

            assert await first.publish() is True  # created again, with its keys
            mount(tmp_path, "a", k1, k0)
            assert await first.publish() is True
            mount(tmp_path, "a", k0)  # undone again, while the mirror restarts
            restarted = Publisher(client, NAMESPACE, NAME,
                                  KeyringSource([str(tmp_path / "a")]), in_term=in_term,
                                  catch_up=300, monotonic=lambda: now[0])
            assert await restarted.publish() is False
            now[0] += 299
            assert await restarted.publish() is False
            assert stored(kube) == public(k1, k0)
            now[0] += 1
            assert await restarted.publish() is True
            assert stored(kube) == public(k0)
            kube.core.delete_namespaced_config_map(NAME, NAMESPACE)
    finally:
        await client.close()
    warned = warnings_of(caplog)
    assert all("was deleted" in m for m in warned), warned  # only this test's own deletions
