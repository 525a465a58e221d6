"""Leader election on a Lease for the BindRequest follower: acquire, renew, take over an expired
Lease (judged by the replica's own clock), lose to a faster writer (resourceVersion), release,
stop leading when renewals fail, on the event loop, and write nothing once the term has run out
by the clock; then the same through `kube` on kmock."""

from __future__ import annotations

import asyncio
import datetime
import logging
from collections.abc import Awaitable, Callable
from types import SimpleNamespace

import pytest
from kubernetes import client as k8s

from kai_fractions.kube.client import Kube
from kai_fractions.kube.errors import NotFound
from kai_fractions.mirror.bindrequest_view import BindRequestView
from kai_fractions.mirror.follower import Follower
from kai_fractions.mirror.leader import (
    ElectionConfig,
    KubeLease,
    LeaderElector,
    LeaseConflict,
    election_config,
    micro_time,
)
from kai_fractions.signing import Keyring
from tests.support.fake_store import FakePodStore

from .test_follower import BOUND, GPU_A, bind_request, pod, reservation_pod, versioned

NS, NAME = "kai-fractions", "kai-fractions-mirror-follower"
T0 = datetime.datetime(2026, 12, 1, 12, 0, 0, tzinfo=datetime.UTC)


class FakeLease:
    """One Lease in memory, with a resourceVersion and 409 on a stale one, as the API server
    does; `broken` makes every call fail as an unreachable API would, `latency` makes each
    take that long; `requests` names them."""

    def __init__(self) -> None:
        self.obj: dict | None = None
        self.version = 0
        self.writes = 0
        self.broken = False
        self.latency = 0.0
        self.requests: list[str] = []

    async def _check(self, request: str) -> None:
        self.requests.append(request)
        if self.latency:
            await asyncio.sleep(self.latency)
        if self.broken:
            raise OSError("connection refused")

    async def get(self):
        await self._check("GET")
        return None if self.obj is None else {"metadata": {"resourceVersion": str(
            self.version)}, "spec": dict(self.obj)}

    async def create(self, spec):
        await self._check("POST")
        if self.obj is not None:
            raise LeaseConflict("already exists")
        return self._store(spec)

    async def update(self, spec, resource_version):
        await self._check("PATCH")
        if self.obj is None:
            raise NotFound("leases \"l\" not found")
        if resource_version != str(self.version):
            raise LeaseConflict("modified")
        return self._store(spec)

    def _store(self, spec):
        self.version += 1
        self.writes += 1
        self.obj = dict(spec)
        return {"metadata": {"resourceVersion": str(self.version)}, "spec": dict(spec)}


class Clocks:
    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now

    def wall(self) -> datetime.datetime:
        return T0 + datetime.timedelta(seconds=self.now)


def elector(lease, identity: str, clocks: Clocks, **durations) -> LeaderElector:
    return LeaderElector(lease, ElectionConfig(NS, NAME, identity, **durations),
                         monotonic=clocks.monotonic, wall=clocks.wall)


async def test_the_first_replica_creates_the_lease_and_renews_it():
    lease, clocks = FakeLease(), Clocks()
    a = elector(lease, "mirror-a", clocks)
    assert await a.try_acquire_or_renew()
    assert lease.obj == {"holderIdentity": "mirror-a", "leaseDurationSeconds": 15,
                         "acquireTime": "2026-12-01T12:01:40.000000Z",
                         "renewTime": "2026-12-01T12:01:40.000000Z", "leaseTransitions": 0}
    clocks.now += 2
    assert await a.try_acquire_or_renew()
    assert lease.obj["renewTime"] == "2026-12-01T12:01:42.000000Z"
    assert (lease.obj["acquireTime"], lease.obj["leaseTransitions"]) == (
        "2026-12-01T12:01:40.000000Z", 0)


async def test_the_holder_renews_with_one_patch_guarded_by_its_own_last_write():
    lease, clocks = FakeLease(), Clocks()
    a = elector(lease, "mirror-a", clocks)
    assert await a.try_acquire_or_renew()
    lease.requests.clear()
    clocks.now += 2
    assert await a.renew()
    assert lease.requests == ["PATCH"]  # no GET: a slow API server costs one request
    assert (lease.obj["renewTime"], lease.obj["acquireTime"]) == (
        "2026-12-01T12:01:42.000000Z", "2026-12-01T12:01:40.000000Z")
    lease.version += 1  # someone else wrote the Lease (a label, say), holder unchanged
    lease.requests.clear()
    clocks.now += 2
    assert await a.renew()
    assert lease.requests == ["PATCH", "GET", "PATCH"]  # 409, then read it and renew
    assert (lease.obj["holderIdentity"], lease.obj["leaseTransitions"]) == ("mirror-a", 0)
    lease.obj = {**lease.obj, "holderIdentity": "mirror-b"}  # taken over meanwhile
    lease.version += 1
    clocks.now += 2
    assert not await a.renew()
    assert lease.obj["holderIdentity"] == "mirror-b" and a.holder() == "mirror-b"


async def test_a_lease_deleted_during_a_term_is_created_again_by_the_next_renewal():
    """The one-PATCH renewal meets 404 when someone deleted the Lease: the full attempt
    creates it again, and the term goes on (it used to end at the renew deadline)."""
    lease, clocks = FakeLease(), Clocks()
    a = elector(lease, "mirror-a", clocks)
    assert await a.try_acquire_or_renew()
    lease.obj = None
    lease.requests.clear()
    clocks.now += 2
    assert await a.renew()
    assert lease.requests == ["PATCH", "GET", "POST"]
    assert lease.obj["holderIdentity"] == "mirror-a"


async def test_another_replica_takes_over_only_after_the_lease_went_unrenewed_for_its_duration():
    lease, clocks = FakeLease(), Clocks()
    a, b = elector(lease, "mirror-a", clocks), elector(lease, "mirror-b", clocks)
    assert await a.try_acquire_or_renew()
    for _ in range(10):  # a renews every 2 s: b never sees the same record for 15 s
        clocks.now += 2
        assert await a.try_acquire_or_renew()
        assert not await b.try_acquire_or_renew()
    clocks.now += 14.9  # a went silent; b's clock, not a's renewTime, decides
    assert not await b.try_acquire_or_renew()
    clocks.now += 0.2
    assert await b.try_acquire_or_renew()
    assert (lease.obj["holderIdentity"], lease.obj["leaseTransitions"]) == ("mirror-b", 1)
    assert lease.obj["acquireTime"] == micro_time(clocks.wall())
    clocks.now += 2
    assert not await a.try_acquire_or_renew()  # a, back, finds b renewing


async def test_a_deleted_lease_is_created_again_at_once_by_its_holder_only():
    # A standby that had seen another replica renew moments before created a deleted Lease at
    # once: the old holder followed on until its next renewal met the 409, beside it. It waits
    # out the duration of the record it saw, by its own clock, as for one that stood still.
    lease, clocks = FakeLease(), Clocks()
    a, b = elector(lease, "mirror-a", clocks), elector(lease, "mirror-b", clocks)
    assert await a.try_acquire_or_renew()
    assert not await b.try_acquire_or_renew()  # b saw a's record at 100
    lease.obj = None  # deleted
    lease.requests.clear()
    clocks.now += 1
    assert not await b.try_acquire_or_renew()
    assert lease.requests == ["GET"] and lease.obj is None  # nothing created
    assert await a.renew()  # the holder creates it again at once
    assert lease.obj["holderIdentity"] == "mirror-a"
    assert not await b.try_acquire_or_renew()  # b sees the new record at 101
    lease.obj = None  # deleted again, and a is gone
    clocks.now += 14.9
    assert not await b.try_acquire_or_renew() and lease.obj is None
    clocks.now += 0.2  # a full lease (15 s) since b saw a's record change
    assert await b.try_acquire_or_renew()
    assert (lease.obj["holderIdentity"], lease.obj["leaseTransitions"]) == ("mirror-b", 0)
    lease.obj = None
    assert await b.try_acquire_or_renew()  # its own record: created again at once
    # (one that never saw a holder creates it at once: the first test)


async def test_of_two_replicas_taking_over_at_once_the_first_write_wins():
    lease, clocks = FakeLease(), Clocks()
    assert await elector(lease, "mirror-a", clocks).try_acquire_or_renew()
    b, c = elector(lease, "mirror-b", clocks), elector(lease, "mirror-c", clocks)
    assert not await b.try_acquire_or_renew() and not await c.try_acquire_or_renew()
    clocks.now += 16
    stale = await lease.get()  # c read the record before b wrote
    assert await b.try_acquire_or_renew()

    async def read_stale():
        return stale

    c.lease = SimpleNamespace(get=read_stale, update=lease.update, create=lease.create)
    assert not await c.try_acquire_or_renew()  # 409: the resourceVersion it read is gone
    assert lease.obj["holderIdentity"] == "mirror-b"


async def test_a_released_lease_is_taken_at_the_next_attempt():
    lease, clocks = FakeLease(), Clocks()
    a, b = elector(lease, "mirror-a", clocks), elector(lease, "mirror-b", clocks)
    assert await a.try_acquire_or_renew()
    assert not await b.try_acquire_or_renew()
    await a.release()
    assert (lease.obj["holderIdentity"], lease.obj["leaseDurationSeconds"]) == ("", 1)
    assert await b.try_acquire_or_renew()
    await b.release()
    b.lease.broken = True
    await a.release()  # not the holder, and the API away: logged, nothing raised


@pytest.mark.parametrize(("durations", "problem"), [
    ({"lease_seconds": 10, "renew_deadline_seconds": 10}, "retry period (2.0) < renew deadline "
     "(10) < lease duration (10)"),
    ({"retry_seconds": 0}, "retry period must be positive, got 0"),
    ({"lease_seconds": 2.5, "renew_deadline_seconds": 2}, "lease duration must be a whole "
     "number of seconds >= 1"),
    ({"lease_seconds": 2.0**31}, "lease duration must be a whole number of seconds >= 1 and "
     "<= 2147483647"),
    ({"lease_seconds": float("inf")}, "the durations must be finite numbers of seconds, got "
     "lease inf, renew deadline 10.0, retry period 2.0"),
    ({"renew_deadline_seconds": float("nan")}, "the durations must be finite"),
])
def test_durations_that_would_let_two_leaders_overlap_are_refused(durations, problem):
    problems = ElectionConfig(NS, NAME, "a", **durations).problems()
    assert any(problem in p for p in problems), problems
    assert ElectionConfig("", NAME, "a").problems() == ["lease namespace is empty"]


def test_flags_default_from_the_downward_api_then_the_host(tmp_path):
    args = SimpleNamespace(leader_elect_lease_namespace="", leader_elect_identity="",
                           leader_elect_lease_name=NAME, leader_elect_lease_duration=15.0,
                           leader_elect_renew_deadline=10.0, leader_elect_retry_period=2.0)
    config = election_config(args, {"POD_NAME": "m-0", "POD_NAMESPACE": "kf"})
    assert (config.namespace, config.identity) == ("kf", "m-0")
    (tmp_path / "ns").write_text("from-sa\n")
    config = election_config(args, {}, namespace_file=str(tmp_path / "ns"))
    assert config.namespace == "from-sa" and "_" in config.identity
    assert election_config(args, {}, namespace_file=str(tmp_path / "none")).namespace == \
        "default"


def recorded_term(disrupt: Callable[[], None]
                  ) -> tuple[list[str], asyncio.Event, Callable[[], Awaitable[None]]]:
    """A term of leadership that records "started", then `disrupt()`s the lease and leads
    until it is cancelled, recording "lost" and setting the event as it ends."""
    terms: list[str] = []
    lost = asyncio.Event()

    async def lead() -> None:
        terms.append("started")
        disrupt()
        try:
            await asyncio.Event().wait()
        finally:
            terms.append("lost")
            lost.set()

    return terms, lost, lead


async def until(condition: Callable[[], bool], timeout: float = 5) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.01)


async def stop(runner: asyncio.Task) -> None:
    runner.cancel()
    with pytest.raises(asyncio.CancelledError):
        await runner


async def test_a_leader_that_cannot_renew_stops_leading_within_its_deadline():
    lease = FakeLease()
    a = LeaderElector(lease, ElectionConfig(NS, NAME, "mirror-a", lease_seconds=2,
                                            renew_deadline_seconds=0.3, retry_seconds=0.05))
    terms, lost, lead = recorded_term(lambda: setattr(lease, "broken", True))  # API gone

    runner = asyncio.create_task(a.run(lead))
    await asyncio.wait_for(lost.wait(), 5)
    await until(lambda: not a.leading)  # once the work has ended
    assert terms == ["started", "lost"]
    await asyncio.sleep(0.2)  # it tries to acquire the Lease again, and fails
    assert terms == ["started", "lost"] and not a.leading
    await stop(runner)


class Partitioned:
    """One replica's view of a shared FakeLease: every call fails at once while `cut`, as a
    replica cut off from the API server sees it, while the others still reach it."""

    def __init__(self, lease: FakeLease) -> None:
        self.lease, self.cut = lease, False

    def _check(self) -> None:
        if self.cut:
            raise OSError("connection refused")

    async def get(self):
        self._check()
        return await self.lease.get()

    async def create(self, spec):
        self._check()
        return await self.lease.create(spec)

    async def update(self, spec, resource_version):
        self._check()
        return await self.lease.update(spec, resource_version)


async def test_a_leader_cut_off_stops_at_its_deadline_before_another_takes_over():
    # The deadline (2.5 s) passes while the leader waits for its next attempt (retry 2 s):
    # waiting the full period would keep it following until 4 s, beside the replica that took
    # the Lease over at 3 s (the lease's duration after it saw the last renewal).
    durations = {"lease_seconds": 3, "renew_deadline_seconds": 2.5, "retry_seconds": 2}
    lease = FakeLease()
    view = Partitioned(lease)
    a = LeaderElector(view, ElectionConfig(NS, NAME, "mirror-a", **durations))
    b = LeaderElector(lease, ElectionConfig(NS, NAME, "mirror-b", **durations))
    terms, lost, lead = recorded_term(lambda: setattr(view, "cut", True))
    runner = asyncio.create_task(a.run(lead))
    async with asyncio.timeout(10):
        while not terms:
            await asyncio.sleep(0.01)
        while not await b.try_acquire_or_renew():
            await asyncio.sleep(0.02)
    assert lost.is_set(), "b acquired the Lease while a still followed"
    await stop(runner)


async def test_a_renewal_the_api_leaves_hanging_is_cut_off_at_the_deadline():
    # A standby that saw the last renewal takes over lease_seconds after it; the holder must
    # have stopped by then, so an attempt waiting on a slow API server cannot outlast the renew
    # deadline (counted from the start of the attempt that last wrote the Lease).
    lease = FakeLease()
    a = LeaderElector(lease, ElectionConfig(NS, NAME, "mirror-a", lease_seconds=2,
                                            renew_deadline_seconds=0.4, retry_seconds=0.05))
    hanging = asyncio.Event()

    async def slow(*_):
        hanging.set()
        await asyncio.sleep(30)  # far past the deadline (each real request may wait 5 s)

    def slow_api() -> None:
        lease.get = lease.update = slow

    terms, lost, lead = recorded_term(slow_api)
    runner = asyncio.create_task(a.run(lead))
    await asyncio.wait_for(hanging.wait(), 5)
    await asyncio.wait_for(lost.wait(), 5)  # without the cut-off: when the GET answers, at 30 s
    await until(lambda: not a.leading)
    assert terms == ["started", "lost"]
    del lease.get, lease.update  # answering again: the release at the stop waits for none
    await stop(runner)


async def test_a_slow_api_server_that_answers_keeps_the_leader_leading():
    # Each request takes 0.3 s: renewing every retry period from the start of the previous
    # attempt with one PATCH lands every renewal well inside the 1.5 s deadline. Counted from
    # the end of the previous attempt, with GET + PATCH each time, the first renewal was cut
    # off at the deadline and the follower restarted, with a full list, every term.
    lease = FakeLease()
    lease.latency = 0.3
    a = LeaderElector(lease, ElectionConfig(NS, NAME, "mirror-a", lease_seconds=2,
                                            renew_deadline_seconds=1.5, retry_seconds=0.4))
    terms, _, lead = recorded_term(lambda: None)
    runner = asyncio.create_task(a.run(lead))
    await asyncio.sleep(3)
    assert terms == ["started"] and a.leading
    assert lease.requests.count("GET") == 1 and lease.requests.count("PATCH") >= 4
    await stop(runner)


async def test_leading_reads_true_for_the_whole_term_failed_renewals_included():
    # kai_fractions_follower_leading: 1 while this replica follows. A renewal that failed
    # within the deadline ends nothing; and while the work winds down it still follows (the
    # KaiFractionsFollowerSeveralLeaders alert must see an overlap, were there one).
    lease = FakeLease()
    a = LeaderElector(lease, ElectionConfig(NS, NAME, "mirror-a", lease_seconds=15,
                                            renew_deadline_seconds=10, retry_seconds=0.05))
    seen: list[bool] = []
    started, ending = asyncio.Event(), []

    async def lead() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        finally:
            ending.append(a.leading)

    runner = asyncio.create_task(a.run(lead))
    await asyncio.wait_for(started.wait(), 5)
    lease.broken = True  # the API away for several retry periods, not the deadline
    for _ in range(30):
        seen.append(a.leading)
        await asyncio.sleep(0.01)
    lease.broken = False
    assert lease.requests.count("PATCH") > 3 and all(seen) and not ending
    await stop(runner)
    assert ending == [True] and not a.leading


async def test_leading_reads_false_after_a_stop_that_comes_while_the_work_winds_down():
    lease = FakeLease()
    a = LeaderElector(lease, ElectionConfig(NS, NAME, "mirror-a", lease_seconds=0.6,
                                            renew_deadline_seconds=0.3, retry_seconds=0.05))
    started, winding = asyncio.Event(), asyncio.Event()

    async def lead() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        finally:
            winding.set()
            await asyncio.sleep(0.5)  # a slow clean-up

    runner = asyncio.create_task(a.run(lead))
    await asyncio.wait_for(started.wait(), 5)
    lease.broken = True  # the term ends at the renew deadline
    await asyncio.wait_for(winding.wait(), 5)
    await stop(runner)  # while the work's clean-up runs
    assert not a.leading


async def test_stopping_a_leader_as_a_renewal_answers_still_stops_it():
    # On Python 3.11 asyncio.wait_for drops a cancel that arrives as the awaited attempt
    # finishes: the renewal loop went on, and the mirror never finished stopping on SIGTERM.
    lease = FakeLease()
    a = LeaderElector(lease, ElectionConfig(NS, NAME, "mirror-a", lease_seconds=15,
                                            renew_deadline_seconds=10, retry_seconds=0.05))
    in_flight, answer = asyncio.Event(), asyncio.Event()
    update = lease.update

    async def gated_update(spec, resource_version):
        in_flight.set()
        await answer.wait()
        return await update(spec, resource_version)

    terms, _, lead = recorded_term(lambda: setattr(lease, "update", gated_update))
    runner = asyncio.create_task(a.run(lead))
    await asyncio.wait_for(in_flight.wait(), 5)
    answer.set()  # the renewal's answer and the stop come together
    runner.cancel()
    await asyncio.wait({runner}, timeout=5)
    assert runner.cancelled(), "the leader did not stop"
    assert terms == ["started", "lost"] and lease.obj["holderIdentity"] == ""


async def test_a_leader_that_finds_another_holder_steps_down_at_once():
    lease = FakeLease()
    a = LeaderElector(lease, ElectionConfig(NS, NAME, "mirror-a", lease_seconds=60,
                                            renew_deadline_seconds=30, retry_seconds=0.05))
    def taken_over() -> None:  # another replica saw a renewal gap of a full lease
        lease.obj = {**lease.obj, "holderIdentity": "mirror-b"}
        lease.version += 1

    terms, lost, lead = recorded_term(taken_over)

    runner = asyncio.create_task(a.run(lead))
    await asyncio.wait_for(lost.wait(), 5)  # long before the 30 s renew deadline
    await stop(runner)
    assert terms == ["started", "lost"] and a.holder() == "mirror-b"
    assert lease.obj["holderIdentity"] == "mirror-b"  # stopping released nothing of b's


async def test_stopping_a_leader_ends_its_work_and_releases_the_lease():
    lease = FakeLease()
    a = LeaderElector(lease, ElectionConfig(NS, NAME, "mirror-a", lease_seconds=2,
                                            renew_deadline_seconds=1, retry_seconds=0.05))
    led = asyncio.Event()
    ended: list[str] = []

    async def lead() -> None:
        led.set()
        try:
            await asyncio.Event().wait()
        finally:
            ended.append(lease.obj["holderIdentity"])  # before the release

    runner = asyncio.create_task(a.run(lead))
    await asyncio.wait_for(led.wait(), 5)
    await stop(runner)
    assert ended == ["mirror-a"]
    assert lease.obj["holderIdentity"] == "" and not a.leading


async def test_stopped_as_its_acquiring_write_lands_a_replica_still_releases():
    # The create reached the API server, its answer had not come back when SIGTERM came: the
    # Lease named a stopped replica, and no replica followed until it expired.
    lease = FakeLease()
    a = LeaderElector(lease, ElectionConfig(NS, NAME, "mirror-a", lease_seconds=15,
                                            renew_deadline_seconds=10, retry_seconds=2))
    landed = asyncio.Event()
    create = lease.create

    async def unanswered_create(spec):
        await create(spec)
        landed.set()
        await asyncio.Event().wait()

    lease.create = unanswered_create
    runner = asyncio.create_task(a.run(recorded_term(lambda: None)[2]))
    await asyncio.wait_for(landed.wait(), 5)
    await stop(runner)
    assert lease.obj["holderIdentity"] == "" and not a.leading


async def test_a_stopped_standby_sends_nothing():
    lease, clocks = FakeLease(), Clocks()
    assert await elector(lease, "mirror-b", clocks).try_acquire_or_renew()
    a = LeaderElector(lease, ElectionConfig(NS, NAME, "mirror-a", lease_seconds=15,
                                            renew_deadline_seconds=10, retry_seconds=2))
    runner = asyncio.create_task(a.run(recorded_term(lambda: None)[2]))
    await until(lambda: a.holder() == "mirror-b")
    lease.requests.clear()
    await stop(runner)
    assert lease.requests == [] and lease.obj["holderIdentity"] == "mirror-b"


async def test_work_that_ends_on_its_own_ends_the_term_and_starts_again_in_a_new_one(caplog):
    # The follower's loop broke while its replica kept renewing the Lease: no replica signed a
    # pod until a restart. The term ends instead, and the next one starts the work again.
    lease = FakeLease()
    a = LeaderElector(lease, ElectionConfig(NS, NAME, "mirror-a", lease_seconds=2,
                                            renew_deadline_seconds=1, retry_seconds=0.05))
    holders: list[str] = []
    second = asyncio.Event()

    async def lead() -> None:
        holders.append(lease.obj["holderIdentity"])
        if len(holders) == 1:
            raise RuntimeError("boom")
        second.set()
        await asyncio.Event().wait()

    runner = asyncio.create_task(a.run(lead))
    await asyncio.wait_for(second.wait(), 5)
    assert holders == ["mirror-a", "mirror-a"] and a.leading
    assert lease.obj["leaseTransitions"] == 1  # released, then acquired anew
    await stop(runner)
    assert "the leader's work ended: RuntimeError('boom'); stepping down" in caplog.text


async def test_work_that_ends_on_its_own_releases_the_lease_to_another_replica():
    lease, clocks = FakeLease(), Clocks()
    a = LeaderElector(lease, ElectionConfig(NS, NAME, "mirror-a", lease_seconds=4,
                                            renew_deadline_seconds=3, retry_seconds=2))
    b = elector(lease, "mirror-b", clocks)
    ended = asyncio.Event()

    async def lead() -> None:  # returns: its loop ended without an error
        ended.set()

    runner = asyncio.create_task(a.run(lead))
    await asyncio.wait_for(ended.wait(), 5)
    async with asyncio.timeout(5):
        while lease.obj["holderIdentity"] != "":
            await asyncio.sleep(0.01)
    assert not a.leading
    assert await b.try_acquire_or_renew()  # within a's retry period: no lease to wait out
    assert not await a.try_acquire_or_renew()  # as a's next attempt finds it
    await stop(runner)
    assert lease.obj["holderIdentity"] == "mirror-b"


@pytest.mark.integration
async def test_two_electors_through_kube_on_kmock(kube):
    clocks = Clocks()
    client = Kube(k8s.ApiClient(kube.configuration()))
    try:
        a = elector(KubeLease(client, NS, NAME), "mirror-a", clocks)
        b = elector(KubeLease(client, NS, NAME), "mirror-b", clocks)
        assert await a.try_acquire_or_renew()
        assert not await b.try_acquire_or_renew()
        clocks.now += 16
        assert await b.try_acquire_or_renew()
        stored = kube.api_client.sanitize_for_serialization(
            k8s.CoordinationV1Api(kube.api_client).read_namespaced_lease(NAME, NS))
        assert stored["spec"]["holderIdentity"] == "mirror-b"
        assert stored["spec"]["leaseTransitions"] == 1
        clocks.now += 1
        assert not await a.try_acquire_or_renew()
        with pytest.raises(LeaseConflict):
            await KubeLease(client, NS, NAME).update({"holderIdentity": "x"}, "1")
        await b.release()
        assert k8s.CoordinationV1Api(kube.api_client).read_namespaced_lease(
            NAME, NS).spec.holder_identity in ("", None)
    finally:
        await client.close()


@pytest.mark.parametrize(("argv", "message"), [
    (["--leader-elect"], "--leader-elect elects the BindRequest follower: it needs "
     "--follow-bindrequests"),
    (["--follow-bindrequests", "--leader-elect", "--leader-elect-renew-deadline", "20"],
     "--leader-elect: the durations must satisfy retry period (2.0) < renew deadline (20.0) < "
     "lease duration (15.0): a leader gives up before another takes over"),
])
def test_the_cli_refuses_an_election_it_cannot_hold(capsys, argv, message):
    from kai_fractions.cli import main

    assert main(["mirror", *argv]) == 2
    assert capsys.readouterr().err == f"kai-fractions mirror: {message}\n"


async def test_the_term_ends_by_the_clock_before_the_renewal_task_wakes():
    # asyncio runs ready I/O callbacks before expired timers: a process paused past its renew
    # deadline (SIGSTOP, a frozen VM) runs the work whose read answered meanwhile before the
    # renewal task that ends the term. in_term() reads the clock, not the task.
    lease, clocks = FakeLease(), Clocks()
    a = elector(lease, "mirror-a", clocks, lease_seconds=15, renew_deadline_seconds=10,
                retry_seconds=0.05)
    assert not a.in_term()
    terms, _, lead = recorded_term(lambda: None)
    runner = asyncio.create_task(a.run(lead))
    await until(lambda: terms == ["started"])
    assert a.in_term()
    clocks.now += 5  # the renewal task renews at its next wake-up: the term runs to 115
    await until(lambda: lease.requests.count("PATCH") == 1)
    clocks.now += 9.9
    assert a.in_term()
    clocks.now += 0.2  # 10.1 s after the start of the last renewal that landed
    assert not a.in_term() and a.leading  # the renewal task has not woken yet
    await until(lambda: "lost" in terms)  # it wakes, and ends the term
    await stop(runner)


KEY = b"k" * 32


@pytest.mark.parametrize(("annotations", "write"), [
    ({"gpu-fraction": "0.5", **BOUND}, "the signing patch of pod team-a/train-0"),
    ({"gpu-fraction": "0.5"}, "the NvFractionsMismatch event on pod team-a/train-0"),
])
async def test_a_check_whose_term_ran_out_during_its_read_writes_nothing(caplog, annotations,
                                                                         write):
    caplog.set_level(logging.INFO, "kai_fractions.mirror.follower")
    # The leader's process was paused while a check's read was in flight; when it resumes, the
    # read's answer runs the check on before the renewal task notices the deadline has passed.
    lease, clocks = FakeLease(), Clocks()
    a = elector(lease, "mirror-a", clocks, lease_seconds=15, renew_deadline_seconds=10,
                retry_seconds=2)
    store = FakePodStore()
    store.nodes["gpu-node-1"] = {"nvidia.com/gpu.memory": "40960"}
    store.add_pod(reservation_pod("group-a", GPU_A))
    store.add_pod(pod("train-0", annotations))
    follower = Follower(store, signer=SimpleNamespace(current=lambda: Keyring.of(KEY)),
                        in_term=a.in_term)
    view = BindRequestView.from_object(versioned(bind_request("br-1", "train-0")))

    def paused(operation: str, *_) -> None:  # the last read, answered after the deadline
        if operation == "node":
            clocks.now += 10.5

    store.faults.append(paused)
    checked = []
    done = asyncio.Event()

    async def lead() -> None:
        checked.append(await follower.follow_one(view))
        done.set()
        await asyncio.Event().wait()

    runner = asyncio.create_task(a.run(lead))
    await asyncio.wait_for(done.wait(), 5)
    assert store.patches == [] and store.events == []
    [result] = checked
    assert not result.complete and result.skipped.startswith(
        f"the term as the follower ended before {write}")
    assert f"{write} not sent" in caplog.text
    await stop(runner)
    # Nothing was counted as done: in a term, the same version is checked and written again.
    store.faults.clear()
    follower.in_term = lambda: True
    again = await follower.follow_one(view)
    assert again is not None
    assert store.patches or store.events
