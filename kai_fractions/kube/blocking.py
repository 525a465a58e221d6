"""A blocking face of `Kube` for threaded components (the node agent, inspect, the CLI): an
event loop in a thread of its own runs every request and every list + watch, so a threaded
caller uses the same client, errors and loop as the mirror does on its own event loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from kubernetes import client as k8s

from .client import Kube

T = TypeVar("T")


class BlockingKube:
    """`call` runs a coroutine of `self.kube` and waits for it; `spawn` starts one that runs
    until cancelled (a list + watch). `close` cancels what runs and ends the thread."""

    def __init__(self, api_client: k8s.ApiClient, *, name: str = "kube-loop",
                 **options: Any) -> None:
        self.kube = Kube(api_client, **options)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()
        self._spawned: set[concurrent.futures.Future[Any]] = set()

    def call(self, work: Callable[[Kube], Coroutine[Any, Any, T]],
             timeout: float | None = None) -> T:
        """`work(kube)`'s result; its error as raised."""
        return asyncio.run_coroutine_threadsafe(work(self.kube), self._loop).result(timeout)

    def request(self, method: str, path: str, **options: Any) -> Any:
        """`Kube.request`, blocking."""
        return self.call(lambda kube: kube.request(method, path, **options))

    def spawn(self, work: Callable[[Kube], Coroutine[Any, Any, Any]]
              ) -> concurrent.futures.Future[Any]:
        """Starts `work(kube)` on the loop; cancel the future to end it."""
        future = asyncio.run_coroutine_threadsafe(work(self.kube), self._loop)
        self._spawned.add(future)
        future.add_done_callback(self._spawned.discard)
        return future

    def close(self, timeout: float = 5.0) -> None:
        if not self._thread.is_alive():
            return
        for future in list(self._spawned):
            future.cancel()
        closing = asyncio.run_coroutine_threadsafe(self.kube.close(), self._loop)
        try:
            closing.result(timeout)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)
            if not self._thread.is_alive():
                self._loop.close()
