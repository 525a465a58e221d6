"""`kai_fractions.v1.NodeEnforcer` on a root-only unix socket.

The socket is created with mode 0600 (the umask is narrowed around the bind, then the mode is
set explicitly), owned by the agent's user (root on a node): only root on the host can call it.
Every call is also checked against its caller's credentials (`peer_guard`: SO_PEERCRED): only
the allowed uids may call at all, and a process in a pod's cgroup (a root container that reached
the socket) may read the node's state but not change any limit. `GetNodeState` answers from the
last pass's snapshot without touching the GPUs; `Provision`, `Release` and `Drain` run on the
agent's worker like any other GPU work. Requests are decoded by the servicer's registration
(`grpc_decode`): one that does not decode (a string field that is not UTF-8, a truncated
message) is INVALID_ARGUMENT naming `request`, after the caller check, not gRPC's trace.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent import futures
from typing import Any

import grpc

from ...api.v1 import allocation_pb2, node_pb2, node_pb2_grpc
from ...contract import ComputeMode
from ...contract.errors import shown
from ...contract.keys import is_container_name
from ...contract.names import pod_ref_problems
from ...grpc_decode import Undecodable, add_service
from ..cgroups import is_pod_uid
from ..config import Mechanism
from ..desired import ComputeEnforcement, ContainerDesired, ContainerKey, Refusal
from ..engine import ContainerResult, ContainerState
from ..errors import NodeError
from ..nvml import GpuComputeMode
from ..plan_refusals import hard_tiers_of
from .condition import Condition
from .mps_links import LEGACY_MPS_NOTE
from .peer_guard import PeerPolicy, PeerTable, Relay, private_dir
from .pods import ContainerNotFound, KnownPod
from .reconciler import NodeView, NotReconciled, Reconciler
from .usage import USAGE_UNKNOWN, usage_unknown
from .worker import Worker, WorkerBusy, WorkerStopped

log = logging.getLogger(__name__)

SOCKET_MODE = 0o600

_STATES = {
    ContainerState.APPLIED: node_pb2.ALLOCATION_STATE_APPLIED,
    ContainerState.PENDING: node_pb2.ALLOCATION_STATE_PENDING,
    ContainerState.REFUSED: node_pb2.ALLOCATION_STATE_REFUSED,
}
_COMPUTE_MODES = {
    GpuComputeMode.DEFAULT: "Default",
    GpuComputeMode.EXCLUSIVE_THREAD: "ExclusiveThread",
    GpuComputeMode.PROHIBITED: "Prohibited",
    GpuComputeMode.EXCLUSIVE_PROCESS: "ExclusiveProcess",
}
_SHARING = {
    ComputeMode.TIME_SLICING: allocation_pb2.COMPUTE_SHARING_MODE_TIME_SLICING,
    ComputeMode.SM_SHARING: allocation_pb2.COMPUTE_SHARING_MODE_SM_SHARING,
}


def _limits(c: ContainerDesired, result: ContainerResult | None, watchdog_stops: bool
            ) -> list[node_pb2.AppliedLimit]:
    """The limits in force: a watchdog that only reports (`NodeView.watchdog_stops` False)
    stops nothing, so it is none (the proto: "a process over the hard limit is stopped"), nor
    is a pinned limit the container's tenants can change (`hard_tiers_of`: no MPS
    namespaces; `LEGACY_MPS_NOTE` says so)."""
    if result is None or result.state is not ContainerState.APPLIED:
        return []
    out = [node_pb2.AppliedLimit(gpu_uuid=t.gpu_uuid, cgroup_path=t.path,
                                 soft_limit_bytes=t.soft, hard_limit_bytes=t.hard,
                                 mechanism=Mechanism.CGROUP.value) for t in result.limits]
    for mechanism in (Mechanism.MPS_PINNED, Mechanism.WATCHDOG):
        if mechanism is Mechanism.WATCHDOG and not watchdog_stops:
            continue
        if mechanism is Mechanism.MPS_PINNED and mechanism not in hard_tiers_of(
                c.mechanisms, c.compute):  # set, but its tenants can change it
            continue
        if mechanism in c.mechanisms:
            out += [node_pb2.AppliedLimit(gpu_uuid=uuid, hard_limit_bytes=c.plan.limit_bytes,
                                          mechanism=mechanism.value)
                    for uuid in c.plan.device_uuids]
    return out


def usage_unknown_note(gpus: Iterable[tuple[str, str]]) -> str:
    """The note of a container on GPUs (uuid, reason) whose usage the last watchdog check could
    not read (`NodeView.usage_unknown`): its memory_used_bytes counts 0 there, which is not its
    use. It begins as `usage.usage_unknown` writes it, which `kai-fractions inspect` reads."""
    return (f"{usage_unknown(gpus)}: the watchdog cannot read it there (memory_used_bytes "
            "leaves it out; the agent's log says why)")


def allocation(view: NodeView, key: ContainerKey) -> node_pb2.ContainerAllocation:
    desired = view.desired
    c = desired.container(key) if desired is not None else None
    refusal: Refusal | None = desired.refusal(key) if desired is not None else None
    result = view.results.get(key)
    known: KnownPod | None = view.pods.get(key.pod_uid)
    namespace = c.pod_namespace if c else refusal.pod_namespace if refusal else \
        known.namespace if known else ""
    name = c.pod_name if c else refusal.pod_name if refusal else known.name if known else ""
    out = node_pb2.ContainerAllocation(
        pod=allocation_pb2.PodRef(namespace=namespace, name=name, uid=key.pod_uid),
        container=key.container,
        state=_STATES[result.state] if result else node_pb2.ALLOCATION_STATE_UNSPECIFIED,
        reason=(result.reason or "") if result else "",
        message=(result.message or "") if result else "",
    )
    if c is not None:
        plan = c.plan
        out.devices.extend(plan.device_uuids)
        out.compute_sharing_mode = _SHARING[plan.compute_mode]
        out.memory_request_bytes = plan.request_bytes
        out.memory_limit_bytes = plan.limit_bytes
        out.active_thread_percentage = plan.active_thread_percentage or 0
        out.plan_digest = plan.digest
        out.mps_namespace = plan.mps_namespace or ""
        out.applied_limits.extend(_limits(c, result, view.watchdog_stops))
        out.memory_used_bytes = sum(u.used_bytes for (k, _uuid), u in view.usage.items()
                                    if k == key)
        if (c.compute is ComputeEnforcement.MPS_CLIENT_ENV and result is not None
                and result.state is ContainerState.APPLIED and not out.message):
            out.message = LEGACY_MPS_NOTE
        unknown = [(u, view.usage_unknown[u]) for u in plan.device_uuids
                   if u in view.usage_unknown]
        if unknown and result is not None and USAGE_UNKNOWN not in out.message:
            # (a container pending WatchdogBlind has it in its message already)
            out.message = "; ".join(filter(None, (out.message, usage_unknown_note(unknown))))
        if refusal is not None:  # held: the plan above stays, the annotations' new one is not
            out.change_refused_reason = refusal.reason.value
            out.change_refused_message = refusal.message
    elif refusal is not None and refusal.watched is not None:
        # Refused while it runs, its use still measured (`Refusal.watched`): what it uses.
        out.memory_used_bytes = sum(u.used_bytes for (k, _uuid), u in view.usage.items()
                                    if k == key)
    return out


def node_state(view: NodeView, node_name: str, condition: Condition | None,
               condition_type: str) -> node_pb2.GetNodeStateResponse:
    inv = view.inventory
    out = node_pb2.GetNodeStateResponse(node_name=node_name)
    if inv is not None:
        out.driver_version = inv.driver_version
        out.memory_limits_supported = inv.capabilities.memory_limits
        out.devices.extend(node_pb2.Device(
            index=d.index, uuid=d.uuid, name=d.name, memory_total_bytes=d.memory_total,
            compute_mode=_COMPUTE_MODES.get(d.compute_mode, str(int(d.compute_mode))),
            mig_enabled=d.mig_enabled) for d in inv.devices)
    for key in sorted(view.results):
        out.allocations.append(allocation(view, key))
    if condition is not None:
        out.condition.CopyFrom(node_pb2.NodeCondition(
            type=condition_type, ready=condition.ready, reason=condition.reason,
            message=condition.message))
    else:
        out.condition.CopyFrom(node_pb2.NodeCondition(type=condition_type, ready=False,
                                                      reason="NotReconciling",
                                                      message="starting"))
    return out


def _decoded(context: grpc.ServicerContext, request: object) -> None:
    """The call ends with INVALID_ARGUMENT naming `request` and the rule when its bytes did not
    decode (`grpc_decode.Undecodable`)."""
    if isinstance(request, Undecodable):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(request))


def _valid_uid(context: grpc.ServicerContext, uid: str) -> str:
    """`uid`, or the call ends with INVALID_ARGUMENT before anything is stored or written: it
    names the pod's cgroup and marker directory. A uid no cgroup can be named by would be kept
    provisioned, with a marker, yet never limited. The cgroup code's rule takes either case
    (it reads what the kubelet wrote), but the API server writes a uid in lower case and the
    kubelet names the cgroup, and the gate its marker directory, by it as it is: an upper-case
    twin would be kept provisioned yet never limited, or counted beside the lower-case one."""
    if uid != uid.lower() or not is_pod_uid(uid):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                      f"pod.uid: must be the pod's metadata.uid, a lower-case UUID (8-4-4-4-12 "
                      f"hexadecimal digits, as the API server writes it), got {shown(uid)}: it "
                      "names the pod's cgroup and marker directory")
    return uid


def _valid_names(context: grpc.ServicerContext, pod: allocation_pb2.PodRef) -> None:
    """The call ends with INVALID_ARGUMENT unless the namespace and name given are ones
    Kubernetes could have: they are logged and echoed in answers, which gRPC caps at 16 KiB.
    (The uid has a rule of its own: `_valid_uid`.)"""
    problems = pod_ref_problems(pod.namespace, pod.name, "")
    if problems:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(problems[0]))


def _valid_containers(context: grpc.ServicerContext, containers: list[str],
                      init_containers: list[str]) -> None:
    """Container names as a pod has them: DNS labels, each once across both lists."""
    seen: set[str] = set()
    for field, names in (("containers", containers), ("init_containers", init_containers)):
        for i, name in enumerate(names):
            if not is_container_name(name):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"{field}[{i}]: must be a container name (a DNS label: lowercase "
                              f"letters, digits and '-', at most 63), got {shown(name)}")
            if name in seen:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"{field}[{i}]: {name!r} is named twice; a pod's containers "
                              "and init containers have names of their own")
            seen.add(name)


def _valid_container(context: grpc.ServicerContext, uid: str, container: str,
                     pods: Mapping[str, KnownPod]) -> str | None:
    """Release's and Drain's `container`: None for "every container of the pod", else the
    name; the call ends before anything is kept or changed with INVALID_ARGUMENT for a name
    no container has, and NOT_FOUND for one that is not a fractional container of the pod
    the agent knows. (A pod gone from the node, or not seen yet, is taken by any valid name:
    a release of it must not wait for a pass.)"""
    if not container:
        return None
    if not is_container_name(container):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                      "container: must be a container name (a DNS label: lowercase letters, "
                      f"digits and '-', at most 63), got {shown(container)}")
    known = pods.get(uid)
    if known is not None and container not in known.containers:
        context.abort(grpc.StatusCode.NOT_FOUND, str(ContainerNotFound(uid, known, container)))
    return container


class NodeEnforcerServicer(node_pb2_grpc.NodeEnforcerServicer):
    def __init__(self, reconciler: Reconciler, worker: Worker, node_name: str,
                 condition: Callable[[], Condition | None], condition_type: str):
        self.reconciler = reconciler
        self.worker = worker
        self.node_name = node_name
        self.condition = condition
        self.condition_type = condition_type
        self.peers: PeerTable | None = None
        self.policy: PeerPolicy | None = None
        """Set by `serve_unix`: the caller of each call, and what it may do."""

    def _authorize(self, context: grpc.ServicerContext, method: str, *, changes: bool) -> None:
        if self.peers is None or self.policy is None:
            return  # called in-process, not through the socket
        peer = self.peers.lookup(context.peer())
        if peer is None:
            context.abort(grpc.StatusCode.PERMISSION_DENIED,
                          f"{method}: the caller's credentials are unknown; only "
                          f"{self.policy.who_may_call()} may call the node agent")
        refusal = self.policy.refusal(peer, method, changes=changes)
        if refusal is not None:
            log.warning("NodeEnforcer: refused pid %d uid %d: %s", peer.pid, peer.uid, refusal)
            context.abort(grpc.StatusCode.PERMISSION_DENIED, refusal)

    def _run(self, context: grpc.ServicerContext, fn: Callable[[], Any]) -> Any:
        try:
            return self.worker.call(fn)
        except (WorkerBusy, WorkerStopped) as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except ContainerNotFound as e:  # the pod's containers changed since the check
            context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        except NotReconciled as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"{e.reason}: {e.message}")
        except NodeError as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{e.reason}: {e.message}")
        except Exception as e:  # a bug: a status with a sentence, the trace in the agent's log
            log.exception("NodeEnforcer call failed")
            context.abort(grpc.StatusCode.INTERNAL,
                          f"the node agent failed: {type(e).__name__}: {e}; see its log")

    @staticmethod
    def _uid(context: grpc.ServicerContext, pod: allocation_pb2.PodRef,
             pods: Mapping[str, KnownPod]) -> str:
        """The pod's uid: `pod.uid`, or the one pod on this node of `pod.namespace`/`name`."""
        _valid_names(context, pod)
        if not pod.uid and not (pod.namespace and pod.name):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          "pod: give pod.uid, or pod.namespace and pod.name")
        found = sorted(uid for uid, k in pods.items()
                       if (k.namespace, k.name) == (pod.namespace, pod.name))
        if pod.uid:
            uid = _valid_uid(context, pod.uid)
            if found and uid not in found:  # (a pod gone from the node is released by uid)
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"pod: uid {uid} is not the uid of pod {pod.namespace}/{pod.name} "
                              f"on this node ({', '.join(found)}); give the uid alone, or the "
                              "pod's own")
            return uid
        if not found:
            context.abort(grpc.StatusCode.NOT_FOUND,
                          f"no pod {pod.namespace}/{pod.name} on this node; give pod.uid")
        if len(found) > 1:  # a pod deleted and created again under its name, both still here
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"{len(found)} pods named {pod.namespace}/{pod.name} on this node "
                          f"(uids {', '.join(found)}); give pod.uid")
        return found[0]

    def GetNodeState(self, request: node_pb2.GetNodeStateRequest | Undecodable,
                     context: grpc.ServicerContext) -> node_pb2.GetNodeStateResponse:
        self._authorize(context, "GetNodeState", changes=False)
        _decoded(context, request)
        return node_state(self.reconciler.view, self.node_name, self.condition(),
                          self.condition_type)

    def Provision(self, request: node_pb2.ProvisionRequest | Undecodable,
                  context: grpc.ServicerContext) -> node_pb2.ProvisionResponse:
        self._authorize(context, "Provision", changes=True)
        _decoded(context, request)
        pod = request.pod
        missing = [f for f, v in (("pod.uid", pod.uid), ("pod.namespace", pod.namespace),
                                  ("pod.name", pod.name), ("containers", request.containers))
                   if not v]
        if missing:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"Provision needs {', '.join(missing)} (the uid names the pod's "
                          "cgroup and MPS namespace)")
        _valid_uid(context, pod.uid)
        _valid_names(context, pod)
        _valid_containers(context, list(request.containers), list(request.init_containers))
        keys = self._run(context, lambda: self.reconciler.provision(
            pod.namespace, pod.name, pod.uid, dict(request.annotations),
            list(request.containers), list(request.init_containers)))
        view = self.reconciler.view
        return node_pb2.ProvisionResponse(allocations=[allocation(view, k) for k in keys])

    def Release(self, request: node_pb2.ReleaseRequest | Undecodable,
                context: grpc.ServicerContext) -> node_pb2.ReleaseResponse:
        self._authorize(context, "Release", changes=True)
        _decoded(context, request)
        pods = self.reconciler.view.pods
        uid = self._uid(context, request.pod, pods)
        container = _valid_container(context, uid, request.container, pods)
        names = self._run(context, lambda: self.reconciler.release(uid, container))
        return node_pb2.ReleaseResponse(released_containers=names)

    def Drain(self, request: node_pb2.DrainRequest | Undecodable,
              context: grpc.ServicerContext) -> node_pb2.DrainResponse:
        self._authorize(context, "Drain", changes=True)
        _decoded(context, request)
        pods = self.reconciler.view.pods
        uid = self._uid(context, request.pod, pods)
        container = _valid_container(context, uid, request.container, pods)
        pids = self._run(context, lambda: self.reconciler.drain(uid, container))
        return node_pb2.DrainResponse(drained_pids=pids)


class SocketError(Exception):
    """The socket cannot be served (the message says why)."""


class EnforcerServer:
    """The gRPC server behind its relay; `stop` ends both and removes the private directory."""

    def __init__(self, server: grpc.Server, relay: Relay) -> None:
        self.server, self.relay = server, relay

    def stop(self, grace: float | None) -> threading.Event:
        self.relay.close()
        self.server.stop(grace).wait()
        done = threading.Event()
        done.set()
        return done


def serve_unix(servicer: NodeEnforcerServicer, path: str, *,
               allowed_uids: Iterable[int] | None = None, max_workers: int = 4
               ) -> EnforcerServer:
    """Serves on `path` with mode 0600 (0666 when `allowed_uids` names other users: each call
    is checked against its caller's credentials either way). Call before other threads start:
    the umask is process-wide."""
    policy = PeerPolicy(servicer.reconciler.procfs, allowed_uids)
    parent = os.path.dirname(path) or "/"
    try:
        os.makedirs(parent, mode=0o755, exist_ok=True)
    except OSError as e:  # a file where the directory should be, a read-only file system
        raise SocketError(f"--socket {path}: cannot create its directory {parent}: "
                          f"{e.strerror or e}") from None
    try:
        st: os.stat_result | None = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISSOCK(st.st_mode):
        raise SocketError(f"--socket {path}: exists and is not a socket; remove it")
    try:
        if st is not None:
            os.unlink(path)  # a previous agent's socket
        directory = private_dir(path)  # 0700: only the agent's user reaches the gRPC server
    except OSError as e:
        raise SocketError(f"--socket {path}: cannot listen: {e.strerror or e}") from None
    upstream = os.path.join(directory, "grpc.sock")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers,
                                                    thread_name_prefix="node-enforcer"))
    # The servicer decodes, so that a request that does not decode is its refusal.
    add_service(server, servicer, node_pb2.DESCRIPTOR.services_by_name["NodeEnforcer"])
    try:
        bound = server.add_insecure_port(f"unix:{upstream}")
    except RuntimeError as e:
        raise SocketError(f"--socket {path}: cannot listen: {e}") from None
    if not bound:
        raise SocketError(f"--socket {path}: cannot listen")
    server.start()
    servicer.peers, servicer.policy = PeerTable(), policy
    others = policy.allowed_uids - {0, os.geteuid()}
    try:
        relay = Relay(path, upstream, directory, servicer.peers,
                      0o666 if others else SOCKET_MODE, policy.procfs)
    except OSError as e:
        server.stop(None)
        raise SocketError(f"--socket {path}: cannot listen: {e.strerror or e}") from None
    log.info("NodeEnforcer listening on unix:%s (mode %o; callers: %s; pods may only read)",
             path, 0o666 if others else SOCKET_MODE, policy.who_may_call())
    return EnforcerServer(server, relay)


def close_unix(server: EnforcerServer, path: str, grace: float = 1.0) -> None:
    server.stop(grace).wait()
    try:
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)
    except FileNotFoundError:
        pass
