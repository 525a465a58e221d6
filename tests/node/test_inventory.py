"""take_inventory: through the real pynvml + fake library, and through the in-memory fake."""

from __future__ import annotations

import pytest

from kai_fractions.node.errors import NvmlDriverNotLoaded
from kai_fractions.node.inventory import Capabilities, Inventory, take_inventory
from kai_fractions.node.nvml import GpuComputeMode, PynvmlNvml
from kai_fractions.sim.nvml import FakeNvml

MIB = 1 << 20
U0 = "GPU-00000000-0000-0000-0000-000000000001"
U1 = "GPU-00000000-0000-0000-0000-000000000002"


def test_inventory_real_bindings_full_driver(fake_nvml) -> None:
    fake_nvml.add_gpu(U0, memory_mib=81559)
    fake_nvml.add_gpu(U1, memory_mib=81559, mig=True, compute_mode=3)
    nvml = PynvmlNvml()
    nvml.init()
    try:
        inv = take_inventory(nvml)
    finally:
        nvml.shutdown()
    assert isinstance(inv, Inventory)
    assert inv.driver_version == "615.48.02"
    assert inv.capabilities == Capabilities(memory_limits=True, mps_namespaces=True)
    assert inv.uuids == (U0, U1)
    assert inv.device(U1).mig_enabled and inv.device(U1).compute_mode is \
        GpuComputeMode.EXCLUSIVE_PROCESS
    assert inv.device(U0).memory_total == 81559 * MIB and not inv.device(U0).mig_enabled
    assert inv.device("GPU-nope") is None


def test_inventory_real_bindings_old_driver(fake_nvml_old_driver) -> None:
    fake_nvml_old_driver.set_driver_version("535.104.05")
    fake_nvml_old_driver.add_gpu(U0)
    nvml = PynvmlNvml()
    nvml.init()
    try:
        inv = take_inventory(nvml)
    finally:
        nvml.shutdown()
    assert inv.driver_version == "535.104.05"
    assert inv.capabilities == Capabilities(memory_limits=False, mps_namespaces=False)
    assert inv.uuids == (U0,)


def test_mps_namespaces_can_be_told_by_the_daemon() -> None:
    nvml = FakeNvml.simulated(1)
    nvml.init()
    inv = take_inventory(nvml, mps_namespaces=False)
    assert inv.capabilities == Capabilities(memory_limits=True, mps_namespaces=False)


def test_nvml_errors_propagate_typed() -> None:
    nvml = FakeNvml.simulated(1)
    nvml.init()
    nvml.fail("driver_version", "DriverNotLoaded")
    with pytest.raises(NvmlDriverNotLoaded):
        take_inventory(nvml)
