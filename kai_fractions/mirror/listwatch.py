"""List, then watch, forever: the loop behind the mirror's BindRequest follower and its pod
cache. It resumes a watch from the last resourceVersion seen, lists again when the server says
that version is too old (410 Gone) or when `resync_seconds` have passed, and backs off (jittered,
capped, never giving up) while the API server is away."""

from __future__ import annotations

import contextlib
import json
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import urllib3
from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines

from .retry import Backoff

log = logging.getLogger(__name__)

WATCH_BACKOFF = Backoff(attempts=1_000_000, base=0.5, cap=30.0)
"""Between failed list/watch calls: a watcher never gives up, it only slows down."""
RESYNC_SECONDS = 600.0
"""Everything is listed again at least this often."""
PAGE_SIZE = 500
"""Objects per list page: a cluster's pods come in bounded pieces, not one huge body."""


class Gone(Exception):
    """410: the resourceVersion is older than the server keeps; list again."""


class ListWatchSource(Protocol):
    def list(self) -> tuple[list[Mapping[str, Any]], str]:
        """Every object and the list's resourceVersion."""
        ...

    def watch(self, resource_version: str, stop: threading.Event
              ) -> Iterator[tuple[str, Mapping[str, Any]]]:
        """(event type, object) from `resource_version` on, until the server ends the stream;
        raises Gone when the version expired."""
        ...


def object_rv(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("resourceVersion") or "")


def watch_event(line: str | bytes, skip: Callable[[Any], bool] | None
                ) -> tuple[str, Mapping[str, Any]] | None:
    """One line of a watch stream as (type, object); None for a blank line or one `skip`
    drops unparsed. An ERROR event whose code is 410 raises Gone; any other ERROR is returned
    for the caller to raise as its transport's error."""
    if not line.strip() or (skip is not None and skip(line)):
        return None
    event = json.loads(line)
    kind, obj = str(event.get("type") or ""), event.get("object") or {}
    if kind == "ERROR" and obj.get("code") == 410:
        raise Gone(str(obj.get("message") or "resource version too old"))
    return kind, obj


class KubeListWatch:
    """A ListWatchSource over one list method of the official client, for example
    `functools.partial(CoreV1Api.list_pod_for_all_namespaces, field_selector=...)`: the same
    call lists (in pages) and, with `watch=True`, streams the changes."""

    def __init__(self, list_call: Callable[..., Any], *, watch_seconds: int = 300,
                 request_timeout: float = 30.0, read_timeout: float | None = None,
                 page_size: int = PAGE_SIZE, skip: Callable[[str], bool] | None = None
                 ) -> None:
        self.list_call = list_call
        self.skip = skip
        """Called with each raw event line; True drops it unparsed (a cheap filter)."""
        self.watch_seconds = watch_seconds
        self.request_timeout = request_timeout
        # A server ends the stream after watch_seconds; the read timeout only catches one that
        # went silent (a dead connection), so it leaves the server some slack.
        self.read_timeout = watch_seconds + 30.0 if read_timeout is None else read_timeout
        self.page_size = page_size
        self._open: set[Any] = set()
        self._closed = False
        self._lock = threading.Lock()

    def close(self) -> None:
        """Ends the watch streams open now, and any opened later (shutdown): their blocked
        reads return at once."""
        with self._lock:
            self._closed = True
            responses = list(self._open)
        for response in responses:
            with contextlib.suppress(Exception):  # already closed: nothing to end
                response.shutdown()

    def _call(self, **kwargs: Any) -> Any:
        try:
            return self.list_call(_preload_content=False, **kwargs)
        except ApiException as e:
            if e.status == 410:  # a watch's version, or a list page's continue token, expired
                raise Gone(str(e.reason)) from None
            raise

    def list(self) -> tuple[list[Mapping[str, Any]], str]:
        items: list[Mapping[str, Any]] = []
        resource_version, token = "", None
        while True:
            response = self._call(limit=self.page_size, _continue=token,
                                  _request_timeout=self.request_timeout)
            body = json.loads(response.data or b"{}")
            items.extend(body.get("items") or [])
            meta = body.get("metadata") or {}
            # Every page of one list is the same snapshot: the first page's version is its.
            resource_version = resource_version or str(meta.get("resourceVersion") or "")
            token = meta.get("continue")
            if not token:
                return items, resource_version

    def watch(self, resource_version: str, stop: threading.Event
              ) -> Iterator[tuple[str, Mapping[str, Any]]]:
        response = self._call(watch=True, allow_watch_bookmarks=True,
                              resource_version=resource_version or None,
                              timeout_seconds=self.watch_seconds,
                              _request_timeout=(self.request_timeout, self.read_timeout))
        with self._lock:
            self._open.add(response)
            if self._closed:  # close() came while the watch was being opened
                with contextlib.suppress(Exception):  # as in close()
                    response.shutdown()
        try:
            for line in iter_resp_lines(response):
                if stop.is_set():
                    return
                event = watch_event(line, self.skip)
                if event is None:
                    continue
                kind, obj = event
                if kind == "ERROR":
                    raise ApiException(status=obj.get("code"), reason=obj.get("message"))
                yield kind, obj
        except (urllib3.exceptions.HTTPError, OSError):
            if stop.is_set():
                return  # close() cut the stream on purpose
            raise
        finally:
            with self._lock:
                self._open.discard(response)
            response.close()
            response.release_conn()


class Cycle:
    """The bookkeeping of one list + watch loop, shared by `list_watch` (a thread's) and
    `aio_listwatch.list_watch_async` (an event loop's): where the watch resumes, when to list
    again, and how long to wait after a failure."""

    def __init__(self, what: str, *, backoff: Backoff, rng: random.Random | None,
                 resync_seconds: float, monotonic: Callable[[], float]) -> None:
        self.what, self.backoff, self.resync_seconds = what, backoff, resync_seconds
        self.rng = rng or random.Random()
        self.monotonic = monotonic
        self.resource_version = ""
        self.failures = 0
        self.listed_at = monotonic()

    def must_list(self) -> bool:
        """Before each list-or-watch step: True when the step must begin with a list (first,
        after an expiry, and at least every `resync_seconds`)."""
        if self.resource_version and self.monotonic() - self.listed_at >= self.resync_seconds:
            self.resource_version = ""  # periodic resync
        if not self.resource_version:
            self.listed_at = self.monotonic()
        return not self.resource_version

    def listed(self, count: int, resource_version: str) -> None:
        self.resource_version = resource_version
        log.info("listed %d %s at resourceVersion %s", count, self.what,
                 resource_version or "-")

    def progressed(self, obj: Mapping[str, Any] | None = None) -> None:
        """A list handled, or a watch event (`obj`): the watch resumes after it."""
        if obj is not None:
            self.resource_version = object_rv(obj) or self.resource_version
        self.failures = 0

    def expired(self, error: Exception) -> None:
        log.info("the %s watch expired (%s); listing again", self.what, error)
        self.resource_version = ""

    def failed(self, error: Exception) -> float:
        """The delay before the next try."""
        delay = self.backoff.delay(min(self.failures, 16), self.rng)
        self.failures += 1
        log.warning("%s list/watch failed (%s: %s); again in %.1fs", self.what,
                    type(error).__name__, error, delay)
        return delay


def list_watch(
    source: ListWatchSource,
    on_list: Callable[[list[Mapping[str, Any]]], object],
    on_event: Callable[[str, Mapping[str, Any]], object],
    stop: threading.Event,
    *,
    what: str,
    backoff: Backoff = WATCH_BACKOFF,
    rng: random.Random | None = None,
    resync_seconds: float = RESYNC_SECONDS,
    monotonic: Callable[[], float] = time.monotonic,
) -> None:
    """Hands every full list to `on_list` and every watch event (BOOKMARK included) to
    `on_event`, until `stop` is set. `what` names the objects in the log ("BindRequest(s)").
    A failing list or watch is retried after a backoff; an exception from a handler is not
    caught here (the handlers own their errors)."""
    cycle = Cycle(what, backoff=backoff, rng=rng, resync_seconds=resync_seconds,
                  monotonic=monotonic)
    while not stop.is_set():
        try:
            if cycle.must_list():
                items, resource_version = source.list()
                cycle.listed(len(items), resource_version)
                on_list(items)
                cycle.progressed()
                if stop.is_set():  # stopped while it listed: no watch to open
                    return
            for kind, obj in source.watch(cycle.resource_version, stop):
                on_event(kind, obj)
                cycle.progressed(obj)
        except Gone as e:
            cycle.expired(e)
        except (ApiException, urllib3.exceptions.HTTPError, OSError, ValueError) as e:
            stop.wait(cycle.failed(e))
