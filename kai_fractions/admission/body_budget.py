"""The bound on the request bodies the admission server holds: how large one may be
(MAX_BODY), how many bytes of them (and of the answers written in their place) are held at once
(BODY_BUDGET), and the thread-safe count of that budget (Budget).

Separate from server.py because the count is shared state with readers of its own: the server
makes one, each request's handler takes and gives its bytes back, and the metrics read it at
each scrape; the size limits are the numbers it is made with.
"""

from __future__ import annotations

import threading
import time

MAX_BODY = 3 * 1024 * 1024
"""The largest AdmissionReview read. The API server itself reads no write request over 3 MiB
(its MaxRequestBodyBytes: twice etcd's default 1.5 MiB request limit, as JSON is larger than
the protobuf etcd stores), so no pod it can store is larger than that in JSON. Pods are a few
KiB; a review past this (an UPDATE carries two objects) is refused with 413, so the pod fails
closed, never open. A larger cap only raises what a hostile body costs: parsed, JSON takes tens
of times its size in memory."""
MAX_BODIES = 4
BODY_BUDGET = MAX_BODIES * MAX_BODY
"""Bytes of request bodies held at once, counted as they arrive (a body announced but not sent
holds nothing): MAX_BODIES of the largest, or thousands of real reviews. A review's answer is
held in its body's place until it is written, which it takes for itself where it is larger (a
fractional pod with a 3 MiB env value is answered with a 4 MiB patch): answers their peers do
not read took the process past the chart's memory limit when they held nothing."""


class Budget:
    """A count of units (bytes) shared by the requests; thread-safe."""

    def __init__(self, size: int) -> None:
        self.size = self.free = size
        self._changed = threading.Condition()

    def take(self, n: int, timeout: float) -> bool:
        """Takes `n` units once they are free; False after `timeout` without."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while self.free < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
            self.free -= n
            return True

    def give(self, n: int) -> None:
        with self._changed:
            self.free += n
            self._changed.notify_all()
