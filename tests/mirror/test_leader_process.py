"""Two real `kai-fractions mirror --follow-bindrequests --leader-elect` processes on kmock:
only the Lease's holder checks and signs a BindRequest; killed, it is replaced within the
lease's duration, and a BindRequest made after is signed once, by the survivor.
`kai-fractions inspect mirror` reads the same from both replicas' metrics."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from kubernetes import client as k8s

from kai_fractions.cli import main
from kai_fractions.signing import Keyring
from tests.support.agent_process import free_port
from tests.support.mirror_kube import (
    BINDREQUESTS,
    honour_label_selectors,
    pod_path,
    register_bindrequests,
    wait_until_serving,
)

from .test_follower import BOUND, GPU_A, GPU_B, NS, bind_request, pod, reservation_pod

pytestmark = pytest.mark.integration

KEY = b"k" * 32
SIG = "kai-fractions.io/container.trainer.signature"
LEASE_NS, LEASE = "kai-fractions", "kai-fractions-mirror-follower"
LEASE_SECONDS = 2
SLACK_S = 8.0  # a loaded test machine: process start-up and kmock's own pace


def start(kube, tmp_path: Path, identity: str, socket_dir: str, metrics_port: int
          ) -> subprocess.Popen:
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
         "--leader-elect-lease-duration", str(LEASE_SECONDS),
         "--leader-elect-renew-deadline", "1.5", "--leader-elect-retry-period", "0.25",
         "--metrics-listen", f"127.0.0.1:{metrics_port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
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
