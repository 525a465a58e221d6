"""One BindRequest follower among the mirror's replicas: leader election on a
coordination.k8s.io/v1 Lease, the way client-go's leaderelection does it.

Every replica serves MirrorAllocation (stateless, every write guarded); only the Lease's holder
follows BindRequests, so each check, event and signature happens once instead of once per
replica. The holder renews the Lease every `retry_seconds`; a replica that sees the same
record (holder, renewTime, ...) unchanged for `lease_seconds` by its own clock takes the Lease
over (no clock of another machine is trusted), and a holder that could not renew for
`renew_deadline_seconds` stops leading first, so a takeover never overlaps two leaders while
clocks run at the same rate and renew_deadline < lease duration: the deadline counts from the
start of the last attempt that renewed (its write is no older than that), the wait for the
next attempt never runs past it, and an attempt still waiting on a slow API server is cut off
when the deadline comes, as client-go's context timeout does. Every write carries the
resourceVersion read just before, or for a renewal the one the holder's own last write got
back (a merge patch the API server refuses with 409 when another replica wrote first); a
holder that stops releases the Lease (empty holder, duration 1 s) so a successor need not wait
out the lease. A Lease deleted under a term is created again at once by its holder; a standby
that saw another holder's record within that record's duration waits it out first, as for a
record that stood still, so the old holder has stopped before it starts.

A replica that has never read the Lease (a fresh pod in a rollout, a restarted one) has seen no
holder, and creates a missing Lease at once: a cold start does not wait out a lease duration.
That leaves one overlap: the Lease is deleted during a term, and such a replica's first attempt
comes before the holder's next renewal. Both then follow until that renewal, refused (409) by
the new Lease, reads it and steps down (within `retry_seconds`), or, should the holder's
renewals fail meanwhile, until its renew deadline. The writes stay safe meanwhile: the
follower's patches (a pod's signatures, a silent node's condition) are each guarded by their
object's resourceVersion, so of two followers' signing patches for a pod one lands and the
other is refused and re-read; and `in_term()` ends the old holder's writes by the clock at its
renew deadline. The overlap costs work done twice (a warning event posted twice, at most).

Two narrower windows are closed besides. The elector talks to the API server over a client of
its own (its own small connection pool, `LEASE_CONNECTIONS`): a renewal never waits behind the
mirror's other requests for a connection, so a burst of calls against an API server slow for
pods does not cost the Lease. And the renew deadline is checked by the renewal task only when it
wakes, while asyncio runs ready I/O callbacks before expired timers: a follower whose read
answered while its process was paused (SIGSTOP, a VM frozen) would go on to its write before
the task noticed the term was over. `in_term()` says, by the clock, whether the term still runs;
the follower tests it just before each write (the resourceVersion guard stays the protection).

It all runs on the mirror's event loop: the leader's work is a task, cancelled when its term
ends; cancelling the elector ends the term and releases the Lease. Work that ends on its own
(its loop broke) ends the term too, and releases the Lease, so that a new term, here or in
another replica, starts it again: a Lease renewed with no work under it would leave every
replica idle until a restart.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import math
import os
import socket
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

from ..contract.names import is_dns_label, is_dns_subdomain
from ..kube.client import MERGE_PATCH, Kube
from ..kube.errors import Conflict, KubeError, NotFound
from ..kube.objects import lease_body, lease_path, resource_version
from ..kube.objects import micro_time as lease_time

log = logging.getLogger(__name__)

LEASE_SECONDS = 15.0
RENEW_DEADLINE_SECONDS = 10.0
RETRY_SECONDS = 2.0
"""client-go's defaults (a lease of 15 s, renewed every 2 s, given up after 10 s without a
renewal)."""
MAX_LEASE_SECONDS = 2**31 - 1  # leaseDurationSeconds is an int32: the API refuses more
LEASE_CONNECTIONS = 2
"""Connections of the elector's own client: one attempt at a time, and the release at a stop."""


class LeaseConflict(Exception):
    """Another replica wrote the Lease first (409): read it again."""


@dataclass(frozen=True, slots=True)
class ElectionConfig:
    namespace: str
    name: str
    identity: str
    lease_seconds: float = LEASE_SECONDS
    renew_deadline_seconds: float = RENEW_DEADLINE_SECONDS
    retry_seconds: float = RETRY_SECONDS

    def problems(self) -> list[str]:
        """What is wrong with these settings, one line each, naming the flag's field. A leader
        stops `renew_deadline_seconds` after the start of its last renewal that landed, others
        take over `lease_seconds` after they saw it land: renew deadline < lease duration is
        what keeps two leaders apart."""
        out = []
        for field, value in (("namespace", self.namespace), ("name", self.name),
                             ("identity", self.identity)):
            if not value:
                out.append(f"lease {field} is empty")
        # The identity is the Lease's holderIdentity: any string the API takes, so not checked.
        if self.namespace and not is_dns_label(self.namespace):
            out.append(f"lease namespace {self.namespace!r} (--leader-elect-lease-namespace, "
                       "else $POD_NAMESPACE or the service account's): not a namespace name "
                       "(lower-case letters, digits and '-', at most 63)")
        if self.name and not is_dns_subdomain(self.name):
            out.append(f"lease name {self.name!r} (--leader-elect-lease-name): not an object "
                       "name (lower-case letters, digits, '-' and '.', at most 253)")
        durations = (self.lease_seconds, self.renew_deadline_seconds, self.retry_seconds)
        if not all(math.isfinite(d) for d in durations):  # int(inf) raises, nan compares false
            return [*out, f"the durations must be finite numbers of seconds, got lease "
                    f"{self.lease_seconds}, renew deadline {self.renew_deadline_seconds}, "
                    f"retry period {self.retry_seconds}"]
        if self.lease_seconds != int(self.lease_seconds) or \
                not 1 <= self.lease_seconds <= MAX_LEASE_SECONDS:
            out.append(f"lease duration must be a whole number of seconds >= 1 and <= "
                       f"{MAX_LEASE_SECONDS} (the Lease's leaseDurationSeconds, an int32), got "
                       f"{self.lease_seconds}")
        if not self.retry_seconds > 0:
            out.append(f"retry period must be positive, got {self.retry_seconds}")
        if not self.retry_seconds < self.renew_deadline_seconds < self.lease_seconds:
            out.append(f"the durations must satisfy retry period ({self.retry_seconds}) < renew "
                       f"deadline ({self.renew_deadline_seconds}) < lease duration "
                       f"({self.lease_seconds}): a leader gives up before another takes over")
        return out


def micro_time(now: datetime.datetime | None = None) -> str:
    """A MicroTime as the API server writes one: RFC 3339 with microseconds, in UTC."""
    return lease_time((now or datetime.datetime.now(datetime.UTC)).timestamp())


class KubeLease:
    """Read, create and guarded-patch one Lease (dicts in, dicts out). Writes are merge patches
    carrying the resourceVersion read before, not PUTs: the same guard, and the API stand-in the
    tests use serves no PUT."""

    def __init__(self, kube: Kube, namespace: str, name: str,
                 request_timeout: float = 5.0) -> None:
        self.kube = kube
        self.namespace, self.name = namespace, name
        self.timeout = request_timeout
        self.path = lease_path(namespace, name)
        self.ref = f"lease {namespace}/{name}"

    async def get(self) -> Mapping[str, Any] | None:
        try:
            return await self.kube.request("GET", self.path, what=f"read {self.ref}",
                                           timeout=self.timeout)
        except NotFound:
            return None

    async def create(self, spec: Mapping[str, Any]) -> Mapping[str, Any]:
        try:
            return await self.kube.request(
                "POST", lease_path(self.namespace), what=f"create {self.ref}",
                body=lease_body(self.namespace, self.name, spec), timeout=self.timeout)
        except Conflict as e:  # created by another replica meanwhile
            raise LeaseConflict(e.message) from None

    async def update(self, spec: Mapping[str, Any], resource_version: str
                     ) -> Mapping[str, Any]:
        body = {"metadata": {"resourceVersion": resource_version}, "spec": dict(spec)}
        try:
            return await self.kube.request("PATCH", self.path, what=f"write {self.ref}",
                                           body=body, content_type=MERGE_PATCH,
                                           timeout=self.timeout)
        except Conflict as e:
            raise LeaseConflict(e.message) from None


class LeaderElector:
    """Acquire, renew and release one Lease for `config.identity`. `lease` is KubeLease or a
    stand-in with the same three coroutines; `monotonic` judges expiry, `wall` writes times."""

    def __init__(self, lease: KubeLease, config: ElectionConfig, *,
                 monotonic: Callable[[], float] = time.monotonic,
                 wall: Callable[[], datetime.datetime] = lambda: datetime.datetime.now(
                     datetime.UTC)) -> None:
        self.lease, self.config = lease, config
        self._monotonic, self._wall = monotonic, wall
        self._observed: Mapping[str, Any] | None = None  # the last spec read or written
        self._observed_at = 0.0  # when it last changed, by this replica's clock
        self._version = ""  # the resourceVersion this replica's last write got back
        self.leading = False  # while its work runs: from its start until it has ended
        self._attempting = False  # an attempt began and has not answered
        self._term_end = -math.inf  # in_term() until then (monotonic): the renew deadline
        self._failure = ""  # why the last attempt wrote nothing, when it raised

    def in_term(self) -> bool:
        """Whether this replica may still write as the follower now: its term has not ended
        and, by the clock, the renew deadline has not passed since the start of its last
        renewal that landed, whether or not the renewal task has woken up to notice. Work
        that writes only while leading tests it just before each write."""
        return self._monotonic() < self._term_end

    def _held_by_another(self) -> bool:
        """The record last seen names another holder, and this replica saw it change (by its
        own clock) within that record's duration: the holder may still be following."""
        observed = self._observed or {}
        holder = str(observed.get("holderIdentity") or "")
        duration = float(observed.get("leaseDurationSeconds") or self.config.lease_seconds)
        return bool(holder) and holder != self.config.identity and \
            self._monotonic() < self._observed_at + duration

    async def try_acquire_or_renew(self) -> bool:
        """One attempt: True when this replica holds the Lease afterwards."""
        identity, now = self.config.identity, micro_time(self._wall())
        current = await self.lease.get()
        if current is None:
            if self._held_by_another():
                # Deleted, but its holder renewed it lately and follows on until its next
                # renewal finds the Lease gone: wait out its duration, as for a record that
                # stood still (its holder, if alive, creates it again meanwhile).
                return False
            spec = self._spec(acquire_time=now, renew_time=now, transitions=0)
            return await self._written(self.lease.create, spec)
        observed = dict(current.get("spec") or {})
        if observed != self._observed:
            self._observed, self._observed_at = observed, self._monotonic()
        holder = str(observed.get("holderIdentity") or "")
        if self._held_by_another():
            return False  # held by another, and renewed within its duration
        transitions = int(observed.get("leaseTransitions") or 0)
        if holder == identity:
            spec = self._spec(acquire_time=str(observed.get("acquireTime") or now),
                              renew_time=now, transitions=transitions)
        else:
            spec = self._spec(acquire_time=now, renew_time=now, transitions=transitions + 1)
        version = resource_version(current)
        return await self._written(lambda s: self.lease.update(s, version), spec)

    async def renew(self) -> bool:
        """One renewal by the holder: a single PATCH guarded by the resourceVersion its own
        last write got back, so a slow API server costs one request per renewal, not two (as
        client-go renews the Lease it keeps); GET + PATCH (try_acquire_or_renew) when another
        write came between (409), the Lease was deleted (404), or this replica did not write
        the Lease last."""
        observed = self._observed or {}
        if not self._version or observed.get("holderIdentity") != self.config.identity:
            return await self.try_acquire_or_renew()
        now, version = micro_time(self._wall()), self._version
        spec = self._spec(acquire_time=str(observed.get("acquireTime") or now), renew_time=now,
                          transitions=int(observed.get("leaseTransitions") or 0))
        try:
            if await self._written(lambda s: self.lease.update(s, version), spec):
                return True
        except NotFound:
            pass  # the Lease was deleted: the full attempt creates it again
        return await self.try_acquire_or_renew()

    async def release(self) -> None:
        """Hands the Lease back when this replica holds it: an empty holder and a duration of
        1 s, so the next replica takes over at its next attempt."""
        try:
            current = await self.lease.get()
            if current is None:
                return
            spec = dict(current.get("spec") or {})
            if spec.get("holderIdentity") != self.config.identity:
                return
            now = micro_time(self._wall())
            spec.update(holderIdentity="", leaseDurationSeconds=1, renewTime=now,
                        acquireTime=now)
            version = resource_version(current)
            await self.lease.update(spec, version)
            log.info("released lease %s/%s", self.config.namespace, self.config.name)
        except (LeaseConflict, KubeError, OSError, ValueError) as e:
            log.warning("could not release lease %s/%s: %s (it expires on its own)",
                        self.config.namespace, self.config.name, e)

    async def run(self, lead: Callable[[], Awaitable[object]]) -> NoReturn:
        """Until cancelled: wait to acquire the Lease, then run `lead()` as a task while
        renewing it. The task is cancelled (and awaited) when a renewal has failed for
        `renew_deadline_seconds` or another replica is found holding the Lease, and the
        elector waits to acquire it again; or when the elector is cancelled, which then
        releases the Lease. When the task ends on its own, the term ends: the Lease is
        released and, `retry_seconds` later (another replica may take it meanwhile), sought
        again."""
        try:
            await self._elect(lead)
        except asyncio.CancelledError:
            # As client-go's ReleaseOnCancel: whenever this replica was the holder last seen,
            # in or out of a term, or stopped mid-attempt (its write may have landed); a
            # standby that saw another holder sends nothing. release() checks and guards.
            if self.holder() == self.config.identity or self._attempting:
                await self.release()
            raise

    async def _elect(self, lead: Callable[[], Awaitable[object]]) -> NoReturn:
        """run() but for the release when cancelled."""
        cfg = self.config
        while True:
            started = self._monotonic()
            if not await self._attempt():
                await asyncio.sleep(cfg.retry_seconds)
                continue
            log.info("leading: lease %s/%s acquired by %s", cfg.namespace, cfg.name,
                     cfg.identity)
            self.leading = True
            self._term_end = started + cfg.renew_deadline_seconds
            work = asyncio.create_task(_coroutine(lead), name="leader-work")
            renewing = asyncio.create_task(self._renew(started), name="lease-renewal")
            try:
                try:
                    await asyncio.wait((work, renewing), return_when=asyncio.FIRST_COMPLETED)
                finally:
                    self._term_end = -math.inf  # the term is over: no write from here on
                if renewing.done():
                    await _cancelled(work)
                    log.warning("lost lease %s/%s: %s; following stopped", cfg.namespace,
                                cfg.name, renewing.result())
                    continue
                await _cancelled(renewing)
            except asyncio.CancelledError:
                await _cancelled(renewing)
                await _cancelled(work)
                raise
            finally:  # a stop that comes while the work is being cancelled ends the term too
                self.leading = False
            log.error("the leader's work ended%s; stepping down from lease %s/%s",
                      _why_ended(work), cfg.namespace, cfg.name)
            await self.release()
            await asyncio.sleep(cfg.retry_seconds)

    def holder(self) -> str:
        """The holder the Lease named when last read or written ("" when none, or not read)."""
        return str((self._observed or {}).get("holderIdentity") or "")

    async def _renew(self, renewed: float) -> str:
        """Renews every `retry_seconds`, counted from the start of the previous attempt (an
        attempt slower than that is followed at once), while it can; returns why the term
        ended. `renewed`: when the attempt that last wrote the Lease started, by this
        replica's clock. It returns
        as soon as `renew_deadline_seconds` have passed since then: another replica may take
        over `lease_seconds` after it saw that write, so neither the wait for the next attempt
        nor an attempt itself may run past the deadline."""
        cfg = self.config
        gave_up = f"no renewal for {cfg.renew_deadline_seconds:g} s"
        next_at = renewed + cfg.retry_seconds
        while True:
            now = self._monotonic()
            left = renewed + cfg.renew_deadline_seconds - now
            if left <= 0:
                return gave_up + (f" (the last attempt: {self._failure})" if self._failure
                                  else "")
            if now < next_at:
                await asyncio.sleep(min(next_at - now, left))
                continue
            try:  # not wait_for: on 3.11 it loses a cancel that comes as the attempt ends
                async with asyncio.timeout(left):
                    written = await self._attempt(self.renew)
            except TimeoutError:
                return gave_up + _unanswered(self._monotonic() - (now + left),
                                             cfg.renew_deadline_seconds)
            if written:
                renewed = now
                if self._term_end > -math.inf:  # not once the term has ended
                    self._term_end = now + cfg.renew_deadline_seconds
            elif self.holder() not in ("", cfg.identity):
                return f"{self.holder()} holds it"  # it judged the Lease expired: step down
            next_at = now + cfg.retry_seconds

    async def _attempt(self, attempt: Callable[[], Awaitable[bool]] | None = None) -> bool:
        """One attempt, its error logged. `leading` follows the term, not the attempts: a
        failed renewal does not end the term, the deadline does."""
        self._attempting = True  # left so when cancelled: its write may have landed
        self._failure = ""
        try:
            written = await (attempt or self.try_acquire_or_renew)()
        except Exception as e:  # the API away, a refusal, a transport error
            log.warning("lease %s/%s: %r", self.config.namespace, self.config.name, e)
            self._failure, written = repr(e), False
        self._attempting = False
        return written

    def _spec(self, *, acquire_time: str, renew_time: str, transitions: int) -> dict[str, Any]:
        return {"holderIdentity": self.config.identity,
                "leaseDurationSeconds": round(self.config.lease_seconds),
                "acquireTime": acquire_time, "renewTime": renew_time,
                "leaseTransitions": transitions}

    async def _written(self, write: Callable[[dict[str, Any]], Awaitable[Mapping[str, Any]]],
                       spec: dict[str, Any]) -> bool:
        try:
            written = await write(spec)
        except LeaseConflict:
            return False
        self._observed = dict(written.get("spec") or spec)
        self._observed_at = self._monotonic()
        self._version = resource_version(written)
        return True


def _unanswered(late: float, deadline: float) -> str:
    """Why an attempt cut off at the deadline wrote nothing. It waits for no connection of the
    mirror's other requests (the elector's client is its own), so the API server kept it
    waiting, unless this process itself ran behind: paused, or its event loop too busy to run
    the deadline's timer on time (`late` seconds after it was due)."""
    why = " (the last attempt got no answer from the API server in time"
    if late > 0.1 * deadline:
        why += f"; this process ran {late:.1f} s behind: paused, or its event loop kept busy"
    return why + ")"


async def _coroutine(lead: Callable[[], Awaitable[object]]) -> object:
    return await lead()


async def _cancelled(work: asyncio.Task) -> None:
    """Cancels `work` and waits until it has ended (its own clean-up done)."""
    work.cancel()
    await asyncio.gather(work, return_exceptions=True)


def _why_ended(work: asyncio.Task) -> str:
    """Why work meant to run until its term ends ended before."""
    if work.cancelled():
        return " (cancelled)"
    error = work.exception()
    return f": {error!r}" if error is not None else " while leading"


SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def own_namespace(env: Mapping[str, str], namespace_file: str = SERVICE_ACCOUNT_NAMESPACE
                  ) -> str:
    """The namespace this process runs in: $POD_NAMESPACE when set, else its service
    account's (what the chart's pods use); "" outside a cluster."""
    namespace = env.get("POD_NAMESPACE", "")
    if not namespace:
        try:
            with open(namespace_file) as f:
                namespace = f.read().strip()
        except OSError:
            pass
    return namespace


def election_config(args: Any, env: Mapping[str, str],
                    namespace_file: str = SERVICE_ACCOUNT_NAMESPACE) -> ElectionConfig:
    """The `kai-fractions mirror --leader-elect-*` flags, with the defaults they name: the
    namespace from $POD_NAMESPACE or the service account's, the identity from $POD_NAME or
    the host name and process id (in the chart's pods the host name is the pod's name)."""
    namespace = (args.leader_elect_lease_namespace or own_namespace(env, namespace_file)
                 or "default")
    identity = args.leader_elect_identity or env.get("POD_NAME", "") or \
        f"{socket.gethostname()}_{os.getpid()}"
    return ElectionConfig(namespace=namespace, name=args.leader_elect_lease_name,
                          identity=identity, lease_seconds=args.leader_elect_lease_duration,
                          renew_deadline_seconds=args.leader_elect_renew_deadline,
                          retry_seconds=args.leader_elect_retry_period)
