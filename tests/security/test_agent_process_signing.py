"""The REAL node agent process with `--signing-hmac-key-file` (a Secret-shaped key directory), over
kmock and the fake libnvidia-ml.so.1: the mirror-signed pod is applied, the same pod unsigned
waits (no marker, one event, no limit) until its signature lands, one signed with a key the node
does not hold is refused (marker, event, no limit); and the NodeEnforcer socket admits root
only."""

from __future__ import annotations

import json
import os
import socket
import stat
from typing import Any

import grpc
import pytest

from kai_fractions.api.v1 import node_pb2, node_pb2_grpc
from kai_fractions.contract import derived_annotations, parse_pod, plan_pod, pod_views
from kai_fractions.signing import Ed25519Key, Keyring
from tests.support.agent_process import GPU0, H100_MIB, AgentEnv, wait_for

from .allocations import KEY_A, KEY_B

pytestmark = pytest.mark.integration

GIB = 1 << 30
HEX = "5e" * 32
NOBODY = 65534


def mirrored(env: AgentEnv, name: str, sign: bytes | None) -> str:
    """A pod as the mirror leaves it (binder keys, derived keys, and a signature with `sign`),
    bound to the node."""
    body = {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "default", "annotations": {
                "nvidia.com/container.main.gpu-memory.request": "10Gi",
                "nvidia.com/container.main.gpu-memory.limit": "20Gi",
                "nvidia.com/container.main.gpus.devices": GPU0,
                "nvidia.com/container.main.gpu-compute.portion": "0.25"}},
            "spec": {"containers": [{"name": "main", "image": "registry.invalid/app:1",
                                     "resources": {"requests": {"cpu": "100m"}}}]}}
    uid = env.kube.core.create_namespaced_pod("default", body).metadata.uid
    env.make_cgroups(uid, HEX)
    notes = derived_annotations(plan_of(env, name))
    if sign is not None:
        notes[SIG] = Keyring.of(sign).sign(plan_of(env, name))
    env.kube.core.patch_namespaced_pod(name, "default", {
        "metadata": {"annotations": notes}, "spec": {"nodeName": env.node}})
    return uid


SIG = "kai-fractions.io/container.main.signature"
KEY_C = b"c" * 32  # held by no node


def plan_of(env: AgentEnv, name: str):
    stored: dict[str, Any] = env.kube.get_object("v1/pods", "default", name)
    (plan,) = plan_pod(parse_pod(next(pod_views(stored))))
    return plan


def marker(env: AgentEnv, uid: str):
    path = env.marker(uid)
    return json.loads(path.read_text()) if path.exists() else None


def test_signed_applied_unsigned_waits_for_its_signature_forged_refused(agent_env: AgentEnv,
                                                                       tmp_path):
    env = agent_env
    keys = tmp_path / "signing"
    keys.mkdir()
    (keys / "current").write_bytes(KEY_B)
    (keys / "previous").write_bytes(KEY_A)
    env.nvml.add_gpu(GPU0, memory_mib=H100_MIB)
    env.create_node()
    # KEY_C is a forger's own: no rotation brings it, so it is refused after the wait
    run = env.start(f"--signing-hmac-key-file={keys}", "--signature-key-wait=1",
                    sm_sharing=False)
    good = mirrored(env, "signed", sign=KEY_B)
    late = mirrored(env, "unsigned", sign=None)
    bad = mirrored(env, "forged", sign=KEY_C)
    wait_for(lambda: marker(env, good) and marker(env, bad), run=run, what="both markers",
             timeout=20)
    assert marker(env, good)["containers"]["main"]["state"] == "applied"
    refused = marker(env, bad)["containers"]["main"]
    assert (refused["state"], refused["reason"]) == ("refused", "SignatureKeyUnknown")
    assert refused["message"].startswith(f"annotation {SIG} was signed with v1 key ")
    assert refused["message"].endswith("(refused after 1 s)")
    # The unsigned pod waits: no marker, one SignatureMissing event, nothing applied.
    waiting = wait_for(lambda: [e for e in env.events(late) if e["reason"] ==
                                "SignatureMissing"], run=run, what="the SignatureMissing event")
    assert waiting[0]["type"] == "Warning"
    assert waiting[0]["message"].startswith(
        f"container main: waiting for its signature: annotation {SIG} is missing: ")
    assert marker(env, late) is None
    limits = {path for (_gpu, path) in env.nvml.limits()}
    assert any(good.replace("-", "_") in p for p in limits)
    assert not any(late.replace("-", "_") in p for p in limits)
    assert not any(bad.replace("-", "_") in p for p in limits)
    events = wait_for(lambda: [e for e in env.events(bad) if e["reason"] == "Refused"],
                      run=run, what="the Refused event")
    assert events[0]["type"] == "Warning"
    assert events[0]["message"].startswith("container main: SignatureKeyUnknown: annotation ")
    # The signature lands (the follower's patch): the pod is applied.
    env.kube.core.patch_namespaced_pod("unsigned", "default", {"metadata": {"annotations": {
        SIG: Keyring.of(KEY_A).sign(plan_of(env, "unsigned"))}}})
    wait_for(lambda: marker(env, late), run=run, what="the late pod's marker", timeout=20)
    assert marker(env, late)["containers"]["main"]["state"] == "applied"
    assert any(late.replace("-", "_") in p for (_gpu, p) in env.nvml.limits())
    assert [e["reason"] for e in env.events(late)].count("SignatureMissing") == 1
    kids = ", ".join(Keyring.of(KEY_B, KEY_A).kids)
    assert f"applying only signed allocations (keys: {kids})" in run.log()
    assert run.stop() == 0


def _signed(env: AgentEnv, name: str, keyring: Keyring, node: str) -> str:
    uid = mirrored(env, name, sign=None)
    env.kube.core.patch_namespaced_pod(name, "default", {"metadata": {"annotations": {
        SIG: keyring.sign(plan_of(env, name), node=node)}}})
    return uid


def test_the_charts_flags_ed25519_public_keys_and_the_legacy_hmac_key(agent_env: AgentEnv,
                                                                      tmp_path):
    """The real process with the chart's production flags: the ConfigMap-shaped directory of the
    mirror's Ed25519 public key as --signing-key-file and the legacy HMAC Secret as
    --signing-hmac-key-file. A v2 signature (Ed25519, naming the node) and a v1 one (HMAC) are
    both applied; text planted in the ConfigMap while the agent runs is refused with a warning
    and never becomes a key: a pod signed with it as an HMAC key is refused."""
    env = agent_env
    mirror_key = Ed25519Key.generate()
    public = tmp_path / "public"
    public.mkdir()
    (public / "current").write_bytes(mirror_key.public_pem())
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / "current").write_bytes(KEY_A)
    env.nvml.add_gpu(GPU0, memory_mib=H100_MIB)
    env.create_node()
    run = env.start(f"--signing-key-file={public}", f"--signing-hmac-key-file={legacy}",
                    "--signature-key-wait=1", sm_sharing=False)
    v2 = _signed(env, "v2", Keyring.of(mirror_key), env.node)
    v1 = _signed(env, "v1", Keyring.of(KEY_A), "")
    wait_for(lambda: marker(env, v2) and marker(env, v1), run=run, what="markers", timeout=20)
    assert marker(env, v2)["containers"]["main"]["state"] == "applied"
    assert marker(env, v1)["containers"]["main"]["state"] == "applied"
    planted = b"planted-by-a-configmap-writer-0123456789"
    (public / "previous").write_bytes(planted)
    forged = _signed(env, "forged", Keyring.of(planted), "")  # its unknown key: a re-read
    wait_for(lambda: marker(env, forged), run=run, what="the forged pod's marker", timeout=20)
    main = marker(env, forged)["containers"]["main"]
    assert (main["state"], main.get("reason")) == ("refused", "SignatureKeyUnknown")
    assert "not a PEM public key" in run.log()
    assert run.stop() == 0


def _connect_as(uid: int, path: str) -> str:
    """Fork; the child drops to `uid` (setgroups, setgid, setuid) and connects to the unix
    socket `path`; returns what it reports: "connected" or "<error name> <errno>"."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only system calls, then _exit (no pytest, no cleanup)
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            s = socket.socket(socket.AF_UNIX)
            try:
                s.connect(path)
                out = "connected"
            except OSError as e:
                out = f"{type(e).__name__} {e.errno}"
            os.write(write_end, out.encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        answer = f.read().decode()
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    return answer


def test_the_node_socket_refuses_a_non_root_user(agent_env: AgentEnv):
    assert os.geteuid() == 0, "this test drops from root to another uid"
    env = agent_env
    env.nvml.add_gpu(GPU0, memory_mib=H100_MIB)
    env.create_node()
    run = env.start(sm_sharing=False)
    # An agent process imports for seconds on a loaded 2-core machine: its start gets longer
    # than a call does.
    wait_for(lambda: env.socket.exists(), timeout=30, run=run, what="the agent's socket")
    # only the socket's own mode may stand in the way: its directories are open to everyone
    os.chmod(env.short, 0o755)
    assert stat.S_IMODE(env.socket.stat().st_mode) == 0o600
    assert (env.socket.stat().st_uid, env.socket.stat().st_gid) == (0, 0)
    assert _connect_as(NOBODY, str(env.socket)) == "PermissionError 13"  # EACCES
    # root can, and gets an answer
    with grpc.insecure_channel(f"unix:{env.socket}") as channel:
        state = node_pb2_grpc.NodeEnforcerStub(channel).GetNodeState(
            node_pb2.GetNodeStateRequest(), timeout=10)
    assert state.node_name == env.node
    # the control: with the mode opened up, the same user gets through, so it was the mode
    os.chmod(env.socket, 0o666)
    try:
        assert _connect_as(NOBODY, str(env.socket)) == "connected"
    finally:
        os.chmod(env.socket, 0o600)
    assert run.stop() == 0
