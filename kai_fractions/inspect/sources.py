"""Where `inspect` reads from: the Kubernetes API (pods, node) and the node agent (its
NodeEnforcer unix socket, or its Prometheus endpoint). Every failure becomes a one-line reason:
the cluster's as `SourceError` (the command exits), the agent's as an unreachable `AgentState`
(the report degrades to "used: n/a" and says why)."""

from __future__ import annotations

import dataclasses
import http.client
import os
import re
import urllib.error
import urllib.parse
import urllib.request
from types import MappingProxyType
from typing import Any

from .agent_metrics import (  # noqa: F401  (re-exported: the metrics' reading lives there)
    CAP_MESSAGE,
    CAP_NOT_IN_FORCE_METRIC,
    LIMIT_MESSAGE,
    MEMORY_USED_METRIC,
    from_metrics_text,
)
from .agent_state import (
    AgentAllocation,
    AgentCondition,
    AgentDevice,
    AgentPlan,
    AgentState,
    unreachable,
)

DEFAULT_AGENT_SOCKET = "/run/kai-fractions/agent.sock"
AGENT_TIMEOUT = 3.0


class SourceError(Exception):
    """The cluster cannot be read; `not_found` tells a missing object from a broken link,
    `status` is the API server's HTTP status when it answered (403: not allowed)."""

    def __init__(self, message: str, *, not_found: bool = False, status: int | None = None):
        super().__init__(message)
        self.message = message
        self.not_found = not_found
        self.status = status


def refusal(what: str, e: Any) -> str:
    """A KubeError as this CLI's user reads it: a 401 is the credentials (authentication), a
    403 the identity's RBAC; the API server's own words either way. (kube.errors' own text
    addresses a component's service account.)"""
    if e.status == 401:
        return (f"{what}: the API server did not accept the credentials ({e.detail}): "
                "authentication failed; check the kubeconfig's user (its token, client "
                "certificate or exec plugin)")
    if e.status == 403:
        return f"{what}: the API server refused this identity ({e.detail}): RBAC does not allow it"
    return e.message


# -- Kubernetes -------------------------------------------------------------------------------


class KubeReader:
    """Pods and nodes as plain dicts, through `kai_fractions.kube` (blocking). `close` ends
    its connections and its event loop thread."""

    def __init__(self, api_client: Any, timeout: float = 10.0):
        """Raises kube.config.ConfigError for settings that cannot work."""
        from ..kube.blocking import BlockingKube
        from ..kube.config import default_namespace

        self.kube = BlockingKube(api_client, name="inspect-kube", request_timeout=timeout)
        self.default_namespace = default_namespace(api_client)
        """The namespace the configuration names (the kubeconfig context's, or in a pod its
        own), as kubectl's default for -n; None when it names none."""

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
            raise SourceError(refusal(what, e), status=e.status) from None

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

    def pod_events(self, namespace: str, name: str, uid: str) -> list[dict[str, Any]]:
        """The Events about the pod `uid` (`namespace`/`name`)."""
        from ..kube.objects import events_path

        body = self._get(f"events of pod {namespace}/{name}", events_path(namespace),
                         {"fieldSelector": f"involvedObject.uid={uid}"})
        # Filtered here too, as pods_on's: a server that ignores the selector.
        return [e for e in (body or {}).get("items") or [] if isinstance(e, dict)
                and (e.get("involvedObject") or {}).get("uid") == uid]

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
            raise SourceError(refusal(what, e), not_found=e.status == 404,
                              status=e.status) from None


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


_USAGE_UNKNOWN = re.compile(r"usage unknown on ((?:GPU \S+ \([^()]*\)(?:, )?)+):")
_UNKNOWN_GPU = re.compile(r"GPU (\S+) \(([^()]*)\)")


def usage_unknown(message: str) -> dict[str, str]:
    """GPU uuid -> reason of the GPUs a ContainerAllocation's message says its usage is not
    known on (the agent's `grpc_service.usage_unknown_note`: memory_used_bytes counts 0
    there)."""
    m = _USAGE_UNKNOWN.search(message)
    return dict(_UNKNOWN_GPU.findall(m.group(1))) if m else {}


def _allocation(a: Any) -> AgentAllocation:
    unknown = usage_unknown(a.message)
    return AgentAllocation(
        namespace=a.pod.namespace, pod=a.pod.name, container=a.container, uid=a.pod.uid,
        state=_STATES.get(a.state, ""), reason=a.reason, message=a.message,
        # A refused container is not accounted: its 0 means "not known"; nor is a sum over a
        # GPU whose usage the agent cannot read.
        used_bytes=None if a.state == 3 or unknown else a.memory_used_bytes, plan=_plan(a),
        mechanisms=_mechanisms(a), usage_unknown=MappingProxyType(unknown),
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


def read_metrics(url: str, timeout: float = AGENT_TIMEOUT) -> str:
    """The text a Prometheus endpoint serves at `url`; raises SourceError with the reason."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as e:
        # HTTPException: a port that is not a number, or a server that does not speak HTTP
        reason = getattr(e, "reason", None) or e
        raise SourceError(f"{type(e).__name__}: {reason}") from None


def agent_from_metrics(url: str, timeout: float = AGENT_TIMEOUT, node: str = "") -> AgentState:
    """The agent behind a metrics endpoint; unreachable when it is not `node`'s agent (another
    node's, or no agent's: the mirror's metrics, say)."""
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
        return from_metrics_text(text, source, node)
    except ValueError as e:
        return unreachable(source, f"not Prometheus text: {e}")


def merged(socket: AgentState, metrics: AgentState) -> AgentState:
    """The socket's word with the metrics' per-GPU usage (the socket sums a container's GPUs)."""
    if not metrics.reachable:
        return socket
    by_gpu = {(a.namespace, a.pod, a.container): a for a in metrics.allocations}

    def more(a: AgentAllocation) -> AgentAllocation:
        m = by_gpu.get((a.namespace, a.pod, a.container))
        if m is None:
            return a
        return dataclasses.replace(a, used_by_gpu=m.used_by_gpu, usage_unknown=MappingProxyType(
            {**m.usage_unknown, **a.usage_unknown}))

    return dataclasses.replace(socket, source=f"{socket.source} + {metrics.source}",
                               allocations=tuple(more(a) for a in socket.allocations))


def agent_state(socket: str | None, metrics: str | None, node: str = "") -> AgentState:
    """The socket when given (or present at the default path), with the metrics endpoint's
    per-GPU usage when given too; the metrics alone otherwise. `node`: the node inspected
    (an agent of another node is not taken for its)."""
    if socket:
        state = agent_from_socket(socket, node=node)
        if not metrics:
            return state
        if state.reachable:
            read = agent_from_metrics(metrics, node=node)
            if read.reachable:
                return merged(state, read)
            return dataclasses.replace(state, notes=(
                *state.notes, f"--agent-metrics not used ({read.source}: {read.error})"))
    if metrics:
        return agent_from_metrics(metrics, node=node)
    if os.path.exists(DEFAULT_AGENT_SOCKET):
        return agent_from_socket(DEFAULT_AGENT_SOCKET, node=node)
    return unreachable("none", "give --agent-socket PATH (on the node) or --agent-metrics URL")
