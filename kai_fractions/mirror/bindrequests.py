"""List and watch KAI's BindRequests (scheduling.run.ai/v1alpha2) and hand each one to the
follower: the generic loop of `listwatch` with BindRequest-specific handling."""

from __future__ import annotations

import functools
import logging
import random
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from kubernetes import client as k8s

from .follower import GROUP, PLURAL, VERSION
from .listwatch import RESYNC_SECONDS, WATCH_BACKOFF, Gone, KubeListWatch, list_watch
from .listwatch import ListWatchSource as BindRequestSource
from .retry import Backoff

log = logging.getLogger(__name__)

__all__ = ["BindRequestSource", "Gone", "KubeBindRequestSource", "follow"]


class KubeBindRequestSource(KubeListWatch):
    def __init__(self, api_client: k8s.ApiClient, *, watch_seconds: int = 300,
                 request_timeout: float = 30.0, read_timeout: float | None = None) -> None:
        api = k8s.CustomObjectsApi(api_client)
        super().__init__(functools.partial(api.list_cluster_custom_object, GROUP, VERSION, PLURAL),
                         watch_seconds=watch_seconds, request_timeout=request_timeout,
                         read_timeout=read_timeout)


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

    def on_list(items: list[Mapping[str, Any]]) -> None:
        for item in items:
            _handle(handle, item)

    def on_event(kind: str, obj: Mapping[str, Any]) -> None:
        if kind in ("ADDED", "MODIFIED"):
            _handle(handle, obj)

    list_watch(source, on_list, on_event, stop, what="BindRequest(s)", backoff=backoff, rng=rng,
               resync_seconds=resync_seconds, monotonic=monotonic)


def _handle(handle: Callable[[Mapping[str, Any]], object], obj: Mapping[str, Any]) -> None:
    try:
        handle(obj)
    except Exception:
        # One bad object or a failed event must not stop the follower.
        meta = obj.get("metadata") or {}
        log.exception("BindRequest %s/%s: check failed", meta.get("namespace"),
                      meta.get("name"))
