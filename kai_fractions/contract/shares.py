"""The parsed request's types: what one container asks for and what the binder wrote for it
(`ContainerShare`), a pod's shares with its errors and warnings (`PodRequest`), and the compute
modes; and `_complete`, the parse's one way to fill in a share it has not handed out yet.
Separate from the parsing because the binder arithmetic and the plans read them too.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from fractions import Fraction
from functools import lru_cache

from . import keys as k
from .errors import ContractError
from .pod import PodView


class ComputeMode(StrEnum):
    TIME_SLICING = "time-slicing"
    SM_SHARING = "sm-sharing"


DEFAULT_MODE = ComputeMode.TIME_SLICING


@lru_cache(maxsize=4096)
def _uuids(devices: tuple[str, ...]) -> tuple[str, ...]:
    """Device items without their CDI prefix (a few distinct lists per node)."""
    return tuple(d.removeprefix(k.CDI_DEVICE_PREFIX) for d in devices)


@dataclass(frozen=True, slots=True)
class ContainerShare:
    """What one container asks for and what the binder wrote for it (raw, before arithmetic)."""

    container: str
    request_bytes: int | None = None
    """NvFractions `.gpu-memory.request` (the user's; never overwritten)."""
    limit_bytes: int | None = None
    """NvFractions `.gpu-memory.limit`."""
    fraction: Fraction | None = None
    """Legacy `gpu-fraction`: the portion of one GPU asked for."""
    limit_portion: Fraction | None = None
    """`gpu-fraction.limit` or `kai.scheduler/container.<c>.gpu-memory.portion.limit`."""
    legacy_memory_bytes: int | None = None
    """Legacy `gpu-memory` (MiB, converted to bytes)."""
    legacy_limit_bytes: int | None = None
    """Legacy `gpu-memory.limit`."""
    compute_mode: ComputeMode = DEFAULT_MODE
    devices_value: str | None = None
    """The `.gpus.devices` annotation verbatim (binder-written)."""
    devices: tuple[str, ...] = ()
    compute_portion: Fraction | None = None
    """The `.gpu-compute.portion` annotation (binder-written)."""
    num_devices: int = 1
    source_key: str | None = None
    """The annotation that makes the container fractional (what errors about it name)."""
    mps_namespace: str | None = None
    """The MPS namespace the admission webhook named for an sm-sharing container; None for a
    pod it did not wire (the plan then derives one from the pod UID)."""

    @property
    def node_request_bytes(self) -> int | None:
        """Guaranteed memory as the node reads it: the request, or the limit when only it is set."""
        return self.request_bytes if self.request_bytes is not None else self.limit_bytes

    @property
    def node_limit_bytes(self) -> int | None:
        """The cap as the node reads it: the limit, or the request when only it is set."""
        return self.limit_bytes if self.limit_bytes is not None else self.request_bytes

    @property
    def device_uuids(self) -> tuple[str, ...]:
        return _uuids(self.devices)


@dataclass(frozen=True, slots=True)
class PodRequest:
    pod: PodView
    shares: tuple[ContainerShare, ...]
    errors: tuple[ContractError, ...]
    warnings: tuple[ContractError, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.errors

    @property
    def share(self) -> ContainerShare | None:
        """The pod's fractional container (KAI allows one); None for non-fractional pods."""
        return self.shares[0] if self.shares else None

    def admitted_namespace_key(self, keys: k.Keys = k.DEFAULT_KEYS) -> str | None:
        """The key under which the admission webhook names the MPS namespace of the pod's
        sm-sharing container (the one protected key a user's new pod may carry); None when
        the pod has no sm-sharing container."""
        share = self.share
        if share is None or share.compute_mode is not ComputeMode.SM_SHARING:
            return None
        return keys.derived(share.container, k.ADMITTED_MPS_NAMESPACE)


def _complete(share: ContainerShare, **fields: object) -> ContainerShare:
    """Sets fields of a share this parse made and has not handed out yet, in place: it is
    frozen for everyone who receives it, and a copy (`dataclasses.replace`) is a sizeable part
    of parsing a legacy pod (measured as P4 in benchmarks/)."""
    for name, value in fields.items():
        object.__setattr__(share, name, value)
    return share
