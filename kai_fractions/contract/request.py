"""Parse a pod's annotations into a typed, immutable GPU share per container, with every error.

Nothing here raises for bad input: `parse_pod` returns a `PodRequest` whose `errors` lists each
broken rule (key, value, rule). Precedence and defaulting follow KAI:
NvFractions keys > `gpu-fraction` > `gpu-memory`; only a limit given means request := limit.

The parts live beside this module: the types (`shares`), the collector of errors and warnings
(`collector`), the value readers (`annotation_values`), the two key dialects (`parse_nvfractions`,
`parse_legacy`) and the rules for a pod not bound yet (`before_bind`). Here they are tied
together, with the rules about the pod's shares as a whole.
"""

from __future__ import annotations

from . import keys as k
from .annotation_values import _above
from .before_bind import _before_bind, _portion_limit_placed
from .collector import MAX_LISTED_WARNINGS, _Collector
from .key_room import check_kai_key_room
from .keys import MPS_NAMESPACE_PREFIX, is_mps_namespace_name
from .parse_legacy import _apply_num_devices, _legacy, _merge_legacy, _portion_limits
from .parse_nvfractions import _scan, _share_from_nvfractions
from .pod import PodView
from .shares import ComputeMode, ContainerShare, PodRequest, _complete

# Re-exported for the modules and tests that import them from here (tests/contract and
# tests/admission: MAX_LISTED_WARNINGS; the package and plan.py: the types).
__all__ = [
    "MAX_LISTED_WARNINGS",
    "ComputeMode",
    "ContainerShare",
    "PodRequest",
    "parse_pod",
]

_IDLE_MODE = "idle-mode"
_IDLE_MODE_WHAT = "compute modes on containers that request no GPU fraction, which have no effect"


def parse_pod(pod: PodView, keys: k.Keys = k.DEFAULT_KEYS) -> PodRequest:
    """Every fractional share the pod asks for, and every contract error, without raising."""
    c = _Collector(pod, keys)
    by_container, portion_limit_items = _scan(pod, keys, c)
    shares: dict[str, ContainerShare] = {
        name: _share_from_nvfractions(name, values, c)
        for name, values in by_container.items()
    }
    legacy = _legacy(pod, c, by_container)
    named = pod.annotations.get(k.GPU_FRACTION_CONTAINER_NAME)
    if named and legacy is not None and by_container and c.requests_fraction:
        # Only a pod that asks for a fraction has its container resolved (upstream Mutate,
        # GetFractionContainerRef; validateGpuFractionContainerNameConsistency).
        for name in by_container:
            if name != named:
                c.error(k.GPU_FRACTION_CONTAINER_NAME, f"names container {named!r} but the "
                        f"NvFractions keys name {name!r}; they must agree", named, name)
    # What KAI's admission refuses in a pod it has not bound yet: a bound pod carries the
    # binder's own keys (its limit beside the legacy keys), so those rules are for unbound pods.
    bound = (legacy is not None or bool(portion_limit_items)) and any(
        share.devices for share in shares.values())
    if legacy is not None and not bound:
        _before_bind(pod, keys, legacy.container, c)
    if legacy is not None and legacy.requested:
        # After a bind the binder's NvFractions request sits beside the legacy key it came
        # from; the NvFractions key wins (precedence), so that is not worth a warning.
        share = shares.get(legacy.container)
        base = share or ContainerShare(container=legacy.container)
        shares[legacy.container] = _merge_legacy(base, legacy, c)
    elif legacy is not None and k.GPU_FRACTION_NUM_DEVICES in pod.annotations:
        _apply_num_devices(pod, shares, legacy.num_devices, c)
    for name, portion in _portion_limits(pod, portion_limit_items, c).items():
        share = shares.get(name)
        key = keys.portion_limit(name)
        value = pod.annotations[key]
        if not bound and not _portion_limit_placed(pod, key, name, c):
            continue
        if share is None:
            c.error(key, "the container requests no GPU fraction to limit", value, name)
        elif share.limit_portion is not None:
            # KAI's admission writes this key from gpu-fraction.limit, verbatim (upstream
            # nvfractions Mutate, translateLegacyGpuFractionLimit): the same value twice is
            # that pod; another value, KAI refuses.
            if value != pod.annotations.get(k.GPU_FRACTION_LIMIT):
                c.error(key, f"differs from {k.GPU_FRACTION_LIMIT} "
                        f"{pod.annotations.get(k.GPU_FRACTION_LIMIT)!r}, which KAI copies into "
                        "this key; set one of them", value, name)
        elif share.limit_bytes is not None:
            # The absolute limit wins. After a bind it is the one the binder computed from
            # this very key, so both being present is the normal, bound state.
            continue
        elif share.fraction is not None and not _above(portion, share.fraction):
            c.error(key, "must be greater than the container's gpu-fraction", None, name)
        else:
            _complete(share, limit_portion=portion)
    _check_shares(pod, keys, shares, c)
    for share in shares.values():
        check_kai_key_room(pod, keys, share, c)
        _admitted_namespace(pod, keys, share, c)
    if k.LEGACY_COMPUTE_MODE in pod.annotations:
        c.warn(k.LEGACY_COMPUTE_MODE, "is ignored by KAI and by kai_fractions; set "
               f"{keys.prefix}<container>{k.COMPUTE_MODE} instead",
               pod.annotations[k.LEGACY_COMPUTE_MODE])
    # In the pod's container order; KAI allows one fractional container, so one is the rule.
    ordered = tuple(shares.values()) if len(shares) < 2 else tuple(
        shares[ct.name] for ct in pod.all_containers if ct.name in shares)
    warnings = tuple(c.warnings) if c.left_out is None else c.listed_warnings()
    return PodRequest(pod=pod, shares=ordered, errors=tuple(c.errors), warnings=warnings)


def _admitted_namespace(pod: PodView, keys: k.Keys, share: ContainerShare,
                        c: _Collector) -> None:
    """The webhook's MPS namespace name of an sm-sharing container, when the pod carries one."""
    key = keys.derived(share.container, k.ADMITTED_MPS_NAMESPACE)
    value = pod.annotations.get(key)
    if value is None or share.compute_mode is not ComputeMode.SM_SHARING:
        return  # a time-slicing container has no namespace: the key changes nothing there
    if is_mps_namespace_name(value):
        _complete(share, mps_namespace=value)
    else:
        c.error(key, f"must be {MPS_NAMESPACE_PREFIX} and 20 lowercase hex digits, as the "
                "admission webhook names an MPS namespace", value, share.container)


def _check_shares(
    pod: PodView, keys: k.Keys, shares: dict[str, ContainerShare], c: _Collector
) -> None:
    fractional = [name for name, share in shares.items() if share.source_key is not None]
    for name, share in shares.items():
        view = pod.container(name)
        if share.source_key is None:
            # Only a compute mode on a container that asks for no fraction. Beside another
            # container's fraction KAI refuses it (upstream validateNvFractionsAnnotations:
            # the NvFractions keys of one container per pod); alone it changes nothing.
            key = keys.container(name, k.COMPUTE_MODE)
            if fractional:
                c.error(key, f"names container {name!r}, but the pod's GPU fraction is on "
                        f"{fractional[0]!r}: KAI allows the NvFractions keys of one container "
                        "per pod (set the compute mode on that container)", None, name)
            elif c.lists(_IDLE_MODE, keys.container("<container>", k.COMPUTE_MODE),
                         _IDLE_MODE_WHAT):
                c.warn(key, "has no effect: the container requests no GPU fraction",
                       container=name)
            continue
        if view is not None and (view.whole_gpus != 0 or view.sets_whole_gpus):
            c.error(share.source_key, "a GPU fraction may not be "
                    f"combined with a whole {k.WHOLE_GPU_RESOURCE} request", None, name)
    if fractional:
        # Upstream getFirstGPULimit: any container's nvidia.com/gpu, even 0, even another's.
        for views in (pod.containers, pod.init_containers):
            for view in views:
                if (view.sets_whole_gpus or view.whole_gpus) and view.name not in shares:
                    share = shares[fractional[0]]
                    c.error(share.source_key or "", "a GPU fraction may not be combined with a "
                            f"whole {k.WHOLE_GPU_RESOURCE} request in the same pod (container "
                            f"{view.name!r} sets one)", None, share.container)
    if len(fractional) > 1:
        c.error(shares[fractional[1]].source_key or "", "KAI allows only one "
                f"container per pod with a fractional GPU request; {fractional[0]!r} already "
                "has one", None, fractional[1])
    for name in list(shares):
        if name not in fractional:
            del shares[name]
