"""The validating webhook: contract checks, protected keys, and the gate's integrity. Pure.

Pods: every contract error is refused (on UPDATE only errors the change introduces, so a pod
admitted before the webhook existed can still be updated and deleted); protected keys
(`Keys.is_protected`: binder-owned and derived) may be created, changed or removed only by the
configured identities; a pod's fractional containers and compute modes are fixed once it
exists (its env, mounts and gate were wired from them); user-owned keys are frozen once the
binder set `.gpus.devices` (`frozen`); in a fractional pod the gate is exactly the injected one
and every other container says `NVIDIA_VISIBLE_DEVICES=void` (`wiring`), the fractional
container's enforced env is exactly the injected one (each variable read from its annotation)
and an sm-sharing container mounts its own MPS namespace, the reserved volumes are the
injected ones (the marker root and the MPS server directory as hostPath volumes, the pod's
annotations as a downward API volume), all checked here even if the mutating webhook never saw
the pod (`webhook.objectSelector` matches labels the pod's author writes), no container asks for
a way past its own (`isolation`: privileged, hostPID, ...), only the gate may mount the marker
root and only the fractional container the MPS pipes; and in EVERY pod no hostPath may reach
the marker root, the MPS pipes, the agent's socket directory or the kubelet's pods directory
(where the marker and MPS subPaths are bind-mounted), however spelled (`hostpaths`: whoever can
write the marker root can release any pod on the node). On UPDATE only what the
change introduces is refused, compared on full values. A Binding carries no NvFractions key
unless an allowed identity binds (its annotations reach the pod without pod admission).
Workloads with a pod template get the contract checks early; a template never carries a
protected key, whoever writes it (the binder writes those on each pod, after scheduling).
No `exec` or `attach` may join the gate container while it waits.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from ..contract import (
    ComputeMode,
    ContainerShare,
    ManifestError,
    PodRequest,
    PodView,
    env_sources,
    parse_pod,
    pod_views,
    view_from_pod_spec,
)
from ..contract import keys as k
from ..contract.errors import shown
from ..gate import paths
from . import frozen, hostpaths, isolation, podspec, shape, wiring
from .config import GATE_CONTAINER, MARKER_VOLUME, MPS_VOLUME, PODINFO_VOLUME, AdmissionConfig
from .errors import Problem, denial_text, error_text, exact, manifest_denial
from .review import Decision, allow, annotations_of, deny, kind_of, user_of
from .wiring import fractional_env, matches, show_value

WORKLOAD_KINDS = frozenset({"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job",
                            "CronJob", "ReplicationController", "PodTemplate"})
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


def _protected_changes(old: Mapping[str, str], new: Mapping[str, str], user: str,
                       config: AdmissionConfig, exempt: str | None = None) -> list[str]:
    if user in config.allowed_identities:
        return []
    out = []
    for key in sorted(set(old) | set(new)):
        if not config.keys.is_protected(key) or old.get(key) == new.get(key) or key == exempt:
            continue
        action = "create" if key not in old else "remove" if key not in new else "change"
        out.append(f"{key}: is a protected key: only {', '.join(config.allowed_identities)} "
                   f"may {action} it, not {user or 'an anonymous user'}")
    return out


def _new_errors(new: PodRequest, old: PodRequest | None) -> list[str]:
    # Compared on the full value: the text leaves out (or cuts) a long one.
    seen = {(e.key, e.rule, e.value) for e in old.errors} if old is not None else set()
    return [error_text(e) for e in new.errors if (e.key, e.rule, e.value) not in seen]


def _parse(obj: Any, config: AdmissionConfig, namespace: str) -> PodRequest | None:
    if not isinstance(obj, Mapping):
        return None
    return parse_pod(view_from_pod_spec(obj.get("metadata") or {}, obj.get("spec") or {},
                                        namespace=namespace), config.keys)


def _modes(request: PodRequest | None) -> dict[str, ComputeMode]:
    return {s.container: s.compute_mode for s in request.shares} if request else {}


def _fixed_shares(old: PodRequest, new: PodRequest, config: AdmissionConfig) -> list[str]:
    before, after = _modes(old), _modes(new)
    out = []
    for name in sorted(set(before) | set(after)):
        if before.get(name) == after.get(name):
            continue
        if name in before and name in after:
            out.append(f"{config.keys.container(name, k.COMPUTE_MODE)}: the compute mode is "
                       "fixed once the pod exists (its env and mounts were wired from it); "
                       "create a new pod to change it")
        else:
            out.append(f"{config.keys.container(name, k.MEMORY_REQUEST)}: whether container "
                       f"{name!r} has a GPU fraction is fixed once the pod exists (the "
                       "admission webhook wired its env and gate at creation); create a new "
                       "pod instead")
    return out


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


# What the mutating webhook injects is checked here too, on its own: the mutating webhook may
# never have seen the pod (the chart's `webhook.objectSelector` matches the pod's own labels,
# which its author writes), and a pod wired by hand from `kubectl create --dry-run=server -o
# yaml` must not pass with the parts that enforce its limits changed.

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


def _validate_pod(request: Mapping[str, Any], config: AdmissionConfig) -> Decision:
    obj, old_obj = request.get("object"), request.get("oldObject")
    namespace = str(request.get("namespace") or "")
    updating = request.get("operation") == "UPDATE"
    shape.check_pod(obj)
    if updating:
        shape.check_pod(old_obj, old=True)
    old_annotations = annotations_of(old_obj) if updating else {}
    user = user_of(request)
    new = _parse(obj, config, namespace)
    # The mutating webhook names a new sm-sharing container's MPS namespace as the pod is
    # created, on the creator's behalf; after that the key is protected like the others.
    exempt = None if updating or new is None else new.admitted_namespace_key(config.keys)
    forbidden = _protected_changes(old_annotations, annotations_of(obj), user, config, exempt)
    if updating:
        forbidden += frozen.frozen_changes(old_obj, old_annotations, annotations_of(obj), user,
                                           config)
    if new is None:
        return allow()
    old = _parse(old_obj, config, namespace) if updating else None
    invalid = _new_errors(new, old)
    if old is not None:
        invalid += _fixed_shares(old, new, config)
    # On UPDATE only what the change introduces: a pod wired by an older webhook (or admitted
    # before it existed) can still be updated and deleted. The spec of a pod barely changes
    # after creation (images, ephemeral containers), so this is where a swap would show.
    # Problems compare on their full values, not on their (cut) text.
    seen = set(_spec_problems(old_obj, old, config)) if old is not None else set()
    problems: list[Problem | str] = [*forbidden]
    problems += [p for p in _spec_problems(obj, new, config) if p not in seen]
    warnings = tuple(str(w) for w in new.warnings)
    if problems:
        return deny(denial_text(problems + invalid), warnings=warnings)
    if invalid:
        return deny(denial_text(invalid), code=422, reason="Invalid", warnings=warnings)
    return allow(warnings=warnings)


def _is_nvfractions_key(key: str, keys: k.Keys) -> bool:
    """A key the contract reads (or the webhooks protect): what the chart's match conditions
    call an NvFractions key, and the mirror's record."""
    return (key.startswith((keys.prefix, keys.project_prefix, k.PORTION_LIMIT_PREFIX))
            or key in k.LEGACY_POD_KEYS or key == k.MIRRORED_RECORD)


def _validate_binding(request: Mapping[str, Any], config: AdmissionConfig) -> Decision:
    # A Binding's annotations are copied onto the pod without pod admission, and its review
    # holds no pod to compare with: no freeze, no contract check can apply. So only the allowed
    # identities (KAI's binder binds with annotations) may bind with any NvFractions key:
    # protected keys as on the pod, and user-owned ones (request, limit, mode, the pod-level
    # keys), which a user could otherwise change after the pod was created and reviewed. And
    # the pod's MPS namespace never comes with one, whoever binds: its mount was made from the
    # name the pod was created with.
    shape.check_metadata(request.get("object"))
    annotations = annotations_of(request.get("object"))
    user = user_of(request)
    problems = [f"{key}: the MPS namespace is named once, when the pod is created; a Binding "
                "may not carry it" for key in sorted(annotations)
                if config.keys.is_admitted_namespace(key)]
    problems += _protected_changes({}, annotations, user, config)
    if user not in config.allowed_identities:
        problems += [f"{key}: a Binding's annotations reach the pod without pod admission: only "
                     f"{', '.join(config.allowed_identities)} may bind with an NvFractions "
                     f"key, not {user or 'an anonymous user'}"
                     for key in sorted(annotations) if _is_nvfractions_key(key, config.keys)
                     and not config.keys.is_protected(key)]
    return deny(denial_text(problems)) if problems else allow()


def _template_view(obj: Any) -> PodView | None:
    return next(iter(pod_views(obj)), None) if isinstance(obj, Mapping) else None


def _validate_workload(request: Mapping[str, Any], config: AdmissionConfig) -> Decision:
    obj = request.get("object")
    old_obj = request.get("oldObject") if request.get("operation") == "UPDATE" else None
    namespace = str(request.get("namespace") or "")
    shape.check_metadata(obj)
    if isinstance(obj, Mapping) and not (obj.get("metadata") or {}).get("namespace"):
        obj = {**obj, "metadata": {**(obj.get("metadata") or {}), "namespace": namespace}}
    view = _template_view(obj)
    try:
        old_view = _template_view(old_obj)
    except ManifestError as e:
        raise ManifestError(f"request.oldObject.{e}") from None
    if view is None:
        return allow()
    old_annotations = dict(old_view.annotations) if old_view is not None else {}
    problems = [f"{key}: a pod template may not carry a protected key; the binder writes it "
                "on each pod after scheduling"
                for key, value in sorted(view.annotations.items())
                if config.keys.is_protected(key) and old_annotations.get(key) != value]
    new = parse_pod(view, config.keys)
    old = parse_pod(old_view, config.keys) if old_view is not None else None
    problems += _new_errors(new, old)
    warnings = tuple(str(w) for w in new.warnings)
    if problems:
        return deny("; ".join(problems), code=422, reason="Invalid", warnings=warnings)
    return allow(warnings=warnings)


def validate(request: Mapping[str, Any], config: AdmissionConfig) -> Decision:
    """Review one AdmissionReview request for the validating webhook. A request or object of
    the wrong shape (`shape`) is a 400."""
    try:
        shape.check_request(request)
        return _validate(request, config)
    except ManifestError as e:
        return manifest_denial(e)


JOINS_A_CONTAINER = frozenset({"exec", "attach"})
"""The CONNECT subresources that put a process into (or a terminal onto) a running container."""


def _validate_connect(request: Mapping[str, Any]) -> Decision:
    """No process may join the gate while it waits: one in its process namespace, as its user,
    could make it exit 0 (ptrace) before the node agent applied the pod's limits, as an
    ephemeral container targeting it could (`isolation`). The chart sends only such requests."""
    options = request.get("object")
    container = options.get("container") if isinstance(options, Mapping) else None
    sub = str(request.get("subResource") or "")
    if sub in JOINS_A_CONTAINER and container == GATE_CONTAINER:
        return deny(f"pods/{sub}: container {GATE_CONTAINER!r} is kai-fractions' gate: no "
                    "process may join it while it waits for the node agent (one could make it "
                    "exit before the pod's GPU limits are in force); its outcome is in `kubectl "
                    f"logs -c {GATE_CONTAINER}` and the pod's status")
    return allow()


def _validate(request: Mapping[str, Any], config: AdmissionConfig) -> Decision:
    if request.get("operation") == "CONNECT":
        return _validate_connect(request)
    if request.get("operation") not in ("CREATE", "UPDATE"):
        return allow()  # DELETE changes no annotation
    kind = kind_of(request)
    if kind == "Pod":  # the pod itself and its status, ephemeralcontainers, resize subresources
        return _validate_pod(request, config)
    if kind == "Binding":
        return _validate_binding(request, config)
    if kind in WORKLOAD_KINDS and not request.get("subResource"):
        return _validate_workload(request, config)
    return allow()
