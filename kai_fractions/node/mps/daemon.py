"""Supervises the MPS control daemon: start it, tell whether it answers, restart it with bounded
exponential backoff, re-apply state after a restart, and stop it.

Facts about the real binary this relies on (535, checked here; v3 flags from NVIDIA's docs):
- `nvidia-cuda-mps-control -d` returns once the daemon listens (a few ms); the daemon detaches
  (daemon(3)), so its pid is not the child's. It writes NO pid file. It holds a POSIX write lock
  on `<pipe dir>/control_lock` for its whole life, so the lock's holder in `/proc/locks` IS the
  daemon's pid (no pgrep, no guessing by name). The lock file and sockets stay after it exits.
- A second `-d` on the same pipe directory prints `An instance of this daemon is already
  running` and exits 1, even when that instance is wedged: a hung daemon must be killed first.
- The 535 binary only honours `-d` as its sole argument (`-d -p 3` or `-d -m` fall into the
  interactive client mode), which is why v3 and multi-user flags are only added when asked for.
- `quit` is synchronous: the client returns once the daemon has exited. All settings made through
  the control channel (default pinned limit, active-thread percentage, namespaces) are lost when
  the daemon exits; `on_restart` puts them back.
- With a SIGSTOPped daemon a client hangs: health checks always run with a short timeout.
  A daemon that misses that timeout once is not wedged: it may only be slow (a loaded node, a
  server starting). Killing it kills every tenant's MPS clients, so a daemon process that holds
  the lock and does not answer is reported `MpsDaemonNotAnswering` and killed only after
  `wedged_checks` failed checks in a row spanning `wedged_after` seconds; one answer resets it.
Backoff never sleeps: while it runs, `ensure_running()` just returns False and the caller's
loop (level-triggered) calls again later.

Not running is not "not answering": every namespace, percentage and pinned limit dies with the
daemon's process, while a live daemon that does not answer may hold them all. `not_running`
says which, after each `ensure_running()` that said no: no process holds the lock (it died,
its start failed, the backoff runs, the binary cannot be run), or the daemon running was
launched since and has not answered with its state put back (it knows nothing), or the one
running is not adopted (`trust`: it holds nothing the agent set).

Which daemon is used, the one launched here or one adopted, and why one is not: `trust`.

A daemon whose pipe directory was removed (a cleanup script, a tmpfs remounted) still runs,
with its MPS servers and their clients, but no client can reach it and no lock file names it
any more. Before each start the supervisor looks for such daemons on its pipe directory (by
their environment, `processes.ProcDaemonProcesses.unreachable_daemons`) and stops them
(SIGTERM, then SIGKILL): otherwise every start would leave one more behind, unseen, and one
that outlives the agent. The clients that ran under it lost their daemon as at any restart:
the new daemon knows nothing until its state is put back (`not_running` meanwhile).

The logs in the log directory are kept under a size cap (`log_cap`) at every look.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections.abc import Callable

from ...clock import Clock, SystemClock
from . import errors as e
from .control import MpsControl, error_for_exit
from .errors import MpsError
from .log_cap import DEFAULT_MAX_BYTES, LogCap
from .processes import DAEMON_COMM, LOCK_FILE, DaemonProcesses, ProcDaemonProcesses
from .runner import CommandNotFound, CommandRunner, CommandTimeout
from .trust import DaemonTrust

__all__ = ["DAEMON_COMM", "LEGACY_DIR", "LOCK_FILE", "DaemonProcesses", "MpsDaemon",
           "ProcDaemonProcesses", "SystemClock", "legacy_pipe_dir"]

log = logging.getLogger(__name__)

LEGACY_DIR = "legacy"
"""Where a daemon without namespaces runs, under the server directory (`legacy_pipe_dir`)."""


def legacy_pipe_dir(root: str, server: str) -> str:
    """The pipe directory of a daemon without namespaces (drivers before r615): inside the
    server directory `<root>/<server>`, the one directory sm-sharing containers mount, so its
    clients reach it through their namespace links while a v3 daemon's own `control` socket, in
    `<root>`, stays outside every container."""
    return os.path.join(root, server, LEGACY_DIR)


RestartHook = Callable[[MpsControl], None]

_NO_ANSWER = frozenset({e.MPS_DAEMON_UNREACHABLE, e.MPS_BINARY_NOT_FOUND, e.PROTOCOL_UNSUPPORTED})


class MpsDaemon:
    """One control daemon per pipe directory, owned by the node agent."""

    def __init__(
        self,
        binary: str,
        pipe_dir: str,
        log_dir: str,
        runner: CommandRunner,
        clock: Clock | None = None,
        multi_user: bool = False,
        protocol_v3: bool | None = None,
        *,
        processes: DaemonProcesses | None = None,
        on_restart: RestartHook | None = None,
        server: str = "shared",
        health_timeout: float = 2.0,
        start_timeout: float = 10.0,
        stop_grace: float = 5.0,
        backoff_initial: float = 1.0,
        backoff_max: float = 60.0,
        stable_after: float = 60.0,
        poll_interval: float = 0.02,
        wedged_after: float = 30.0,
        wedged_checks: int = 3,
        log_max_bytes: int = DEFAULT_MAX_BYTES,
    ):
        self.binary = str(binary)
        self.root = str(pipe_dir)
        """The pipe root: a v3 daemon's pipe directory, whose `<server>/` holds the namespaces
        the containers mount (a daemon without namespaces runs in `legacy_pipe_dir`)."""
        self._pipe_dir: str | None = None
        self.log_dir = str(log_dir)
        self.runner = runner
        self.clock: Clock = clock or SystemClock()
        self.multi_user = multi_user
        self.processes: DaemonProcesses = processes or ProcDaemonProcesses()
        self.on_restart = on_restart
        self.health_timeout = health_timeout
        self.start_timeout = start_timeout
        self.stop_grace = stop_grace
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.stable_after = stable_after
        """A daemon that answered this long after its start ran: the backoff starts over. One
        that dies sooner counts as a failed start (it answered once, then crashed)."""
        self.poll_interval = poll_interval
        self.wedged_after = wedged_after
        self.wedged_checks = wedged_checks
        """A live daemon that does not answer is killed only after this many failed checks in
        a row (`ensure_running` calls) spanning at least `wedged_after` seconds."""
        self.control = MpsControl(self.binary, self.root, self.log_dir, runner, server,
                                  protocol_v3=protocol_v3, sleep=self.clock.sleep)
        self.logs = LogCap(self.log_dir, log_max_bytes)
        """control.log and server.log, cut once over `log_max_bytes` (at every look)."""
        self.restarts = 0
        """Starts (`-d` returned 0) after the first daemon this supervisor made or found,
        whether or not the new one answered in time: its state is put back either way."""
        self.starts = 0
        """Daemons this supervisor started (`-d` returned 0, answering in time or not); 0: it
        only ever found one running."""
        self.failures = 0
        """Consecutive failed starts, and starts of a daemon that died within `stable_after`
        (drives the backoff); 0 once one has run that long."""
        self.last_error: MpsError | None = None
        """Why the daemon is not running (or its state not applied) now; None when it is."""
        self.last_health_error: MpsError | None = None
        """What the last failed health check saw."""
        self.not_running = False
        """Whether the last `ensure_running` found no daemon that holds what was set through
        it (namespaces, their active-thread percentages, the default pinned limits): no daemon
        process is left (it died or was stopped, its start failed, the supervisor is backing
        off, the binary cannot be run), or the one running now was started since and has not
        answered with its state put back (a new daemon knows nothing). False while one answers,
        and while a daemon process that holds the lock does not answer (slow, busy, or not yet
        taken for wedged): that one may still hold its namespaces and serve its clients."""
        self._next_attempt = float("-inf")
        self._started_at = float("-inf")
        self._seen_running = False
        self._restart_pending = False
        """A daemon was launched after one had run: a restart, counted once one answers."""
        self._needs_reapply = False
        self._silent_since: float | None = None
        self._silent_checks = 0
        self.restart_cause: str | None = None
        """Why the last daemon was started: none answered (the one before died or was never
        there), the one before was wedged (killed), or it was cut off from its pipe directory
        (stopped); None before any start."""
        self.trust = DaemonTrust(self.clock.monotonic, self.pid, self.processes,
                                 lambda: self.control.env, lambda: self.pipe_dir)
        """Which daemon is used: the one launched here, or one adopted (`trust`)."""

    # ------------------------------------------------------------------ queries

    @property
    def protocol_v3(self) -> bool:
        """Whether this daemon runs (or will be started) with the v3 protocol."""
        return self.control.supports_protocol_v3()

    @property
    def pipe_dir(self) -> str:
        """This daemon's own pipe directory, by its binary's protocol (asked once; raises
        MpsError when the binary cannot be run): the root for a v3 daemon, `legacy_pipe_dir`
        for one without namespaces. The control client is pointed at it."""
        if self._pipe_dir is None:
            self._pipe_dir = (self.root if self.protocol_v3
                              else legacy_pipe_dir(self.root, self.control.server))
            self.control.pipe_dir = self._pipe_dir
        return self._pipe_dir

    def start_argv(self) -> list[str]:
        argv = [self.binary, "-d"]
        if self.protocol_v3:
            argv += ["-p", "3"]
        if self.multi_user:
            argv.append("-m")
        return argv

    def pid(self) -> int | None:
        try:
            directory = self.pipe_dir
        except MpsError:
            return None  # no binary to ask: no daemon of ours either
        return self.processes.daemon_pid(directory)

    def healthy(self) -> bool:
        """The daemon answers a cheap command within `health_timeout`. A dead daemon, a stale
        socket and a hung one all fail this; an answer that is an error (a v3 daemon without
        the server yet) still proves it is alive, and so does a daemon that stays busy with
        other clients (MpsDaemonBusy): restarting that one would kill every MPS workload on
        the node for nothing."""
        try:
            # (reading pipe_dir points the control client at the daemon's directory first)
            if self.pipe_dir == self.root:  # only a v3 daemon runs in the root
                # a v3 daemon makes every client follow its protocol: ask in v3
                self.control.namespace_list(timeout=self.health_timeout)
            else:
                self.control.get_server_list(timeout=self.health_timeout)
        except MpsError as err:
            if err.reason in _NO_ANSWER:
                self.last_health_error = err
                return False
        return True

    # ------------------------------------------------------------------ supervision

    def ensure_running(self) -> bool:
        """True when the daemon answers and its state is applied; starts or restarts it (at most
        once per backoff step) otherwise. Never sleeps for the backoff. Sets `not_running`.
        Cuts the logs that are over their cap first."""
        self.logs.check()
        running = False
        try:
            running = self._ensure_running()
            return running
        finally:
            self.not_running = not running and self._state_gone()

    def _state_gone(self) -> bool:
        """`not_running`, once `_ensure_running` said no: a daemon launched since that has not
        got its state back, or no daemon process at all. A process table that cannot be read
        proves nothing (False). A daemon not adopted holds nothing the agent set (True)."""
        if self._needs_reapply or self.trust.refusing:
            return True
        try:
            return self.pid() is None
        except OSError:
            return False

    def _ensure_running(self) -> bool:
        if self.healthy():
            self._silent_since, self._silent_checks = None, 0
            refusal = self.trust.adoption_refused()
            if refusal is not None:
                self.last_error = refusal
                return False
            self._answered()
            if self.clock.monotonic() - self._started_at >= self.stable_after:
                self.failures = 0
            return self._reapply_if_needed()
        if self._not_answering():
            return False
        now = self.clock.monotonic()
        if now < self._next_attempt:
            # Backing off: last_error still says why the last start failed, or, after a
            # daemon that died soon after its start (which answered, so no start failed), why
            # none runs now.
            if self.last_error is None:
                self.last_error = MpsError(
                    e.MPS_DAEMON_UNREACHABLE,
                    f"the MPS control daemon started on {self._pipe_dir or self.root} "
                    f"{now - self._started_at:g}s ago does not answer any more (it died, or "
                    "hung, soon after its start, as one before it did); it is started again "
                    f"at {self._next_attempt - self._started_at:g}s after that start "
                    f"(backoff); see {self.log_dir}/control.log")
            return False
        quick = now - self._started_at < self.stable_after  # the last one died soon
        try:
            argv = self.start_argv()  # (asks the binary its protocol: may fail too)
            self._launch(argv)
        except MpsError as err:
            return self._start_failed(err)
        self._launched()
        try:
            self._await_answer(argv)
        except MpsError as err:
            return self._start_failed(err)
        self.trust.adoption_refused()  # ours: trusted, its pid noted
        self._answered()
        # Started. One that answers once and dies again at once must not be restarted on every
        # call (each restart runs a pass, whose check restarts it again): a start soon after
        # the last one counts toward the backoff the next restart waits.
        if quick:
            self.failures += 1
        self._next_attempt = self._started_at + (self._delay() if self.failures else 0.0)
        return self._reapply_if_needed()

    def _launched(self) -> None:
        """`-d` returned 0: a daemon this supervisor started runs, answering or not yet. It is
        ours (stopped at shutdown), and it knows nothing (settings die with the process): the
        state is put back whenever it first answers, in this call or a later one, before it
        is reported as running. It is a restart when one ran before, counted when it answers:
        a daemon that dies before it ever does is a failed start, not a restart per try."""
        self.starts += 1
        self._started_at = self.clock.monotonic()
        self._restart_pending = self._restart_pending or self._seen_running
        self._needs_reapply = True
        self.trust.launched()

    def _answered(self) -> None:
        """A daemon answered: if it is a restart, it counts now."""
        if self._restart_pending:
            self.restarts += 1
            self._restart_pending = False
        self._seen_running = True

    def _start_failed(self, err: MpsError) -> bool:
        """Why the start failed, and the backoff before the next one."""
        self.last_error = err
        self.failures += 1
        delay = self._delay()
        self._next_attempt = self.clock.monotonic() + delay
        log.warning("MPS control daemon start failed (%s: %s); next try in %gs",
                    err.reason, err.message, delay)
        return False

    def _not_answering(self) -> bool:
        """True (with `last_error` saying so) while a live daemon that failed its health check
        is given time: killing it would kill every tenant's MPS clients, and a daemon that
        is only slow answers again. False when no daemon process is left (start one) or it
        has stayed silent for `wedged_checks` checks over `wedged_after` seconds (wedged:
        `_launch` kills it first). A lock holder other than the trusted daemon is taken for
        wedged only once its environment shows it numbers the GPUs as the agent's own starts
        do (`DaemonTrust.foreign_refusal`): one that does not, or cannot be read, is
        another's, reported (True, MpsDaemonAlreadyRunning) and never killed, silent or not."""
        pid = self.pid()
        if pid is None:
            self._silent_since, self._silent_checks = None, 0
            return False
        if not self.trust.trusts(pid):
            refusal = self.trust.foreign_refusal(pid)
            if refusal is not None:  # not adopted: not ours to kill, silent or not
                self._silent_since, self._silent_checks = None, 0
                self.last_error = refusal
                return True
        now = self.clock.monotonic()
        if self._silent_since is None:
            self._silent_since = now
        self._silent_checks += 1
        silent_for = now - self._silent_since
        if self._silent_checks >= self.wedged_checks and silent_for >= self.wedged_after:
            log.warning("MPS control daemon pid %d on %s has not answered %d checks over %gs: "
                        "taken as wedged", pid, self.pipe_dir, self._silent_checks, silent_for)
            self._silent_since, self._silent_checks = None, 0
            return False
        seen = self.last_health_error
        self.last_error = MpsError(
            e.MPS_DAEMON_NOT_ANSWERING,
            f"the MPS control daemon pid {pid} on {self.pipe_dir} runs but has not answered "
            f"for {silent_for:g}s ({self._silent_checks} check(s); last: "
            f"{seen.message if seen else 'no answer'}); it is killed and restarted once it has "
            f"not answered {self.wedged_checks} checks over {self.wedged_after:g}s")
        if self._silent_checks == 1:
            log.warning("%s", self.last_error.message)
        return True

    def _delay(self) -> float:
        return min(self.backoff_max, self.backoff_initial * 2 ** (self.failures - 1))

    def _reapply_if_needed(self) -> bool:
        if not self._needs_reapply or self.on_restart is None:
            self._needs_reapply = False
            self.last_error = None
            return True
        try:
            self.on_restart(self.control)
        except MpsError as err:
            # Stay "not ready" and try again on the next call: a daemon without its state
            # must not count as enforcing.
            self.last_error = err
            log.warning("re-applying MPS state after a restart failed (%s: %s)",
                        err.reason, err.message)
            return False
        self._needs_reapply = False
        self.last_error = None
        return True

    def _launch(self, argv: list[str]) -> None:
        """Runs `-d` (after killing a wedged daemon); raises MpsError when it fails."""
        for directory in (self.pipe_dir, self.log_dir):
            os.makedirs(directory, mode=0o755, exist_ok=True)
            # makedirs' mode is masked by the umask; the client sockets need 0755 exactly
            os.chmod(directory, 0o755)
        causes = [cause for cause in (self._kill_wedged(), self._stop_unreachable()) if cause]
        self.restart_cause = ("; ".join(causes) if causes
                              else f"no MPS control daemon answered on {self.pipe_dir}")
        if self._seen_running:
            log.warning("restarting the MPS control daemon: %s", self.restart_cause)
        try:
            result = self.runner.run(argv, env=self.control.env, timeout=self.start_timeout)
        except CommandTimeout as exc:
            raise MpsError(
                e.MPS_DAEMON_UNREACHABLE,
                f"{' '.join(argv)} did not return within {self.start_timeout:g}s") from exc
        except CommandNotFound as exc:
            raise MpsError(e.MPS_BINARY_NOT_FOUND,
                           f"{exc.message}; point --mps-control-binary at "
                           "nvidia-cuda-mps-control") from exc
        if result.returncode != 0:
            raise error_for_exit(result, " ".join(argv[1:]), binary=self.binary,
                                 pipe_dir=self.pipe_dir)

    def _await_answer(self, argv: list[str]) -> None:
        """Waits up to `start_timeout` for the daemon just launched to answer; raises
        MpsDaemonUnreachable when it does not (it may yet, at a later check)."""
        deadline = self.clock.monotonic() + self.start_timeout
        while True:
            if self.healthy():
                log.info("MPS control daemon running on %s (pid %s)", self.pipe_dir, self.pid())
                return
            if self.clock.monotonic() >= deadline:
                raise MpsError(
                    e.MPS_DAEMON_UNREACHABLE,
                    f"the MPS control daemon started with {' '.join(argv)} does not answer on "
                    f"{self.pipe_dir} after {self.start_timeout:g}s; see "
                    f"{self.log_dir}/control.log")
            self.clock.sleep(self.poll_interval)

    def _kill_wedged(self) -> str | None:
        """A daemon that holds the lock but does not answer blocks every new start (reached
        only once `_not_answering` gave it up, or when it appeared during a start). Returns
        the cause of the restart when there was one. One that is not the trusted daemon and
        whose environment is not the agent's (`DaemonTrust.foreign_refusal`) is not killed:
        the start fails with that refusal instead."""
        pid = self.pid()
        if pid is None:
            return None
        if not self.trust.trusts(pid):
            refusal = self.trust.foreign_refusal(pid)
            if refusal is not None:
                raise refusal
        log.warning("MPS control daemon pid %d holds %s but does not answer: killing it",
                    pid, self.pipe_dir)
        self.processes.kill(pid, signal.SIGKILL)
        self._wait_gone(pid, self.stop_grace)
        return f"the MPS control daemon pid {pid} on {self.pipe_dir} did not answer: killed"

    def _stop_unreachable(self) -> str | None:
        """Stops the daemons started on this pipe directory that no client can reach any more
        (it, or its lock file, was removed under them): SIGTERM, then SIGKILL after
        `stop_grace`. Returns the cause of the restart when there were any."""
        pids = self.processes.unreachable_daemons(self.pipe_dir)
        for pid in pids:
            log.warning("MPS control daemon pid %d was started on %s but can no longer be "
                        "reached (its pipe directory or lock file was removed): stopping it; "
                        "its MPS clients lost their daemon", pid, self.pipe_dir)
            self.processes.kill(pid, signal.SIGTERM)
        for pid in pids:
            if not self._wait_gone(pid, self.stop_grace):
                self.processes.kill(pid, signal.SIGKILL)
                self._wait_gone(pid, self.stop_grace)
        if not pids:
            return None
        return (f"the MPS control daemon{'s' if len(pids) > 1 else ''} pid "
                f"{', '.join(map(str, pids))} on {self.pipe_dir} could no longer be reached "
                "(its pipe directory or lock file was removed): stopped")

    def _wait_gone(self, pid: int, grace: float) -> bool:
        deadline = self.clock.monotonic() + grace
        while self.processes.is_alive(pid):
            if self.clock.monotonic() >= deadline:
                return False
            self.clock.sleep(self.poll_interval)
        return True

    def stop(self, grace: float | None = None) -> bool:
        """`quit`, then SIGKILL if the daemon is still alive after `grace` seconds, and the
        daemons on this pipe directory that can no longer be reached. True when no daemon is
        left. A daemon that was not adopted is not this supervisor's to stop: left running
        (False)."""
        grace = self.stop_grace if grace is None else grace
        with contextlib.suppress(MpsError):  # no binary to ask: no directory of ours either
            self._stop_unreachable()
        pid = self.pid()
        if self.trust.refused(pid):
            log.info("MPS control daemon pid %s on %s was not adopted: left running", pid,
                     self._pipe_dir or self.root)
            return False
        try:
            self.control.quit(timeout=grace)
        except MpsError as err:
            if err.reason != e.MPS_DAEMON_UNREACHABLE:
                log.warning("MPS quit failed (%s: %s)", err.reason, err.message)
        pid = pid or self.pid()
        if pid is None or self._wait_gone(pid, grace):
            return True
        log.warning("MPS control daemon pid %d ignored quit for %gs: killing it", pid, grace)
        self.processes.kill(pid, signal.SIGKILL)
        return self._wait_gone(pid, grace)
