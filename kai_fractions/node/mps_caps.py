"""Why an MPS namespace's compute cap (its active-thread percentage) is not in force: the
reasons the engine gives a container pending for it, and the messages that say what happened and
what to do.

MPS fixes a namespace's percentage when its first client attaches, for the client's lifetime, so
each message says whether a client may already run without the cap (it has to exit) or none can
attach until the next pass puts it right.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from .errors import NodeError
from .mps import adoption
from .mps.errors import (
    COMMAND_FAILED,
    DAEMON_ALREADY_RUNNING,
    NAMESPACE_BUSY,
    NOT_APPLIED,
    MpsError,
)
from .mps_pinned import MPS_PINNED_LIMIT_LOST


class MpsClientLike(Protocol):
    pid: int
    namespace: str | None


NAMESPACE_CAP_UNVERIFIED = "NamespaceCapUnverified"
"""An MPS namespace the engine created (again, e.g. after a daemon restart) had clients attached
before its active-thread percentage could be verified in force: they may run uncapped for their
lifetime, so its container stays pending until they exit."""
NAMESPACE_CAP_NOT_SET = "NamespaceCapNotSet"
"""An MPS namespace the engine made (again, e.g. after a daemon restart) does not hold the plan's
active-thread percentage because the daemon did not take a step of making it: its set failed and
it was deleted (no client may attach to it uncapped; the next pass makes it again), or could not
be deleted either (a client attaching to it would run uncapped for its lifetime), or it could not
be created. Also a container whose MPS caps went with an MPS control daemon that is not running,
or are not on the one that runs, which the agent did not adopt (`cap_gone_with_daemon`: its
namespace, or on a driver without namespaces the MPS server that enforces its client env; one
without a namespace whose pinned limit is a tier gets MpsPinnedLimitLost). The message says
which."""
CAP_NOT_IN_FORCE_REASONS = frozenset({NAMESPACE_CAP_UNVERIFIED, NAMESPACE_CAP_NOT_SET,
                                      MPS_PINNED_LIMIT_LOST})
"""The reasons of a container pending with `ContainerResult.mps_cap_missing`, and only of such a
container: whoever reads the reason alone (GetNodeState, the metrics) tells a container whose
readiness marker is set aside from one pending for a reason that keeps it (a busy daemon)."""


SET_REFUSED = (NAMESPACE_BUSY, NOT_APPLIED, COMMAND_FAILED)
"""How a daemon answers a percentage set on a namespace whose first client came and went: a
refusal, or a value it does not hold when read back."""


def attached_pids(clients: Iterable[MpsClientLike], namespace: str) -> list[int]:
    """Pids of the clients attached to `namespace`."""
    return sorted(int(cl.pid) for cl in clients if cl.namespace == namespace)


UNTIL_THEY_EXIT = (
    "The container stays pending until they have exited (restart the container's GPU "
    "processes, or recreate the pod); the cap is then set before anything attaches again")
"""What a container whose clients attached before its cap waits for, and what to do."""


def cap_unverified(name: str, pct: int, pids: list[int], said: str | None = None) -> MpsError:
    who = (f"clients (pids {', '.join(map(str, pids))}) attached" if pids
           else f"clients attached ({said})" if said else "clients attached")
    return MpsError(NAMESPACE_CAP_UNVERIFIED, (
        f"MPS namespace {name} was created (again, e.g. after an MPS daemon restart) and "
        f"{who} before its active-thread percentage {pct} could be verified in force: MPS "
        "fixes the percentage at the first attach, so they may run without the cap for their "
        "lifetime. " + UNTIL_THEY_EXIT))


def cap_not_set(name: str, pct: int, set_error: NodeError, delete_error: NodeError
                 ) -> MpsError:
    return MpsError(NAMESPACE_CAP_NOT_SET, (
        f"MPS namespace {name} was made but its active-thread percentage {pct} could not be set "
        f"({set_error.reason}: {set_error.message}), and it could not be deleted either "
        f"({delete_error.reason}: {delete_error.message}): a client attaching to it would run "
        "without the cap for its lifetime. The container stays pending; the next pass sets the "
        "percentage before anything attaches, or deletes the namespace"))


def cap_not_set_deleted(name: str, pct: int, set_error: NodeError) -> MpsError:
    """`name`'s percentage could not be set (`set_error`), and it was deleted for it."""
    return MpsError(NAMESPACE_CAP_NOT_SET, (
        f"MPS namespace {name} was made but its active-thread percentage {pct} could not be set "
        f"({set_error.reason}: {set_error.message}); it was deleted, so that no client attaches "
        "to it without the cap. The container stays pending, and its readiness marker set aside, "
        "until the next pass has made it again with the percentage (it retries every pass; if "
        "this persists, check the MPS control daemon and its log)"))


def cap_not_set_attached(name: str, pct: int, set_error: NodeError, *,
                          pids: Iterable[int] = (), delete_error: NodeError | None = None
                          ) -> MpsError:
    """`name`'s percentage could not be set (`set_error`), and clients (`pids`, when known)
    attached to it meanwhile: the delete that was to keep them out was refused for them
    (`delete_error`: NamespaceBusy), or a client list showed them."""
    pids = list(pids)
    who = (f"clients (pids {', '.join(map(str, pids))}) attached to it" if pids
           else "clients attached to it")
    when = (f" before it could be deleted ({delete_error.reason}: {delete_error.message})"
            if delete_error is not None else " meanwhile")
    return MpsError(NAMESPACE_CAP_UNVERIFIED, (
        f"MPS namespace {name} does not hold the plan's active-thread percentage {pct}, which "
        f"could not be set ({set_error.reason}: {set_error.message}), and {who}{when}: MPS "
        "fixes the percentage at the first attach, so they run without the plan's cap for "
        "their lifetime. " + UNTIL_THEY_EXIT))


def cap_not_made(name: str, pct: int, error: NodeError) -> MpsError:
    """`name` is not there (a restarted daemon has none) and could not be made (`error`)."""
    return MpsError(NAMESPACE_CAP_NOT_SET, (
        f"MPS namespace {name} is not there (a new container's, or one a restarted MPS daemon "
        f"lost) and could not be made with its active-thread percentage {pct} ({error.reason}: "
        f"{error.message}). The container stays pending, and its readiness marker set aside, "
        "until a pass has made it with the percentage (it retries every pass; if this "
        "persists, check the MPS control daemon and its log)"))


def cap_not_held(name: str, pct: int, error: NodeError) -> MpsError:
    """`name` is known not to hold `pct` (the engine's `_uncapped`), and `error` kept it from
    being given it."""
    return MpsError(NAMESPACE_CAP_NOT_SET, (
        f"MPS namespace {name} does not hold the plan's active-thread percentage {pct}, and "
        f"it could not be given it ({error.reason}: {error.message}): a client attaching to it "
        "now would not run with the cap. The container stays pending, and its readiness marker "
        "set aside, until it holds it (the agent retries every pass; if this persists, check "
        "the MPS control daemon and its log)"))


def gone_with_daemon_reason(namespace: bool, pinned: bool) -> str:
    """The reason of a container whose MPS cap went with an MPS control daemon that is not
    running (`cap_gone_with_daemon`): its namespace's (NamespaceCapNotSet) where it has one,
    else its GPU's pinned limit's (MpsPinnedLimitLost) where it is mps-pinned, else
    NamespaceCapNotSet (a driver without namespaces: the MPS server its client env names)."""
    return MPS_PINNED_LIMIT_LOST if pinned and not namespace else NAMESPACE_CAP_NOT_SET


def cap_gone_with_daemon(name: str | None, pct: int | None, error: NodeError, *,
                         pinned: Sequence[int] = ()) -> MpsError:
    """The MPS control daemon is not running (`error`: why, as its supervisor saw it), and the
    container's MPS caps went with it: its namespace `name` and that namespace's percentage
    `pct` (None: a driver without namespaces, where the MPS server enforces the client env's
    percentage), and the default pinned device memory limit of its GPUs `pinned` (their
    indexes: where that limit is a tier of the container, `engine_mps.pinned_is_a_tier`).
    Reason: `gone_with_daemon_reason`. A daemon that runs
    but is not adopted (MpsDaemonAlreadyRunning) holds none of them either, and is told as
    such (`_not_on_unusable_daemon`): it is not "not running", and the agent does not start
    another while it holds the pipe directory."""
    caps = []
    if name is not None:
        caps.append(f"MPS namespace {name} and its active-thread percentage {pct}")
    if pinned:
        gpus = ("GPUs " if len(pinned) > 1 else "GPU ") + ", ".join(map(str, pinned))
        caps.append(f"the default pinned device memory limit of {gpus}")
    back = " and ".join(
        (["the namespace is made again with its percentage"] if name is not None else [])
        + (["the limit is set again"] if pinned else [])) or "its clients can reach it again"
    reason = gone_with_daemon_reason(name is not None, bool(pinned))
    if error.reason == DAEMON_ALREADY_RUNNING:
        return _not_on_unusable_daemon(reason, caps, back, error)
    gone = caps if name is not None else [
        *caps, "the MPS server its clients reach, which enforces its share of the SMs"]
    return MpsError(reason, (
        f"the MPS control daemon is not running ({error.reason}: {error.message}), and "
        f"{' and '.join(gone)} went with it (a daemon's namespaces and settings die with it). "
        "A CUDA process of the container started now would not reach MPS and would run as "
        "without it, uncapped (alone on an EXCLUSIVE_PROCESS GPU). The container stays "
        "pending, and its readiness marker set aside, until the daemon runs again and "
        f"{back} (the agent starts it again, with a backoff; if this persists, check "
        "--mps-control-binary and the MPS log directory)"))


def _not_on_unusable_daemon(reason: str, caps: list[str], back: str, error: NodeError
                            ) -> MpsError:
    """`cap_gone_with_daemon` for a daemon that runs but is not adopted (`error`): the agent
    applies nothing through it, so the container's `caps` are not in force; the remedy is to
    stop that daemon (`adoption.stop_it`)."""
    held = (" and ".join(caps) + (" are" if len(caps) > 1 else " is") if caps
            else "its share of the SMs, as an MPS server of a daemon the agent uses enforces "
                 "it, is")
    return MpsError(reason, (
        f"{adoption.not_usable(error)}, and {held} not in force through it (the agent applies "
        "nothing through a daemon it did not adopt). A CUDA process of the container started "
        "now would run without the agent's MPS caps. The container stays pending, and its "
        "readiness marker set aside, until a daemon the agent can use runs and "
        f"{back}: {adoption.stop_it()}"))


def cap_not_verified(name: str, pct: int, error: NodeError) -> MpsError:
    """`name`, made by the engine (its `_fresh`), could not be checked for clients that
    attached before its percentage was set (`error`)."""
    return MpsError(NAMESPACE_CAP_UNVERIFIED, (
        f"MPS namespace {name} was made (again, e.g. after an MPS daemon restart) and whether a "
        f"client attached to it before its active-thread percentage {pct} was set could not be "
        f"checked ({error.reason}: {error.message}): such a client would run without the cap "
        "for its lifetime. The container stays pending, and its readiness marker set aside, "
        "until a client list shows the percentage in force (the agent retries every pass; if "
        "this persists, check the MPS control daemon and its log)"))


def namespace_busy(name: str, in_force: str, pct: int) -> MpsError:
    """Clients attached to `name` run with another percentage than the plan's `pct`
    (`in_force` says which, and how it is known)."""
    return MpsError(NAMESPACE_BUSY, (
        f"MPS namespace {name} has clients attached, which run with the active-thread "
        f"percentage {in_force} (MPS fixes it at the first attach); the plan's {pct} takes "
        "effect once they have exited: stop the container's GPU processes, or recreate the "
        "pod"))


def cap_not_held_by_clients(name: str, pct: int, pids: list[int]) -> MpsError:
    """Clients (`pids`) attached to `name`, which holds no percentage at all (the daemon says)."""
    return MpsError(NAMESPACE_CAP_UNVERIFIED, (
        f"MPS namespace {name} has clients (pids {', '.join(map(str, pids))}) "
        f"attached but holds no active-thread percentage, not the plan's {pct}: MPS "
        "fixes it at the first attach, so they run without the cap for their "
        "lifetime. The container stays pending until they have exited (restart the "
        "container's GPU processes, or recreate the pod)"))
