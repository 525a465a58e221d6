"""Where `inspect` reads from: the Kubernetes API (pods, node) and the node agent (its
NodeEnforcer unix socket, or its Prometheus endpoint). Every failure becomes a one-line reason:
the cluster's as `SourceError` (the command exits), the agent's as an unreachable `AgentState`
(the report degrades to "used: n/a" and says why)."""

from __future__ import annotations

import dataclasses
import http.client
import os
import urllib.error
import urllib.parse
import urllib.request
from types import MappingProxyType
from typing import Any

from .agent_state import (
    AgentAllocation,
    AgentCondition,
    AgentDevice,
    AgentPlan,
    AgentState,
    unreachable,
)

DEFAULT_AGENT_SOCKET = "/run/kai-fractions/agent.sock"
MEMORY_USED_METRIC = "kai_fractions_container_gpu_memory_used_bytes"
CAP_NOT_IN_FORCE_METRIC = "kai_fractions_container_cap_not_in_force"
AGENT_TIMEOUT = 3.0


class SourceError(Exception):
    """The cluster cannot be read; `not_found` tells a missing object from a broken link."""

    def __init__(self, message: str, *, not_found: bool = False):
        super().__init__(message)
        self.message = message
        self.not_found = not_found


# -- Kubernetes -------------------------------------------------------------------------------


class KubeReader:
    """Pods and nodes as plain dicts, through `kai_fractions.kube` (blocking). `close` ends
    its connections and its event loop thread."""

    def __init__(self, api_client: Any, timeout: float = 10.0):
        """Raises kube.config.ConfigError for settings that cannot work."""
        from ..kube.blocking import BlockingKube

        self.kube = BlockingKube(api_client, name="inspect-kube", request_timeout=timeout)

    def close(self) -> None:
        self.kube.close()

    def __enter__(self) -> KubeReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _get(self, what: str, path: str, query: dict[str, str] | None = None, *,
             missing_ok: bool = False) -> Any:
        from ..kube.errors import KubeError, NotFound

        try:
            return self.kube.request("GET", path, what=what, query=query)
        except NotFound:
            if missing_ok:
                return None
            raise SourceError(f"{what}: not found", not_found=True) from None
        except KubeError as e:
            if e.status is None:  # no answer: the connection failed or timed out
                raise SourceError(f"{what}: the Kubernetes API is not reachable: "
                                  f"{e.answer}") from None
            raise SourceError(e.message) from None

    def node(self, name: str) -> dict[str, Any] | None:
        from ..kube.objects import node_path

        return self._get(f"node {name}", node_path(name), missing_ok=True)

    def heartbeat_lease(self, namespace: str, node: str) -> tuple[dict[str, Any] | None, str]:
        """The node agent's heartbeat Lease (None: it has none) and its `NS/NAME`."""
        from ..kube.objects import heartbeat_lease_name, lease_path

        name = heartbeat_lease_name(node)
        if name is None:
            return None, ""
        ref = f"{namespace}/{name}"
        return self._get(f"lease {ref}", lease_path(namespace, name), missing_ok=True), ref

    def pods_on(self, node: str) -> list[dict[str, Any]]:
        from ..kube.objects import pods_path

        body = self._get(f"pods of node {node}", pods_path(),
                         {"fieldSelector": f"spec.nodeName={node}"})
        # Filtered here too: a server (or an emulator) that ignores the selector must not put
        # another node's pods in the report.
        return [p for p in (body or {}).get("items") or []
                if isinstance(p, dict) and (p.get("spec") or {}).get("nodeName") == node]

    def pod(self, namespace: str, name: str) -> dict[str, Any]:
        from ..kube.objects import pod_path

        return self._get(f"pod {namespace}/{name}", pod_path(namespace, name))

    def pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        """The pods of `namespace` that `selector` (a label selector) picks."""
        from ..kube.objects import pods_path

        body = self._get(f"pods {selector} in namespace {namespace}", pods_path(namespace),
                         {"labelSelector": selector})
        return [p for p in (body or {}).get("items") or [] if isinstance(p, dict)]

    def pod_proxy_text(self, namespace: str, name: str, port: int, path: str) -> str:
        """GET `path` of a pod's `port` through the API server's pod proxy: a pod the caller
        cannot reach itself, read wherever kubectl works (RBAC: get on pods/proxy)."""
        from ..kube.errors import KubeError
        from ..kube.objects import pod_path

        what = f"pod {namespace}/{name}:{port}{path} via the API server"
        # NAME:PORT as kubectl writes it (a ':' the API server would read percent-encoded too)
        target = f"{pod_path(namespace, name)}:{port}/proxy{path}"
        try:
            return self.kube.call(lambda kube: kube.read(
                "GET", target, what=what, headers={"Accept": "text/plain"})).decode(
                "utf-8", "replace")
        except KubeError as e:
            raise SourceError(e.message, not_found=e.status == 404) from None


def load_kube(kubeconfig: str | None, timeout: float = 10.0) -> KubeReader:
    """A KubeReader configured from `kubeconfig` when given, else in-cluster, else from
    $KUBECONFIG / ~/.kube/config; raises SourceError with the reason."""
    from ..kube.config import ConfigError, load_api_client

    try:
        return KubeReader(load_api_client(kubeconfig), timeout)
    except ConfigError as e:
        raise SourceError(str(e)) from None


# -- the node agent ---------------------------------------------------------------------------

_STATES = {0: "", 1: "pending", 2: "applied", 3: "refused"}


_MODES = {1: "time-slicing", 2: "sm-sharing"}


def _plan(a: Any) -> AgentPlan | None:
    """The plan of a ContainerAllocation; None when it carries none (no devices)."""
    if not a.devices:
        return None
    return AgentPlan(devices=tuple(a.devices), mode=_MODES.get(a.compute_sharing_mode, ""),
                     request_bytes=a.memory_request_bytes, limit_bytes=a.memory_limit_bytes,
                     active_thread_percentage=a.active_thread_percentage or None,
                     mps_namespace=a.mps_namespace)


def _mechanisms(a: Any) -> MappingProxyType[str, frozenset[str]]:
    found: dict[str, set[str]] = {}
    for limit in a.applied_limits:
        found.setdefault(limit.gpu_uuid, set()).add(limit.mechanism)
    return MappingProxyType({uuid: frozenset(names) for uuid, names in found.items()})


def _allocation(a: Any) -> AgentAllocation:
    return AgentAllocation(
        namespace=a.pod.namespace, pod=a.pod.name, container=a.container, uid=a.pod.uid,
        state=_STATES.get(a.state, ""), reason=a.reason, message=a.message,
        # A refused container is not accounted: its 0 means "not known".
        used_bytes=None if a.state == 3 else a.memory_used_bytes, plan=_plan(a),
        mechanisms=_mechanisms(a),
        change_reason=a.change_refused_reason, change_message=a.change_refused_message)


def from_node_state(reply: Any, source: str) -> AgentState:
    """AgentState from a NodeEnforcer GetNodeStateResponse."""
    allocations = tuple(_allocation(a) for a in reply.allocations)
    condition = None
    if reply.HasField("condition"):
        c = reply.condition
        condition = AgentCondition(c.type, c.ready, c.reason, c.message)
    return AgentState(
        source=source,
        devices=tuple(AgentDevice(d.index, d.uuid, d.name, d.memory_total_bytes, d.compute_mode)
                      for d in reply.devices),
        allocations=allocations, condition=condition, driver_version=reply.driver_version,
        memory_limits_supported=reply.memory_limits_supported)


def agent_from_socket(path: str, timeout: float = AGENT_TIMEOUT, node: str = "") -> AgentState:
    """The agent behind the socket, as unreachable when it is another `node`'s (the default
    socket is the agent of the node inspect runs on)."""
    import grpc

    from ..api.v1 import node_pb2, node_pb2_grpc

    target = path if path.startswith("unix:") else f"unix://{os.path.abspath(path)}"
    source = f"socket {target}"
    socket_path = target.removeprefix("unix://").removeprefix("unix:")
    if not os.path.exists(socket_path):
        return unreachable(source, f"no socket at {socket_path} (run inspect on the node, or "
                           "give --agent-metrics)")
    with grpc.insecure_channel(target) as channel:
        try:
            reply = node_pb2_grpc.NodeEnforcerStub(channel).GetNodeState(
                node_pb2.GetNodeStateRequest(), timeout=timeout)
        except grpc.RpcError as e:
            return unreachable(source, f"{e.code().name}: {e.details()}")
    if node and reply.node_name and reply.node_name != node:
        return unreachable(source, f"this socket is node {reply.node_name}'s agent, not "
                           f"{node}'s: run inspect on {node}, or give --agent-metrics")
    return from_node_state(reply, source)


def metrics_url(url: str) -> str:
    """`url` with http:// and /metrics added where it lacks them (`HOST:PORT` works)."""
    if "://" not in url:
        url = f"http://{url}"
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError as e:  # an unclosed [IPv6] bracket, say
        raise SourceError(f"{url}: not a URL: {e}") from None
    if parts.path in ("", "/"):
        parts = parts._replace(path="/metrics")
    return urllib.parse.urlunsplit(parts)


Key = tuple[str, str, str]
"""(namespace, pod, container) of a container's series."""


def _container_samples(text: str) -> list[tuple[Key, Any]]:
    """The samples of the agent's per-container families inspect reads, each with its
    container's key, from one parse of its Prometheus text (raises ValueError)."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = (MEMORY_USED_METRIC, CAP_NOT_IN_FORCE_METRIC)
    return [((s.labels.get("namespace", ""), s.labels.get("pod", ""),
              s.labels.get("container", "")), s)
            for family in text_string_to_metric_families(text)
            for s in family.samples if s.name in wanted]


def parse_usage(samples: list[tuple[Key, Any]]) -> dict[Key, dict[str, int]]:
    """(namespace, pod, container) -> {gpu uuid: bytes}."""
    out: dict[Key, dict[str, int]] = {}
    for key, sample in samples:
        if sample.name == MEMORY_USED_METRIC:
            out.setdefault(key, {})[sample.labels.get("gpu_uuid", "")] = int(sample.value)
    return out


def parse_caps(samples: list[tuple[Key, Any]]) -> dict[Key, tuple[str, str]]:
    """(namespace, pod, container) -> (pod uid, reason) of each container whose MPS cap the
    agent says is not in force (a series at 1)."""
    out: dict[Key, tuple[str, str]] = {}
    for key, sample in samples:
        if sample.name == CAP_NOT_IN_FORCE_METRIC and sample.value >= 1:
            found = (sample.labels.get("pod_uuid", ""), sample.labels.get("reason", ""))
            out[key] = min(out.get(key, found), found)  # one series per container: stable
    return out


CAP_MESSAGE = (
    "the node agent's metrics say an MPS cap this container relies on is not in force: its "
    "readiness marker is set aside (a gate of the pod waits), and a client of it that attached "
    "meanwhile may run uncapped, whatever its gate did before. The pod's MpsCapNotInForce "
    "event says why and what to do (on the node, --agent-socket gives the agent's own "
    "message)")
LIMIT_MESSAGE = (
    "the node agent's metrics say the GPU memory limit on this container's pod cgroup is not in "
    "force and could not be set: a gate of the pod waits (a running pod's readiness marker is "
    "set aside, and what of it runs meanwhile runs without the cap). A running pod's "
    "MemoryLimitNotInForce event says why; on the node, --agent-socket gives the agent's own "
    "message with NVML's error")
MEMORY_LIMIT_NOT_IN_FORCE = "MemoryLimitNotInForce"
"""kai_fractions.node.memory_limits' reason of that series (read from the metrics, as text)."""


def from_metrics_text(text: str, source: str) -> AgentState:
    """AgentState from the agent's Prometheus text: each container's usage per GPU, and the
    containers with a cap known not in force (`AgentAllocation.cap_not_in_force`: an MPS cap,
    or the pod cgroup's GPU memory limit).
    Raises ValueError for text that is not Prometheus's."""
    samples = _container_samples(text)
    usage, caps = parse_usage(samples), parse_caps(samples)
    allocations = []
    for key in sorted(usage.keys() | caps.keys()):
        namespace, pod, container = key
        by_gpu = usage.get(key)
        uid, reason = caps.get(key, ("", ""))
        allocations.append(AgentAllocation(
            namespace=namespace, pod=pod, container=container, uid=uid,
            reason=reason, message="" if key not in caps else (
                LIMIT_MESSAGE if reason == MEMORY_LIMIT_NOT_IN_FORCE else CAP_MESSAGE),
            cap_not_in_force=key in caps,
            used_bytes=sum(by_gpu.values()) if by_gpu is not None else None,
            used_by_gpu=MappingProxyType(dict(by_gpu or {}))))
    return AgentState(source=source, allocations=tuple(allocations))


def read_metrics(url: str, timeout: float = AGENT_TIMEOUT) -> str:
    """The text a Prometheus endpoint serves at `url`; raises SourceError with the reason."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as e:
        # HTTPException: a port that is not a number, or a server that does not speak HTTP
        reason = getattr(e, "reason", None) or e
        raise SourceError(f"{type(e).__name__}: {reason}") from None


def agent_from_metrics(url: str, timeout: float = AGENT_TIMEOUT) -> AgentState:
    try:
        target = metrics_url(url)
    except SourceError as e:
        return unreachable(f"metrics {url}", e.message)
    source = f"metrics {target}"
    try:
        text = read_metrics(target, timeout)
    except SourceError as e:
        return unreachable(source, e.message)
    try:
        return from_metrics_text(text, source)
    except ValueError as e:
        return unreachable(source, f"not Prometheus text: {e}")


def merged(socket: AgentState, metrics: AgentState) -> AgentState:
    """The socket's word with the metrics' per-GPU usage (the socket sums a container's GPUs)."""
    if not metrics.reachable:
        return socket
    by_gpu = {(a.namespace, a.pod, a.container): a.used_by_gpu for a in metrics.allocations}
    return dataclasses.replace(socket, source=f"{socket.source} + {metrics.source}",
                               allocations=tuple(
        dataclasses.replace(a, used_by_gpu=by_gpu.get((a.namespace, a.pod, a.container),
                                                      a.used_by_gpu))
        for a in socket.allocations))


def agent_state(socket: str | None, metrics: str | None, node: str = "") -> AgentState:
    """The socket when given (or present at the default path), with the metrics endpoint's
    per-GPU usage when given too; the metrics alone otherwise. `node`: the node inspected
    (an agent of another node is not taken for its)."""
    if socket:
        state = agent_from_socket(socket, node=node)
        if not metrics:
            return state
        if state.reachable:
            return merged(state, agent_from_metrics(metrics))
    if metrics:
        return agent_from_metrics(metrics)
    if os.path.exists(DEFAULT_AGENT_SOCKET):
        return agent_from_socket(DEFAULT_AGENT_SOCKET, node=node)
    return unreachable("none", "give --agent-socket PATH (on the node) or --agent-metrics URL")
