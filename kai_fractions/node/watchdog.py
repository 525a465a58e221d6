"""The memory watchdog: the GPU memory cap where the driver cannot enforce one (no cgroup limits
before r615), and a second line everywhere.

Each check maps every GPU process to its pod and container through `/proc/<pid>/cgroup`, sums
the usage per container and device, and compares it with the container's cap. The processes of
a GPU are those of all three NVML listings (compute, graphics, MPS compute: some drivers list an
MPS client in the MPS listing only, and NVML lists a graphics-only process in the graphics one
only), each pid once, with its largest memory figure (`merge_listings`). By policy:
- `report`: returns the violations (the agent turns them into events and metrics); no action;
- `kill`: drains each of the container's processes on that GPU from MPS first (`client
  terminate`: killing a client in the middle of a kernel can wedge the MPS server for every
  tenant), then terminates it: SIGTERM, and at a later check SIGKILL once the grace period
  has passed. The check never waits for a process to exit (it runs on the agent's one worker,
  with the passes and gRPC calls): each stop in progress is followed from check to check,
  its outcome reported when it is known, and a process that has not exited some time after
  SIGKILL (stuck in the kernel) is reported as such, never signalled again.
A process whose cgroup names a managed pod but a container ID the agent does not know (or none:
right after a container starts or restarts, the pod's status still names the old ID, or none
yet) is the pod's fractional container's, where that container is planned (capped) on the GPU:
the contract allows one fractional container per pod, and the cgroup tier's limit, on the pod's
slice, caps every container of the pod alike (a process of another container of the pod on
that GPU counts too: the agent knows the fractional container's ID only). So it is counted and,
over the cap, stopped like the container's own (were several of the pod's containers capped
there, against the contract, it would be taken for one whose container cannot be told, below).
Before a signal, a process is read again and stopped only while it is in the very pod and
container (the ID, or none) it was counted in: its pid taken meanwhile by a process of another
container of the pod (a sidecar's, not on the GPU) or of the pod's own cgroup counts for the
same container by that rule, but is not the process that was listed. A process that belongs to no
managed container (another pod, a pod whose fractional container is not planned on that GPU, a
host process, a pid that vanished, pid 1, the agent itself) is never touched. When MPS
is in use but cannot say whether a process of an sm-sharing container is its client, the kill
waits for the next check rather than risk the other tenants (a time-slicing container's
processes cannot be clients: they are stopped without asking MPS).

A process whose container cannot be told (its /proc entry there but unreadable: `hidepid`, an
LSM; or a cgroup path relative to the agent's cgroup namespace with a pod-shaped component that
names no pod it can place, `procfs.may_be_a_pod`) is not taken for no pod's: the report lists it
(`unplaced`), so that the agent counts the watchdog blind there. Nothing of it is touched.

Only the GPUs listed in a check are judged: a GPU missing from `processes` (its listing failed)
gives no usage row and no violation, and whoever reads the report keeps what it knew of them.
When a container's use is over its cap while some of its processes are being stopped, the
memory of those still within their SIGTERM grace period or their SIGKILL bound is left out in
judging whether to stop the others: a process started during another's grace period is stopped
only if the processes not being stopped are over the cap. An `unkillable` one (still running
after that bound) is not on its way out: its memory counts again, so a process beside it that
takes the container over its cap is stopped (the unkillable one itself is never signalled
again).
A step that cannot be done (a drain MPS does not answer, a signal the kernel refuses) fails
that process's stop only, is logged once, and is tried again at the next check.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ..clock import Clock, SystemClock
from .mps import errors as mps_errors
from .mps.control import client_servers, end_client
from .mps.errors import MpsError
from .process_killer import Killer, SignalKiller, _errno, _why_failed
from .procfs import (
    UNPINNED,
    Pin,
    PodContainer,
    Procfs,
    Unpinned,
    may_be_a_pod,
    parse_cgroup_path,
)
from .watchdog_types import (
    DRAIN,
    DRAINED,
    ESCALATED,
    FAILED,
    GONE,
    KILL,
    KILLED,
    POLICIES,
    REPORT,
    SIGNALLED,
    SKIPPED,
    TERMINATE,
    TERMINATED,
    UNKILLABLE,
    VIOLATION_REASON,
    Action,
    ContainerUsage,
    GpuProcessLike,
    ManagedContainer,
    MpsClientLike,
    MpsDrain,
    OwnerUnknown,
    Violation,
    WatchdogReport,
    _mib,
)

# The data types and constants live in `watchdog_types`, the killer in `process_killer`; they
# are re-exported here for the agent, the simulated killer and the tests, which import them
# from this module.
__all__ = [
    "DRAIN", "DRAINED", "ESCALATED", "FAILED", "GONE", "KILL", "KILLED", "POLICIES", "REPORT",
    "SIGNALLED", "SKIPPED", "TERMINATE", "TERMINATED", "UNKILLABLE", "VIOLATION_REASON",
    "Action", "ContainerUsage", "GpuProcessLike", "Killer", "ManagedContainer", "MpsClientLike",
    "MpsDrain", "OwnerUnknown", "SignalKiller", "Violation", "Watchdog", "WatchdogReport",
    "merge_listings",
]

log = logging.getLogger(__name__)


def merge_listings(*listings: Iterable[GpuProcessLike]) -> tuple[GpuProcessLike, ...]:
    """NVML's listings of one GPU (compute, graphics, MPS compute) as one: a row per pid, the
    one with the largest memory figure (NVML gives a process with contexts of several kinds in
    each listing, with its memory in each: counted once, never twice), first-listed order. A
    figure NVML does not have (None) is taken only where no listing has one."""
    rows: dict[int, GpuProcessLike] = {}
    for listing in listings:
        for p in listing:
            had = rows.get(p.pid)
            if had is None or (p.used_bytes is not None and (
                    had.used_bytes is None or p.used_bytes > had.used_bytes)):
                rows[p.pid] = p
    return tuple(rows.values())


class _Attribution:
    """Which managed container a GPU process's pod and container are, on a GPU (the module's
    docstring): by its container ID, else the pod's one container capped on that GPU."""

    def __init__(self, containers: Iterable[ManagedContainer]):
        self.containers: dict[tuple[str, str], ManagedContainer] = {}
        """(pod uid, container name) -> the container: every one, known ID or not."""
        self._by_id: dict[tuple[str, str], ManagedContainer] = {}
        self._by_pod: dict[str, list[ManagedContainer]] = {}
        for c in containers:
            self.containers[_ident(c)] = c
            if c.key is not None:
                self._by_id[c.key] = c
            self._by_pod.setdefault(c.pod_uid.lower(), []).append(c)

    def of(self, owner: PodContainer | bool | OwnerUnknown | None, device: str
           ) -> ManagedContainer | OwnerUnknown | None:
        """The container `owner`'s process on `device` counts for; None for none; OwnerUnknown
        where the pod has several containers capped there (the contract allows one)."""
        if not isinstance(owner, PodContainer):
            return None
        if owner.container_id is not None:
            known = self._by_id.get((owner.pod_uid, owner.container_id))
            if known is not None:
                return known
        capped = [c for c in self._by_pod.get(owner.pod_uid, ()) if device in c.caps]
        if len(capped) > 1:
            where = (f"container {owner.container_id}" if owner.container_id is not None
                     else "own cgroup")
            return OwnerUnknown(
                f"it runs in its pod {owner.pod_uid}'s {where}, which is none of the containers "
                f"the agent knows, and {len(capped)} of that pod's containers are capped on "
                "that GPU")
        return capped[0] if capped else None


def _ident(c: ManagedContainer) -> tuple[str, str]:
    return c.pod_uid.lower(), c.container_name


# ---------------------------------------------------------------------------- the watchdog


@dataclass(frozen=True, slots=True)
class _Over:
    """A violation, its container, the memory of each of its processes (pid, bytes), and the
    pod and container each of them was read in (pid -> owner) when it was counted."""

    violation: Violation
    container: ManagedContainer
    used: tuple[tuple[int, int], ...]
    owners: Mapping[int, PodContainer]


@dataclass
class _DrainState:
    """MPS clients, asked once per check and only when something is to be stopped."""

    clients: dict[int, int | None] | None = None
    error: MpsError | None = None


class Watchdog:
    def __init__(
        self,
        policy: str,
        procfs: Procfs,
        killer: Killer,
        mps_control: MpsDrain | None,
        clock: Clock | None = None,
    ):
        policy = str(getattr(policy, "value", policy))
        if policy not in POLICIES:
            raise ValueError(f"watchdog policy must be one of {', '.join(POLICIES)}, "
                             f"got {policy!r}")
        self.policy = policy
        self.procfs = procfs
        self.killer = killer
        self.mps = mps_control
        self.clock: Clock = clock or SystemClock()
        # pid -> (owner, pin), for the pids NVML reported in the last check. A GPU process keeps
        # its pid (and cgroup) for its lifetime, so re-reading /proc/<pid>/cgroup every second
        # for every process is wasted work; entries go as soon as NVML stops reporting the pid,
        # or their pin says the process exited (its pid may be another's now, listed by NVML
        # in the same place). Enforcement never trusts this cache: `_still_in` reads /proc
        # afresh before acting.
        self._owners: dict[int, tuple[PodContainer | bool | OwnerUnknown, Pin]] = {}
        self._attribution = _Attribution(())
        """The managed containers of the check in progress (`_still_in` reads it)."""
        self._read_now: set[int] = set()
        """The pids whose /proc entry this check has read (not from `_owners`)."""
        self._stopping: dict[int, tuple[str, str, str]] = {}
        """pid -> (GPU, pod uid, container) of each stop the killer has in progress: never
        drained nor signalled again, its outcome reported when the killer knows it."""
        self._unkillable: set[int] = set()
        """The pids of `_stopping` the killer reported UNKILLABLE: kept (never signalled again)
        until they exit, but their memory counts again in judging the others (`_enforce`)."""
        self._failing: dict[int, tuple[str, str]] = {}
        """pid -> (step, detail) of its last FAILED step: the same failure at the next check
        (each retries) is logged at debug level only."""
        if not procfs.own_pid_namespace:
            log.info("%s is not a /proc of the agent's pid namespace: the watchdog cannot hold "
                     "GPU processes by pidfd, and a pid reused between two checks is read again "
                     "only when its usage is over a cap", procfs.root)

    def check(
        self,
        processes: Mapping[str, Iterable[GpuProcessLike]],
        containers: Iterable[ManagedContainer],
        sm_percent: Mapping[int, int] | None = None,
    ) -> WatchdogReport:
        """`processes`: GPU UUID -> its processes (NVML, host pids), of every listing (a pid
        listed more than once counts once: `merge_listings`); `containers`: the managed
        containers and their caps; `sm_percent`: pid -> SM utilisation, if known."""
        processes = {device: merge_listings(procs) for device, procs in processes.items()}
        managed = self._attribution = _Attribution(containers)
        self._read_now = set()
        usage, violations, unmanaged, unplaced = self._account(processes, managed, sm_percent)
        # A violation is never reported on a cached owner: where no pin tells a reused pid (a
        # /proc of another pid namespace), it would count against the wrong container. Rare
        # and cheap: only the pids of violations are read again, until none rests on the
        # cache (each round reads at least one pid more).
        while stale := {p for o in violations for p in o.violation.pids} - self._read_now:
            for pid in stale:
                self._forget(pid)
            usage, violations, unmanaged, unplaced = self._account(processes, managed,
                                                                   sm_percent)
        seen = {proc.pid for procs in processes.values() for proc in procs}
        for pid in [pid for pid in self._owners if pid not in seen]:
            self._forget(pid)
        for pid in [pid for pid in self._failing if pid not in seen]:
            del self._failing[pid]
        actions: list[Action] = []
        if self.policy == KILL:
            actions = self.progress()
            if violations:
                actions += self._enforce(violations)
        return WatchdogReport(self.clock.monotonic(), tuple(o.violation for o in violations),
                              tuple(usage), tuple(actions), tuple(unmanaged), tuple(unplaced))

    def _account(
        self,
        processes: Mapping[str, Iterable[GpuProcessLike]],
        managed: _Attribution,
        sm_percent: Mapping[int, int] | None,
    ) -> tuple[list[ContainerUsage], list[_Over], list[tuple[str, int]],
               list[tuple[str, int, str]]]:
        """Usage per managed container and GPU listed, the violations, the unmanaged
        processes and those whose container cannot be told."""
        # ((pod uid, container name), device) -> [pids, (pid, used), unknown]
        found: dict[tuple[tuple[str, str], str],
                    tuple[list[int], list[tuple[int, int]], list[int]]] = {}
        owners: dict[int, PodContainer] = {}
        # pid -> the pod and container it was read in, for each pid counted for a container
        devices_of: dict[tuple[str, str], set[str]] = {}
        unmanaged: list[tuple[str, int]] = []
        unplaced: list[tuple[str, int, str]] = []
        for device, procs in processes.items():
            for proc in procs:
                owner = self._owner(proc.pid, cached=True)
                if owner is None:
                    continue  # vanished while we looked: nothing to account, nothing to touch
                if isinstance(owner, OwnerUnknown):
                    unplaced.append((device, proc.pid, owner.why))
                    continue
                container = managed.of(owner, device)
                if isinstance(container, OwnerUnknown):
                    unplaced.append((device, proc.pid, container.why))
                    continue
                if container is None:
                    unmanaged.append((device, proc.pid))
                    continue
                assert isinstance(owner, PodContainer)  # `of` places nothing else
                owners[proc.pid] = owner
                key = _ident(container)
                devices_of.setdefault(key, set()).add(device)
                pids, used, unknown = found.setdefault((key, device), ([], [], []))
                pids.append(proc.pid)
                if proc.used_bytes is None:
                    unknown.append(proc.pid)
                else:
                    used.append((proc.pid, proc.used_bytes))

        usage: list[ContainerUsage] = []
        violations: list[_Over] = []
        for key, c in managed.containers.items():
            devices = list(c.caps) + sorted(devices_of.get(key, set()) - set(c.caps))
            for device in devices:
                if device not in processes:
                    continue  # not listed this check: its usage is unknown, not 0
                pids, used, unknown = found.get((key, device), ([], [], []))
                total = sum(b for _pid, b in used)
                cap = c.caps.get(device)
                sm = None
                if sm_percent is not None and any(p in sm_percent for p in pids):
                    sm = sum(sm_percent.get(p, 0) for p in pids)
                usage.append(ContainerUsage(
                    c.pod_uid, c.container_name, c.container_id, device, total, cap,
                    tuple(pids), sm, tuple(unknown)))
                if cap is not None and total > cap:
                    violations.append(_Over(Violation(c.pod_uid, c.container_name,
                                                      c.container_id, device, total, cap,
                                                      tuple(pids)), c, tuple(used),
                                            {p: owners[p] for p in pids}))
        return usage, violations, unmanaged, unplaced

    # -------------------------------------------------------------------- mapping

    def _owner(self, pid: int, cached: bool = False
               ) -> PodContainer | bool | OwnerUnknown | None:
        """The pod/container of `pid`; False for a live process of no pod; OwnerUnknown for a
        live one whose pod cannot be told; None if it is gone."""
        if pid <= 1 or pid == os.getpid():
            return False
        entry = self._owners.get(pid)
        if cached and entry is not None and not entry[1].exited():
            return entry[0]
        self._forget(pid)
        self._read_now.add(pid)
        # Pinned before the read, alive after it: the cgroup read is the pinned process's.
        try:
            pin, keep = self.procfs.pin(pid), True
        except OSError:  # no file descriptor left to hold it: read it now, keep nothing
            pin, keep = UNPINNED, False
        if pin is None:
            return None
        unknown: OwnerUnknown | None = None
        try:
            path = self.procfs.cgroup_path(pid)
        except OSError as exc:  # hidepid=1, an LSM: there, but whose it is cannot be read
            path, unknown = None, OwnerUnknown(f"its cgroup cannot be read: {_errno(exc)}")
        if pin.exited():
            pin.close()
            return None
        if path is None and unknown is None and not isinstance(pin, Unpinned):
            # Alive by its pidfd, yet no /proc entry: hidden from the agent (hidepid=2).
            unknown = OwnerUnknown("its /proc entry is hidden from the agent")
        if unknown is not None:
            pin.close()  # not kept: read again at the next check, in case it can be then
            return unknown
        if path is None:
            pin.close()
            return None
        owner: PodContainer | bool | OwnerUnknown = parse_cgroup_path(path) or False
        if owner is False and may_be_a_pod(path):
            owner = OwnerUnknown(f"its cgroup {path} is relative to the agent's cgroup "
                                 "namespace and names no pod the agent can place")
        if keep:
            self._owners[pid] = (owner, pin)
        return owner

    def _forget(self, pid: int) -> None:
        entry = self._owners.pop(pid, None)
        if entry is not None:
            entry[1].close()

    def _still_in(self, pid: int, owner: PodContainer, container: ManagedContainer,
                  device: str) -> bool:
        """Whether `pid` (read afresh) is still in the pod and container it was counted in
        (`owner`: the same container ID, None included; a pid another container of the pod
        took meanwhile would count for `container` by the pod's rule, but is not the process
        counted), and still counts for `container` on `device`."""
        now = self._owner(pid)
        if not isinstance(now, PodContainer) or (now.pod_uid, now.container_id) != (
                owner.pod_uid, owner.container_id):
            return False
        counted = self._attribution.of(now, device)
        return isinstance(counted, ManagedContainer) and _ident(counted) == _ident(container)

    # -------------------------------------------------------------------- enforcement

    def progress(self) -> list[Action]:
        """The stops in progress whose state changed since the last check (the process may
        well be listed no more: it exited). Part of every kill-mode check, and called alone
        when no check can read usage (NVML down): signalling needs no NVML, and a process that
        ignores SIGTERM must not keep its GPU memory for as long as NVML fails."""
        if self.policy != KILL:
            return []
        actions: list[Action] = []
        for pid, outcome in self.killer.progress():
            device, pod_uid, name = self._stopping.get(pid, ("", "", ""))
            if outcome == UNKILLABLE and pid in self._stopping:
                self._unkillable.add(pid)
            elif outcome != ESCALATED:
                self._stopping.pop(pid, None)  # done: a later violation starts over
                self._unkillable.discard(pid)
            detail = _why_failed(self.killer, pid) if outcome == FAILED else ""
            actions.append(self._action(pid, device, pod_uid, name, TERMINATE, outcome, detail))
        return actions

    def _enforce(self, violations: Sequence[_Over]) -> list[Action]:
        actions: list[Action] = []
        drain = _DrainState()
        for over in violations:
            violation, container = over.violation, over.container
            # The memory of its processes being stopped is on its way out: a process started
            # meanwhile is stopped only if the others are over the cap without it. Not that of
            # an unkillable one: it may hold it for as long as the node runs.
            leaving = {pid for pid in self._stopping if pid not in self._unkillable}
            rest = sum(b for pid, b in over.used if pid not in leaving)
            if rest <= violation.cap_bytes:
                if any(pid not in leaving for pid in violation.pids):
                    log.debug("watchdog: %s/%s on %s is within its cap without the processes "
                              "being stopped (%s): no other is stopped", violation.pod_uid,
                              violation.container_name, violation.device_uuid, _mib(rest))
                continue
            for pid in violation.pids:
                if pid in self._stopping:
                    continue  # being stopped: drained already, its outcome comes from progress
                for step, outcome, detail in self._enforce_one(pid, over.owners[pid], container,
                                                               violation.device_uuid, drain):
                    if step == TERMINATE and outcome == SIGNALLED:
                        self._stopping[pid] = (violation.device_uuid, violation.pod_uid,
                                               violation.container_name)
                    actions.append(self._action(pid, violation.device_uuid, violation.pod_uid,
                                                violation.container_name, step, outcome, detail))
        return actions

    def _action(self, pid: int, device: str, pod_uid: str, name: str, step: str, outcome: str,
                detail: str) -> Action:
        level = logging.WARNING
        if outcome == FAILED:
            if self._failing.get(pid) == (step, detail):
                level = logging.DEBUG  # failed so at the last check too: retried, not news
            self._failing[pid] = (step, detail)
        else:
            self._failing.pop(pid, None)
        log.log(level, "watchdog %s pid %d of %s/%s on %s: %s %s", step, pid, pod_uid, name,
                device, outcome, detail)
        return Action(pid, device, pod_uid, name, step, outcome, detail)

    def _enforce_one(self, pid: int, owner: PodContainer, container: ManagedContainer,
                     device: str, drain: _DrainState) -> list[tuple[str, str, str]]:
        """Drain (when it is an MPS client), then terminate: the steps taken, in order. `owner`:
        the pod and container `pid` was counted in."""
        if not self._still_in(pid, owner, container, device):
            return [(TERMINATE, SKIPPED, "the process exited or left the container")]
        steps: list[tuple[str, str, str]] = []
        if self.mps is not None and container.mps_client:
            if drain.clients is None and drain.error is None:
                drain.clients, drain.error = self._mps_clients()
            if drain.error is not None:
                # Unknown whether it is an MPS client: killing it undrained could wedge the
                # server of every tenant. Retried at the next check.
                return [(DRAIN, FAILED, f"{drain.error.reason}: {drain.error.message}")]
            if drain.clients is not None and pid in drain.clients:
                try:
                    end_client(self.mps, pid, drain.clients[pid])
                    steps.append((DRAIN, DRAINED, ""))
                except MpsError as err:
                    # ClientNotFound: it left MPS since the list was read; nothing to drain
                    if err.reason != mps_errors.CLIENT_NOT_FOUND:
                        return [(DRAIN, FAILED, f"{err.reason}: {err.message}")]
        outcome = self.killer.terminate(
            pid, lambda: self._still_in(pid, owner, container, device))
        steps.append((TERMINATE, outcome,
                      _why_failed(self.killer, pid) if outcome == FAILED else ""))
        return steps

    def _mps_clients(self) -> tuple[dict[int, int | None] | None, MpsError | None]:
        """MPS client pid -> its server pid (None in v3, where `client terminate` needs none)."""
        assert self.mps is not None
        try:
            return client_servers(self.mps), None
        except MpsError as err:
            return None, err
