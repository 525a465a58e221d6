"""What one parse gathers: its errors and warnings (each kind of warning a pod may repeat
per key listed up to a cap), and what it works out once about the whole pod, chiefly whether
KAI's admission takes the pod for one that asks for a GPU fraction. Every part of the parse
reports through it, so it is apart from each of them.
"""

from __future__ import annotations

from . import keys as k
from .errors import ContractError
from .pod import PodView

MAX_LISTED_WARNINGS = 20
"""Warnings of one kind a parse lists in full, as a webhook's denial lists at most MAX_LISTED
problems (kai_fractions.admission.errors): a pod may carry thousands of keys that each have no
effect, and every warning travels in the admission response (and the API server's reply to
the user) and the CLI's output. The rest of that kind are counted in one line after the last
one listed."""


class _Collector:
    """What one parse gathers: its errors and warnings, and what it works out about the whole
    pod, once, when first needed (the class defaults stand until then: most pods never need
    them, and a parse is the node agent's and the webhooks' hot path)."""

    _requests: bool | None = None
    _carries: bool | None = None
    _kinds: dict[str, int] | None = None
    """Warnings of each capped kind found so far, listed or not."""
    left_out: dict[str, tuple[int, ContractError]] | None = None
    """Per capped kind past its cap: where its summary goes and the summary's key and wording
    (its count is filled in by `listed_warnings`); None while nothing is left out."""

    def __init__(self, pod: PodView, keys: k.Keys) -> None:
        self.pod, self.keys = pod, keys
        self.errors: list[ContractError] = []
        self.warnings: list[ContractError] = []

    @property
    def requests_fraction(self) -> bool:
        """`requests_fraction` of the pod, worked out at the first question. Each of these walks
        every annotation: asked once per key (a compute mode per missing container), a pod of
        thousands of keys took seconds to parse."""
        if self._requests is None:
            self._requests = requests_fraction(self.pod, self.keys)
        return self._requests

    @property
    def carries_fraction(self) -> bool:
        """`requests_fraction`, or a binder-written key (`.gpus.devices`,
        `.gpu-compute.portion`): beside one, a compute mode on another container names a second
        fractional container, which KAI refuses (upstream validateDeviceAnnotationTargets,
        GetNvFractionsContainerName). Worked out once, as `requests_fraction` is."""
        if self._carries is None:
            self._carries = self.requests_fraction or _carries_binder_keys(self.pod, self.keys)
        return self._carries

    def error(self, key: str, rule: str, value: str | None = None, container: str | None = None):
        self.errors.append(ContractError(key, rule, value, container))

    def warn(self, key: str, rule: str, value: str | None = None, container: str | None = None):
        self.warnings.append(ContractError(key, rule, value, container))

    def lists(self, kind: str, key: str, what: str) -> bool:
        """Whether to list one more warning of `kind` (one a pod may carry once per key or
        container): True for the first MAX_LISTED_WARNINGS; the rest are only counted, and
        one line (`key`: and N more ... `what`) says how many. Asked before the warning's
        text is built, so those left out cost nothing more."""
        if self._kinds is None:
            self._kinds = {}
        seen = self._kinds[kind] = self._kinds.get(kind, 0) + 1
        if seen <= MAX_LISTED_WARNINGS:
            return True
        if self.left_out is None:
            self.left_out = {}
        if kind not in self.left_out:
            self.left_out[kind] = (len(self.warnings), ContractError(key, what))
        return False

    def listed_warnings(self) -> tuple[ContractError, ...]:
        """The warnings, each capped kind followed by its count of those left out."""
        if self.left_out is None or self._kinds is None:  # nothing left out
            return tuple(self.warnings)
        out = list(self.warnings)
        for kind, (at, summary) in sorted(self.left_out.items(), key=lambda item: -item[1][0]):
            more = self._kinds[kind] - MAX_LISTED_WARNINGS
            out.insert(at, ContractError(summary.key, f"and {more} more warning(s) of the same "
                                         f"kind, not listed: {summary.rule}"))
        return tuple(out)


_REQUEST_SUFFIXES = (k.MEMORY_REQUEST, k.MEMORY_LIMIT)

NO_FRACTION_ASKED = (
    "KAI resolves the fraction's container only in a pod that requests a GPU fraction "
    "(gpu-fraction, gpu-memory, or an NvFractions memory request or limit), and this pod "
    "requests none")
"""Ends the warning for a key KAI's admission looks at only beside a fraction request (where it
refuses the same value): what an unchanged KAI manifest may carry, so it is not refused."""


def requests_fraction(pod: PodView, keys: k.Keys = k.DEFAULT_KEYS) -> bool:
    """Whether KAI's admission takes the pod for one that asks for a GPU fraction (upstream
    RequestsGPUFraction, kai-scheduler/api utilities/resources/gpu_sharing.go): `gpu-fraction`
    or `gpu-memory` present, even empty, or an NvFractions `.gpu-memory.request` or
    `.gpu-memory.limit` key. Only then does its mutating webhook resolve the fraction's
    container (KAI-Scheduler pkg/admission/webhook/v1alpha2/nvfractions/mutation.go, Mutate,
    GetFractionContainerRef) and refuse a container name it cannot find; a compute mode alone
    makes no request (getNvFractionData)."""
    a = pod.annotations
    if k.GPU_FRACTION in a or k.GPU_MEMORY in a:
        return True
    prefix = keys.prefix
    return any(key.startswith(prefix) and key.endswith(_REQUEST_SUFFIXES) for key in a)


def _carries_binder_keys(pod: PodView, keys: k.Keys) -> bool:
    prefix = keys.prefix
    return any(key.startswith(prefix) and key.endswith(k.BINDER_SUFFIXES)
               for key in pod.annotations)
