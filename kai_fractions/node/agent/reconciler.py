"""One reconcile pass of the node agent, and the other calls of its worker thread (watchdog
checks, Provision, Release, Drain), each delegated to the module that owns the work. NOT
thread-safe: only the worker thread calls into a `Reconciler`.

A pass: supervise the MPS daemon (`mps_supervisor`), take the NVML inventory, plan the node from
every live pod (`pods`: watched or provisioned, minus what was released, applied plans held),
remove what belongs to pods that went away (their markers before their limits), apply
(`kai_fractions.node.engine`), make the legacy MPS pipe links (`mps_links`), run the watchdog
check first where the pass would otherwise vouch for a container whose only memory tier is the
watchdog on a GPU no check has judged with it (`_watchdog_blind`), report pending each
container whose only memory tier is a watchdog that cannot see its GPU
(`usage.UsageCheck.blind_results`: WatchdogBlind, a cap known not in force), settle each
fractional pod (`markers`: derived annotations, then the readiness marker, then events), report
pending the applied containers of a pod left with no marker to read because one could not be
written (`markers.pending_results`: MarkerNotWritten, AnnotationsNotWritten), tidy marker
directories and links, and publish metrics and the snapshot read by gRPC and the node
condition.

Before the first successful pod list nothing is applied: an apply without the node's pods would
clear the limits of every running one. Likewise after a list from the API server's watch cache
that lacks pods the agent knew or holds markers for, until a consistent list confirms them gone
(`PodWatcher.confirm_absent`): a lagging cache must not clear a running pod's limits. While NVML
is down nothing is planned or written either (a pass cannot verify anything); markers of pods
that went away are still removed.

One thing comes before all of those early returns: an MPS control daemon known not running
(`MpsHealth.not_running`) took every cap that relies on it along, so the markers that vouch
for such caps are set aside at once (`set_aside_for_mps`), whether or not the pass goes on to
apply: from the last plan where there is one, from the markers themselves where there is none
(a fresh agent whose daemon cannot start, before its first full pass). So are they on a pass
that returns early while the daemon runs but was started by this agent since its last apply
(`_fresh_daemon`: a fresh agent after a crash, whose daemon died with it): it holds none of
them yet. A pass that applies on such a daemon takes those caps for gone before its apply
(`engine_mps.caps_not_on_daemon`), so one whose MPS step fails there (a busy daemon, a
timeout) reports them not in force and sets those markers aside too. Likewise a pass that
returns early sets aside the markers of containers whose only memory tier is the watchdog
where no watchdog check watches them (`set_aside_unwatched`), and
the agent's stop those of every such container, since the watchdog stops with it
(`set_aside_at_stop`); the next agent's first full pass runs a watchdog check, then writes them
again, or restores those the stop set aside for the watchdog alone as they were
(`_restore_stopped`: a container pending for an ordinary reason keeps its marker across a
healthy restart, as on a running agent).

Those set-aside and restore methods are the `Reconciler`'s through its mixin
`marker_set_aside.MarkerSetAside`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from ...marker import read_boot_id
from ..cgroups import CgroupFs
from ..config import NodeConfig, WatchdogPolicy
from ..desired import ContainerKey, DesiredState
from ..engine import ContainerResult, ContainerState, Engine
from ..engine_mps import caps_not_on_daemon
from ..errors import NodeError
from ..inventory import Inventory
from ..limit_ledger import FileLimitLedger
from ..mps.adoption import not_usable
from ..mps.errors import DAEMON_ALREADY_RUNNING
from ..mps_pinned import DAEMON_STARTED
from ..nvml import Nvml
from ..procfs import Procfs
from ..watchdog import Killer, SignalKiller, Watchdog
from .condition import Health, watchdog_sole_tier
from .events import EventRecorder
from .kube import ClusterWriter
from .marker_set_aside import MarkerSetAside, _planned_pods
from .markers import MarkerStore, MarkerWriter, NotWritten, may_restore, pending_results
from .metrics import AgentMetrics, Usage
from .mps_links import LegacyPipeLinks
from .mps_supervisor import MpsHealth, MpsSupervisor, drain
from .nvml_health import NvmlHealth
from .options import AgentOptions
from .pods import API, KnownPod, NodePods, without_released
from .signatures import SignatureCheck
from .usage import UsageCheck
from .watch import PodCache

BlindGpus = tuple[tuple[str, str], ...]
"""(GPU uuid, reason) of each GPU where the watchdog is some container's only memory tier and
cannot see the GPU's usage (`Health.watchdog_blind`)."""

NOT_LISTED = "NotListed"
UNCONFIRMED = "ListUnconfirmed"
"""A list from the watch cache lacks pods the agent had limits or markers for, and no
consistent list confirmed them gone yet."""


@dataclass(frozen=True, slots=True)
class NodeView:
    """What the last pass and watchdog check saw: read by gRPC without touching the GPUs."""

    inventory: Inventory | None = None
    desired: DesiredState | None = None
    results: Mapping[ContainerKey, ContainerResult] = field(
        default_factory=lambda: MappingProxyType({}))
    usage: Mapping[tuple[ContainerKey, str], Usage] = field(
        default_factory=lambda: MappingProxyType({}))
    usage_unknown: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    """GPU uuid -> reason of each GPU whose usage the last watchdog check could not read
    (`UsageCheck.blindness`): its containers have no usage row there, which is not 0."""
    pods: Mapping[str, KnownPod] = field(default_factory=lambda: MappingProxyType({}))
    health: Health = field(default_factory=Health)
    watchdog_stops: bool = False
    """The watchdog stops what exceeds a cap (`--watchdog-policy=kill`): only then is it a limit
    in force; in report mode it is a second line that reports."""


class NotReconciled(NodeError):
    """A call's pass could not apply anything (the pods not listed yet, NVML down): what it
    asked for is not in force, and may be once a pass runs."""


@dataclass(frozen=True, slots=True)
class PassReport:
    converged: bool
    """Nothing pending and nothing to retry: the worker waits for the next change."""
    errors: frozenset[str] = frozenset()
    """Reasons of what went wrong this pass (metrics count each once)."""
    applied: bool = False
    """An apply ran (NVML up and the pods listed)."""


class Reconciler(MarkerSetAside):
    def __init__(self, *, config: NodeConfig, options: AgentOptions, nvml: Nvml,
                 cgroup_fs: CgroupFs, pods: PodCache, mps: MpsSupervisor | None = None,
                 cluster: ClusterWriter | None = None, events: EventRecorder | None = None,
                 metrics: AgentMetrics | None = None, procfs: Procfs | None = None,
                 killer: Killer | None = None, clock: Callable[[], float] = time.time,
                 signatures: SignatureCheck | None = None,
                 confirm_absent: Callable[[set[str], int], bool] | None = None):
        """`signatures` None: allocations are applied unsigned (no `--signing-key-file`).
        `confirm_absent`: `PodWatcher.confirm_absent`, asked when a list from the watch cache
        lacks pods the agent knew (None: such pods are never confirmed, nothing is cleared)."""
        self.confirm_absent = confirm_absent
        self.config = config
        self.options = options
        self.nvml = nvml
        self.cgroup_fs = cgroup_fs
        self.mps = mps if config.sm_sharing else None
        self.events = events or EventRecorder(cluster, config.node_name, clock)
        self.metrics = metrics or AgentMetrics(config.node_name)
        self.procfs = procfs or Procfs(config.proc_root)
        self.clock = clock
        control = self.mps.control if self.mps is not None else None
        boot_id = read_boot_id(options.boot_id_file)
        self.engine = Engine(nvml, cgroup_fs, control, clock=clock, config=config,
                             ledger=FileLimitLedger(options.marker_dir, boot_id))
        self.mps_health = (MpsHealth(self.mps, self.metrics, self.engine.forget)
                           if self.mps is not None else None)
        self.markers = MarkerStore(options.marker_dir, boot_id)
        self._other_boots_forgotten = False
        self.writer = MarkerWriter(self.markers, keys=config.keys, cluster=cluster, pods=pods,
                                   events=self.events, clock=clock,
                                   watchdog_stops=config.watchdog_policy is WatchdogPolicy.KILL)
        self.pods = NodePods(pods, config=config, engine=self.engine, markers=self.markers,
                             events=self.events, signatures=signatures, clock=clock)
        self.links = LegacyPipeLinks(config.mps_pipe_dir) if config.sm_sharing else None
        self.usage = UsageCheck(nvml, Watchdog(config.watchdog_policy, self.procfs,
                                               killer or SignalKiller(
                                                   same_pid_namespace=self.procfs
                                                   .own_pid_namespace), control),
                                self.events, self.metrics)
        self.nvml_health = NvmlHealth(nvml)
        self.view = NodeView(watchdog_stops=config.watchdog_policy is WatchdogPolicy.KILL)
        self._metrics_inventory: Inventory | None = None
        """The last inventory the metrics were set from: while NVML is down the view has none,
        and the series of a pod deleted meanwhile still have to go (`_forget_usage`)."""
        self.passes = 0
        self._applied_on_start: int | None = None
        """The supervisor's `starts` at the last apply that ran with the daemon usable: a daemon
        this agent started after it holds nothing any apply made (`_fresh_daemon`)."""

    # -- the pass ---------------------------------------------------------------------------

    def mps_needs_pass(self) -> bool:
        """The worker's periodic MPS check (`MpsHealth.needs_pass`)."""
        return self.mps_health is not None and self.mps_health.needs_pass()

    def usage_needs_pass(self, now: float | None = None) -> bool:
        """Whether a watchdog check found the watchdog turn blind on a GPU, or see again
        (`UsageCheck.take_news`). `now`: the worker's monotonic time, so that its clock, not
        the system's, paces the news (None: `time.monotonic()`)."""
        return self.usage.take_news(now)

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
        if not self._other_boots_forgotten:  # before anything may keep or trust a marker
            self.markers.forget_other_boots()
            self._other_boots_forgotten = True
        if full:
            self.engine.forget()
        mps_namespaces, mps_error = (self.mps_health.check() if self.mps_health is not None
                                     else (None, None))
        if mps_error is not None:
            errors.add(mps_error.reason)
        if mps_error is not None and self.mps_health is not None and self.mps_health.not_running:
            # Before any return below (pods not listed, a list not confirmed, NVML down): the
            # caps went with the daemon whether or not this pass gets to apply.
            self.set_aside_for_mps(_not_running_cause(mps_error))
        inventory = self.nvml_health.take(mps_namespaces)
        if inventory is None and self.nvml_health.error is not None:
            errors.add(self.nvml_health.error.reason)
        if not self.pods.cache.synced:
            self._fresh_daemon()
            self.set_aside_unwatched(nvml_down=False)
            self._publish(inventory, mps_error, mps_namespaces, count=False)
            errors.add(NOT_LISTED)
            return PassReport(converged=False, errors=frozenset(errors))
        generation = self.pods.cache.generation  # read first: a later list is not vouched for
        live = self.pods.live()
        tidy = {"grace": self.options.marker_grace_seconds, "now": self.clock()}
        if not self.pods.cache.consistent:
            if not self._confirmed(live, tidy["now"], generation):
                self._fresh_daemon()
                self.set_aside_unwatched(nvml_down=False)
                self._publish(inventory, mps_error, mps_namespaces, count=False)
                errors.add(UNCONFIRMED)
                return PassReport(converged=False, errors=frozenset(errors))
            live = self.pods.live()  # with what the confirmation brought back
            if self.pods.cache.generation != generation:
                # Another list replaced the one confirmed while the consistent list was on its
                # way: what it lacks is unconfirmed. The next pass checks it.
                self._fresh_daemon()
                self.set_aside_unwatched(nvml_down=False)
                self._publish(inventory, mps_error, mps_namespaces, count=False)
                errors.add(UNCONFIRMED)
                return PassReport(converged=False, errors=frozenset(errors))
        self.markers.remove_leftovers()
        if inventory is None:
            self._fresh_daemon()
            self.set_aside_unwatched(nvml_down=True)
            self.pods.drop_gone(live, errors, release=False)
            self.markers.tidy(set(live), None, **tidy)  # which pods are fractional is unknown
            self._forget_usage(live)
            self._publish(None, mps_error, mps_namespaces, unverified=self.nvml_health.error)
            return PassReport(converged=False, errors=frozenset(errors))

        desired = self.pods.plan(live, inventory, errors)
        # Markers go before the limits they vouch for: a gone pod's marker, then its release;
        # markers of pods this agent never knew (gone while no agent ran) before the apply,
        # whose sweep clears their limits.
        self.pods.drop_gone(live, errors, release=True)
        self.markers.tidy(set(live), None, **tidy)

        if self._daemon_new():
            # Whatever the apply fails at (a busy daemon, a timeout), the caps it put on the
            # daemon before are not on this one: reported not in force until put back.
            caps_not_on_daemon(self.engine, desired, DAEMON_STARTED)
        report = self.engine.apply(
            desired, mps_down=mps_error,
            mps_not_running=self.mps_health is not None and self.mps_health.not_running)
        if self.mps is not None and mps_error is None:
            self._applied_on_start = self.mps.starts
        inventory = inventory.with_compute_modes(report.compute_modes_set)
        errors.update(i.reason for i in report.issues)
        results = dict(report.containers)
        if self.links is not None:
            results = self.links.link_applied(desired, results, errors)
        # Markers the last agent's stop set aside for the watchdog alone: they may come back
        # once this pass's watchdog check watches their pods (`_restore_stopped`).
        by_pod = _by_pod(results)
        stopped = {uid: m for uid in by_pod
                   if (m := self.markers.stopped_for_watchdog(uid)) is not None}
        restorable = {uid for uid, m in stopped.items() if may_restore(m, by_pod[uid])}
        results, blind = self._watchdog_blind(desired, inventory, results, restorable)
        by_pod = _by_pod(results)
        converged = report.converged
        not_written: dict[str, NotWritten] = {}
        for uid, pod_results in by_pod.items():
            manifest, source = live[uid]
            if uid in stopped:
                self._restore_stopped(uid, stopped[uid], pod_results, manifest)
            settled = self.writer.settle(uid, manifest, source == API, pod_results, desired,
                                         errors)
            converged = converged and settled.done
            if settled.not_written is not None:
                not_written[uid] = settled.not_written
        # An applied container whose gate has no marker to read is reported pending, in the
        # view and the metrics alike; the markers were decided from the engine's results.
        results = pending_results(results, not_written)
        errors.update(r.reason for r in results.values()
                      if r.state is ContainerState.PENDING and r.reason)
        self.pods.settled(live, by_pod)
        self.markers.tidy(set(live), set(by_pod), **tidy)
        self.pods.plan_change_events(desired)
        self.events.flush()
        if self.links is not None:
            self.links.tidy(desired)
        self.metrics.count_states(r.state for r in results.values())
        self.metrics.count_caps(results.values())
        self.metrics.update(desired, self.view.usage, inventory)
        self._metrics_inventory = inventory
        self.view = NodeView(inventory=inventory, desired=desired,
                             results=MappingProxyType(results), usage=self.view.usage,
                             usage_unknown=self.view.usage_unknown,
                             pods=MappingProxyType(dict(self.pods.known)),
                             health=self._health(inventory, mps_error, mps_namespaces, 1,
                                                 watchdog_blind=blind),
                             watchdog_stops=self.view.watchdog_stops)
        pending = any(r.state is ContainerState.PENDING for r in results.values())
        return PassReport(converged=converged and not pending and not errors,
                          errors=frozenset(errors), applied=True)

    def _confirmed(self, live: Mapping[str, object], now: float, generation: int) -> bool:
        """Whether the pods a list from the watch cache lacks may be taken for gone: those the
        agent knew, and those with a marker here (a restarted agent knew none), are, once a
        consistent list agrees. A lagging watch cache would otherwise have their limits and
        markers cleared while they run, until the watch brought them back. A list that lacks
        none of them is as good as a consistent one: the cache is marked so, and a pod the
        watch removes later (its events are newer than any list) costs no confirmation."""
        absent = {uid for uid in self.pods.known if uid not in live}
        absent.update(self.markers.stale_dirs(set(live), grace=math.inf, now=now))
        if not absent:
            self.pods.cache.confirm(generation, [])
            return True
        return self.confirm_absent is not None and self.confirm_absent(absent, generation)

    def _forget_usage(self, live: Mapping[str, object]) -> None:
        """While NVML does not work no check reads usage (it needs the inventory), and the last
        check's could be long over (a process that ended): the gauges and GetNodeState read 0,
        as for a GPU whose processes cannot be listed, until a check reads it again. No pass
        plans meanwhile either: a pod deleted meanwhile leaves the last plan, and its series
        go, as after any pass."""
        desired = self.view.desired
        gone = {(uid, None) for uid in _planned_pods(desired) if uid not in live}
        if not self.view.usage and not gone:
            return
        if desired is not None and gone:
            desired = without_released(desired, gone)
        if desired is not None and self._metrics_inventory is not None:
            self.metrics.update(desired, {}, self._metrics_inventory)
        self.view = dataclasses.replace(self.view, desired=desired, usage=MappingProxyType({}))

    def _watchdog_blind(self, desired: DesiredState, inventory: Inventory,
                        results: dict[ContainerKey, ContainerResult],
                        restorable: Collection[str] = ()
                        ) -> tuple[dict[ContainerKey, ContainerResult], BlindGpus]:
        """`UsageCheck.blind_results`: each container whose only memory tier is the watchdog,
        on a GPU where the watchdog is blind, pending under WatchdogBlind; and the (GPU uuid,
        reason) of each GPU the node condition names: those GPUs, and, where the watchdog would
        be the only memory tier of a time-slicing container placed on the node now
        (`condition.watchdog_sole_tier`), every GPU where it is blind, with a container or not.

        A pass never vouches for a watchdog-only container on a GPU that no check has judged
        with it planned (`BlindnessTracker.unjudged`: a restarted agent, a pod new on a GPU),
        nor restores a marker of the `restorable` pods (`_restore_stopped`: their containers
        count as vouched for, pending ones too), nor calls such a node ready before any check
        ran: it runs the watchdog check first,
        the one the worker schedules (same metrics, events and stops; the worker counts it as
        the next scheduled one), over this pass's plan. A check that raises fails the pass,
        which then vouches for nothing."""
        stops = self.view.watchdog_stops
        sole = stops and watchdog_sole_tier(self.config, inventory)
        vouched = results if not restorable else {
            k: dataclasses.replace(r, state=ContainerState.APPLIED) if k.pod_uid in restorable
            else r for k, r in results.items()}
        if (self.usage.sight.unjudged(desired, vouched, inventory, stops)
                or (sole and self.usage.checks == 0)):
            self._checked(self.usage.check(desired, inventory))
        results, gpus = self.usage.blind_results(desired, results, stops)
        if sole:
            gpus.update((u, b.reason) for u, b in self.usage.blindness().items()
                        if inventory.device(u) is not None)
        self.usage.news = False  # this pass reports what the checks found
        return results, tuple(sorted(gpus.items()))

    def _health(self, inventory: Inventory | None, mps_error: NodeError | None,
                mps_namespaces: bool | None, bump: int,
                watchdog_blind: BlindGpus | None = None) -> Health:
        """`watchdog_blind` None: as the last pass that applied found it. The GPUs known in
        the wrong compute mode, and those that take no memory limit, are the engine's
        (`Engine.wrong_mode`, `Engine.limits_not_settable`: only an apply changes them, and a
        pass that fails before it reaches them keeps them)."""
        return Health(inventory=inventory, nvml_error=self.nvml_health.error, mps_error=mps_error,
                      mps_namespaces=mps_namespaces, passes=self.view.health.passes + bump,
                      watchdog_blind=(self.view.health.watchdog_blind if watchdog_blind is None
                                      else watchdog_blind),
                      wrong_compute_mode=tuple(sorted(
                          (uuid, mode.name, error.reason)
                          for uuid, (mode, error) in self.engine.wrong_mode.items())),
                      limits_not_settable=tuple(sorted(
                          (uuid, error.reason, error.message)
                          for uuid, error in self.engine.limits_not_settable.items())))

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
                for k, r in results.items() if k.pod_uid in self.pods.known})
            self.metrics.count_states(r.state for r in results.values())
            self.metrics.count_caps(results.values())
        self.view = dataclasses.replace(
            self.view, inventory=inventory, results=results,
            pods=MappingProxyType(dict(self.pods.known)),
            health=self._health(inventory, mps_error, mps_namespaces, 1 if count else 0))

    # -- between passes -----------------------------------------------------------------------

    def check_usage(self) -> None:
        """One watchdog check (`usage`), over what the last pass planned. Without an
        inventory (NVML down) or a plan, the stops in progress still move on: they need no
        NVML, and SIGKILL is sent only there."""
        desired, inventory = self.view.desired, self.nvml_health.inventory
        if desired is None or inventory is None:
            self.usage.advance_stops(desired)
            return
        self._checked(self.usage.check(desired, inventory))

    def _checked(self, usage: Mapping[tuple[ContainerKey, str], Usage]) -> None:
        """A check's usage, and the GPUs whose usage it could not read, into the view."""
        self.view = dataclasses.replace(self.view, usage=usage, usage_unknown=MappingProxyType(
            {uuid: b.reason for uuid, b in self.usage.unreadable().items()}))

    def provision(self, namespace: str, name: str, uid: str, annotations: Mapping[str, str],
                  containers: Sequence[str], init_containers: Sequence[str] = ()
                  ) -> list[ContainerKey]:
        """Adds a pod given by an integration (not read from the API) and reconciles; returns
        the keys of its fractional containers."""
        self.pods.provision(namespace, name, uid, annotations, containers, init_containers)
        report = self.reconcile()
        if not report.applied:
            # An empty answer would read as "no fractional container" (the proto's meaning).
            why = ", ".join(sorted(report.errors)) or "no pass ran"
            raise NotReconciled(
                f"pod {namespace}/{name} is provisioned, but no limit of it is in force yet: "
                f"the agent's pass could not apply ({why}); call again, or watch "
                "GetNodeState", reason=min(report.errors, default="NotReconciled"))
        return [k for k in self.view.results if k.pod_uid == uid]

    def release(self, uid: str, container: str | None = None) -> list[str]:
        """`NodePods.release`, then a pass. Raises NodeError when a limit or namespace could not
        be removed: the caller must not believe the pod unlimited while it may not be (the pod
        stays released, so the passes after remove it, and a repeated call is harmless)."""
        names, issues = self.pods.release(uid, container)
        self.reconcile()
        if issues:
            raise NodeError(
                f"pod {uid} is released, but not everything enforced for it could be removed "
                "yet (" + "; ".join(f"{i.reason}: {i.message}" for i in issues) + "); the "
                "agent's next passes remove the rest", reason=issues[0].reason)
        return names

    def drain(self, uid: str, container: str | None = None) -> list[int]:
        """`mps_supervisor.drain` over what the last pass planned."""
        desired = self.view.desired
        if desired is None or self.mps is None:
            return []
        return drain(self.mps.control, desired, self.nvml, self.procfs, uid, container)

    def close(self) -> None:
        """On shutdown, once the worker has stopped: closes the marker store and sets aside the
        markers of what stops with the agent (`set_aside_at_stop`), then stops the MPS control
        daemon if this agent started it (`MpsHealth.stop`) and shuts NVML down."""
        self.set_aside_at_stop()
        if self.mps_health is not None:
            self.mps_health.stop()
        self.nvml_health.shutdown()

    def abandon(self) -> list[str]:
        """On shutdown when the worker did not finish its task within the stop's bound (a pass
        stuck on NVML or the MPS control, say): the daemon and NVML are left as they are (the
        worker may still be in them), but a daemon this agent started runs in its container and
        dies with it all the same, and so does the watchdog: their markers are set aside as at
        a clean stop (`set_aside_at_stop`: the store closed first, so the stuck pass, should it
        end, writes none of them back). Called from another thread than the worker's: it
        touches only the marker files and reads the last plan. Returns the pods' uids."""
        return self.set_aside_at_stop()


def _by_pod(results: Mapping[ContainerKey, ContainerResult]
            ) -> dict[str, dict[str, ContainerResult]]:
    """Pod uid -> container name -> result."""
    by_pod: dict[str, dict[str, ContainerResult]] = {}
    for key, result in results.items():
        by_pod.setdefault(key.pod_uid, {})[key.container] = result
    return by_pod


def _not_running_cause(error: NodeError) -> str:
    if error.reason == DAEMON_ALREADY_RUNNING:  # runs, but not adopted: holds nothing of ours
        return (f"{not_usable(error)}, so none of the namespaces, active-thread percentages and "
                "default pinned limits the agent set is on it (a gate of the pod waits); the "
                "marker is written again once a daemon the agent uses runs and they are "
                "applied again")
    return (f"the MPS control daemon is not running ({error.reason}: {error.message}), and "
            "its namespaces, their active-thread percentages and its default pinned limits "
            "went with it (a gate of the pod waits); the marker is written again once a "
            "daemon runs and they are applied again")

