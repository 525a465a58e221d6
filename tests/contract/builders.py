"""Small builders for contract tests: a PodView from annotations, a decision, a bind.

Key strings are written out literally in the tests themselves; these helpers only assemble
objects, so a typo in kai_fractions' keys cannot hide behind the same typo here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from fractions import Fraction
from types import MappingProxyType

from kai_fractions.contract import (
    BindDecision,
    ComputeMode,
    ContainerView,
    Dialect,
    Keys,
    PodRequest,
    PodView,
    binder_annotations,
    parse_pod,
)

GPU_A = "GPU-3f2a1b4c-0d5e-6f70-8192-a3b4c5d6e7f8"
GPU_B = "GPU-77b1c2d3-e4f5-0617-2839-4a5b6c7d8e9f"
PFX = "nvidia.com/container."


def pod(
    annotations: Mapping[str, str] | None = None,
    containers: Iterable[str] = ("main",),
    *,
    init: Iterable[str] = (),
    whole_gpus: Mapping[str, int] | None = None,
    name: str = "p",
    namespace: str = "default",
    uid: str = "",
) -> PodView:
    whole = dict(whole_gpus or {})
    return PodView(
        name=name,
        namespace=namespace,
        uid=uid,
        annotations=MappingProxyType(dict(annotations or {})),
        containers=tuple(ContainerView(c, whole_gpus=whole.get(c, 0), sets_whole_gpus=c in whole)
                         for c in containers),
        init_containers=tuple(
            ContainerView(c, whole_gpus=whole.get(c, 0), init=True, sets_whole_gpus=c in whole)
            for c in init
        ),
    )


def decision(
    node_mib: int = 2000,
    gpus: tuple[str, ...] = (GPU_A,),
    portion: str | Fraction | None = "0.5",
    *,
    reserve: int = 0,
    cdi: bool = False,
    modes: tuple[ComputeMode, ...] = (),
    resource_type: str = "Fraction",
    dialect: Dialect = Dialect.UPSTREAM,
) -> BindDecision:
    return BindDecision(
        node_gpu_memory_mib=node_mib,
        gpu_ids=gpus,
        received_portion=Fraction(portion) if isinstance(portion, str) else portion,
        group_modes=modes,
        reserve_mib=reserve,
        cdi=cdi,
        resource_type=resource_type,
        dialect=dialect,
    )


def patched(node_mib: int = 2000, *args, **kwargs) -> BindDecision:
    """A decision of the patched KAI (writes `.gpu-compute.portion`)."""
    return decision(node_mib, *args, dialect=Dialect.PATCHED, **kwargs)


def bind(view: PodView, d: BindDecision, keys: Keys | None = None) -> tuple[dict, PodRequest]:
    """The binder's patch for `view`, and the parsed request of the pod after that patch."""
    keys = keys or Keys()
    written = binder_annotations(parse_pod(view, keys), d, keys)
    bound = PodView(
        name=view.name,
        namespace=view.namespace,
        uid=view.uid,
        annotations=MappingProxyType({**view.annotations, **written}),
        labels=view.labels,
        containers=view.containers,
        init_containers=view.init_containers,
        kind=view.kind,
    )
    return written, parse_pod(bound, keys)


def error_keys(request: PodRequest) -> list[str]:
    return [e.key for e in request.errors]
