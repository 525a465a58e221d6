"""The REAL node agent process's NodeEnforcer socket checks who is calling (issue 17, finding 4):
SO_PEERCRED's uid must be an allowed one (root), and a process in a pod's cgroup (a root
container that reached the socket through a hostPath) may read the node's state but not
Release, Drain or Provision anything. The agent runs over kmock and the fake NVML, with a fake
/proc (`--proc-root`) that says which pod the calling test process is in."""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import pytest

from kai_fractions.api.v1 import allocation_pb2, node_pb2, node_pb2_grpc
from tests.support.agent_process import GPU0, H100_MIB, AgentEnv, AgentRun, wait_for

pytestmark = pytest.mark.integration

NOBODY = 65534
VICTIM = "0a1b2c3d-0000-4000-8000-000000000001"
ATTACKER_POD = "0a1b2c3d-0000-4000-8000-0000000000ff"
HEX = "5e" * 32
POD_CGROUP = (f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod"
              f"{ATTACKER_POD.replace('-', '_')}.slice/cri-containerd-{'ab' * 32}.scope")
HOST_CGROUP = "/user.slice/user-0.slice/session-1.scope"


@contextmanager
def stub(env: AgentEnv) -> Iterator[node_pb2_grpc.NodeEnforcerStub]:
    """A channel with a connection of its own: the agent places a caller as it accepts the
    connection, and gRPC would otherwise reuse an earlier channel's to the same socket."""
    with grpc.insecure_channel(f"unix:{env.socket}",
                               options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
        yield node_pb2_grpc.NodeEnforcerStub(channel)


def refused(call, request) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        call(request, timeout=10)
    return e.value.code(), e.value.details()


def started(env: AgentEnv) -> AgentRun:
    env.nvml.add_gpu(GPU0, memory_mib=H100_MIB)
    env.create_node()
    run = env.start(sm_sharing=False)
    # An agent process imports for seconds on a loaded 2-core machine: its start gets longer
    # than a call does.
    wait_for(lambda: env.socket.exists(), timeout=30, run=run, what="the agent's socket")
    return run


def provision_victim(env: AgentEnv) -> node_pb2.ProvisionRequest:
    env.make_cgroups(VICTIM, HEX)
    p = "nvidia.com/container.main"
    request = node_pb2.ProvisionRequest(
        pod=allocation_pb2.PodRef(namespace="jobs", name="victim", uid=VICTIM),
        annotations={f"{p}.gpu-memory.request": "10Gi", f"{p}.gpu-memory.limit": "20Gi",
                     f"{p}.gpus.devices": GPU0, f"{p}.gpu-compute.portion": "0.25"},
        containers=["main"])
    with stub(env) as s:
        (alloc,) = s.Provision(request, timeout=10).allocations
    assert alloc.state == node_pb2.ALLOCATION_STATE_APPLIED, alloc
    return request


def test_a_process_in_a_pod_may_read_but_not_release_other_pods_limits(agent_env: AgentEnv):
    env = agent_env
    env.proc_entry(os.getpid(), HOST_CGROUP)  # the test starts as a host process
    run = started(env)
    provision = provision_victim(env)
    release = node_pb2.ReleaseRequest(pod=allocation_pb2.PodRef(uid=VICTIM))
    # the attacker: a root container (same uid) that reached the socket
    env.proc_entry(os.getpid(), POD_CGROUP)
    rule = ("only processes on the host or in the node agent's own pod may change GPU limits "
            "through this socket")
    with stub(env) as s:
        for name, call, request in (("Release", s.Release, release),
                                    ("Drain", s.Drain, node_pb2.DrainRequest(pod=release.pod)),
                                    ("Provision", s.Provision, provision)):
            assert refused(call, request) == (grpc.StatusCode.PERMISSION_DENIED, (
                f"{name}: refused: pid {os.getpid()} runs in pod {ATTACKER_POD}; {rule}"))
        state = s.GetNodeState(node_pb2.GetNodeStateRequest(), timeout=10)  # reading is fine
    (alloc,) = [a for a in state.allocations if a.pod.uid == VICTIM]
    assert alloc.state == node_pb2.ALLOCATION_STATE_APPLIED  # the limits stay
    assert env.marker(VICTIM).exists()
    assert "NodeEnforcer: refused pid" in run.log()
    # the control: the same call from a host process goes through
    env.proc_entry(os.getpid(), HOST_CGROUP)
    with stub(env) as s:
        assert list(s.Release(release, timeout=10).released_containers) == ["main"]
    assert run.stop() == 0


def test_a_pod_process_that_exits_after_connecting_leaves_its_connection_a_pods(
        agent_env: AgentEnv):
    # A pod process connects, forks and exits; its child calls on the inherited connection.
    # Its pid then names nothing in /proc, which read at call time looked like the host.
    env = agent_env
    env.proc_entry(os.getpid(), HOST_CGROUP)
    run = started(env)
    provision_victim(env)
    release = node_pb2.ReleaseRequest(pod=allocation_pb2.PodRef(uid=VICTIM))
    env.proc_entry(os.getpid(), POD_CGROUP)
    with stub(env) as s:
        s.GetNodeState(node_pb2.GetNodeStateRequest(), timeout=10)  # connected, from the pod
        shutil.rmtree(env.proc_root / str(os.getpid()))  # the connecting process is gone
        code, details = refused(s.Release, release)
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert details.startswith(f"Release: refused: pid {os.getpid()} runs in pod {ATTACKER_POD}")
    # A connection whose process is gone before it is accepted cannot be placed: refused too.
    with stub(env) as s:
        code, details = refused(s.Release, release)
    assert (code, details) == (grpc.StatusCode.PERMISSION_DENIED, (
        f"Release: refused: pid {os.getpid()} had exited when the node agent accepted its "
        "connection, so it cannot be told from a pod; call from a process that stays until it "
        "is connected"))
    assert env.marker(VICTIM).exists()
    env.proc_entry(os.getpid(), HOST_CGROUP)
    assert run.stop() == 0


def test_a_uid_that_is_not_allowed_is_refused_naming_who_may_call(agent_env: AgentEnv):
    assert os.geteuid() == 0, "this test calls as another uid (seteuid)"
    env = agent_env
    env.proc_entry(os.getpid(), HOST_CGROUP)
    run = started(env)
    provision_victim(env)
    os.chmod(env.short, 0o755)
    os.chmod(env.socket, 0o666)  # the mode alone would let this user in
    try:
        os.seteuid(NOBODY)  # every thread's, grpc's own included (glibc applies it process-wide)
        try:
            with stub(env) as s:
                got = refused(s.GetNodeState, node_pb2.GetNodeStateRequest())
                got_release = refused(s.Release, node_pb2.ReleaseRequest(
                    pod=allocation_pb2.PodRef(uid=VICTIM)))
        finally:
            os.seteuid(0)
    finally:
        os.chmod(env.socket, 0o600)
    assert got == (grpc.StatusCode.PERMISSION_DENIED, (
        f"GetNodeState: uid {NOBODY} may not call the node agent; only uid 0 may (the socket "
        "checks its caller's credentials)"))
    assert got_release[0] == grpc.StatusCode.PERMISSION_DENIED
    assert got_release[1].startswith(f"Release: uid {NOBODY} may not call the node agent")
    assert env.marker(VICTIM).exists()
    with stub(env) as s:  # root still can
        assert s.GetNodeState(node_pb2.GetNodeStateRequest(), timeout=10).node_name == env.node
    assert run.stop() == 0


def test_the_private_grpc_socket_behind_the_relay_answers_no_one_directly(agent_env: AgentEnv):
    """A root process that reaches the agent's directory could connect to the gRPC server's own
    socket and skip the relay: its calls carry no known credentials and are refused."""
    env = agent_env
    run = started(env)
    private = env.socket.parent / f".{env.socket.name}.d"
    assert stat.S_IMODE(private.stat().st_mode) == 0o700
    with grpc.insecure_channel(f"unix:{private / 'grpc.sock'}") as channel:
        got = refused(node_pb2_grpc.NodeEnforcerStub(channel).GetNodeState,
                      node_pb2.GetNodeStateRequest())
    assert got == (grpc.StatusCode.PERMISSION_DENIED, (
        "GetNodeState: the caller's credentials are unknown; only uid 0 may call the node "
        "agent"))
    assert run.stop() == 0
    assert not private.exists() and not env.socket.exists()  # stopping leaves nothing behind
