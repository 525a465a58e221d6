"""Signed allocations on the node (`--signing-key-file`): only what the mirror signed is applied.

Before a pass plans the node, every fractional container of a watched pod that the binder has
bound is planned on its own and its signature checked (`kai_fractions.signing`). A pod whose
signature is not valid is not planned from its annotations (its refusals are `plan_node`'s
vetoes), so it takes no memory, compute mode or MPS pinned limit on any GPU, unless it runs
already:

- a MISSING signature is pending (`SignatureMissing`, not final): with an unmodified KAI its
  binder's annotations land before the mirror's BindRequest follower has checked and signed
  them. No marker is written, the gate keeps waiting (and fails the pod on its own timeout if
  the signature never comes), and one `SignatureMissing` event tells the pod's owner why;
- a signature under a key this node does not hold is pending too (`SignatureKeyUnknown`),
  for `--signature-key-wait` (300 s) from when the agent first saw it: after a rotation the
  mirror signs with its new key a minute or two before every node has the public half, and
  the pod is applied once the agent re-reads its keys. A key still unknown then is a final
  refusal (a forged signature under a key of its own);
- a malformed or wrong signature is a final refusal (`SignatureInvalid`): the marker says so,
  the gate fails the pod with the reason, a `Refused` event tells its owner.

Never loosened: a pod that was applied and is edited afterwards (a user raising their own
`.gpu-memory.limit` on a running pod while admission is down or skips its namespace) keeps its
applied plan (`kai_fractions.node.applied`): its limits, its place in the GPU's accounting, its
MPS namespace and pinned limit and the watchdog's attention; the edit is reported as
`PlanChangeRefused` naming the signature failure. A refused pod whose applied plan cannot be
read back (no marker, derived annotations gone) keeps at least the memory limits in force on its
cgroups exactly as the kernel holds them (`kept_limits`, read back every pass, so this survives
agent restarts): a refusal must not turn into "unlimited" for a container that may be running.

Pods given through the root-only NodeEnforcer socket (`Provision`) are not checked: whoever can
reach that socket is root on the node already.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass

from ...contract import ContractViolation, Keys, parse_pod, plan_container
from ...signing import KeyringSource, Reason, Verification, signature_key
from ..desired import ContainerKey, DesiredState, LimitTarget, NodePod, Refusal
from ..engine import Engine
from ..errors import NvmlError
from ..inventory import Inventory

log = logging.getLogger(__name__)

KEY_WAIT_SECONDS = 300.0
"""How long a signature under a key this node does not hold waits for it: a rotation reaches a
node within the mirror's publishing interval (30 s) and the kubelet's sync of the mounted
ConfigMap (about a minute, its cache TTL included), with room to spare."""


@dataclass(frozen=True, slots=True)
class Screened:
    pods: tuple[NodePod, ...]
    """The pods to plan (everything but the refused ones)."""
    refusals: tuple[Refusal, ...] = ()
    refused_pods: frozenset[str] = frozenset()


class SignatureCheck:
    def __init__(self, source: KeyringSource, keys: Keys, node: str = "", *,
                 key_wait_seconds: float = KEY_WAIT_SECONDS,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.source = source
        self.keys = keys
        self.node = node
        """This agent's node: an Ed25519 signature must have been made for it ("" = the
        node each pod is bound to, for agents run without a node name)."""
        self.key_wait_seconds = key_wait_seconds
        self.monotonic = monotonic
        self._unknown_since: dict[tuple[str, str, str], float] = {}
        """(pod uid, container, kid) -> when a signature under that unknown key was first
        seen; only the pods of the last screen are kept."""

    def screen(self, pods: Iterable[NodePod], unchecked: Collection[str] = ()) -> Screened:
        """Split `pods` into the ones to plan and the refusals; `unchecked` pod UIDs (the
        provisioned ones) pass as they are."""
        keyring = self.source.current()
        kept: list[NodePod] = []
        refusals: list[Refusal] = []
        refused: set[str] = set()
        pods = list(pods)
        seen = {pod.uid for pod in pods}
        self._unknown_since = {k: t for k, t in self._unknown_since.items() if k[0] in seen}
        for pod in pods:
            mine = [] if pod.uid in unchecked else self._refusals(pod, keyring)
            if mine:
                refusals.extend(mine)
                refused.add(pod.uid)
            else:
                kept.append(pod)
        return Screened(tuple(kept), tuple(refusals), frozenset(refused))

    def _refusals(self, pod: NodePod, keyring) -> list[Refusal]:
        request = parse_pod(pod.view, self.keys)
        if request.errors:
            return []  # planning refuses it as ContractInvalid, with the contract's words
        failed: dict[str, tuple[str, str, bool]] = {}  # container -> (reason, message, waits)
        for share in request.shares:
            if not share.devices:
                continue  # not bound yet: nothing to check (planning says NotBound)
            try:
                plan = plan_container(share, pod.uid, keys=self.keys)
            except ContractViolation:
                continue  # planning refuses it with the reason
            verdict = keyring.verify(plan, pod.view.annotations.get(
                signature_key(plan, self.keys)), self.keys,
                node=self.node or pod.view.node_name)
            if not verdict.ok:
                waits = self._waits(pod.uid, share.container, verdict)
                message = verdict.message if waits or verdict.reason != Reason.KEY_UNKNOWN \
                    else f"{verdict.message} (refused after {self.key_wait_seconds:g} s)"
                failed[share.container] = (verdict.reason, message, waits)
        if not failed:
            return []
        # One bad signature decides for the whole pod; only a pod whose every failure may
        # clear (a signature not there yet, a key not here yet) waits.
        final = not all(waits for _why, _message, waits in failed.values())
        first, (reason, _message, _waits) = next((name, f) for name, f in failed.items()
                                                 if not final or not f[2])
        sibling = ("failed its signature check" if final
                   else "is waiting for its signature")
        out = []
        for share in request.shares:
            why, message, waits = failed.get(share.container, (
                reason, f"not applied because container {first!r} of this pod {sibling}", False))
            if final and waits:
                why, message = reason, (f"not applied because container {first!r} of this "
                                        f"pod failed its signature check ({message})")
            out.append(Refusal(key=ContainerKey(pod.uid, share.container),
                               pod_namespace=pod.view.namespace, pod_name=pod.view.name,
                               reason=Reason(why), message=message, final=final))
            # A pending one is logged at info: it is retried every pass until it is signed.
            log.log(logging.WARNING if final else logging.INFO, "pod %s/%s container %s %s: "
                    "%s: %s", pod.view.namespace, pod.view.name, share.container,
                    "refused" if final else "pending", why, message)
        return out

    def _waits(self, uid: str, container: str, verdict: Verification) -> bool:
        """Whether this failure may still clear: a missing signature always may (the follower
        signs later), an unknown key for `key_wait_seconds` after it was first seen."""
        if verdict.reason == Reason.MISSING:
            return True
        if verdict.reason != Reason.KEY_UNKNOWN:
            return False
        since = self._unknown_since.setdefault((uid, container, verdict.kid), self.monotonic())
        return self.monotonic() - since < self.key_wait_seconds


def kept_limits(engine: Engine, inventory: Inventory, uids: Collection[str]
                ) -> tuple[tuple[LimitTarget, ...], frozenset[tuple[str, str]]]:
    """The memory limits in force on the cgroups of `uids` (pod slices and below), as targets
    the engine keeps instead of sweeping them; and the (GPU, cgroup) pairs whose limit could
    not be read, which the engine must leave as they are (a read that failed once must not
    let the sweep clear a refused pod's limit)."""
    if not uids:
        return (), frozenset()
    gpus = [d.uuid for d in inventory.devices if not d.mig_enabled]
    pods = [pc for pc in engine.layout.scan(engine.cgroup_fs) if pc.uid in uids]
    try:
        if not engine.limits.supported():
            return (), frozenset()
    except NvmlError as e:
        log.warning("cannot tell whether GPU memory limits are in force (%s): %s; the limits "
                    "of refused pods are left as they are", e.reason, e.message)
        return (), frozenset((uuid, path) for pc in pods for path in (pc.path, *pc.children)
                             for uuid in gpus)
    out: list[LimitTarget] = []
    unread: set[tuple[str, str]] = set()
    for pc in pods:
        for path in (pc.path, *pc.children):
            for uuid in gpus:
                try:
                    got = engine.limits.read(uuid, path)
                except NvmlError as e:
                    log.warning("cannot read the GPU memory limit on %s (%s): %s; it is left "
                                "as it is", path, e.reason, e.message)
                    unread.add((uuid, path))
                    continue
                if not got.cleared:
                    out.append(LimitTarget(gpu_uuid=uuid, path=path, soft=got.soft,
                                           hard=got.hard, pod_uid=pc.uid, container=None))
    return tuple(out), frozenset(unread)


def with_kept_limits(desired: DesiredState, kept: tuple[Sequence[LimitTarget],
                                                        frozenset[tuple[str, str]]]
                     ) -> DesiredState:
    """The desired state plus what `kept_limits` keeps for refused pods."""
    keep, unread = kept
    if not keep and not unread:
        return desired
    return dataclasses.replace(desired, limits=desired.limits + tuple(keep),
                               unread=desired.unread | unread)
