"""Why a request to the Kubernetes API failed: one error tree for every component, and the one
place that reads an API server's refusal (`refused`) or a transport failure (`unreachable`).

Callers give these a meaning of their own where they have one (the mirror: a 404 on its pod is
NOT_FOUND to the scheduler; the agent: a 409 on its marker write means the pod was recreated);
everything else is reported with the API server's own message, which names the object and the
rule it broke.
"""

from __future__ import annotations

import json
from collections.abc import Mapping


class KubeError(Exception):
    """A request failed; `status` is the HTTP status when the server answered (else None).
    `str(e)` is one line: what was asked, then the server's (or the transport's) answer."""

    reason = "APIError"
    """A word for events, metrics and node conditions."""

    def __init__(self, message: str, status: int | None = None,
                 retry_after: float | None = None, *, answer: str | None = None,
                 detail: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.answer = message if answer is None else answer
        """The answer alone, without the request's name: for a caller whose own message
        already names the request."""
        self.detail = self.answer if detail is None else detail
        """The server's own words (`status_message`), without this module's advice: for a
        caller that gives its own (the CLI tells its user, not a component, what to check)."""
        self.status = status
        self.retry_after = retry_after
        """The server's Retry-After hint, in seconds, when it gave one."""


class NotFound(KubeError):
    reason = "NotFound"


class Conflict(KubeError):
    """409: the object changed (resourceVersion) or was recreated (uid) since it was read."""

    reason = "Conflict"


class Gone(KubeError):
    """410: a watch's resourceVersion, or a list page's continue token, expired: list again."""

    reason = "Expired"


class Invalid(KubeError):
    """422: the server refused the object or patch as invalid (an immutable field, a uid that
    is not the stored object's)."""

    reason = "Invalid"


class Forbidden(KubeError):
    """401 (its credentials not accepted) or 403 (its identity refused: its RBAC)."""

    reason = "Forbidden"


class Transient(KubeError):
    """Worth trying again: throttled (429), timed out (408), a server error (5xx), or no
    answer at all (refused, reset, timed out connections). `sent` is False when the request
    never left this end (no connection could be made, no credentials could be had)."""

    reason = "Unavailable"

    def __init__(self, message: str, status: int | None = None,
                 retry_after: float | None = None, *, answer: str | None = None,
                 detail: str | None = None, sent: bool = True) -> None:
        super().__init__(message, status, retry_after, answer=answer, detail=detail)
        self.sent = sent

    @property
    def may_have_applied(self) -> bool:
        """Whether the server may have acted on the request (a write may have landed): not
        when it was never sent, nor when it was throttled (429: an API server's flow control
        refuses a request before any handler runs). A timeout or a reset after sending loses
        the answer to whatever the server did; a 5xx or a 408 says that the server, or a
        proxy in front of it, gave up, not that nothing was done (an API server's 504 leaves
        its handler running, a 500 may follow an etcd write that timed out, a proxy's 502 or
        504 may come after it forwarded the request)."""
        return self.sent and self.status != THROTTLED


class BadAnswer(KubeError):
    """A 2xx answer that is not JSON (a proxy's or gateway's page): asking again reads the
    same page again."""

    reason = "BadAnswer"


class NotSent(KubeError):
    """The request could not be sent as built, so nothing was: a header aiohttp refuses (a
    control character, such as the newline at the end of a token file sent unstripped).
    Asking again sends the same until its source is fixed: a list + watch loop backs off and
    tries again, so a fixed token file is taken up."""

    reason = "RequestNotSent"


class Unavailable(KubeError):
    """Transient failures used up the retries a caller allowed: retry later."""

    reason = "Unavailable"


class DeadlineExceeded(KubeError):
    """The caller's deadline ran out before an answer came."""

    reason = "DeadlineExceeded"


THROTTLED = 429

_BY_STATUS: dict[int, type[KubeError]] = {
    401: Forbidden, 403: Forbidden, 404: NotFound, 408: Transient, 409: Conflict, 410: Gone,
    422: Invalid, 429: Transient,
}


def status_message(status: int | None, reason: str | None, body: str | bytes | None) -> str:
    """`409 Conflict: <the message of the server's Status>`, else the status and its reason."""
    try:
        parsed = json.loads(body or "")
        if isinstance(parsed, dict) and parsed.get("message"):
            return f"{status} {parsed.get('reason') or reason}: {parsed['message']}"
    except ValueError:
        pass
    return f"{status} {reason or ''}".strip()


def refused(what: str, status: int, reason: str | None = None, body: str | bytes | None = None,
            retry_after: str | None = None) -> KubeError:
    """The error for a non-2xx answer to the request `what` ("patch pod ns/name")."""
    cls = _BY_STATUS.get(status) or (Transient if status >= 500 else KubeError)
    answer = detail = status_message(status, reason, body)
    if status == 401:
        answer = (f"the API server did not accept this component's credentials ({answer}); "
                  "check its token or kubeconfig user")
    elif cls is Forbidden:
        answer = (f"the API server refused this component's identity ({answer}); check its "
                  "RBAC")
    try:
        hint = float(retry_after) if retry_after is not None else None
    except ValueError:
        hint = None
    return cls(f"{what}: {answer}", status, hint, answer=answer, detail=detail)


def unreachable(what: str, error: BaseException, *, sent: bool = True) -> Transient:
    """The error for a request that got no answer (the connection failed or timed out);
    `sent=False` when the transport knows that the request never left (no connection)."""
    answer = ("no answer in time" if isinstance(error, TimeoutError)
              else f"{type(error).__name__}: {error}")
    return Transient(f"{what}: {answer}", answer=answer, sent=sent)


def not_sent(what: str, error: ValueError, headers: Mapping[str, str]) -> NotSent:
    """The error for a request aiohttp refused to send (`error`): it names the `headers`
    whose name or value holds a control character, never a value (a credential)."""
    bad = [name for name, value in headers.items()
           if any(ord(c) < 0x20 or ord(c) == 0x7F for c in name + value)]
    if bad:
        answer = (f"not sent: header {', '.join(bad)} holds a control character (a "
                  "token file, or a kubeconfig's token or exec plugin's output, ending in a "
                  "newline?); fix its source")
    else:
        answer = f"not sent: {error}"
    return NotSent(f"{what}: {answer}", answer=answer, detail=str(error))
