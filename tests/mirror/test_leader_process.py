"""Two real `kai-fractions mirror --follow-bindrequests --leader-elect` processes on kmock:
only the Lease's holder checks and signs a BindRequest; killed, it is replaced within the
lease's duration, and a BindRequest made after is signed once, by the survivor.
`kai-fractions inspect mirror` reads the same from both replicas' metrics. A burst of calls
that holds every connection of the mirror's pool on an API server slow for pods does not stop
the leader's renewals (the elector has connections of its own)."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from kubernetes import client as k8s

from kai_fractions.api.v1 import allocation_pb2_grpc as pb_grpc
from kai_fractions.cli import main
from kai_fractions.kube.client import CONNECTIONS
from kai_fractions.signing import Keyring
from kai_fractions.sim import apiserver
from tests.support.agent_process import free_port
from tests.support.mirror_kube import (
    BINDREQUESTS,
    honour_label_selectors,
    pod_path,
    register_bindrequests,
    wait_until_serving,
)

from .messages import allocation, mirror_request
from .test_follower import BOUND, GPU_A, GPU_B, NS, bind_request, pod, reservation_pod

pytestmark = pytest.mark.integration

KEY = b"k" * 32
SIG = "kai-fractions.io/container.trainer.signature"
LEASE_NS, LEASE = "kai-fractions", "kai-fractions-mirror-follower"
LEASE_SECONDS = 2
SLACK_S = 8.0  # a loaded test machine: process start-up and kmock's own pace


def start(kube, tmp_path: Path, identity: str, socket_dir: str, metrics_port: int, *,
          durations: tuple[float, float, float] = (LEASE_SECONDS, 1.5, 0.25),
          log: Path | None = None) -> subprocess.Popen:
    """The mirror as a process; `durations`: the Lease's (lease, renew deadline, retry period);
    its stderr to `log` when given (else a pipe, for `communicate`)."""
    lease, renew, retry = durations
    key = tmp_path / "signing-key"
    key.write_bytes(KEY)
    listen = f"unix://{socket_dir}/{identity}.sock"
    process = subprocess.Popen(
        [sys.executable, "-c", "import sys; from kai_fractions.cli import main; "
         "sys.exit(main())", "mirror", "--listen", listen,
         "--kubeconfig", str(kube.write_kubeconfig(tmp_path / "kubeconfig")),
         "--follow-bindrequests", "--signing-key-file", str(key), "--no-pod-cache",
         "--leader-elect", "--leader-elect-identity", identity,
         "--leader-elect-lease-namespace", LEASE_NS,
         "--leader-elect-lease-duration", f"{lease:g}",
         "--leader-elect-renew-deadline", f"{renew:g}", "--leader-elect-retry-period",
         f"{retry:g}", "--metrics-listen", f"127.0.0.1:{metrics_port}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE if log is None else log.open("w"), text=True)
    with grpc.insecure_channel(listen) as channel:
        wait_until_serving(channel, process)
    return process


def leading(port: int) -> str:
    """The replica's own word on whether it follows (its metrics)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        (line,) = [line for line in answer.read().decode().splitlines()
                   if line.startswith("kai_fractions_follower_leading ")]
    return line.split()[1]


def holder(kube) -> str:
    try:
        lease = k8s.CoordinationV1Api(kube.api_client).read_namespaced_lease(LEASE, LEASE_NS)
    except k8s.ApiException:
        return ""
    return lease.spec.holder_identity or ""


def wait_for(predicate, timeout: float, what: str) -> float:
    began = time.monotonic()
    while not predicate():
        if time.monotonic() - began > timeout:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(0.05)
    return time.monotonic() - began


def signature(kube, name: str) -> str | None:
    obj = kube.core.read_namespaced_pod(name, NS)
    return (obj.metadata.annotations or {}).get(SIG)


def bind(kube, name: str) -> None:
    kube.core.create_namespaced_pod(NS, pod(name, {"gpu-fraction": "0.5", **BOUND}))
    k8s.CustomObjectsApi(kube.api_client).create_namespaced_custom_object(
        BINDREQUESTS.group, BINDREQUESTS.version, NS, BINDREQUESTS.plural,
        bind_request(f"br-{name}", name))


def inspected(capsys, ports: dict[str, int]) -> tuple[int, dict]:
    """`kai-fractions inspect mirror` on both replicas' metrics, as JSON."""
    code = main(["inspect", "mirror", "-o", "json", "--window", "0",  # one reading: no wait
                 *(f"127.0.0.1:{ports[identity]}" for identity in sorted(ports))])
    return code, json.loads(capsys.readouterr().out)


def signing_patches(kube, name: str) -> int:
    return sum(SIG in str(r.data) for r in kube.requests("PATCH", pod_path(NS, name)))


def test_one_follower_at_a_time_and_a_killed_leader_is_replaced(kube, tmp_path, capsys):
    register_bindrequests(kube)
    honour_label_selectors(kube)
    kube.core.create_node({"metadata": {"name": "gpu-node-1",
                                        "labels": {"nvidia.com/gpu.memory": "40960"}}})
    for group, gpu in (("group-a", GPU_A), ("group-b", GPU_B)):
        kube.core.create_namespaced_pod("kai-resource-reservation", reservation_pod(group, gpu))
    socket_dir = tempfile.mkdtemp(prefix="kfl-")
    processes: dict[str, subprocess.Popen] = {}
    ports = {"mirror-a": free_port(), "mirror-b": free_port()}
    try:
        for identity in ("mirror-a", "mirror-b"):
            processes[identity] = start(kube, tmp_path, identity, socket_dir, ports[identity])
        wait_for(lambda: holder(kube) in processes, 30, "a replica holds the lease")
        leader = holder(kube)
        (survivor,) = set(processes) - {leader}
        wait_for(lambda: leading(ports[leader]) == "1.0", 10, "the leader says it leads")
        assert leading(ports[survivor]) == "0.0"
        code, report = inspected(capsys, ports)
        assert (code, report["leader"], report["problems"]) == (
            0, f"127.0.0.1:{ports[leader]}", [])

        bind(kube, "before-0")
        wait_for(lambda: signature(kube, "before-0"), 30, "the leader signs")
        time.sleep(1.0)  # time enough for a second follower, were there one, to sign too
        assert signing_patches(kube, "before-0") == 1

        processes[leader].send_signal(signal.SIGKILL)  # no release: the lease must expire
        processes[leader].wait(10)
        killed_at = time.monotonic()
        bind(kube, "after-0")
        wait_for(lambda: holder(kube) == survivor, LEASE_SECONDS + SLACK_S,
                 "the survivor takes the lease over")
        wait_for(lambda: signature(kube, "after-0"), LEASE_SECONDS + SLACK_S,
                 "the survivor signs")
        took = time.monotonic() - killed_at
        assert leading(ports[survivor]) == "1.0"
        time.sleep(0.5)
        assert signing_patches(kube, "after-0") == 1
        assert signing_patches(kube, "before-0") == 1  # the new leader's list re-checks it
        assert Keyring.of(KEY).current.kid in signature(kube, "after-0")
        assert took < LEASE_SECONDS + SLACK_S
        code, report = inspected(capsys, ports)
        assert (code, report["leader"]) == (1, f"127.0.0.1:{ports[survivor]}")
        [gone] = report["problems"]
        assert gone.startswith(f"127.0.0.1:{ports[leader]}: not read: ")

        processes[survivor].send_signal(signal.SIGTERM)
        _, err = processes[survivor].communicate(timeout=30)
        assert processes[survivor].returncode == 0, err
        assert f"leading: lease {LEASE_NS}/{LEASE} acquired by {survivor}" in err
        assert f"released lease {LEASE_NS}/{LEASE}" in err
        assert holder(kube) == ""
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.kill()
                process.communicate()
        shutil.rmtree(socket_dir, ignore_errors=True)


class HeldPodReads:
    """The API stand-in holds every GET of a `flood-*` pod until `release`d (an API server slow
    for pods: each one holds a connection of the mirror's pool meanwhile), and notes, for each
    PATCH of the election's Lease (a renewal), how many such reads it was holding then."""

    def __init__(self, lease_path: str) -> None:
        self.lease_path = lease_path
        self.held = 0
        self.renewals_at: list[int] = []
        self.released = threading.Event()
        self._handle = apiserver.VersionedKubernetesEmulator._handle

    async def handle(self, emulator, request):
        method, path = request.method.value, request.url.path
        if method == "GET" and "/pods/flood-" in path:
            self.held += 1
            try:
                for _ in range(1200):  # 60 s at most: never past the test
                    if self.released.is_set():
                        break
                    await asyncio.sleep(0.05)
            finally:
                self.held -= 1
        elif method == "PATCH" and path == self.lease_path:
            self.renewals_at.append(self.held)
        return await self._handle(emulator, request)


def test_a_burst_of_calls_on_an_api_server_slow_for_pods_does_not_cost_the_lease(
        kube, tmp_path, monkeypatch):
    # The Lease's requests used to share the pool of 32 connections with the calls' pod
    # requests: with every one held by a slow pod GET, the renewals waited behind them and the
    # only replica lost its Lease at the renew deadline. Over the elector's own connections
    # they keep landing while the pool is full.
    lease_path = f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NS}/leases/{LEASE}"
    reads = HeldPodReads(lease_path)
    monkeypatch.setattr(apiserver.VersionedKubernetesEmulator, "_handle",
                        lambda emulator, request: reads.handle(emulator, request))
    register_bindrequests(kube)
    kube.core.create_node({"metadata": {"name": "gpu-node-1",
                                        "labels": {"nvidia.com/gpu.memory": "40960"}}})
    full = CONNECTIONS - 1  # the BindRequest watch holds one of them
    socket_dir = tempfile.mkdtemp(prefix="kfb-")
    port, log = free_port(), tmp_path / "mirror-a.log"
    process = start(kube, tmp_path, "mirror-a", socket_dir, port, durations=(6, 4, 0.5),
                    log=log)
    try:
        wait_for(lambda: holder(kube) == "mirror-a", 30, "the replica holds the lease")
        wait_for(lambda: leading(port) == "1.0", 10, "it says it leads")
        with grpc.insecure_channel(f"unix://{socket_dir}/mirror-a.sock") as channel:
            stub = pb_grpc.AllocationMirrorStub(channel)
            calls = [stub.MirrorAllocation.future(mirror_request(allocation(
                {"metadata": {"namespace": NS, "name": f"flood-{i}", "uid": "u"}})), timeout=90)
                for i in range(CONNECTIONS + 16)]
            try:
                wait_for(lambda: reads.held >= full, 30, "the calls hold the pool")
                # Each renewal needs a connection while none of the pool is free.
                wait_for(lambda: sum(n >= full for n in reads.renewals_at) >= 3, 30,
                         "renewals while the pool is full")
            finally:
                reads.released.set()
            codes = {call.code() for call in calls}  # waits for each
        assert codes == {grpc.StatusCode.NOT_FOUND}  # no such pods: each read one
        assert (holder(kube), leading(port)) == ("mirror-a", "1.0")
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
        err = log.read_text()
        assert "lost lease" not in err, err
        assert f"released lease {LEASE_NS}/{LEASE}" in err  # over its own, closed, client
        assert "Unclosed" not in err, err
    finally:
        reads.released.set()
        if process.poll() is None:
            process.kill()
            process.wait()
        shutil.rmtree(socket_dir, ignore_errors=True)
