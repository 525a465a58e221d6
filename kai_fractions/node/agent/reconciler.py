"""One reconcile pass, and the other GPU-side work of the agent (watchdog checks, Provision,
Release, Drain). NOT thread-safe: only the worker thread calls into a `Reconciler`.

A pass: supervise the MPS daemon, take the NVML inventory, plan the node from every live pod
(watched or provisioned, minus what was released), release the pods that went away, apply, make
the legacy MPS pipe links, then settle each fractional pod: its derived annotations (patched when
following an unmodified KAI), its readiness marker and its events. Finally remove what belongs
to no live pod (marker directories, links) and refresh metrics and the snapshot read by gRPC
and the node condition.

Before the first successful pod list nothing is applied: an apply without the node's pods would
clear the limits of every running one. While NVML is down nothing is planned or written either
(a pass cannot verify anything); markers of pods that went away are still removed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol

from ...contract import ContainerPlan, derived_annotations
from ..applied import applied_plans, has_recorded_plans
from ..cgroups import CgroupFs
from ..config import Mechanism, NodeConfig
from ..desired import (
    ComputeEnforcement,
    ContainerDesired,
    ContainerKey,
    DesiredState,
    NodePod,
    RefusalReason,
    plan_node,
)
from ..engine import ContainerResult, ContainerState, Engine, MpsControlLike
from ..errors import NodeError, NvmlError
from ..inventory import Inventory, take_inventory
from ..mps import errors as mps_errors
from ..mps.errors import MpsError
from ..nvml import Nvml
from ..procfs import Procfs, normalize_container_id
from ..watchdog import (
    KILLED,
    TERMINATE,
    TERMINATED,
    Killer,
    ManagedContainer,
    SignalKiller,
    Watchdog,
)
from . import events as ev
from .condition import Health
from .events import EventRecorder, PodRef
from .kube import ClusterWriter, Conflict, KubeError, NotFound
from .markers import MarkerStore, decide, still_valid
from .metrics import AgentMetrics, Usage
from .mps_links import LegacyPipeLinks
from .options import AgentOptions
from .signatures import SignatureCheck, kept_limits, with_kept_limits
from .watch import PodCache

log = logging.getLogger(__name__)

API = "api"
PROVISIONED = "provisioned"
CRASH_BEFORE_MARKER = "before-marker"
"""Test hook point: after the limits are applied, before the marker is written."""

ANNOTATIONS_NOT_WRITTEN = "AnnotationsNotWritten"
MARKER_NOT_WRITTEN = "MarkerNotWritten"
NOT_LISTED = "NotListed"
LEGACY_MPS_NOTE = ("compute cap through the client's CUDA_MPS_ACTIVE_THREAD_PERCENTAGE only: this "
                   "MPS daemon has no namespaces (driver before r615), so it is not enforced by "
                   "the daemon")


class MpsSupervisor(Protocol):
    """`kai_fractions.node.mps.MpsDaemon` (and `fakes.FakeMpsSupervisor`)."""

    control: Any
    restarts: int
    last_error: MpsError | None
    on_restart: Any

    def ensure_running(self) -> bool: ...
    def healthy(self) -> bool: ...
    def stop(self, grace: float | None = None) -> bool: ...


@dataclass(frozen=True, slots=True)
class KnownPod:
    namespace: str
    name: str
    source: str
    containers: tuple[str, ...]
    """Its fractional containers (planned or refused)."""


@dataclass(frozen=True, slots=True)
class NodeView:
    """What the last pass and watchdog check saw: read by gRPC without touching the GPUs."""

    inventory: Inventory | None = None
    desired: DesiredState | None = None
    results: Mapping[ContainerKey, ContainerResult] = field(
        default_factory=lambda: MappingProxyType({}))
    usage: Mapping[tuple[ContainerKey, str], Usage] = field(
        default_factory=lambda: MappingProxyType({}))
    pods: Mapping[str, KnownPod] = field(default_factory=lambda: MappingProxyType({}))
    health: Health = field(default_factory=Health)


@dataclass(frozen=True, slots=True)
class PassReport:
    converged: bool
    """Nothing pending and nothing to retry: the worker waits for the next change."""
    errors: frozenset[str] = frozenset()
    """Reasons of what went wrong this pass (metrics count each once)."""
    applied: bool = False
    """An apply ran (NVML up and the pods listed)."""


def without_released(desired: DesiredState,
                     released: set[tuple[str, str | None]]) -> DesiredState:
    """The desired state minus released pods and containers (until the pod goes away).

    A pod-level cgroup limit (the pod's slice) stays while any of the pod's cgroup-limited
    containers does (KAI allows one fractional container per pod, so it is that one's)."""
    if not released:
        return desired

    def gone(key: ContainerKey) -> bool:
        return (key.pod_uid, None) in released or (key.pod_uid, key.container) in released

    containers = tuple(c for c in desired.containers if not gone(c.key))
    limited = {c.key.pod_uid for c in containers if Mechanism.CGROUP in c.mechanisms}
    limits = tuple(t for t in desired.limits
                   if (t.pod_uid in limited if t.container is None
                       else not gone(ContainerKey(t.pod_uid, t.container))))
    gpus = tuple(dataclasses.replace(g, containers=tuple(k for k in g.containers if not gone(k)))
                 for g in desired.gpus)
    return dataclasses.replace(
        desired, containers=containers, limits=limits, gpus=gpus,
        refusals=tuple(r for r in desired.refusals if not gone(r.key)))


def _meta(manifest: Mapping[str, Any]) -> Mapping[str, Any]:
    return manifest.get("metadata") or {}


def _terminal(manifest: Mapping[str, Any]) -> bool:
    return str((manifest.get("status") or {}).get("phase") or "") in ("Succeeded", "Failed")


class Reconciler:
    def __init__(
        self,
        *,
        config: NodeConfig,
        options: AgentOptions,
        nvml: Nvml,
        cgroup_fs: CgroupFs,
        pods: PodCache,
        mps: MpsSupervisor | None = None,
        cluster: ClusterWriter | None = None,
        events: EventRecorder | None = None,
        metrics: AgentMetrics | None = None,
        procfs: Procfs | None = None,
        killer: Killer | None = None,
        clock: Callable[[], float] = time.time,
        hook: Callable[[str], None] = lambda point: None,
        signatures: SignatureCheck | None = None,
    ):
        self.config = config
        self.signatures = signatures
        """None: allocations are applied unsigned (`--signing-key-file` not given)."""
        self.options = options
        self.nvml = nvml
        self.cgroup_fs = cgroup_fs
        self.pods = pods
        self.mps = mps if config.sm_sharing else None
        self.cluster = cluster
        self.events = events or EventRecorder(cluster, config.node_name, clock)
        self.metrics = metrics or AgentMetrics(config.node_name)
        self.procfs = procfs or Procfs(config.proc_root)
        self.clock = clock
        self.hook = hook
        control: MpsControlLike | None = self.mps.control if self.mps is not None else None
        self.engine = Engine(nvml, cgroup_fs, control, clock=clock, config=config)
        if self.mps is not None:
            # A daemon that was restarted knows nothing; the pass that restarted it applies
            # everything again, and the engine must not trust what it cached.
            self.mps.on_restart = lambda _control: self.engine.forget()
        self.markers = MarkerStore(options.marker_dir)
        self.links = LegacyPipeLinks(config.mps_pipe_dir) if config.sm_sharing else None
        self.watchdog = Watchdog(config.watchdog_policy, self.procfs, killer or SignalKiller(),
                                 control)
        self.provisioned: dict[str, dict[str, Any]] = {}
        self.released: set[tuple[str, str | None]] = set()
        self.known: dict[str, KnownPod] = {}
        self.view = NodeView()
        self.passes = 0
        self.mps_owned = False
        """Whether this agent started the MPS control daemon (only then it stops it)."""
        self._mps_seen = False
        self._mps_restarts = 0
        self._mps_state: str | None = None  # the daemon's error reason the last pass saw
        self._util_since: dict[str, int] = {}
        self._nvml_error: NodeError | None = None
        self._inventory: Inventory | None = None

    # -- health -----------------------------------------------------------------------------

    def _check_mps(self) -> tuple[bool | None, NodeError | None]:
        """(has v3 namespaces, why the daemon is unusable) for sm-sharing; (None, None) else."""
        if self.mps is None:
            return None, None
        error: NodeError | None = None
        try:
            if not self._mps_seen:
                # A daemon that already answers was started by someone else (or by an agent
                # before a restart): adopted, and left running on shutdown.
                self.mps_owned = not self.mps.healthy()
                self._mps_seen = True
            if not self.mps.ensure_running():
                error = self.mps.last_error or MpsError(
                    mps_errors.MPS_DAEMON_UNREACHABLE, "the MPS control daemon does not answer")
        except MpsError as e:
            error = e
        except OSError as e:  # its pipe or log directory cannot be made
            error = MpsError(mps_errors.MPS_DAEMON_UNREACHABLE,
                             f"the MPS control daemon cannot be started: {e}; check "
                             "--mps-pipe-dir and --mps-log-dir")
        if self.mps.restarts > self._mps_restarts:
            self.metrics.mps_restarts.inc(self.mps.restarts - self._mps_restarts)
            self._mps_restarts = self.mps.restarts
            self.mps_owned = True
            log.warning("the MPS control daemon was restarted; its state is applied again")
        try:
            v3 = bool(self.mps.control.supports_protocol_v3())
        except MpsError as e:
            return False, error or e
        return v3, error

    def _take_inventory(self, mps_namespaces: bool | None) -> Inventory | None:
        try:
            self.nvml.init()
            inventory = take_inventory(self.nvml, mps_namespaces=mps_namespaces)
        except NvmlError as e:
            if self._nvml_error is None or self._nvml_error.message != e.message:
                log.error("NVML does not work (%s): %s", e.reason, e.message)
            self._nvml_error = e
            self._inventory = None
            with contextlib.suppress(NvmlError):  # from scratch next time (the driver may return)
                self.nvml.shutdown()
            return None
        if self._nvml_error is not None:
            log.info("NVML works again: %d GPU(s), driver %s", len(inventory.devices),
                     inventory.driver_version)
        self._nvml_error = None
        self._inventory = inventory
        return inventory

    # -- the pass ---------------------------------------------------------------------------

    def _manifests(self) -> dict[str, tuple[Mapping[str, Any], str]]:
        """Live pods by uid with their source; a watched pod wins over a provisioned one."""
        out: dict[str, tuple[Mapping[str, Any], str]] = {
            uid: (m, PROVISIONED) for uid, m in self.provisioned.items()}
        out.update({uid: (m, API) for uid, m in self.pods.snapshot().items()})
        return {uid: v for uid, v in out.items() if not _terminal(v[0])}

    def mps_needs_pass(self) -> bool:
        """The periodic MPS check: supervise the daemon (restart it if it died) and say whether
        a pass is needed, i.e. it was restarted (its state must be applied again) or its health
        changed since the last pass. A healthy daemon costs one control command, not a pass."""
        if self.mps is None:
            return False
        restarts = self._mps_restarts
        _, error = self._check_mps()
        state = error.reason if error is not None else None
        return self._mps_restarts != restarts or state != self._mps_state

    def reconcile(self, *, full: bool = False) -> PassReport:
        started = time.monotonic()
        try:
            report = self._reconcile(full)
        finally:
            self.metrics.reconcile_duration.observe(time.monotonic() - started)
        for reason in report.errors:
            self.metrics.reconcile_errors.labels(reason).inc()
        self.passes += 1
        return report

    def _reconcile(self, full: bool) -> PassReport:
        errors: set[str] = set()
        if full:
            self.engine.forget()
        mps_namespaces, mps_error = self._check_mps()
        self._mps_state = mps_error.reason if mps_error is not None else None
        if mps_error is not None:
            errors.add(mps_error.reason)
        inventory = self._take_inventory(mps_namespaces)
        if inventory is None and self._nvml_error is not None:
            errors.add(self._nvml_error.reason)
        if not self.pods.synced:
            self._publish(inventory, mps_error, mps_namespaces, count=False)
            errors.add(NOT_LISTED)
            return PassReport(converged=False, errors=frozenset(errors))
        manifests = self._manifests()
        gone = [uid for uid in self.known if uid not in manifests]
        self.released = {r for r in self.released if r[0] in manifests}
        if inventory is None:
            for uid in gone:
                self._forget(uid)
            self.known = {uid: k for uid, k in self.known.items() if uid in manifests}
            self._tidy(set(manifests), None)  # which pods are fractional is unknown now
            self._publish(None, mps_error, mps_namespaces, unverified=self._nvml_error)
            return PassReport(converged=False, errors=frozenset(errors))

        node_pods = []
        for uid, (manifest, _source) in manifests.items():
            try:
                node_pods.append(NodePod.from_manifest(manifest))
            except ValueError as e:  # a malformed object the API server should have refused
                log.error("pod %s cannot be read (%s); skipped", uid, e)
                errors.add("PodUnreadable")
        applied = self._applied(node_pods, manifests)
        screened = None
        if self.signatures is not None:
            screened = self.signatures.screen(node_pods, unchecked={
                uid for uid, (_m, source) in manifests.items() if source == PROVISIONED})
        desired = without_released(plan_node(
            node_pods, inventory, self.config, applied=applied,
            vetoes=screened.refusals if screened is not None else ()), self.released)
        if screened is not None and screened.refused_pods:
            # a refused pod that runs no applied plan keeps the limits the kernel holds
            held = {c.key.pod_uid for c in desired.containers}
            desired = with_kept_limits(desired, kept_limits(
                self.engine, inventory, screened.refused_pods - held))

        # Markers go before the limits they vouch for: a gone pod's marker first, then its
        # release; and markers of pods this agent never knew (gone while no agent ran) before
        # the apply, whose sweep clears their limits.
        for uid in gone:
            self._forget(uid)
            self._release_gone(uid, errors)
        self._tidy(set(manifests), None)

        report = self.engine.apply(desired)
        errors.update(i.reason for i in report.issues)
        results = self._with_links(desired, dict(report.containers), errors)
        by_pod: dict[str, dict[str, ContainerResult]] = {}
        for key, result in results.items():
            by_pod.setdefault(key.pod_uid, {})[key.container] = result
        converged = report.converged
        for uid, pod_results in by_pod.items():
            manifest, source = manifests[uid]
            if not self._settle(uid, manifest, source, pod_results, desired, errors):
                converged = False
        errors.update(r.reason for r in results.values()
                      if r.state is ContainerState.PENDING and r.reason)
        self.known = {uid: KnownPod(
            namespace=str(_meta(m).get("namespace") or ""), name=str(_meta(m).get("name") or ""),
            source=source, containers=tuple(sorted(by_pod.get(uid, {}))))
            for uid, (m, source) in manifests.items()}
        self._tidy(set(manifests), set(by_pod))
        self._plan_change_events(desired)
        self.events.flush()
        if self.links is not None:
            keep = {c.plan.mps_namespace for c in desired.containers
                    if c.compute is ComputeEnforcement.MPS_CLIENT_ENV and c.plan.mps_namespace}
            for name in self.links.sweep(keep):
                log.info("removed the MPS pipe link %s (no container uses it)", name)
        self.metrics.count_states(r.state for r in results.values())
        self.metrics.update(desired, self.view.usage, inventory)
        self.view = NodeView(inventory=inventory, desired=desired,
                             results=MappingProxyType(results), usage=self.view.usage,
                             pods=MappingProxyType(dict(self.known)),
                             health=self._health(inventory, mps_error, mps_namespaces, 1))
        pending = any(r.state is ContainerState.PENDING for r in results.values())
        return PassReport(converged=converged and not pending and not errors,
                          errors=frozenset(errors), applied=True)

    def _applied(self, pods: Sequence[NodePod], manifests: Mapping[str, tuple[Any, str]]
                 ) -> dict[ContainerKey, ContainerPlan]:
        """The plan each running container was applied with, from durable facts only: its
        pod's derived annotations and this node's marker (`kai_fractions.node.applied`).
        Provisioned pods are not held: whoever provisions them may change them."""
        keys = self.config.keys
        out: dict[ContainerKey, ContainerPlan] = {}
        for pod in pods:
            if manifests.get(pod.uid, (None, PROVISIONED))[1] != API \
                    or not has_recorded_plans(pod.view, keys):
                continue
            for name, plan in applied_plans(pod.view, self.markers.read(pod.uid), keys).items():
                out[ContainerKey(pod.uid, name)] = plan
        return out

    def _plan_change_events(self, desired: DesiredState) -> None:
        """One Warning per refused change; a change undone and made again is reported again."""
        now = set()
        for r in desired.refusals:
            if r.reason == RefusalReason.PLAN_CHANGE_REFUSED:
                key = (ev.PLAN_CHANGE_REFUSED, r.key, r.message)
                now.add(key)
                self.events.emit(PodRef(r.pod_namespace, r.pod_name, r.key.pod_uid), ev.WARNING,
                                 ev.PLAN_CHANGE_REFUSED, f"container {r.key.container}: "
                                 f"{r.message}", key=key)
        self.events.forget_matching(lambda k: isinstance(k, tuple) and len(k) == 3
                                    and k[0] == ev.PLAN_CHANGE_REFUSED and k not in now)

    def _health(self, inventory: Inventory | None, mps_error: NodeError | None,
                mps_namespaces: bool | None, bump: int) -> Health:
        return Health(inventory=inventory, nvml_error=self._nvml_error, mps_error=mps_error,
                      mps_namespaces=mps_namespaces, passes=self.view.health.passes + bump)

    def _publish(self, inventory: Inventory | None, mps_error: NodeError | None,
                 mps_namespaces: bool | None, *, count: bool = True,
                 unverified: NodeError | None = None) -> None:
        results = self.view.results
        if unverified is not None:
            # Nothing can be verified while NVML is down: what was applied is reported pending
            # (with the reason) rather than vouched for; gone pods drop out.
            results = MappingProxyType({
                k: (dataclasses.replace(r, state=ContainerState.PENDING, reason=unverified.reason,
                                        message=unverified.message)
                    if r.state is ContainerState.APPLIED else r)
                for k, r in results.items() if k.pod_uid in self.known})
            self.metrics.count_states(r.state for r in results.values())
        self.view = dataclasses.replace(
            self.view, inventory=inventory, results=results,
            pods=MappingProxyType(dict(self.known)),
            health=self._health(inventory, mps_error, mps_namespaces, 1 if count else 0))

    # -- releasing --------------------------------------------------------------------------

    def _release_gone(self, uid: str, errors: set[str]) -> None:
        known = self.known.get(uid)
        names = known.containers if known else ()
        report = self.engine.release(uid, container_names=names)
        for issue in report.issues:
            errors.add(issue.reason)
            log.warning("releasing pod %s: %s: %s", uid, issue.reason, issue.message)
        if report.cleared or report.namespaces_deleted:
            log.info("released pod %s (%s/%s): %d limit(s) cleared, MPS namespaces deleted: %s",
                     uid, known.namespace if known else "?", known.name if known else "?",
                     len(report.cleared), ", ".join(report.namespaces_deleted) or "none")

    def _forget(self, uid: str) -> None:
        """The pod is gone: its marker directory, events and metrics go too."""
        if self.markers.remove_pod(uid):
            log.info("removed the marker directory of gone pod %s", uid)
        self.events.forget_pod(uid)
        self.provisioned.pop(uid, None)

    def _tidy(self, live: set[str], fractional: set[str] | None) -> None:
        for uid in self.markers.stale_dirs(live, grace=self.options.marker_grace_seconds,
                                           now=self.clock()):
            if self.markers.remove_pod(uid):
                log.info("removed the marker directory of pod %s (no such pod on this node)",
                         uid)
        if fractional is None:
            return
        for uid in live - fractional:
            # no fractional container any more (annotations removed, or released): a marker
            # left from before must not keep vouching for limits
            if self.markers.read(uid) is not None and self.markers.unlink(uid):
                log.info("removed the marker of pod %s (it has no fractional container now)",
                         uid)

    # -- legacy MPS links --------------------------------------------------------------------

    def _with_links(self, desired: DesiredState, results: dict[ContainerKey, ContainerResult],
                    errors: set[str]) -> dict[ContainerKey, ContainerResult]:
        if self.links is None:
            return results
        for c in desired.containers:
            if c.compute is not ComputeEnforcement.MPS_CLIENT_ENV or not c.plan.mps_namespace:
                continue
            result = results.get(c.key)
            if result is None or result.state is not ContainerState.APPLIED:
                continue
            try:
                if self.links.ensure(c.plan.mps_namespace):
                    log.info("linked %s to the legacy MPS pipe directory for %s",
                             self.links.path(c.plan.mps_namespace), c.ref)
            except NodeError as e:
                errors.add(e.reason)
                results[c.key] = dataclasses.replace(result, state=ContainerState.PENDING,
                                                     reason=e.reason, message=e.message)
        return results

    # -- settling one pod -------------------------------------------------------------------

    def _settle(self, uid: str, manifest: Mapping[str, Any], source: str,
                results: Mapping[str, ContainerResult], desired: DesiredState,
                errors: set[str]) -> bool:
        """Annotations, marker and events of one fractional pod; True when settled."""
        meta = _meta(manifest)
        ref = PodRef(str(meta.get("namespace") or ""), str(meta.get("name") or ""), uid)
        decision = decide(results)
        existing = self.markers.read(uid)
        self._pending_events(ref, results)
        if decision.write is None:
            if existing is not None and not still_valid(existing, results):
                self.markers.unlink(uid)
                log.info("pod %s/%s: removed its marker (no longer the applied plan)",
                         ref.namespace, ref.name)
            return False
        refused = any(r.state is ContainerState.REFUSED for r in results.values())
        if not refused and source == API:
            plans = [c.plan for name in results
                     if (c := desired.container(ContainerKey(uid, name))) is not None]
            if not self._ensure_annotations(ref, manifest, plans, errors):
                return False
        if existing is None or dict(existing.containers) != dict(decision.write):
            self.hook(CRASH_BEFORE_MARKER)
            try:
                self.markers.write(uid, decision.write, now=self.clock())
            except OSError as e:
                errors.add(MARKER_NOT_WRITTEN)
                log.error("pod %s/%s: the readiness marker could not be written under %s: %s",
                          ref.namespace, ref.name, self.options.marker_dir, e)
                return False
            log.info("pod %s/%s: marker written (%s)", ref.namespace, ref.name, ", ".join(
                f"{n}={m.state.value}" for n, m in sorted(decision.write.items())))
            self._marker_events(ref, results)
        return True

    def _ensure_annotations(self, ref: PodRef, manifest: Mapping[str, Any],
                            plans: Sequence[Any], errors: set[str]) -> bool:
        """The derived annotations the workload's env (and the gate) read: patched onto the pod
        when the mirror did not write them (an unmodified KAI), before any marker."""
        have = _meta(manifest).get("annotations") or {}
        want: dict[str, str] = {}
        for plan in plans:
            want.update(derived_annotations(plan, self.config.keys))
        missing = {key: value for key, value in want.items() if have.get(key) != value}
        if not missing:
            return True
        if self.cluster is None:
            errors.add(ANNOTATIONS_NOT_WRITTEN)
            return False
        try:
            updated = self.cluster.patch_pod_annotations(ref.namespace, ref.name, ref.uid,
                                                         missing)
        except (NotFound, Conflict) as e:
            log.info("pod %s/%s changed under the agent (%s); waiting for the watch",
                     ref.namespace, ref.name, e.message)
            return False
        except KubeError as e:
            errors.add(ANNOTATIONS_NOT_WRITTEN)
            log.warning("pod %s/%s: derived annotations not written (%s); retried",
                        ref.namespace, ref.name, e.message)
            return False
        log.info("pod %s/%s: wrote %d derived annotation(s) (%s)", ref.namespace, ref.name,
                 len(missing), ", ".join(sorted(missing)))
        if isinstance(updated, dict) and updated.get("metadata"):
            self.pods.upsert(updated)
        return True

    def _pending_events(self, ref: PodRef, results: Mapping[str, ContainerResult]) -> None:
        """One event per container waiting for its signature (the follower signs after the
        binder's annotations land): its owner sees why the gate is still waiting."""
        for name, r in sorted(results.items()):
            if r.state is ContainerState.PENDING and r.reason == ev.SIGNATURE_MISSING:
                self.events.emit(ref, ev.WARNING, ev.SIGNATURE_MISSING,
                                 f"container {name}: waiting for its signature: {r.message}",
                                 key=(ev.SIGNATURE_MISSING, ref.uid, name))

    def _marker_events(self, ref: PodRef, results: Mapping[str, ContainerResult]) -> None:
        for name, r in sorted(results.items()):
            if r.state is ContainerState.APPLIED:
                self.events.emit(ref, ev.NORMAL, ev.APPLIED,
                                 f"container {name}: GPU limits in force (plan {r.plan_digest})",
                                 key=(ev.APPLIED, ref.uid, name, r.plan_digest))
            elif r.state is ContainerState.REFUSED:
                self.events.emit(ref, ev.WARNING, ev.REFUSED,
                                 f"container {name}: {r.reason}: {r.message}",
                                 key=(ev.REFUSED, ref.uid, name, r.reason, r.message))

    # -- watchdog ---------------------------------------------------------------------------

    def check_usage(self) -> None:
        """One watchdog check: usage per container (metrics, GetNodeState), and the violations
        by policy (events; in kill mode the watchdog drains and stops the process)."""
        desired, inventory = self.view.desired, self._inventory
        if desired is None or inventory is None:
            return
        managed = []
        for c in desired.containers:
            caps = (dict.fromkeys(c.plan.device_uuids, c.plan.limit_bytes)
                    if Mechanism.WATCHDOG in c.mechanisms else {})
            managed.append(ManagedContainer(c.key.pod_uid, c.key.container, c.container_id,
                                            MappingProxyType(caps)))
        processes: dict[str, Any] = {}
        sm: dict[int, int] = {}
        for d in inventory.devices:
            try:
                processes[d.uuid] = self.nvml.running_processes(d.uuid)
            except NvmlError as e:
                log.debug("running processes of %s: %s", d.uuid, e)
                continue
            try:
                samples = self.nvml.process_utilization(d.uuid, self._util_since.get(d.uuid, 0))
            except NvmlError:
                samples = ()
            latest: dict[int, tuple[int, int]] = {}
            for s in samples:
                if s.pid not in latest or s.timestamp_us >= latest[s.pid][0]:
                    latest[s.pid] = (s.timestamp_us, s.sm_percent)
                self._util_since[d.uuid] = max(self._util_since.get(d.uuid, 0), s.timestamp_us)
            sm.update({pid: pct for pid, (_ts, pct) in latest.items()})
        report = self.watchdog.check(processes, managed, sm)
        usage = {(ContainerKey(u.pod_uid, u.container_name), u.device_uuid):
                 Usage(u.used_bytes, u.sm_percent) for u in report.usage}
        self.view = dataclasses.replace(self.view, usage=MappingProxyType(usage))
        self.metrics.update(desired, usage, inventory)
        self.metrics.count_violations(report.violations)
        self._violation_events(desired, report)

    def _violation_events(self, desired: DesiredState, report: Any) -> None:
        refs = {c.key: PodRef(c.pod_namespace, c.pod_name, c.key.pod_uid)
                for c in desired.containers}
        now_violating = set()
        for v in report.violations:
            key = ContainerKey(v.pod_uid, v.container_name)
            ref = refs.get(key)
            if ref is None:
                continue
            dedup = (ev.LIMIT_VIOLATION, v.pod_uid, v.container_name, v.device_uuid)
            now_violating.add(dedup)
            if self.watchdog.policy == "report":
                self.events.emit(ref, ev.WARNING, ev.LIMIT_VIOLATION, v.message, key=dedup)
        # an episode ends when the usage is back under the cap: the next one is reported again
        self.events.forget_matching(lambda k: isinstance(k, tuple) and len(k) == 4
                                    and k[0] == ev.LIMIT_VIOLATION and k not in now_violating)
        for a in report.actions:
            if a.step != TERMINATE or a.outcome not in (TERMINATED, KILLED):
                continue
            ref = refs.get(ContainerKey(a.pod_uid, a.container_name))
            if ref is None:
                continue
            self.events.emit(
                ref, ev.WARNING, ev.LIMIT_ENFORCED,
                f"container {a.container_name}: process {a.pid} {a.outcome} for using more GPU "
                f"memory on {a.device_uuid} than its cap (drained from MPS first when it was "
                "a client)", key=(ev.LIMIT_ENFORCED, a.pod_uid, a.container_name, a.pid))

    # -- direct driving (gRPC) ----------------------------------------------------------------

    def provision(self, namespace: str, name: str, uid: str, annotations: Mapping[str, str],
                  containers: Sequence[str], init_containers: Sequence[str] = ()
                  ) -> list[ContainerKey]:
        """Adds a pod given by an integration (not read from the API) to the desired state and
        reconciles; returns the keys of its fractional containers."""
        qos = next((pc.qos.value for pc in self.engine.layout.scan(self.cgroup_fs)
                    if pc.uid == uid), "Burstable")
        self.provisioned[uid] = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "uid": uid,
                         "annotations": dict(annotations),
                         "creationTimestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                            time.gmtime(self.clock()))},
            "spec": {"nodeName": self.config.node_name,
                     "containers": [{"name": c} for c in containers],
                     "initContainers": [{"name": c} for c in init_containers]},
            "status": {"phase": "Running", "qosClass": qos},
        }
        self.released = {r for r in self.released if r[0] != uid}
        self.reconcile()
        return [k for k in self.view.results if k.pod_uid == uid]

    def release(self, uid: str, container: str | None = None) -> list[str]:
        """Removes what is enforced for a pod (or one container) and keeps it out of the desired
        state until the pod goes away (or is provisioned again)."""
        known = self.known.get(uid)
        names = list(known.containers) if known else []
        if container:
            names = [n for n in names if n == container]
        if uid in self.provisioned and not container:
            del self.provisioned[uid]
            self.markers.remove_pod(uid)
        else:
            self.released.add((uid, container or None))
            self.markers.unlink(uid)
        report = self.engine.release(uid, container or None, container_names=names)
        for issue in report.issues:
            log.warning("release of pod %s: %s: %s", uid, issue.reason, issue.message)
        self.reconcile()
        return names

    def drain(self, uid: str, container: str | None = None) -> list[int]:
        """Ends the MPS client work of the container's processes (`client terminate`); the
        processes themselves are left to their owners. Raises MpsError / NvmlError."""
        desired = self.view.desired
        if desired is None or self.mps is None:
            return []
        mine = [c for c in desired.containers if c.key.pod_uid == uid
                and (not container or c.key.container == container) and c.container_id]
        pids: list[int] = []
        for c in mine:
            want = (uid.lower(), normalize_container_id(c.container_id or ""))
            for uuid in c.plan.device_uuids:
                for p in self.nvml.running_processes(uuid):
                    owner = self.procfs.container_of(p.pid)
                    if owner is not None and (owner.pod_uid, owner.container_id) == want \
                            and p.pid not in pids:
                        pids.append(p.pid)
        if not pids:
            return []
        control = self.mps.control
        drained = []
        if control.supports_protocol_v3():
            clients = {int(cl.pid) for cl in control.client_list()}
            for pid in pids:
                if pid in clients:
                    control.client_terminate(pid)
                    drained.append(pid)
        else:
            servers = {}
            for server in control.get_server_list():
                for pid in control.get_client_list(server):
                    servers[pid] = server
            for pid in pids:
                if pid in servers:
                    control.terminate_client(servers[pid], pid)
                    drained.append(pid)
        return drained

    def containers_of(self, uid: str) -> Iterable[ContainerDesired]:
        desired = self.view.desired
        return [c for c in desired.containers if c.key.pod_uid == uid] if desired else []

    # -- shutdown ---------------------------------------------------------------------------

    def close(self, *, stop_mps: bool = True) -> None:
        if self.mps is not None and stop_mps and self.mps_owned:
            log.info("stopping the MPS control daemon this agent started")
            try:
                self.mps.stop()
            except MpsError as e:
                log.warning("MPS control daemon stop: %s", e.message)
        with contextlib.suppress(NvmlError):
            self.nvml.shutdown()
