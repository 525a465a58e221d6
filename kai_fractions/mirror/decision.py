"""A scheduler's decision for one pod, and its conversion into the contract's BindDecision.

`AllocationInput` is what both callers produce: the gRPC servicer (from the protobuf Allocation)
and the KAI follower (from a BindRequest). Values stay as the scheduler spelled them (the portion
is a string) so that ONE place reads them: `resolve_decision`. Error keys are field paths relative
to the Allocation message (`received_gpu.portion`), the same paths the contract package uses.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fractions import Fraction

from ..contract import (
    DEFAULT_DIALECT,
    BindDecision,
    ComputeMode,
    ContractError,
    ContractViolation,
    Dialect,
    NumberError,
    parse_decimal,
    parse_group_modes,
)
from ..contract import keys as k
from ..contract.dialect import check_reserve
from ..contract.names import MAX_NAME, is_dns_subdomain, pod_ref_problems
from .errors import InvalidAllocation

MAX_IDEMPOTENCY_KEY = 256
MAX_NODE_GPU_MEMORY_MIB = 1 << 40
"""A bound far above any GPU (a MiB count of 2^40 is an exbibyte): past it, a label or a
request is an error rather than a number nobody can enforce or encode."""


@dataclass(frozen=True, slots=True)
class AllocationInput:
    namespace: str
    pod_name: str
    pod_uid: str = ""
    """"" = the caller does not know it. KAI's BindRequest carries it as the owner reference
    of kind Pod (`metadata.ownerReferences[kind=Pod].uid`), and the follower passes it on."""
    selected_node: str = ""
    resource_type: str = ""
    """`Fraction` or `Regular` (k.RESOURCE_TYPE_*); "" = not given."""
    gpu_count: int = 0
    portion: str = ""
    """Share of one GPU as the scheduler wrote it ("0.5"); "" = from the pod's own request."""
    group_ids: tuple[str, ...] = ()
    group_modes: tuple[str, ...] = ()
    """One per group: `time-slicing`, `sm-sharing`, or "" (time-slicing, KAI's older groups)."""
    gpu_ids: tuple[str, ...] = ()
    """The GPU UUID behind each group, same order."""
    node_gpu_memory_mib: float = 0
    """0 = read the node's `nvidia.com/gpu.memory` label."""
    cdi: bool = False
    reserve_mib: int | None = None
    """None = the mirror's configured default."""
    container: str = ""
    """"" = the pod's fractional container as the contract resolves it."""

    @property
    def is_fraction(self) -> bool:
        return self.resource_type == k.RESOURCE_TYPE_FRACTION


NodeLabels = Callable[[str], Mapping[str, str] | None]
"""Labels of a node by name; None when the node does not exist."""


def resolve_decision(
    allocation: AllocationInput, node_labels: NodeLabels, *, default_reserve_mib: int = 0,
    dialect: Dialect = DEFAULT_DIALECT,
) -> BindDecision:
    """The contract's BindDecision for `allocation`, written in `dialect`; raises
    InvalidAllocation with every request field error found. Reads the node's labels (through
    `node_labels`) only when it must."""
    errors: list[ContractError] = []

    def error(field: str, rule: str, value: object = None) -> None:
        errors.append(ContractError(field, rule, None if value is None else str(value)))

    if not allocation.namespace:
        error("pod.namespace", "is required")
    if not allocation.pod_name:
        error("pod.name", "is required")
    _check_bounds(allocation, error)
    kind = allocation.resource_type
    if kind not in (k.RESOURCE_TYPE_FRACTION, k.RESOURCE_TYPE_REGULAR):
        error("received_resource_type", ("must be " if kind else "is required: ")
              + f"{k.RESOURCE_TYPE_FRACTION} or {k.RESOURCE_TYPE_REGULAR}", kind or None)
    if kind != k.RESOURCE_TYPE_FRACTION:
        if errors:
            raise InvalidAllocation(errors)
        # A whole-GPU bind writes only `received-resource-type`: no arithmetic, no node read.
        return BindDecision(node_gpu_memory_mib=0, resource_type=kind, dialect=dialect)

    portion: Fraction | None = None
    if allocation.portion:
        try:
            portion = parse_decimal(allocation.portion)
        except NumberError as e:
            error("received_gpu.portion", e.args[0], allocation.portion)
    if allocation.gpu_count < 0:
        error("received_gpu.count", "must not be negative", allocation.gpu_count)
    elif allocation.gpu_count and allocation.gpu_count != len(allocation.gpu_ids):
        error("received_gpu.count", f"is {allocation.gpu_count} but reserved_gpu_ids lists "
              f"{len(allocation.gpu_ids)} GPU(s)", allocation.gpu_count)
    if len(allocation.group_modes) != len(allocation.gpu_ids):
        error("reserved_gpu_ids", f"lists {len(allocation.gpu_ids)} GPU(s) for "
              f"{len(allocation.group_modes)} selected group(s): one per group, same order",
              ",".join(allocation.gpu_ids))
    modes: tuple[ComputeMode, ...] = ()
    try:
        modes = parse_group_modes(allocation.group_modes)
    except ContractViolation as e:
        errors.extend(e.errors)
    reserve = default_reserve_mib if allocation.reserve_mib is None else allocation.reserve_mib
    if (allocation.reserve_mib and allocation.reserve_mib > 0
            and (problem := check_reserve(dialect, allocation.reserve_mib))):
        error("reserve_mib", problem)
    memory = allocation.node_gpu_memory_mib
    if memory < 0:
        error("node_gpu_memory_mib", "must not be negative (0 reads the node's "
              f"{k.NODE_GPU_MEMORY_LABEL} label)", memory)
    elif memory > MAX_NODE_GPU_MEMORY_MIB:
        error("node_gpu_memory_mib", f"must be at most {MAX_NODE_GPU_MEMORY_MIB} MiB", memory)
    elif memory == 0:
        memory = _node_memory(allocation, node_labels, error)
    else:
        _node(allocation, node_labels, error)  # given its memory, the node must still exist
    if errors:
        raise InvalidAllocation(errors)
    return BindDecision(
        node_gpu_memory_mib=memory,
        gpu_ids=allocation.gpu_ids,
        received_portion=portion,
        group_modes=modes,
        reserve_mib=reserve,
        cdi=allocation.cdi,
        resource_type=kind,
        dialect=dialect,
    )


def node_to_read(allocation: AllocationInput) -> str:
    """The node whose labels `resolve_decision` will ask for, "" when it asks for none: a
    caller whose reads are coroutines reads them first and hands them over. A fractional
    allocation always names its node, which must exist (its labels also give the GPU memory
    when the caller does not)."""
    node = allocation.selected_node
    # A name no node could have is not sent to the API server: the bounds refuse it.
    return node if allocation.is_fraction and is_dns_subdomain(node) else ""


# Bounds on what a caller may send: far above any real allocation, low enough that nothing
# past them is parsed, stored or echoed back in an error (gRPC metadata holds 16 KiB).
MAX_IDS = 64  # GPUs or groups of one allocation (no node has more)
MAX_ID = 128  # one GPU UUID or group id


def _check_bounds(allocation: AllocationInput, error) -> None:
    for e in pod_ref_problems(allocation.namespace, allocation.pod_name, allocation.pod_uid):
        error(e.key, e.rule, e.value)
    for field, value in (("selected_node", allocation.selected_node),
                         ("container_name", allocation.container)):
        if len(value) > MAX_NAME:
            error(field, f"must be at most {MAX_NAME} characters (got {len(value)})")
        elif value and not is_dns_subdomain(value):
            error(field, "must be a Kubernetes name (lowercase letters, digits, '-' and '.')",
                  value)
    for field, ids in (("reserved_gpu_ids", allocation.gpu_ids),
                       ("selected_fractional_gpu_groups", allocation.group_ids)):
        if len(ids) > MAX_IDS:
            error(field, f"must list at most {MAX_IDS} (got {len(ids)})")
        elif any(len(i) > MAX_ID for i in ids):
            error(field, f"each item must be at most {MAX_ID} characters")
    reserve = allocation.reserve_mib
    if reserve is not None and not 0 <= reserve <= MAX_NODE_GPU_MEMORY_MIB:
        error("reserve_mib", f"must be between 0 and {MAX_NODE_GPU_MEMORY_MIB}", reserve)


def _node_memory(allocation: AllocationInput, node_labels: NodeLabels, error) -> float:
    """The node's label in MiB, read as a number as KAI reads it (strconv.ParseFloat: `40960`
    and `40960.0` alike); 0 when it is missing (the contract then names the problem)."""
    node = allocation.selected_node
    labels = _node(allocation, node_labels, error)
    if labels is None:
        return 0
    raw = labels.get(k.NODE_GPU_MEMORY_LABEL)
    if raw is None:
        return 0
    mib = label_memory_mib(raw)
    if mib is None:
        error("node_gpu_memory_mib", f"cannot be read from node {node}: its "
              f"{k.NODE_GPU_MEMORY_LABEL} label is not a positive number of MiB (at most "
              f"{MAX_NODE_GPU_MEMORY_MIB})", raw[:40])
        return 0
    return int(mib) if mib.denominator == 1 else float(mib)


def label_memory_mib(raw: str | None) -> Fraction | None:
    """The node's GPU memory label as a usable number of MiB (positive, at most
    MAX_NODE_GPU_MEMORY_MIB); None when it is missing or is not one."""
    if raw is None:
        return None
    try:
        mib = parse_decimal(raw)
    except NumberError:
        return None
    return mib if 0 < mib <= MAX_NODE_GPU_MEMORY_MIB else None


def _node(allocation: AllocationInput, node_labels: NodeLabels, error
          ) -> Mapping[str, str] | None:
    """The selected node's labels; None (and an error) when it is not named or not there."""
    node = allocation.selected_node
    if not node:
        error("selected_node", "is required: a fractional allocation names the node it is "
              "for (and that node's GPU memory comes from its "
              f"{k.NODE_GPU_MEMORY_LABEL} label when node_gpu_memory_mib is 0)")
        return None
    if not node_to_read(allocation):
        return None  # not a node's name: the bounds said so, and nothing was read
    labels = node_labels(node)
    if labels is None:
        error("selected_node", "names a node that does not exist", node)
    return labels


def idempotency_key_problems(key: str) -> list[ContractError]:
    """A caller's key is logged and kept in the pod's record: bounded and printable."""
    if len(key) > MAX_IDEMPOTENCY_KEY or not key.isprintable():
        return [ContractError("idempotency_key", f"must be printable and at most "
                              f"{MAX_IDEMPOTENCY_KEY} characters", key[:40])]
    return []


def check_idempotency_key(key: str) -> None:
    problems = idempotency_key_problems(key)
    if problems:
        raise InvalidAllocation(problems)
