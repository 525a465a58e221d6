"""When the follower checks a BindRequest again on its own: after a check that could not finish
for a reason that passes by itself, with a bounded exponential backoff.

The watch shows a BindRequest only when it changes, and a relist comes 600 to 900 s later
(RESYNC_SECONDS, at the end of a 300 s watch), while the node agent's gate fails a pod it has
waited 600 s for (its default --timeout). So a fresh bind whose check met an API server briefly
away, or a pod written to three times while it was being signed (KAI's binder patches its
status right after it marks the BindRequest Succeeded, then the kubelet), must be checked
again soon, not at the next list. What cannot pass by itself (a mismatch, an invalid decision,
another pod of that name) waits for a change, as before: checked again in a loop, it would only
cost reads.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable, Hashable
from typing import Any

from ..kube.retry import Backoff
from .errors import ApiUnavailable, DeadlineExceeded

log = logging.getLogger(__name__)

RECHECK_BACKOFF = Backoff(attempts=1_000_000, base=1.0, cap=60.0)
"""From 1 s, doubling, to at most 60 s between checks (jittered down by up to half), for as
long as the check stays incomplete (within RECHECK_WINDOW): `attempts` is not used."""
RECHECK_WINDOW = 900.0
"""How long one version of a BindRequest is checked again: past the gate's default timeout
(600 s), after which its pod's gate has failed and the next list checks it as every other.
Without a bound, a cause that does not pass (a reservation namespace set wrong: every check
"GPU not known yet") would check every BindRequest once a minute for ever."""


def wants_recheck(outcome: object) -> bool:
    """Whether a handling's outcome (what it returned, or the exception it raised) may pass
    by itself: an API server that stayed away through the store's own retries, or a result
    that says so (`Verification.recheck`)."""
    if isinstance(outcome, BaseException):
        return isinstance(outcome, (ApiUnavailable, DeadlineExceeded))
    return getattr(outcome, "recheck", False) is True


class Rechecks:
    """One timer per BindRequest to check again, keyed as the follow loop keys them; `due(item)`
    is called when one fires. A BindRequest handled again at the same resourceVersion waits
    twice as long as before (up to the cap); a new version starts again from the base."""

    def __init__(self, due: Callable[[Any], object], backoff: Backoff = RECHECK_BACKOFF,
                 rng: random.Random | None = None, window: float = RECHECK_WINDOW) -> None:
        self.due = due
        self.backoff = backoff
        self.rng = rng or random.Random()
        self.window = window
        self._timers: dict[Hashable, asyncio.TimerHandle] = {}
        self._tries: dict[Hashable, tuple[str, int, float]] = {}
        """key -> (the resourceVersion checked, the rechecks of it so far, when its first
        incomplete check ended: the loop's clock)."""

    def after(self, key: Hashable, version: str, item: object, wanted: bool) -> float | None:
        """A handling of `item` (at `version`) ended: its recheck's delay, or None when it
        needs none (and what was counted for it is forgotten) or when this version has been
        incomplete for `window` already."""
        self.cancel(key)
        if not wanted:
            self._tries.pop(key, None)
            return None
        loop = asyncio.get_running_loop()
        last, tries, since = self._tries.get(key, (version, -1, loop.time()))
        if last != version:
            tries, since = -1, loop.time()
        if loop.time() - since >= self.window:
            # Kept, not forgotten: a list that hands this version over again, still
            # incomplete, sets no recheck either.
            if tries >= 0:
                log.warning("BindRequest %s: still not complete %.0f s after its first "
                            "incomplete check; checked again when it changes or at the next "
                            "list", getattr(item, "ref", key), loop.time() - since)
                self._tries[key] = (version, -1, since)
            return None
        self._tries[key] = (version, tries + 1, since)
        delay = self.backoff.delay(tries + 1, self.rng)
        self._timers[key] = loop.call_later(delay, self._fire, key, item)
        return delay

    def cancel(self, key: Hashable) -> None:
        """`key` is being handled again (its event, its list entry): no recheck is due."""
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()

    def forget(self, key: Hashable) -> None:
        """`key` is gone (deleted): nothing of it is kept."""
        self.cancel(key)
        self._tries.pop(key, None)

    def retain(self, keys: set[Hashable] | dict[Hashable, object]) -> None:
        """A relist: it hands every live BindRequest over again, so no timer is kept, and the
        counts only of those listed (the others were deleted while the watch was away)."""
        for key in list(self._timers):
            self.cancel(key)
        self._tries = {key: tries for key, tries in self._tries.items() if key in keys}

    def close(self) -> None:
        """The loop stops (the term ended): every timer is dropped."""
        for key in list(self._timers):
            self.cancel(key)
        self._tries.clear()

    def _fire(self, key: Hashable, item: object) -> None:
        self._timers.pop(key, None)
        self.due(item)
