"""The watchdog check the worker runs between passes (`--watchdog-interval`): each fractional
container's GPU memory and SM use, and what the watchdog policy does about use over a cap.

The processes on each GPU come from NVML and are matched to containers through /proc (by the
watchdog); SM use is the newest NVML sample per process since the last check. The usage feeds
the metrics and GetNodeState. Use over a cap is counted, reported once per episode as a
LimitViolation event in `report` mode (an episode ends when the use is back under the cap), and
in `kill` mode the watchdog drains the process from MPS and stops it, with a LimitEnforced
event on its pod; a stop that cannot proceed (the drain or the signal failed) is a
LimitViolation event too, once per episode, saying why. A GPU whose processes cannot be listed
in a check is not judged: its containers' episodes go on as they were (neither ended nor
started), and their usage is unknown (the gauges read 0, as while NVML is down). Only
containers whose plan has the watchdog mechanism are capped; the others are observed. A
running container refused because only a report-mode watchdog would watch it
(`DesiredState.watched`, after an upgrade to the rule that refuses such containers) is still
checked against its plan's cap: its use over it is reported, nothing of it is stopped.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any

from ...contract import MIB
from ..desired import ContainerKey, DesiredState
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
    ContainerUsage,
    Watchdog,
    WatchdogReport,
)
from . import events as ev
from .events import EventRecorder, PodRef
from .metrics import AgentMetrics, Usage

log = logging.getLogger(__name__)

MEMORY_UNKNOWN = "ProcessMemoryUnknown"
"""The usage-unreadable reason for a managed container's process NVML lists without memory."""
CONTAINER_UNKNOWN = "ProcessContainerUnknown"
"""The usage-unreadable reason for a GPU with managed containers where NVML lists a process whose
container the watchdog cannot tell: its /proc entry unreadable (`hidepid`, an LSM), or a cgroup
path relative to the agent's cgroup namespace that names no pod it can place (a layout it does
not know). The process may be a managed container's: its memory is counted for no one."""
NO_PROCESSES_VISIBLE = "NoProcessesVisible"
"""The usage-unreadable reason for a GPU with managed containers whose memory is used by
processes NVML does not list: NVML (like /proc) shows only the processes of the caller's pid
namespace, so an agent without the host's (no `hostPID`) gets empty lists and no error."""
UNSEEN_MEMORY_BYTES = 512 * MIB
"""GPU memory in use beyond what the listed processes account for that counts as processes NVML
does not show. NVML's `used` (nvmlMemory_v2, drivers since R510) leaves the driver's reserved
memory out, so an idle GPU reads 0 to a few MiB; the v1 fallback of older drivers counts the
reserved memory too, typically a few hundred MiB. One CUDA context alone takes some 300-500 MiB
on recent GPUs: a hidden workload crosses this at its first allocations, an idle GPU does not."""
NEWS_GAP_SECONDS = 10.0
"""The least time between two passes asked for by watchdog checks that found NVML failing."""


class UsageCheck:
    def __init__(self, nvml: Nvml, watchdog: Watchdog, events: EventRecorder,
                 metrics: AgentMetrics):
        self.nvml = nvml
        self.watchdog = watchdog
        self.events = events
        self.metrics = metrics
        self._util_since: dict[str, int] = {}
        """GPU uuid -> timestamp (µs) of the newest utilization sample read."""
        self._blind: dict[str, str] = {}
        """GPU uuid -> why its processes could not be listed, while they cannot."""
        self._unknown: set[str] = set()
        """GPU uuids where NVML lists a managed container's process without its memory."""
        self._unseen: set[str] = set()
        """GPU uuids whose memory is used by processes NVML does not list."""
        self._unplaced: set[str] = set()
        """GPU uuids where NVML lists a process whose container cannot be told."""
        self.news = False
        """Set when a GPU's processes stop being listable: NVML may be failing between passes,
        which only a pass reports (the node condition), so the worker runs one soon instead of
        at the next resync (`take_news`)."""
        self._news_taken = -math.inf
        self._stop_refs: dict[int, PodRef] = {}
        """pid -> the pod of each stop in progress, taken when it started: its outcome comes
        at a later check, often after the pod left the plan (its main process exited on
        SIGTERM, so the pod ended), and must still be its event."""

    def check(self, desired: DesiredState, inventory: Inventory
              ) -> Mapping[tuple[ContainerKey, str], Usage]:
        """Usage by (container, GPU uuid); metrics, violations and events updated."""
        processes: dict[str, Any] = {}
        sm: dict[int, int] = {}
        for d in inventory.devices:
            try:
                processes[d.uuid] = self.nvml.running_processes(d.uuid)
            except NvmlError as e:
                self._unreadable(d.uuid, e)
                continue
            if self._blind.pop(d.uuid, None) is not None:
                log.info("the processes of GPU %s can be listed again", d.uuid)
            sm.update(self._sm_percent(d.uuid))
        report = self.watchdog.check(processes, desired.watchdog_containers(), sm)
        checked = set(processes)
        self._unknown_memory(report.usage, checked)
        self._unseen_processes(desired, processes, report.usage)
        self._unplaced_processes(desired, report, checked)
        # A GPU not listed has no usage row: unknown, read 0 like a GPU while NVML is down.
        usage = MappingProxyType({(ContainerKey(u.pod_uid, u.container_name), u.device_uuid):
                                  Usage(u.used_bytes, u.sm_percent) for u in report.usage})
        self.metrics.update(desired, usage, inventory)
        self.metrics.count_violations(report.violations, checked)
        self.metrics.count_stop_failures((a.pod_uid, a.container_name, a.device_uuid, a.step)
                                         for a in _failed_stops(report.actions))
        self._events(desired, report, checked)
        return usage

    def _unreadable(self, uuid: str, error: NvmlError) -> None:
        """Counted every check, logged when it starts or its reason changes: a blind watchdog
        must be visible, not read as "nothing used"."""
        self.metrics.usage_blind.labels(self.metrics.node, uuid, error.reason).inc()
        if self._blind.get(uuid) != error.reason:
            self.news = self.news or uuid not in self._blind  # listable before: news
            self._blind[uuid] = error.reason
            log.warning("cannot list the processes of GPU %s (%s): %s; the watchdog sees no "
                        "usage there until it can", uuid, error.reason, error.message)

    def take_news(self, now: float | None = None) -> bool:
        """Whether a check found something only a pass can report: once per finding, and at
        most every NEWS_GAP_SECONDS (a GPU whose listing fails every other check must not
        turn the watchdog's interval into a pass each)."""
        now = time.monotonic() if now is None else now
        if not self.news or now - self._news_taken < NEWS_GAP_SECONDS:
            return False
        self.news, self._news_taken = False, now
        return True

    def _unknown_memory(self, usage: Iterable[ContainerUsage], checked: set[str]) -> None:
        """Processes of managed containers that NVML lists without their memory (it says "not
        available" without the privileges to read it, and in some virtualised modes) count
        as 0 in the watchdog's sums: like a GPU it cannot list, counted every check and
        logged when it starts and ends, so a partly blind watchdog shows. A GPU not listed
        this check keeps its state."""
        unknown: dict[str, list[int]] = {}
        for u in usage:
            if u.unknown_usage_pids:
                unknown.setdefault(u.device_uuid, []).extend(u.unknown_usage_pids)
        for uuid, pids in unknown.items():
            self.metrics.usage_blind.labels(self.metrics.node, uuid, MEMORY_UNKNOWN).inc()
            if uuid not in self._unknown:
                log.warning("NVML reports no memory for %d process(es) of managed containers "
                            "on GPU %s (pids %s): the watchdog counts them as 0 until it does",
                            len(pids), uuid, ", ".join(map(str, sorted(pids))))
        for uuid in (self._unknown & checked) - set(unknown):
            log.info("NVML reports the memory of every managed process on GPU %s again", uuid)
        self._unknown = set(unknown) | (self._unknown - checked)

    def _unplaced_processes(self, desired: DesiredState, report: WatchdogReport,
                            checked: set[str]) -> None:
        """GPUs with managed containers where NVML lists a process whose container the
        watchdog cannot tell (`WatchdogReport.unplaced`): it may be a managed container's, so
        a container over its cap could pass unseen. Counted every check and logged when it
        starts and ends, like the other kinds of blindness."""
        planned = {u for c in (*desired.containers, *desired.watched)
                   for u in c.plan.device_uuids}
        unplaced: dict[str, list[tuple[int, str]]] = {}
        for uuid, pid, why in report.unplaced:
            if uuid in planned:
                unplaced.setdefault(uuid, []).append((pid, why))
        for uuid, procs in unplaced.items():
            self.metrics.usage_blind.labels(self.metrics.node, uuid, CONTAINER_UNKNOWN).inc()
            if uuid not in self._unplaced:
                pid, why = min(procs)
                log.warning("GPU %s runs %d process(es) whose container the agent cannot tell "
                            "(pid %d: %s): the watchdog counts their memory for no container "
                            "until it can", uuid, len(procs), pid, why)
        for uuid in (self._unplaced & checked) - set(unplaced):
            log.info("the container of every process on GPU %s can be told again", uuid)
        self._unplaced = set(unplaced) | (self._unplaced - checked)

    def _unseen_processes(self, desired: DesiredState, processes: Mapping[str, Any],
                          usage: Iterable[ContainerUsage]) -> None:
        """GPUs with managed containers where NVML lists no process of theirs while more than
        UNSEEN_MEMORY_BYTES of memory is used beyond what the listed processes (none at all,
        or an MPS server in the agent's own pid namespace) account for: an agent without the
        host's pid namespace sees such lists, with no error, and the watchdog would read 0
        there. Counted every check and logged when it starts and ends, like an unlistable
        GPU. Only GPUs listed this check are judged; a process listed without its memory
        leaves the GPU unjudged (its share cannot be told)."""
        planned = {u for c in (*desired.containers, *desired.watched)
                   for u in c.plan.device_uuids}
        seen = {u.device_uuid for u in usage if u.pids}
        suspects = [uuid for uuid, procs in processes.items()
                    if uuid in planned and uuid not in seen
                    and all(p.used_bytes is not None for p in procs)]
        checked = set(processes)
        unseen: dict[str, int] = {}
        if suspects:
            try:
                devices = {d.uuid: d for d in self.nvml.devices()}
            except NvmlError:
                return  # nothing can be judged this check; the state stays as it was
            for uuid in suspects:
                d = devices.get(uuid)
                if d is None or d.mig_enabled:
                    continue
                hidden = d.memory_used - sum(p.used_bytes for p in processes[uuid])
                if hidden > UNSEEN_MEMORY_BYTES:
                    unseen[uuid] = hidden
        for uuid, hidden in unseen.items():
            self.metrics.usage_blind.labels(self.metrics.node, uuid, NO_PROCESSES_VISIBLE).inc()
            if uuid not in self._unseen:
                log.warning(
                    "GPU %s has %d MiB of memory in use that no process NVML lists accounts "
                    "for, and NVML lists no process of its managed containers: the agent may "
                    "not run in the host's pid namespace (hostPID), where NVML and /proc show "
                    "every GPU process; the watchdog sees no usage there until it does",
                    uuid, hidden // MIB)
        for uuid in (self._unseen & checked) - set(unseen):
            log.info("the processes using the memory of GPU %s are listed again", uuid)
        self._unseen = set(unseen) | (self._unseen - checked)

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
