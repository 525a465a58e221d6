"""The slice of a pod the contract reads, built from a manifest (dict) of a Pod or a workload.

Pure data: no Kubernetes client here. `pod_specs` accepts Pods and anything with a pod template
(Deployment, StatefulSet, DaemonSet, ReplicaSet, Job, CronJob, PodTemplate, and the templates
other kinds nest below their spec: PyTorchJob, LeaderWorkerSet, RayCluster, JobSet, ...), each
with its raw spec and field path, so the CLI and the webhook give early feedback on workloads,
before any pod exists. `view_from_pod_spec` is the view of one pod's metadata and spec, as the
webhook, the mirror and the node agent read the pods they are given.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from types import MappingProxyType
from typing import Any

from . import keys as k


class ManifestError(ValueError):
    """A manifest field has the wrong shape; the message names the field path."""


def _mapping(value: Any, path: str) -> Mapping[str, Any]:
    if type(value) is dict:  # the common case, without the slower ABC check
        return value
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ManifestError(f"{path} must be a mapping, got {type(value).__name__}")
    return value


def _items(value: Any, path: str) -> list[Any]:
    if type(value) is list:
        return value
    if value is None:
        return []
    if not isinstance(value, list):
        raise ManifestError(f"{path} must be a list, got {type(value).__name__}")
    return value


@dataclass(frozen=True, slots=True)
class ContainerView:
    name: str
    whole_gpus: int = 0
    """`nvidia.com/gpu` from the container's limits (or requests); 0 when absent."""
    init: bool = False
    sets_whole_gpus: bool = False
    """The container names `nvidia.com/gpu` at all, 0 included: KAI refuses a fraction in a
    pod where any container does (upstream getFirstGPULimit)."""


_INDEX_FROM = 16
"""Containers above which `PodView.container` looks names up in an index."""


@dataclass(frozen=True, slots=True)
class PodView:
    name: str
    namespace: str = "default"
    uid: str = ""
    annotations: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    labels: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    containers: tuple[ContainerView, ...] = ()
    init_containers: tuple[ContainerView, ...] = ()
    node_name: str = ""
    kind: str = "Pod"
    """The object this view came from (a Deployment's template reads as kind Deployment)."""

    @property
    def all_containers(self) -> tuple[ContainerView, ...]:
        return self.containers + self.init_containers

    _by_name: dict[str, ContainerView] | None = field(default=None, init=False, repr=False,
                                                      compare=False)
    """`container`'s index, built on first use for a pod of many containers."""

    def container(self, name: str) -> ContainerView | None:
        # Plain loops for the pods there are (P4 in benchmarks/); an index for one that brings
        # thousands, which admission sees before the API server's limits apply: a lookup per
        # annotation would make parsing it quadratic.
        if len(self.containers) + len(self.init_containers) <= _INDEX_FROM:
            for c in self.containers:
                if c.name == name:
                    return c
            for c in self.init_containers:
                if c.name == name:
                    return c
            return None
        index = self._by_name
        if index is None:  # the first of a name wins, as the loops find it
            index = {c.name: c for c in reversed(self.all_containers)}
            object.__setattr__(self, "_by_name", index)
        return index.get(name)

    def with_annotations(self, annotations: Mapping[str, str]) -> PodView:
        """This view with other annotations (the mirror's hot path: a direct constructor call
        costs a fraction of dataclasses.replace)."""
        return PodView(self.name, self.namespace, self.uid, annotations, self.labels,
                       self.containers, self.init_containers, self.node_name, self.kind)

    @property
    def ref(self) -> str:
        """How messages name this object: `Deployment/ns/name` or `ns/name` for a pod."""
        base = f"{self.namespace}/{self.name}"
        return base if self.kind == "Pod" else f"{self.kind}/{base}"


def _whole_gpus(container: Mapping[str, Any], path: str) -> int | None:
    """The container's `nvidia.com/gpu` count; None when it names none."""
    resources = _mapping(container.get("resources"), f"{path}.resources")
    for section in ("limits", "requests"):
        value = _mapping(resources.get(section), f"{path}.resources.{section}").get(
            k.WHOLE_GPU_RESOURCE)
        if value is not None:
            try:
                return int(str(value))
            except ValueError:
                return -1  # not a count; validation reports it
    return None


@lru_cache(maxsize=1024)
def _container(name: str, whole_gpus: int | None, init: bool) -> ContainerView:
    """Views are immutable, so equal containers (a job's pods) share one."""
    return ContainerView(name=name, whole_gpus=whole_gpus or 0, init=init,
                         sets_whole_gpus=whole_gpus is not None)


def _containers(spec: Mapping[str, Any], key: str, init: bool) -> tuple[ContainerView, ...]:
    views = []
    for i, item in enumerate(_items(spec.get(key), _SPEC_PATHS[key])):
        # This runs for every pod: field paths are built only for unusual shapes.
        c = item if type(item) is dict else _mapping(item, f"spec.{key}[{i}]")
        name = str(c.get("name", ""))
        whole_gpus = _whole_gpus(c, f"spec.{key}[{i}]") if c.get("resources") else None
        views.append(_container(name, whole_gpus, init))
    return tuple(views)


_SPEC_PATHS = {"containers": "spec.containers", "initContainers": "spec.initContainers"}
_NO_STRINGS: Mapping[str, str] = MappingProxyType({})


def _str_map(value: Any, path: str) -> Mapping[str, str]:
    value = _mapping(value, path)
    if not value:
        return _NO_STRINGS  # immutable, so every pod without labels shares one
    for key, item in value.items():
        if type(key) is not str or type(item) is not str:
            break
    else:
        # The usual case: no conversion needed. A read-only map is kept as it is: whoever
        # passes one promises that the map under it does not change; any other is copied, so
        # the view never changes under its reader and the parse reads a dict (the mirror's
        # pod cache keeps compact maps of its own, which the copy turns into one).
        return value if type(value) is MappingProxyType else MappingProxyType(dict(value))
    for key, item in value.items():
        # The API server refuses anything but strings here (null reads as ""): a manifest
        # checked offline must not pass with a value converted for it. YAML reads an
        # unquoted 010240 as an octal number, 0.5 as a float, yes as true.
        if type(key) is not str or not (item is None or type(item) is str):
            raise ManifestError(f"{path}[{str(key)!r}]: must be a string, got {item!r} "
                                f"({type(item).__name__}); quote the value in YAML")
    return MappingProxyType({a: "" if b is None else b for a, b in value.items()})


def view_from_pod_spec(
    metadata: Mapping[str, Any], spec: Mapping[str, Any], *, kind: str = "Pod", namespace: str = ""
) -> PodView:
    """Raises ManifestError when a field has the wrong shape."""
    metadata = _mapping(metadata, "metadata")
    spec = _mapping(spec, "spec")
    return PodView(
        name=str(metadata.get("name") or metadata.get("generateName") or ""),
        namespace=str(metadata.get("namespace") or namespace or "default"),
        uid=str(metadata.get("uid") or ""),
        annotations=_str_map(metadata.get("annotations"), "metadata.annotations"),
        labels=_str_map(metadata.get("labels"), "metadata.labels"),
        containers=_containers(spec, "containers", init=False),
        init_containers=_containers(spec, "initContainers", init=True),
        node_name=str(spec.get("nodeName") or ""),
        kind=kind,
    )


_TEMPLATE_KINDS = frozenset({"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet",
                             "ReplicationController", "Job", "CronJob", "PodTemplate"})
"""Kinds whose one pod template sits where Kubernetes puts it (`_template`); any other kind's
templates are searched for (`_nested_templates`)."""

MAX_TEMPLATE_DEPTH = 16
"""How many levels below `spec` a pod template is searched for. The deepest a workload puts one
is JobSet's `spec.replicatedJobs[i].template.spec.template` (5); the bound keeps a deep,
hostile document from making the search slow."""

MAX_SEARCHED_VALUES = 1_000_000
"""How many mappings and lists below `spec` the search reads at most: more than an object the
API server stores can hold (etcd keeps 1.5 MiB), so only a hostile document meets it."""


def _template(obj: Mapping[str, Any]) -> tuple[Mapping[str, Any] | None, str]:
    """The pod template of a workload and its field path, or None for kinds without one."""
    if obj.get("kind") == "PodTemplate":
        return _mapping(obj.get("template"), "template") or None, "template"
    spec = _mapping(obj.get("spec"), "spec")
    path = "spec"
    if obj.get("kind") == "CronJob":
        job = _mapping(spec.get("jobTemplate"), "spec.jobTemplate")
        spec, path = _mapping(job.get("spec"), "spec.jobTemplate.spec"), "spec.jobTemplate.spec"
    if spec.get("template") is None:
        return None, ""
    return _mapping(spec.get("template"), f"{path}.template"), f"{path}.template"


def _is_template(value: Mapping[str, Any]) -> bool:
    """A pod template's shape: `spec.containers` is a list (its metadata may be absent)."""
    spec = value.get("spec")
    return isinstance(spec, Mapping) and type(spec.get("containers")) is list


def _nested_templates(spec: Any) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """(path, template) of every pod template below an object's `spec`, in document order: a
    mapping whose `spec.containers` is a list, however the kind nests it (Kubeflow's
    `spec.pytorchReplicaSpecs.Worker.template`, LeaderWorkerSet's
    `spec.leaderWorkerTemplate.workerTemplate`, Ray's `spec.workerGroupSpecs[0].template`, ...),
    which KAI's pod-grouper schedules. A template is not searched inside. Raises ManifestError
    past MAX_SEARCHED_VALUES."""
    seen: set[int] = set()
    stack = [("spec", spec, 0)] if isinstance(spec, Mapping) or type(spec) is list else []
    while stack:  # only mappings and lists are on it
        path, value, depth = stack.pop()
        if id(value) in seen:
            # A YAML alias of a value read already: each is read once, so aliases (a billion
            # laughs) cannot multiply the work.
            continue
        seen.add(id(value))
        if len(seen) > MAX_SEARCHED_VALUES:
            raise ManifestError(f"spec: more than {MAX_SEARCHED_VALUES:,} mappings and lists to "
                                "search for pod templates, more than an object Kubernetes "
                                "stores; split it")
        mapping = isinstance(value, Mapping)
        if mapping and _is_template(value):
            yield path, value
        elif depth < MAX_TEMPLATE_DEPTH:
            inner = [(key, item) for key, item in (value.items() if mapping else enumerate(value))
                     if isinstance(item, Mapping) or type(item) is list]
            # Reversed onto the stack, so the templates come in the order of the document.
            stack += [(f"{path}.{key}" if mapping else f"{path}[{key}]", item, depth + 1)
                      for key, item in reversed(inner)]


@dataclass(frozen=True, slots=True)
class PodSpecAt:
    """A pod (or pod template) of a manifest object: its view, its raw spec, and the field
    path of that spec in the object (`spec`, `spec.template.spec`, ...), for the checks that
    read more of a spec than the contract does (the validating webhook's, offline)."""

    view: PodView
    spec: Mapping[str, Any]
    path: str
    template: str = ""
    """The path of a template found by searching the object
    (`spec.pytorchReplicaSpecs.Worker.template`), which messages add to the object's name, as
    such an object may hold several; "" for a Pod and a kind of `_TEMPLATE_KINDS`."""
    owner_annotations: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """Annotations of the workload that no pod gets, by their field path, as written: its own
    `metadata.annotations`, and a CronJob's `spec.jobTemplate.metadata.annotations` (a
    GPU-sharing key there is a mistake: `misplaced_keys`); empty for a Pod."""


def _annotations(metadata: Mapping[str, Any]) -> Mapping[str, Any]:
    """`metadata.annotations` when it is a map (its shape is not ours to judge), else none."""
    found = metadata.get("annotations")
    return found if isinstance(found, Mapping) else _NO_STRINGS


def pod_specs(obj: Mapping[str, Any]) -> Iterator[PodSpecAt]:
    """Every pod (or pod template) in a manifest object; nothing for kinds without pods.
    Raises ManifestError naming the field when the object has the wrong shape."""
    if not isinstance(obj, Mapping):
        return  # not a Kubernetes object, so no pod
    kind = str(obj.get("kind") or "")
    metadata = _mapping(obj.get("metadata"), "metadata")
    if kind == "List":
        for item in _items(obj.get("items"), "items"):
            yield from pod_specs(item)
        return
    if kind == "Pod":
        spec = _mapping(obj.get("spec"), "spec")
        yield PodSpecAt(view_from_pod_spec(metadata, spec), spec, "spec")
        return
    if kind in _TEMPLATE_KINDS:
        template, path = _template(obj)
        found = [] if template is None else [(path, template)]
    else:
        found = _nested_templates(obj.get("spec"))
    owner = {"metadata.annotations": _annotations(metadata)}
    if kind == "CronJob":  # its Jobs get the job template's metadata, its pods neither
        spec_of = obj.get("spec")
        job = spec_of.get("jobTemplate") if isinstance(spec_of, Mapping) else None
        if isinstance(job, Mapping) and isinstance(job.get("metadata"), Mapping):
            owner["spec.jobTemplate.metadata.annotations"] = _annotations(job["metadata"])
    for path, template in found:
        try:
            # A template has no name of its own: messages name the workload.
            template_meta = {**_mapping(template.get("metadata"), "metadata"),
                             "name": metadata.get("name", "")}
            spec = _mapping(template.get("spec"), "spec")
            view = view_from_pod_spec(template_meta, spec, kind=kind or "Object",
                                      namespace=str(metadata.get("namespace") or ""))
        except ManifestError as e:
            raise ManifestError(f"{path}.{e}") from None
        yield PodSpecAt(view, spec, f"{path}.spec", "" if kind in _TEMPLATE_KINDS else path,
                        owner)


def pod_views(obj: Mapping[str, Any]) -> Iterator[PodView]:
    """The view of every pod (or pod template) in a manifest object (`pod_specs`)."""
    return (found.view for found in pod_specs(obj))
