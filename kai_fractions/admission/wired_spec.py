"""A fractional pod's spec held to what the mutating webhook injects, and `_spec_problems`.

The fractional container's enforced env is exactly the injected one (each variable read from
its annotation) and an sm-sharing container mounts its own MPS namespace; the reserved volumes
are the injected ones (the marker root and the MPS server directory as hostPath volumes, the
pod's annotations as a downward API volume). What the mutating webhook injects is checked here
too, on its own: the mutating webhook may never have seen the pod (the chart's
`webhook.objectSelector` matches the pod's own labels, which its author writes), and a pod
wired by hand from `kubectl create --dry-run=server -o yaml` must not pass with the parts that
enforce its limits changed. The gate and the other containers' GPU env are `wiring`'s; what a
user may not ask for at all is `pod_manifest`'s; `_spec_problems` puts them all together for
the validating webhook (`validate`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..contract import ComputeMode, ContainerShare, PodRequest, env_sources
from ..contract import keys as k
from . import podspec, wiring
from .config import GATE_CONTAINER, MARKER_VOLUME, MPS_VOLUME, PODINFO_VOLUME, AdmissionConfig
from .errors import Problem, exact
from .pod_manifest import _carries_gate, _containers, _manifest_problems
from .wiring import fractional_env, matches, show_value


def _spec_problems(obj: Any, request: PodRequest | None,
                   config: AdmissionConfig) -> list[Problem]:
    """Everything wrong with the pod's spec: what its user may not ask for
    (`manifest_problems`); for a pod the mutating webhook wired, or one that carries the
    gate, the gate exactly as injected; and for a wired pod the other containers' GPU env,
    the fractional container's env and MPS mount, and the reserved volumes as injected."""
    spec = obj.get("spec") if isinstance(obj, Mapping) else None
    if not isinstance(spec, Mapping) or request is None:
        return []
    out = _manifest_problems(spec, request, config)
    # A pod that breaks the contract is refused for that (and by the node agent); the mutating
    # webhook did not wire it, so its gate and env would only repeat the refusal.
    wired = request.share is not None and not request.errors
    if wired or _carries_gate(spec):
        out = wiring.gate_problems(spec, config) + out
    if wired and request.share is not None:
        out += wiring.env_problems(spec, request.share)
        out += _fractional_problems(spec, request.share, config)
        out += _reserved_volume_problems(spec, request.share, config)
    return out
def _fractional_problems(spec: Mapping[str, Any], share: ContainerShare,
                         config: AdmissionConfig) -> list[Problem]:
    """The fractional container's enforced env exactly as injected (each variable read from
    its annotation), and an sm-sharing container's mount of its own MPS namespace present."""
    if share.container == GATE_CONTAINER:
        return []  # `wiring.gate_name_problem` says why
    out: list[Problem] = []
    for field, i, c in _containers(spec):
        if field == "ephemeralContainers" or c.get("name") != share.container:
            continue  # an ephemeral container of that name is another's: `wiring.env_problems`
        where = f"spec.{field}[{i}]"
        out += _fractional_env_problems(where, c, share, config)
        if share.compute_mode is ComputeMode.SM_SHARING:
            out += _mps_mount_missing(where, c, share, config)
    return out


def _fractional_env_problems(where: str, container: Mapping[str, Any], share: ContainerShare,
                             config: AdmissionConfig) -> list[Problem]:
    """Why the container's enforced variables (`k.ENFORCED_ENV`) are not the ones the mutating
    webhook injects: each of its mode's, once, read from the annotation the contract names for
    it (the node agent applies the limits to what those annotations say), and no other. The
    test is the mutating webhook's own (`fractional_env` leaves such an env as it is);
    variables of other names are the pod's own."""
    env = container.get("env")
    items = list(env) if isinstance(env, list) else []
    wanted = podspec.enforced_env(share.container, share.compute_mode, config.keys)
    if fractional_env(items, wanted) == items:
        return []
    sources = env_sources(share.container, share.compute_mode, config.keys)
    by_name = {str(w["name"]): w for w in wanted}
    name, mode = share.container, share.compute_mode.value
    out: list[Problem] = []
    seen: set[str] = set()
    for j, entry in enumerate(items):
        if not isinstance(entry, Mapping) or entry.get("name") not in k.ENFORCED_ENV:
            continue
        var, at = str(entry["name"]), f"{where}.env[{j}]"
        if var not in by_name:
            out.append(Problem(f"{at}: container {name!r} ({mode}) may not set {var}: the "
                               "admission webhook sets only "
                               f"{', '.join(by_name)} there (got {show_value(entry)})",
                               exact(entry)))
        elif var in seen:
            out.append(Problem(f"{at}: {var} is set twice in container {name!r} (the last one "
                               "wins): only the entry the admission webhook injects may set it",
                               exact(entry)))
        elif not matches(entry, by_name[var]):
            out.append(Problem(f"{at}: {var} of container {name!r}, which has the GPU "
                               f"fraction, must be read from {_field_path(sources[var])}, as "
                               "the admission webhook injects it: the node agent applies the "
                               f"pod's limits to what that annotation says (got "
                               f"{show_value(entry)})", exact(entry)))
        seen.add(var)
    out += [Problem(f"{where}.env: container {name!r} has the GPU fraction but no {var}: the "
                    f"admission webhook sets it from {_field_path(sources[var])}", exact(var))
            for var in by_name if var not in seen]
    # Never empty where the mutating webhook's test failed (a shape this does not name).
    return out or [Problem(f"{where}.env: the enforced variables of container {name!r} must be "
                           "exactly what the admission webhook injects", exact(items))]


def _field_path(key: str) -> str:
    return f"valueFrom.fieldRef.fieldPath {podspec.annotation_ref(key)['fieldRef']['fieldPath']}"


def _mps_mount_missing(where: str, container: Mapping[str, Any], share: ContainerShare,
                       config: AdmissionConfig) -> list[Problem]:
    """An sm-sharing container without a mount of the MPS volume: its CUDA_MPS_PIPE_DIRECTORY
    leads nowhere, so it runs outside the MPS server and its compute cap never applies. (The
    mount's shape, where there is one: `_mount_problems`.)"""
    mounts = container.get("volumeMounts")
    if any(isinstance(m, Mapping) and m.get("name") == MPS_VOLUME
           for m in (mounts if isinstance(mounts, list) else [])):
        return []
    name = share.container
    if share.mps_namespace is None:
        key = config.keys.derived(name, k.ADMITTED_MPS_NAMESPACE)
        return [Problem(f"{where}.volumeMounts: sm-sharing container {name!r} must mount its own "
                        f"MPS namespace ({MPS_VOLUME}), and it has none ({key} is missing; the "
                        "mutating webhook names one when the pod is created)")]
    return [Problem(f"{where}.volumeMounts: sm-sharing container {name!r} must mount its own "
                    f"MPS namespace, exactly {podspec.mps_mount(share.mps_namespace)}, as the "
                    "admission webhook injects it: without it the container runs outside the "
                    "MPS server and its compute cap never applies", exact(share.mps_namespace))]


_VOLUME_ROLES = {
    MARKER_VOLUME: "the gate releases the workload on the node agent's marker there, which "
                   "only the node agent may write",
    MPS_VOLUME: "the MPS server's pipes, where the container's compute cap is enforced",
    PODINFO_VOLUME: "the gate checks the marker against the pod's annotations there",
}


def _reserved_volume_problems(spec: Mapping[str, Any], share: ContainerShare,
                              config: AdmissionConfig) -> list[Problem]:
    """The reserved volumes as the mutating webhook injects them: the marker root (and, for an
    sm-sharing container, the MPS server directory) hostPath volumes, whose paths
    `_host_path_problems` checks, and the pod's annotations a downward API volume. Under one
    of these names a volume the pod's author controls (an emptyDir, a PVC, an NFS share, a
    configMap) would let it write the marker its gate waits for, or feed the gate annotations
    of its own."""
    host = {MARKER_VOLUME: config.marker_host_dir, MPS_VOLUME: config.mps_server_host_dir}
    podinfo = podspec.podinfo_volume()
    required = [MARKER_VOLUME, PODINFO_VOLUME]
    if share.compute_mode is ComputeMode.SM_SHARING:
        required.append(MPS_VOLUME)
    volumes = spec.get("volumes")
    found: set[str] = set()
    out: list[Problem] = []
    for i, volume in enumerate(volumes if isinstance(volumes, list) else []):
        name = volume.get("name") if isinstance(volume, Mapping) else None
        if not isinstance(name, str) or name not in _VOLUME_ROLES:
            continue
        found.add(name)
        where = f"spec.volumes[{i}]"
        sources = sorted(str(key) for key in volume if key != "name")
        if name in host and (sources != ["hostPath"]
                             or not isinstance(volume.get("hostPath"), Mapping)):
            out.append(Problem(f"{where}: volume {name!r} must be a hostPath volume of the host "
                               f"directory {host[name]!r}, as the admission webhook injects it "
                               f"({_VOLUME_ROLES[name]}), not "
                               f"{' and '.join(sources) or 'one without a source'}",
                               exact(volume)))
        elif name == PODINFO_VOLUME and (set(volume) != set(podinfo)
                                         or not matches(volume, podinfo)):
            out.append(Problem(f"{where}: volume {name!r} must be the downward API volume of "
                               "the pod's annotations the admission webhook injects "
                               f"({_VOLUME_ROLES[name]}), {show_value(podinfo['downwardAPI'])} "
                               f"(got {show_value(volume)})", exact(volume)))
    out += [Problem(f"spec.volumes: a fractional pod must have volume {name!r} as the admission "
                    f"webhook injects it ({_VOLUME_ROLES[name]})", exact(name))
            for name in required if name not in found]
    return out
