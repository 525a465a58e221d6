"""The demo's pods: every pod of the example manifests, and one manifest admission must refuse.

A workload (Deployment, Job, ...) becomes ONE pod built from its template, named
`<workload>-0`: the demo shows what each kind of request turns into, not replica counts.
Objects without pods (the KAI Queue) are skipped.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ..contract import keys as k

TEMPLATE_PATHS = {
    "Deployment": ("spec", "template"),
    "StatefulSet": ("spec", "template"),
    "DaemonSet": ("spec", "template"),
    "ReplicaSet": ("spec", "template"),
    "ReplicationController": ("spec", "template"),
    "Job": ("spec", "template"),
    "CronJob": ("spec", "jobTemplate", "spec", "template"),
}


class WorkloadError(ValueError):
    """A manifest cannot be read or names no pod the demo can create; the message names the
    file (and the field)."""


@dataclass(frozen=True, slots=True)
class DemoPod:
    source: str
    """Where it came from: `memory-request.yaml` or `inference-deployment.yaml (Deployment
    llm-inference)`."""
    manifest: Mapping[str, Any]

    @property
    def name(self) -> str:
        return str(self.manifest["metadata"]["name"])

    @property
    def namespace(self) -> str:
        return str(self.manifest["metadata"]["namespace"])


def _dig(obj: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    for part in path:
        if not isinstance(obj, Mapping):
            return None
        obj = obj.get(part)  # type: ignore[assignment]
    return obj


def _metadata(obj: Mapping[str, Any], kind: str) -> Mapping[str, Any]:
    """The object's metadata with a name the demo can create it by: the demo creates each pod
    once, by name, so `generateName` alone (what `kubectl create` completes) is not enough."""
    meta = obj.get("metadata")
    if not isinstance(meta, Mapping):
        raise WorkloadError(f"{kind}: metadata: must be a mapping with a name, got {meta!r}")
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        also = (f" (generateName {meta['generateName']!r} is not enough: the demo creates each "
                "pod by name)" if meta.get("generateName") else "")
        raise WorkloadError(f"{kind}: metadata.name: must be a non-empty string, got "
                            f"{name!r}{also}")
    ns = meta.get("namespace")
    if ns is not None and (not isinstance(ns, str) or not ns):
        raise WorkloadError(f"{kind}: metadata.namespace: must be a non-empty string, got "
                            f"{ns!r}")
    return meta


def pod_of(obj: Mapping[str, Any], namespace: str) -> tuple[dict[str, Any], str] | None:
    """(the pod, its kind note) an object stands for, or None for kinds without pods; raises
    WorkloadError (without the file's name) for one with no usable metadata."""
    kind = str(obj.get("kind") or "")
    if kind != "Pod" and kind not in TEMPLATE_PATHS:
        return None
    meta = _metadata(obj, kind)
    if kind == "Pod":
        pod = copy.deepcopy(dict(obj))
        pod["metadata"] = {**pod["metadata"], "namespace": meta.get("namespace") or namespace}
        return pod, ""
    path = TEMPLATE_PATHS.get(kind)
    template = _dig(obj, path) if path else None
    if not isinstance(template, Mapping):
        return None
    tmeta = copy.deepcopy(dict(template.get("metadata") or {}))
    tmeta["name"] = f"{meta.get('name')}-0"
    tmeta["namespace"] = meta.get("namespace") or namespace
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": tmeta,
           "spec": copy.deepcopy(dict(template.get("spec") or {}))}
    return pod, f"{kind} {meta.get('name')}"


def load_examples(directory: Path, namespace: str = "default") -> list[DemoPod]:
    """Every pod of the `*.yaml` files of `directory`, files in name order, documents in
    file order; raises WorkloadError."""
    if not directory.is_dir():
        raise WorkloadError(f"{directory}: no such directory (give one with `examples:` in "
                            "--config, or run from a checkout of kai_fractions)")
    out: list[DemoPod] = []
    for path in sorted(directory.glob("*.yaml")):
        try:
            docs = list(yaml.safe_load_all(path.read_text()))
        except (OSError, yaml.YAMLError) as e:
            raise WorkloadError(f"{path}: {' '.join(str(e).split())}") from None
        for n, doc in enumerate(docs, 1):
            if not isinstance(doc, Mapping):
                continue
            try:
                found = pod_of(doc, namespace)
            except WorkloadError as e:
                where = f" (document {n})" if len(docs) > 1 else ""
                raise WorkloadError(f"{path}{where}: {e}") from None
            if found is None:
                continue
            pod, note = found
            source = f"{path.name} ({note})" if note else path.name
            out.append(DemoPod(source, pod))
    if not out:
        raise WorkloadError(f"{directory}: no pods or workloads in its *.yaml files")
    names = [(p.namespace, p.name) for p in out]
    duplicates = sorted({f"{ns}/{n}" for ns, n in names if names.count((ns, n)) > 1})
    if duplicates:
        raise WorkloadError(f"{directory}: more than one pod named {', '.join(duplicates)}")
    return out


def forged_gpu_pod(namespace: str, gpu_uuid: str) -> dict[str, Any]:
    """A user who picks their own GPU: `.gpus.devices` is the binder's key (protected), so
    admission refuses the pod, whatever else it asks for."""
    keys = k.DEFAULT_KEYS
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "pick-my-own-gpu", "namespace": namespace, "annotations": {
            keys.container("app", k.MEMORY_REQUEST): "8Gi",
            keys.container("app", k.DEVICES): gpu_uuid,
        }},
        "spec": {"schedulerName": k.KAI_SCHEDULER_NAME, "containers": [
            {"name": "app", "image": "nvcr.io/nvidia/pytorch:24.08-py3"}]},
    }
