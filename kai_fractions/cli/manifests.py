"""Reading YAML manifests for the CLI: files, directories, or `-` for stdin.

Every pod (or pod template) comes with where it was found, `file:line` (the line its YAML
document starts on), so an error points at it. A YAML syntax error names the file, line and
column. An object with no pod template found in it is a warning, wherever it was found, unless
its kind holds none (`NO_POD_KINDS`): a workload whose template is not where it is searched
would otherwise pass unchecked. A file given by name (`-f FILE`) with nothing to check in it is
a warning too; one found in a directory is skipped quietly (directories hold other objects
too); no pod-bearing object at all is a usage error (`NothingToCheck`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..contract import ManifestError, PodView, pod_specs
from ..contract.pod import MAX_TEMPLATE_DEPTH


class InputError(Exception):
    """Unreadable input: the message names the file and what is wrong (exit code 2)."""


class NothingToCheck(InputError):
    """The input holds no Pod and no workload with a pod template (exit code 2)."""


@dataclass(frozen=True, slots=True)
class Located:
    view: PodView
    file: str
    line: int
    """1-based: where the object's YAML document starts."""
    spec: Mapping[str, Any] = field(default_factory=dict)
    """The pod's (or template's) raw spec, for the checks that read more than the contract."""
    spec_path: str = "spec"
    """Where that spec is in the object: `spec`, `spec.template.spec`, ..."""
    template: str = ""
    """`PodSpecAt.template`: the path of a template found by searching the object, or ""."""
    owner_annotations: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """`PodSpecAt.owner_annotations`: a workload's annotations that no pod gets, by path."""

    @property
    def ref(self) -> str:
        """How messages name it: the object, then the path of a template found by searching it
        (an object may hold several)."""
        return f"{self.view.ref} {self.template}" if self.template else self.view.ref

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


@dataclass
class Manifests:
    views: list[Located] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    """An object with no pod template found in it, and a file named on the command line that
    holds nothing to check, one line each."""


NO_POD_KINDS = frozenset({
    # Kubernetes
    "APIService", "Binding", "CertificateSigningRequest", "ClusterRole", "ClusterRoleBinding",
    "ConfigMap", "ControllerRevision", "CSIDriver", "CSINode", "CustomResourceDefinition",
    "Endpoints", "EndpointSlice", "Event", "FlowSchema", "HorizontalPodAutoscaler", "Ingress",
    "IngressClass", "Lease", "LimitRange", "MutatingWebhookConfiguration", "Namespace",
    "NetworkPolicy", "Node", "PersistentVolume", "PersistentVolumeClaim",
    "PodDisruptionBudget", "PriorityClass", "PriorityLevelConfiguration", "ResourceQuota",
    "Role", "RoleBinding", "RuntimeClass", "Secret", "Service", "ServiceAccount",
    "StorageClass", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding",
    "ValidatingWebhookConfiguration", "VolumeAttachment",
    # KAI Scheduler, kai-fractions and the tools beside them
    "BindRequest", "Config", "GpuFractioningConfig", "PodGroup", "Queue", "SchedulingShard",
    "Topology", "Kustomization", "PodMonitor", "PrometheusRule", "ServiceMonitor",
    "Certificate", "ClusterIssuer", "Issuer",
})
"""Kinds known to hold no pod template: no warning for them (a directory holds many)."""


@dataclass(frozen=True, slots=True)
class _Source:
    name: str
    text: str
    named: bool
    """Given by name (or stdin), not found by walking a directory."""


def _files(path: str) -> list[tuple[Path, bool]]:
    p = Path(path)
    if p.is_dir():
        return [(f, False) for f in sorted(p.rglob("*"))
                if f.suffix in (".yaml", ".yml") and f.is_file()]
    if not p.exists():
        raise InputError(f"{path}: no such file or directory")
    return [(p, True)]


MAX_FILE_BYTES = 64 << 20
"""A manifest file larger than this is not read (`/dev/zero` would be read for ever)."""


def _bounded(name: str, read) -> str:
    text = read(MAX_FILE_BYTES + 1)
    if len(text) > MAX_FILE_BYTES:
        raise InputError(f"{name}: larger than {MAX_FILE_BYTES:,} bytes; split it")
    return text


def _sources(paths: list[str]) -> Iterator[_Source]:
    for path in paths:
        if path == "-":
            try:
                yield _Source("<stdin>", _bounded("<stdin>", sys.stdin.read), True)
            except UnicodeDecodeError as e:
                raise InputError(f"<stdin>: cannot read: {e}") from None
            continue
        for f, named in _files(path):
            try:
                with f.open(encoding="utf-8") as handle:
                    text = _bounded(str(f), handle.read)
            except (OSError, UnicodeDecodeError) as e:
                raise InputError(f"{f}: cannot read: {e}") from None
            yield _Source(str(f), text, named)


def _yaml_error(name: str, e: yaml.YAMLError) -> InputError:
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    where = f"{name}:{mark.line + 1}:{mark.column + 1}" if mark is not None else name
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    context, context_mark = getattr(e, "context", None), getattr(e, "context_mark", None)
    if context and context_mark is not None:
        problem += f" ({context} from line {context_mark.line + 1})"
    return InputError(f"{where}: not valid YAML: {problem}")


def _documents(source: _Source) -> Iterator[tuple[int, Any]]:
    """(start line, document) of each non-empty document."""
    try:
        # The loader's reader checks the whole text at once (unprintable characters).
        loader = yaml.SafeLoader(source.text)
    except yaml.YAMLError as e:
        raise _yaml_error(source.name, e) from None
    try:
        while loader.check_node():
            node = loader.get_node()
            if node is None:
                continue
            doc = loader.construct_document(node)
            if doc is None:
                continue
            if not isinstance(doc, dict):
                raise InputError(f"{source.name}:{node.start_mark.line + 1}: a document is not "
                                 "a Kubernetes object (a mapping)")
            yield node.start_mark.line + 1, doc
    except yaml.YAMLError as e:
        raise _yaml_error(source.name, e) from None
    except RecursionError:
        raise InputError(f"{source.name}: not valid YAML: nested too deep to read "
                         "(no Kubernetes object nests like this)") from None
    finally:
        loader.dispose()


def load_manifests(paths: list[str]) -> Manifests:
    """Every pod and pod template in the files, located; raises InputError for a malformed
    object or unreadable input, NothingToCheck when none is found anywhere."""
    out = Manifests()
    kinds: set[str] = set()
    for source in _sources(paths):
        found, here, warned = 0, set(), False
        for line, doc in _documents(source):
            kind = str(doc.get("kind") or "object")
            here.add(kind)
            for obj in _objects(doc):
                try:
                    views = list(pod_specs(obj))
                except ManifestError as e:
                    raise InputError(f"{source.name}:{line}: {kind}: {e}") from None
                out.views += [Located(v.view, source.name, line, v.spec, v.path, v.template,
                                      v.owner_annotations) for v in views]
                found += len(views)
                if not views and _may_hold_pods(obj):
                    out.warnings.append(_unchecked(f"{source.name}:{line}", obj))
                    warned = True
        kinds |= here
        if not found and source.named and not warned:
            out.warnings.append(f"{source.name}: no Pod or workload with a pod template "
                                f"({_kinds(here)}): nothing in it to check")
    if not out.views:
        verb = "holds" if len(paths) == 1 else "hold"
        raise NothingToCheck(f"nothing to check: {', '.join(paths)} {verb} no Pod or workload "
                             f"with a pod template ({_kinds(kinds)})")
    return out


def _objects(doc: dict) -> list[Any]:
    """The document, or a List's items (each is its own object for the warnings)."""
    items = doc.get("items") if doc.get("kind") == "List" else None
    return items if type(items) is list else [doc]  # a malformed List: pod_specs names it


def _may_hold_pods(obj: Any) -> bool:
    """A Kubernetes object (it has a kind; values.yaml and Chart.yaml have none) of a kind not
    known to hold no pod template."""
    return (isinstance(obj, Mapping) and isinstance(obj.get("kind"), str)
            and obj["kind"] not in NO_POD_KINDS and obj["kind"] != "List")


def _unchecked(where: str, obj: Mapping[str, Any]) -> str:
    metadata = obj.get("metadata") if isinstance(obj.get("metadata"), Mapping) else {}
    ref = "/".join((obj["kind"], str(metadata.get("namespace") or "default"),
                    str(metadata.get("name") or metadata.get("generateName") or "")))
    return (f"{where}: {ref}: no pod template found in it (a mapping whose spec.containers is "
            f"a list, at most {MAX_TEMPLATE_DEPTH} levels below spec), so nothing in it was "
            "checked; if it creates pods that ask for GPU fractions, validate one of them: "
            "kubectl get pod NAME -o yaml | kai-fractions validate -f -")


def _kinds(kinds: set[str]) -> str:
    return "found: " + ", ".join(sorted(kinds)) if kinds else "no objects"
