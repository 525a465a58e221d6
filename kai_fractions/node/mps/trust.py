"""Which control daemon on a pipe directory the supervisor (`daemon.MpsDaemon`) may use: the one
it launched, or one it adopted.

A daemon this supervisor did not launch is adopted only when its environment
(`/proc/<pid>/environ`) numbers the GPUs as the agent's own starts do (`adoption`); one that
does not, or whose environment cannot be read, is reported (MpsDaemonAlreadyRunning, naming
the variable) and left running, never used, never stopped: other workloads may use it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from . import adoption
from . import errors as e
from .errors import MpsError
from .processes import LOCK_FILE, DaemonProcesses

# The supervisor's logger, as before this module was split out of it (log configurations and
# the `%(name)s` of its lines name the daemon module).
log = logging.getLogger(f"{__package__}.daemon")

_NOBODY = object()
TRUST_RECHECK_SECONDS = 10.0
"""How long the pid of a daemon that answers is taken to be the trusted one's without reading
/proc/locks again (a read costs milliseconds on some hosts, and every pass and 5 s check asks):
a daemon that replaced it meanwhile is found this much later at most."""


class DaemonTrust:
    """The daemon known to be usable on one pipe directory, and the one refused (with why).

    Reads through what it is given, called at each look: `monotonic` (the clock),
    `lock_holder` (the pid holding the pipe directory's lock, None when none is seen),
    `processes` (`is_alive`, `environ`), `env` (the agent's own start environment) and
    `pipe_dir` (the daemon's pipe directory, as messages name it)."""

    def __init__(
        self,
        monotonic: Callable[[], float],
        lock_holder: Callable[[], int | None],
        processes: DaemonProcesses,
        env: Callable[[], dict[str, str]],
        pipe_dir: Callable[[], str],
    ):
        self._monotonic = monotonic
        self._lock_holder = lock_holder
        self._processes = processes
        self._env = env
        self._pipe_dir = pipe_dir
        self._launched_unseen = False
        """A daemon this supervisor launched has not answered yet: the next to answer is it."""
        self._trusted: int | object | None = _NOBODY
        """The pid of the daemon known to be usable: the one launched here (None when /proc
        does not show its pid), or one adopted after its environment was checked."""
        self._trusted_seen_at = float("-inf")
        """When the answering daemon's pid was last read to be the trusted one's."""
        self._refused: tuple[int | None, MpsError] | None = None
        """The daemon not adopted (its pid) and why; None while the daemon is usable."""
        self._recheck = False
        """`_refused` holds only until the next look: its environment could not be read yet
        (a process still starting, or exiting), which proves nothing either way."""

    @property
    def refusing(self) -> bool:
        """A daemon is not adopted now (it holds nothing the agent set)."""
        return self._refused is not None

    def refused(self, pid: int | None) -> bool:
        """`pid` is the daemon not adopted."""
        return self._refused is not None and self._refused[0] == pid

    def trusts(self, pid: int | None) -> bool:
        """`pid` is the trusted daemon's."""
        return pid == self._trusted

    def launched(self) -> None:
        """A daemon was launched here: the next to answer is it, whatever was refused before."""
        self._launched_unseen = True
        self._refused, self._recheck = None, False

    def adoption_refused(self) -> MpsError | None:
        """None when the daemon that answers may be used: the one launched here (its pid is
        noted at its first answer), or one whose environment was checked (`adoption`). Why it
        is not adopted otherwise (logged once per daemon). A daemon not adopted is neither
        used nor stopped."""
        now = self._monotonic()
        if (self._trusted is not _NOBODY and not self._launched_unseen
                and now - self._trusted_seen_at < TRUST_RECHECK_SECONDS):
            return None
        pid = self._lock_holder()
        if self._launched_unseen:
            self._launched_unseen, self._trusted = False, pid
            self._refused, self._recheck = None, False
            self._trusted_seen_at = now
            return None
        trusted = self._trusted
        if trusted is not _NOBODY:
            if pid == trusted:
                self._trusted_seen_at = now
                return None
            if pid is None and (trusted is None or self._processes.is_alive(int(trusted))):
                return None  # no lock holder seen: the trusted one, which still runs
            if pid is None:  # it answered, then exited: none runs now, not a stranger
                return MpsError(
                    e.MPS_DAEMON_UNREACHABLE,
                    f"the MPS control daemon pid {trusted} on {self._pipe_dir()} answered, then "
                    "exited; the supervisor starts another")
        refusal = self.foreign_refusal(pid)
        if refusal is None:
            log.info("MPS control daemon pid %d on %s, not started by this agent, numbers the "
                     "GPUs as the agent does: adopted", pid, self._pipe_dir())
            self._trusted, self._refused, self._recheck = pid, None, False
            self._trusted_seen_at = now
        return refusal

    def foreign_refusal(self, pid: int | None) -> MpsError | None:
        """Why the lock holder `pid`, not the trusted daemon, is not the agent's: its
        environment numbers the GPUs otherwise, or cannot be read (`adoption`); None when it
        numbers them as the agent's own starts do (one this agent launched before a restart
        of its own, say). A refusal is remembered for that pid (`_refused`, logged once),
        except one whose environment could not be read yet, checked again at the next look."""
        if self._refused is not None and self._refused[0] == pid and not self._recheck:
            return self._refused[1]
        refusal, final = self._check_environment(pid)
        if refusal is None:
            self._refused, self._recheck = None, False  # whatever was refused holds no lock now
            return None
        if self._refused is None or self._refused != (pid, refusal):
            log.warning("%s", refusal.message)
        self._refused, self._recheck = (pid, refusal), not final
        return refusal

    def _check_environment(self, pid: int | None) -> tuple[MpsError | None, bool]:
        """The adoption check of `pid`'s environment, and whether its answer is final (False:
        the environment could not be read yet, the process starting or exiting, or reads
        empty, or no process holds the lock)."""
        if pid is None:  # (or the daemon exited right after it answered: looked at again)
            return adoption.unreadable(
                None, self._pipe_dir(), f"no process holds {self._pipe_dir()}/{LOCK_FILE} in "
                "/proc/locks; the agent must run in the host's pid namespace"), False
        try:
            env = self._processes.environ(pid)
        except OSError as err:
            return adoption.unreadable(pid, self._pipe_dir(), f"/proc/{pid}/environ: {err}"), True
        if env is None:
            return adoption.unreadable(
                pid, self._pipe_dir(), f"/proc/{pid}/environ cannot be read yet: the process is "
                "starting or exiting (it is checked again at the next look)"), False
        # An empty one is looked at again too: what /proc shows of a process caught between
        # the steps of its exec, and no daemon the agent starts (it passes its pipe directory).
        return (adoption.environment_problem(pid, env, self._env(), self._pipe_dir()),
                bool(env))
