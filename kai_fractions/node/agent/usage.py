"""The watchdog check the worker runs between passes (`--watchdog-interval`): each fractional
container's GPU memory and SM use, and what the watchdog policy does about use over a cap.

The processes on each GPU come from NVML, all three of its listings (compute, graphics, MPS
compute: some drivers list an MPS client in the MPS listing only, and a graphics-only process is
in the graphics one only; each pid once, `watchdog.merge_listings`), and are matched to
containers through /proc (by the watchdog); SM use is the newest NVML sample per process since
the last check. The usage feeds the metrics and GetNodeState. A GPU whose compute listing fails
is not listed this check (blind, below); its graphics and MPS listings, where the driver lacks
them or the GPU does not support them, are no processes, and each is taken on its own
(`BlindnessTracker.other_processes`): a graphics listing that fails otherwise leaves the others
watched (logged once), an MPS listing that fails otherwise too, and blinds the GPU where
sm-sharing containers are planned (an MPS client some drivers list there only is not seen).

Use over a cap is counted, reported once per episode as a LimitViolation event in `report` mode
(an episode ends when the use is back under the cap), and in `kill` mode the watchdog drains the
process from MPS and stops it, with a LimitEnforced event on its pod; a stop that cannot proceed
(the drain or the signal failed) is a LimitViolation event too, once per episode, saying why. A
GPU whose processes cannot be listed in a check is not judged: its containers' episodes go on
as they were (neither ended nor started), and their usage is unknown (the gauges read 0, as
while NVML is down). Only containers whose plan has the watchdog mechanism are capped; the
others are observed. A running container refused because only a report-mode watchdog would
watch it (`DesiredState.watched`, after an upgrade to the rule that refuses such containers) is
still checked against its plan's cap: its use over it is reported, nothing of it is stopped.

Where the watchdog is blind (`blindness.BlindnessTracker`: a GPU whose processes cannot be
listed, or whose MPS client listing fails where sm-sharing containers are planned, or that lists
a managed container's process without its memory, none of its managed containers' processes
while memory is in use, or a process whose container cannot be told), a
container whose GPU memory cap rests on the kill-policy watchdog alone there has no cap in
force: the pass reports it pending under WATCHDOG_BLIND (`blind_results`), so no readiness
marker vouches for it, and the node condition says so. An episode of blindness starts at the
first check that finds it and ends after two checks in a row that see the GPU; each start and
end asks for a pass (`take_news`), so that both are reported within seconds, not at the next
resync. A pass that would vouch for such a container on a GPU no check has judged with it
planned runs this check first (`Reconciler`), with its own desired state: the same check, with
the same metrics, events and stops.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any

from ..desired import ContainerKey, DesiredState
from ..engine_reports import ContainerResult
from ..errors import NvmlError
from ..inventory import Inventory
from ..nvml import Nvml
from ..watchdog import (
    ESCALATED,
    FAILED,
    KILLED,
    SIGNALLED,
    TERMINATE,
    TERMINATED,
    UNKILLABLE,
    Action,
    Watchdog,
    WatchdogReport,
    merge_listings,
)
from . import events as ev
from .blindness import (
    CONTAINER_UNKNOWN,
    MEMORY_UNKNOWN,
    MPS_LISTING_FAILED,
    NEWS_GAP_SECONDS,
    NO_PROCESSES_VISIBLE,
    UNSEEN_MEMORY_BYTES,
    USAGE_UNKNOWN,
    Blindness,
    BlindnessTracker,
    usage_unknown,
    watchdog_only,
)
from .events import EventRecorder, PodRef
from .metrics import AgentMetrics, Usage

__all__ = [  # the blindness names are read from here too (they were this module's)
    "CONTAINER_UNKNOWN", "MEMORY_UNKNOWN", "MPS_LISTING_FAILED", "NEWS_GAP_SECONDS",
    "NO_PROCESSES_VISIBLE",
    "UNSEEN_MEMORY_BYTES", "USAGE_UNKNOWN", "UsageCheck", "usage_unknown", "watchdog_only",
]


class UsageCheck:
    def __init__(self, nvml: Nvml, watchdog: Watchdog, events: EventRecorder,
                 metrics: AgentMetrics):
        self.nvml = nvml
        self.watchdog = watchdog
        self.events = events
        self.metrics = metrics
        self._util_since: dict[str, int] = {}
        """GPU uuid -> timestamp (µs) of the newest utilization sample read."""
        self.sight = BlindnessTracker(nvml, metrics)
        """What the watchdog cannot see, GPU by GPU (`blindness`)."""
        self.checks = 0
        """Checks run since the agent started."""
        self._stop_refs: dict[int, PodRef] = {}
        """pid -> the pod of each stop in progress, taken when it started: its outcome comes
        at a later check, often after the pod left the plan (its main process exited on
        SIGTERM, so the pod ended), and must still be its event."""

    def check(self, desired: DesiredState, inventory: Inventory
              ) -> Mapping[tuple[ContainerKey, str], Usage]:
        """Usage by (container, GPU uuid); metrics, violations and events updated."""
        self.checks += 1
        sight = self.sight
        sight.forget_gone(set(inventory.uuids))
        processes: dict[str, Any] = {}
        sm: dict[int, int] = {}
        for d in inventory.devices:
            try:
                compute = self.nvml.running_processes(d.uuid)
            except NvmlError as e:
                sight.listing_failed(d.uuid, e)
                continue
            sight.listed(d.uuid)
            processes[d.uuid] = merge_listings(compute, sight.other_processes(d.uuid))
            sm.update(self._sm_percent(d.uuid))
        report = self.watchdog.check(processes, desired.watchdog_containers(), sm)
        checked = set(processes)
        sight.judge(desired, inventory, processes, report)
        # A GPU not listed has no usage row: unknown, read 0 like a GPU while NVML is down.
        usage = MappingProxyType({(ContainerKey(u.pod_uid, u.container_name), u.device_uuid):
                                  Usage(u.used_bytes, u.sm_percent) for u in report.usage})
        self.metrics.update(desired, usage, inventory)
        self.metrics.count_violations(report.violations, checked)
        self.metrics.count_stop_failures((a.pod_uid, a.container_name, a.device_uuid, a.step)
                                         for a in _failed_stops(report.actions))
        self._events(desired, report, checked)
        self.metrics.set_usage_unknown({u: b.reason for u, b in sight.unreadable().items()})
        return usage

    @property
    def news(self) -> bool:
        """`BlindnessTracker.news`."""
        return self.sight.news

    @news.setter
    def news(self, value: bool) -> None:
        self.sight.news = value

    def take_news(self, now: float | None = None) -> bool:
        """`BlindnessTracker.take_news`."""
        return self.sight.take_news(now)

    def blindness(self) -> dict[str, Blindness]:
        """`BlindnessTracker.blindness`: the GPUs in an episode of blindness."""
        return self.sight.blindness()

    def unreadable(self) -> dict[str, Blindness]:
        """`BlindnessTracker.unreadable`: what the last check could not see."""
        return self.sight.unreadable()

    def blind_results(self, desired: DesiredState,
                      results: Mapping[ContainerKey, ContainerResult], watchdog_stops: bool
                      ) -> tuple[dict[ContainerKey, ContainerResult], dict[str, str]]:
        """`BlindnessTracker.blind_results`."""
        return self.sight.blind_results(desired, results, watchdog_stops)

    def _sm_percent(self, uuid: str) -> dict[int, int]:
        """pid -> SM percent of its newest sample since the last check."""
        try:
            samples = self.nvml.process_utilization(uuid, self._util_since.get(uuid, 0))
        except NvmlError:
            samples = ()
        latest: dict[int, tuple[int, int]] = {}
        for s in samples:
            if s.pid not in latest or s.timestamp_us >= latest[s.pid][0]:
                latest[s.pid] = (s.timestamp_us, s.sm_percent)
            self._util_since[uuid] = max(self._util_since.get(uuid, 0), s.timestamp_us)
        return {pid: pct for pid, (_ts, pct) in latest.items()}

    def _events(self, desired: DesiredState, report: WatchdogReport,
                checked: set[str]) -> None:
        refs = _refs(desired)
        now_violating = set()
        for v in report.violations:
            ref = refs.get(ContainerKey(v.pod_uid, v.container_name))
            if ref is None:
                continue
            dedup = (ev.LIMIT_VIOLATION, v.pod_uid, v.container_name, v.device_uuid)
            now_violating.add(dedup)
            if self.watchdog.policy == "report":
                self.events.emit(ref, ev.WARNING, ev.LIMIT_VIOLATION, v.message, key=dedup)
        self._failed_stop_events(report, refs)
        # An episode ends when the usage is back under the cap: the next one is reported
        # again. A GPU not listed this check says nothing of that: its episodes go on.
        self.events.forget_matching(lambda k: isinstance(k, tuple) and len(k) == 4
                                    and k[0] == ev.LIMIT_VIOLATION and k not in now_violating
                                    and k[3] in checked)
        self._stop_events(report.actions, refs)

    def _failed_stop_events(self, report: WatchdogReport,
                            refs: Mapping[ContainerKey, PodRef]) -> None:
        """Kill mode: a stop that cannot proceed (its drain or its signal failed; retried at
        every check) is told to the pod once per episode, as the episode's LimitViolation
        (the event report mode sends), with why it was not stopped."""
        failed: dict[tuple[str, str, str], list[Action]] = {}
        for a in _failed_stops(report.actions):
            failed.setdefault((a.pod_uid, a.container_name, a.device_uuid), []).append(a)
        if not failed:
            return
        violations = {(v.pod_uid, v.container_name, v.device_uuid): v
                      for v in report.violations}
        for (pod_uid, name, device), actions in failed.items():
            # A stop that failed at SIGKILL may be of a pod that left the plan meanwhile.
            ref = self._stop_refs.get(actions[0].pid)
            if ref is None or ref.uid != pod_uid:
                ref = refs.get(ContainerKey(pod_uid, name))
            if ref is None:
                continue
            why = "; ".join(
                f"pid {a.pid}: {a.step} failed" + (f" ({a.detail})" if a.detail else "")
                for a in actions)
            v = violations.get((pod_uid, name, device))
            head = v.message if v is not None else (
                f"container {name} of pod {pod_uid} uses more GPU memory on {device} than "
                "its cap")
            message = (f"{head}; the watchdog (kill policy) could not stop it: {why}; it "
                       "tries again at every check while the use stays over the cap")
            key = (ev.LIMIT_VIOLATION, pod_uid, name, device)
            self.events.emit(ref, ev.WARNING, ev.LIMIT_VIOLATION, message, key=key)
            if ContainerKey(pod_uid, name) not in refs:
                # Its pod left the plan (and `forget_pod` ran): nothing would forget the key.
                self.events.forget_matching(lambda k, key=key: k == key)

    def advance_stops(self, desired: DesiredState | None) -> None:
        """The watchdog's stops in progress moved on without a usage check: what the agent
        runs instead of `check` while NVML does not work (no inventory) or nothing is planned
        yet. Usage, violations and metrics wait for a check that can read them (a stop that
        failed meanwhile is told to its pod all the same)."""
        actions = self.watchdog.progress()
        refs = _refs(desired)
        self._failed_stop_events(WatchdogReport(0.0, actions=tuple(actions)), refs)
        self.metrics.count_stop_failures((a.pod_uid, a.container_name, a.device_uuid, a.step)
                                         for a in _failed_stops(actions))
        self._stop_events(actions, refs)

    def _stop_events(self, actions: Iterable[Action],
                     refs: Mapping[ContainerKey, PodRef]) -> None:
        """A stop takes several checks (SIGTERM, SIGKILL after the grace period): only what
        happened in the end is an event, the steps in between are logged."""
        for a in actions:
            if a.step != TERMINATE:
                continue
            ref = self._stop_ref(a, refs)
            if ref is None or a.outcome not in (TERMINATED, KILLED, UNKILLABLE):
                continue
            if a.outcome == UNKILLABLE:
                reason, message = ev.PROCESS_NOT_STOPPED, (
                    f"container {a.container_name}: process {a.pid}, over its GPU memory cap on "
                    f"{a.device_uuid}, still runs after SIGKILL (stuck in the kernel or the "
                    "driver); its GPU memory stays in use until it exits")
            else:
                reason, message = ev.LIMIT_ENFORCED, (
                    f"container {a.container_name}: process {a.pid} {a.outcome} for using more "
                    f"GPU memory on {a.device_uuid} than its cap (drained from MPS first when it "
                    "was a client)")
            key = (reason, a.pod_uid, a.container_name, a.pid)
            self.events.emit(ref, ev.WARNING, reason, message, key=key)
            if ContainerKey(a.pod_uid, a.container_name) not in refs:
                # Its pod left the plan (and `forget_pod` ran): nothing would forget the key.
                self.events.forget_matching(lambda k, key=key: k == key)

    def _stop_ref(self, a: Action, refs: Mapping[ContainerKey, PodRef]) -> PodRef | None:
        """The pod of a stop's step: remembered while the stop is in progress (SIGTERM sent,
        SIGKILL sent, or still running after it), forgotten once the process exited."""
        ref = self._stop_refs.get(a.pid)
        if ref is None or ref.uid != a.pod_uid:
            ref = refs.get(ContainerKey(a.pod_uid, a.container_name))
        if a.outcome in (SIGNALLED, ESCALATED, UNKILLABLE) and ref is not None:
            self._stop_refs[a.pid] = ref
        else:
            self._stop_refs.pop(a.pid, None)
        return ref


def _failed_stops(actions: Iterable[Action]) -> list[Action]:
    """The steps of stops that could not proceed: a drain or a signal that failed (the
    process was left running, and is tried again at the next check)."""
    return [a for a in actions if a.outcome == FAILED and a.pod_uid]


def _refs(desired: DesiredState | None) -> dict[ContainerKey, PodRef]:
    """The pod of each planned container, and of each refused one the watchdog still watches
    (`DesiredState.watched`), for its events."""
    if desired is None:
        return {}
    return {c.key: PodRef(c.pod_namespace, c.pod_name, c.key.pod_uid)
            for c in (*desired.containers, *desired.watched)}
