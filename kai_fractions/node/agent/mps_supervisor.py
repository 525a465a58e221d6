"""The MPS control daemon as the agent sees it (sm-sharing only): kept running, and drained of a
container's clients on request.

Every pass, and the worker's periodic MPS check between passes, makes sure the daemon runs and
asks whether it has namespaces (the v3 protocol). A daemon that was restarted knows nothing: the
restart is counted and the engine drops what it cached, so the pass applies everything again;
and the reconciler takes every cap it had put on the daemon before as gone until that apply
has put it back (`engine_mps.caps_not_on_daemon`), so an apply that fails at the new daemon (a
busy answer, a timeout) sets the markers that vouch for them aside rather than keep them.
The agent stops on shutdown only a daemon it started: one that already answered when the agent
first looked (started by someone else, or by an agent before a restart) is adopted and left
running. Drain (gRPC) ends the MPS client work of a container's processes; the processes
themselves are left to their owners.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

from ..desired import DesiredState
from ..errors import NodeError
from ..mps import errors as mps_errors
from ..mps.control import client_servers, end_client
from ..mps.errors import MpsError
from ..nvml import Nvml
from ..procfs import Procfs, normalize_container_id
from .metrics import AgentMetrics

log = logging.getLogger(__name__)


class MpsSupervisor(Protocol):
    """`kai_fractions.node.mps.MpsDaemon` (and the simulated one of `kai_fractions.sim`)."""

    control: Any
    restarts: int
    starts: int
    last_error: MpsError | None
    not_running: bool
    """Set by `ensure_running` when it says no: True when no daemon holds what was set through
    the supervisor (no daemon process is left: it died, its start failed, the supervisor backs
    off, the binary cannot be run; or the one running was started since and has not got its
    state back), False when a daemon process that may still hold it merely does not answer
    (slow, busy, not yet taken for wedged). `MpsDaemon.not_running` says how it is told."""
    on_restart: Any

    def ensure_running(self) -> bool: ...
    def healthy(self) -> bool: ...
    def stop(self, grace: float | None = None) -> bool: ...


class MpsHealth:
    def __init__(self, daemon: MpsSupervisor, metrics: AgentMetrics,
                 on_restart: Callable[[], None]):
        self.daemon = daemon
        self.metrics = metrics
        daemon.on_restart = lambda _control: on_restart()
        self.owned = False
        """Whether this agent started the daemon (only then it stops it)."""
        self._restarts = 0
        self._state: tuple[str, bool] | None = None
        """The daemon's error reason the last pass saw, and whether it was not running."""
        self.not_running = False
        """What the last check found (a pass's, or the periodic one's): the daemon is unusable
        because none runs that holds the MPS state the engine applied
        (`MpsSupervisor.not_running`), not because one that may hold it does not answer. Its
        namespaces, their percentages and its default pinned limits are then gone with it
        (`Engine.apply`'s `mps_not_running`)."""

    def check(self) -> tuple[bool | None, NodeError | None]:
        """(has v3 namespaces, None when the binary cannot say; why the daemon is unusable),
        for a pass; `not_running` says whether it is not running. Not known is not "no": the
        inventory then follows the driver (`take_inventory`), so a binary that fails its
        `--help` once does not make an r615 node's plans those of a daemon without namespaces
        (where mps-pinned is no tier, and a container it alone caps is refused)."""
        v3, error = self._check()
        self._state = self._state_of(error)
        return v3, error

    def needs_pass(self) -> bool:
        """The periodic check: supervise the daemon (restart it if it died) and say whether a
        pass is needed, i.e. it was restarted (its state must be applied again) or its health
        changed since the last pass. A healthy daemon costs one control command, not a pass."""
        restarts = self._restarts
        _, error = self._check()
        return self._restarts != restarts or self._state_of(error) != self._state

    def _state_of(self, error: NodeError | None) -> tuple[str, bool] | None:
        return None if error is None else (error.reason, self.not_running)

    def _check(self) -> tuple[bool | None, NodeError | None]:
        error: NodeError | None = None
        try:
            if not self.daemon.ensure_running():
                error = self.daemon.last_error or MpsError(
                    mps_errors.MPS_DAEMON_UNREACHABLE, "the MPS control daemon does not answer")
        except MpsError as e:
            error = e
        except OSError as e:  # its pipe or log directory cannot be made
            error = MpsError(mps_errors.MPS_DAEMON_UNREACHABLE,
                             f"the MPS control daemon cannot be started: {e}; check "
                             "--mps-pipe-dir and --mps-log-dir")
        self.not_running = error is not None and bool(self.daemon.not_running)
        # Ours only once we started one: a daemon found running (even one slow to answer at
        # the first look) is adopted, and left running at shutdown.
        self.owned = self.owned or self.daemon.starts > 0
        if self.daemon.restarts > self._restarts:
            self.metrics.mps_restarts.inc(self.daemon.restarts - self._restarts)
            self._restarts = self.daemon.restarts
            self.owned = True
            log.warning("the MPS control daemon was restarted (%s); its state is applied again",
                        getattr(self.daemon, "restart_cause", None) or "cause unknown")
        try:
            v3 = bool(self.daemon.control.supports_protocol_v3())
        except MpsError as e:
            return None, error or e
        return v3, error

    def stop(self) -> None:
        """On shutdown: stops the daemon if this agent started it (`owned`; the caller sets
        aside first the readiness markers that vouch for what goes with it:
        `Reconciler.close`)."""
        if not self.owned:
            return
        log.info("stopping the MPS control daemon this agent started")
        try:
            self.daemon.stop()
        except MpsError as e:
            log.warning("MPS control daemon stop: %s", e.message)


def drain(control: Any, desired: DesiredState, nvml: Nvml, procfs: Procfs, uid: str,
          container: str | None = None) -> list[int]:
    """Ends the MPS client work (`client terminate`) of the processes of a pod's containers (or
    one of them) on their GPUs; returns the pids drained. Raises MpsError / NvmlError."""
    mine = [c for c in desired.containers if c.key.pod_uid == uid
            and (not container or c.key.container == container) and c.container_id]
    pids: list[int] = []
    for c in mine:
        want = (uid.lower(), normalize_container_id(c.container_id or ""))
        for uuid in c.plan.device_uuids:
            for p in nvml.running_processes(uuid):
                owner = procfs.container_of(p.pid)
                if owner is not None and (owner.pod_uid, owner.container_id) == want \
                        and p.pid not in pids:
                    pids.append(p.pid)
    if not pids:
        return []
    clients = client_servers(control)
    return [pid for pid in pids if pid in clients and _ended(control, pid, clients[pid])]


def _ended(control: Any, pid: int, server: int | None) -> bool:
    """Ends one client's work; False when the client (or its server) had left MPS since the
    list was read: nothing to drain, and no reason to fail the drain of the others."""
    try:
        end_client(control, pid, server)
    except MpsError as e:
        if e.reason not in (mps_errors.CLIENT_NOT_FOUND, mps_errors.SERVER_NOT_FOUND):
            raise
        return False
    return True
