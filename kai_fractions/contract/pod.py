"""The slice of a pod the contract reads, built from a manifest (dict) of a Pod or a workload.

Pure data: no Kubernetes client here. `pod_views` accepts Pods and anything with a pod template
(Deployment, StatefulSet, DaemonSet, ReplicaSet, Job, CronJob, PodTemplate, ...), so the CLI and
the webhook give early feedback on workloads, before any pod exists.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from . import keys as k


@dataclass(frozen=True, slots=True)
class ContainerView:
    name: str
    whole_gpus: int = 0
    """`nvidia.com/gpu` from the container's limits (or requests); 0 when absent."""
    init: bool = False


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

    def container(self, name: str) -> ContainerView | None:
        return next((c for c in self.all_containers if c.name == name), None)

    @property
    def ref(self) -> str:
        """How messages name this object: `Deployment/ns/name` or `ns/name` for a pod."""
        base = f"{self.namespace}/{self.name}"
        return base if self.kind == "Pod" else f"{self.kind}/{base}"


def _whole_gpus(container: Mapping[str, Any]) -> int:
    resources = container.get("resources") or {}
    for section in ("limits", "requests"):
        value = (resources.get(section) or {}).get(k.WHOLE_GPU_RESOURCE)
        if value is not None:
            try:
                return int(str(value))
            except ValueError:
                return -1  # not a count; validation reports it
    return 0


def _containers(spec: Mapping[str, Any], key: str, init: bool) -> tuple[ContainerView, ...]:
    items = spec.get(key) or []
    return tuple(
        ContainerView(name=str(c.get("name", "")), whole_gpus=_whole_gpus(c), init=init)
        for c in items
        if isinstance(c, Mapping)
    )


def _str_map(value: Any) -> Mapping[str, str]:
    if not isinstance(value, Mapping):
        return MappingProxyType({})
    return MappingProxyType({str(a): "" if b is None else str(b) for a, b in value.items()})


def view_from_pod_spec(
    metadata: Mapping[str, Any], spec: Mapping[str, Any], *, kind: str = "Pod", namespace: str = ""
) -> PodView:
    return PodView(
        name=str(metadata.get("name") or metadata.get("generateName") or ""),
        namespace=str(metadata.get("namespace") or namespace or "default"),
        uid=str(metadata.get("uid") or ""),
        annotations=_str_map(metadata.get("annotations")),
        labels=_str_map(metadata.get("labels")),
        containers=_containers(spec, "containers", init=False),
        init_containers=_containers(spec, "initContainers", init=True),
        node_name=str(spec.get("nodeName") or ""),
        kind=kind,
    )


def _template_path(obj: Mapping[str, Any]) -> Mapping[str, Any] | None:
    spec = obj.get("spec") or {}
    if obj.get("kind") == "CronJob":
        spec = ((spec.get("jobTemplate") or {}).get("spec")) or {}
    if obj.get("kind") == "PodTemplate":
        return obj.get("template")
    template = spec.get("template")
    return template if isinstance(template, Mapping) else None


def pod_views(obj: Mapping[str, Any]) -> Iterator[PodView]:
    """Every pod (or pod template) in a manifest object; nothing for kinds without pods."""
    if not isinstance(obj, Mapping):
        return
    kind = str(obj.get("kind") or "")
    metadata = obj.get("metadata") or {}
    if kind == "List":
        for item in obj.get("items") or []:
            yield from pod_views(item)
        return
    if kind == "Pod":
        yield view_from_pod_spec(metadata, obj.get("spec") or {})
        return
    template = _template_path(obj)
    if template is None:
        return
    template_meta = dict(template.get("metadata") or {})
    # A template has no name of its own: messages name the workload.
    template_meta.setdefault("name", metadata.get("name", ""))
    template_meta["name"] = metadata.get("name", template_meta["name"])
    yield view_from_pod_spec(
        template_meta,
        template.get("spec") or {},
        kind=kind or "Object",
        namespace=str(metadata.get("namespace") or ""),
    )
