"""List and watch KAI's BindRequests (scheduling.run.ai/v1alpha2), resuming from the last
resourceVersion and relisting when the server says it is too old (410 Gone)."""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import urllib3
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines

from .follower import GROUP, PLURAL, VERSION
from .retry import Backoff

log = logging.getLogger(__name__)

WATCH_BACKOFF = Backoff(attempts=1_000_000, base=0.5, cap=30.0)
"""Between failed list/watch calls; the follower never gives up, it only slows down."""
RESYNC_SECONDS = 600.0
"""Everything is listed (and handled) again at least this often."""


class Gone(Exception):
    """410: the resourceVersion is older than the server keeps; list again."""


class BindRequestSource(Protocol):
    def list(self) -> tuple[list[Mapping[str, Any]], str]:
        """Every BindRequest and the list's resourceVersion."""
        ...

    def watch(self, resource_version: str, stop: threading.Event
              ) -> Iterator[tuple[str, Mapping[str, Any]]]:
        """(event type, object) from `resource_version` on, until the server ends the stream;
        raises Gone when the version expired."""
        ...


def _object_rv(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("resourceVersion") or "")


class KubeBindRequestSource:
    def __init__(self, api_client: k8s.ApiClient, *, watch_seconds: int = 300,
                 request_timeout: float = 30.0, read_timeout: float | None = None) -> None:
        self.api = k8s.CustomObjectsApi(api_client)
        self.watch_seconds = watch_seconds
        self.request_timeout = request_timeout
        # A server ends the stream after watch_seconds; the read timeout only catches one that
        # went silent (a dead connection), so it leaves the server some slack.
        self.read_timeout = watch_seconds + 30.0 if read_timeout is None else read_timeout

    def list(self) -> tuple[list[Mapping[str, Any]], str]:
        try:
            response = self.api.list_cluster_custom_object(
                GROUP, VERSION, PLURAL, _preload_content=False,
                _request_timeout=self.request_timeout)
        except ApiException as e:
            if e.status == 410:
                raise Gone(str(e.reason)) from None
            raise
        body = json.loads(response.data or b"{}")
        return list(body.get("items") or []), _object_rv(body)

    def watch(self, resource_version: str, stop: threading.Event
              ) -> Iterator[tuple[str, Mapping[str, Any]]]:
        try:
            response = self.api.list_cluster_custom_object(
                GROUP, VERSION, PLURAL, watch=True, allow_watch_bookmarks=True,
                resource_version=resource_version or None, timeout_seconds=self.watch_seconds,
                _preload_content=False,
                _request_timeout=(self.request_timeout, self.read_timeout))
        except ApiException as e:
            if e.status == 410:
                raise Gone(str(e.reason)) from None
            raise
        try:
            for line in iter_resp_lines(response):
                if stop.is_set():
                    return
                if not line.strip():
                    continue
                event = json.loads(line)
                kind, obj = str(event.get("type") or ""), event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise Gone(str(obj.get("message") or "resource version too old"))
                    raise ApiException(status=obj.get("code"), reason=obj.get("message"))
                yield kind, obj
        finally:
            response.close()
            response.release_conn()


def follow(
    source: BindRequestSource,
    handle: Callable[[Mapping[str, Any]], object],
    stop: threading.Event,
    *,
    backoff: Backoff = WATCH_BACKOFF,
    rng: random.Random | None = None,
    resync_seconds: float = RESYNC_SECONDS,
    monotonic: Callable[[], float] = time.monotonic,
) -> None:
    """Level-triggered: every BindRequest seen (listed or watched) goes to `handle`, which must
    be idempotent. A watch only replays changes, so a handling that failed for a reason of its
    own (a conflict while signing, the API briefly away) is retried by listing everything again
    once `resync_seconds` have passed, when the current watch stream ends. Returns when `stop`
    is set."""
    rng = rng or random.Random()
    resource_version = ""
    failures = 0
    listed_at = monotonic()
    while not stop.is_set():
        try:
            if resource_version and monotonic() - listed_at >= resync_seconds:
                resource_version = ""  # periodic resync
            if not resource_version:
                listed_at = monotonic()
                items, resource_version = source.list()
                log.info("listed %d BindRequest(s) at resourceVersion %s", len(items),
                         resource_version or "-")
                for item in items:
                    _handle(handle, item)
                failures = 0
            for kind, obj in source.watch(resource_version, stop):
                if kind in ("ADDED", "MODIFIED"):
                    _handle(handle, obj)
                resource_version = _object_rv(obj) or resource_version
                failures = 0
        except Gone as e:
            log.info("BindRequest watch expired (%s); listing again", e)
            resource_version = ""
        except (ApiException, urllib3.exceptions.HTTPError, OSError, ValueError) as e:
            delay = backoff.delay(min(failures, 16), rng)
            failures += 1
            log.warning("BindRequest list/watch failed (%s: %s); again in %.1fs",
                        type(e).__name__, e, delay)
            stop.wait(delay)


def _handle(handle: Callable[[Mapping[str, Any]], object], obj: Mapping[str, Any]) -> None:
    try:
        handle(obj)
    except Exception:
        # One bad object or a failed event must not stop the follower.
        meta = obj.get("metadata") or {}
        log.exception("BindRequest %s/%s: check failed", meta.get("namespace"),
                      meta.get("name"))
