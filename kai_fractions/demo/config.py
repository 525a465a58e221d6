"""The demo's settings: the simulated node and its GPUs, from a small YAML file (`--config`).

    node: demo-node            # the Node's name (a DNS-1123 subdomain)
    gpus:                      # the simulated GPUs, as kai_fractions.sim.nvml reads them
      - model: H100-80GB       # H100-80GB, H200-141GB, A100-40GB, A100-80GB, L4, T4
        count: 2               # (or name + memory: 24Gi); 16 GPUs at most in all
                               # uuid: GPU-<8-4-4-4-12 hex> (count 1); mig: true|false
    driver_version: 615.00.00  # r615+ has NVML cgroup memory limits and MPS namespaces; an
                               # older one has neither (FunctionNotFound), as a real driver
    sm_sharing: true           # the agent's --sm-sharing (MPS); false refuses sm-sharing pods
    memory_enforcement: cgroup,mps-pinned,watchdog
    watchdog_policy: report    # the agent's --watchdog-policy: report (the product's default)
                               # stops nothing, so the watchdog is only a second line beside
                               # cgroup or mps-pinned and a container only it would watch is
                               # refused; kill caps such a container by stopping its process
                               # (in the demo a stop is recorded, no signal is sent)
    reserve_mib: 0             # the mirror's --reserve-mib: 0 is upstream KAI main (no reserve);
                               # more simulates a patched KAI (reserve + compute portion); less
                               # than the smallest GPU's memory
    namespace: default         # where the example pods go (a DNS-1123 label)
    examples: null             # a directory of manifests; null: the repository's examples/

Every key is optional; an unknown key or a bad value is an error naming it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..contract import MIB, Dialect
from ..node.config import WatchdogPolicy, parse_memory_enforcement
from ..node.errors import ConfigError as NodeConfigError
from ..sim.nvml import FakeNvml

DEFAULT_NODE = "demo-node"
DEFAULT_GPUS: tuple[Mapping[str, Any], ...] = ({"model": "H100-80GB", "count": 2},)
DEFAULT_DRIVER = "615.00.00"
_KEYS = ("node", "gpus", "driver_version", "sm_sharing", "memory_enforcement", "watchdog_policy",
         "reserve_mib", "namespace", "examples")
_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
DNS_LABEL = re.compile(_LABEL)
"""A namespace's name (RFC 1123 label, at most 63 characters), as Kubernetes checks it."""
DNS_SUBDOMAIN = re.compile(rf"{_LABEL}(\.{_LABEL})*")
"""A Node's name (RFC 1123 subdomain); the demo takes 63 characters at most, not 253: the name
is also the value of the node's kubernetes.io/hostname label, and label values stop at 63."""
GPU_UUID = re.compile(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
"""What nvmlDeviceGetUUID returns; the mirror and the agent take nothing else as a GPU's id."""
DRIVER_VERSION = re.compile(r"[0-9]+(\.[0-9]+)+")
"""What nvmlSystemGetDriverVersion returns: 615.00.00, 550.54.15, 535.104.05."""
MAX_GPUS = 16
"""GPUs on the simulated node, all entries together: the largest GPU servers hold 8 (HGX,
DGX) or 16 (DGX-2); more is a typo, and each simulated GPU costs the agent work every pass."""


class DemoConfigError(ValueError):
    """The config file is unreadable or wrong: the message names the key."""


def repository_examples() -> Path:
    """`examples/` next to the package in a checkout (scripts/demo runs from one), else the
    current directory's (an installed package, run from a checkout)."""
    beside = Path(__file__).resolve().parents[2] / "examples"
    return beside if beside.is_dir() else Path.cwd() / "examples"


@dataclass(frozen=True, slots=True)
class DemoConfig:
    node: str = DEFAULT_NODE
    gpus: tuple[Mapping[str, Any], ...] = DEFAULT_GPUS
    driver_version: str = DEFAULT_DRIVER
    sm_sharing: bool = True
    memory_enforcement: str = "cgroup,mps-pinned,watchdog"
    watchdog_policy: WatchdogPolicy = WatchdogPolicy.REPORT
    reserve_mib: int = 0
    namespace: str = "default"
    examples: Path = field(default_factory=repository_examples)

    @property
    def mirror_reserve_mib(self) -> int:
        return self.reserve_mib

    @property
    def dialect(self) -> Dialect:
        """Upstream KAI main subtracts no reserve; a reserve is what a patched KAI's binder
        does (and it writes the compute portion too)."""
        return Dialect.PATCHED if self.reserve_mib else Dialect.UPSTREAM

    def nvml(self) -> FakeNvml:
        """The simulated GPUs (UUIDs are stable for a node name)."""
        try:
            return FakeNvml.from_dict({"driver_version": self.driver_version,
                                       "gpus": [dict(g) for g in self.gpus]}, seed=self.node)
        except NodeConfigError as e:
            raise DemoConfigError(f"gpus: {e}") from None


def _name(value: Any, key: str, pattern: re.Pattern[str], what: str) -> str:
    if not isinstance(value, str) or len(value) > 63 or not pattern.fullmatch(value):
        raise DemoConfigError(f"{key}: must be a {what}, at most 63 characters, got {value!r}")
    return value


def _gpus(value: Any) -> tuple[dict[str, Any], ...]:
    """The `gpus` entries, with what the demo needs beyond a valid simulated NVML: at most
    MAX_GPUS in all, and UUIDs of the form NVML gives (FakeNvml alone takes any string)."""
    if not isinstance(value, list) or not value or not all(isinstance(g, Mapping)
                                                           for g in value):
        raise DemoConfigError("gpus: must be a non-empty list of mappings such as "
                              "{model: H100-80GB, count: 2}")
    total = 0
    for n, entry in enumerate(value):
        count = entry.get("count", 1)
        if isinstance(count, int) and not isinstance(count, bool):
            total += count
            if total > MAX_GPUS:
                raise DemoConfigError(f"gpus: gpus[{n}].count: at most {MAX_GPUS} GPUs on the "
                                      f"node in all, this entry makes {total}")
        if "uuid" in entry and not (isinstance(entry["uuid"], str)
                                    and GPU_UUID.fullmatch(entry["uuid"])):
            raise DemoConfigError(f"gpus: gpus[{n}].uuid: must be a GPU UUID as NVML gives it, "
                                  "GPU- and 8-4-4-4-12 lower-case hex digits (GPU-d20accf7-"
                                  f"5ad8-a5f3-a183-03fac7775c53), got {entry['uuid']!r}")
    return tuple(dict(g) for g in value)


def config_from_dict(data: Any, base: Path | None = None) -> DemoConfig:
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise DemoConfigError("the config must be a mapping of the keys " + ", ".join(_KEYS))
    unknown = sorted(set(data) - set(_KEYS))
    if unknown:
        raise DemoConfigError(f"unknown key(s) {', '.join(map(str, unknown))}; known: "
                              + ", ".join(_KEYS))
    out: dict[str, Any] = {}
    if "node" in data:
        out["node"] = _name(data["node"], "node", DNS_SUBDOMAIN,
                            "DNS-1123 subdomain (lower-case letters, digits, '-' and '.'; "
                            "each dot-separated part starts and ends with a letter or digit)")
    if "namespace" in data:
        out["namespace"] = _name(data["namespace"], "namespace", DNS_LABEL,
                                 "DNS-1123 label (lower-case letters, digits and '-', starting "
                                 "and ending with a letter or digit)")
    if "gpus" in data:
        out["gpus"] = _gpus(data["gpus"])
    if "driver_version" in data:
        value = data["driver_version"]
        if not isinstance(value, str) or not DRIVER_VERSION.fullmatch(value):
            hint = (f" (YAML read a number: quote it, \"{value}\")"
                    if isinstance(value, float) else "")
            raise DemoConfigError(f"driver_version: must be an NVIDIA driver version, digits "
                                  f"and dots such as 615.00.00 or 550.54.15, got {value!r}{hint}")
        out["driver_version"] = value
    if "sm_sharing" in data:
        if not isinstance(data["sm_sharing"], bool):
            raise DemoConfigError(f"sm_sharing: must be true or false, got "
                                  f"{data['sm_sharing']!r}")
        out["sm_sharing"] = data["sm_sharing"]
    if "memory_enforcement" in data:
        value = data["memory_enforcement"]
        if isinstance(value, list):
            value = ",".join(map(str, value))
        try:
            parse_memory_enforcement(str(value))
        except NodeConfigError as e:
            raise DemoConfigError(f"memory_enforcement: {e}") from None
        out["memory_enforcement"] = str(value)
    if "watchdog_policy" in data:
        value = data["watchdog_policy"]
        policies = [p.value for p in WatchdogPolicy]
        if value not in policies:  # a str enum: "report" and "kill" only, no other type
            raise DemoConfigError(f"watchdog_policy: must be {' or '.join(policies)}, got "
                                  f"{value!r}")
        out["watchdog_policy"] = WatchdogPolicy(value)
    if data.get("reserve_mib") is not None:
        value = data["reserve_mib"]
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise DemoConfigError(f"reserve_mib: must be a whole number of MiB >= 0, got "
                                  f"{value!r}")
        out["reserve_mib"] = value
    if data.get("examples") is not None:
        path = Path(str(data["examples"]))
        out["examples"] = path if path.is_absolute() or base is None else base / path
    config = DemoConfig(**out)
    smallest = min(g.memory_total for g in config.nvml().gpus) // MIB  # a valid simulated NVML
    if config.reserve_mib >= smallest:
        raise DemoConfigError(f"reserve_mib: must be less than the smallest GPU's memory "
                              f"({smallest} MiB), or nothing is left to share, got "
                              f"{config.reserve_mib}")
    return config


def load_config(path: str | Path | None) -> DemoConfig:
    """The defaults, or the file's settings over them; raises DemoConfigError."""
    if path is None:
        return DemoConfig()
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise DemoConfigError(f"{path}: cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise DemoConfigError(f"{path}: cannot read: not UTF-8 text ({e.reason} at byte "
                              f"{e.start})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise DemoConfigError(f"{path}: not valid YAML: {' '.join(str(e).split())}") from None
    try:
        return config_from_dict(data, base=path.parent)
    except DemoConfigError as e:
        raise DemoConfigError(f"{path}: {e}") from None
