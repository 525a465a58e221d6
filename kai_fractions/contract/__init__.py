"""The NvFractions contract: keys, quantities, parsing, validation, binder arithmetic, plans.

Pure (no I/O) and the only place in kai_fractions that knows key strings and value formats.
"""

from . import keys
from .binder import BindDecision, binder_annotations, parse_group_modes
from .dialect import DEFAULT_DIALECT, DIALECTS, Dialect
from .errors import ContractError, ContractViolation
from .keys import DEFAULT_KEYS, Keys, is_mps_namespace_name
from .numbers import NumberError, format_plain, parse_decimal
from .plan import (
    DEFAULT_MPS_PIPE_ROOT,
    MAX_PIPE_DIRECTORY,
    MPS_SERVER,
    ContainerPlan,
    active_thread_percentage,
    derived_annotations,
    env_sources,
    mps_namespace_name,
    plan_container,
    plan_pod,
    pod_identity,
)
from .pod import (
    ContainerView,
    ManifestError,
    PodSpecAt,
    PodView,
    pod_specs,
    pod_views,
    view_from_pod_spec,
)
from .quantity import MIB, QuantityError, memory_bytes, mib_ceil, parse_quantity
from .request import ComputeMode, ContainerShare, PodRequest, parse_pod

__all__ = [
    "DEFAULT_DIALECT",
    "DEFAULT_KEYS",
    "DEFAULT_MPS_PIPE_ROOT",
    "DIALECTS",
    "MAX_PIPE_DIRECTORY",
    "MIB",
    "MPS_SERVER",
    "BindDecision",
    "ComputeMode",
    "ContainerPlan",
    "ContainerShare",
    "ContainerView",
    "ContractError",
    "ContractViolation",
    "Dialect",
    "Keys",
    "ManifestError",
    "NumberError",
    "PodRequest",
    "PodSpecAt",
    "PodView",
    "QuantityError",
    "active_thread_percentage",
    "binder_annotations",
    "derived_annotations",
    "env_sources",
    "format_plain",
    "is_mps_namespace_name",
    "keys",
    "memory_bytes",
    "mib_ceil",
    "mps_namespace_name",
    "parse_decimal",
    "parse_group_modes",
    "parse_pod",
    "parse_quantity",
    "plan_container",
    "plan_pod",
    "pod_identity",
    "pod_specs",
    "pod_views",
    "view_from_pod_spec",
]
