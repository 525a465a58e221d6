"""`kai-fractions mirror`: flags, refusals (exit 2, one line), and a real process that serves,
writes through kmock and stops gracefully on SIGTERM."""

from __future__ import annotations

import socket

import pytest

from kai_fractions.cli import build_parser, main
from kai_fractions.mirror import bindrequests
from tests.support.agent_process import free_port
from tests.support.mirror_kube import register_bindrequests, run_mirror_process

FLAGS = ["--listen", "--tls-cert", "--tls-key", "--tls-client-ca", "--token-file",
         "--signing-key-file", "--publish-public-key", "--insecure", "--kai-dialect",
         "--reserve-mib", "--write-as", "--annotation-prefix", "--kubeconfig",
         "--follow-bindrequests", "--reservation-namespace", "--mark-silent-nodes-after",
         "--heartbeat-lease-namespace",
         "--node-condition", "--follow-concurrency",
         "--leader-elect", "--leader-elect-lease-name", "--leader-elect-lease-namespace",
         "--leader-elect-identity", "--leader-elect-lease-duration",
         "--leader-elect-renew-deadline", "--leader-elect-retry-period",
         "--scheduler-name", "--no-pod-cache", "--report-gpu-fractioning-config",
         "--node-agent-daemonset", "--report-interval", "--metrics-listen", "--log-level"]


def test_every_flag_is_there_with_its_default():
    parser = build_parser()
    args = parser.parse_args(["mirror"])
    assert (args.listen, args.reserve_mib, args.annotation_prefix, args.insecure,
            args.follow_bindrequests, args.log_level, args.kubeconfig, args.token_file,
            args.scheduler_name, args.pod_cache, args.metrics_listen) == (
        "127.0.0.1:50051", 0, "nvidia.com/container.", False, False, "info", None, None,
        "kai-scheduler", True, "")
    mirror_parser = parser._subparsers._group_actions[0].choices["mirror"]
    options = [o for a in mirror_parser._actions for o in a.option_strings
               if o.startswith("--") and o != "--help"]
    assert options == FLAGS
    assert all(a.help for a in mirror_parser._actions)
    assert args.follow_concurrency == bindrequests.CONCURRENCY  # the follow loop's own default
    assert args.reservation_namespace == "kai-resource-reservation"  # KAI's default


@pytest.mark.parametrize(("argv", "message"), [
    (["--listen", "0.0.0.0:50051"], "refusing to listen on 0.0.0.0:50051 without TLS: pass "
     "--tls-cert and --tls-key, or --insecure to accept plaintext on a non-loopback address"),
    (["--tls-client-ca", "/ca.crt"], "--tls-client-ca needs --tls-cert and --tls-key (mutual "
     "TLS is TLS plus client certificates)"),
    (["--reserve-mib", "-1"], "--reserve-mib must not be negative, got -1"),
    (["--publish-public-key", "just-a-name"], "--publish-public-key must be NAMESPACE/NAME, "
     "got 'just-a-name'"),
    (["--publish-public-key", "ns/name"], "--publish-public-key publishes the signing key's "
     "public half: it needs --signing-key-file"),
    (["--reserve-mib", "1024"], "--reserve-mib is 1024 MiB, but upstream KAI main subtracts no "
     "reserve: use 0, or the patched dialect for a KAI that does"),
    (["--kai-dialect", "patched", "--reserve-mib", "-5"], "--reserve-mib must not be negative, "
     "got -5"),
    (["--annotation-prefix", "nope"], "--annotation-prefix: prefix must look like "
     "'example.com/container.' (a domain, a slash, ending with a dot), got 'nope'"),
    (["--follow-bindrequests", "--follow-concurrency", "0"], "--follow-concurrency 0: at "
     "least 1"),
    (["--metrics-listen", "nowhere"], "--metrics-listen: expected HOST:PORT, got 'nowhere'"),
    (["--mark-silent-nodes-after", "180"], "--mark-silent-nodes-after 180: it needs "
     "--follow-bindrequests (nodes are checked as binds are)"),
    (["--follow-bindrequests", "--mark-silent-nodes-after", "60"], "--mark-silent-nodes-after "
     "60: at least 120 seconds (twice the node agent's heartbeat) and finite, or 0 for off"),
    (["--follow-bindrequests", "--reservation-namespace", "KAI_Reservations"],
     "--reservation-namespace 'KAI_Reservations': not a namespace name (lower-case letters, "
     "digits and '-', at most 63)"),
    (["--follow-bindrequests", "--heartbeat-lease-namespace", "Kai"],
     "--heartbeat-lease-namespace 'Kai': not a namespace name (lower-case letters, digits and "
     "'-', at most 63)"),
    (["--kubeconfig", "/nonexistent/kubeconfig"],
     "--kubeconfig /nonexistent/kubeconfig: no such file"),
])
def test_refusals_are_one_line_and_exit_2(capsys, argv, message):
    assert main(["mirror", *argv]) == 2
    err = capsys.readouterr().err
    assert err == f"kai-fractions mirror: {message}\n"


@pytest.mark.integration
def test_a_metrics_port_in_use_is_refused_naming_the_flag(kube, tmp_path, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["mirror", "--kubeconfig", str(kube.write_kubeconfig(tmp_path / "kc")),
                     "--no-pod-cache", "--metrics-listen", f"127.0.0.1:{port}"]) == 2
    assert capsys.readouterr().err == (
        f"kai-fractions mirror: --metrics-listen 127.0.0.1:{port}: Address already in use\n")


@pytest.mark.integration
def test_a_real_process_serves_and_stops_on_sigterm(kube, tmp_path):
    register_bindrequests(kube)
    (tmp_path / "token").write_text("process-token")
    port = free_port()
    run = run_mirror_process(kube, tmp_path, "--token-file", str(tmp_path / "token"),
                             "--follow-bindrequests", "--metrics-listen", f"127.0.0.1:{port}",
                             metadata=(("authorization", "Bearer process-token"),),
                             metrics_url=f"http://127.0.0.1:{port}/metrics")
    err = run.err
    assert run.returncode == 0, err
    assert f"metrics at http://127.0.0.1:{port}/metrics" in err
    for series in ('kai_fractions_mirror_calls_total{code="OK",method="MirrorAllocation"} 1.0',
                   'kai_fractions_mirror_api_requests_total{code="200",verb="PATCH"} 1.0',
                   "kai_fractions_mirror_pod_cache_synced 1.0",
                   "kai_fractions_follower_leading 1.0"):
        assert series in run.metrics
    assert "AllocationMirror listening on " + run.listen + " (plaintext, bearer token required)" \
        in err
    assert "following BindRequests (scheduling.run.ai/v1alpha2)" in err
    assert "listed 1 pod(s) of kai-scheduler at resourceVersion" in err  # the pod cache
    assert "SIGTERM received: shutting down" in err
    assert "AllocationMirror stopped" in err
    assert "Traceback" not in err
    annotations = kube.core.read_namespaced_pod("train-0", "team-a").metadata.annotations
    # 20480 MiB as KAI writes it (resource.MustParse("20480Mi").String()).
    assert annotations["nvidia.com/container.trainer.gpu-memory.request"] == "20Gi"
