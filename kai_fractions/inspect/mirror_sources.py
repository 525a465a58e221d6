"""Where `inspect mirror` reads the replicas' /metrics: the URLs it is given, or the mirror's
pods found through the Kubernetes API and read through the API server's pod proxy, so that it
works wherever kubectl does (no port-forward, no route to the pods). Each replica that cannot
be read becomes an unreadable `Replica` with its reason and what to try instead."""

from __future__ import annotations

import time
from typing import Any

from .mirror_state import Replica, replica_from_metrics, unreadable
from .sources import KubeReader, SourceError, metrics_url, read_metrics

DEFAULT_NAMESPACE = "kai-fractions"
DEFAULT_SELECTOR = "app.kubernetes.io/name=kai-fractions,app.kubernetes.io/component=mirror"
"""The chart's labels of the mirror's pods."""
METRICS_PORT = "metrics"
"""The name of the container port the chart gives `--metrics-listen`."""


def replica_from_url(url: str, now: float | None = None) -> Replica:
    try:
        target = metrics_url(url)
    except SourceError as e:
        return unreadable(url, url, e.message)
    try:
        text = read_metrics(target)
        return replica_from_metrics(url, target, text, time.time() if now is None else now)
    except SourceError as e:
        return unreadable(url, target, e.message)
    except ValueError as e:
        return unreadable(url, target, f"not a mirror's metrics: {e}")


def _labels_match(pod: dict[str, Any], selector: str) -> bool:
    """The selector's equality terms, checked here too: a server (or an emulator) that ignores
    the selector must not put another component's pods in the report."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    for term in filter(None, (t.strip() for t in selector.split(","))):
        key, eq, value = term.replace("==", "=").partition("=")
        if eq and not key.endswith("!") and labels.get(key.strip()) != value.strip():
            return False
    return True


def metrics_port(pod: dict[str, Any]) -> int | None:
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == METRICS_PORT and isinstance(port.get("containerPort"), int):
                return port["containerPort"]
    return None


def _replica_of(reader: KubeReader, pod: dict[str, Any], now: float) -> Replica:
    meta = pod.get("metadata") or {}
    namespace, name = meta.get("namespace", ""), meta.get("name", "")
    phase = (pod.get("status") or {}).get("phase") or "Unknown"
    port = metrics_port(pod)
    if port is None:
        return unreadable(name, f"pod {namespace}/{name}", "no container port named "
                          f"{METRICS_PORT!r}: this mirror serves no metrics (--metrics-listen; "
                          "the chart's mirror.metricsPort)")
    source = f"pod {namespace}/{name}:{port} via the API server"
    if phase != "Running":
        return unreadable(name, source, f"the pod is {phase}, not Running")
    try:
        text = reader.pod_proxy_text(namespace, name, port, "/metrics")
    except SourceError as e:
        return unreadable(name, source, f"{e.message} (reading through the API server needs "
                          f"get on pods/proxy in {namespace}, and the API server's way to "
                          f"the pod; else: kubectl -n {namespace} port-forward pod/{name} "
                          f"{port}, then inspect mirror http://127.0.0.1:{port})")
    try:
        return replica_from_metrics(name, source, text, now)
    except ValueError as e:
        return unreadable(name, source, f"not a mirror's metrics: {e}")


def replicas_in_cluster(reader: KubeReader, namespace: str, selector: str,
                        now: float | None = None) -> list[Replica]:
    """Every mirror pod `selector` picks in `namespace`, by name; raises SourceError when the
    pods cannot be listed."""
    pods = [p for p in reader.pods(namespace, selector) if _labels_match(p, selector)]
    pods.sort(key=lambda p: (p.get("metadata") or {}).get("name", ""))
    at = time.time() if now is None else now
    return [_replica_of(reader, pod, at) for pod in pods]
