"""What the node's GPUs and driver are and can do, read once through the NVML seam."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from .nvml import DeviceInfo, GpuComputeMode, Nvml


@dataclass(frozen=True, slots=True)
class Capabilities:
    memory_limits: bool
    """The driver exports nvmlDeviceSet/GetMemoryLimits_v1 (r615+): cgroup GPU memory limits."""
    mps_namespaces: bool
    """MPS v3 namespaces (a compute cap per container). They came with the same r615 release as
    the memory limits and NVML has no probe of its own for them, so this follows memory_limits
    unless the caller knows better."""


@dataclass(frozen=True, slots=True)
class Inventory:
    driver_version: str
    devices: tuple[DeviceInfo, ...]
    capabilities: Capabilities

    def device(self, uuid: str) -> DeviceInfo | None:
        return next((d for d in self.devices if d.uuid == uuid), None)

    @property
    def uuids(self) -> tuple[str, ...]:
        return tuple(d.uuid for d in self.devices)

    def with_compute_modes(self, modes: Iterable[tuple[str, GpuComputeMode]]) -> Inventory:
        """This inventory with the compute modes an apply set since it was taken, so that what
        the agent reports is the mode in force, not the one it replaced."""
        by_uuid = dict(modes)
        if not by_uuid:
            return self
        return replace(self, devices=tuple(
            replace(d, compute_mode=by_uuid[d.uuid]) if d.uuid in by_uuid else d
            for d in self.devices))


def take_inventory(nvml: Nvml, *, mps_namespaces: bool | None = None) -> Inventory:
    """Devices, driver version and capabilities. NVML must be initialised; NVML errors propagate
    as the typed errors of `errors.py` (the agent turns them into its node condition)."""
    limits = nvml.memory_limits_supported()
    return Inventory(
        driver_version=nvml.driver_version(),
        devices=tuple(sorted(nvml.devices(), key=lambda d: d.index)),
        capabilities=Capabilities(
            memory_limits=limits,
            mps_namespaces=limits if mps_namespaces is None else mps_namespaces,
        ),
    )
