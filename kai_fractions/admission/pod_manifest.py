"""What a pod's spec may not ask for, as its user writes it: host paths, mounts, isolation.

In EVERY pod no hostPath may reach the marker root, the MPS pipes, the agent's socket directory
or the kubelet's pods directory (where the marker and MPS subPaths are bind-mounted), however
spelled (`hostpaths`: whoever can write the marker root can release any pod on the node). In a
pod that is fractional or carries the gate or a reserved volume, no container asks for a way
past its own (`isolation`: privileged, hostPID, ...); only the gate may mount the marker root
and only the fractional container the MPS pipes. Separate from the review (`validate`) because
`kai-fractions validate` applies the same rules offline to a user's manifest
(`manifest_problems`), before any mutating webhook wired it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from ..contract import ComputeMode, ManifestError, PodRequest
from ..contract import keys as k
from ..contract.errors import shown
from ..gate import paths
from . import hostpaths, isolation, podspec, shape, wiring
from .config import GATE_CONTAINER, MARKER_VOLUME, MPS_VOLUME, PODINFO_VOLUME, AdmissionConfig
from .errors import Problem, exact

_CONTAINER_LISTS = ("initContainers", "containers", "ephemeralContainers")
_RESERVED_VOLUMES = frozenset({MARKER_VOLUME, PODINFO_VOLUME, MPS_VOLUME})
HOST_PATH_EXEMPTION_HINT = (
    "to admit a trusted host agent without NvFractions keys, exempt its namespace: the label "
    "kai-fractions.io/webhook=disabled, or the chart's webhook.hostPathExemptNamespaces")
"""Ends a host-path refusal of a pod without NvFractions keys: host-level agents (node
exporters, GPU operator parts) mount `/`."""
HOST_PATH_NO_EXEMPTION_HINT = (
    "no namespace exemption lifts this for a pod with NvFractions keys: mount a narrower host "
    "directory, or run the host agent as a pod of its own without them")
"""Ends a host-path refusal of a pod with NvFractions keys, which the exemptions never cover
(its gate and limits depend on these directories)."""


def _containers(spec: Mapping[str, Any]) -> Iterator[tuple[str, int, Mapping[str, Any]]]:
    for field in _CONTAINER_LISTS:
        for i, c in enumerate(spec.get(field) or []):
            if isinstance(c, Mapping):
                yield field, i, c


def _guarded(config: AdmissionConfig) -> list[tuple[str, str, str]]:
    """The host directories no hostPath may reach: (canonical path, what it is, who may)."""
    return [(hostpaths.canonical(directory), f"{what} {directory!r}", who)
            for directory, what, who in (
        (config.marker_host_dir, "the kai-fractions directory",
         f"only the webhook's own volume {MARKER_VOLUME!r} may"),
        (config.mps_pipe_host_dir, "the kai-fractions directory",
         f"only the webhook's own volume {MPS_VOLUME!r} may"),
        (config.agent_socket_host_dir, "the kai-fractions directory",
         "no volume may: whoever reaches the node agent's socket can release any pod's limits"),
        (config.kubelet_pods_dir, "the kubelet's pods directory",
         "no volume may: the kubelet mounts every pod's subPath volumes read-write under it, "
         "the gate's marker directory and the MPS namespaces included"))]


def _host_path_problems(spec: Mapping[str, Any], config: AdmissionConfig,
                        hint: str) -> list[Problem]:
    """No hostPath of any pod reaches the marker root, the MPS pipes, the agent's socket
    directory or the kubelet's pods directory (the directory, a parent or a child, however
    spelled), except the webhook's own reserved volumes, which must point exactly at theirs.
    Each path is resolved once; `hint` ends the denial (how, if at all, it can be lifted)."""
    reserved = {MARKER_VOLUME: config.marker_host_dir, MPS_VOLUME: config.mps_server_host_dir}
    guarded = _guarded(config)
    out: list[Problem] = []
    for i, volume in enumerate(spec.get("volumes") or []):
        if not isinstance(volume, Mapping) or not isinstance(volume.get("hostPath"), Mapping):
            continue
        path = str(volume["hostPath"].get("path") or "")
        where = f"spec.volumes[{i}].hostPath.path"
        if not hostpaths.fits(path):
            out.append(Problem(f"{where}: must be shorter than PATH_MAX ({hostpaths.PATH_MAX} "
                               f"bytes), the longest path the kernel opens (got {shown(path)})",
                               exact(path)))
            continue
        resolved = hostpaths.canonical(path or "/")
        own = reserved.get(str(volume.get("name")))
        if own is not None:
            if resolved != hostpaths.canonical(own):
                out.append(Problem(f"{where}: volume {volume.get('name')!r} must be the host "
                                   f"directory {own!r}, not {shown(path)}", exact(path)))
            continue
        # Host-level agents (node exporters, GPU operator parts) mount `/`, `/run` or `/proc`:
        # the denial says once, after the last such problem, how an admin lets trusted ones in.
        out += [Problem(f"{where}: {shown(path)} reaches {what}; {who}", exact(path),
                        hint=hint)
                for canonical, what, who in guarded if hostpaths.related(resolved, canonical)]
    return out


def _own_namespace(mount: Mapping[str, Any], own: Mapping[str, Any] | None) -> bool:
    """The mount reaches exactly the container's own namespace directory, where its
    CUDA_MPS_PIPE_DIRECTORY points, read-write as injected (an MPS client writes into its
    pipes); fields the API server may default do not count."""
    return own is not None and not mount.get("subPathExpr") and not mount.get("readOnly") and all(
        mount.get(field) == own[field] for field in ("mountPath", "subPath"))


def _mount_problems(spec: Mapping[str, Any], request: PodRequest,
                    config: AdmissionConfig) -> list[Problem]:
    """Only the gate reads the marker root, only the fractional container reaches the MPS
    pipes, and only its own namespace's."""
    share = request.share
    sm_container = (share.container if share is not None
                    and share.compute_mode is ComputeMode.SM_SHARING else None)
    own = podspec.mps_mount(share.mps_namespace) if share and share.mps_namespace else None
    out: list[str] = []
    for field, i, c in _containers(spec):
        name = c.get("name")
        for j, mount in enumerate(c.get("volumeMounts") or []):
            if not isinstance(mount, Mapping):
                continue
            where = f"spec.{field}[{i}].volumeMounts[{j}]"
            volume = mount.get("name")
            if volume == MARKER_VOLUME:
                is_gate = field == "initContainers" and name == GATE_CONTAINER
                if not is_gate:
                    out.append(f"{where}: only the {GATE_CONTAINER} init container may mount "
                               f"{MARKER_VOLUME}")
                elif mount.get("readOnly") is not True or mount.get(
                        "subPathExpr") != f"$({paths.POD_UID_ENV})":
                    out.append(f"{where}: {GATE_CONTAINER} must mount {MARKER_VOLUME} "
                               f"read-only with subPathExpr $({paths.POD_UID_ENV})")
            elif volume == MPS_VOLUME and (name != sm_container or field == "ephemeralContainers"):
                out.append(f"{where}: only the sm-sharing container of this pod may mount "
                           f"{MPS_VOLUME}")
            elif volume == MPS_VOLUME and not _own_namespace(mount, own):
                key = request.admitted_namespace_key(config.keys)
                out.append(f"{where}: must mount only the container's own MPS namespace, "
                           f"read-write, exactly {own}" if own is not None else
                           f"{where}: the container has no MPS namespace of its own ({key} is "
                           "missing; the mutating webhook names one when the pod is created)")
    return [Problem(text) for text in out]


def manifest_problems(spec: Mapping[str, Any], request: PodRequest,
                      config: AdmissionConfig) -> list[Problem]:
    """What a pod's spec may not ask for, as its user writes it (before the mutating webhook
    wires it): host paths for every pod; for a pod that is fractional or carries the gate or a
    reserved volume, any way past its containers (`isolation`); the reserved volumes' mounts;
    and a fractional container may not take the gate's name. `kai-fractions validate` reports
    these offline, from the same rules, where no API server decoded the manifest: a field of
    the wrong shape (`shape`) is then the one problem."""
    try:
        shape.check_spec(spec)
    except ManifestError as e:
        return [Problem(str(e), exact(str(e)))]
    return _manifest_problems(spec, request, config)


def _manifest_problems(spec: Mapping[str, Any], request: PodRequest,
                       config: AdmissionConfig) -> list[Problem]:
    """`manifest_problems` of a spec whose shape was checked (`_validate_pod`)."""
    keyed = any(_is_nvfractions_key(key, config.keys) for key in request.pod.annotations)
    out = _host_path_problems(
        spec, config, HOST_PATH_NO_EXEMPTION_HINT if keyed else HOST_PATH_EXEMPTION_HINT)
    # str(): a name of the wrong shape (a list) is no reserved name, and must not raise.
    carries_reserved = any(isinstance(v, Mapping) and str(v.get("name")) in _RESERVED_VOLUMES
                           for v in spec.get("volumes") or [])
    if (request.share is not None or request.errors or _carries_gate(spec)
            or carries_reserved):
        out += isolation.isolation_problems(spec)
    out += _mount_problems(spec, request, config)
    if request.share is not None and (reserved := wiring.gate_name_problem(request.share)):
        out.append(reserved)
    return out


def _carries_gate(spec: Mapping[str, Any]) -> bool:
    return any(c.get("name") == GATE_CONTAINER for f, _, c in _containers(spec)
               if f == "initContainers")


def _is_nvfractions_key(key: str, keys: k.Keys) -> bool:
    """A key the contract reads (or the webhooks protect): what the chart's match conditions
    call an NvFractions key, and the mirror's record."""
    return (key.startswith((keys.prefix, keys.project_prefix, k.PORTION_LIMIT_PREFIX))
            or key in k.LEGACY_POD_KEYS or key == k.MIRRORED_RECORD)
