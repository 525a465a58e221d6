"""The validating webhook: contract checks, protected keys, and the gate's integrity. Pure.

Pods: every contract error is refused (on UPDATE only errors the change introduces, so a pod
admitted before the webhook existed can still be updated and deleted); protected keys
(`Keys.is_protected`: binder-owned and derived) may be created, changed or removed only by the
configured identities (a new pod's MPS namespace name, the one such key a creator may bring,
must carry the tag of the pod's namespace); a pod's fractional containers and compute modes
are fixed once it exists (its env, mounts and gate were wired from them); user-owned keys are
frozen once the binder set `.gpus.devices` (`frozen`); and the pod's spec is refused for what
its user may not ask for (`pod_manifest`: host paths in every pod, ways past the containers,
the reserved volumes' mounts) and, in a fractional pod, for wiring that is not exactly what
the mutating webhook injects (`wiring`: the gate and the other containers' GPU env;
`wired_spec`: the fractional container's env and MPS mount, the reserved volumes). On UPDATE
only what the change introduces is refused, compared on full values. A Binding carries no
NvFractions key unless an allowed identity binds (its annotations reach the pod without pod
admission). Workloads with a pod template get the contract checks early; a template never
carries a protected key, whoever writes it (the binder writes those on each pod, after
scheduling). No `exec` or `attach` may join the gate container while it waits. A fractional
container that mounts CUDA's default MPS pipe directory is admitted with a warning
(`default_mps`), when its pod is created and on a workload's template; so is a workload with a
GPU-sharing key where its pods do not get it (`contract.misplaced_keys`: on its own metadata, or
as a label), for the workloads the webhook is sent (a template with a key where pods get it). A
workload's UPDATE gives only the warnings its old object did not (a ReplicaSet is updated on
each scale).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..contract import (
    ComputeMode,
    ManifestError,
    PodRequest,
    PodSpecAt,
    parse_pod,
    pod_specs,
    view_from_pod_spec,
)
from ..contract import keys as k
from ..contract.misplaced_keys import misplaced_keys
from . import frozen, podspec, shape
from .config import GATE_CONTAINER, AdmissionConfig
from .default_mps import default_mps_warnings
from .errors import Problem, denial_text, error_text, manifest_denial
from .pod_manifest import _is_nvfractions_key, manifest_problems
from .review import Decision, allow, annotations_of, deny, kind_of, user_of
from .wired_spec import _spec_problems

# manifest_problems is re-exported: `kai-fractions validate` and the tests import it from here.
__all__ = ["JOINS_A_CONTAINER", "WORKLOAD_KINDS", "manifest_problems", "validate"]

WORKLOAD_KINDS = frozenset({"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job",
                            "CronJob", "ReplicationController", "PodTemplate"})


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


def _foreign_mps_namespace(new: PodRequest, key: str, namespace: str) -> list[str]:
    """A new pod's MPS namespace name must carry the tag of its own Kubernetes namespace
    (`podspec.namespace_tag`), whoever creates it: the node agent gives a name to the first
    container naming it, so one copied from a pod of another namespace would lock that pod out
    of every node the copier reached first. The mutating webhook replaces such a name; this
    refuses it where that webhook did not run."""
    name = new.share.mps_namespace if new.share is not None else None
    if name is None or podspec.is_named_for(name, namespace):
        return []
    return [f"{key}: {name!r} was not named for a pod of Kubernetes namespace {namespace!r} "
            f"(a new pod's MPS namespace name must start with "
            f"{k.MPS_NAMESPACE_PREFIX}{podspec.namespace_tag(namespace)}, the tag of its "
            "namespace, so that no pod can take another namespace's); remove the annotation: "
            "the admission webhook names the MPS namespace itself"]


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
    if exempt is not None and new is not None:
        forbidden += _foreign_mps_namespace(new, exempt, namespace)
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
    if not updating:  # a pod's mounts never change: said once, when it is created
        warnings += default_mps_warnings(obj.get("spec"), new, config.keys)
    if problems:
        return deny(denial_text(problems + invalid), warnings=warnings)
    if invalid:
        return deny(denial_text(invalid), code=422, reason="Invalid", warnings=warnings)
    return allow(warnings=warnings)


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


def _template(obj: Any) -> PodSpecAt | None:
    return next(iter(pod_specs(obj)), None) if isinstance(obj, Mapping) else None


def _workload_warnings(found: PodSpecAt, parsed: PodRequest, keys: k.Keys) -> tuple[str, ...]:
    """A template's warnings: the pods' own (they go to the controller that creates them: the
    user sees these), a mount at CUDA's default MPS pipe directory, misplaced keys."""
    return (*(str(w) for w in parsed.warnings), *default_mps_warnings(found.spec, parsed, keys),
            *(str(w) for w in misplaced_keys(found.view, found.path, found.owner_annotations,
                                             keys)))


def _validate_workload(request: Mapping[str, Any], config: AdmissionConfig) -> Decision:
    obj = request.get("object")
    old_obj = request.get("oldObject") if request.get("operation") == "UPDATE" else None
    namespace = str(request.get("namespace") or "")
    shape.check_metadata(obj)
    if isinstance(obj, Mapping) and not (obj.get("metadata") or {}).get("namespace"):
        obj = {**obj, "metadata": {**(obj.get("metadata") or {}), "namespace": namespace}}
    found = next(iter(pod_specs(obj)), None) if isinstance(obj, Mapping) else None
    try:
        old_found = _template(old_obj)
    except ManifestError as e:
        raise ManifestError(f"request.oldObject.{e}") from None
    if found is None:
        return allow()
    view = found.view
    old_view = old_found.view if old_found is not None else None
    old_annotations = dict(old_view.annotations) if old_view is not None else {}
    problems = [f"{key}: a pod template may not carry a protected key; the binder writes it "
                "on each pod after scheduling"
                for key, value in sorted(view.annotations.items())
                if config.keys.is_protected(key) and old_annotations.get(key) != value]
    new = parse_pod(view, config.keys)
    old = parse_pod(old_view, config.keys) if old_view is not None else None
    problems += _new_errors(new, old)
    warnings = _workload_warnings(found, new, config.keys)
    if old_found is not None and old is not None:
        # Said when their cause comes, not on each update: the deployment controller updates
        # a ReplicaSet on every scale, and each answer's warnings end in its log.
        said = set(_workload_warnings(old_found, old, config.keys))
        warnings = tuple(w for w in warnings if w not in said)
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
