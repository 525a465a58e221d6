"""KAI's NvFractions dependency, reported honestly: the `Ready` condition of the cluster-scoped
GpuFractioningConfig `default` follows the real readiness of our node agents' DaemonSet.

KAI's operator, in `global.gpuSharingMode=NvFractions`, reads that object and its `Ready`
condition and reports `DependenciesFulfilled=False` on its Config until it is `True` (upstream
KAI-Scheduler `pkg/operator/operands/gpu_sharing/gpu_sharing.go`). Upstream, the gpu-fractioning
operator writes it; where kai_fractions is the node side, the chart installs the object and the
mirror runs this reporter (`kai-fractions mirror --report-gpu-fractioning-config`).

`readiness` and `next_status` are pure (every case is tested on its own); `Reporter` reads the
DaemonSet, compares, and writes the status subresource only when something changed.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

from ..kube.client import MERGE_PATCH, Kube
from ..kube.errors import Conflict, KubeError, NotFound
from ..kube.objects import namespaced_path

log = logging.getLogger(__name__)

GROUP = "gpu-fractioning.kai.scheduler"
VERSION = "v1alpha1"
PLURAL = "gpufractioningconfigs"
NAME = "default"
"""KAI's operator reads exactly this object: cluster-scoped, named `default`."""
CONDITION = "Ready"

# Reasons (CamelCase, as metav1.Condition wants them).
ALL_READY = "AllNodeAgentsReady"
NOT_READY = "NodeAgentsNotReady"
ROLLING_OUT = "RolloutInProgress"
NO_AGENTS = "NoNodeAgents"
MISSING = "NodeAgentDaemonSetMissing"
UNREADABLE = "NodeAgentStatusUnavailable"


@dataclass(frozen=True)
class Rollout:
    """What the node agent DaemonSet's controller last reported about it."""

    desired: int
    ready: int
    updated: int
    generation: int | None = None
    observed_generation: int | None = None

    @classmethod
    def from_object(cls, obj: Mapping[str, Any]) -> Rollout:
        """From a DaemonSet as the API returns it; a status not yet written counts as zeros."""
        status = obj.get("status") or {}
        meta = obj.get("metadata") or {}
        return cls(desired=int(status.get("desiredNumberScheduled") or 0),
                   ready=int(status.get("numberReady") or 0),
                   updated=int(status.get("updatedNumberScheduled") or 0),
                   generation=meta.get("generation"),
                   observed_generation=status.get("observedGeneration"))


@dataclass(frozen=True)
class Readiness:
    """The `Ready` condition's status ("True", "False" or "Unknown"), reason and message."""

    status: str
    reason: str
    message: str


def readiness(rollout: Rollout | None, daemonset: str, error: str | None = None) -> Readiness:
    """The condition for `rollout` (None: the DaemonSet does not exist; `error`: it could not be
    read). True only when agents are scheduled and every one of them runs the current template
    and is ready: a rolling update or a crashing agent on one node keeps KAI waiting, as the
    gpu-fractioning operator's own aggregate does."""
    if error is not None:
        return Readiness("Unknown", UNREADABLE, f"cannot read node agent DaemonSet {daemonset}: "
                         f"{error}")
    if rollout is None:
        return Readiness("False", MISSING, f"node agent DaemonSet {daemonset} not found")
    counts = f"{rollout.ready}/{rollout.desired} node agents ready"
    if (rollout.generation is not None and rollout.observed_generation is not None
            and rollout.observed_generation < rollout.generation):
        return Readiness("False", ROLLING_OUT, f"{counts}; DaemonSet {daemonset} generation "
                         f"{rollout.generation} not yet observed by its controller")
    if rollout.desired <= 0:
        return Readiness("False", NO_AGENTS, f"{counts}: no node matches the node agent "
                         f"DaemonSet {daemonset}'s node selector and tolerations")
    if rollout.updated < rollout.desired:
        return Readiness("False", ROLLING_OUT,
                         f"{counts}, {rollout.updated}/{rollout.desired} updated")
    if rollout.ready < rollout.desired:
        return Readiness("False", NOT_READY, counts)
    return Readiness("True", ALL_READY, counts)


def next_status(current: Mapping[str, Any] | None, wanted: Readiness, generation: int | None,
                now: datetime.datetime) -> dict[str, Any] | None:
    """The status to write so that the object says `wanted`, or None when it already does.
    `lastTransitionTime` moves only when the condition's status changes (a new message alone
    keeps it); conditions of other types are kept as they are."""
    current = current or {}
    conditions = [c for c in current.get("conditions") or [] if isinstance(c, Mapping)]
    old = next((c for c in conditions if c.get("type") == CONDITION), None)
    condition: dict[str, Any] = {"type": CONDITION, "status": wanted.status,
                                 "reason": wanted.reason, "message": wanted.message}
    if generation is not None:
        condition["observedGeneration"] = generation
    if old is not None and old.get("status") == wanted.status and old.get("lastTransitionTime"):
        condition["lastTransitionTime"] = old["lastTransitionTime"]
    else:
        condition["lastTransitionTime"] = now.astimezone(datetime.UTC).strftime(
            "%Y-%m-%dT%H:%M:%SZ")
    unchanged = old is not None and all(old.get(k) == v for k, v in condition.items()) and (
        generation is None or current.get("observedGeneration") == generation)
    if unchanged:
        return None
    status: dict[str, Any] = {"conditions": [*(c for c in conditions
                                               if c.get("type") != CONDITION), condition]}
    if generation is not None:
        status["observedGeneration"] = generation
    return status


def _utc_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


class Reporter:
    """Re-evaluates the condition every `interval` seconds and writes it when it changed.

    A DaemonSet that cannot be read (an API error, not a 404) turns the condition Unknown only
    after `unknown_after` rounds in a row, so that one failed request does not make KAI's
    operator report a missing dependency. Errors are logged, never raised out of `run`."""

    def __init__(self, kube: Kube, daemonset_namespace: str, daemonset_name: str, *,
                 interval: float = 10.0, unknown_after: int = 3, request_timeout: float = 10.0,
                 now: Callable[[], datetime.datetime] = _utc_now) -> None:
        if interval <= 0:
            raise ValueError(f"interval must be positive, got {interval}")
        self.kube = kube
        self.namespace = daemonset_namespace
        self.name = daemonset_name
        self.interval = interval
        self.unknown_after = unknown_after
        self.request_timeout = request_timeout
        self.now = now
        self.failures = 0
        self._config_path = namespaced_path(GROUP, VERSION, PLURAL, None, NAME)

    @property
    def daemonset(self) -> str:
        return f"{self.namespace}/{self.name}"

    async def evaluate(self) -> Readiness | None:
        """The condition the DaemonSet calls for now, or None while a read failure is still
        too young to say Unknown."""
        what = f"read DaemonSet {self.daemonset}"
        try:
            obj = await self.kube.request(
                "GET", namespaced_path("apps", "v1", "daemonsets", self.namespace, self.name),
                what=what, timeout=self.request_timeout)
            rollout = Rollout.from_object(obj or {})
        except NotFound:
            self.failures = 0
            return readiness(None, self.daemonset)
        except KubeError as e:  # the server's answer, without the request it already names
            return self._unreadable(e.answer)
        except ValueError as e:  # a count that is not a number
            return self._unreadable(f"{type(e).__name__}: {e}")
        self.failures = 0
        return readiness(rollout, self.daemonset)

    def _unreadable(self, error: str) -> Readiness | None:
        self.failures += 1
        log.warning("reading node agent DaemonSet %s failed (%d in a row): %s",
                    self.daemonset, self.failures, error)
        if self.failures < self.unknown_after:
            return None
        return readiness(None, self.daemonset, error=error)

    async def report_once(self) -> bool:
        """One round: evaluate, compare with the object, write its status if it differs.
        True when it wrote."""
        wanted = await self.evaluate()
        if wanted is None:
            return False
        try:
            obj = await self.kube.request("GET", self._config_path,
                                          what=f"read GpuFractioningConfig {NAME}",
                                          timeout=self.request_timeout) or {}
            meta = obj.get("metadata") or {}
            status = next_status(obj.get("status"), wanted, meta.get("generation"), self.now())
            if status is None:
                return False
            body: dict[str, Any] = {"status": status}
            if meta.get("resourceVersion"):
                # Conditional: a replica that raced us makes this one 409 and re-read next round.
                body["metadata"] = {"resourceVersion": meta["resourceVersion"]}
            await self.kube.request("PATCH", f"{self._config_path}/status",
                                    what=f"write GpuFractioningConfig {NAME} status",
                                    body=body, content_type=MERGE_PATCH,
                                    timeout=self.request_timeout)
        except NotFound:
            log.warning("GpuFractioningConfig %s not found (%s.%s): KAI's operator reports "
                        "its NvFractions dependency missing until it exists; the chart "
                        "creates it", NAME, PLURAL, GROUP)
            return False
        except Conflict:
            log.info("GpuFractioningConfig %s changed while writing its status; "
                     "re-evaluating next round", NAME)
            return False
        except KubeError as e:
            log.warning("writing GpuFractioningConfig %s status failed: %s", NAME, e)
            return False
        log.info("GpuFractioningConfig %s: Ready=%s (%s: %s)", NAME, wanted.status,
                 wanted.reason, wanted.message)
        return True

    async def run(self) -> NoReturn:
        """Rounds until cancelled; nothing it meets ends it (the mirror keeps serving)."""
        while True:
            try:
                await self.report_once()
            except Exception:  # a bug here must not take the mirror's other work down
                log.exception("GpuFractioningConfig reporter round failed")
            await asyncio.sleep(self.interval)
