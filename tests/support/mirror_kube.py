"""The mirror's test harness: kmock (``kube``) with the reactions the mirror relies on, plus the
real AllocationMirror gRPC server on loopback TCP or a unix socket, with fast retries, writing
through its real store (KubePodStore over kai_fractions.kube).

Reactions added to the ``kube`` emulator (kmock ignores selectors and knows no CRDs):

* pod lists honour an equality ``labelSelector`` (``runai-gpu-group=<id>``), as the follower's
  reservation-pod lookup expects of a real API server;
* ``bindrequests.scheduling.run.ai/v1alpha2`` is a known namespaced resource (list + watch).
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import kmock
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kubernetes import client as k8s

from kai_fractions.api.v1 import allocation_pb2_grpc as pb_grpc
from kai_fractions.contract import DEFAULT_DIALECT
from kai_fractions.kube.client import Kube
from kai_fractions.kube.retry import Backoff
from kai_fractions.mirror.grpc.server import MirrorServer, ServerOptions
from kai_fractions.mirror.kube_store import KubePodStore
from kai_fractions.mirror.pod_cache import PodCache
from kai_fractions.mirror.pod_feed import pod_feed
from kai_fractions.mirror.service import MirrorService
from tests.support.kube import KubeServer

PODS = kmock.resource("", "v1", "pods")
NODES = kmock.resource("", "v1", "nodes")
EVENTS = kmock.resource("", "v1", "events")
BINDREQUESTS = kmock.resource("scheduling.run.ai", "v1alpha2", "bindrequests")
FAST_STORE_BACKOFF = Backoff(attempts=3, base=0.01, cap=0.05)
FAST_CONFLICT_BACKOFF = Backoff(attempts=4, base=0.01, cap=0.05)


def _selector(text: str | None) -> dict[str, str]:
    if not text:
        return {}
    pairs = (part.split("=", 1) for part in text.split(",") if part)
    return {k.strip(): v.strip() for k, v in pairs}


def honour_label_selectors(kube: KubeServer) -> None:
    emulator = kube.emulator

    def selected(request: kmock.Request) -> dict[str, Any]:
        want = _selector(request.params.get("labelSelector"))
        items = [
            obj.raw for (resource, namespace, _), obj in list(emulator.objects.items())
            if resource == PODS and not obj.deleted
            and (request.namespace is None or namespace == request.namespace)
            and all((obj.raw["metadata"].get("labels") or {}).get(k) == v
                    for k, v in want.items())
        ]
        return {"apiVersion": "v1", "kind": "PodList",
                "metadata": {"resourceVersion": str(emulator.revision)}, "items": items}

    emulator[kmock.action.LIST, PODS] << selected


def register_bindrequests(kube: KubeServer) -> None:
    kube.emulator.resources["scheduling.run.ai/v1alpha2/bindrequests"] = kmock.ResourceInfo(
        namespaced=True, kind="BindRequest", singular="bindrequest",
        verbs={"list", "watch", "get", "create", "patch", "delete"})


def create_pending_bind_request(kube: KubeServer, namespace: str, name: str, pod: str, node: str,
                                **spec: Any) -> None:
    """A Pending BindRequest of KAI's scheduler for `pod` (a 0.5 fraction of GPU group
    `group-a` on `node`): what the follower sees before KAI's binder acts on it; `spec` adds
    or replaces fields of its spec. Registers the resource with the stand-in first."""
    register_bindrequests(kube)
    k8s.CustomObjectsApi(kube.api_client).create_namespaced_custom_object(
        BINDREQUESTS.group, BINDREQUESTS.version, namespace, BINDREQUESTS.plural, {
            "apiVersion": "scheduling.run.ai/v1alpha2", "kind": "BindRequest",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"podName": pod, "selectedNode": node, "receivedResourceType": "Fraction",
                     "receivedGPU": {"count": 1, "portion": "0.5"},
                     "selectedFractionalGpuGroups": [{"id": "group-a"}], **spec},
            "status": {"phase": "Pending"}})


def pod_path(namespace: str, name: str) -> str:
    return f"/api/v1/namespaces/{namespace}/pods/{name}"


@dataclass
class MirrorHarness:
    kube: KubeServer
    store: KubePodStore
    service: MirrorService
    server: MirrorServer
    channel: grpc.Channel
    stub: pb_grpc.AllocationMirrorStub
    cleanups: list[Callable[[], None]] = field(default_factory=list)

    # -- cluster helpers ----------------------------------------------------------------------
    def create_pod(self, name: str, annotations: dict[str, str] | None = None, *,
                   namespace: str = "team-a", containers: tuple[str, ...] = ("trainer",),
                   labels: dict[str, str] | None = None) -> dict[str, Any]:
        body = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace,
                         "annotations": dict(annotations or {}), "labels": dict(labels or {})},
            "spec": {"containers": [{"name": c, "image": "registry.invalid/app:1"}
                                    for c in containers]},
        }
        self.kube.core.create_namespaced_pod(namespace, body)
        return self.pod(namespace, name)

    def create_node(self, name: str, gpu_memory_mib: str | None) -> None:
        """The node `name` with (or, None, without) its GPU memory label; an existing node
        (the harness makes gpu-node-1) gets exactly these labels."""
        labels = {} if gpu_memory_mib is None else {"nvidia.com/gpu.memory": gpu_memory_mib}
        if self.kube.get_object("v1/nodes", None, name) is not None:
            self.kube.core.delete_node(name)
        self.kube.core.create_node({"apiVersion": "v1", "kind": "Node",
                                    "metadata": {"name": name, "labels": labels}})

    def pod(self, namespace: str, name: str) -> dict[str, Any]:
        obj = self.kube.get_object(PODS, namespace, name)
        assert obj is not None, f"pod {namespace}/{name} is not in kmock"
        return obj

    def annotations(self, namespace: str, name: str) -> dict[str, str]:
        return dict(self.pod(namespace, name)["metadata"].get("annotations") or {})

    def patches(self, namespace: str, name: str) -> int:
        """PATCH requests the API server received for the pod (refused ones included)."""
        return self.kube.count("PATCH", pod_path(namespace, name))


def start_mirror(kube: KubeServer, *, transport: str = "tcp", **options: Any) -> MirrorHarness:
    honour_label_selectors(kube)
    metrics = options.pop("metrics", None)
    client = Kube(kube.api_client, observe=metrics.api_request if metrics else None)
    store = KubePodStore(client, backoff=options.pop("store_backoff", FAST_STORE_BACKOFF),
                         request_timeout=options.pop("request_timeout", 5.0))
    cleanups: list[Callable[[], None]] = []
    cache = PodCache() if options.pop("pod_cache", False) else None
    if cache is not None and metrics is not None:
        metrics.watch_pod_cache(cache)
    feeds = [pod_feed(client, cache, backoff=FAST_STORE_BACKOFF)] \
        if cache is not None else []
    service = MirrorService(store, conflict_backoff=FAST_CONFLICT_BACKOFF,
                            default_reserve_mib=options.pop("default_reserve_mib", 0),
                            dialect=options.pop("dialect", DEFAULT_DIALECT), cache=cache)
    if transport == "unix":
        # A short directory: a unix socket path must fit in 107 bytes.
        directory = tempfile.mkdtemp(prefix="kfm-")
        cleanups.append(lambda: shutil.rmtree(directory, ignore_errors=True))
        listen = f"unix://{directory}/mirror.sock"
    else:
        listen = "127.0.0.1:0"
    credentials = options.pop("channel_credentials", None)
    server = MirrorServer(service, ServerOptions(listen=listen, **options),
                          tasks=feeds, observe=metrics.call if metrics else None).start()
    if credentials is not None:
        channel = grpc.secure_channel(server.address, credentials, options=(
            ("grpc.ssl_target_name_override", "localhost"),))
    else:
        channel = grpc.insecure_channel(server.address)
    harness = MirrorHarness(kube, store, service, server, channel,
                            pb_grpc.AllocationMirrorStub(channel), cleanups)
    if kube.get_object("v1/nodes", None, "gpu-node-1") is None:
        # The node the tests' allocations name (the mirror checks that it exists); the GPU
        # memory comes with each call unless a test labels the node itself.
        harness.create_node("gpu-node-1", None)
    return harness


def stop_mirror(harness: MirrorHarness) -> None:
    harness.channel.close()
    harness.server.stop(grace=0)
    for cleanup in harness.cleanups:
        cleanup()


@pytest.fixture
def mirror_factory(kube: KubeServer) -> Iterator[Callable[..., MirrorHarness]]:
    """``mirror_factory(transport="tcp"|"unix", tls_cert=..., token_file=..., ...)``: starts a
    mirror server against ``kube``; every one started is stopped after the test. Besides the
    ServerOptions fields: ``dialect`` (the KAI binder to match; upstream by default),
    ``default_reserve_mib``, ``pod_cache``, ``store_backoff``, ``request_timeout``,
    ``metrics`` (a MirrorMetrics the server, its API client and its pod cache report to)."""
    started: list[MirrorHarness] = []

    def factory(**options: Any) -> MirrorHarness:
        harness = start_mirror(kube, **options)
        started.append(harness)
        return harness

    yield factory
    for harness in reversed(started):
        stop_mirror(harness)


@pytest.fixture(params=["tcp", "unix"])
def mirror(request: pytest.FixtureRequest, mirror_factory) -> MirrorHarness:
    """The mirror on loopback TCP reading every pod from the API and, as a second run of the
    test, on a unix socket with its pod cache (list + watch) on."""
    return mirror_factory(transport=request.param, pod_cache=request.param == "unix")


@pytest.fixture
def mirror_tcp(mirror_factory) -> MirrorHarness:
    return mirror_factory(transport="tcp")


__all__ = [
    "BINDREQUESTS",
    "EVENTS",
    "NODES",
    "PODS",
    "MirrorHarness",
    "honour_label_selectors",
    "mirror",
    "mirror_factory",
    "mirror_tcp",
    "pod_path",
    "register_bindrequests",
    "run_mirror_process",
    "start_mirror",
    "stop_mirror",
]


@dataclass
class MirrorProcessRun:
    """What `run_mirror_process` saw: where it listened, its one answer, how it ended, and
    its metrics after the answer (when it served them)."""

    listen: str
    reply: Any
    returncode: int
    err: str
    metrics: str = ""


def run_mirror_process(kube: KubeServer, tmp_path: Path, *flags: str,
                       metadata: tuple[tuple[str, str], ...] = (),
                       metrics_url: str = "",
                       metrics_ready: Callable[[str], object] = lambda text: True,
                       ) -> MirrorProcessRun:
    """`kai-fractions mirror` as a real process over `kube` on a unix socket (plus `flags`):
    creates pod team-a/train-0 (gpu-fraction 0.5), makes one MirrorAllocation call for it
    (which must write), reads `metrics_url` when given until `metrics_ready` says the text
    holds what the test waits for (the follower, say, runs beside the call), then stops the
    process with SIGTERM."""
    from tests.mirror.messages import allocation, mirror_request

    kubeconfig = kube.write_kubeconfig(tmp_path / "kubeconfig")
    socket_dir = tempfile.mkdtemp(prefix="kfm-")  # short: a socket path fits in 107 bytes
    listen = f"unix://{socket_dir}/mirror.sock"
    if kube.get_object("v1/nodes", None, "gpu-node-1") is None:
        kube.core.create_node({"metadata": {"name": "gpu-node-1"}})  # the allocation's node
    created = kube.core.create_namespaced_pod("team-a", {
        "metadata": {"name": "train-0", "namespace": "team-a",
                     "annotations": {"gpu-fraction": "0.5"}},
        "spec": {"containers": [{"name": "trainer", "image": "registry.invalid/app:1"}]}})
    process = subprocess.Popen(
        [sys.executable, "-c", "import sys; from kai_fractions.cli import main; "
         "sys.exit(main())", "mirror", "--listen", listen, "--kubeconfig", str(kubeconfig),
         *flags],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        with grpc.insecure_channel(listen) as channel:
            wait_until_serving(channel, process)
            pod = {"metadata": {"namespace": "team-a", "name": "train-0",
                                "uid": created.metadata.uid}}
            reply = pb_grpc.AllocationMirrorStub(channel).MirrorAllocation(
                mirror_request(allocation(pod)), timeout=10, metadata=metadata)
            assert reply.changed
        metrics = ""
        deadline = time.monotonic() + 20
        while metrics_url:
            assert process.poll() is None, process.communicate()[1]
            with urllib.request.urlopen(metrics_url, timeout=10) as answer:
                metrics = answer.read().decode()
            if metrics_ready(metrics):
                break
            assert time.monotonic() < deadline, f"the metrics never got ready:\n{metrics}"
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=20)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
        shutil.rmtree(socket_dir, ignore_errors=True)
    return MirrorProcessRun(listen, reply, process.returncode, err, metrics)


def wait_until_serving(channel: grpc.Channel, process: subprocess.Popen, timeout: float = 30
                       ) -> None:
    """Polls the gRPC health service of a mirror started as a process until it says SERVING;
    fails with the process's stderr if it exits first."""
    health = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout
    while True:
        try:
            if health.Check(health_pb2.HealthCheckRequest(), timeout=1).status == \
                    health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            pass
        assert process.poll() is None, process.communicate()[1]
        assert time.monotonic() < deadline, "the mirror did not become healthy"
        time.sleep(0.1)
