"""What the watchdog cannot see, GPU by GPU, as its checks (`usage.UsageCheck`) find it, and its
episodes. What that means for a container whose GPU memory cap rests on the kill-policy watchdog
alone is `blind_results`'s; what NVML is asked beside the compute listing, `listing_accounting`'s.

Five kinds of blindness, each judged by every check that lists the GPU's processes (its compute,
graphics and MPS compute listings, each taken on its own and each pid once: the processes the
watchdog attributes):
- the compute listing fails (NVML's error: `NVMLNoPermission`, ...), on any GPU (a graphics
  listing that fails leaves the others to be watched and to account, logged once: graphics
  processes are not how an MPS tenant escapes its cap; `other_processes`);
- the MPS client listing fails (MPS_LISTING_FAILED), on a GPU with planned (or watched)
  sm-sharing containers: some drivers list an MPS client there only, so one over its cap
  could pass unseen (a time-slicing container's processes are no MPS clients: elsewhere it
  hides nothing of a managed container). The compute and graphics listings are still watched;
- NVML lists a managed container's process without its memory (MEMORY_UNKNOWN);
- NVML lists no process of the GPU's managed containers while more memory is in use than the
  processes it lists account for (NO_PROCESSES_VISIBLE: an agent outside the host's pid
  namespace). What the processes account for is the compute listing plus the graphics and MPS
  client listings (`Nvml.other_processes`: NVML lists a graphics process in the graphics
  listing only), each pid once (`watchdog.merge_listings`: a process in several listings is
  counted once). A GPU the check's listings make a suspect is judged by a test of its own
  (`GpuListings.hidden_memory`), so a process that starts or exits meanwhile is not taken for a
  hidden one (a GPU whose listings show a managed container's process costs no read more);
- NVML lists a process whose container cannot be told on a GPU with managed containers
  (CONTAINER_UNKNOWN).
The last three are judged on GPUs with planned (or watched) containers only: elsewhere there is
no managed container to miss.

An episode of blindness (`blindness`) starts at the first check that finds any kind on a GPU
and ends only after CLEAN_CHECKS checks in a row that list the GPU and find none: honest at
once, and a GPU whose listing fails every other check is one episode, not one per failure. Its
start, its end and a change of its reason are news for a pass (`take_news`). `unreadable` is
what the last check found, without that hysteresis (the usage it could not read). A container
whose only memory tier is the watchdog on a GPU in an episode is pending WatchdogBlind
(`blind_results`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ...contract import MIB, ComputeMode
from ..desired import ContainerKey, DesiredState
from ..engine_reports import ContainerResult
from ..errors import NvmlError
from ..inventory import Inventory
from ..nvml import Nvml
from ..watchdog import ContainerUsage, WatchdogReport

# USAGE_UNKNOWN, usage_unknown, blind_message, watchdog_only and UNSEEN_MEMORY_BYTES were
# this module's: re-exported, where their importers read them.
from .blind_results import (  # noqa: F401
    USAGE_UNKNOWN,
    blind_message,
    pending_blind,
    usage_unknown,
    vouches_unjudged,
    watchdog_only,
)
from .listing_accounting import UNSEEN_MEMORY_BYTES, GpuListings  # noqa: F401
from .metrics import AgentMetrics

# A child of the usage check's logger: these lines are the check's.
log = logging.getLogger(f"{__package__}.usage.blindness")

MEMORY_UNKNOWN = "ProcessMemoryUnknown"
"""The usage-unreadable reason for a managed container's process NVML lists without memory."""
CONTAINER_UNKNOWN = "ProcessContainerUnknown"
"""The usage-unreadable reason for a GPU with managed containers where NVML lists a process whose
container the watchdog cannot tell: its /proc entry unreadable (`hidepid`, an LSM), or a cgroup
path relative to the agent's cgroup namespace that names no pod it can place (a layout it does
not know). The process may be a managed container's: its memory is counted for no one."""
MPS_LISTING_FAILED = "MpsListingFailed"
"""The usage-unreadable reason for a GPU with sm-sharing containers whose MPS client listing
(nvmlDeviceGetMPSComputeRunningProcesses) fails, while its compute listing works: an MPS client
some drivers list there only is not seen."""
NO_PROCESSES_VISIBLE = "NoProcessesVisible"
"""The usage-unreadable reason for a GPU with managed containers whose memory is used by
processes NVML does not list: NVML (like /proc) shows only the processes of the caller's pid
namespace, so an agent without the host's (no `hostPID`) gets empty lists and no error."""
NEWS_GAP_SECONDS = 10.0
"""The least time between two passes asked for by watchdog checks that found an episode of
blindness start or end."""
CLEAN_CHECKS = 2
"""Checks in a row that list a GPU and find no blindness there that end its episode."""


@dataclass(frozen=True, slots=True)
class Blindness:
    """Why the watchdog cannot see a GPU's usage, as its last check that could tell found."""

    reason: str
    """The NVML error's reason when the GPU's processes cannot be listed (NVMLNoPermission,
    ...), else MPS_LISTING_FAILED, MEMORY_UNKNOWN, NO_PROCESSES_VISIBLE or CONTAINER_UNKNOWN:
    the reason of
    `kai_fractions_agent_gpu_usage_unreadable_total`."""
    detail: str
    """What the watchdog cannot see there, and what to do (for messages)."""


def _planned(desired: DesiredState) -> set[str]:
    """The GPUs of the planned containers and of the refused ones the watchdog still watches."""
    return {u for c in (*desired.containers, *desired.watched) for u in c.plan.device_uuids}


def _mps_clients(desired: DesiredState) -> set[str]:
    """The GPUs of `_planned`'s sm-sharing containers: those whose processes are MPS clients."""
    return {u for c in (*desired.containers, *desired.watched)
            if c.plan.compute_mode is ComputeMode.SM_SHARING for u in c.plan.device_uuids}


class BlindnessTracker:
    """The five kinds of blindness per GPU, their episodes, and which planned containers a
    check has judged their GPUs with. Driven by `UsageCheck.check`, on the worker thread."""

    def __init__(self, nvml: Nvml, metrics: AgentMetrics):
        self.nvml = nvml
        self.metrics = metrics
        self.listings = GpuListings(nvml)
        """The graphics and MPS listings a check takes, and the hidden-memory test."""
        self._blind: dict[str, NvmlError] = {}
        """GPU uuid -> why its processes could not be listed, while they cannot."""
        self._unknown: dict[str, tuple[int, ...]] = {}
        """GPU uuid -> the pids NVML lists for managed containers without their memory."""
        self._unseen: dict[str, int] = {}
        """GPU uuid -> the bytes in use there that no process NVML lists accounts for."""
        self._unplaced: dict[str, tuple[int, str]] = {}
        """GPU uuid -> (pid, why) of a process there whose container cannot be told."""
        self._untested: dict[str, NvmlError] = {}
        """GPU uuid -> why the hidden-memory test of a suspect GPU could not run (a memory read
        or its listing again failed): it cannot be told clear, so it counts as blind."""
        self._mps_failing: dict[str, NvmlError] = {}
        """GPU uuid with sm-sharing containers -> why its MPS client listing fails, while it
        does (MPS_LISTING_FAILED)."""
        self._episodes: dict[str, Blindness] = {}
        """GPU uuid -> its blindness, from the first check that found it until CLEAN_CHECKS
        checks in a row found none."""
        self._clean: dict[str, int] = {}
        """GPU uuid in an episode -> the checks in a row since that found no blindness."""
        self._judged: set[tuple[ContainerKey, str]] = set()
        """(container, GPU uuid) of each planned container whose GPU a check has judged with it
        planned (`unjudged`)."""
        self.news = False
        """Set when an episode starts or ends, or its reason changes: only a pass reports it (a
        container whose only memory tier is the watchdog there, the node condition), so the
        worker runs one soon instead of at the next resync (`take_news`)."""
        self._news_taken = -math.inf

    # -- during a check ---------------------------------------------------------------------

    def forget_gone(self, here: set[str]) -> None:
        """Forgets the GPUs the node no longer has."""
        for state in (self._blind, self._unknown, self._unseen, self._unplaced,
                      self._untested, self._mps_failing, self._episodes, self._clean):
            for gone in state.keys() - here:
                del state[gone]
        self.listings.forget_gone(here)

    def listing_failed(self, uuid: str, error: NvmlError) -> None:
        """Counted every check, logged when it starts or its reason changes: a blind watchdog
        must be visible, not read as "nothing used"."""
        self.metrics.usage_blind.labels(self.metrics.node, uuid, error.reason).inc()
        before = self._blind.get(uuid)
        self._blind[uuid] = error  # the newest error, for messages
        if before is None or before.reason != error.reason:
            log.warning("cannot list the processes of GPU %s (%s): %s; the watchdog sees no "
                        "usage there until it can", uuid, error.reason, error.message)

    def listed(self, uuid: str) -> None:
        """The GPU's compute listing worked; its other listings come next (`other_processes`):
        what they did in an earlier check is not this check's."""
        self.listings.mps_failed.pop(uuid, None)
        if self._blind.pop(uuid, None) is not None:
            log.info("the processes of GPU %s can be listed again", uuid)

    def judge(self, desired: DesiredState, inventory: Inventory,
              processes: Mapping[str, Any], report: WatchdogReport) -> None:
        """After the watchdog's check over `processes` (the GPUs listed): the other kinds of
        blindness, then the episodes, and the containers judged."""
        checked = set(processes)
        self._unknown_memory(report.usage, checked)
        self._unseen_processes(desired, processes, report.usage)
        self._unplaced_processes(desired, report, checked)
        self._mps_unlisted(desired, checked)
        here = set(inventory.uuids)
        current = {(c.key, u) for c in desired.containers for u in c.plan.device_uuids}
        # Every GPU of the inventory was judged: listed, or known unlistable.
        self._judged = (self._judged | {(k, u) for k, u in current if u in here}) & current
        self._episode(checked)

    def _episode(self, listed: set[str]) -> None:
        """Episodes from what this check found: one starts (or goes on, its blindness the
        newest) on each GPU blind now (a GPU whose hidden-memory test could not run included:
        `_untested`); one ends after CLEAN_CHECKS checks in a row that `listed` the GPU and
        found it clear."""
        was = {u: b.reason for u, b in self._episodes.items()}
        now = self.unreadable()
        for uuid, b in now.items():
            self._episodes[uuid] = b
            self._clean[uuid] = 0
        for uuid in [u for u in self._episodes if u not in now and u in listed]:
            self._clean[uuid] = self._clean.get(uuid, 0) + 1
            if self._clean[uuid] >= CLEAN_CHECKS:
                del self._episodes[uuid], self._clean[uuid]
                log.info("the watchdog sees GPU %s again (%d checks in a row)", uuid,
                         CLEAN_CHECKS)
        if {u: b.reason for u, b in self._episodes.items()} != was:
            self.news = True

    def _unknown_memory(self, usage: Iterable[ContainerUsage], checked: set[str]) -> None:
        """Processes of managed containers that NVML lists without their memory (it says "not
        available" without the privileges to read it, and in some virtualised modes) count
        0 in the watchdog's sums: like a GPU it cannot list, counted every check and
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
        for uuid in (self._unknown.keys() & checked) - set(unknown):
            log.info("NVML reports the memory of every managed process on GPU %s again", uuid)
        self._unknown = {**{u: p for u, p in self._unknown.items() if u not in checked},
                         **{u: tuple(sorted(p)) for u, p in unknown.items()}}

    def _unplaced_processes(self, desired: DesiredState, report: WatchdogReport,
                            checked: set[str]) -> None:
        """GPUs with managed containers where NVML lists a process whose container the
        watchdog cannot tell (`WatchdogReport.unplaced`): it may be a managed container's, so
        a container over its cap could pass unseen. Counted every check and logged when it
        starts and ends, like the other kinds of blindness."""
        planned = _planned(desired)
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
        for uuid in (self._unplaced.keys() & checked) - set(unplaced):
            log.info("the container of every process on GPU %s can be told again", uuid)
        self._unplaced = {**{u: p for u, p in self._unplaced.items() if u not in checked},
                          **{u: min(procs) for u, procs in unplaced.items()}}

    def _mps_unlisted(self, desired: DesiredState, checked: set[str]) -> None:
        """GPUs with sm-sharing containers whose MPS client listing failed this check (in the
        check's listings or in the hidden-memory test's): an MPS client of theirs that some
        drivers list there only could use more than its cap unseen. Counted every check,
        logged when it starts (or its reason changes) and when it ends, like the other kinds.
        A GPU not listed this check keeps its state."""
        clients = _mps_clients(desired)
        failing = {u: e for u, e in self.listings.mps_failed.items()
                   if u in clients and u in checked}
        self.listings.mps_failed.clear()
        for uuid, error in failing.items():
            self.metrics.usage_blind.labels(self.metrics.node, uuid, MPS_LISTING_FAILED).inc()
            before = self._mps_failing.get(uuid)
            if before is None or before.reason != error.reason:
                log.warning("GPU %s: its MPS client listing fails (%s: %s); an MPS client that "
                            "the driver lists there only is not seen: the watchdog counts the "
                            "GPU blind until it can list them", uuid, error.reason,
                            error.message)
        for uuid in (self._mps_failing.keys() & checked) - set(failing):
            log.info("GPU %s: its MPS clients can be listed again", uuid)
        self._mps_failing = {**{u: e for u, e in self._mps_failing.items() if u not in checked},
                             **failing}

    def _unseen_processes(self, desired: DesiredState, processes: Mapping[str, Any],
                          usage: Iterable[ContainerUsage]) -> None:
        """GPUs with managed containers where NVML lists no process of theirs while more than
        UNSEEN_MEMORY_BYTES of memory is used beyond what the listed processes account for
        (none at all, or an MPS server in the agent's own pid namespace): an agent without
        the host's pid namespace sees such lists, with no error, and the watchdog would read 0
        there. The check's listings (`processes`: compute, graphics and MPS, each pid once)
        only make a GPU a suspect; a suspect is then judged by a test of its own
        (`GpuListings.hidden_memory`). So a check whose GPUs each list a managed container's
        process costs no read more. Counted every check and logged when it starts and ends,
        like an unlistable GPU. Only GPUs listed this check are judged; a process listed
        without its memory leaves the GPU clear of this kind (its share cannot be told). A
        suspect whose memory read or compute listing fails in the test cannot be told clear:
        it counts as blind under NVML's reason (`_untested`) until a test runs again."""
        planned = _planned(desired)
        seen = {u.device_uuid for u in usage if u.pids}
        suspects = [uuid for uuid, procs in processes.items()
                    if uuid in planned and uuid not in seen
                    and all(p.used_bytes is not None for p in procs)]
        checked = set(processes)
        unseen, untested = self.listings.hidden_memory(suspects)
        for uuid, error in untested.items():
            self.metrics.usage_blind.labels(self.metrics.node, uuid, error.reason).inc()
            if uuid not in self._untested:
                log.warning("GPU %s: cannot tell whether memory is in use that no process NVML "
                            "lists accounts for (%s: %s); the watchdog counts it blind until "
                            "it can", uuid, error.reason, error.message)
        for uuid in (self._untested.keys() & checked) - set(untested):
            log.info("GPU %s: whether memory is in use that no listed process accounts for "
                     "can be told again", uuid)
        self._untested = {**{u: e for u, e in self._untested.items() if u not in checked},
                          **untested}
        for uuid, hidden in unseen.items():
            self.metrics.usage_blind.labels(self.metrics.node, uuid, NO_PROCESSES_VISIBLE).inc()
            if uuid not in self._unseen:
                log.warning(
                    "GPU %s has %d MiB of memory in use that no process NVML lists accounts "
                    "for, and NVML lists no process of its managed containers: the agent may "
                    "not run in the host's pid namespace (hostPID), where NVML and /proc show "
                    "every GPU process; the watchdog sees no usage there until it does",
                    uuid, hidden // MIB)
        for uuid in (self._unseen.keys() & checked) - set(unseen) - set(untested):
            log.info("the processes using the memory of GPU %s are listed again", uuid)
        self._unseen = {**{u: b for u, b in self._unseen.items()
                           if u not in checked or u in untested},
                        **unseen}

    def other_processes(self, uuid: str) -> tuple[Any, ...]:
        """`GpuListings.other_processes`: the GPU's graphics and MPS compute listings (an MPS
        listing that fails otherwise is kept for `judge`)."""
        return self.listings.other_processes(uuid)

    # -- for passes -------------------------------------------------------------------------

    def take_news(self, now: float | None = None) -> bool:
        """Whether a check found something only a pass can report (an episode started, ended
        or changed its reason): once per finding, and at most every NEWS_GAP_SECONDS."""
        now = time.monotonic() if now is None else now
        if not self.news or now - self._news_taken < NEWS_GAP_SECONDS:
            return False
        self.news, self._news_taken = False, now
        return True

    def unreadable(self) -> dict[str, Blindness]:
        """GPU uuid -> why the last check that could tell could not see its usage (a GPU not
        listed keeps what was known of the other kinds). A listing that fails comes first:
        nothing else can be told there."""
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
        for uuid, error in self._mps_failing.items():
            out[uuid] = Blindness(MPS_LISTING_FAILED, (
                f"NVML cannot list its MPS clients ({error.reason}: {error.message}), and some "
                "drivers list an MPS client there only, so one over its cap may go unseen; see "
                "docs/node-agent.md, \"What the watchdog sees and stops\""))
        for uuid, error in self._untested.items():
            out[uuid] = Blindness(error.reason, (
                "NVML cannot read what its memory in use or its processes are to tell whether "
                f"memory is in use that no process it lists accounts for: {error.message}"))
        for uuid, error in self._blind.items():
            out[uuid] = Blindness(error.reason, f"NVML cannot list its processes: {error.message}")
        return out

    def blindness(self) -> dict[str, Blindness]:
        """GPU uuid -> its episode of blindness, for each GPU in one (what the agent acts on:
        see the module's docstring)."""
        return dict(self._episodes)

    def unjudged(self, desired: DesiredState, results: Mapping[ContainerKey, ContainerResult],
                 inventory: Inventory, watchdog_stops: bool) -> bool:
        """Whether a pass with these results would vouch for a container whose only memory
        tier is the watchdog (applied) on a GPU of the node that no check has judged with it
        planned: it must run a check first (`blind_results.vouches_unjudged`)."""
        return vouches_unjudged(desired, results, inventory, self._judged, watchdog_stops)

    def blind_results(self, desired: DesiredState,
                      results: Mapping[ContainerKey, ContainerResult], watchdog_stops: bool
                      ) -> tuple[dict[ContainerKey, ContainerResult], dict[str, str]]:
        """The pass's results with each container whose GPU memory cap rests on the watchdog
        alone on a GPU in an episode of blindness (`blindness`) pending WatchdogBlind
        (`blind_results.pending_blind`), and GPU uuid -> blindness reason of each such GPU."""
        blind = self.blindness() if watchdog_stops else {}
        return pending_blind(desired, results, blind, watchdog_stops)
