"""Pure: from a pod and a decision, what the mirror writes, and the one patch that gets it there.

All arithmetic is the contract package's (`parse_pod`, `binder_annotations`, `plan_pod`,
`derived_annotations`); this module only decides which of the pod's keys are the user's, and
diffs what should be on the pod against what is.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from ..contract import (
    DEFAULT_MPS_PIPE_ROOT,
    BindDecision,
    ContainerPlan,
    ContractError,
    ContractViolation,
    Keys,
    PodRequest,
    PodView,
    binder_annotations,
    derived_annotations,
    parse_pod,
    plan_pod,
)
from ..contract import keys as k
from .errors import AllocationConflict, InvalidAllocation
from .record import MIRRORED_ANNOTATION, MirrorRecord, allocation_digest, decode_record
from .store import PodSnapshot

ExtraAnnotations = Callable[
    [PodSnapshot, Mapping[str, str], tuple[ContainerPlan, ...], str], Mapping[str, str]]
"""A hook (pod, written, plans, node) whose annotations join the mirror's own, in the same
patch and owned (recorded, released) the same way: allocation signatures (`mirror.signing`).
Its values are a function of the decision, not part of it, so they stay out of the decision
digest: re-signing the same allocation with a rotated key is the same allocation, not a
conflicting one."""


@dataclass(frozen=True, slots=True)
class Outcome:
    container: str
    """The fractional container ("" for a whole-GPU bind)."""
    annotations: Mapping[str, str]
    """Everything the mirror owns for this allocation: binder keys and derived keys, sorted."""
    plans: tuple[ContainerPlan, ...]
    hook_keys: frozenset[str] = frozenset()
    """Keys the ExtraAnnotations hook wrote (they do not identify the decision)."""
    _digest: str = field(default="", init=False, repr=False, compare=False)

    @property
    def digest(self) -> str:
        """Computed once (a JSON dump and a hash): the patch, the record and the log use it."""
        if not self._digest:
            object.__setattr__(self, "_digest", allocation_digest(
                {key: value for key, value in self.annotations.items()
                 if key not in self.hook_keys}))
        return self._digest


def current_record(pod: PodSnapshot) -> MirrorRecord | None:
    """The pod's record when it was written for THIS pod (a recreated pod's is ignored)."""
    record = decode_record(pod.annotations.get(MIRRORED_ANNOTATION))
    if record is None or (pod.uid and record.pod_uid != pod.uid):
        return None
    return record


def is_mirror_managed(key: str, keys: Keys) -> bool:
    """Keys only the binder role writes: always recomputed, never taken as the user's. The
    MPS namespace the admission webhook named is not one: it stays, and the plan reads it."""
    return key == k.RECEIVED_RESOURCE_TYPE or (  # protected: the record too
        keys.is_protected(key) and not keys.is_admitted_namespace(key))


def user_view(pod: PodSnapshot, keys: Keys) -> PodView:
    """The pod as its user wrote it: without the keys the record says the mirror wrote (a
    mirror-written request must not pass for a user-given one) and without binder-owned and
    derived keys (always rewritten, whoever wrote them)."""
    record = current_record(pod)
    owned = set(record.keys) if record else set()
    view = pod.view
    kept = {key: value for key, value in view.annotations.items()
            if key not in owned and not is_mirror_managed(key, keys)}
    if len(kept) == len(view.annotations):
        return view  # a pod the mirror has not written yet: one view, not a copy per pod
    return view.with_annotations(MappingProxyType(kept))


def user_request(pod: PodSnapshot, keys: Keys = k.DEFAULT_KEYS) -> tuple[PodView, PodRequest]:
    """`user_view` and its parse, computed once per snapshot and Keys. The pod cache has it
    computed when a pod arrives (PodCache's `prepare`), long before a scheduler binds the pod,
    so an allocation for a cached pod starts from it: about a third of compute_outcome."""
    parsed = pod.parsed
    if parsed is None or not (parsed[0] is keys or parsed[0] == keys):
        parsed = (keys, parse_pod(user_view(pod, keys), keys))
        object.__setattr__(pod, "parsed", parsed)  # a frozen snapshot's one cache slot
    request = parsed[1]
    return request.pod, request  # the view is the request's own: one tuple fewer per pod kept


_NAMED = 10
"""Containers a message names."""


def _check_pod_state(pod: PodSnapshot, node: str) -> None:
    """An allocation is mirrored onto a pod that can still run it: not one being deleted, and
    not one bound to another node than the allocation's (its GPUs are not there)."""
    ref = f"{pod.namespace}/{pod.name}"
    if pod.metadata.get("deletionTimestamp"):
        raise AllocationConflict(ref, f"pod {ref} is being deleted: no allocation is written "
                                 "onto it", kind="POD_DELETING")
    bound = pod.spec.get("nodeName")
    if node and bound and bound != node:
        raise AllocationConflict(ref, (
            f"pod {ref} is bound to node {bound}, not to {node}, the allocation's: its GPUs "
            "are not there"), kind="POD_ON_ANOTHER_NODE")


def compute_outcome(
    pod: PodSnapshot,
    decision: BindDecision,
    *,
    container: str = "",
    keys: Keys = k.DEFAULT_KEYS,
    mps_pipe_root: str = DEFAULT_MPS_PIPE_ROOT,
    extra: ExtraAnnotations | None = None,
    node: str = "",
) -> Outcome:
    """Raises InvalidAllocation (request fields and pod annotation keys). `node` is the node
    the allocation was made for (what a signature binds, through `extra`)."""
    _check_pod_state(pod, node)
    view, request = user_request(pod, keys)
    if container and view.container(container) is None:
        every = [c.name for c in view.all_containers]
        names = ", ".join(every[:_NAMED]) or "none"
        if len(every) > _NAMED:  # a status carries at most 16 KiB
            names += f", ... ({len(every)} in all)"
        raise InvalidAllocation([ContractError(
            "container_name", f"names container {container!r}, which is not in pod "
            f"{pod.namespace}/{pod.name} (containers: {names})", container)])
    if request.errors:
        raise InvalidAllocation(request.errors)
    share = request.share
    if (container and share is not None and share.container != container
            and decision.resource_type == k.RESOURCE_TYPE_FRACTION):
        raise InvalidAllocation([ContractError(
            "container_name", f"names container {container!r} but the pod's fractional GPU "
            f"request is on container {share.container!r}", container)])
    try:
        written = binder_annotations(request, decision, keys)
        plans: tuple[ContainerPlan, ...] = ()
        if decision.resource_type == k.RESOURCE_TYPE_FRACTION:
            bound = view.with_annotations(MappingProxyType({**view.annotations,
                                                            **written}))
            plans = plan_pod(parse_pod(bound, keys), keys=keys, mps_pipe_root=mps_pipe_root)
    except ContractViolation as e:
        raise InvalidAllocation(e.errors) from None
    for plan in plans:
        written.update(derived_annotations(plan, keys))
    hooked: dict[str, str] = {}
    if extra is not None:
        hooked = {key: value for key, value in extra(pod, dict(written), plans, node).items()
                  if key not in written}  # the hook adds keys; it never rewrites the decision
        written.update(hooked)
    name = share.container if share is not None and plans else ""
    return Outcome(container=name, annotations=MappingProxyType(dict(sorted(written.items()))),
                   plans=plans, hook_keys=frozenset(hooked))


@dataclass(frozen=True, slots=True)
class Patch:
    changes: Mapping[str, str | None]
    """key -> new value, or None to delete; empty = the pod already says it all."""
    record: MirrorRecord
    repeat: bool = False
    """The pod already carries this allocation: the patch only adds the caller's new key to
    the record (`MirrorRecord.aliases`), and the answer is `changed: false`."""


def mirror_patch(
    pod: PodSnapshot, outcome: Outcome, *, idempotency_key: str = "", replace: bool = False,
    keys: Keys = k.DEFAULT_KEYS,
) -> Patch:
    """The one merge patch that puts `outcome` on `pod` (removing what the mirror wrote before
    and no longer wants); raises AllocationConflict when the pod carries a different mirrored
    allocation and `replace` is not set."""
    current = pod.annotations
    old = current_record(pod)
    new = MirrorRecord(pod_uid=pod.uid, container=outcome.container,
                       keys=tuple(sorted(outcome.annotations)), digest=outcome.digest,
                       idempotency_key=idempotency_key)
    ref = f"{pod.namespace}/{pod.name}"
    if old is not None and old.digest != new.digest:
        if old.owns_key(idempotency_key):
            raise AllocationConflict(ref, (
                f"idempotency key {idempotency_key!r} was already used on pod {ref} for a "
                "different allocation; a retry must repeat the same decision, a new decision "
                "needs a new key"), kind="IDEMPOTENCY_KEY_REUSED")
        if idempotency_key and idempotency_key in old.spent:
            raise AllocationConflict(ref, (
                f"idempotency key {idempotency_key!r} names an allocation of pod {ref} that a "
                f"later call replaced (key {old.idempotency_key or '-'}): a late retry of a "
                "superseded decision is not put back; drop it"),
                kind="IDEMPOTENCY_KEY_SUPERSEDED")
        if not replace:
            raise AllocationConflict(ref, (
                f"pod {ref} already carries a different mirrored allocation (container "
                f"{old.container or '-'}, {old.digest[:19]}); set replace to rebind it, or "
                "release it first"))
        new = old.replaced_by(new)
    stale = set(old.keys) if old else set()
    stale |= {key for key in current if is_mirror_managed(key, keys)}
    stale -= set(outcome.annotations) | {MIRRORED_ANNOTATION}
    changes: dict[str, str | None] = {
        key: value for key, value in outcome.annotations.items() if current.get(key) != value}
    changes.update({key: None for key in sorted(stale) if key in current})
    if old is not None and old.digest == new.digest:
        # The same allocation, whatever hook keys came or went (signing turned on or off):
        # the record keeps its keys, the first caller's, the spent ones and the aliases. A new
        # key is recorded as well, though the repeat writes nothing else (one guarded patch
        # more): answered OK for this allocation, its late retry after a rebind must be
        # refused like the first key's, not put it back.
        known = old.repeated_by(new, idempotency_key)
        if known == old:
            return Patch(changes=changes, record=old)
        changes[MIRRORED_ANNOTATION] = known.encode()
        return Patch(changes=changes, record=known,
                     repeat=changes.keys() == {MIRRORED_ANNOTATION})
    changes[MIRRORED_ANNOTATION] = new.encode()
    return Patch(changes=changes, record=new)


def release_patch(pod: PodSnapshot, keys: Keys = k.DEFAULT_KEYS) -> dict[str, None]:
    """Deletes every key the mirror wrote (its record lists them), every key only the binder
    role writes (`is_mirror_managed`: a release whose record went while one of them stayed,
    put back by a webhook, must find it again), and the record; the user's keys stay."""
    current = pod.annotations
    record = current_record(pod)
    changes: dict[str, None] = {}
    if record is not None:
        changes = {key: None for key in record.keys if key in current}
    changes.update({key: None for key in current if is_mirror_managed(key, keys)})
    return changes
