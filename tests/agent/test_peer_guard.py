"""Where a NodeEnforcer caller runs, read as its connection is accepted (`peer_guard.peer_of`):
a process that connected and exited is never placed by a /proc entry its pid may name now."""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path
from typing import Any

import pytest

from kai_fractions.node.agent import peer_guard
from kai_fractions.node.agent.peer_guard import peer_of
from kai_fractions.node.procfs import Procfs

HOST_CGROUP = "/user.slice/user-0.slice/session-1.scope"
POD = "0a1b2c3d-0000-4000-8000-0000000000ff"
POD_CGROUP = (f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod"
              f"{POD.replace('-', '_')}.slice/cri-containerd-{'ab' * 32}.scope")


def proc(root: Path, pid: int, cgroup: str) -> Procfs:
    (root / str(pid)).mkdir(parents=True, exist_ok=True)
    (root / str(pid) / "cgroup").write_text(f"0::{cgroup}\n")
    return Procfs(root)


def connected_by_a_child_that_exits(path: str) -> tuple[socket.socket, int]:
    """A connection whose connect() a child process made before it exited and was reaped: the
    socket stays open here (created before the fork), its peer credentials name the child."""
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:  # the child
        try:
            client.connect(path)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    return client, pid


def kernel_gives_peer_pidfds() -> bool:
    a, b = socket.socketpair(socket.AF_UNIX)
    with a, b:
        try:
            os.close(a.getsockopt(socket.SOL_SOCKET, peer_guard.SO_PEERPIDFD))
        except OSError as e:
            return e.errno != errno.ENOPROTOOPT
    return True


@pytest.fixture
def listener(short_tmp: Path):
    path = str(short_tmp / "s.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen()
    server.settimeout(10)  # a child that failed to connect must not hang the test
    yield server, path
    server.close()


def peer_of_this_process(listener, procfs: Procfs, wrap: Any = lambda conn: conn
                         ) -> peer_guard.Peer:
    """`peer_of` a connection this (live) process made, as the agent accepts it."""
    server, path = listener
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        client.connect(path)
        conn, _ = server.accept()
        with conn:
            return peer_of(wrap(conn), procfs)


def test_a_live_caller_is_placed_by_its_cgroup(listener, tmp_path: Path) -> None:
    peer = peer_of_this_process(listener, proc(tmp_path, os.getpid(), POD_CGROUP))
    assert (peer.pid, peer.pod, peer.placed) == (os.getpid(), POD, True)


@pytest.mark.skipif(not kernel_gives_peer_pidfds(), reason="a kernel before 6.5: no SO_PEERPIDFD")
def test_a_caller_gone_before_the_accept_is_not_placed_even_if_its_pid_names_a_host_process(
        listener, tmp_path: Path) -> None:
    """The pid of the exited caller may be reused by a host process before the agent reads
    /proc (played here by the fake /proc entry): the caller's pidfd says it is gone."""
    server, path = listener
    client, pid = connected_by_a_child_that_exits(path)
    with client:
        conn, _ = server.accept()
        with conn:
            peer = peer_of(conn, proc(tmp_path, pid, HOST_CGROUP))
    assert (peer.pid, peer.placed) == (pid, False)


def test_without_the_kernels_peer_pidfd_the_proc_entry_decides(
        listener, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Kernels before 6.5 (no SO_PEERPIDFD): the window of a reused pid stays open, as the
    module says; a live caller is still placed."""
    monkeypatch.setattr(peer_guard, "SO_PEERPIDFD", 0x7FFF)  # an option no kernel has
    peer = peer_of_this_process(listener, proc(tmp_path, os.getpid(), HOST_CGROUP))
    assert (peer.pod, peer.placed) == (None, True)


class _PidfdRefused:
    """A socket as kernels 6.5 to 6.14 answer for a reaped peer: EINVAL for its pidfd."""

    def __init__(self, sock: socket.socket, code: int) -> None:
        self.sock, self.code = sock, code

    def getsockopt(self, level: int, option: int, *size: int):
        if option == peer_guard.SO_PEERPIDFD:
            raise OSError(self.code, os.strerror(self.code))
        return self.sock.getsockopt(level, option, *size)


@pytest.mark.parametrize("code", [errno.EINVAL, errno.ESRCH])
def test_a_kernel_that_refuses_the_pidfd_of_a_reaped_caller_leaves_it_unplaced(
        listener, tmp_path: Path, code: int) -> None:
    peer = peer_of_this_process(listener, proc(tmp_path, os.getpid(), HOST_CGROUP),
                                lambda conn: _PidfdRefused(conn, code))
    assert peer.placed is False


def test_a_pod_caller_seen_from_the_agents_cgroup_namespace_is_placed_in_its_pod(
        listener, tmp_path: Path) -> None:
    """A non-privileged agent has a cgroup namespace of its own: on a cgroupfs-driver node a
    pod's cgroup reads relative to the agent's, with nothing of kubepods left. Read as the
    host's, a root process of any pod could change GPU limits through the socket."""
    procfs = proc(tmp_path, os.getpid(), f"/../../../besteffort/pod{POD}/{'ab' * 32}")
    peer = peer_of_this_process(listener, procfs)
    assert (peer.pod, peer.placed) == (POD, True)
    agent = peer_guard.PeerPolicy(procfs, own_pid=1)  # the agent's own: `0::/` in its namespace
    refusal = agent.refusal(peer, "Provision", changes=True)
    assert refusal is not None and f"runs in pod {POD}" in refusal
    host = peer_of_this_process(listener, proc(
        tmp_path, os.getpid(), "/../../../../system.slice/kubelet.service"))
    assert host.pod is None and agent.refusal(host, "Provision", changes=True) is None


HIDDEN_POD_CGROUP = f"/../../../../custom-root/pod{POD}/{'cd' * 32}"
"""Pod-shaped, relative to the agent's cgroup namespace, in a layout the parse cannot place."""


def test_a_caller_whose_cgroup_may_be_a_pods_is_refused_changes(listener, tmp_path: Path
                                                                 ) -> None:
    """A cgroup relative to the agent's cgroup namespace that the parse cannot place and that
    is pod-shaped (a kubelet `--cgroup-root` or a layout it does not know) may be a pod's: read
    as the host's, its root process could change GPU limits. It may still read."""
    procfs = proc(tmp_path, os.getpid(), HIDDEN_POD_CGROUP)
    peer = peer_of_this_process(listener, procfs)
    assert (peer.pod, peer.hidden) == (None, HIDDEN_POD_CGROUP)
    agent = peer_guard.PeerPolicy(procfs, own_pid=1)
    refusal = agent.refusal(peer, "Provision", changes=True)
    assert refusal is not None and "cannot tell from a pod's" in refusal
    assert agent.refusal(peer, "GetNodeState", changes=False) is None


@pytest.mark.parametrize("cgroup", [
    "/../../../../runtime.slice/containerd.service",  # EKS AL2023's containerd
    "/../../../../system/ext-nvidia-persistenced",  # a Talos system service
    "/../../../../docker/" + "d" * 64,  # a Docker container with the cgroupfs driver
    "/../cri-containerd-" + "b" * 64 + ".scope",  # a sibling of the agent's own container
])
def test_a_host_or_own_pod_caller_outside_the_usual_host_cgroups_may_change_limits(
        listener, tmp_path: Path, cgroup: str) -> None:
    """A non-privileged agent reads cgroups relative to its own: a host service outside
    systemd's usual slices, or a container of its own pod, names no pod-shaped cgroup. Taken
    for one that may be a pod's, such a caller was refused Provision, Release and Drain."""
    procfs = proc(tmp_path, os.getpid(), cgroup)
    peer = peer_of_this_process(listener, procfs)
    assert (peer.pod, peer.hidden) == (None, None)
    agent = peer_guard.PeerPolicy(procfs, own_pid=1)
    assert agent.refusal(peer, "Release", changes=True) is None
