"""Only the mirror holds the Ed25519 private key; it publishes the public half into a ConfigMap
that node agents mount as their --signing-key-file directory (issue 17, finding 8)."""

from __future__ import annotations

import logging

import pytest
from kubernetes import client as k8s

from kai_fractions.kube.client import Kube
from kai_fractions.mirror.public_key import Publisher, public_data
from kai_fractions.signing import Ed25519Key, Keyring, KeyringSource, load_keyring

from .allocations import KEY_A

pytestmark = pytest.mark.integration


def key_dir(tmp_path, name: str, *keys: Ed25519Key):
    d = tmp_path / name
    d.mkdir(exist_ok=True)
    for file, key in zip(("current", "previous"), keys, strict=False):
        (d / file).write_bytes(key.private_pem())
    return d


async def test_the_public_keys_are_published_once_and_again_after_a_rotation(kube, tmp_path):
    old, new = Ed25519Key.generate(), Ed25519Key.generate()
    keys = key_dir(tmp_path, "secret", old)
    client = Kube(k8s.ApiClient(kube.configuration()))
    publisher = Publisher(client, "kai-fractions", "kai-fractions-signing-public",
                          KeyringSource([str(keys)]))
    try:
        assert await publisher.publish() is True  # created
        assert await publisher.publish() is False  # nothing changed: nothing written
        stored = kube.core.read_namespaced_config_map("kai-fractions-signing-public",
                                                      "kai-fractions")
        assert stored.data == {"current": old.public_pem().decode()}
        assert "PRIVATE" not in str(stored.data)
        key_dir(tmp_path, "secret", new, old)  # the Secret after a rotation
        assert await publisher.publish() is True  # patched
    finally:
        await client.close()
    stored = kube.core.read_namespaced_config_map("kai-fractions-signing-public",
                                                  "kai-fractions")
    assert stored.data == {"current": new.public_pem().decode(),
                           "previous": old.public_pem().decode()}

    # What a node agent mounts verifies what the mirror signs, and cannot sign.
    mounted = tmp_path / "mounted"
    mounted.mkdir()
    for name, pem in stored.data.items():
        (mounted / name).write_text(pem)
    node_keys = load_keyring([str(mounted)])
    assert node_keys.kids == (new.kid, old.kid)
    assert not any(key.can_sign for key in node_keys.keys)


async def test_a_key_retired_from_the_secret_is_no_longer_trusted_by_the_nodes(kube, tmp_path):
    # The last step of a rotation (docs/chart.md): `previous` leaves the Secret once no pod
    # signed with it remains. It must leave the ConfigMap too, or a leaked old key stays
    # trusted on every node however often the keys are rotated.
    old, new = Ed25519Key.generate(), Ed25519Key.generate()
    keys = key_dir(tmp_path, "secret", new, old)
    client = Kube(k8s.ApiClient(kube.configuration()))
    publisher = Publisher(client, "kai-fractions", "kai-fractions-signing-public",
                          KeyringSource([str(keys)]))
    try:
        assert await publisher.publish() is True
        (keys / "previous").unlink()
        assert await publisher.publish() is True
    finally:
        await client.close()
    stored = kube.core.read_namespaced_config_map("kai-fractions-signing-public",
                                                  "kai-fractions")
    assert stored.data == {"current": new.public_pem().decode()}


def test_an_hmac_key_has_nothing_to_publish():
    assert public_data(KeyringSource.fixed(Keyring.of(KEY_A))) == {}


def test_the_mirror_process_publishes_its_public_key(kube, tmp_path):
    from tests.support.mirror_kube import run_mirror_process

    key = Ed25519Key.generate()
    keys = key_dir(tmp_path, "secret", key)
    run = run_mirror_process(kube, tmp_path, "--signing-key-file", str(keys),
                             "--publish-public-key", "kai-fractions/signing-public")
    assert run.returncode == 0, run.err
    stored = kube.core.read_namespaced_config_map("signing-public", "kai-fractions")
    assert stored.data == {"current": key.public_pem().decode()}
    assert f"created ConfigMap kai-fractions/signing-public with the signing public key(s) " \
        f"{key.kid}" in run.err


CONFIGMAP = "/api/v1/namespaces/kai-fractions/configmaps/kai-fractions-signing-public"


def publisher_of(kube, keys, **kw) -> tuple[Kube, Publisher]:
    client = Kube(k8s.ApiClient(kube.configuration()))
    return client, Publisher(client, "kai-fractions", "kai-fractions-signing-public",
                             KeyringSource([str(keys)]), **kw)


def stored_data(kube) -> dict[str, str] | None:
    names = {c.metadata.name: c for c in kube.core.list_namespaced_config_map(
        "kai-fractions").items}
    found = names.get("kai-fractions-signing-public")
    return None if found is None else found.data


async def test_a_deleted_configmap_is_published_again_at_the_next_round(kube, tmp_path, caplog):
    # Every node agent mounts the ConfigMap as a required volume: deleted and left so, every
    # agent that starts afterwards would wait in ContainerCreating until the mirror restarts.
    key = Ed25519Key.generate()
    client, publisher = publisher_of(kube, key_dir(tmp_path, "secret", key))
    try:
        assert await publisher.publish() is True
        kube.core.delete_namespaced_config_map("kai-fractions-signing-public", "kai-fractions")
        await publisher.try_publish()  # one round of Publisher.run
    finally:
        await client.close()
    assert stored_data(kube) == {"current": key.public_pem().decode()}
    assert "ConfigMap kai-fractions/kai-fractions-signing-public was deleted: created it again" \
        in caplog.text


async def test_an_edited_key_is_put_back_by_the_lease_holder_and_a_retired_one_removed(
        kube, tmp_path, caplog):
    key, other = Ed25519Key.generate(), Ed25519Key.generate()
    client, publisher = publisher_of(kube, key_dir(tmp_path, "secret", key),
                                     in_term=lambda: True)
    try:
        assert await publisher.publish() is True
        kube.core.patch_namespaced_config_map(
            "kai-fractions-signing-public", "kai-fractions",
            {"data": {"current": other.public_pem().decode(),
                      "previous": other.public_pem().decode()}})
        assert await publisher.publish() is True
        assert await publisher.publish() is False  # level again: nothing written
    finally:
        await client.close()
    assert stored_data(kube) == {"current": key.public_pem().decode()}
    assert "kai-fractions-signing-public holds keys this replica's key files do not hold " \
        f"(current {other.kid}, previous {other.kid}: its mount of the signing Secret behind " \
        "by more than one step, or an edit): updated it again" in caplog.text


async def test_without_election_an_edit_is_overwritten_only_when_the_own_keys_change(
        kube, tmp_path):
    # Without --leader-elect the stored ConfigMap may differ because another replica sees
    # another key set: overwriting it merely because it differs makes replicas take turns.
    key, other, new = (Ed25519Key.generate() for _ in range(3))
    keys = key_dir(tmp_path, "secret", key)
    client, publisher = publisher_of(kube, keys)
    try:
        assert await publisher.publish() is True
        kube.core.patch_namespaced_config_map(
            "kai-fractions-signing-public", "kai-fractions",
            {"data": {"current": other.public_pem().decode()}})
        assert await publisher.publish() is False
        assert stored_data(kube) == {"current": other.public_pem().decode()}
        key_dir(tmp_path, "secret", new, key)  # a rotation: this replica's own change
        assert await publisher.publish() is True
    finally:
        await client.close()
    assert stored_data(kube) == {"current": new.public_pem().decode(),
                                 "previous": key.public_pem().decode()}


async def test_two_replicas_without_election_do_not_take_turns_during_a_rotation(
        kube, tmp_path, caplog):
    # The chart runs 2 replicas, with --leader-elect only when following BindRequests. The
    # kubelet refreshes the rotated Secret in one pod before the other: the stale replica must
    # not set `current` back to the old key and drop `previous` every other round.
    old, new = Ed25519Key.generate(), Ed25519Key.generate()
    client, a = publisher_of(kube, key_dir(tmp_path, "a", old))
    b = Publisher(client, "kai-fractions", "kai-fractions-signing-public",
                  KeyringSource([str(key_dir(tmp_path, "b", old))]))
    rotated = {"current": new.public_pem().decode(), "previous": old.public_pem().decode()}
    seen = []
    try:
        assert await a.publish() is True
        assert await b.publish() is False  # the same keys: nothing to write
        key_dir(tmp_path, "a", new, old)  # A's mount is refreshed first
        for _round in range(3):
            for replica in (a, b):
                await replica.try_publish()
                seen.append(stored_data(kube))
        key_dir(tmp_path, "b", new, old)  # then B's
        wrote_after_refresh = await b.publish()
    finally:
        await client.close()
    assert seen == [rotated] * 6
    assert wrote_after_refresh is False  # it finds its keys there already
    assert stored_data(kube) == rotated
    assert "changed since" not in caplog.text


async def test_a_restarted_replica_says_it_updated_what_it_found(kube, tmp_path, caplog):
    # After a restart the replica remembers nothing: its log says what the read found.
    caplog.set_level(logging.INFO)
    key, other = Ed25519Key.generate(), Ed25519Key.generate()
    client, publisher = publisher_of(kube, key_dir(tmp_path, "secret", key))
    try:
        assert await publisher.publish() is True
        kube.core.patch_namespaced_config_map(
            "kai-fractions-signing-public", "kai-fractions",
            {"data": {"current": other.public_pem().decode()}})
        restarted = Publisher(client, "kai-fractions", "kai-fractions-signing-public",
                              KeyringSource([str(key_dir(tmp_path, "secret", key))]))
        assert await restarted.publish() is True
    finally:
        await client.close()
    assert stored_data(kube) == {"current": key.public_pem().decode()}
    assert "created ConfigMap kai-fractions/kai-fractions-signing-public with the signing " \
        f"public key(s) {key.kid}" in caplog.text
    assert "updated ConfigMap kai-fractions/kai-fractions-signing-public to the signing " \
        f"public key(s) {key.kid} (it held other keys)" in caplog.text


async def test_a_role_without_get_still_creates_and_updates_the_configmap(
        kube, tmp_path, caplog):
    # An older chart's Role (or a custom one) allows patch and create but not get: the
    # ConfigMap every node agent mounts as a required volume must still be created.
    old, new = Ed25519Key.generate(), Ed25519Key.generate()
    kube.fail("GET", CONFIGMAP, 403, times=None, reason="Forbidden",
              message='configmaps "kai-fractions-signing-public" is forbidden: cannot get')
    keys = key_dir(tmp_path, "secret", old)
    client, publisher = publisher_of(kube, keys)
    try:
        assert await publisher.publish() is True  # created
        for _ in range(2):
            await publisher.try_publish()  # the key files did not change: nothing written
        assert stored_data(kube) == {"current": old.public_pem().decode()}
        key_dir(tmp_path, "secret", new, old)
        assert await publisher.publish() is True  # patched
    finally:
        await client.close()
    assert stored_data(kube) == {"current": new.public_pem().decode(),
                                 "previous": old.public_pem().decode()}
    assert len(kube.requests("POST", "/api/v1/namespaces/kai-fractions/configmaps")) == 1
    warned = [r.getMessage() for r in caplog.records if "may not get it" in r.getMessage()]
    assert len(warned) == 1, warned  # once, not every round
    assert "not put back after a deletion or an edit until its Role allows get" in warned[0]


async def test_under_election_only_the_lease_holder_overwrites_the_configmap(kube, tmp_path):
    # Replicas whose mounted Secrets differ mid-rotation must not take turns rewriting it; a
    # missing one any replica creates (a create cannot overwrite), so agents need no leader.
    mine, theirs = Ed25519Key.generate(), Ed25519Key.generate()
    holding = False
    client, publisher = publisher_of(kube, key_dir(tmp_path, "secret", mine),
                                     in_term=lambda: holding)
    try:
        assert await publisher.publish() is True  # none there: created, leader or not
        assert stored_data(kube) == {"current": mine.public_pem().decode()}
        kube.core.patch_namespaced_config_map(
            "kai-fractions-signing-public", "kai-fractions",
            {"data": {"current": theirs.public_pem().decode()}})  # the leader's key set
        assert await publisher.publish() is False
        assert stored_data(kube) == {"current": theirs.public_pem().decode()}
        holding = True  # this replica acquired the Lease
        assert await publisher.publish() is True
    finally:
        await client.close()
    assert stored_data(kube) == {"current": mine.public_pem().decode()}


async def test_the_publisher_follows_the_mirrors_lease_when_elected(kube, tmp_path):
    from kai_fractions.cli import build_parser
    from kai_fractions.cli.mirror_background import background
    from kai_fractions.contract import Dialect, Keys
    from kai_fractions.mirror.leader import ElectionConfig

    keys = key_dir(tmp_path, "secret", Ed25519Key.generate())
    flags = ["mirror", "--signing-key-file", str(keys), "--publish-public-key", "ns/public"]
    client = Kube(k8s.ApiClient(kube.configuration()))
    try:
        for more, election in (([], None), (["--follow-bindrequests", "--leader-elect"],
                                            ElectionConfig("ns", "follower", "me"))):
            args = build_parser().parse_args([*flags, *more])
            _tasks, publisher = background(
                args, client, keys=Keys(), dialect=Dialect(args.kai_dialect),
                keyring=KeyringSource([str(keys)]), election=election,
                publish_to=["ns", "public"], daemonset=["ns", "agent"])
            if election is None:
                assert publisher.in_term is None  # one replica: it always publishes
            else:
                assert publisher.in_term is not None
                assert publisher.in_term() is False  # not elected yet
    finally:
        await client.close()
