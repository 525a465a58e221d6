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


def replica(client: Kube, keys, in_term, now: list[float] | None = None) -> Publisher:
    """A replica's publisher over its mounted key files `keys`; with `now`, on that clock
    (`now[0]`, seconds) and waiting 300 s for a lagging mount (`catch_up`)."""
    if now is None:
        return Publisher(client, NAMESPACE, NAME, KeyringSource([str(keys)]), in_term=in_term)
    return Publisher(client, NAMESPACE, NAME, KeyringSource([str(keys)]), in_term=in_term,
                     catch_up=300, monotonic=lambda: now[0])


def node_keyring(tmp_path, data: dict[str, str]):
    """What a node agent that mounts the ConfigMap verifies with."""
    d = tmp_path / f"node-{len(list(tmp_path.iterdir()))}"
    d.mkdir()
    for file, pem in data.items():
        (d / file).write_text(pem)
    return load_keyring([str(d)])


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


LEFT = "left as it is"


def warnings_but_left_as_it_is(caplog) -> list[str]:
    """The warnings other than a replica's 'keys one step ahead of its files, left as it is',
    which a rotation logs too: the replica cannot tell a mount not refreshed yet from an
    edit shaped as a rotation."""
    return [m for m in warnings_of(caplog) if LEFT not in m]


def edit(kube, data: dict[str, str]) -> None:
    """Someone with `patch` on the ConfigMap replaces its keys."""
    kube.core.patch_namespaced_config_map(
        NAME, NAMESPACE, {"data": {"current": None, "previous": None, **data}})


async def test_a_replica_not_holding_the_lease_publishes_the_key_it_signs_with(
        kube, tmp_path, caplog):
    """Before, only the Lease's holder wrote a ConfigMap that differed: the replica whose mount
    was refreshed first signed with the new key, which no node could verify
    (SignatureKeyUnknown, refused after --signature-key-wait), until the holder's mount caught
    up. Now it publishes both keys itself, and the holder, whose mount is older, leaves them
    (saying so once, a warning: it cannot tell its mount's lag from an edit)."""
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
    assert warnings_but_left_as_it_is(caplog) == []
    older = [m for m in caplog.messages if LEFT in m]
    assert len(older) == 1, older  # said once, not every round


async def test_a_lease_holder_with_an_older_mount_does_not_remove_the_newer_key(
        kube, tmp_path, caplog):
    """Before, a handover to a replica whose mount was not refreshed yet took `current` back to
    the old key and dropped the new one (the previous holder's signatures failed on every
    node), with a WARNING blaming an outside edit. Now it leaves the newer keys, and its one
    warning names both causes (its mount not refreshed yet, or an edit)."""
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
    assert warnings_but_left_as_it_is(caplog) == []
    assert [m for m in warnings_of(caplog) if "not caught up with" in m and "or an edit" in m]


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
    assert warnings_but_left_as_it_is(caplog) == []


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
            restarted = replica(client, tmp_path / "a", in_term, now)
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
    warned = warnings_but_left_as_it_is(caplog)
    assert all("was deleted" in m or "for longer than a mounted Secret takes" in m
               for m in warned), warned  # this test's own deletions, the Secret gone back


async def test_an_edit_shaped_as_a_rotation_is_a_warning_in_the_first_round(
        kube, tmp_path, caplog):
    """An edit `{current: E, previous: A}` (E the editor's own key, A the real one) looks like
    a rotation the Lease's holder's mount has not caught up with, so it is left for
    `catch_up`. Before, that was said only at INFO, blaming the kubelet: an edit that made
    every node trust the editor's key for 5 minutes left no warning. Now the first round
    warns, naming the stored key ids and this replica's, and both causes."""
    caplog.set_level(logging.INFO)
    real, editors = Ed25519Key.generate(), Ed25519Key.generate()
    now = [0.0]
    client = Kube(k8s.ApiClient(kube.configuration()))
    leader = replica(client, mount(tmp_path, "a", real), lambda: True, now)
    try:
        assert await leader.publish() is True
        edit(kube, public(editors, real))
        caplog.clear()
        assert await leader.publish() is False  # left, for now
        warned = warnings_of(caplog)
        assert len(warned) == 1, warned
        assert f"current {editors.kid}, previous {real.kid}" in warned[0]
        assert f"key files (current {real.kid})" in warned[0]
        assert "not caught up with" in warned[0] and "or an edit" in warned[0]
        assert "Lease's holder puts back after 300 s" in warned[0]
        now[0] += 299
        assert await leader.publish() is False
        assert len(warnings_of(caplog)) == 1  # once for these keys, not every round
        now[0] += 1
        assert await leader.publish() is True
        assert stored(kube) == public(real)
        edit(kube, public(editors, real))  # again, after the put-back: warned again
        assert await leader.publish() is False  # (a rotation may come right after a put-back)
        assert len([m for m in warnings_of(caplog) if LEFT in m]) == 2
    finally:
        await client.close()


async def test_edits_one_after_another_get_no_fresh_five_minutes(kube, tmp_path, caplog):
    """Before, each new edit shaped as a rotation restarted the 5 minutes, so edits every 4
    could keep an editor's key trusted on every node for good, with no put-back ever
    logged. Now the 5 minutes count from when the ConfigMap first went ahead of this
    replica's (unchanged) key files, a mount's lag; each new edit is still warned about."""
    caplog.set_level(logging.INFO)
    real, first, second = (Ed25519Key.generate() for _ in range(3))
    now = [0.0]
    client = Kube(k8s.ApiClient(kube.configuration()))
    leader = replica(client, mount(tmp_path, "a", real), lambda: True, now)
    try:
        assert await leader.publish() is True
        edit(kube, public(first, real))
        assert await leader.publish() is False
        now[0] += 240
        edit(kube, public(second, real))
        assert await leader.publish() is False
        now[0] += 60
        assert await leader.publish() is True
    finally:
        await client.close()
    assert stored(kube) == public(real)
    warned = [m for m in warnings_of(caplog) if LEFT in m]
    assert [first.kid in warned[0], second.kid in warned[1], len(warned)] == [True, True, 2]


async def test_two_rotations_within_one_mount_lag_are_put_back_as_keys_not_held(
        kube, tmp_path, caplog):
    """Two rotations while the Lease's holder's mount still has the first key (A -> {B, A}
    -> {C, B}): the other replica publishes each step, and the holder, two steps behind,
    puts its own keys back (not supported: docs/chart.md says to rotate again only once every
    replica signs with the new key). Before, its warning said the ConfigMap 'was changed since
    this replica last wrote or read it', an edit's words; now it says the ConfigMap holds keys
    its key files do not hold, its mount behind by more than one step or an edit."""
    a, b, c = (Ed25519Key.generate() for _ in range(3))
    client = Kube(k8s.ApiClient(kube.configuration()))
    holder = replica(client, mount(tmp_path, "y", a), in_term=lambda: True)
    other = replica(client, mount(tmp_path, "x", a), in_term=lambda: False)
    try:
        assert await holder.publish() is True
        assert await other.publish() is False
        mount(tmp_path, "x", b, a)
        assert await other.publish() is True
        assert await holder.publish() is False
        mount(tmp_path, "x", c, b)
        assert await other.publish() is True
        caplog.clear()
        assert await holder.publish() is True
    finally:
        await client.close()
    assert stored(kube) == public(a)
    warned = warnings_of(caplog)
    assert len(warned) == 1, warned
    assert "changed since" not in warned[0]
    assert f"holds keys this replica's key files do not hold (current {c.kid}, previous " \
        f"{b.kid}: its mount of the signing Secret behind by more than one step, or an edit)" \
        in warned[0]


async def test_an_edit_that_only_removes_a_key_is_put_back_as_a_change(kube, tmp_path, caplog):
    """A ConfigMap holding nothing this replica's files do not (the new key removed, the old
    one kept) is no mount behind: the holder's warning says it was changed."""
    old, new = Ed25519Key.generate(), Ed25519Key.generate()
    client = Kube(k8s.ApiClient(kube.configuration()))
    holder = replica(client, mount(tmp_path, "a", new, old), in_term=lambda: True)
    try:
        assert await holder.publish() is True
        edit(kube, public(old))
        assert await holder.publish() is True
    finally:
        await client.close()
    assert stored(kube) == public(new, old)
    warned = warnings_of(caplog)
    assert len(warned) == 1 and "was changed since this replica last wrote or read it" \
        in warned[0], warned


async def test_a_key_put_back_by_a_holder_whose_mount_lags_past_catch_up_is_published_again(
        kube, tmp_path, caplog):
    """A second look: the Lease's holder, its mount still on the old key 5 minutes after a
    rotation, put the old key back once its wait ran out, and the replica that signs with the
    new key never wrote again (its files had not changed since it last wrote): its pods were
    refused as SignatureKeyUnknown until the holder's mount refreshed. Now a replica whose files
    are a step past the stored keys publishes them again at its next round."""
    old, new = Ed25519Key.generate(), Ed25519Key.generate()
    now = [0.0]
    client = Kube(k8s.ApiClient(kube.configuration()))
    holder = replica(client, mount(tmp_path, "y", old), lambda: True, now)
    ahead_of_it = replica(client, mount(tmp_path, "x", new, old), lambda: False, now)
    try:
        assert await holder.publish() is True  # {old}
        assert await ahead_of_it.publish() is True  # the rotation it saw first
        assert stored(kube) == public(new, old)
        now[0] = 30.0
        assert await holder.publish() is False  # its next round: left as it is, for now
        now[0] = 360.0
        assert await holder.publish() is True  # its wait ran out: the old key put back
        assert stored(kube) == public(old)
        assert await ahead_of_it.publish() is True  # its next round: the new key again
        assert stored(kube) == public(new, old)
    finally:
        await client.close()
    plan = plan_of(time_slicing())
    signature = ahead_of_it.source.current().sign(plan, node="node-1")
    assert node_keyring(tmp_path, stored(kube)).verify(plan, signature, node="node-1").ok
