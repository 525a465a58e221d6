"""NVML as the agent's passes see it: the inventory each pass takes, or why NVML does not work.

A failure is logged once per distinct message (a pass may run every second while it lasts) and
NVML is shut down, so the next pass starts it from scratch: the driver may come back (reloaded
or upgraded) under the same agent. While NVML does not work nothing can be verified, so the pass
plans and writes nothing, and the node condition and GetNodeState say why.
"""

from __future__ import annotations

import contextlib
import logging

from ..errors import NodeError, NvmlError
from ..inventory import Inventory, take_inventory
from ..nvml import Nvml

log = logging.getLogger(__name__)


class NvmlHealth:
    def __init__(self, nvml: Nvml):
        self.nvml = nvml
        self.inventory: Inventory | None = None
        """What the last pass took; None while NVML does not work (or before the first)."""
        self.error: NodeError | None = None
        """Why NVML did not work on the last pass; None when it did."""

    def take(self, mps_namespaces: bool | None) -> Inventory | None:
        try:
            self.nvml.init()
            inventory = take_inventory(self.nvml, mps_namespaces=mps_namespaces)
        except NvmlError as e:
            if self.error is None or self.error.message != e.message:
                log.error("NVML does not work (%s): %s", e.reason, e.message)
            self.error, self.inventory = e, None
            with contextlib.suppress(NvmlError):  # from scratch next time (the driver may return)
                self.nvml.shutdown()
            return None
        if self.error is not None:
            log.info("NVML works again: %d GPU(s), driver %s", len(inventory.devices),
                     inventory.driver_version)
        self.error, self.inventory = None, inventory
        return inventory

    def shutdown(self) -> None:
        with contextlib.suppress(NvmlError):
            self.nvml.shutdown()
