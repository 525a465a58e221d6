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

Where the watchdog is blind (`blindness`: a GPU whose processes cannot be listed, or that lists
a managed container's process without its memory, none of its managed containers' processes
while memory is in use, or a process whose container cannot be told), a container whose GPU
memory cap rests on the kill-policy watchdog alone there has no cap in force: the pass reports
it pending under WATCHDOG_BLIND (`blind_results`), so no readiness marker vouches for it, and
the node condition says so. Every start and end of such blindness asks for a pass (`take_news`),
so that both are reported within seconds, not at the next resync.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from ...contract import MIB
from ..config import Mechanism
from ..desired import ContainerDesired, ContainerKey, DesiredState
from ..engine_reports import WATCHDOG_BLIND, ContainerResult, ContainerState
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
"""The least time between two passes asked for by watchdog checks that found the watchdog turn
blind on a GPU, or see again."""
HARD_TIERS = frozenset({Mechanism.CGROUP, Mechanism.MPS_PINNED})
"""The memory tiers that cap a container without the watchdog: with one of them in force the
watchdog is a second line, and its blindness leaves the cap in force."""


@dataclass(frozen=True, slots=True)
class Blindness:
    """Why the watchdog cannot see a GPU's usage, as its last check that could tell found."""

    reason: str
    """The NVML error's reason when the GPU's processes cannot be listed (NVMLNoPermission,
    ...), else MEMORY_UNKNOWN, NO_PROCESSES_VISIBLE or CONTAINER_UNKNOWN: the reason of
    `kai_fractions_agent_gpu_usage_unreadable_total`."""
    detail: str
    """What the watchdog cannot see there, and what to do (for messages)."""


def watchdog_only(c: ContainerDesired, watchdog_stops: bool) -> bool:
    """Whether the container's GPU memory cap rests on the watchdog alone (on each of its GPUs:
    its mechanisms are the same on all of them): the watchdog stops what exceeds a cap (kill
    policy) and neither the cgroup tier nor mps-pinned is one of its mechanisms. A watchdog
    that only reports is no tier (the plan refuses a container it alone would watch)."""
    return (watchdog_stops and Mechanism.WATCHDOG in c.mechanisms
            and not c.mechanisms & HARD_TIERS)


class UsageCheck:
    def __init__(self, nvml: Nvml, watchdog: Watchdog, events: EventRecorder,
                 metrics: AgentMetrics):
        self.nvml = nvml
        self.watchdog = watchdog
        self.events = events
        self.metrics = metrics
        self._util_since: dict[str, int] = {}
        """GPU uuid -> timestamp (µs) of the newest utilization sample read."""
        self._blind: dict[str, NvmlError] = {}
        """GPU uuid -> why its processes could not be listed, while they cannot."""
        self._unknown: dict[str, tuple[int, ...]] = {}
        """GPU uuid -> the pids NVML lists for managed containers without their memory."""
        self._unseen: dict[str, int] = {}
        """GPU uuid -> the bytes in use there that no process NVML lists accounts for."""
        self._unplaced: dict[str, tuple[int, str]] = {}
        """GPU uuid -> (pid, why) of a process there whose container cannot be told."""
        self.checks = 0
        """Checks run since the agent started (until the first, a pass `probe`s the listing
        of the GPUs it may vouch for the watchdog on)."""
        self.news = False
        """Set when the watchdog turns blind on a GPU (its processes stop being listable, and
        the other kinds of `blindness`) or sees again: only a pass reports it (a container
        whose only memory tier is the watchdog there, the node condition), so the worker runs
        one soon instead of at the next resync (`take_news`)."""
        self._news_taken = -math.inf
        self._stop_refs: dict[int, PodRef] = {}
        """pid -> the pod of each stop in progress, taken when it started: its outcome comes
        at a later check, often after the pod left the plan (its main process exited on
        SIGTERM, so the pod ended), and must still be its event."""

    def check(self, desired: DesiredState, inventory: Inventory
              ) -> Mapping[tuple[ContainerKey, str], Usage]:
        """Usage by (container, GPU uuid); metrics, violations and events updated."""
        self.checks += 1
        here = set(inventory.uuids)
        for state in (self._blind, self._unknown, self._unseen, self._unplaced):
            for gone in state.keys() - here:  # a GPU the node no longer has
                del state[gone]
        processes: dict[str, Any] = {}
        sm: dict[int, int] = {}
        for d in inventory.devices:
            try:
                processes[d.uuid] = self.nvml.running_processes(d.uuid)
            except NvmlError as e:
                self._unreadable(d.uuid, e)
                continue
            if self._blind.pop(d.uuid, None) is not None:
                self.news = True  # a container it blinded may be vouched for again
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
        self.metrics.set_usage_unknown({u: b.reason for u, b in self.blindness().items()})
        return usage

    def probe(self, uuids: Iterable[str]) -> None:
        """Before the first check (`checks` 0: a pass of a fresh agent, which may vouch for
        the watchdog before any check has run): lists the processes of `uuids`, only to know
        whether they can be (`blindness`); nothing is judged, stopped or counted. The first
        check, a watchdog interval later, judges the rest."""
        for uuid in uuids:
            try:
                self.nvml.running_processes(uuid)
            except NvmlError as e:
                self._unreadable(uuid, e, count=False)
                continue
            self._blind.pop(uuid, None)
        self.metrics.set_usage_unknown({u: b.reason for u, b in self.blindness().items()})

    def _unreadable(self, uuid: str, error: NvmlError, *, count: bool = True) -> None:
        """Counted every check, logged when it starts or its reason changes: a blind watchdog
        must be visible, not read as "nothing used"."""
        if count:
            self.metrics.usage_blind.labels(self.metrics.node, uuid, error.reason).inc()
        before = self._blind.get(uuid)
        self._blind[uuid] = error  # the newest error, for messages
        if before is None or before.reason != error.reason:
            self.news = self.news or before is None  # listable before: news
            log.warning("cannot list the processes of GPU %s (%s): %s; the watchdog sees no "
                        "usage there until it can", uuid, error.reason, error.message)

    def take_news(self, now: float | None = None) -> bool:
        """Whether a check found something only a pass can report (the watchdog turned blind
        on a GPU, or sees again): once per finding, and at most every NEWS_GAP_SECONDS (a GPU
        whose listing fails every other check must not turn the watchdog's interval into a
        pass each)."""
        now = time.monotonic() if now is None else now
        if not self.news or now - self._news_taken < NEWS_GAP_SECONDS:
            return False
        self.news, self._news_taken = False, now
        return True

    def blindness(self) -> dict[str, Blindness]:
        """GPU uuid -> why the watchdog cannot see its usage now, as the last check that could
        tell found (a GPU not listed keeps what was known of the other kinds: `check`). A
        listing that fails comes first: nothing else can be told there."""
        out: dict[str, Blindness] = {}
        for uuid, pids in self._unplaced.items():
            pid, why = pids
            out[uuid] = Blindness(CONTAINER_UNKNOWN, (
                f"NVML lists a process there whose container the agent cannot tell (pid {pid}: "
                f"{why}), so its memory counts for no container; see docs/node-agent.md, "
                "\"What the watchdog sees and stops\""))
        for uuid in self._unseen:
            out[uuid] = Blindness(NO_PROCESSES_VISIBLE, (
                "NVML lists none of its managed containers' processes while memory that no "
                "listed process accounts for is in use: run the node agent in the host's pid "
                "namespace (hostPID: true, the chart's default), where NVML and /proc show "
                "every GPU process"))
        for uuid, pids in self._unknown.items():
            out[uuid] = Blindness(MEMORY_UNKNOWN, (
                f"NVML lists managed processes there without their memory (pids "
                f"{', '.join(map(str, pids))}), so the watchdog counts them as 0: NVML shows "
                "every process's memory to root in the host's pid namespace (the chart's "
                "defaults), but not in some virtualised GPU modes"))
        for uuid, error in self._blind.items():
            out[uuid] = Blindness(error.reason, f"NVML cannot list its processes: {error.message}")
        return out

    def blind_results(self, desired: DesiredState,
                      results: Mapping[ContainerKey, ContainerResult], watchdog_stops: bool
                      ) -> tuple[dict[ContainerKey, ContainerResult], dict[str, str]]:
        """The pass's results with each container whose GPU memory cap rests on the watchdog
        alone (`watchdog_only`) on a GPU where the watchdog is blind (`blindness`) reported
        pending under WATCHDOG_BLIND (`ContainerResult.watchdog_blind`): nothing would stop a
        process of it over its cap there, so no readiness marker may vouch for it. A refused
        one stays refused; one known without an MPS cap too keeps that reason (its message
        says what to do first). Also returns GPU uuid -> blindness reason of each such GPU
        (with such a container: the node condition names them)."""
        out = dict(results)
        blind = self.blindness() if watchdog_stops else {}
        gpus_out: dict[str, str] = {}
        for c in desired.containers:
            gpus = [u for u in c.plan.device_uuids if u in blind]
            if not gpus or not watchdog_only(c, watchdog_stops):
                continue
            gpus_out.update((u, blind[u].reason) for u in gpus)
            r = out.get(c.key)
            if r is None or r.state is ContainerState.REFUSED:
                continue
            out[c.key] = _blind_result(r, c, gpus, blind)
        return out, gpus_out

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
                self.news = True
                log.warning("NVML reports no memory for %d process(es) of managed containers "
                            "on GPU %s (pids %s): the watchdog counts them as 0 until it does",
                            len(pids), uuid, ", ".join(map(str, sorted(pids))))
        for uuid in (self._unknown.keys() & checked) - set(unknown):
            self.news = True
            log.info("NVML reports the memory of every managed process on GPU %s again", uuid)
        self._unknown = {**{u: p for u, p in self._unknown.items() if u not in checked},
                         **{u: tuple(sorted(p)) for u, p in unknown.items()}}

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
                self.news = True
                pid, why = min(procs)
                log.warning("GPU %s runs %d process(es) whose container the agent cannot tell "
                            "(pid %d: %s): the watchdog counts their memory for no container "
                            "until it can", uuid, len(procs), pid, why)
        for uuid in (self._unplaced.keys() & checked) - set(unplaced):
            self.news = True
            log.info("the container of every process on GPU %s can be told again", uuid)
        self._unplaced = {**{u: p for u, p in self._unplaced.items() if u not in checked},
                          **{u: min(procs) for u, procs in unplaced.items()}}

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
                self.news = True
                log.warning(
                    "GPU %s has %d MiB of memory in use that no process NVML lists accounts "
                    "for, and NVML lists no process of its managed containers: the agent may "
                    "not run in the host's pid namespace (hostPID), where NVML and /proc show "
                    "every GPU process; the watchdog sees no usage there until it does",
                    uuid, hidden // MIB)
        for uuid in (self._unseen.keys() & checked) - set(unseen):
            self.news = True
            log.info("the processes using the memory of GPU %s are listed again", uuid)
        self._unseen = {**{u: b for u, b in self._unseen.items() if u not in checked},
                        **unseen}

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


USAGE_UNKNOWN = "usage unknown on "
"""How a message begins that names the GPUs where a container's usage is not known
(`usage_unknown`): GetNodeState's messages carry it, `kai-fractions inspect` reads it back."""


def usage_unknown(gpus: Iterable[tuple[str, str]]) -> str:
    """USAGE_UNKNOWN, then `GPU <uuid> (<reason>)` for each GPU (uuid, reason), comma-separated
    (a colon follows where it is used)."""
    return USAGE_UNKNOWN + ", ".join(f"GPU {uuid} ({reason})" for uuid, reason in gpus)


def blind_message(c: ContainerDesired, gpus: Iterable[str],
                  blind: Mapping[str, Blindness]) -> str:
    """Why a container whose only memory tier is the watchdog has no cap in force on `gpus`,
    and what to do (first: an event's message is cut at 1024 characters)."""
    gpus = list(gpus)
    seen = "; ".join(blind[u].detail for u in gpus)
    return (f"{usage_unknown((u, blind[u].reason) for u in gpus)}: the watchdog, this "
            "container's only GPU memory tier there (no cgroup or MPS pinned limit), cannot see "
            f"its use ({seen}), so its cap of {-(-c.plan.limit_bytes // MIB)} MiB is not in "
            "force: nothing stops a process over it until a watchdog check sees the GPU again")


def _blind_result(r: ContainerResult, c: ContainerDesired, gpus: list[str],
                  blind: Mapping[str, Blindness]) -> ContainerResult:
    if r.mps_cap_missing or r.limit_missing:  # its own reason says what to do first
        return dataclasses.replace(r, watchdog_blind=True)
    message = blind_message(c, gpus, blind)
    if r.state is ContainerState.PENDING and r.reason:
        message += f" (this pass also: {r.reason}: {r.message})"
    return dataclasses.replace(r, state=ContainerState.PENDING, reason=WATCHDOG_BLIND,
                               message=message, watchdog_blind=True)


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
