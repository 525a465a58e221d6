"""Errors of the MPS control seam: a CamelCase `reason` the engine can branch on and show, and a
`message` that says what happened and what to do.

`nvidia-cuda-mps-control` exits 0 even when a command fails, so these are raised from what it
printed, never from its exit status alone.
"""

from __future__ import annotations

from kai_fractions.node.errors import NodeError

# Reasons (the values of MpsError.reason). Callers compare against these names.
MPS_DAEMON_UNREACHABLE = "MpsDaemonUnreachable"
"""No control daemon answers on the pipe directory (not started, dead, or wedged)."""
MPS_DAEMON_NOT_ANSWERING = "MpsDaemonNotAnswering"
"""The daemon's process runs but missed its health checks: maybe slow, maybe wedged. It is
killed (with every tenant's MPS clients) only once it stayed silent long enough."""
MPS_DAEMON_BUSY = "MpsDaemonBusy"
"""The daemon is alive but serving another client: it takes one at a time and turns a second
away ("Cannot send command to MPS control daemon process", exit 1). Retry; never restart it."""
MPS_BINARY_NOT_FOUND = "MpsBinaryNotFound"
"""`nvidia-cuda-mps-control` is not where --mps-control-binary points."""
DAEMON_ALREADY_RUNNING = "MpsDaemonAlreadyRunning"
"""`-d` refused: another control daemon holds the pipe directory's lock."""
UNKNOWN_COMMAND = "UnknownCommand"
"""The daemon does not know the command (`Unknown command "x"`)."""
PROTOCOL_UNSUPPORTED = "ProtocolUnsupported"
"""The binary has no v3 control protocol (`-p 3`): drivers before r615, e.g. 535."""
SERVER_NOT_FOUND = "ServerNotFound"
"""An MPS server named by pid or name does not exist (`Server N not found`)."""
CLIENT_NOT_FOUND = "ClientNotFound"
"""`client terminate` named a pid that is not (or no longer) an MPS client."""
NAMESPACE_NOT_FOUND = "NamespaceNotFound"
NAMESPACE_EXISTS = "NamespaceExists"
NAMESPACE_BUSY = "NamespaceBusy"
"""A namespace still has clients attached; retry the delete after they exit."""
INVALID_ARGUMENT = "InvalidArgument"
"""Rejected before anything ran (or by the daemon): the message names the argument."""
NOT_APPLIED = "NotApplied"
"""The daemon accepted the command but reading the value back shows it did not take effect."""
COMMAND_FAILED = "CommandFailed"
"""The daemon printed an error this module has no specific reason for; the message quotes it."""
UNEXPECTED_OUTPUT = "UnexpectedOutput"
"""A query printed something that cannot be parsed as its answer."""

REASONS = frozenset({
    MPS_DAEMON_UNREACHABLE, MPS_DAEMON_NOT_ANSWERING, MPS_DAEMON_BUSY, MPS_BINARY_NOT_FOUND,
    DAEMON_ALREADY_RUNNING,
    UNKNOWN_COMMAND,
    PROTOCOL_UNSUPPORTED, SERVER_NOT_FOUND, CLIENT_NOT_FOUND, NAMESPACE_NOT_FOUND, NAMESPACE_EXISTS,
    NAMESPACE_BUSY, INVALID_ARGUMENT, NOT_APPLIED, COMMAND_FAILED, UNEXPECTED_OUTPUT,
})


class MpsError(NodeError):
    """A failed MPS control call. `reason` is one of REASONS; `message` a sentence to act on."""

    reason = "MpsError"

    def __init__(self, reason: str, message: str):
        super().__init__(message, reason=reason)

    def __repr__(self) -> str:
        return f"MpsError({self.reason!r}, {self.message!r})"

    def __eq__(self, other: object) -> bool:
        # Value semantics, so tests and the fake's recorded errors compare by content.
        return (isinstance(other, MpsError) and other.reason == self.reason
                and other.message == self.message)

    def __hash__(self) -> int:
        return hash((self.reason, self.message))
