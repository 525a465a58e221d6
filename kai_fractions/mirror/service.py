"""The mirror's three operations over a PodStore, independent of gRPC. They run on the
gRPC server's event loop (coroutines), one task per call.

Every write is ONE merge patch guarded by the pod's uid and resourceVersion. A write conflict
(someone changed the pod since it was read) re-reads the pod and recomputes, a bounded number of
times: the decision is re-applied to the pod as it now is, never blindly replayed. A conflict
met by the store's retry of a write whose answer was lost may be that very write: when the
write was computed from a pod read from the API and the re-read pod carries all it held, the
call answers as the write would have (`changed`). A write computed from the cache proves
nothing: the cached pod may have lagged the same call's write by another replica.

With a PodCache the first try computes from the cached pod and guards the write with its
resourceVersion, saving the read; a stale entry costs one refused write and a re-read, and an
answer that writes nothing, or refuses the call, is always confirmed by a read from the API
(pod_cache explains why).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass

from ..clock import AsyncClock, SystemClock
from ..contract import (
    DEFAULT_DIALECT,
    DEFAULT_MPS_PIPE_ROOT,
    ContainerPlan,
    Dialect,
    Keys,
)
from ..contract import keys as k
from ..kube.retry import Backoff
from .compute import (
    ExtraAnnotations,
    Outcome,
    Patch,
    compute_outcome,
    mirror_patch,
    release_patch,
)
from .decision import (
    AllocationInput,
    check_idempotency_key,
    node_to_read,
    resolve_decision,
)
from .errors import (
    AllocationConflict,
    ApiRejected,
    ApiUnavailable,
    DeadlineExceeded,
    InvalidAllocation,
    PodReplaced,
)
from .foreground import Foreground
from .node_labels import NodeLabelCache
from .pod_cache import PodCache
from .record import MIRRORED_ANNOTATION
from .release_keys import (
    check_key_after_release,
    released_here,
    released_record,
    retry_of_release,
)
from .store import (
    NO_DEADLINE,
    Deadline,
    PodSnapshot,
    PodStore,
    WriteConflict,
    WriteInvalid,
    stored_otherwise,
)

log = logging.getLogger(__name__)

CONFLICT_BACKOFF = Backoff(attempts=5, base=0.05, cap=1.0)
"""Re-reads after a write conflict (another writer changed the pod in between)."""


@dataclass(frozen=True, slots=True)
class MirrorResult:
    annotations: Mapping[str, str]
    """What the mirror owns on the pod now (binder and derived keys), sorted."""
    changed: bool
    resource_version: str
    plans: tuple[ContainerPlan, ...]


@dataclass(frozen=True, slots=True)
class PreviewResult:
    annotations: Mapping[str, str]
    plans: tuple[ContainerPlan, ...]


@dataclass(frozen=True, slots=True)
class ReleaseResult:
    removed_keys: tuple[str, ...]
    changed: bool


@dataclass(frozen=True, slots=True)
class _Refused:
    """A write its precondition refused: the caller re-reads and recomputes."""

    lost: Mapping[str, str | None] | None = None
    """The changes the write held when a try of it may have landed, its answer lost
    (WriteConflict.may_have_landed), and the write was computed from a pod read from the API;
    else None: a re-read pod that carries them all carries this call's write."""

    def landed(self, pod: PodSnapshot) -> bool:
        return self.lost is not None and stored_otherwise(pod, self.lost) is None


_NOT_LOST = _Refused()
"""Before a call's first write: nothing of it can be on the pod."""


class _PodLocks:
    """Serialises calls for one pod inside this process, so concurrent duplicates in one replica
    cost one write even where the server supplies no resourceVersion. One event loop's: the
    table itself needs no lock, nothing awaits between its reads and writes."""

    def __init__(self) -> None:
        self._locks: dict[tuple[str, str], tuple[asyncio.Lock, int]] = {}

    @asynccontextmanager
    async def hold(self, namespace: str, name: str) -> AsyncIterator[None]:
        key = (namespace, name)
        lock, users = self._locks.get(key) or (asyncio.Lock(), 0)
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[key]
            if users == 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)


class MirrorService:
    def __init__(
        self,
        store: PodStore,
        *,
        keys: Keys = k.DEFAULT_KEYS,
        default_reserve_mib: int = 0,
        dialect: Dialect = DEFAULT_DIALECT,
        mps_pipe_root: str = DEFAULT_MPS_PIPE_ROOT,
        conflict_backoff: Backoff = CONFLICT_BACKOFF,
        clock: AsyncClock | None = None,
        rng: random.Random | None = None,
        extra_annotations: ExtraAnnotations | None = None,
        cache: PodCache | None = None,
    ) -> None:
        self.store = store
        self.cache = cache
        """Pods as last seen (pod_cache); None reads every pod from the API."""
        self.keys = keys
        self.default_reserve_mib = default_reserve_mib
        self.dialect = dialect
        """Which KAI binder the written annotations match (the compute portion key or not)."""
        self.mps_pipe_root = mps_pipe_root
        self.conflict_backoff = conflict_backoff
        self.clock = clock or SystemClock()
        self.rng = rng or random.Random()
        self.extra_annotations = extra_annotations
        self.foreground = cache.foreground if cache is not None else Foreground()
        """Every call is marked in flight here: the cache's list work waits for a gap."""
        self._locks = _PodLocks()
        self._nodes = NodeLabelCache(store, self.clock)

    # -- operations ---------------------------------------------------------------------------

    async def mirror(
        self, allocation: AllocationInput, *, idempotency_key: str = "", replace: bool = False,
        deadline: Deadline = NO_DEADLINE,
    ) -> MirrorResult:
        """What the pod carries once the call is done: written by this call (`changed`) or
        already there. The log line of a write is written after the caller has its answer."""
        with self.foreground.call():
            return await self._mirror(allocation, idempotency_key, replace, deadline)

    async def preview(self, allocation: AllocationInput, *, check_conflict: bool = False,
                      deadline: Deadline = NO_DEADLINE) -> PreviewResult:
        """What `mirror` with `replace` would write, refused where it would be (the pod's
        state); `check_conflict`: also where `mirror` without `replace` would be (a different
        mirrored allocation). Nothing is written."""
        with self.foreground.call():
            decision = await self._decision(allocation, deadline)
            pod = await self._get(allocation.namespace, allocation.pod_name,
                                  allocation.pod_uid, deadline)
            planned = self._plan_write(pod, allocation, decision, "", not check_conflict,
                                       final=True)
            assert planned is not None  # final=True raises instead
            outcome = planned[0]
            return PreviewResult(outcome.annotations, outcome.plans)

    async def release(self, namespace: str, name: str, uid: str = "", *,
                      idempotency_key: str = "", deadline: Deadline = NO_DEADLINE
                      ) -> ReleaseResult:
        """Removes what the mirror wrote; the record gives way to a ReleasedRecord that keeps
        the keys of the calls now over (`idempotency_key` the latest), so a late retry of one
        is refused (IDEMPOTENCY_KEY_SUPERSEDED) rather than stripping, or putting back, an
        allocation written after it. A retry of the release itself is a no-op."""
        with self.foreground.call():
            return await self._release(namespace, name, uid, idempotency_key, deadline)

    async def close(self) -> None:
        """Closes the store (its connections): the event loop the service ran on awaits it."""
        await self.store.close()

    # -- steps --------------------------------------------------------------------------------

    async def _mirror(self, allocation: AllocationInput, idempotency_key: str, replace: bool,
                      deadline: Deadline) -> MirrorResult:
        check_idempotency_key(idempotency_key)
        decision = await self._decision(allocation, deadline)
        ns, name = allocation.namespace, allocation.pod_name
        async with self._locks.hold(ns, name):
            refused = _NOT_LOST  # the write of the try before, when its precondition failed
            for attempt, wait in enumerate(self._waits(f"mirror on pod {ns}/{name}", deadline)):
                if wait:
                    await self.clock.asleep(wait)
                # A conflict means the pod moved on: every later try reads it from the API.
                pod, fresh = await self._read(allocation, deadline, cached=attempt == 0)
                planned = self._plan_write(pod, allocation, decision, idempotency_key, replace,
                                           final=fresh)
                if planned is None or (not planned[1].changes and not fresh):
                    # Never refuse, nor answer "nothing to write", from the cache: what it
                    # holds may be stale. Only the API server's copy decides those.
                    pod, fresh = await self._get(ns, name, allocation.pod_uid, deadline), True
                    planned = self._plan_write(pod, allocation, decision, idempotency_key,
                                               replace, final=True)
                assert planned is not None  # final=True raises instead
                outcome, patch = planned
                if not patch.changes:
                    if refused.landed(pod):
                        # This call's write landed and its answer was lost: the store's retry
                        # met the version that write made. The call did write.
                        log.info("pod %s/%s: this call's write (%s) landed, its answer lost",
                                 ns, name, outcome.digest[:19])
                        return MirrorResult(outcome.annotations, True, pod.resource_version,
                                            outcome.plans)
                    log.info("pod %s/%s already carries its allocation (%s); nothing written",
                             ns, name, outcome.digest[:19])
                    return MirrorResult(outcome.annotations, False, pod.resource_version,
                                        outcome.plans)
                written = await self._patch(pod, patch.changes, deadline, attempt,
                                            allocation.pod_uid)
                if isinstance(written, _Refused):
                    # A repeat's write (the record's new key alone) answers changed=False
                    # whether or not it landed. A write from a cached pod met by a 409 proves
                    # nothing of its own: where the cache lagged another replica's write of
                    # this same call (KAI's retry after that one's answer was lost), the
                    # stale write was refused and the retry met that replica's version, which
                    # the re-read shows as this call's allocation.
                    refused = written if fresh and not patch.repeat else _NOT_LOST
                    continue
                # Queued, the line is written once this task has handed its answer back (a
                # write to stderr is not worth a caller's wait).
                if patch.repeat:
                    asyncio.get_running_loop().call_soon(
                        log.info, "pod %s/%s already carries its allocation (%s); recorded "
                        "the key %r of this repeat", ns, name, outcome.digest[:19],
                        idempotency_key)
                else:
                    asyncio.get_running_loop().call_soon(
                        log.info, "pod %s/%s: wrote %d annotation change(s) for container %s "
                        "(%s)", ns, name, len(patch.changes), outcome.container or "-",
                        outcome.digest[:19])
                return MirrorResult(outcome.annotations, not patch.repeat,
                                    written.resource_version, outcome.plans)
        raise AssertionError("unreachable")  # _waits raises when it runs out

    async def _release(self, namespace: str, name: str, uid: str, idempotency_key: str,
                       deadline: Deadline) -> ReleaseResult:
        check_idempotency_key(idempotency_key)
        async with self._locks.hold(namespace, name):
            what = f"release on pod {namespace}/{name}"
            refused = _NOT_LOST  # the write of the try before, when its precondition failed
            for attempt, wait in enumerate(self._waits(what, deadline)):
                if wait:
                    await self.clock.asleep(wait)
                pod = await self._get(namespace, name, uid, deadline)
                if refused.landed(pod):
                    # This call's write landed and its answer was lost (the store's retry met
                    # the version it made): the release is done, by this call.
                    assert refused.lost is not None
                    return self._released(namespace, name, idempotency_key, refused.lost)
                if retry_of_release(pod, idempotency_key):
                    # This very release landed before (the record is the one it left), and
                    # whatever the pod carries now came after it: the binder's own rebind (an
                    # unmodified KAI binder writes its keys itself, the follower signs them),
                    # which the scheduler accounts. Removing it would be the late retry
                    # stripping a newer allocation: nothing is written. Not even a key that a
                    # mutating webhook put back in the release's own write: the answer to that
                    # write was checked (stored_otherwise in _patch) and the call failed
                    # INTERNAL, naming the key, and no retry can tell such a key from one
                    # written since. (Where that answer was lost, the PATCH timing out after it
                    # landed, the key goes unreported; removing it here would still risk the
                    # newer allocation, so the retry leaves it too.)
                    log.info("pod %s/%s: release %s already done; nothing written",
                             namespace, name, idempotency_key)
                    return ReleaseResult((), False)
                changes: dict[str, str | None] = dict(release_patch(pod, self.keys))
                left = released_record(pod, idempotency_key)
                if left is not None:  # else the record goes with the keys it lists
                    encoded = left.encode()
                    if pod.annotations.get(MIRRORED_ANNOTATION) == encoded:
                        changes.pop(MIRRORED_ANNOTATION, None)  # unchanged (a keyless release)
                    else:
                        changes[MIRRORED_ANNOTATION] = encoded
                if not changes:
                    return ReleaseResult((), False)
                written = await self._patch(pod, changes, deadline, attempt, uid)
                if isinstance(written, _Refused):
                    refused = written
                    continue
                return self._released(namespace, name, idempotency_key, changes)
        raise AssertionError("unreachable")

    @staticmethod
    def _released(namespace: str, name: str, idempotency_key: str,
                  changes: Mapping[str, str | None]) -> ReleaseResult:
        """The answer to a release whose write of `changes` landed."""
        removed = tuple(sorted(key for key, value in changes.items() if value is None))
        log.info("pod %s/%s: released %d key(s)%s", namespace, name, len(removed),
                 f" (key {idempotency_key})" if idempotency_key else "")
        return ReleaseResult(removed, bool(removed))

    async def _decision(self, allocation: AllocationInput, deadline: Deadline):
        """The contract's BindDecision; the node's labels are read first when it needs them
        (resolve_decision is pure: it gets them as a lookup)."""
        node = node_to_read(allocation)
        needs_memory = not allocation.node_gpu_memory_mib  # else only that the node exists
        labels = await self._nodes.get(node, needs_memory, deadline) if node else None
        return resolve_decision(allocation, lambda _: labels,
                                default_reserve_mib=self.default_reserve_mib,
                                dialect=self.dialect)

    async def _read(self, allocation: AllocationInput, deadline: Deadline, *, cached: bool
                    ) -> tuple[PodSnapshot, bool]:
        """The pod and whether it came from the API (True) or the cache (False). A cached pod
        of another uid than the caller's is read again: the cache may lag a recreation."""
        if cached and self.cache is not None:
            pod = self.cache.lookup(allocation.namespace, allocation.pod_name,
                                    allocation.pod_uid)
            if pod is not None:
                return pod, False
        return await self._get(allocation.namespace, allocation.pod_name, allocation.pod_uid,
                               deadline), True

    def _plan_write(self, pod: PodSnapshot, allocation: AllocationInput, decision,
                    idempotency_key: str, replace: bool, *, final: bool
                    ) -> tuple[Outcome, Patch] | None:
        """The outcome and the patch; None instead of a refusal when not `final` (a pod from
        the cache, which is read again before anyone is refused)."""
        try:
            outcome = self._outcome(pod, allocation, decision)
            released = released_here(pod)
            if released is not None:
                check_key_after_release(pod, released, idempotency_key)
            patch = mirror_patch(pod, outcome, idempotency_key=idempotency_key,
                                 replace=replace, keys=self.keys)
            if released is not None and MIRRORED_ANNOTATION in patch.changes:
                record = released.followed_by(patch.record)  # the spent keys carried on
                patch = Patch({**patch.changes, MIRRORED_ANNOTATION: record.encode()}, record)
            return outcome, patch
        except (InvalidAllocation, AllocationConflict):
            if final:
                raise
            return None

    def _outcome(self, pod: PodSnapshot, allocation: AllocationInput, decision) -> Outcome:
        return compute_outcome(pod, decision, container=allocation.container, keys=self.keys,
                               mps_pipe_root=self.mps_pipe_root, extra=self.extra_annotations,
                               node=allocation.selected_node)

    async def _get(self, namespace: str, name: str, uid: str, deadline: Deadline
                   ) -> PodSnapshot:
        pod = await self.store.get_pod(namespace, name, deadline)
        if self.cache is not None:
            self.cache.remember(pod)
        if uid and pod.uid and pod.uid != uid:
            raise PodReplaced(namespace, name, uid, pod.uid)
        return pod

    async def _patch(self, pod: PodSnapshot, changes: Mapping[str, str | None],
                     deadline: Deadline, attempt: int, uid: str) -> PodSnapshot | _Refused:
        """The written pod, or _Refused after a conflict (the caller re-reads and recomputes).
        `uid` is the one the caller named ("" none): only then is a recreated pod the end of
        the call (PodReplaced); a caller that named no uid means whatever pod has the name."""
        try:
            written = await self.store.patch_annotations(
                pod.namespace, pod.name, changes, uid=pod.uid,
                resource_version=pod.resource_version, deadline=deadline)
            if self.cache is not None:
                # Write-through: a duplicate call sees it at once, and its watch event, which
                # brings nothing new, is skipped unparsed.
                self.cache.remember(written, written=True)
            otherwise = stored_otherwise(written, changes)
            if otherwise is not None:
                raise ApiRejected(f"{otherwise}; the pod does not carry what the call wrote")
            return written
        except WriteConflict as e:
            log.info("pod %s/%s changed under the write (try %d): %s; re-reading",
                     pod.namespace, pod.name, attempt + 1, e)
            return _Refused(changes) if e.may_have_landed else _NOT_LOST
        except WriteInvalid as e:
            # A uid that no longer matches fails the immutable-field check (422 on a real API
            # server): tell a recreated pod from a genuinely refused patch.
            fresh = await self.store.get_pod(pod.namespace, pod.name, deadline)
            if self.cache is not None:
                self.cache.remember(fresh)  # a stale entry is what sent the old uid
            if pod.uid and fresh.uid != pod.uid:
                if uid:
                    raise PodReplaced(pod.namespace, pod.name, uid, fresh.uid) from None
                log.info("pod %s/%s was recreated under the write (try %d); re-reading",
                         pod.namespace, pod.name, attempt + 1)
                return _NOT_LOST  # bounded: each try counts as a conflict (_waits)
            raise ApiRejected(f"the API server refused the patch of pod {pod.namespace}/"
                              f"{pod.name}: {e}") from None

    def _waits(self, what: str, deadline: Deadline) -> Iterator[float]:
        """The wait before each try: 0 before the first, then a jittered, bounded delay after
        each write conflict. Raises DeadlineExceeded when the next wait would outlast the
        caller's deadline, ApiUnavailable when the tries are spent. A plain generator that the
        caller's loop awaits between tries: an async one, left suspended by the `return` of a
        successful try, made the event loop finalize it (a wakeup and a task) on every call."""
        backoff = self.conflict_backoff
        yield 0.0
        for conflicts in range(1, backoff.attempts):
            delay = backoff.delay(conflicts - 1, self.rng)
            remaining = deadline.remaining()
            if remaining is not None and remaining <= delay:
                raise DeadlineExceeded(f"{what}: the caller's deadline ran out after "
                                       f"{conflicts} write conflict(s)")
            yield delay
        raise ApiUnavailable(f"{what}: the pod kept changing under the write "
                             f"({backoff.attempts} conflicts); retry later")
