"""Pass errors that last. A reconcile pass reports why it did not converge as reasons (the
metric `kai_fractions_reconcile_errors_total` counts each), most of them the short waits of a
new pod (its cgroup not made yet, say). A reason that lasts `PERSIST_SECONDS` is logged once as
a warning, naming the containers it holds pending, and at info level when it clears: the
agent's log then says what the alert on that metric sends an operator to read."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping

from ...contract.errors import shown
from ..engine import ContainerState
from .reconciler import NodeView

log = logging.getLogger(__name__)

PERSIST_SECONDS = 30.0
SHOWN_CONTAINERS = 3


class PassErrorLog:
    def __init__(self, monotonic: Callable[[], float], persist: float = PERSIST_SECONDS):
        self.monotonic = monotonic
        self.persist = persist
        self._since: dict[str, float] = {}
        self._warned: set[str] = set()

    def update(self, errors: Iterable[str], view: Callable[[], NodeView]) -> None:
        """After each pass: its reasons, and the view it left (read only to warn)."""
        now = self.monotonic()
        current = set(errors)
        for reason in [r for r in self._since if r not in current]:
            del self._since[reason]
            if reason in self._warned:
                self._warned.discard(reason)
                log.info("reconcile: %s no longer reported", reason)
        for reason in sorted(current):
            since = self._since.setdefault(reason, now)
            if reason in self._warned or now - since < self.persist:
                continue
            self._warned.add(reason)
            held = pending(view()).get(reason, [])
            shown_held = "; ".join(held[:SHOWN_CONTAINERS])
            more = f" and {len(held) - SHOWN_CONTAINERS} more" if len(held) > SHOWN_CONTAINERS \
                else ""
            log.warning("reconcile passes have reported %s for %.0f s%s; the passes go on "
                        "trying (kai-fractions inspect node shows every container's state)",
                        reason, now - since,
                        f": {len(held)} container(s) pending: {shown_held}{more}" if held
                        else "")


def pending(view: NodeView) -> Mapping[str, list[str]]:
    """reason -> `namespace/pod/container: message` of each container pending for it."""
    refs = {c.key: c.ref for c in view.desired.containers} if view.desired is not None else {}
    out: dict[str, list[str]] = {}
    for key, result in sorted(view.results.items()):
        if result.state is not ContainerState.PENDING or not result.reason:
            continue
        ref = refs.get(key, f"{key.pod_uid}/{key.container}")
        out.setdefault(result.reason, []).append(f"{ref}: {shown(result.message or '')}")
    return out
