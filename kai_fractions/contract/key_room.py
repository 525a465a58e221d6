"""Whether KAI's keys for a pod's fractional container fit in an annotation key.

Kubernetes refuses an annotation key whose name (the part after the '/') is over 63
characters. KAI builds its per-container keys from the container's name, `<prefix><name>
<suffix>` (upstream pkg/common/resources/gpu_sharing_nvfractions.go,
CalcGpuFractionAnnotationForContainer and the like), and checks no length anywhere: its
admission (gpu_sharing_validation.go) admits a pod whose fractional container's name is too
long (a `gpu-fraction` pod names no container in its keys), its binder's patch
(pkg/binder/plugins/nvfractions, PreBind) is then refused by the API server, and the pod is
never bound. So the parse refuses such a pod, naming the key, the rule and the longest name
that fits; `kai-fractions validate` and the webhooks say it before the pod exists.

`.gpu-compute.portion` is written only by the patched binder (`dialect`): a name that fits every
other key but not that one works with upstream KAI, so it is a warning, not an error.
"""

from __future__ import annotations

from . import keys as k
from .collector import _Collector
from .pod import PodView
from .shares import ContainerShare


def _fits(prefix: str, suffix: str) -> int:
    """The longest container name `<prefix><name><suffix>` holds."""
    return k.MAX_KEY_NAME - k.key_name_length(prefix) - len(suffix)


def _kai_keys(pod: PodView, keys: k.Keys, share: ContainerShare
              ) -> list[tuple[str, int, str]]:
    """(key, longest name it holds, who writes it) for each key KAI reads or writes for the
    share's container in every dialect."""
    name = share.container
    written = [(k.MEMORY_REQUEST, "KAI's binder writes it when it binds the pod (or the "
                                  "user does)"),
               (k.DEVICES, "KAI's binder writes it when it binds the pod")]
    if (share.limit_bytes is not None or share.legacy_limit_bytes is not None
            or share.limit_portion is not None):
        written.append((k.MEMORY_LIMIT, "KAI writes it for the pod's memory limit"))
    if keys.container(name, k.COMPUTE_MODE) in pod.annotations:
        written.append((k.COMPUTE_MODE, "the pod carries it"))
    out = [(keys.container(name, suffix), _fits(keys.prefix, suffix), who)
           for suffix, who in written]
    portion_limit = keys.portion_limit(name)
    if k.GPU_FRACTION_LIMIT in pod.annotations or portion_limit in pod.annotations:
        out.append((portion_limit, _fits(k.PORTION_LIMIT_PREFIX, k.PORTION_LIMIT_SUFFIX),
                    f"KAI's admission writes it from {k.GPU_FRACTION_LIMIT}"))
    return out


def check_kai_key_room(pod: PodView, keys: k.Keys, share: ContainerShare,
                       c: _Collector) -> None:
    """An error when a key KAI needs for the share's container cannot exist (one, the
    tightest), else a warning when only the patched binder's `.gpu-compute.portion` cannot."""
    name = share.container
    too_long = [item for item in _kai_keys(pod, keys, share) if len(name) > item[1]]
    if too_long:
        key, fits, who = min(too_long, key=lambda item: item[1])
        c.error(key, f"container {name!r} has a {len(name)}-character name, too long for "
                f"this key: Kubernetes refuses an annotation key whose name (after the '/') is "
                f"over {k.MAX_KEY_NAME} characters, and this one's is "
                f"{k.key_name_length(key)}; {who}, so KAI cannot bind the pod. Name the "
                f"fractional container with at most {fits} characters", None, name)
        return
    portion = keys.container(name, k.COMPUTE_PORTION)
    fits = _fits(keys.prefix, k.COMPUTE_PORTION)
    if len(name) > fits:
        c.warn(key=portion, rule=f"container {name!r} has a {len(name)}-character name: the "
               "patched KAI binder (dialect patched) writes this key, whose name would be "
               f"{k.key_name_length(portion)} characters, over Kubernetes' {k.MAX_KEY_NAME}, "
               "so that binder cannot bind the pod (upstream KAI writes no such key); a name "
               f"of at most {fits} characters fits every KAI", container=name)
