"""The KAI follower's signing step: the patch that signs a pod whose annotations it checked.

With a signing key (`--signing-key-file`) the follower signs what it verified, and nothing
else: when every key matches, one signature annotation per fractional container
(`kai_fractions.signing`, over the `ContainerPlan` the node agent builds from the pod's current
annotations), in ONE merge patch guarded by the pod's uid and resourceVersion. A pod that
changed between the read and the patch is refused by the API server (409); the follower reads
it again and checks it again (its SIGN_ATTEMPTS), so it never signs annotations it did not
check; one that keeps changing is checked again after a backoff (`Verification.recheck`,
`rechecks`). A patch refused as invalid (422) is read again to tell a recreated pod (its uid
guard failed: checked again, as a change) from a write the API server refuses itself
(annotations over its size limit, an admission policy), which would be refused at every retry:
that is reported, not rechecked (`refused_patch`). A mismatch is never signed; a signature that
already verifies is not rewritten, and one under a key the mirror still holds that no longer
verifies (the pod was edited after it was signed) is not replaced: only a retired key's is.
Derived annotations stay the node agent's.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import replace

from ..contract import ContractViolation, Keys, parse_pod, plan_container
from ..kube.retry import NO_DEADLINE, Deadline
from ..signing import KeyringSource, signature_key
from .bindrequest_view import BindRequestView
from .errors import PodNotFound
from .store import PodSnapshot, PodStore, WriteInvalid, stored_otherwise
from .verification import Verification

# The follower's logger, not this module's: its log lines keep the name they were always
# filtered and collected under.
log = logging.getLogger("kai_fractions.mirror.follower")

UNSIGNED_REASON = "NvFractionsUnsigned"

Report = Callable[[PodSnapshot, str, str, Deadline], Awaitable[None]]
"""The follower's event reporter: (pod, reason, message, deadline)."""


async def sign_checked(store: PodStore, pod: PodSnapshot, checked: Verification, node: str, *,
                       keys: Keys, signer: KeyringSource | None,
                       may_write: Callable[[str], None],
                       deadline: Deadline = NO_DEADLINE) -> Verification:
    """Signs the checked `pod` as it was read, for `node` (the BindRequest's selected
    node): one patch, guarded by its uid and resourceVersion (raises WriteConflict /
    WriteInvalid when it changed since). `may_write` raises TermEnded when the patch must
    not be sent."""
    if signer is None:
        return checked
    if not node:
        return replace(checked, unsigned="the BindRequest names no selected node to sign "
                                         "the allocation for")
    if not pod.uid or not pod.resource_version:
        # Without both guards the patch could land on annotations nobody checked.
        return replace(checked, unsigned="the pod has no uid or resourceVersion to guard "
                                         "the signing patch")
    request = parse_pod(pod.view, keys)
    if request.errors:  # pragma: no cover - the check above parsed the same annotations
        return replace(checked, unsigned="the pod's annotations do not parse")
    keyring = signer.current()
    changes: dict[str, str | None] = {}
    for share in request.shares:
        try:
            # Exactly what the node agent verifies (signatures.SignatureCheck).
            plan = plan_container(share, pod.uid, keys=keys)
        except ContractViolation as e:
            return replace(checked, unsigned=f"container {share.container} cannot be "
                                             f"planned: {e}")
        annotation = signature_key(plan, keys)
        existing = pod.annotations.get(annotation)
        if existing:
            verdict = keyring.verify(plan, existing, keys, node=node)
            if verdict.ok:
                continue
            if verdict.kid in keyring.kids:
                # Signed under a key still held: what it signed was changed since (a
                # user-owned key raised where admission does not run). Only a retired
                # key's signature is replaced.
                return replace(checked, unsigned=(
                    f"container {share.container}'s signature (key {verdict.kid}, which "
                    "the mirror still holds) no longer matches its GPU annotations: they "
                    "were changed after they were signed, and are not signed again; "
                    "delete the pod so the scheduler binds it again"))
        changes[annotation] = keyring.sign(plan, node=node)
    if not changes:
        return checked
    may_write(f"the signing patch of pod {pod.namespace}/{pod.name}")
    written = await store.patch_annotations(
        pod.namespace, pod.name, changes, uid=pod.uid,
        resource_version=pod.resource_version, deadline=deadline)
    otherwise = stored_otherwise(written, changes)
    if otherwise is not None:  # the node agent would refuse the pod as unsigned
        return replace(checked, unsigned=otherwise)
    log.info("pod %s/%s: signed %s (key %s)", pod.namespace, pod.name,
             ", ".join(sorted(changes)), keyring.current.kid)
    return replace(checked, signed=tuple(sorted(changes)), unsigned="",
                   resigned=any(key in pod.annotations for key in changes))


async def refused_patch(store: PodStore, br: BindRequestView, pod: PodSnapshot,
                        checked: Verification, error: WriteInvalid, *, report: Report,
                        deadline: Deadline) -> Verification | None:
    """What a signing patch refused as invalid (422) means: None when the pod was created
    again (its uid guard failed: check the new one, as after a conflict), else the final
    result. The same pod refused means the API server refuses the write itself (its
    annotations over the 256 KiB limit, an admission webhook or policy): that does not
    pass by itself, so it is reported, not rechecked (as MirrorService._patch tells)."""
    try:
        fresh = await store.get_pod(br.namespace, br.pod_name, deadline)
    except PodNotFound:
        return Verification(br.ref, checked.pod, skipped="pod not found")
    if fresh.uid != pod.uid:
        return None
    # The API server's answer goes last: an event's message is cut at 1024 characters,
    # and what to do must survive a long one.
    await report(pod, UNSIGNED_REASON, (
        "not signed: the API server refuses the signing patch as invalid, so the pod is "
        "not checked again until its BindRequest changes or is listed again; keep the "
        "pod's annotations under the API server's 256 KiB limit and let admission "
        "webhooks and policies allow the mirror's patch of its signature annotation, then "
        f"delete the pod so the scheduler binds it again (BindRequest {br.ref}): {error}"),
        deadline)
    return replace(checked, unsigned=f"the API server refused the signing patch as "
                                     f"invalid: {error}", recheck=False)
