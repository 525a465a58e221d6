"""The follow loop checks a BindRequest again, after a bounded backoff, when its check could not
finish for a reason that passes by itself: the watch shows a BindRequest only when it changes,
the next list comes 600 to 900 s later, and the node agent's gate fails a pod it waited 600 s
for (its default --timeout). What cannot pass by itself waits for a change; a recheck ends with
the BindRequest (a newer version, its deletion) and with the follower's term."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from kai_fractions.kube.objects import epoch_seconds
from kai_fractions.kube.retry import Backoff
from kai_fractions.mirror.bindrequest_view import BindRequestView
from kai_fractions.mirror.bindrequests import follow
from kai_fractions.mirror.errors import ApiUnavailable
from kai_fractions.mirror.follower import Follower
from kai_fractions.mirror.rechecks import RECHECK_BACKOFF, RECHECK_WINDOW, Rechecks
from kai_fractions.signing import Keyring
from tests.support.fake_store import FakePodStore

from .test_follower import (
    BOUND,
    GPU_B,
    NS,
    SIGNATURE,
    Keys,
    T,
    bind_request,
    one_group_store,
    pod,
    reservation_pod,
)

FAST = Backoff(attempts=1_000_000, base=0.01, cap=0.04)
"""The production backoff's shape (doubling, capped), at a test's pace."""


class QueueSource:
    """A BindRequest collection whose list is `listed` and whose one watch stream stays open
    (a real one lasts 300 s, so no relist comes), yielding what the test puts in `events`."""

    what = "BindRequest(s)"

    def __init__(self, listed: list[dict] | None = None) -> None:
        self.listed = listed or []
        self.lists = 0
        self.events: asyncio.Queue = asyncio.Queue()

    async def list(self, resource_version: str = ""):
        self.lists += 1
        return list(self.listed), "1"

    async def watch(self, resource_version: str):
        while True:
            yield await self.events.get()


def versioned(br: dict, rv: str, uid: str = "br-uid-1") -> dict:
    return {**br, "metadata": {**br["metadata"], "uid": uid, "resourceVersion": rv}}


CREATED = "2026-12-02T10:00:00Z"
JUST_AFTER = epoch_seconds(CREATED) + 1
"""A follower's clock a second after CREATED: a Pending BindRequest then is fresh."""


def pending(br: dict) -> dict:
    """`br` as KAI's scheduler creates it (at CREATED), before its binder marks it Succeeded."""
    return {**br, "metadata": {**br["metadata"], "creationTimestamp": CREATED},
            "status": {"phase": ""}}


@pytest.fixture
def store() -> FakePodStore:
    return one_group_store()


class Following:
    """`follow` over `source`, its handle the follower's `follow_one` as the mirror wires it
    (the result goes back to the loop), counting each BindRequest's handlings."""

    def __init__(self, source: QueueSource, follower: Follower, **options) -> None:
        self.source, self.follower = source, follower
        self.handled: list[str] = []

        async def handle(br: BindRequestView):
            self.handled.append(br.name)
            return await follower.follow_one(br)

        options.setdefault("concurrency", 2)
        self.task = asyncio.create_task(follow(source, handle, forget=follower.forget,
                                               backoff=Backoff(base=0.001, cap=0.001),
                                               **options))

    def count(self, name: str) -> int:
        return self.handled.count(name)

    async def until(self, predicate: Callable[[], bool], timeout: float = 5.0) -> float:
        began = time.monotonic()
        while not predicate():
            assert not self.task.done(), self.task.exception()
            assert time.monotonic() - began < timeout, (
                f"timed out; handled {len(self.handled)}, the last {self.handled[-8:]}")
            await asyncio.sleep(0.005)
        return time.monotonic() - began

    async def stop(self) -> None:
        self.task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await self.task


async def settled(predicate: Callable[[], bool]) -> None:
    while not predicate():
        await asyncio.sleep(0.005)


def signer() -> Keys:
    return Keys(Keyring.of(b"k" * 32))


async def test_a_transient_api_failure_on_a_fresh_bind_is_checked_again_and_signed(store):
    # The store gives up after its own tries (ApiUnavailable: "check failed"); nothing changes
    # on the BindRequest afterwards. With the production backoff the pod is signed within
    # about a second, not at the next list (600-900 s; the gate gives up at 600 s).
    store.add_pod(pod("train-0", {"gpu-fraction": "0.5", **BOUND}))
    blips = [1]

    def blip(operation, _namespace, name):
        if operation == "get" and name == "train-0" and blips[0]:
            blips[0] -= 1
            raise ApiUnavailable("read pod team-a/train-0: the Kubernetes API failed 5 "
                                 "time(s), last: 503; retry later")

    store.faults.append(blip)
    source = QueueSource()
    following = Following(source, Follower(store, signer=signer(), now=lambda: JUST_AFTER))
    br = bind_request("br-1", "train-0")
    source.events.put_nowait(("ADDED", versioned(pending(br), "1")))
    source.events.put_nowait(("MODIFIED", versioned(br, "2")))
    waited = await following.until(
        lambda: SIGNATURE in store.annotations(NS, "train-0"))
    await following.stop()
    assert waited < RECHECK_BACKOFF.base * 3 and source.lists == 1
    assert following.count("br-1") == 3  # Pending, the failed check, its recheck


async def test_status_writes_racing_the_signature_are_checked_again_and_signed(store):
    # KAI's binder patches the pod's status right after it marks the BindRequest Succeeded
    # (KAI-Scheduler pkg/binder/controllers/bindrequest_controller.go, Reconcile's deferred
    # updatePodCondition), and the kubelet writes it as soon as the pod is bound: each bumps
    # the resourceVersion the signing patch is guarded by. Three in a row used all of
    # SIGN_ATTEMPTS, and the pod stayed unsigned until the next list.
    store.add_pod(pod("train-0", {"gpu-fraction": "0.5", **BOUND}))
    writes = [3]

    def status_write(operation, namespace, name):
        if operation == "patch" and writes[0]:
            writes[0] -= 1
            obj = store.pods[(namespace, name)]
            obj["metadata"]["resourceVersion"] = str(next(store._versions))
            obj.setdefault("status", {})["conditions"] = [{"type": "PodBound",
                                                           "status": "True"}]

    store.faults.append(status_write)
    source = QueueSource(listed=[versioned(bind_request("br-1", "train-0"), "2")])
    following = Following(source, Follower(store, signer=signer()))
    await following.until(lambda: SIGNATURE in store.annotations(NS, "train-0"))
    await following.stop()
    assert following.count("br-1") == 2 and source.lists == 1
    (unsigned,) = [e.message for e in store.events]
    assert unsigned.startswith("not signed: it changed under 3 attempt(s); the follower "
                               "checks it again in 1 s, then at doubling intervals of at most "
                               "60 s, until it is signed or the BindRequest changes")


async def test_a_final_mismatch_waits_for_a_change_while_an_unknown_gpu_is_checked_again(store):
    # Both incomplete: the reserved GPU not known yet (that may pass by itself: here the
    # reservation pod appears later), and annotations that differ from the decision (final
    # until something changes): only the first is checked again.
    store.add_pod(pod("train-0", {"gpu-fraction": "0.5", **BOUND,
                                  f"{T}.gpus.devices": GPU_B}))  # not the reserved GPU
    store.add_pod(pod("train-1", {"gpu-fraction": "0.5", **BOUND, f"{T}.gpus.devices": GPU_B}))
    source = QueueSource(listed=[
        versioned(bind_request("mismatch", "train-0"), "2", uid="uid-m"),
        versioned(bind_request("unknown", "train-1", groups=("group-b",)), "3", uid="uid-u")])
    following = Following(source, Follower(store, signer=signer()),
                          recheck_backoff=FAST)
    await following.until(lambda: following.count("unknown") >= 3)
    store.add_pod(reservation_pod("group-b", GPU_B))
    await following.until(lambda: SIGNATURE in store.annotations(NS, "train-1"))
    settled = following.count("unknown")
    await asyncio.sleep(0.2)  # many backoffs
    await following.stop()
    assert following.count("mismatch") == 1
    assert following.count("unknown") == settled  # signed: complete, no more rechecks
    assert SIGNATURE not in store.annotations(NS, "train-0")
    assert [e.reason for e in store.events if e.pod == "train-0"] == ["NvFractionsMismatch"]
    # One event for all the rechecks of the unknown GPU (each finding is reported once).
    assert [e.reason for e in store.events if e.pod == "train-1"] == ["NvFractionsUnsigned"]


async def test_the_recheck_of_a_deleted_bind_request_stops(store):
    store.add_pod(pod("train-0", {"gpu-fraction": "0.5", **BOUND}))
    br = versioned(bind_request("br-1", "train-0", groups=("group-gone",)), "2")
    source = QueueSource(listed=[br])
    following = Following(source, Follower(store, signer=signer()), recheck_backoff=FAST)
    await following.until(lambda: following.count("br-1") >= 2)
    source.events.put_nowait(("DELETED", versioned(br, "3")))
    await following.until(lambda: source.events.empty())
    await asyncio.sleep(0.02)  # a check under way when the deletion came may end
    checked = following.count("br-1")
    await asyncio.sleep(0.2)
    await following.stop()
    assert following.count("br-1") == checked


async def test_a_newer_version_takes_over_from_the_recheck_of_an_older_one(store):
    # The recheck of version 2 must not run after (or beside) the check of version 3.
    store.add_pod(pod("train-0", {"gpu-fraction": "0.5", **BOUND}))
    br = bind_request("br-1", "train-0", groups=("group-gone",))
    source = QueueSource(listed=[versioned(br, "2")])
    versions: list[str] = []
    follower = Follower(store, signer=signer())

    async def handle(view: BindRequestView):
        versions.append(view.resource_version)
        return await follower.follow_one(view)

    task = asyncio.create_task(follow(source, handle, concurrency=2, recheck_backoff=FAST))
    try:
        await asyncio.wait_for(settled(lambda: versions.count("2") >= 2), 5)
        fixed = bind_request("br-1", "train-0")  # rescheduled onto a known group
        source.events.put_nowait(("MODIFIED", versioned(fixed, "3")))
        await asyncio.wait_for(settled(
            lambda: SIGNATURE in store.annotations(NS, "train-0")), 5)
        await asyncio.sleep(0.2)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    first_3 = versions.index("3")
    assert set(versions[first_3:]) == {"3"} and versions.count("3") == 1, versions


async def test_rechecks_stop_when_the_term_ends(store):
    # A leader that loses the Lease stops following (its follow() is cancelled): no recheck
    # of its runs after. A check whose write the ended term dropped is not checked again by
    # it either (the next leader lists everything).
    store.add_pod(pod("train-0", {"gpu-fraction": "0.5", **BOUND}))
    br = versioned(bind_request("br-1", "train-0", groups=("group-gone",)), "2")
    following = Following(QueueSource(listed=[br]), Follower(store, signer=signer()),
                          recheck_backoff=FAST)
    await following.until(lambda: following.count("br-1") >= 3)
    await following.stop()
    stopped = following.count("br-1")
    await asyncio.sleep(0.2)  # many backoffs
    assert following.count("br-1") == stopped
    assert [e.reason for e in store.events] == ["NvFractionsUnsigned"]
    ended = Follower(store, signer=signer(), in_term=lambda: False)
    following = Following(QueueSource(listed=[br]), ended, recheck_backoff=FAST)
    await following.until(lambda: following.count("br-1") == 1)
    await asyncio.sleep(0.2)
    await following.stop()
    assert following.count("br-1") == 1
    assert [e.reason for e in store.events] == ["NvFractionsUnsigned"]  # its event dropped


async def test_rechecks_that_keep_falling_due_leave_the_listed_ones_their_turn(store):
    # Many BindRequests whose GPU is never known, rechecked at once each time: the listed ones
    # behind them are still handed over (turn about), and the watch's events go first.
    stuck = [versioned(bind_request(f"stuck-{i}", "train-0", groups=("group-gone",)), "2",
                       uid=f"uid-s{i}") for i in range(20)]
    for i, br in enumerate(stuck):
        br["metadata"]["creationTimestamp"] = f"2026-12-02T10:00:{i:02}Z"  # newest: first
    store.add_pod(pod("train-0", {"gpu-fraction": "0.5", **BOUND}))
    listed = [versioned(bind_request(f"listed-{i}", f"ok-{i}"), "2", uid=f"uid-l{i}")
              for i in range(5)]
    for i in range(5):
        store.add_pod(pod(f"ok-{i}", {"gpu-fraction": "0.5", **BOUND}))
    source = QueueSource(listed=[*listed, *stuck])
    following = Following(source, Follower(store, signer=signer()), concurrency=2,
                          recheck_backoff=Backoff(attempts=1_000_000, base=0.0, cap=0.0))
    await following.until(lambda: sum(following.count(f"stuck-{i}") for i in range(20)) >= 100)
    source.events.put_nowait(("ADDED", versioned(bind_request("event", "ok-0"), "3",
                                                 uid="uid-e")))
    await following.until(lambda: all(following.count(f"listed-{i}") == 1 for i in range(5))
                          and following.count("event") == 1)
    await following.stop()


async def test_one_version_is_checked_again_only_within_the_window():
    """A cause that does not pass (a reservation namespace set wrong: every check "GPU not known
    yet") must not check each BindRequest once a minute for ever: one version is checked again
    for RECHECK_WINDOW (past the gate's 600 s), then only when it changes or at a list."""
    fired: list[str] = []
    rechecks = Rechecks(fired.append, FAST, window=0.2)
    assert RECHECK_WINDOW > 600  # the gate's default --timeout
    assert rechecks.after("k", "1", "br@1", True) is not None
    await asyncio.sleep(0.25)
    assert fired == ["br@1"]
    assert rechecks.after("k", "1", "br@1", True) is None  # the window has passed
    assert rechecks.after("k", "1", "br@1", True) is None  # and a list's handling sets none
    assert rechecks.after("k", "2", "br@2", True) is not None  # a new version: a new window
    rechecks.close()


class _Incomplete:
    recheck = True  # as a Verification whose GPU is not known yet


async def test_an_older_versions_recheck_never_follows_the_newer_version_nor_drops_its_outcome():
    """Version 3's event waits for a place while version 2 is still being checked: version 2's
    handling ends incomplete and last of those started, but a newer version has been seen, so
    it sets no recheck; version 3's check is the last, and its outcome (incomplete once) sets
    the recheck (the reviewer's probe p1_stale_recheck_after_newer.py)."""
    source = QueueSource(listed=[versioned(bind_request("k", "train-0"), "2", uid="uid-k")])
    source.events.put_nowait(("ADDED", versioned(bind_request("busy", "train-1"), "1",
                                                 uid="uid-busy")))
    started: list[tuple[str, str]] = []
    sent = asyncio.Event()

    async def handle(view: BindRequestView):
        started.append((view.name, view.resource_version))
        if view.name == "busy":
            await asyncio.sleep(0.6)  # holds the other place (a slow API call)
            return None
        if view.resource_version == "2":
            await asyncio.sleep(0.05)
            if not sent.is_set():
                sent.set()
                source.events.put_nowait(("MODIFIED", versioned(bind_request("k", "train-0"),
                                                                "3", uid="uid-k")))
                await asyncio.sleep(0.05)  # version 3's event now waits for a place
            return _Incomplete()
        await asyncio.sleep(0.3)  # longer than the recheck's backoff
        return _Incomplete() if started.count(("k", "3")) == 1 else None

    task = asyncio.create_task(follow(
        source, handle, concurrency=2, backoff=Backoff(base=0.001, cap=0.001),
        recheck_backoff=Backoff(attempts=1_000_000, base=0.02, cap=0.04)))
    try:
        await asyncio.wait_for(settled(lambda: started.count(("k", "3")) >= 2), 5)
        await asyncio.sleep(0.3)  # whatever else would fall due
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    versions = [rv for name, rv in started if name == "k"]
    assert versions == ["2", "3", "3"], versions


async def test_a_newer_listed_version_or_event_leaves_no_recheck_of_an_older_one():
    """The same rule for a relist (a watch that missed the event: the list carries version 3
    while version 2's check is under way), and for a timer that fell due all the same."""
    from kai_fractions.mirror.bindrequests import _InFlight, _Replay

    handled: list[str] = []

    async def handle(view: BindRequestView):
        handled.append(view.resource_version)

    def view(rv: str) -> BindRequestView:
        return BindRequestView.from_object(versioned(bind_request("k", "train-0"), rv))

    replay = _Replay(_InFlight(handle, 2), FAST)
    try:
        replay.restart([view("3")])
        replay.after(view("2"), _Incomplete(), True)  # version 2's check ends after the list
        assert replay.rechecks._timers == {}
        await settled(lambda: handled == ["3"])
        replay.after(view("3"), _Incomplete(), True)
        assert list(replay.rechecks._timers) == ["br-uid-1"]  # its own outcome counts
        replay.rechecks.cancel("br-uid-1")
        replay.supersede(view("4"))
        replay._fell_due(view("3"))  # a timer no one cancelled
        assert replay.due == {}
        await asyncio.sleep(0.05)
        assert handled == ["3"]
    finally:
        replay.rechecks.close()
        if replay.task is not None:
            replay.task.cancel()
            await asyncio.gather(replay.task, return_exceptions=True)


async def test_a_recheck_reads_the_reservation_pods_from_the_watch_cache_only(store):
    """A consistent list reads the whole reservation namespace from etcd: the first check of a
    version whose GPU is not known yet does it once (a reservation pod a cache a moment behind
    has not seen), its rechecks read the watch cache alone (10,000 BindRequests stuck at "not
    known yet" would otherwise list that namespace consistently some 220 times a second, for
    15 minutes; the reviewer's probe p2_recheck_storm.py)."""
    store.add_pod(pod("train-0", {"gpu-fraction": "0.5", **BOUND, f"{T}.gpus.devices": GPU_B}))
    br = versioned(bind_request("br-1", "train-0", groups=("group-b",)), "2")
    following = Following(QueueSource(listed=[br]), Follower(store, signer=signer()),
                          recheck_backoff=FAST)
    await following.until(lambda: following.count("br-1") >= 5)
    assert store.lists.count(False) == 1 and store.lists[:2] == [True, False]
    store.add_pod(reservation_pod("group-b", GPU_B))  # the cache has it at the next recheck
    await following.until(lambda: SIGNATURE in store.annotations(NS, "train-0"))
    await following.stop()
    assert store.lists.count(False) == 1
    assert store.lists.count(True) == following.count("br-1")
    # A new version's first check reads consistently again.
    follower = Follower(store, signer=signer())
    gone = versioned(bind_request("br-2", "train-0", groups=("group-gone",)), "3", uid="uid-2")
    store.lists.clear()
    assert (await follower.follow_one(BindRequestView.from_object(gone))).recheck
    assert (await follower.follow_one(BindRequestView.from_object(gone))).recheck
    assert store.lists == [True, False, True]
    assert (await follower.follow_one(BindRequestView.from_object(
        versioned(gone, "4", uid="uid-2")))).recheck
    assert store.lists == [True, False, True, True, False]
