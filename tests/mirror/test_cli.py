"""`kai-fractions mirror`: flags, refusals (exit 2, one line), and a real process that serves,
writes through kmock and stops gracefully on SIGTERM."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile

import grpc
import pytest

from kai_fractions.api.v1 import allocation_pb2_grpc as pb_grpc
from kai_fractions.cli import build_parser, main
from tests.support.mirror_kube import register_bindrequests, wait_until_serving

from .messages import allocation, mirror_request

FLAGS = ["--listen", "--tls-cert", "--tls-key", "--tls-client-ca", "--token-file",
         "--signing-key-file", "--insecure", "--reserve-mib", "--annotation-prefix",
         "--kubeconfig", "--follow-bindrequests", "--scheduler-name", "--no-pod-cache",
         "--log-level"]


def test_every_flag_is_there_with_its_default():
    parser = build_parser()
    args = parser.parse_args(["mirror"])
    assert (args.listen, args.reserve_mib, args.annotation_prefix, args.insecure,
            args.follow_bindrequests, args.log_level, args.kubeconfig, args.token_file,
            args.scheduler_name, args.pod_cache) == (
        "127.0.0.1:50051", 0, "nvidia.com/container.", False, False, "info", None, None,
        "kai-scheduler", True)
    mirror_parser = parser._subparsers._group_actions[0].choices["mirror"]
    options = [o for a in mirror_parser._actions for o in a.option_strings
               if o.startswith("--") and o != "--help"]
    assert options == FLAGS
    assert all(a.help for a in mirror_parser._actions)


@pytest.mark.parametrize(("argv", "message"), [
    (["--listen", "0.0.0.0:50051"], "refusing to listen on 0.0.0.0:50051 without TLS: pass "
     "--tls-cert and --tls-key, or --insecure to accept plaintext on a non-loopback address"),
    (["--tls-client-ca", "/ca.crt"], "--tls-client-ca needs --tls-cert and --tls-key (mutual "
     "TLS is TLS plus client certificates)"),
    (["--reserve-mib", "-1"], "--reserve-mib must not be negative, got -1"),
    (["--annotation-prefix", "nope"], "--annotation-prefix: prefix must look like "
     "'example.com/container.' (a domain, a slash, ending with a dot), got 'nope'"),
    (["--kubeconfig", "/nonexistent/kubeconfig"],
     "--kubeconfig /nonexistent/kubeconfig: no such file"),
])
def test_refusals_are_one_line_and_exit_2(capsys, argv, message):
    assert main(["mirror", *argv]) == 2
    err = capsys.readouterr().err
    assert err == f"kai-fractions mirror: {message}\n"


@pytest.mark.integration
def test_a_real_process_serves_and_stops_on_sigterm(kube, tmp_path):
    register_bindrequests(kube)
    kubeconfig = kube.write_kubeconfig(tmp_path / "kubeconfig")
    (tmp_path / "token").write_text("process-token")
    socket_dir = tempfile.mkdtemp(prefix="kfm-")
    listen = f"unix://{socket_dir}/mirror.sock"
    created = kube.core.create_namespaced_pod("team-a", {
        "metadata": {"name": "train-0", "namespace": "team-a",
                     "annotations": {"gpu-fraction": "0.5"}},
        "spec": {"containers": [{"name": "trainer", "image": "registry.invalid/app:1"}]}})
    process = subprocess.Popen(
        [sys.executable, "-c", "import sys; from kai_fractions.cli import main; "
         "sys.exit(main())", "mirror", "--listen", listen, "--kubeconfig", str(kubeconfig),
         "--token-file", str(tmp_path / "token"), "--follow-bindrequests"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        with grpc.insecure_channel(listen) as channel:
            wait_until_serving(channel, process)
            pod = {"metadata": {"namespace": "team-a", "name": "train-0",
                                "uid": created.metadata.uid}}
            reply = pb_grpc.AllocationMirrorStub(channel).MirrorAllocation(
                mirror_request(allocation(pod)), timeout=10,
                metadata=(("authorization", "Bearer process-token"),))
            assert reply.changed
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=20)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
        shutil.rmtree(socket_dir, ignore_errors=True)
    assert process.returncode == 0, err
    assert "AllocationMirror listening on " + listen + " (plaintext, bearer token required)" \
        in err
    assert "following BindRequests (scheduling.run.ai/v1alpha2)" in err
    assert "listed 1 pod(s) of kai-scheduler at resourceVersion" in err  # the pod cache
    assert "SIGTERM received: shutting down" in err
    assert "AllocationMirror stopped" in err
    assert "Traceback" not in err
    annotations = kube.core.read_namespaced_pod("train-0", "team-a").metadata.annotations
    assert annotations["nvidia.com/container.trainer.gpu-memory.request"] == "20480Mi"
