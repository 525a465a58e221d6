"""What the MPS control daemon prints, and how its answers and the client's exits are read.

Separate from `control` (which runs the commands): these are the daemon's texts, pinned against
the real binary where one was at hand, and the few parsers that turn them into values or
`MpsError`s; the supervisor (`daemon`) maps the client's exits through `error_for_exit` too.

The client exits 0 even when the daemon rejects a command, so every answer is parsed from
stdout. What the real 535 daemon does (checked against the binary):
- unknown commands print `Unknown command "x"`; commands on a missing server `Server N not found`;
- other rejections (`Invalid device ordinal!`, `Invalid percentage ...`) are written ONLY to
  control.log, never to the client. So every setter reads its value back and compares;
- a pinned limit reads back in whole GiB once it reaches 1 GiB, truncated (`1536M` -> `1G`,
  `4096M` -> `4G`): compare with `displayed_mem_limit`, not by parsing the readback as exact;
- the set default active-thread percentage is echoed back (`25.0`);
- with no daemon the client exits 1 with `Cannot find MPS control daemon process` on stderr;
- the old binary ignores argv it does not know (`-p 3 ...`) and reads commands from stdin, so a
  v3 command "succeeds" with no output: v3 support is probed from `--help` instead.
- v3 (NVIDIA's "MPS v3 Interface"; not testable here, no r615 binary): `namespace get <n>
  <server> <field>` prints one unformatted field (`pipe-directory`, `active-thread-percentage`,
  ...): a namespace's percentage is read back through it. What `client terminate` and
  `namespace delete` print on success is pinned nowhere: a known failure text fails them,
  silence or an answer that reads as done passes, and any other answer is judged by reading
  back `client list` / `namespace list`.
"""

from __future__ import annotations

import re

from . import errors as e
from .errors import MpsError
from .runner import CommandResult

CLIENT_LIST_COLUMNS = ("pid", "server", "device", "namespace", "cmd")
"""Columns of `client list --format=csv,noheader` (v3) as NVIDIA's "MPS v3 Interface" shows
them (`51023,training,0,default,python train.py`; not checked against an r615 binary here).
Only `pid` (first) and `namespace` are used. A line of three columns is read as `pid, server,
namespace` (what `control` assumed before), and so is a longer one whose third column is not
a device (an ordinal or a GPU/MIG UUID)."""
_DEVICE_RE = re.compile(r"\d+|(?:GPU|MIG)-[0-9A-Fa-f-]+")

_MIB_PER_GIB = 1024


def displayed_mem_limit(mib: int) -> str:
    """How the daemon prints a pinned limit set to `mib` MiB: whole GiB (truncated) from 1 GiB."""
    if mib >= _MIB_PER_GIB:
        return f"{mib // _MIB_PER_GIB}G"
    return f"{mib}M"


_LIMIT_RE = re.compile(r"(\d+)([MG])")
_PCT_RE = re.compile(r"(\d+(?:\.\d+)?)\s*%?")


def parse_mem_limit(text: str) -> int | None:
    """MiB shown by a pinned-limit readback (`4G` -> 4096, `7M` -> 7); None when unset (empty).

    A GiB readback is a lower bound of what was set (`1536M` reads back as `1G`)."""
    text = text.strip()
    if not text:
        return None
    m = _LIMIT_RE.fullmatch(text)
    if m is None:
        raise ValueError(f"not a pinned memory limit: {text!r}")
    value = int(m.group(1))
    return value * _MIB_PER_GIB if m.group(2) == "G" else value


# Patterns of the daemon's answers, checked line by line, first match wins. The legacy texts are
# the real 535 daemon's; the v3 ones are deliberately broad (the exact r615 wording is not
# pinned anywhere we can test) and only pick the reason: the message always quotes the daemon.
_ANSWER_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(p, re.IGNORECASE), reason) for p, reason in (
        (r"^Unknown command\b", e.UNKNOWN_COMMAND),
        (r"\bclient\b.*\b(not found|does not exist|doesn't exist)|\bno such client\b",
         e.CLIENT_NOT_FOUND),
        (r"\bnamespace\b.*\b(not found|does not exist|doesn't exist)|\bno such namespace\b",
         e.NAMESPACE_NOT_FOUND),
        (r"\bserver\b.*\b(not found|does not exist|doesn't exist)|\bno such server\b",
         e.SERVER_NOT_FOUND),
        (r"\bclients?\b.*\b(attached|connected|active|running)\b|\b(busy|in use)\b",
         e.NAMESPACE_BUSY),
        (r"\balready exists?\b", e.NAMESPACE_EXISTS),
        (r"\b(invalid|out of range|must be|expected)\b", e.INVALID_ARGUMENT),
        (r"\b(error|fail(ed|ure)?|cannot|can't|could not|couldn't|unable|denied|"
         r"not supported|unsupported|not permitted|not allowed|rejected|refused|"
         r"unrecognized|unknown|usage)\b", e.COMMAND_FAILED),
    )
)

_DONE_RE = re.compile(
    r"(ok|done|success(ful(ly)?)?"
    r"|(client|namespace) \S+ (terminated|deleted|removed)( successfully)?"
    r"|(terminated|deleted|removed) (client|namespace) \S+)\.?",
    re.IGNORECASE)
_NOT_DONE_RE = re.compile(
    r"\b(not|no|never|could|cannot|unable|fail\w*|error|deferred|pending|later|refused|"
    r"rejected)\b|n't\b", re.IGNORECASE)
"""The only texts besides silence that the legacy `terminate_client` is taken to print on
success (a line that reads as done and says nothing against it): a failed drain read as done
is worse than a success reported as failed (the caller retries). The v3 `client terminate` /
`namespace delete` read back any other answer instead (`MpsControl._confirm_gone`)."""


def _reads_done(stdout: str) -> bool:
    """Silence, or every line reads as done and says nothing against it (`_DONE_RE`)."""
    lines = [line.strip() for line in stdout.splitlines() if line.strip()]
    return all(_DONE_RE.fullmatch(line) and not _NOT_DONE_RE.search(line) for line in lines)


_STATUS_RE = re.compile(r"-?\d+")
_INVALID_PROCESS_RE = re.compile(r"^Invalid process (\d+)!?$", re.IGNORECASE | re.MULTILINE)
"""The legacy daemon's answer to `terminate_client` for a pid that is no client of that
server (any more: it exited mid-drain)."""
EXCERPT_MAX = 200
"""Characters of an unrecognised daemon answer quoted in an error."""

_UNREACHABLE_TEXTS = (
    "Cannot find MPS control daemon process",
    "Cannot authenticate or connect to MPS control daemon process",
    "Cannot access CUDA_MPS_PIPE_DIRECTORY",
)
_BUSY_TEXT = "Cannot send command to MPS control daemon process"
"""What a client gets while another one talks to the daemon (measured with the 535 binary: 28
of 30 simultaneous clients got it, exit 1, and one more exited 1 saying nothing; the daemon kept
answering). A dead daemon says "Cannot find", a hung one makes the client wait: this one is
alive. A command's silent exit 1 is taken the same way (`MpsControl._run_once`): a daemon that
keeps failing so is reported busy (its pods wait, visibly) rather than killed with every MPS
workload on the node."""
_ALREADY_RUNNING_TEXT = "An instance of this daemon is already running"


def classify_answer(stdout: str) -> tuple[str, str] | None:
    """(reason, line) of the first line of a daemon answer that is an error; None when clean."""
    for line in stdout.splitlines():
        line = line.strip()
        if not line or line.startswith("/"):  # a bare path is an answer, whatever its words
            continue
        for pattern, reason in _ANSWER_PATTERNS:
            if pattern.search(line):
                return reason, line
    return None


def _busy(what: str, said: str, pipe_dir: str) -> MpsError:
    return MpsError(e.MPS_DAEMON_BUSY,
                    f"the MPS control daemon on {pipe_dir} is serving another client ({what!r}: "
                    f"{said}); it is alive, try again")


def error_for_exit(result: CommandResult, what: str, *, binary: str, pipe_dir: str) -> MpsError:
    """The error for a client run that exited non-zero (the client's own failures: no daemon,
    a second daemon; the daemon's rejections exit 0 and are parsed from stdout instead)."""
    text = (result.stdout + "\n" + result.stderr).strip()
    if _BUSY_TEXT in text:
        return _busy(what, _first_line(text), pipe_dir)
    if any(t in text for t in _UNREACHABLE_TEXTS):
        return MpsError(
            e.MPS_DAEMON_UNREACHABLE,
            f"no MPS control daemon answers on {pipe_dir} ({what!r}: "
            f"{_first_line(text)}); the supervisor starts it")
    if _ALREADY_RUNNING_TEXT in text:
        return MpsError(
            e.DAEMON_ALREADY_RUNNING,
            f"another MPS control daemon already holds {pipe_dir}/control_lock")
    found = classify_answer(text)
    if found is not None and found[0] not in (e.COMMAND_FAILED, e.UNKNOWN_COMMAND):
        # A daemon answer that also set the exit status (the reason matters to the caller:
        # NamespaceBusy means retry later).
        return MpsError(found[0], f"the MPS control daemon rejected {what!r}: {found[1]}")
    return MpsError(
        e.COMMAND_FAILED,
        f"{binary} {what!r} exited {result.returncode}: {text or '(no output)'}")


def _parse_int(text: str, what: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise MpsError(e.UNEXPECTED_OUTPUT, f"{what} printed {text!r}, not a pid") from None


def _parse_float(text: str, what: str) -> float:
    try:
        return float(text.strip())
    except ValueError:
        raise MpsError(e.UNEXPECTED_OUTPUT, f"{what} printed {text!r}, not a number") from None


def _excerpt(text: str) -> str:
    text = " | ".join(line.strip() for line in text.strip().splitlines() if line.strip())
    return text if len(text) <= EXCERPT_MAX else text[:EXCERPT_MAX - 3] + "..."


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else "(no output)"
