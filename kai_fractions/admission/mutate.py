"""The mutating webhook: wire a fractional pod's env, MPS mount and gate, and write the request
of a container that gives only a memory limit. Pure. It warns (never refuses) of what it keeps
but the pod may not mean: another scheduler or runtime class, a mount at CUDA's default MPS pipe
directory (`default_mps`).

The pod's desired shape is computed from the pod itself; a part that already has that shape is
left exactly as it is (so the API server's defaults do not count as a difference), and only the
parts that differ become patch operations. Running it on its own output yields no patch, which
makes `reinvocationPolicy: IfNeeded` safe.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

from ..contract import (
    DEFAULT_MPS_PIPE_ROOT,
    MIB,
    ComputeMode,
    ContainerShare,
    ManifestError,
    parse_pod,
    view_from_pod_spec,
)
from ..contract import keys as k
from ..contract.plan import MPS_SERVER
from ..contract.quantity import canonical_mib
from ..contract.scheduler import scheduler_problem
from . import podspec, shape, wiring
from .config import GATE_CONTAINER, MPS_VOLUME, AdmissionConfig
from .default_mps import default_mps_warnings
from .errors import contract_denial, manifest_denial
from .review import Decision, allow, deny, kind_of
from .wiring import VOID_ENV, fractional_env, matches, strip_enforced

Json = dict[str, Any]


def _ensure_named(items: list[Json], wanted: Json) -> list[Json]:
    """`items` with exactly one entry named like `wanted`, of its shape (kept when it matches)."""
    name = wanted["name"]
    same = [i for i in items if isinstance(i, Mapping) and i.get("name") == name]
    if len(same) == 1 and matches(same[0], wanted):
        return items
    return [i for i in items if not (isinstance(i, Mapping) and i.get("name") == name)] + [wanted]


def _void_env(env: list[Json]) -> list[Json]:
    """`NVIDIA_VISIBLE_DEVICES=void` first, no other enforced variable; unchanged when so.
    Set, not just removed: an image's own `ENV NVIDIA_VISIBLE_DEVICES=all` would apply."""
    enforced = [e for e in env if isinstance(e, Mapping) and e.get("name") in k.ENFORCED_ENV]
    if len(enforced) == 1 and dict(enforced[0]) == VOID_ENV:
        return env
    return [dict(VOID_ENV), *strip_enforced(env)]


def _fractional_mounts(mounts: list[Json], namespace: str) -> list[Json]:
    wanted = podspec.mps_mount(namespace)
    # The pipe root and the server directory are reserved too: the pod's own volume there
    # would hold the MPS paths.
    reserved = (wanted["mountPath"], DEFAULT_MPS_PIPE_ROOT, f"{DEFAULT_MPS_PIPE_ROOT}/{MPS_SERVER}")
    same = [m for m in mounts if isinstance(m, Mapping)
            and (m.get("name") == MPS_VOLUME or m.get("mountPath") in reserved)]
    if len(same) == 1 and matches(same[0], wanted):
        return mounts
    dropped = {id(m) for m in same}  # by identity, in one pass: a pod may bring thousands
    return [m for m in mounts if id(m) not in dropped] + [wanted]


def _with_list(container: Json, field: str, items: list[Json]) -> Json:
    if items == (container.get(field) or []):
        return container
    out = dict(container)
    if items:
        out[field] = items
    else:
        out.pop(field, None)
    return out


def _container(container: Json, share: ContainerShare, config: AdmissionConfig,
               namespace: str | None) -> Json:
    env = list(container.get("env") or [])
    if container.get("name") != share.container:
        # A sidecar must not carry GPU limits of its own, nor see a GPU at all.
        return _with_list(container, "env", _void_env(env))
    wanted = podspec.enforced_env(share.container, share.compute_mode, config.keys)
    out = _with_list(container, "env", fractional_env(env, wanted))
    if namespace is not None:
        mounts = list(container.get("volumeMounts") or [])
        out = _with_list(out, "volumeMounts", _fractional_mounts(mounts, namespace))
    return out


def desired_spec(spec: Mapping[str, Any], share: ContainerShare, config: AdmissionConfig,
                 namespace: str | None = None) -> Json:
    """The pod spec with the env, mounts, volumes and gate a fractional pod must have;
    `namespace`: the MPS namespace of an sm-sharing container (its mount's subPath)."""
    out: Json = copy.deepcopy(dict(spec))
    containers = [c for c in out.get("containers") or [] if isinstance(c, Mapping)]
    init = [c for c in out.get("initContainers") or []
            if isinstance(c, Mapping) and c.get("name") != GATE_CONTAINER]
    out["containers"] = [_container(c, share, config, namespace) for c in containers]
    init = [_container(c, share, config, namespace) for c in init]
    gate = podspec.gate_container(config, [str(c.get("name", "")) for c in containers],
                                  [str(c.get("name", "")) for c in init])
    current = [c for c in out.get("initContainers") or [] if isinstance(c, Mapping)]
    first = current[0] if current and current[0].get("name") == GATE_CONTAINER else None
    # Kept only when it is the injected gate but for fields the API server defaults: a gate
    # the pod brought with more in it must not run, even if only this webhook ran.
    keep = first is not None and not wiring.gate_differences(first, gate)
    out["initContainers"] = [first if keep else gate, *init]
    volumes = list(out.get("volumes") or [])
    wanted = [podspec.marker_volume(config), podspec.podinfo_volume()]
    if namespace is not None:
        wanted.append(podspec.mps_volume(config))
    for volume in wanted:
        volumes = _ensure_named(volumes, volume)
    out["volumes"] = volumes
    if config.runtime_class and not out.get("runtimeClassName"):
        out["runtimeClassName"] = config.runtime_class
    return out


def _ops(spec: Mapping[str, Any], new: Json) -> list[Json]:
    ops: list[Json] = []
    old_containers = spec.get("containers") or []
    for i, (before, after) in enumerate(zip(old_containers, new["containers"], strict=True)):
        if before != after:
            ops.append({"op": "replace", "path": f"/spec/containers/{i}", "value": after})
    # `add` on an object member replaces it when present (RFC 6902 4.1): one op either way.
    for field in ("initContainers", "volumes"):
        if (spec.get(field) or []) != new[field] or field not in spec:
            ops.append({"op": "add", "path": f"/spec/{field}", "value": new[field]})
    if new.get("runtimeClassName") != spec.get("runtimeClassName"):
        ops.append({"op": "add", "path": "/spec/runtimeClassName",
                    "value": new["runtimeClassName"]})
    return ops


def _annotation_op(key: str, value: str) -> Json:
    # A fractional pod always has annotations (its request is one), so `add` finds the map.
    escaped = key.replace("~", "~0").replace("/", "~1")  # JSON Pointer, RFC 6901
    return {"op": "add", "path": f"/metadata/annotations/{escaped}", "value": value}


def _request_from_limit(annotations: Mapping[str, Any], share: ContainerShare,
                        keys: k.Keys) -> list[Json]:
    """A container that sets only `.gpu-memory.limit` gets its request written as the limit:
    what the contract reads anyway, and what KAI's scheduler reads too (upstream
    pkg/common/resources, ExtractNvFractionsData: defaultRequestFromLimit). Written, because
    KAI's binder writes a request wherever the pod has none, as node memory x the BindRequest's
    portion (pkg/binder/plugins/nvfractions, setNvFractionsMemoryAnnotation), and the scheduler
    rounds that portion up to a hundredth (getGpuMemoryFractionalOnNode): the request it would
    write exceeds the limit unless the limit is a whole hundredth of the GPU, and the node
    agent refuses a request above the limit.

    Beside `gpu-memory` the request is that amount instead, in the text KAI's admission writes
    for it (upstream nvfractions/mutation.go, translateLegacyMemory, which refuses other text):
    whichever of the two webhooks runs first, the pod ends with the same request."""
    request_key = keys.container(share.container, k.MEMORY_REQUEST)
    if request_key in annotations or share.limit_bytes is None:
        return []
    value = annotations.get(keys.container(share.container, k.MEMORY_LIMIT))
    if not isinstance(value, str):
        return []  # the limit came from elsewhere: nothing the binder would overwrite
    if k.GPU_MEMORY in annotations and share.request_bytes is not None:
        value = canonical_mib(share.request_bytes // MIB)
    return [_annotation_op(request_key, value)]


def _ephemeral_ops(request: Mapping[str, Any], config: AdmissionConfig) -> Decision:
    """An ephemeral container added to a fractional pod gets `NVIDIA_VISIBLE_DEVICES=void`
    like any other container without the fraction."""
    pod = request.get("object")
    shape.check_pod(pod)
    spec = pod.get("spec") if isinstance(pod, Mapping) else None
    if not isinstance(spec, Mapping) or not isinstance(spec.get("ephemeralContainers"), list):
        return allow()
    parsed = parse_pod(view_from_pod_spec(pod.get("metadata") or {}, spec, namespace=str(
        request.get("namespace") or "")), config.keys)
    if parsed.share is None:
        return allow()
    ops = [{"op": "replace", "path": f"/spec/ephemeralContainers/{i}",
            "value": _with_list(c, "env", _void_env(list(c.get("env") or [])))}
           for i, c in enumerate(spec["ephemeralContainers"])
           if isinstance(c, Mapping)
           and _void_env(list(c.get("env") or [])) != list(c.get("env") or [])]
    return allow(patch=tuple(ops))


def mutate(request: Mapping[str, Any], config: AdmissionConfig, *,
           new_namespace: Callable[[], str] = podspec.new_mps_namespace) -> Decision:
    """Review one AdmissionReview request for the mutating webhook. `new_namespace` draws the
    random part of a new sm-sharing container's MPS namespace name (`podspec.mps_namespace_for`;
    the only impure step, so tests pass their own). A request or pod of the wrong shape
    (`shape`) is a 400, changing nothing."""
    try:
        shape.check_request(request)
        return _mutate(request, config, new_namespace)
    except ManifestError as e:
        return manifest_denial(e)


def _mutate(request: Mapping[str, Any], config: AdmissionConfig,
            new_namespace: Callable[[], str]) -> Decision:
    if kind_of(request) != "Pod":
        return allow()
    if request.get("operation") == "UPDATE" and request.get("subResource") == \
            "ephemeralcontainers":
        return _ephemeral_ops(request, config)
    if request.get("operation") != "CREATE" or request.get("subResource"):
        return allow()  # only new pods are wired; a pod's containers cannot change later
    pod = request.get("object")
    if not isinstance(pod, Mapping):
        return allow()
    shape.check_pod(pod)
    metadata = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    parsed = parse_pod(view_from_pod_spec(metadata, spec, namespace=str(
        request.get("namespace") or "")), config.keys)
    warnings = tuple(str(w) for w in parsed.warnings)
    if parsed.errors:
        # Deny here too: if only this webhook ran, an invalid pod must not start unwired.
        return contract_denial(parsed.errors, warnings)
    share = parsed.share
    if share is None or not isinstance(spec.get("containers"), list):
        return allow(warnings=warnings)  # not a fractional pod: untouched
    if (reserved := wiring.gate_name_problem(share)) is not None:
        return deny(reserved.text, code=422, reason="Invalid", warnings=warnings)
    namespace = None
    if share.compute_mode is ComputeMode.SM_SHARING:
        # A name already there is kept when it carries the tag of the pod's Kubernetes
        # namespace: this webhook may run again on its own output (reinvocation). Any other is
        # replaced (the mount follows): the node agent gives a name to the first container
        # naming it, so a name copied from another namespace's pod would lock that pod out.
        # docs/admission.md, "How the name is protected".
        pod_namespace = str(request.get("namespace") or "")
        namespace = share.mps_namespace
        if namespace is None or not podspec.is_named_for(namespace, pod_namespace):
            namespace = podspec.mps_namespace_for(pod_namespace, new_namespace())
    new = desired_spec(spec, share, config, namespace)
    if len(new["containers"]) != len(spec["containers"]):
        return allow(warnings=warnings)  # malformed entries; the API server rejects the pod
    found = spec.get("schedulerName")
    if config.scheduler_name and (problem := scheduler_problem(
            found, config.scheduler_name, "spec.schedulerName")):
        warnings += ("spec.schedulerName: " + ("" if found is None else f"{found!r} ")
                     + problem,)
    warnings += default_mps_warnings(spec, parsed, config.keys)
    own = spec.get("runtimeClassName")
    if config.runtime_class and own and own != config.runtime_class:
        warnings += (f"spec.runtimeClassName: {own!r} is kept, but container "
                     f"{share.container!r} reaches its GPU through the NVIDIA runtime "
                     f"({config.runtime_class!r}); without it the container has no GPU",)
    ops = _ops(spec, new)
    if namespace is not None and namespace != share.mps_namespace:
        ops.append(_annotation_op(config.keys.derived(share.container, k.ADMITTED_MPS_NAMESPACE),
                                  namespace))
    ops += _request_from_limit(metadata.get("annotations") or {}, share, config.keys)
    return allow(patch=tuple(ops), warnings=warnings)
