"""The compute-mode step of one apply (`kai_fractions.node.engine`): each GPU in the mode its
containers need (EXCLUSIVE_PROCESS for sm-sharing, DEFAULT for time-slicing), what the report
says of an sm-sharing GPU that could not be put in EXCLUSIVE_PROCESS, and a GPU the agent put in
EXCLUSIVE_PROCESS given back its earlier mode once no fractional container is left on it.

Why the last: a GPU left in EXCLUSIVE_PROCESS holds one CUDA context at a time, so a whole-GPU
pod KAI places there next cannot open a second one (a multi-process server, DDP's helpers).
The agent gives back only the mode it changed (`LimitLedger.save_modes`, recorded before the
switch and kept across agent restarts of this boot), and only while no process runs on the GPU
(an MPS server that has not exited yet, or a workload already placed there).

A step of the engine's `_Run` over the apply's state (`engine_run.RunState`); of the Engine
(`e`) it uses `nvml`, `config`, `ledger`, `_switched` and `_wrong_mode`.
"""

from __future__ import annotations

import logging

from .desired_state import GpuDesired
from .engine_reports import GpuResult, Issue
from .engine_run import RunState
from .errors import NvmlError
from .nvml import DeviceInfo, GpuComputeMode

log = logging.getLogger(__name__)

MODE_NOT_RECORDED = "ComputeModeNotRecorded"
MODE_NOT_RESTORED = "ComputeModeNotRestored"


class ComputeModeStep(RunState):
    """The GPUs' compute modes of an apply: set for their containers, or given back."""

    def compute_modes(self) -> None:
        for g in self.d.gpus:
            device = self.devices.get(g.uuid)
            if device is None:
                continue  # the plan refused its containers (DeviceNotOnNode)
            if g.compute_mode is None:
                self._give_back(g, device)
                continue
            mode, changed, error = device.compute_mode, False, None
            if self.e.config.sm_sharing and device.compute_mode != g.compute_mode:
                if g.compute_mode is GpuComputeMode.EXCLUSIVE_PROCESS:
                    self._record_switch(g.uuid, device.compute_mode)
                try:
                    self.e.nvml.set_compute_mode(g.uuid, g.compute_mode)
                    mode, changed = g.compute_mode, True
                    self.modes_set.append((g.uuid, g.compute_mode))
                except NvmlError as e:
                    error = e
                    self.fail(g.containers, e)
                    # Read back in another mode, and not set: known not in force for its
                    # sm-sharing containers (`mode_missing`). Not for a time-slicing GPU left
                    # in EXCLUSIVE_PROCESS: that only keeps a second process from starting.
                    if g.compute_mode is GpuComputeMode.EXCLUSIVE_PROCESS:
                        self.e._wrong_mode[g.uuid] = (device.compute_mode, e)
            if mode == g.compute_mode:  # read back in force, or set now
                self.e._wrong_mode.pop(g.uuid, None)
            if mode is not GpuComputeMode.EXCLUSIVE_PROCESS:
                self._forget_switch(g.uuid)  # its containers need another mode: no longer ours
            self.gpu_results.append(GpuResult(g.uuid, mode, changed, error))

    def _give_back(self, g: GpuDesired, device: DeviceInfo) -> None:
        """A GPU no container plans a mode for: its earlier mode back, where the agent set
        EXCLUSIVE_PROCESS, nothing of the node's fractions is on it and no process runs."""
        before = self.e._switched.get(g.uuid)
        mode, changed, error = device.compute_mode, False, None
        self._unrecorded(g, device, before)
        if before is not None and device.compute_mode is not GpuComputeMode.EXCLUSIVE_PROCESS:
            self._forget_switch(g.uuid)  # someone else changed it since: theirs now
        elif before is not None and not g.containers and not g.requested_bytes:
            try:
                busy = (self.e.nvml.running_processes(g.uuid)
                        or self.e.nvml.other_processes(g.uuid))  # MPS clients, on some drivers
                if not busy:
                    self.e.nvml.set_compute_mode(g.uuid, before)
                    mode, changed = before, True
                    self.modes_set.append((g.uuid, before))
                    self._forget_switch(g.uuid)
                    log.info("GPU %s: no fractional container left; compute mode %s given back "
                             "(the agent had set EXCLUSIVE_PROCESS)", g.uuid, before.name)
            except NvmlError as e:
                error = e
                self._issue(MODE_NOT_RESTORED, (
                    f"GPU {g.uuid} stays in EXCLUSIVE_PROCESS, which the agent set for "
                    f"sm-sharing, though no fractional container is left on it: {e}; tried "
                    f"again at the next pass (by hand: nvidia-smi -i {g.uuid} -c "
                    f"{before.name})"))
        self.gpu_results.append(GpuResult(g.uuid, mode, changed, error))

    def _unrecorded(self, g: GpuDesired, device: DeviceInfo, before: GpuComputeMode | None
                    ) -> None:
        """Logs once a GPU in EXCLUSIVE_PROCESS with no fractional container and no record of
        a switch (`before` None): an administrator's choice, or a switch of a release before
        the record, which never gives it back. Left as it is either way; the log says how to
        reset it. Logged again only after it was seen in another mode."""
        noted = self.e._unrecorded_exclusive
        if device.compute_mode is not GpuComputeMode.EXCLUSIVE_PROCESS:
            noted.discard(g.uuid)
            return
        if before is not None or g.containers or g.requested_bytes or g.uuid in noted:
            return
        noted.add(g.uuid)
        log.warning("GPU %s is in EXCLUSIVE_PROCESS with no fractional container on it, and the "
                    "agent has no record of setting it: left as it is; if an earlier "
                    "kai-fractions release set it (releases before the record did not give it "
                    "back), reset it with nvidia-smi -i %s -c DEFAULT", g.uuid, g.uuid)

    def _record_switch(self, uuid: str, before: GpuComputeMode) -> None:
        """Before the agent puts a GPU in EXCLUSIVE_PROCESS: the mode to give back later,
        saved first, so that an agent restarted in between still knows it (a failed save
        does not hold the switch back: sm-sharing needs it; the issue says what it costs)."""
        if uuid in self.e._switched:
            return
        self.e._switched[uuid] = before
        self._save_switches()

    def _forget_switch(self, uuid: str) -> None:
        if self.e._switched.pop(uuid, None) is not None:
            self._save_switches()

    def _save_switches(self) -> None:
        try:
            self.e.ledger.save_modes({u: m.name for u, m in self.e._switched.items()})
        except OSError as e:
            self._issue(MODE_NOT_RECORDED, (
                f"could not record which GPUs the agent put in EXCLUSIVE_PROCESS ({e}); after "
                "a restart of the agent, such a GPU may stay in that mode once its last "
                "sm-sharing container is gone"))

    def _issue(self, reason: str, message: str) -> None:
        """A pass error (its reason counts as the pass's); the message goes to the log."""
        log.warning("%s: %s", reason, message)
        self.issues.append(Issue(reason, message))
