"""The mirror's pod cache: what it keeps, and that MirrorService with it writes exactly what it
writes without it, while reading the pod from the API only when the cache cannot be trusted."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Mapping
from types import MappingProxyType

import pytest

from kai_fractions.contract.keys import ADMITTED_MPS_NAMESPACE, DEFAULT_KEYS
from kai_fractions.kube.errors import Gone
from kai_fractions.kube.listwatch import list_watch
from kai_fractions.kube.retry import Backoff
from kai_fractions.mirror import pod_cache
from kai_fractions.mirror.errors import InvalidAllocation, PodReplaced
from kai_fractions.mirror.foreground import Foreground
from kai_fractions.mirror.pod_cache import PodCache, trimmed
from kai_fractions.mirror.pod_feed import pod_selector
from kai_fractions.mirror.service import MirrorService
from kai_fractions.mirror.store import PodSnapshot
from tests.support.agent_process import wait_for
from tests.support.aio import until
from tests.support.clock import FakeClock
from tests.support.fake_store import FakePodStore
from tests.support.mirror_kube import pod_path

from . import messages
from .messages import mirror_request
from .test_service import GPU_A, NS, POD, SINGLE, UID, allocation, pod

NEW_UID = "99999999-2222-3333-4444-555555555555"


def full_pod(**meta) -> dict:
    return {
        "metadata": {"name": POD, "namespace": NS, "uid": UID, "resourceVersion": "7",
                     "labels": {"app": "x"}, "annotations": {"gpu-fraction": "0.5"},
                     "managedFields": [{"manager": "kubectl"}] * 20,
                     "ownerReferences": [{"kind": "Job"}], **meta},
        "spec": {"nodeName": "node-1", "schedulerName": "kai-scheduler",
                 "containers": [{"name": "trainer", "image": "r/x:1", "env": [{"name": "A"}],
                                 "resources": {"limits": {"nvidia.com/gpu": "1"}}}],
                 "initContainers": [{"name": "setup", "command": ["true"]}],
                 "volumes": [{"name": "v", "emptyDir": {}}]},
        "status": {"phase": "Pending", "conditions": [{"type": "PodScheduled"}]},
    }


def test_an_entry_keeps_only_what_the_contract_reads():
    obj = full_pod()
    kept = trimmed(obj)
    assert kept.view == PodSnapshot.from_object(obj).view
    assert (kept.uid, kept.resource_version) == (UID, "7")
    assert set(kept.metadata) == {"name", "namespace", "uid", "resourceVersion", "annotations",
                                  "labels"}
    assert kept.spec == {"containers": [{"name": "trainer", "resources": {
                             "limits": {"nvidia.com/gpu": "1"}}}],
                         "initContainers": [{"name": "setup"}], "nodeName": "node-1"}
    assert len(json.dumps({**kept.metadata, **kept.spec}, default=dict)) < len(json.dumps(obj)) / 2


def test_a_malformed_pod_is_kept_as_is_so_the_contract_names_the_field():
    obj = {"metadata": {"name": POD, "namespace": NS}, "spec": {"containers": "nope"}}
    assert trimmed(obj).spec == {"containers": "nope"}
    assert trimmed({"metadata": "nope"}).name == ""  # a nameless entry: never cached
    cache = PodCache()
    cache.event("ADDED", {"metadata": "nope"})
    cache.event("MODIFIED", "not a pod")  # type: ignore[arg-type]
    cache.replace(["not a pod", full_pod()])  # type: ignore[list-item]
    assert len(cache) == 1


def test_only_pending_pods_of_the_scheduler_are_watched():
    assert pod_selector("kai-scheduler") == "spec.schedulerName=kai-scheduler,status.phase=Pending"
    assert pod_selector("") == "status.phase=Pending"


def rv(cache: PodCache, name: str = POD) -> str | None:
    entry = cache.lookup(NS, name)
    return entry.resource_version if entry is not None else None


def test_a_newer_version_is_never_replaced_by_an_older_one():
    cache = PodCache()
    cache.event("ADDED", full_pod(resourceVersion="10"))
    cache.event("MODIFIED", full_pod(resourceVersion="9"))  # a late event
    assert rv(cache) == "10"
    cache.remember(PodSnapshot.from_object(full_pod(resourceVersion="12")))  # a write
    cache.event("MODIFIED", full_pod(resourceVersion="11"))
    assert rv(cache) == "12"
    cache.event("BOOKMARK", {"metadata": {"resourceVersion": "13"}})
    assert rv(cache) == "12"
    # A recreated pod (another uid) replaces the old one whatever its version: versions of two
    # pods are not compared (an etcd restored from a backup numbers anew).
    cache.event("ADDED", full_pod(uid=NEW_UID, resourceVersion="3"))
    assert cache.lookup(NS, POD).uid == NEW_UID
    # Versions that are not integers are opaque: the latest one wins.
    cache.event("MODIFIED", full_pod(uid=NEW_UID, resourceVersion="abc"))
    assert rv(cache) == "abc"


def test_a_delete_removes_only_the_pod_it_names():
    cache = PodCache()
    cache.event("ADDED", full_pod(uid=NEW_UID, resourceVersion="20"))
    cache.event("DELETED", full_pod(resourceVersion="15"))  # the old pod of the same name
    assert cache.lookup(NS, POD).uid == NEW_UID
    cache.event("DELETED", full_pod(uid=NEW_UID, resourceVersion="21"))
    assert cache.lookup(NS, POD) is None
    assert (cache.hits, cache.misses) == (1, 1)


def test_a_late_answer_about_a_deleted_pod_never_brings_it_back():
    """A read or write of the old pod answered before its DELETED but handed over after it
    (and after the recreated pod's ADDED) must not take the new pod's place: the DELETED of
    the new pod would then remove nothing, and the ghost stayed until the next list."""
    cache = PodCache()
    cache.event("ADDED", full_pod(resourceVersion="5"))
    cache.event("DELETED", full_pod(resourceVersion="7"))
    cache.remember(PodSnapshot.from_object(full_pod(resourceVersion="6")))  # no entry: a tomb
    assert cache.lookup(NS, POD) is None
    cache.event("ADDED", full_pod(uid=NEW_UID, resourceVersion="8"))
    cache.remember(PodSnapshot.from_object(full_pod(resourceVersion="6")), written=True)
    assert (cache.lookup(NS, POD).uid, rv(cache)) == (NEW_UID, "8")
    assert not cache._echoes  # a dropped answer is no echo to wait for
    cache.event("DELETED", full_pod(uid=NEW_UID, resourceVersion="9"))
    cache.remember(PodSnapshot.from_object(full_pod(uid=NEW_UID, resourceVersion="8")))
    cache.remember(PodSnapshot.from_object(full_pod(resourceVersion="6")))
    assert cache.lookup(NS, POD) is None and len(cache) == 0
    cache.event("ADDED", full_pod(uid="third", resourceVersion="10"))  # a newer pod is news
    assert cache.lookup(NS, POD).uid == "third"


def test_a_deleted_pods_uid_is_kept_out_whatever_the_versions_say():
    """Versions are opaque strings, and numbered anew by an etcd restored from a backup: a late
    answer about a deleted pod is kept out by its uid, not by comparing versions, and a list
    (or an event) of the pod recreated under its name always wins, however it is numbered."""
    cache = PodCache()
    cache.event("ADDED", full_pod(resourceVersion="a5"))
    cache.event("DELETED", full_pod(resourceVersion="a7"))
    cache.event("ADDED", full_pod(uid=NEW_UID, resourceVersion="a8"))
    cache.remember(PodSnapshot.from_object(full_pod(resourceVersion="a6")))  # late
    assert cache.lookup(NS, POD).uid == NEW_UID
    restored = PodCache()
    restored.event("ADDED", full_pod(resourceVersion="5000"))
    restored.replace([full_pod(uid=NEW_UID, resourceVersion="120")])
    assert (restored.lookup(NS, POD).uid, rv(restored)) == (NEW_UID, "120")


def test_a_deleted_pod_is_remembered_for_a_bounded_count_and_time(monkeypatch):
    now = [0.0]
    cache = PodCache(monotonic=lambda: now[0])
    monkeypatch.setattr(pod_cache, "TOMBSTONES_KEPT", 2)
    for name in ("a", "b", "c"):
        cache.event("DELETED", full_pod(name=name, resourceVersion="5"))
    assert list(cache._tombstones) == [(NS, "b", UID), (NS, "c", UID)]  # the oldest go first
    cache.remember(PodSnapshot.from_object(full_pod(name="a", resourceVersion="4")))
    assert rv(cache, "a") == "4"  # forgotten: only the next list would correct it
    now[0] += pod_cache.TOMBSTONE_SECONDS + 1
    cache.remember(PodSnapshot.from_object(full_pod(name="b", resourceVersion="4")))
    assert rv(cache, "b") == "4" and (NS, "b", UID) not in cache._tombstones
    cache.event("DELETED", full_pod(name="d", resourceVersion="6"))
    assert list(cache._tombstones) == [(NS, "d", UID)]  # and those past their age go as well


def test_a_pod_without_a_resource_version_is_always_news():
    """A server that supplies no resourceVersions (writes are then unguarded) must not leave
    the first copy of a pod in the cache for good."""
    cache = PodCache()
    cache.event("ADDED", full_pod(resourceVersion=""))
    cache.event("MODIFIED", full_pod(resourceVersion="", annotations={"gpu-fraction": "0.25"}))
    assert cache.lookup(NS, POD).annotations["gpu-fraction"] == "0.25"
    listed = full_pod(resourceVersion="", annotations={"gpu-fraction": "0.75"})
    assert cache.keep(listed).annotations["gpu-fraction"] == "0.75"
    assert cache.lookup(NS, POD).annotations["gpu-fraction"] == "0.75"


def test_a_list_replaces_everything_but_keeps_newer_writes():
    cache = PodCache()
    assert not cache.synced
    cache.event("ADDED", full_pod(name="gone", resourceVersion="5"))
    cache.remember(PodSnapshot.from_object(full_pod(resourceVersion="30")))
    cache.replace([full_pod(resourceVersion="25"), full_pod(name="new", resourceVersion="26")])
    assert cache.synced and len(cache) == 2
    assert (rv(cache), rv(cache, "new"), rv(cache, "gone")) == ("30", "26", None)


def test_prepare_runs_on_what_the_list_and_the_watch_bring_once_per_version():
    prepared: list[tuple[str, str]] = []
    cache = PodCache(prepare=lambda p: prepared.append((p.name, p.resource_version)))
    cache.replace([full_pod(resourceVersion="5"), full_pod(name="other", resourceVersion="6")])
    cache.event("MODIFIED", full_pod(resourceVersion="7"))
    cache.event("MODIFIED", full_pod(resourceVersion="7"))  # a repeat: nothing new
    cache.event("MODIFIED", full_pod(resourceVersion="6"))  # late: not kept
    cache.remember(PodSnapshot.from_object(full_pod(resourceVersion="8")), written=True)
    assert prepared == [(POD, "5"), ("other", "6"), (POD, "7")]  # the mirror's own: never
    kept = cache.lookup(NS, "other")
    cache.replace([full_pod(resourceVersion="8"), full_pod(name="other", resourceVersion="6")])
    assert cache.lookup(NS, "other") is kept  # the same version: the prepared object stays
    # Listed, the version the mirror read or wrote waits its turn as any other (as in a merge);
    # one that carries the mirror's allocation never does (test_a_pod_the_mirror_allocated_...).
    assert prepared == [(POD, "5"), ("other", "6"), (POD, "7"), (POD, "8")]


def test_a_failing_prepare_is_logged_and_the_pod_still_cached(caplog):
    def broken(pod):
        raise RuntimeError("bug")

    cache = PodCache(prepare=broken)
    cache.event("ADDED", full_pod())
    cache.replace([full_pod(name="other")])
    assert cache.lookup(NS, "other") is not None
    assert "preparing pod team-a/train-0 for allocations failed" in caplog.text


def test_user_request_is_computed_once_per_snapshot_and_keys():
    from kai_fractions.contract import Keys
    from kai_fractions.mirror.compute import user_request

    snapshot = trimmed(full_pod())
    view, request = user_request(snapshot)
    assert user_request(snapshot) == (view, request)
    assert user_request(snapshot)[1] is request
    assert [s.container for s in request.shares] == ["trainer"]
    other = user_request(snapshot, Keys(prefix="example.com/container."))
    assert other[1] is not request
    assert user_request(trimmed(full_pod()))[1] is not request  # another snapshot


async def test_a_prepared_pod_is_mirrored_exactly_as_an_unprepared_one(store):
    from kai_fractions.mirror.compute import user_request

    for prepare in (None, user_request):
        store.pods.clear()
        store.add_pod(pod({"gpu-fraction": "0.5"}))
        cache = PodCache(prepare=prepare)
        service = MirrorService(store, clock=FakeClock(), cache=cache)
        listed = await store.get_pod(NS, POD)
        cache.replace([{"metadata": listed.metadata, "spec": listed.spec}])
        assert (cache.lookup(NS, POD).parsed is not None) is (prepare is not None)
        result = await service.mirror(allocation())
        assert dict(result.annotations) == SINGLE


class Ticks:
    """A monotonic clock that moves one second per reading: with a slice of half a second, a
    merge lets the loop run after every pod (and, with 1.5 s of "busy", once each time)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


async def settle(cache: PodCache) -> None:
    while cache._merging is not None:
        await asyncio.sleep(0)


async def test_a_merged_list_lets_the_loop_run_between_slices_and_events_win():
    cache = PodCache(slice_seconds=0.5, foreground=Foreground(busy_seconds=1.5, clock=Ticks()),
                     monotonic=Ticks())
    cache.event("ADDED", full_pod(name="gone", resourceVersion="5"))
    cache.event("ADDED", full_pod(name="kept-by-event", resourceVersion="4"))
    listed = [full_pod(name=f"p{i}", resourceVersion=str(10 + i)) for i in range(6)]
    cache.merge_soon([trimmed(p) for p in listed])  # pages arrive trimmed on the loop
    assert not cache.synced and cache.lists == 0
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    partly = len(cache)
    assert 2 < partly < 8  # some of the list merged, the old entries still there
    # Events of the watch that follows the list are newer than it: they win.
    cache.event("MODIFIED", full_pod(name="p5", resourceVersion="30"))
    cache.event("DELETED", full_pod(name="p4", resourceVersion="31"))
    cache.event("MODIFIED", full_pod(name="kept-by-event", resourceVersion="32"))
    await settle(cache)
    assert cache.synced and cache.lists == 1
    assert {name for _, name in cache._pods} == {"p0", "p1", "p2", "p3", "p5", "kept-by-event"}
    assert rv(cache, "p5") == "30" and rv(cache, "p0") == "10"


async def count_turns(turns: list[int]) -> None:
    """Other work on the loop (a call's steps): counts the turns of the loop it gets."""
    while True:
        turns[0] += 1
        await asyncio.sleep(0)


@pytest.mark.parametrize("slice_seconds,yields", [(0.5, True), (1e9, False)])
async def test_a_burst_of_watch_events_lets_the_loop_run_between_slices(slice_seconds, yields):
    # A Job of thousands of pods created at once: the watch brings them back to back, and
    # each is decoded, trimmed and prepared on the serving loop (benchmarks/README.md, P6's
    # "a Job of 5000 pods at once"). With Ticks, every event spends a slice of 0.5 s.
    cache = PodCache(slice_seconds=slice_seconds,
                     foreground=Foreground(busy_seconds=1.5, clock=Ticks()), monotonic=Ticks())
    turns = [0]
    other = asyncio.create_task(count_turns(turns))
    await asyncio.sleep(0)
    began = turns[0]
    for i in range(5):
        await cache.event_soon("ADDED", full_pod(name=f"p{i}", resourceVersion=str(i + 1)))
    other.cancel()
    assert len(cache) == 5
    assert (turns[0] - began >= 5) is yields  # a slice of a whole event: a turn after each


async def test_a_listed_page_is_stored_as_it_arrives_and_the_merge_prepares_it():
    prepared: list[str] = []
    cache = PodCache(prepare=lambda p: prepared.append(p.name))
    cache.remember(PodSnapshot.from_object(full_pod(name="written", resourceVersion="50")))
    page = [cache.keep(full_pod(name="early", resourceVersion="5")),
            cache.keep(full_pod(name="written", resourceVersion="40"))]
    assert rv(cache, "early") == "5" and not cache.synced  # found before the list ends
    assert rv(cache, "written") == "50" and prepared == []  # a newer write stays
    cache.merge_soon(page)
    await settle(cache)
    assert prepared == ["early"] and cache.synced


def test_a_listed_pod_held_at_that_version_comes_back_as_the_object_held():
    # Its copy goes as its page is kept, not with the whole list once merged: a re-list's
    # copies of every held pod, freed at once, held the serving loop (benchmarks/README.md,
    # P6 round thirteen).
    cache = PodCache()
    held = cache.keep(full_pod(resourceVersion="5"))
    assert cache.keep(full_pod(resourceVersion="5")) is held
    assert cache.keep(full_pod(uid=NEW_UID, resourceVersion="5")) is not held  # another pod
    newer = cache.keep(full_pod(uid=NEW_UID, resourceVersion="6"))
    assert cache.lookup(NS, POD) is newer


async def test_a_newer_list_cancels_the_merge_in_progress():
    cache = PodCache(slice_seconds=0.5, foreground=Foreground(busy_seconds=1.5, clock=Ticks()),
                     monotonic=Ticks())
    cache.merge_soon([full_pod(name=f"old{i}", resourceVersion=str(i + 1)) for i in range(50)])
    await asyncio.sleep(0)
    cache.merge_soon([full_pod(name="new", resourceVersion="100")])
    await settle(cache)
    assert [name for _, name in cache._pods] == ["new"] and cache.lists == 1


async def test_a_merge_prepares_what_is_new_and_keeps_what_was_prepared():
    prepared: list[str] = []
    cache = PodCache(prepare=lambda p: prepared.append(p.name))
    cache.merge_soon([full_pod(resourceVersion="5"), full_pod(name="other")])
    await settle(cache)
    kept = cache.lookup(NS, "other")
    cache.merge_soon([full_pod(resourceVersion="6"), full_pod(name="other")])
    await settle(cache)
    assert prepared == [POD, "other", POD] and cache.lookup(NS, "other") is kept


def test_only_the_first_pods_are_prepared_and_a_slot_frees_when_one_leaves():
    prepared: list[str] = []
    cache = PodCache(prepare=lambda p: prepared.append(p.name), prepared_kept=2)
    cache.replace([full_pod(name=f"p{i}", resourceVersion=str(i + 1)) for i in range(4)])
    assert prepared == ["p0", "p1"]  # the others: parsed by their first allocation
    cache.event("MODIFIED", full_pod(name="p1", resourceVersion="9"))  # its new version
    cache.event("DELETED", full_pod(name="p0", resourceVersion="10"))
    cache.event("ADDED", full_pod(name="p9", resourceVersion="11"))
    assert prepared == ["p0", "p1", "p1", "p9"]
    cache.event("ADDED", full_pod(name="p8", resourceVersion="12"))
    assert prepared[-1] == "p9"


async def test_a_freed_slot_is_refilled_between_calls_with_the_oldest_pod_waiting():
    # A scheduler working through a long queue in order: the pods it binds next are parsed
    # ahead, not only the first `prepared_kept` the cache ever held.
    prepared: list[str] = []
    foreground = Foreground(rest=0, max_wait=0.5)
    cache = PodCache(prepare=lambda p: prepared.append(p.name), prepared_kept=2,
                     foreground=foreground)
    cache.merge_soon([full_pod(name=f"p{i}", resourceVersion=str(i + 1)) for i in range(5)])
    await settle(cache)
    assert prepared == ["p0", "p1"]
    with foreground.call():  # the mirror writes p0: its slot frees inside the call
        cache.remember(PodSnapshot.from_object(full_pod(name="p0", resourceVersion="20")),
                       written=True)
        await asyncio.sleep(0.01)
        assert prepared == ["p0", "p1"]  # the call goes first
    await until(lambda: prepared == ["p0", "p1", "p2"], "p2 prepared")
    cache.event("DELETED", full_pod(name="p1", resourceVersion="21"))
    await until(lambda: prepared == ["p0", "p1", "p2", "p3"], "p3 prepared")
    cache.remember(PodSnapshot.from_object(full_pod(name="p3", resourceVersion="22")),
                   written=True)
    cache.event("DELETED", full_pod(name="p4", resourceVersion="23"))  # gone before its turn
    await asyncio.sleep(0.05)
    assert prepared == ["p0", "p1", "p2", "p3"] and cache._refilling is None


async def test_a_pod_still_waiting_keeps_its_turn_across_a_list_of_the_same_versions():
    prepared: list[str] = []
    cache = PodCache(prepare=lambda p: prepared.append(p.name), prepared_kept=1,
                     foreground=Foreground(rest=0))
    listed = [full_pod(name="p0", resourceVersion="1"), full_pod(name="p1", resourceVersion="2")]
    cache.replace(listed)
    cache.replace(listed)  # the same versions: p0 stays prepared, p1 waits again
    assert prepared == ["p0"]
    cache.event("DELETED", full_pod(name="p0", resourceVersion="3"))
    await until(lambda: prepared == ["p0", "p1"], "p1 prepared")


def test_a_pod_the_mirror_allocated_is_not_prepared_again():
    # Its next step is the bind, not an allocation: a parse would take a slot for nothing.
    prepared: list[str] = []
    cache = PodCache(prepare=lambda p: prepared.append(p.name))
    bound = full_pod(resourceVersion="9")
    bound["metadata"]["annotations"][pod_cache.MIRRORED_ANNOTATION] = '{"container":"t"}'
    cache.event("MODIFIED", bound)
    cache.replace([bound, full_pod(name="waiting")])
    assert prepared == ["waiting"] and cache._pods[(NS, POD)].resource_version == "9"


def test_a_pod_the_mirror_allocated_is_held_as_its_identity_and_a_lookup_misses():
    # Every call about an allocated pod reads the API's copy anyway (a duplicate is confirmed
    # by a read, a conflicting allocation too): its annotations would save no read, only cost
    # memory, and they are the largest part of a written pod.
    cache = PodCache()
    bound = full_pod(resourceVersion="9")
    bound["metadata"]["annotations"][pod_cache.MIRRORED_ANNOTATION] = '{"container":"t"}'
    cache.event("MODIFIED", bound)
    held = cache._pods[(NS, POD)]
    assert dict(held.metadata) == {"name": POD, "namespace": NS, "uid": UID,
                                   "resourceVersion": "9"}
    assert held.spec is pod_cache.ALLOCATED and cache.lookup(NS, POD) is None
    assert (cache.hits, cache.misses) == (0, 1)
    # It still keeps an older copy out (a list that began before the write)...
    cache.replace([full_pod(resourceVersion="8")])
    assert cache._pods[(NS, POD)] is held
    # ...and the pod comes back whole once it no longer carries an allocation (a release).
    cache.event("MODIFIED", full_pod(resourceVersion="10"))
    assert rv(cache) == "10" and cache.lookup(NS, POD).annotations == {"gpu-fraction": "0.5"}


async def test_a_new_list_orders_the_pods_waiting_anew_and_the_wait_stays_bounded():
    prepared: list[str] = []
    cache = PodCache(prepare=lambda p: prepared.append(p.name), prepared_kept=1)
    cache.merge_soon([full_pod(name="p0", resourceVersion="1")])
    await settle(cache)
    for i in range(50):  # churn with no list: pods come and go while the slot stays taken
        cache.event("ADDED", full_pod(name=f"c{i}", resourceVersion=str(100 + 2 * i)))
        cache.event("DELETED", full_pod(name=f"c{i}", resourceVersion=str(101 + 2 * i)))
    assert len(cache._waiting) < 10  # not one per pod that came and went
    cache.merge_soon([full_pod(name=n, resourceVersion="1") for n in ("p0", "a", "b")])
    await settle(cache)
    assert list(cache._waiting) == [(NS, "a"), (NS, "b")]


def test_trimmed_keeps_a_snapshot_and_shares_repeated_strings():
    snapshot = trimmed(full_pod())
    assert trimmed(snapshot) is snapshot
    a, b = trimmed(json.loads(json.dumps(full_pod()))), trimmed(json.loads(json.dumps(full_pod())))
    assert a.annotations["gpu-fraction"] is b.annotations["gpu-fraction"]
    assert a.metadata["namespace"] is b.metadata["namespace"]


def test_equal_maps_are_one_read_only_map_which_the_contracts_view_reads_as_a_dict():
    pod_cache._shared.clear()  # no clearing at its bound between the two pods
    a, b = (trimmed(json.loads(json.dumps(full_pod()))) for _ in range(2))
    annotations = a.metadata["annotations"]
    assert annotations is b.metadata["annotations"] and a.metadata["labels"] is b.metadata[
        "labels"]
    with pytest.raises(TypeError):
        annotations["gpu-fraction"] = "1"  # type: ignore[index]
    # The contract's parse reads a dict of its own (at dict speed), equal to the shared map.
    assert a.view.annotations == annotations == dict(annotations)
    assert type(a.view.annotations) is MappingProxyType
    assert a.spec is b.spec and a.view.containers == b.view.containers  # a job's: one spec
    with pytest.raises(TypeError):
        a.spec["nodeName"] = "elsewhere"  # type: ignore[index]


def test_a_map_seen_once_is_kept_by_its_hash_not_by_a_copy_of_its_text():
    pod_cache._shared.clear()
    once = full_pod(name="its-own")
    once["metadata"]["annotations"]["team-note"] = "x" * 500
    trimmed(once)
    assert all(not isinstance(key, str) or "x" * 500 not in key for key in pod_cache._shared)
    # Its labels are a job's, seen on every pod: shared all the same.
    assert trimmed(full_pod()).metadata["labels"] is trimmed(once).metadata["labels"]


def test_a_map_naming_a_pods_own_mps_namespace_skips_the_table_and_the_interning():
    # The admission webhook names an MPS namespace per sm-sharing container: such a map is equal
    # to no other pod's, and its namespace is in no other string.
    pod_cache._shared.clear()
    key = DEFAULT_KEYS.derived("trainer", ADMITTED_MPS_NAMESPACE)
    pods = [full_pod(name=f"p{i}") for i in range(2)]
    for i, p in enumerate(pods):
        p["metadata"]["annotations"][key] = f"kf_{i:020x}"
    a, b = (trimmed(json.loads(json.dumps(p))).metadata["annotations"] for p in pods)
    kept = [v for v in pod_cache._shared.values() if isinstance(v, Mapping)]
    assert kept and all(key not in v for v in kept)  # the labels are kept, not these
    assert a["gpu-fraction"] is b["gpu-fraction"]  # the values pods share are still one string
    namespace = a[key]
    assert sys.intern("".join(["kf_", "0" * 20])) is not namespace


def test_a_map_that_is_not_a_string_map_is_left_for_the_contract_to_name():
    odd = full_pod()
    odd["metadata"]["labels"] = {"app": ["not", "a", "string"]}
    assert trimmed(odd).metadata["labels"] == {"app": ["not", "a", "string"]}


# -- MirrorService with a cache ---------------------------------------------------------------

@pytest.fixture
def store() -> FakePodStore:
    store = FakePodStore(nodes={"node-1": {}})  # the node the allocations name
    store.reads = 0

    def count(operation: str, namespace: str, name: str) -> None:
        if operation == "get":
            store.reads += 1

    store.faults.append(count)
    return store


@pytest.fixture
def cache() -> PodCache:
    return PodCache()


@pytest.fixture
def service(store: FakePodStore, cache: PodCache) -> MirrorService:
    return MirrorService(store, clock=FakeClock(), cache=cache)


def cached_from_store(store: FakePodStore, cache: PodCache) -> None:
    cache.replace([store.pods[(NS, POD)]])


async def test_a_cached_pod_is_written_without_a_read(service, store, cache):
    store.add_pod(pod({"gpu-fraction": "0.5"}))
    cached_from_store(store, cache)
    result = await service.mirror(allocation())
    assert result.changed and store.reads == 0 and len(store.patches) == 1
    owned = {key: store.annotations(NS, POD)[key] for key in SINGLE}
    assert owned == SINGLE
    # Write-through: the written version is the cache's entry at once (identity only: a
    # later call about the pod reads it).
    assert cache._pods[(NS, POD)].resource_version == result.resource_version
    assert cache.lookup(NS, POD) is None


async def test_a_duplicate_is_confirmed_by_a_read_and_writes_nothing(service, store, cache):
    store.add_pod(pod({"gpu-fraction": "0.5"}))
    cached_from_store(store, cache)
    await service.mirror(allocation(), idempotency_key="k-1")
    again = await service.mirror(allocation(), idempotency_key="k-1")
    assert not again.changed and len(store.patches) == 1 and store.reads == 1


async def test_a_stale_entry_that_looks_done_never_answers_done(service, store, cache):
    """The cache says the allocation is there; meanwhile somebody removed it: the mirror must
    write it again, not report success from the cache."""
    store.add_pod(pod({"gpu-fraction": "0.5"}))
    cached_from_store(store, cache)
    await service.mirror(allocation())
    store.pods[(NS, POD)]["metadata"]["annotations"] = {"gpu-fraction": "0.5"}  # not watched
    again = await service.mirror(allocation())
    assert again.changed and len(store.patches) == 2 and store.reads == 1
    assert {key: store.annotations(NS, POD)[key] for key in SINGLE} == SINGLE


async def test_a_stale_entry_costs_one_refused_write_and_a_read(service, store, cache):
    store.add_pod(pod({"gpu-fraction": "0.5"}))
    cached_from_store(store, cache)
    # The pod changes behind the cache's back (a label, say): its resourceVersion moves on.
    await store.patch_annotations(NS, POD, {"team": "a"}, uid=UID, resource_version="")
    result = await service.mirror(allocation())
    assert result.changed and store.reads == 1
    label, refused, written = store.patches  # the first write was refused (409), then read
    assert label[2] == {"team": "a"} and refused[2] == written[2]
    assert store.annotations(NS, POD)["team"] == "a"


async def test_a_cached_pod_of_another_uid_is_read_again(service, store, cache):
    store.add_pod(pod({"gpu-fraction": "0.5"}, uid=NEW_UID))
    cache.replace([pod({"gpu-fraction": "0.5"}) | {"metadata": {
        "name": POD, "namespace": NS, "uid": UID, "resourceVersion": "1"}}])
    # The caller names the new pod; the cache still has the old one: read, then write.
    result = await service.mirror(allocation(pod_uid=NEW_UID))
    assert result.changed and store.reads == 1
    # The caller names the old pod, which the API no longer has: refused, nothing written.
    with pytest.raises(PodReplaced):
        await service.mirror(allocation(pod_uid=UID))
    assert len(store.patches) == 1


async def test_a_stale_entry_of_a_recreated_pod_is_read_again_for_a_caller_naming_none(
        service, store, cache):
    """KAI's BindRequest names no uid: a write refused for the cached entry's uid (422) is a
    pod recreated under the name, which the call is for; the mirror reads it, refreshes the
    cache and writes, where it used to answer PodReplaced ("drop the decision") every time."""
    store.add_pod(pod({"gpu-fraction": "0.5"}))
    cached_from_store(store, cache)
    store.delete_pod(NS, POD)
    store.add_pod(pod({"gpu-fraction": "0.5"}, uid=NEW_UID))  # the watch has not said so yet
    result = await service.mirror(allocation(pod_uid=""))
    assert result.changed and len(store.patches) == 2  # the refused one, then the write
    assert cache._pods[(NS, POD)].uid == NEW_UID
    assert store.annotations(NS, POD)["nvidia.com/container.trainer.gpus.devices"] == GPU_A


async def test_a_caller_naming_the_uid_of_a_pod_recreated_under_the_write_gets_pod_replaced(
        service, store, cache):
    store.add_pod(pod({"gpu-fraction": "0.5"}))
    cached_from_store(store, cache)
    store.delete_pod(NS, POD)
    store.add_pod(pod({"gpu-fraction": "0.5"}, uid=NEW_UID))
    with pytest.raises(PodReplaced):
        await service.mirror(allocation(pod_uid=UID))
    assert len(store.patches) == 1 and cache._pods[(NS, POD)].uid == NEW_UID


async def test_without_an_entry_the_pod_is_read_and_then_cached(service, store, cache):
    store.add_pod(pod({"gpu-fraction": "0.5"}))
    await service.preview(allocation())  # reads the pod, writes nothing
    assert store.reads == 1 and cache.lookup(NS, POD) is not None
    assert (await service.mirror(allocation())).changed and store.reads == 1


# -- list + watch -----------------------------------------------------------------------------

class ScriptedSource:
    """list() and watch() answer from scripts; after the last watch the loop is cancelled."""

    what = "pod(s)"

    def __init__(self, lists, watches):
        self.lists, self.watches = list(lists), list(watches)

    async def list(self, resource_version=""):
        return self.lists.pop(0)

    async def watch(self, resource_version):
        if not self.watches:
            raise asyncio.CancelledError  # the script is over: end the loop
        for event in self.watches.pop(0):
            if isinstance(event, Exception):
                raise event
            yield event


async def test_the_cache_follows_a_list_and_its_watch_through_an_expiry():
    cache = PodCache()
    source = ScriptedSource(
        lists=[([full_pod(resourceVersion="5")], "5"),
               ([full_pod(name="b", resourceVersion="9")], "9")],
        watches=[[("MODIFIED", full_pod(resourceVersion="6")), Gone("too old")],
                 [("ADDED", full_pod(name="c", resourceVersion="10"))]])
    with pytest.raises(asyncio.CancelledError):
        await list_watch(source, cache.replace, cache.event,
                         backoff=Backoff(base=0.001, cap=0.001))
    # The relist after the expiry dropped the pod that is gone, the watch then added one.
    assert (rv(cache), rv(cache, "b"), rv(cache, "c")) == (None, "9", "10")


# -- against kmock, through gRPC --------------------------------------------------------------

@pytest.mark.integration
def test_a_watched_pod_costs_one_patch_and_its_duplicate_one_read(mirror_factory):
    mirror = mirror_factory(transport="tcp", pod_cache=True)
    cache = mirror.service.cache
    created = mirror.create_pod("train-0", {"gpu-fraction": "0.5"})
    path = pod_path("team-a", "train-0")
    wait_for(lambda: cache.lookup("team-a", "train-0") is not None,
             what="the pod cache to catch up")

    request = mirror_request(messages.allocation(created), key="k-1")
    first = mirror.stub.MirrorAllocation(request, timeout=10)
    assert first.changed
    assert (mirror.kube.count("GET", path), mirror.patches("team-a", "train-0")) == (0, 1)

    again = mirror.stub.MirrorAllocation(request, timeout=10)
    assert not again.changed and again.resource_version == first.resource_version
    assert (mirror.kube.count("GET", path), mirror.patches("team-a", "train-0")) == (1, 1)

    # Somebody strips the annotations; before the watch delivers that, the mirror's answer
    # must still come from the API server, and it writes them again.
    mirror.kube.core.patch_namespaced_pod("train-0", "team-a", {"metadata": {
        "annotations": {key: None for key in mirror.annotations("team-a", "train-0")
                        if key != "gpu-fraction"}}})
    third = mirror.stub.MirrorAllocation(request, timeout=10)
    assert third.changed and mirror.annotations("team-a", "train-0")[
        "nvidia.com/container.trainer.gpu-memory.request"] == "20Gi"  # upstream KAI's form


# -- the mirror's own writes coming back on the watch -----------------------------------------

def event_line(kind: str, obj: dict) -> str:
    return json.dumps({"type": kind, "object": obj}, separators=(",", ":"))


def test_an_echo_of_the_mirrors_own_write_is_recognised_once():
    cache = PodCache()
    written = full_pod(resourceVersion="31")
    other = full_pod(resourceVersion="32")
    assert not cache.is_echo(event_line("MODIFIED", written))  # nothing written yet
    cache.remember(PodSnapshot.from_object(full_pod(resourceVersion="30")))  # a read
    cache.remember(PodSnapshot.from_object(written), written=True)
    assert not cache.is_echo(event_line("MODIFIED", other))
    assert cache.is_echo(event_line("MODIFIED", written))
    assert not cache.is_echo(event_line("MODIFIED", written))  # once only (a replay parses)
    assert not cache.is_echo('{"type":"BOOKMARK","object":{}}')
    # The watch may bring a write before its response does: then no echo is left to expect.
    cache.event("MODIFIED", full_pod(resourceVersion="35"))
    cache.remember(PodSnapshot.from_object(full_pod(resourceVersion="35")), written=True)
    assert cache._echoes == {}


def test_only_the_latest_writes_are_remembered_as_echoes(monkeypatch):
    monkeypatch.setattr(pod_cache, "ECHOES_KEPT", 2)
    cache = PodCache()
    for version in ("1", "2", "3"):
        cache.remember(PodSnapshot.from_object(full_pod(resourceVersion=version)), written=True)
    assert [cache.is_echo(event_line("MODIFIED", full_pod(resourceVersion=v)))
            for v in ("1", "2", "3")] == [False, True, True]


async def test_a_stale_entry_never_refuses_a_call(service, store, cache):
    """The cache holds another allocation (since released) and a bad user key (since fixed):
    neither refusal may come from it, only from the API server's copy."""
    store.add_pod(pod({"gpu-fraction": "0.5"}))
    cached_from_store(store, cache)
    await service.mirror(allocation())
    stale = await store.get_pod(NS, POD)  # it holds this allocation now
    await service.release(NS, POD, UID)

    def lagging(snapshot: PodSnapshot, **annotations: str) -> PodCache:
        lag = PodCache()  # a cache whose watch has not delivered the latest change yet
        lag.replace([{"metadata": {**snapshot.metadata, "annotations": {
            **snapshot.annotations, **annotations}}, "spec": snapshot.spec}])
        return lag

    service.cache = lagging(stale)
    rebind = allocation(portion="0.25", gpu_ids=("GPU-2222bbbb",))
    reads = store.reads
    assert (await service.mirror(rebind)).changed and store.reads == reads + 1
    assert store.annotations(NS, POD)["nvidia.com/container.trainer.gpu-memory.request"] == \
        "10Gi"  # the rebind's quarter, not the cached half
    # A bad key only the cache still has: not refused either (and nothing left to write).
    service.cache = lagging(await store.get_pod(NS, POD), **{"gpu-fraction": "1.5"})
    assert not (await service.mirror(rebind)).changed
    # The same on a pod with no allocation yet, which the cache holds whole: read, then written.
    store.add_pod(pod({"gpu-fraction": "0.5"}, name="fresh"))
    service.cache = lagging(await store.get_pod(NS, "fresh"), **{"gpu-fraction": "1.5"})
    reads = store.reads
    assert service.cache.lookup(NS, "fresh") is not None
    assert (await service.mirror(allocation(pod_name="fresh"))).changed
    assert store.reads == reads + 1


async def test_a_refusal_the_api_confirms_is_the_answer(service, store, cache):
    store.add_pod(pod({"gpu-fraction": "1.5"}))
    cached_from_store(store, cache)
    with pytest.raises(InvalidAllocation):
        await service.mirror(allocation())
    assert store.reads == 1 and store.patches == []


def test_a_lookup_for_another_uid_is_a_miss():
    """The caller then reads the pod from the API server: counted a hit, the metric's hit
    ratio was overstated exactly while pods are recreated."""
    cache = PodCache()
    cache.event("ADDED", full_pod(resourceVersion="1"))
    assert cache.lookup(NS, POD, NEW_UID) is None
    assert cache.lookup(NS, POD, UID).uid == UID
    assert cache.lookup(NS, POD).uid == UID  # a caller naming no uid takes whatever is there
    assert (cache.hits, cache.misses) == (2, 1)
