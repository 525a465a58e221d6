"""Why a mirror call failed, as values a scheduler can act on (the servicer maps each class to
one gRPC status code; nothing here knows gRPC)."""

from __future__ import annotations

from collections.abc import Iterable

from ..contract import ContractError


class MirrorError(Exception):
    """Base class; `str(e)` is the one-line message a caller sees."""


class InvalidAllocation(MirrorError):
    """The request (or the pod's own annotations) breaks the contract: INVALID_ARGUMENT.

    Each error's `key` is a request field path (`received_gpu.portion`, relative to the
    Allocation message) or a pod annotation key."""

    def __init__(self, errors: Iterable[ContractError]):
        self.errors = tuple(errors)
        super().__init__("; ".join(str(e) for e in self.errors))


class PodNotFound(MirrorError):
    """The pod does not exist (deleted, or never created): NOT_FOUND."""

    def __init__(self, namespace: str, name: str, message: str | None = None):
        self.namespace, self.name = namespace, name
        super().__init__(message or f"pod {namespace}/{name} not found")


class PodReplaced(PodNotFound):
    """A pod of that name exists but it is another pod (deleted and recreated): NOT_FOUND.

    NOT_FOUND rather than FAILED_PRECONDITION because the pod the decision was made for is gone
    for good; a scheduler drops the decision instead of retrying it."""

    def __init__(self, namespace: str, name: str, expected_uid: str, actual_uid: str):
        self.expected_uid, self.actual_uid = expected_uid, actual_uid
        super().__init__(namespace, name, (
            f"pod {namespace}/{name} has uid {actual_uid}, not {expected_uid}: the pod the "
            "decision was made for was deleted and recreated; nothing was written"))


class AllocationConflict(MirrorError):
    """The pod already carries a different mirrored allocation (or the idempotency key was used
    for another decision): FAILED_PRECONDITION."""

    def __init__(self, subject: str, message: str, kind: str = "ALLOCATION_CONFLICT"):
        self.subject, self.kind = subject, kind
        super().__init__(message)


class ApiUnavailable(MirrorError):
    """The Kubernetes API could not be reached or kept failing: UNAVAILABLE (retry later)."""


class DeadlineExceeded(MirrorError):
    """The caller's deadline ran out before the work finished: DEADLINE_EXCEEDED."""


class ApiRejected(MirrorError):
    """The API server refused the write for a reason retrying will not fix: INTERNAL."""
