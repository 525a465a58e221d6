"""kmock (tests.support.kube) as the live cluster of `helm install --dry-run=server`
(render.install_in_cluster): the chart's `lookup` calls reach it, so what a test puts there is
what a real install or upgrade would find. What kmock lacks for helm is added here: a Kubernetes
version the chart takes (kmock says 1.26), the core group's discovery under the groupVersion
`v1` (kmock writes `/v1`, and helm then maps no core kind), and the release namespace."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

from tests.support.kube import KubeServer

from .render import NAMESPACE


def live_cluster(kube: KubeServer, directory: Path, *, namespace: bool = True) -> Path:
    """Makes `kube` a cluster helm can install into (with the release namespace when
    `namespace`); returns its kubeconfig."""
    kube.emulator["get", "/version"] << {"major": "1", "minor": "31", "gitVersion": "v1.31.0"}
    with urllib.request.urlopen(f"{kube.url}/api/v1", timeout=10) as answer:
        core = json.loads(answer.read())
    kube.emulator["get", "/api/v1"] << {**core, "groupVersion": "v1"}
    if namespace:
        holds(kube, namespace_path(), {"apiVersion": "v1", "kind": "Namespace",
                                       "metadata": {"name": NAMESPACE}})
    return kube.write_kubeconfig(directory / "kubeconfig")


def namespace_path(name: str = NAMESPACE) -> str:
    return f"/api/v1/namespaces/{name}"


def holds(kube: KubeServer, path: str, obj: dict[str, Any]) -> None:
    """The cluster answers a GET of `path` (what `lookup` sends) with `obj`."""
    kube.emulator["get", path] << obj
