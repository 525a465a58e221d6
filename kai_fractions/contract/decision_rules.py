"""The rules a bind decision keeps whatever the pod: its reserved GPUs and its portion, each
checked by itself. The binder checks them among the rules that need the pod; `kai-fractions
plan` checks them on its flags before any pod is read. One home, so the two never drift apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction

from .annotation_values import _GPU_UUID
from .errors import ContractError
from .numbers import MAX_NUMBER_LENGTH, format_plain


def reserved_gpu_errors(gpu_ids: Sequence[str]) -> list[ContractError]:
    """What is wrong with the reserved GPU UUIDs by themselves: none named, one that is not a
    GPU UUID (each, keyed by its index), the same GPU twice. Whether their number fits the pod
    is the pod's question."""
    if not gpu_ids:
        return [ContractError("reserved_gpu_ids", "must name the reserved GPU of each "
                              "fractional group")]
    errors = [ContractError(f"reserved_gpu_ids[{i}]", "must be a GPU UUID (GPU-...)", gpu)
              for i, gpu in enumerate(gpu_ids) if not _GPU_UUID.fullmatch(gpu)]
    # NVML prints a UUID in lower case, but the hex reads the same in either: GPU-AB and GPU-ab
    # are one GPU named twice (and the node, which matches UUIDs exactly, would know neither).
    if len({gpu.lower() for gpu in gpu_ids}) != len(gpu_ids):
        errors.append(ContractError("reserved_gpu_ids", "lists the same GPU twice",
                                    ",".join(gpu_ids)))
    return errors


def received_portion_errors(portion: Fraction | None) -> list[ContractError]:
    """What is wrong with the received portion by itself (at most one error; none when there
    is no portion): not above 0, or not writable as a decimal portion (0 as a float64, or more
    characters than a contract number may have). Whether it fits the pod's request is the
    pod's question."""
    if portion is None:
        return []
    if portion <= 0:
        return [ContractError("received_gpu.portion", "must be greater than 0",
                              format_plain(portion) if abs(portion) < 10**15 else "huge")]
    if float(portion) == 0.0 or len(format_plain(portion)) > MAX_NUMBER_LENGTH:
        # It would be written as "0" (or too long), which the contract itself rejects as a
        # portion.
        return [ContractError("received_gpu.portion",
                              "is too small to be written as a decimal portion", str(portion))]
    return []
