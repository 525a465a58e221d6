"""The mirror's PodStore over `kai_fractions.kube`, on the mirror's event loop: what each
request is, and what each refusal means to a scheduler.

A write is ONE JSON merge patch of `metadata.annotations` that carries `metadata.uid` and
`metadata.resourceVersion`: a real API server refuses it when the pod was recreated (uid is
immutable: 422) or changed since it was read (409), so a set of keys is never half-written and
never lands on the wrong pod. Every request gets a timeout bounded by the caller's deadline, and
transient failures are retried (`kube.retry`). A retried write refused 409 says that a try
before it may have landed (`WriteConflict.may_have_landed`) when one may have: a lost answer,
then the retry meets its own write's version. A try throttled (429) or never sent (no
connection) cannot have landed, and says nothing of the sort.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from ..clock import AsyncClock, SystemClock
from ..kube import errors as kerr
from ..kube.client import MERGE_PATCH, Kube
from ..kube.listwatch import WATCH_CACHE
from ..kube.objects import (
    annotation_patch,
    events_path,
    node_path,
    pod_event,
    pod_path,
    pods_path,
    uid_of,
)
from ..kube.retry import NO_DEADLINE, Backoff, Deadline, retrying
from .errors import ApiRejected, ApiUnavailable, DeadlineExceeded, PodNotFound
from .store import (
    NodeLabels,
    NodeNotFound,
    PodSnapshot,
    WriteConflict,
    WriteInvalid,
    label_selector,
    matches_labels,
)

COMPONENT = "kai-fractions-mirror"
DEFAULT_BACKOFF = Backoff()
MIN_WRITE_BUDGET = 0.1
"""Seconds of the caller's deadline a pod PATCH needs left to be sent at all. A PATCH sent with
less (it used to go with whatever was left, down to 1 ms) timed out at this end while the API
server applied it: the caller heard DEADLINE_EXCEEDED for a write that landed. 100 ms is about
twice what one takes at the 99th percentile against the tests' stand-in API server (p50 27 ms,
p99 57 ms) and covers a real one's admission webhooks on pod UPDATE. With less left the write
is not started: DEADLINE_EXCEEDED, nothing written. Reads have no side effect and get no
minimum. A retry after a transient failure needs it too, counted after its wait: one that
would not have it is given up before the wait (`retrying`'s `try_budget`), and the error then
says that the try sent before may have landed (a timeout or reset loses the answer to a PATCH
the API server applied), with that try's error."""
MAY_HAVE_LANDED = ("the write tried before may have landed (a timeout or a reset can lose the "
                   "answer to a PATCH the API server applied): a retry of the call finds it")
IMPERSONATE_USER = "Impersonate-User"


KAI_BINDER_ONLY = "may only be modified by"
"""Upstream KAI's webhook's words for a pod write by anyone but its binder."""
WRITE_AS_HINT = ("the mirror wrote as its own account: run it with --write-as <KAI's binder> "
                 "(the chart's mirror.writeAsBinder: true) so KAI's webhook sees its binder")


def write_as_headers(write_as: str) -> dict[str, str]:
    """Headers that make a pod write carry `write_as`'s identity (Kubernetes impersonation).

    KAI's own NvFractions webhook lets exactly one username create or change `.gpus.devices`:
    its binder's service account. A mirror that writes them on the binder's behalf must carry
    that name; RBAC `impersonate` on exactly that service account is what allows it."""
    return {IMPERSONATE_USER: write_as} if write_as else {}


class KubePodStore:
    def __init__(
        self,
        kube: Kube,
        *,
        backoff: Backoff = DEFAULT_BACKOFF,
        request_timeout: float = 10.0,
        clock: AsyncClock | None = None,
        rng: random.Random | None = None,
        write_as: str = "",
        component: str = COMPONENT,
    ) -> None:
        self.kube = kube
        self.write_headers = write_as_headers(write_as)
        """Pod writes impersonate `write_as`; reads do not."""
        self.backoff = backoff
        self.request_timeout = request_timeout
        self.clock = clock or SystemClock()
        self.rng = rng or random.Random()
        self.component = component

    async def get_pod(self, namespace: str, name: str, deadline: Deadline = NO_DEADLINE
                      ) -> PodSnapshot:
        what = f"read pod {namespace}/{name}"
        obj = await self._call(what, deadline, lambda t: self.kube.request(
            "GET", pod_path(namespace, name), what=what, timeout=t),
            not_found=lambda: PodNotFound(namespace, name))
        return PodSnapshot.from_object(obj)

    async def patch_annotations(
        self, namespace: str, name: str, changes: Mapping[str, str | None], *, uid: str,
        resource_version: str, deadline: Deadline = NO_DEADLINE,
    ) -> PodSnapshot:
        what = f"patch pod {namespace}/{name}"
        body = annotation_patch(changes, uid=uid, resource_version=resource_version)
        tries = 0
        last: kerr.Transient | None = None  # the last try's failure
        applied: kerr.Transient | None = None  # the last failure the server may have applied

        async def once(timeout: float) -> Any:
            nonlocal tries, last, applied
            # Checked before every try: see MIN_WRITE_BUDGET. `retrying` gives a retry up
            # before its wait when the wait would leave less; this catches a wait that ran
            # late. Raised as the deadline's own error, so `retrying` ends there.
            remaining = deadline.remaining()
            if remaining is not None and remaining < MIN_WRITE_BUDGET:
                answer = (f"the caller's deadline leaves {remaining * 1000:.0f} ms, less than "
                          f"the {MIN_WRITE_BUDGET * 1000:.0f} ms a write needs: ") + (
                    "not sent, nothing written" if last is None else
                    f"the retry not sent ({tries} tries, last: {last.answer})")
                raise kerr.DeadlineExceeded(f"{what}: {answer}", answer=answer)
            tries += 1
            try:
                return await self.kube.request(
                    "PATCH", pod_path(namespace, name), what=what, body=body,
                    content_type=MERGE_PATCH, timeout=timeout, headers=self.write_headers)
            except kerr.Transient as e:
                last = e
                if e.may_have_applied:
                    applied = e
                raise

        try:
            obj = await self._call(what, deadline, once,
                                   not_found=lambda: PodNotFound(namespace, name),
                                   try_budget=MIN_WRITE_BUDGET)
        except (DeadlineExceeded, ApiUnavailable) as e:
            if not tries:
                raise
            # A try went out: say so (the class, so the status, stays as it was).
            raise type(e)(f"{e}; {MAY_HAVE_LANDED}") from None
        except WriteConflict as e:
            if applied is None:
                # The first try, or retries after tries the server did not apply (a 429, a
                # connection refused): another writer moved the version.
                raise
            # A retry refused for the version it carries, after a try that failed in a way
            # that may have applied it (its answer lost, a server error): that try may be
            # what moved the version (the service's re-read tells).
            raise WriteConflict(f"{e} (refused a retry: a try before it failed, "
                                f"{applied.answer}, and may have landed)",
                                may_have_landed=True) from None
        except ApiRejected as e:
            if self.write_headers or KAI_BINDER_ONLY not in str(e):
                raise
            # KAI's own webhook lets only its binder write the devices: say what to set.
            raise ApiRejected(f"{e}; {WRITE_AS_HINT}") from None
        return PodSnapshot.from_object(obj)

    async def node_labels(self, node: str, deadline: Deadline = NO_DEADLINE
                          ) -> NodeLabels:
        what = f"read node {node}"
        obj = await self._call(what, deadline, lambda t: self.kube.request(
            "GET", node_path(node), what=what, timeout=t), not_found=lambda: NodeNotFound(node))
        labels = (obj.get("metadata") or {}).get("labels") or {}
        return NodeLabels({str(k): str(v) for k, v in labels.items()}, uid_of(obj))

    async def list_pods(self, namespace: str, labels: Mapping[str, str],
                        deadline: Deadline = NO_DEADLINE, *, cached: bool = False
                        ) -> list[PodSnapshot]:
        selector = label_selector(labels)
        what = f"list pods in {namespace} ({selector})"
        query = {"labelSelector": selector}
        if cached:
            query["resourceVersion"] = WATCH_CACHE
        obj = await self._call(what, deadline, lambda t: self.kube.request(
            "GET", pods_path(namespace), what=what, query=query, timeout=t))
        pods = [PodSnapshot.from_object(item) for item in (obj or {}).get("items") or []]
        # The selector already filtered on a real server; filtering again costs nothing and
        # keeps a server that ignores selectors from handing us another group's pod.
        return [p for p in pods if matches_labels(p.labels, labels)]

    async def emit_event(self, pod: PodSnapshot, event_type: str, reason: str, message: str,
                         deadline: Deadline = NO_DEADLINE) -> None:
        what = f"record event {reason} on pod {pod.namespace}/{pod.name}"
        event = pod_event(pod.namespace, pod.name, pod.uid, event_type=event_type,
                          reason=reason, message=message, component=self.component,
                          resource_version=pod.resource_version)
        try:
            await self._call(what, deadline, lambda t: self.kube.request(
                "POST", events_path(pod.namespace), what=what, body=event, timeout=t))
        except WriteConflict:
            # 409 AlreadyExists: the event's name is fixed for the call, so a retry of a POST
            # whose answer was lost meets the event it created. It is recorded: success.
            return

    async def close(self) -> None:
        await self.kube.close()

    async def _call(self, what: str, deadline: Deadline,
                    once: Callable[[float], Awaitable[Any]],
                    not_found: Callable[[], Exception] | None = None, *,
                    try_budget: float = 0.0) -> Any:
        """The decoded answer of `once(timeout)`, retried while transient (a retry only with
        `try_budget` of the deadline left after its wait); each failure as the mirror's error
        a scheduler can act on."""
        try:
            return await retrying(once, what=what, backoff=self.backoff, deadline=deadline,
                                  request_timeout=self.request_timeout, clock=self.clock,
                                  rng=self.rng, try_budget=try_budget)
        except kerr.NotFound as e:
            raise (not_found() if not_found is not None else ApiRejected(str(e))) from None
        except kerr.Conflict as e:  # the service says which write, in its own words
            raise WriteConflict(e.answer) from None
        except kerr.Invalid as e:
            raise WriteInvalid(e.answer) from None
        except kerr.Unavailable as e:
            raise ApiUnavailable(e.message) from None
        except kerr.DeadlineExceeded as e:
            raise DeadlineExceeded(e.message) from None
        except kerr.KubeError as e:
            raise ApiRejected(e.message) from None
