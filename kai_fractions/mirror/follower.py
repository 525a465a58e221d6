"""KAI follower: for clusters running an unmodified KAI, check what KAI's binder wrote.

For each fractional BindRequest (scheduling.run.ai/v1alpha2) that KAI reports as Succeeded, or
that is still Pending (or Failed with bind attempts left) a while after its creation while its
pod is bound to the node it selected (the binder's update of its status was lost:
`PENDING_GRACE`, `lost_bind_status`), `Follower` rebuilds the scheduler's decision as the SAME
`AllocationInput` the gRPC servicer hands to `MirrorService`, computes with the contract
package what the binder must have written (in the configured dialect: upstream KAI main, or the
patched KAI that also writes a compute portion), compares it with the pod BY MEANING (`20Gi` is
`20480Mi`) and reports each difference as a pod event (reason `NvFractionsMismatch`, naming the
key, the expected and the found value).

With a signing key (`--signing-key-file`) it signs what it verified, and nothing else, in one
patch guarded by the pod's uid and resourceVersion (`follower_signing`).
It signs only the pod the BindRequest was made for (its owner's uid), never another created
under the same name. A pod that has run to its end (Succeeded, Failed) has nothing left to
check or sign.
Every decision not to sign a bound fractional pod is an event on the pod and a log line that
name the reason (`NvFractionsMismatch`, `NvFractionsInvalid`, `NvFractionsUnsigned`).

Under leader election (`in_term`, the elector's) every write, signing patch and event alike, is
sent only while this replica's term still runs by the clock: a check that was under way when
the renew deadline passed (its process paused, say, while its read was answered) drops its
write, and the check counts as skipped, not done.

What it cannot know, and assumes: the binder's dialect and memory reserve (`--kai-dialect`,
`--reserve-mib`, as configured for the mirror) and whether a memory request on the pod was the
user's or the binder's (a request beside a legacy `gpu-fraction`/`gpu-memory` key is taken as
the binder's or KAI admission's, since precedence makes a user's own request win over those
keys anyway).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import replace

from ..contract import DEFAULT_DIALECT, BindDecision, Dialect, Keys, parse_pod
from ..contract import keys as k
from ..contract.compare import same_value
from ..kube.retry import NO_DEADLINE, Deadline
from ..signing import KeyringSource
from .bindrequest_view import BindRequestView, not_its_pod
from .decision import MAX_ID, MAX_IDS, AllocationInput, node_to_read, resolve_decision
from .errors import InvalidAllocation, PodNotFound
from .follower_signing import UNSIGNED_REASON, refused_patch, sign_checked
from .kai_binder import binder_expectation, binder_request, kept_limit
from .lost_bind_status import not_bound, pending_phase, waiting
from .rechecks import RECHECK_BACKOFF, RECHECK_WINDOW
from .store import NodeNotFound, PodSnapshot, PodStore, WriteConflict, WriteInvalid
from .verification import Mismatch, TermEnded, Verification

log = logging.getLogger(__name__)

GROUP, VERSION, PLURAL = k.BINDREQUEST_GROUP, k.BINDREQUEST_VERSION, k.BINDREQUEST_PLURAL
RESERVATION_NAMESPACE = k.RESERVATION_NAMESPACE
SUCCEEDED = "Succeeded"
PENDING = frozenset(("", "Pending"))
"""A BindRequest's phases before KAI's binder has reported an outcome ("": no status yet)."""
PENDING_GRACE = 30.0
"""Seconds from its creation or first sight (the longer ago) after which a BindRequest not yet
Succeeded has its pod read, to be signed if bound to the selected node (KAI's binder may lose
that status update); sooner, the pod is nearly always not bound yet (docs/mirror.md)."""
MISMATCH_REASON = "NvFractionsMismatch"
INVALID_REASON = "NvFractionsInvalid"
SIGN_ATTEMPTS = 3
"""Reads of a pod per check when its signing patch meets a conflict (it changed meanwhile)."""
POD_ENDED = frozenset(("Succeeded", "Failed"))
"""Pod phases after which nothing runs: KAI's binder then deletes the group's reservation pod
(KAI-Scheduler pkg/binder/controllers/pod_controller.go, isCompletionEvent ->
syncReservationIfNeeded), so the GPU could not be known any more, and nothing needs a
signature."""
CHECKED_AGAIN = (f"the follower checks it again in {RECHECK_BACKOFF.base:g} s, then at "
                 f"doubling intervals of at most {RECHECK_BACKOFF.cap:g} s, until it is signed "
                 f"or the BindRequest changes (for {RECHECK_WINDOW / 60:g} minutes at most, "
                 "then at its next list)")
"""When an incomplete check that may pass by itself is done again (bindrequests.follow)."""
COMPLETE_KEPT = 200_000
"""BindRequests remembered as complete at most (then the oldest is checked again on its next
list): more than the fractional pods of a 5,000-node cluster (docs/scale.md)."""


class Follower:
    def __init__(self, store: PodStore, *, keys: Keys = k.DEFAULT_KEYS,
                 default_reserve_mib: int = 0, dialect: Dialect = DEFAULT_DIALECT,
                 reservation_namespace: str = RESERVATION_NAMESPACE,
                 remember: int = 10_000, signer: KeyringSource | None = None,
                 in_term: Callable[[], bool] | None = None,
                 now: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.now = now
        """The wall clock (seconds since the epoch), against a BindRequest's creationTimestamp:
        how long one has been Pending (`PENDING_GRACE`)."""
        self.monotonic = monotonic
        """This process's own clock, from the first sight of a BindRequest not Succeeded yet:
        bounds its wait when the wall clock is behind the API server's (`PENDING_GRACE`)."""
        self.in_term = in_term
        """Under leader election, the elector's `in_term`: tested just before each write, which
        is dropped when it says False (None: no election, every write is sent)."""
        self.signer = signer
        """None: check only (the node agent then runs without --signing-key-file)."""
        self.keys = keys
        self.default_reserve_mib = default_reserve_mib
        self.dialect = dialect
        self.reservation_namespace = reservation_namespace
        self._reported: OrderedDict[tuple[str, str, str], None] = OrderedDict()
        """(pod, reason, message) of each event posted (`_report`), and (BindRequest,
        "pending-bound", "") of each one not Succeeded checked anyway (`not_bound`): said once."""
        self._remember = remember
        self._complete: OrderedDict[str, str] = OrderedDict()
        """BindRequest uid -> the resourceVersion whose check was complete (`follow_one`)."""
        self._complete_under: tuple[str, ...] | None = None  # the signing keys it was under
        self.complete_kept = COMPLETE_KEPT
        self._read_consistently: OrderedDict[str, str] = OrderedDict()
        """BindRequest uid -> the resourceVersion whose check found no reserved GPU even in a
        consistent list (`reserved_gpu`): its checks again read the watch cache only."""
        self._first_seen: OrderedDict[str, float] = OrderedDict()
        """BindRequest uid -> `monotonic` when it was first seen not Succeeded yet; dropped
        once it is Succeeded or failed for good, or deleted (`forget`)."""

    async def follow_one(self, br: BindRequestView, deadline: Deadline = NO_DEADLINE
                         ) -> Verification | None:
        """`verify`, unless this version of `br` was already checked, found matching and
        signed under the signing keys of now (None then). KAI keeps a BindRequest for as long
        as its pod lives (its scheduler deletes only failed ones and those of deleted nodes),
        so every re-list (every resync) replays them all: without this, each costs its reads
        again (docs/scale.md). What was not complete (a finding, a skip, a pod left unsigned)
        is checked again: by the follow loop after a backoff when its `recheck` says so, else
        when it changes or is listed again; new signing keys make everything be checked (and
        signed) again."""
        kids = self.signer.current().kids if self.signer is not None else ()
        if kids != self._complete_under:
            self._complete.clear()
            self._complete_under = kids
        done = self._complete.get(br.uid)
        if br.uid and br.resource_version and done == br.resource_version:
            self._complete.move_to_end(br.uid)
            return None
        result = await self.verify(br, deadline)
        if br.uid and br.resource_version and result.complete:
            self._complete[br.uid] = br.resource_version
            while len(self._complete) > self.complete_kept:
                self._complete.popitem(last=False)
        return result

    def forget(self, br: BindRequestView) -> None:
        """A BindRequest is gone (its pod was deleted): its memory goes too."""
        self._complete.pop(br.uid, None)
        self._read_consistently.pop(br.uid, None)
        self._first_seen.pop(br.uid or br.ref, None)

    async def reserved_gpu(self, group_id: str, deadline: Deadline = NO_DEADLINE, *,
                           consistent: bool = True) -> str | None:
        """The GPU UUID behind a group: its reservation pod's `run.ai/reserve_for_gpu_index`.
        Read from the API server's watch cache first: a consistent list reads the whole
        reservation namespace from etcd before Kubernetes 1.31, once per BindRequest checked
        (thousands a second in a wave; docs/scale.md). Only a cache a moment behind misses
        it (the binder waited for that annotation before it bound the pod), and only then is
        it read again, consistently (unless not `consistent`): a miss would leave the pod
        unsigned until the next resync. A recheck of a version whose consistent read found
        nothing asks for none (`_check`): a reservation pod created since is in the cache by
        then, and thousands of BindRequests stuck at "not known yet" (a reservation namespace
        set wrong) would read that namespace from etcd at every recheck."""
        selector = {k.GPU_GROUP_LABEL: group_id}
        for cached in (True, False) if consistent else (True,):
            pods = await self.store.list_pods(self.reservation_namespace, selector, deadline,
                                              cached=cached)
            for pod in pods:
                uuid = pod.annotations.get(k.RESERVE_FOR_GPU)
                if uuid:
                    return uuid
        return None

    async def decide(self, br: BindRequestView, *, cdi: bool = False,
                     deadline: Deadline = NO_DEADLINE, consistent: bool = True
                     ) -> AllocationInput | None:
        """The decision as the servicer would receive it, the pod named by its uid as well
        (the BindRequest's owner); None while a group's device is not known yet (the binder
        has not finished reserving). `consistent`: as `reserved_gpu`."""
        gpu_ids = []
        # Past the bounds resolve_decision refuses the groups: nothing is read for them.
        within = len(br.group_ids) <= MAX_IDS and all(len(g) <= MAX_ID for g in br.group_ids)
        for group in br.group_ids if within else ():
            uuid = await self.reserved_gpu(group, deadline, consistent=consistent)
            if uuid is None:
                return None
            gpu_ids.append(uuid)
        return AllocationInput(
            namespace=br.namespace, pod_name=br.pod_name, pod_uid=br.owner_uid,
            selected_node=br.selected_node,
            resource_type=br.resource_type, gpu_count=br.gpu_count, portion=br.portion,
            group_ids=br.group_ids, group_modes=br.group_modes, gpu_ids=tuple(gpu_ids),
            cdi=cdi, container="")

    async def verify(self, br: BindRequestView, deadline: Deadline = NO_DEADLINE
                     ) -> Verification:
        try:
            return await self._verify(br, deadline)
        except TermEnded as e:
            log.info("BindRequest %s: %s not sent: this replica's term as the follower has "
                     "ended", br.ref, e)
            return Verification(br.ref, f"{br.namespace}/{br.pod_name}",
                                skipped=f"the term as the follower ended before {e}")

    def _may_write(self, what: str) -> None:
        """Raises TermEnded when this replica's term has ended: `what` is not sent."""
        if self.in_term is not None and not self.in_term():
            raise TermEnded(what)

    async def _verify(self, br: BindRequestView, deadline: Deadline) -> Verification:
        pod_ref = f"{br.namespace}/{br.pod_name}"
        if br.resource_type != k.RESOURCE_TYPE_FRACTION:
            return Verification(br.ref, pod_ref, skipped="not a fractional bind")
        pending = br.phase != SUCCEEDED
        if not pending or not (br.phase in PENDING or br.retrying):
            self._first_seen.pop(br.uid or br.ref, None)
        if pending:
            if br.phase not in PENDING and not br.retrying:
                # Failed for good (KAI's scheduler deletes it: IsFailed), or a phase unknown.
                return Verification(br.ref, pod_ref, skipped=f"phase {br.phase}")
            if waiting(br, self._first_seen, grace=PENDING_GRACE, now=self.now,
                       monotonic=self.monotonic, kept=self.complete_kept):
                # Succeeded is on its way, normally: checked again after a backoff (its event
                # then supersedes that), the pod read only once PENDING_GRACE has passed.
                return Verification(br.ref, pod_ref, skipped=pending_phase(br), recheck=True,
                                    waiting=True)
        result = Verification(br.ref, pod_ref)
        for _attempt in range(SIGN_ATTEMPTS):
            try:
                pod = await self.store.get_pod(br.namespace, br.pod_name, deadline)
            except PodNotFound:
                return Verification(br.ref, pod_ref, skipped="pod not found")
            if other := not_its_pod(br, pod):
                # A controller recreating a pod under its name meets this until KAI's garbage
                # collector removes the old BindRequest: not an event, only never a signature.
                log.info("%s; not checked", other)
                return Verification(br.ref, pod_ref, skipped=other)
            if pod.phase in POD_ENDED:
                # KAI keeps its BindRequest as long as the pod exists, so every list replays
                # it: complete, with no read of a reservation pod KAI has deleted.
                return Verification(br.ref, pod_ref)
            if pending:
                unbound = await not_bound(br, pod, signing=self.signer is not None,
                                          report=self._report, said=self._reported,
                                          remember=self._remember, deadline=deadline)
                if unbound is not None:
                    return unbound
            result = await self._check(br, pod, deadline)
            if result.skipped or result.errors or result.mismatches or self.signer is None:
                return result
            try:
                result = await sign_checked(self.store, pod, result, br.selected_node,
                                            keys=self.keys, signer=self.signer,
                                            may_write=self._may_write, deadline=deadline)
            except WriteConflict as e:
                # The pod changed since it was read: what was checked is not what is there
                # now, so read it again and check it again.
                log.info("pod %s changed before it was signed (%s); checking it again",
                         pod_ref, e)
                result = replace(result, unsigned=f"the pod kept changing: {e}", recheck=True)
                continue
            except WriteInvalid as e:
                refused = await refused_patch(self.store, br, pod, result, e,
                                              report=self._report, deadline=deadline)
                if refused is not None:
                    return refused
                log.info("pod %s was created again before it was signed (%s); checking it "
                         "again", pod_ref, e)
                result = replace(result, unsigned=f"the pod kept changing: {e}", recheck=True)
                continue
            except PodNotFound:
                return Verification(br.ref, pod_ref, skipped="pod not found")
            if result.unsigned:
                await self._report(pod, UNSIGNED_REASON, f"not signed: {result.unsigned} "
                                   f"(BindRequest {br.ref})", deadline)
            return result
        await self._report(pod, UNSIGNED_REASON, f"not signed: it changed under "
                           f"{SIGN_ATTEMPTS} attempt(s); {CHECKED_AGAIN} (BindRequest {br.ref})",
                           deadline)
        return result

    async def _check(self, br: BindRequestView, pod: PodSnapshot,
                     deadline: Deadline) -> Verification:
        pod_ref = f"{br.namespace}/{br.pod_name}"
        versioned = bool(br.uid and br.resource_version)
        consistent = not (versioned
                          and self._read_consistently.get(br.uid) == br.resource_version)
        allocation = await self.decide(br, deadline=deadline, consistent=consistent)
        if allocation is not None:
            self._read_consistently.pop(br.uid, None)
        elif consistent and versioned:
            self._read_consistently[br.uid] = br.resource_version
            while len(self._read_consistently) > self.complete_kept:
                self._read_consistently.popitem(last=False)
        if allocation is None:
            reason = (f"the GPU reserved for group(s) {', '.join(br.group_ids)} is not known "
                      f"yet: no pod labelled {k.GPU_GROUP_LABEL} in "
                      f"{self.reservation_namespace} carries {k.RESERVE_FOR_GPU}")
            if self.signer is not None:
                await self._report(pod, UNSIGNED_REASON, f"not signed yet: {reason}; "
                                   f"{CHECKED_AGAIN} (BindRequest {br.ref})", deadline)
            return Verification(br.ref, pod_ref, skipped=reason, recheck=True)
        share = parse_pod(pod.view, self.keys).share
        written = pod.annotations.get(self.keys.container(share.container, k.DEVICES), "") \
            if share is not None else ""
        allocation = replace(allocation, cdi=written.startswith(k.CDI_DEVICE_PREFIX))
        try:
            decision = await self._decision(allocation, deadline)
            request, before = binder_request(pod, self.keys, decision)
            expected = binder_expectation(request, decision, self.keys)
        except InvalidAllocation as e:
            await self._report(pod, INVALID_REASON, f"cannot check the binder's annotations "
                               f"for BindRequest {br.ref}: {e}", deadline)
            return Verification(br.ref, pod_ref, errors=e.errors)
        wanted: dict[str, str | None] = dict(expected)
        if share is not None and not self.dialect.writes_compute_portion:
            # Upstream KAI never writes it (its webhook refuses the key): one on the pod was
            # not written by that binder, and the node would take it as a compute cap.
            wanted.setdefault(self.keys.container(share.container, k.COMPUTE_PORTION), None)
        rules: dict[str, str] = {}
        if before and (limit := kept_limit(pod, request, decision, self.keys)) is not None:
            key, found, rule = limit
            if rule:
                rules[key] = rule
            else:
                wanted[key] = found  # as KAI's binder keeps it
        mismatches = tuple(Mismatch(key, value, pod.annotations.get(key), rules.get(key, ""))
                           for key, value in sorted(wanted.items())
                           if not same_value(key, value, pod.annotations.get(key), self.keys))
        for m in mismatches:
            hint = ("; a binder that writes it is the patched KAI: run the follower with "
                    "--kai-dialect patched" if m.expected is None
                    and m.key.endswith(k.COMPUTE_PORTION) else "")
            await self._report(pod, MISMATCH_REASON,
                               f"{m.message} (BindRequest {br.ref}){hint}", deadline)
        return Verification(br.ref, pod_ref, mismatches=mismatches)

    async def _decision(self, allocation: AllocationInput, deadline: Deadline
                        ) -> BindDecision:
        """resolve_decision, the node's labels read first when it needs them (raises
        InvalidAllocation)."""
        node = node_to_read(allocation)
        labels = await self._node_labels(node, deadline) if node else None
        return resolve_decision(allocation, lambda _: labels,
                                default_reserve_mib=self.default_reserve_mib,
                                dialect=self.dialect)

    async def _node_labels(self, node: str, deadline: Deadline) -> Mapping[str, str] | None:
        try:
            return await self.store.node_labels(node, deadline)
        except NodeNotFound:
            return None

    async def _report(self, pod: PodSnapshot, reason: str, message: str,
                      deadline: Deadline) -> None:
        """One event per distinct finding per pod (a relist replays every BindRequest)."""
        key = (pod.uid or f"{pod.namespace}/{pod.name}", reason, message)
        if key in self._reported:
            return
        self._may_write(f"the {reason} event on pod {pod.namespace}/{pod.name}")
        log.warning("pod %s/%s: %s: %s", pod.namespace, pod.name, reason, message)
        await self.store.emit_event(pod, "Warning", reason, message, deadline)
        self._reported[key] = None
        while len(self._reported) > self._remember:
            self._reported.popitem(last=False)
