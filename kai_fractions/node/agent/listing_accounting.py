"""The NVML listings a watchdog check takes of a GPU beside its compute one, and the test that
accounts a suspect GPU's memory in use against all of them (`GpuListings`).

Apart from `blindness`, which judges what these find (its kinds of blindness and their
episodes): here is only what NVML is asked and what its answers add up to. The graphics and MPS
compute listings are each taken on its own (`other_processes`): a graphics listing that fails
leaves the others to be watched and to account, logged once (graphics processes are not how an
MPS tenant escapes its cap); an MPS listing that fails is kept for `BlindnessTracker.judge`. A
GPU whose listings make it a suspect of NO_PROCESSES_VISIBLE is judged by a sequence of its
own (`hidden_memory`): its memory read, its listings taken again, its memory read again, and
the smaller read counts, so a process that starts or exits meanwhile is not taken for a hidden
one.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from ...contract import MIB
from ..errors import NvmlCapabilityMissing, NvmlError
from ..nvml import GRAPHICS_PROCESSES, MPS_PROCESSES, DeviceInfo, Nvml, other_listings
from ..watchdog import merge_listings

# The blindness tracker's logger, as before this code moved here: these lines are the check's.
log = logging.getLogger(f"{__package__}.usage.blindness")

UNSEEN_MEMORY_BYTES = 512 * MIB
"""GPU memory in use beyond what the listed processes account for that counts as processes NVML
does not show. NVML's `used` (nvmlMemory_v2, drivers since R510) leaves the driver's reserved
memory out, so an idle GPU reads 0 to a few MiB; the v1 fallback of older drivers counts the
reserved memory too, typically a few hundred MiB. One CUDA context alone takes some 300-500 MiB
on recent GPUs: a hidden workload crosses this at its first allocations, an idle GPU does not."""


class GpuListings:
    """A GPU's graphics and MPS compute listings (`other_processes`) and the hidden-memory test
    (`hidden_memory`), with what a check must remember of them. Driven by `BlindnessTracker`,
    on the worker thread."""

    def __init__(self, nvml: Nvml):
        self.nvml = nvml
        self._graphics_failing: dict[str, str] = {}
        """GPU uuid -> the reason its graphics listing fails, while it does (logged once; the
        watchdog and its hidden-memory test go on with the compute and MPS listings)."""
        self.mps_failed: dict[str, NvmlError] = {}
        """GPU uuid -> why its MPS client listing failed in the check in progress
        (`BlindnessTracker.judge` decides where that is blindness, and empties it)."""

    def forget_gone(self, here: set[str]) -> None:
        """Forgets the GPUs the node no longer has."""
        for state in (self._graphics_failing, self.mps_failed):
            for gone in state.keys() - here:
                del state[gone]

    def other_processes(self, uuid: str) -> tuple[Any, ...]:
        """`Nvml.other_processes` (the graphics and MPS compute listings, each taken on its
        own), for the watchdog to attribute and for the hidden-memory test to account: the
        processes of those that list; none of one the driver lacks. A graphics listing that
        fails otherwise is logged once, the other listings watched (graphics processes are not
        how an MPS tenant escapes its cap; the compute listing alone may then read a graphics
        process's memory as hidden, `NO_PROCESSES_VISIBLE`: more than the listing working
        would, never less). An MPS listing that fails otherwise is kept (`mps_failed`) for
        `BlindnessTracker.judge`: blindness (MPS_LISTING_FAILED) where sm-sharing containers
        are planned."""
        failed: Mapping[str, NvmlError] = {}
        try:
            processes = tuple(self.nvml.other_processes(uuid))
        except NvmlCapabilityMissing:  # a driver without those listings: none
            processes = ()
        except NvmlError as e:
            listed = other_listings(e)
            processes, failed = listed.processes, listed.failed
        graphics = failed.get(GRAPHICS_PROCESSES)
        if graphics is None:
            self._graphics_failing.pop(uuid, None)
        else:
            if self._graphics_failing.get(uuid) != graphics.reason:
                log.warning("GPU %s: its graphics process listing fails (%s: %s); the watchdog "
                            "watches and accounts what the compute and MPS listings show",
                            uuid, graphics.reason, graphics.message)
            self._graphics_failing[uuid] = graphics.reason
        mps = failed.get(MPS_PROCESSES)
        if mps is not None:
            self.mps_failed[uuid] = mps
        return processes

    def hidden_memory(self, suspects: Iterable[str]
                      ) -> tuple[dict[str, int], dict[str, NvmlError]]:
        """The hidden-memory test of the `suspects` GPUs: their memory in use read, every
        listing taken again (the compute one, and the graphics and MPS client ones:
        `other_processes`; each pid once, `merge_listings`), their memory read again, and the
        smaller of the two reads compared with what the listings account for (a process that
        started in between is in neither the first read nor, perhaps, the listings; one that
        exited, in neither the second read nor, perhaps, the listings). Returns GPU uuid -> the
        bytes in use that no listed process accounts for, where more than UNSEEN_MEMORY_BYTES;
        and GPU uuid -> why its test could not run (a memory read or its compute listing
        failed). A process listed without its memory leaves the GPU clear (its share cannot be
        told), and so does a graphics or MPS listing the driver lacks or does not support (no
        such processes); one that fails otherwise leaves the other listings to account
        (`other_processes`). No suspect, no read."""
        suspects = list(suspects)
        unseen: dict[str, int] = {}
        untested: dict[str, NvmlError] = {}
        if not suspects:
            return unseen, untested
        before = self._memory_used()
        listed: dict[str, tuple[Any, ...]] = {}
        for uuid in suspects:
            try:
                listed[uuid] = merge_listings(self.nvml.running_processes(uuid),
                                              self.other_processes(uuid))
            except NvmlError as e:
                untested[uuid] = e
        after = self._memory_used()
        for uuid in suspects:
            failed = next((x for x in (before, after) if isinstance(x, NvmlError)), None)
            if failed is not None:
                untested.setdefault(uuid, failed)
            if uuid in untested:
                continue
            d0, d1 = before.get(uuid), after.get(uuid)  # type: ignore[union-attr]
            if d0 is None or d1 is None or d0.mig_enabled or d1.mig_enabled:
                continue
            if any(p.used_bytes is None for p in listed[uuid]):
                continue  # a share that cannot be told: not judged
            hidden = (min(d0.memory_used, d1.memory_used)
                      - sum(p.used_bytes for p in listed[uuid]))
            if hidden > UNSEEN_MEMORY_BYTES:
                unseen[uuid] = hidden
        return unseen, untested

    def _memory_used(self) -> dict[str, DeviceInfo] | NvmlError:
        """The GPUs as NVML reads them now (their memory in use), or why it cannot."""
        try:
            return {d.uuid: d for d in self.nvml.devices()}
        except NvmlError as e:
            return e
