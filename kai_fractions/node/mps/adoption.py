"""Whether a control daemon the agent did not start may be adopted: it must number the GPUs as the
agent's own daemons do, since every pinned limit is set (and read back) by NVML index.

The agent starts its daemons with `CUDA_DEVICE_ORDER=PCI_BUS_ID` and no `CUDA_VISIBLE_DEVICES`
(`control.control_env`; the runner passes nothing else of the agent's own environment that
CUDA reads). A daemon started otherwise (another tool, an operator's shell) numbers the GPUs
fastest first, or only those `CUDA_VISIBLE_DEVICES` lists, renumbered: a limit the agent sets
"on GPU 0" lands on another GPU (on a node with GPUs of mixed kinds, or any node for the
latter), and the readback, by the same wrong number, agrees. The daemon's environment is read
from `/proc/<pid>/environ`; one that cannot be read is not guessed at.
"""

from __future__ import annotations

from ..errors import NodeError
from . import errors as e
from .control import ENV_DEVICE_ORDER
from .errors import MpsError

ENV_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
CHECKED = (ENV_DEVICE_ORDER[0], ENV_VISIBLE_DEVICES)
"""The variables a daemon must hold as the agent's own start gives them (absent: unset)."""

_WHY = {
    ENV_DEVICE_ORDER[0]: "CUDA then numbers the GPUs fastest first, not by PCI bus as NVML does",
    ENV_VISIBLE_DEVICES: "it hides and renumbers the GPUs",
}


NOT_USABLE = "the MPS control daemon that runs is not one the agent can use"
"""How a daemon not adopted (MpsDaemonAlreadyRunning) is named wherever what it lacks is
reported: it runs, so "not running" (and "the agent starts it again") would send the reader to
the wrong fix."""


def not_usable(error: NodeError) -> str:
    """`NOT_USABLE`, with `error` (MpsDaemonAlreadyRunning: why it is not adopted)."""
    return f"{NOT_USABLE} ({error.reason}: {error.message})"


def stop_it(pipe_dir: str | None = None) -> str:
    """What to do about a daemon not adopted: stop it (the command, where `pipe_dir` is known;
    else the refusal quoted before names it), or leave the pipe directory to the agent."""
    how = (f" (`echo quit | CUDA_MPS_PIPE_DIRECTORY={pipe_dir} nvidia-cuda-mps-control`, or "
           "`-q` for a v3 daemon)" if pipe_dir is not None
           else " (the MpsDaemonAlreadyRunning reason above has the command)")
    return (f"stop {'it' if pipe_dir is not None else 'that daemon'}{how} and the agent starts "
            "its own, or let the agent alone own the pipe directory")


def _what_to_do(pipe_dir: str) -> str:
    return ("it is not adopted (nothing is applied through it, and it is left running): "
            + stop_it(pipe_dir))


def environment_problem(pid: int, env: dict[str, str], expected: dict[str, str],
                        pipe_dir: str) -> MpsError | None:
    """None when the daemon's `env` agrees with `expected` (the agent's own start environment)
    on every `CHECKED` variable; otherwise why it is not adopted, naming each variable, its
    value, and what to do (reason MpsDaemonAlreadyRunning: a daemon the agent cannot use
    holds the pipe directory)."""
    wrong = []
    for name in CHECKED:
        have, want = env.get(name), expected.get(name)
        if have == want:
            continue
        wanted = f"{name}={want}" if want is not None else f"no {name}"
        shown = f"{name} unset" if have is None else f"{name}={have!r}"
        wrong.append(f"{shown} ({wanted} expected: {_WHY[name]})")
    if not wrong:
        return None
    return MpsError(
        e.DAEMON_ALREADY_RUNNING,
        f"the MPS control daemon pid {pid} on {pipe_dir} was not started by this agent and runs "
        f"with {'; '.join(wrong)}, so a pinned limit the agent sets by NVML index would land on "
        f"another GPU; {_what_to_do(pipe_dir)}")


def unreadable(pid: int | None, pipe_dir: str, why: str) -> MpsError:
    """Why a daemon whose environment cannot be read (or whose process cannot be found) is not
    adopted."""
    who = "whose process cannot be found" if pid is None else f"pid {pid}"
    return MpsError(
        e.DAEMON_ALREADY_RUNNING,
        f"the MPS control daemon {who} on {pipe_dir} was not started by this agent, and its "
        f"environment cannot be checked ({why}): whether it numbers the GPUs as the agent "
        f"does ({ENV_DEVICE_ORDER[0]}={ENV_DEVICE_ORDER[1]}, no {ENV_VISIBLE_DEVICES}) is "
        f"unknown; {_what_to_do(pipe_dir)}")
