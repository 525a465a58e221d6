"""The seam through which every external command of the MPS enforcer runs.

`SubprocessRunner` runs it for real; `RecordingRunner` records each call (argv, stdin, env) and
answers from scripted responses, so tests pin the exact argv and env without a daemon.
"""

from __future__ import annotations

import os
import subprocess
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class CommandResult:
    returncode: int
    stdout: str
    stderr: str


class RunnerError(Exception):
    """The command could not be run to completion (as opposed to running and failing)."""

    def __init__(self, argv: Sequence[str], message: str):
        super().__init__(message)
        self.argv = tuple(argv)
        self.message = message


class CommandTimeout(RunnerError):
    """It did not finish within the timeout and was killed."""

    def __init__(self, argv: Sequence[str], timeout: float):
        super().__init__(argv, f"{argv[0]} did not finish within {timeout:g}s")
        self.timeout = timeout


class CommandNotFound(RunnerError):
    """The executable does not exist or cannot be executed."""


class CommandRunner(Protocol):
    def run(
        self,
        argv: Sequence[str],
        stdin: str | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float = 10,
    ) -> CommandResult: ...


# Only these are taken from the agent's own environment: anything else (a stray
# CUDA_MPS_ACTIVE_THREAD_PERCENTAGE or CUDA_VISIBLE_DEVICES) would silently change what the
# control daemon does. Callers pass every variable that matters explicitly.
INHERITED_ENV = ("PATH", "LANG", "LC_ALL")


class SubprocessRunner:
    """Runs the command with `stdin` as input (never the agent's own stdin: the MPS client
    reads commands from it until EOF, and an old binary ignores its argv and does the same)."""

    def __init__(self, inherit: Sequence[str] = INHERITED_ENV):
        self._inherit = tuple(inherit)

    def run(
        self,
        argv: Sequence[str],
        stdin: str | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float = 10,
    ) -> CommandResult:
        full_env = {k: os.environ[k] for k in self._inherit if k in os.environ}
        full_env.update(env or {})
        try:
            done = subprocess.run(
                list(argv), input=stdin if stdin is not None else "", env=full_env,
                capture_output=True, text=True, timeout=timeout, check=False,
                errors="replace",
            )
        except subprocess.TimeoutExpired as e:
            raise CommandTimeout(argv, timeout) from e
        except (FileNotFoundError, PermissionError, NotADirectoryError) as e:
            raise CommandNotFound(argv, f"cannot execute {argv[0]}: {e.strerror or e}") from e
        return CommandResult(done.returncode, done.stdout, done.stderr)


@dataclass(frozen=True, slots=True)
class RecordedCall:
    argv: tuple[str, ...]
    stdin: str | None
    env: dict[str, str] | None
    timeout: float


Response = CommandResult | str | BaseException | Callable[[RecordedCall], CommandResult]
"""A scripted answer: a result, plain stdout (exit 0), an exception to raise, or a function."""


class RecordingRunner:
    """A fake runner: records every call and answers from scripted responses.

    `respond(argv, *responses, stdin=...)` queues answers for calls with that argv (and, when
    given, that exact stdin); each call takes the next one and the last one repeats. Calls that
    match nothing get `default` (exit 0, no output), like a daemon with nothing to say.
    """

    def __init__(self, default: Response | None = None):
        self.calls: list[RecordedCall] = []
        self._scripts: dict[tuple[tuple[str, ...], str | None], deque[Response]] = {}
        self._default: Response = default if default is not None else CommandResult(0, "", "")

    def respond(
        self, argv: Sequence[str], *responses: Response, stdin: str | None = None
    ) -> RecordingRunner:
        if not responses:
            raise ValueError("respond() needs at least one response")
        self._scripts[(tuple(argv), stdin)] = deque(responses)
        return self

    def run(
        self,
        argv: Sequence[str],
        stdin: str | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float = 10,
    ) -> CommandResult:
        call = RecordedCall(tuple(argv), stdin, dict(env) if env is not None else None, timeout)
        self.calls.append(call)
        queue = self._scripts.get((call.argv, stdin)) or self._scripts.get((call.argv, None))
        if queue is None:
            response = self._default
        else:
            response = queue.popleft() if len(queue) > 1 else queue[0]
        if isinstance(response, BaseException):
            raise response
        if isinstance(response, str):
            return CommandResult(0, response, "")
        if callable(response):
            return response(call)
        return response

    @property
    def argvs(self) -> list[tuple[str, ...]]:
        return [c.argv for c in self.calls]

    @property
    def stdins(self) -> list[str | None]:
        return [c.stdin for c in self.calls]
