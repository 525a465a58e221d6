"""TLS, mutual TLS and the bearer token; the plaintext-on-a-public-address guard."""

from __future__ import annotations

import subprocess

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kai_fractions.api.v1 import allocation_pb2 as pb
from kai_fractions.api.v1 import allocation_pb2_grpc as pb_grpc
from kai_fractions.mirror.grpc.security import (
    ListenAddress,
    SecurityConfigError,
    parse_listen,
)
from kai_fractions.mirror.grpc.server import MirrorServer, ServerOptions
from kai_fractions.mirror.service import MirrorService
from tests.support.fake_store import FakePodStore

from .certs import CertificateAuthority
from .messages import allocation, mirror_request

pytestmark = pytest.mark.integration

TOKEN = "s3cret-token-for-tests"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    directory = tmp_path_factory.mktemp("pki")
    ca, rogue = CertificateAuthority(), CertificateAuthority("someone else's CA")
    (directory / "ca.crt").write_bytes(ca.pem)
    server_cert, server_key = ca.issue("kai-fractions-mirror", server=True).write(directory,
                                                                                   "server")
    return {
        "dir": directory, "ca": ca.pem, "ca_file": str(directory / "ca.crt"),
        "server_cert": str(server_cert), "server_key": str(server_key),
        "client": ca.issue("kai-scheduler-binder", server=False),
        "rogue_client": rogue.issue("kai-scheduler-binder", server=False),
    }


def preview(stub, pod, metadata=()) -> pb.PreviewAllocationResponse:
    return stub.PreviewAllocation(pb.PreviewAllocationRequest(allocation=allocation(pod)),
                                  timeout=5, metadata=metadata)


def tls_channel(address: str, pki, client=None) -> grpc.Channel:
    credentials = grpc.ssl_channel_credentials(
        root_certificates=pki["ca"],
        private_key=client.key if client else None,
        certificate_chain=client.cert if client else None)
    return grpc.secure_channel(address, credentials,
                               options=(("grpc.ssl_target_name_override", "localhost"),))


def test_tls_serves_clients_that_trust_the_ca(mirror_factory, pki):
    mirror = mirror_factory(tls_cert=pki["server_cert"], tls_key=pki["server_key"],
                            channel_credentials=grpc.ssl_channel_credentials(pki["ca"]))
    pod = mirror.create_pod("train-0", {"gpu-fraction": "0.5"})
    assert preview(mirror.stub, pod).annotations
    with grpc.insecure_channel(mirror.server.address) as plain, pytest.raises(
            grpc.RpcError) as e:
        preview(pb_grpc.AllocationMirrorStub(plain), pod)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_requires_a_client_certificate_from_the_ca(mirror_factory, pki):
    mirror = mirror_factory(tls_cert=pki["server_cert"], tls_key=pki["server_key"],
                            tls_client_ca=pki["ca_file"])
    pod = mirror.create_pod("train-0", {"gpu-fraction": "0.5"})
    with tls_channel(mirror.server.address, pki, pki["client"]) as channel:
        assert preview(pb_grpc.AllocationMirrorStub(channel), pod).annotations
    for client in (None, pki["rogue_client"]):  # no certificate, a stranger's certificate
        with tls_channel(mirror.server.address, pki, client) as channel, pytest.raises(
                grpc.RpcError) as e:
            pb_grpc.AllocationMirrorStub(channel).MirrorAllocation(
                mirror_request(allocation(pod)), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE  # the handshake failed
    assert mirror.patches("team-a", "train-0") == 0


def test_bearer_token(mirror_factory, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    mirror = mirror_factory(token_file=str(token_file))
    pod = mirror.create_pod("train-0", {"gpu-fraction": "0.5"})
    for metadata, message in [
        ((), "missing `authorization: Bearer <token>` metadata"),
        ((("authorization", "Bearer wrong"),), "invalid bearer token"),
        ((("authorization", TOKEN),), "invalid bearer token"),  # no scheme
        ((("authorization", f"Basic {TOKEN}"),), "invalid bearer token"),
    ]:
        with pytest.raises(grpc.RpcError) as e:
            mirror.stub.MirrorAllocation(mirror_request(allocation(pod)), timeout=5,
                                         metadata=metadata)
        assert (e.value.code(), e.value.details()) == (grpc.StatusCode.UNAUTHENTICATED, message)
    assert mirror.patches("team-a", "train-0") == 0
    assert mirror.kube.count("GET") == 0  # refused before the servicer ran
    good = (("authorization", f"Bearer {TOKEN}"),)
    assert mirror.stub.MirrorAllocation(mirror_request(allocation(pod)), timeout=5,
                                        metadata=good).changed
    # kubelet's gRPC probe sends no metadata: health needs no token
    health = health_pb2_grpc.HealthStub(mirror.channel)
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == \
        health_pb2.HealthCheckResponse.SERVING


def test_token_rotation_takes_effect_without_restart(mirror_factory, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("first-token")
    mirror = mirror_factory(token_file=str(token_file))
    pod = mirror.create_pod("train-0", {"gpu-fraction": "0.5"})
    preview(mirror.stub, pod, (("authorization", "Bearer first-token"),))
    token_file.write_text("second-token-longer")
    with pytest.raises(grpc.RpcError) as e:
        preview(mirror.stub, pod, (("authorization", "Bearer first-token"),))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    preview(mirror.stub, pod, (("authorization", "Bearer second-token-longer"),))


def test_a_token_file_emptied_while_running_keeps_the_last_token(mirror_factory, tmp_path,
                                                                 caplog):
    """Every call failed with UNKNOWN (and the file's path) while the file was empty; the token
    read last stays in use, as while the file is missing, and a new one takes over."""
    token_file = tmp_path / "token"
    token_file.write_text("first-token")
    mirror = mirror_factory(token_file=str(token_file))
    pod = mirror.create_pod("train-0", {"gpu-fraction": "0.5"})
    token_file.write_text("\n")
    with caplog.at_level("WARNING"):
        preview(mirror.stub, pod, (("authorization", "Bearer first-token"),))
        preview(mirror.stub, pod, (("authorization", "Bearer first-token"),))
    warned = [r.getMessage() for r in caplog.records if "token read last" in r.getMessage()]
    assert warned == [f"--token-file {token_file}: the file is empty; the token read last "
                      "stays in use"]
    token_file.write_text("second-token")
    preview(mirror.stub, pod, (("authorization", "Bearer second-token"),))


def test_reflection_needs_the_token_too(grpcurl_bin, mirror_factory, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    mirror = mirror_factory(token_file=str(token_file))
    base = [str(grpcurl_bin), "-max-time", "20", "-plaintext"]
    refused = subprocess.run([*base, mirror.server.address, "list"], capture_output=True,
                             text=True, timeout=30, check=False)
    assert refused.returncode != 0
    assert "Unauthenticated" in refused.stderr
    allowed = subprocess.run([*base, "-H", f"authorization: Bearer {TOKEN}",
                              mirror.server.address, "list"],
                             capture_output=True, text=True, timeout=30, check=False)
    assert allowed.returncode == 0, allowed.stderr
    assert "kai_fractions.v1.AllocationMirror" in allowed.stdout.split()


# -- configuration guards (no server needed) ---------------------------------------------------

def make(**options) -> MirrorServer:
    return MirrorServer(MirrorService(FakePodStore()), ServerOptions(**options))


@pytest.mark.parametrize("listen", ["0.0.0.0:50051", "10.0.0.7:50051", "[::]:50051",
                                    "mirror.kai-fractions.svc:50051", ":50051"])
def test_plaintext_on_a_non_loopback_address_is_refused(listen):
    with pytest.raises(SecurityConfigError) as e:
        make(listen=listen)
    assert str(e.value) == (
        f"refusing to listen on {listen} without TLS: pass --tls-cert and --tls-key, or "
        "--insecure to accept plaintext on a non-loopback address")


@pytest.mark.parametrize(("listen", "local"), [
    ("127.0.0.1:50051", True), ("localhost:50051", True), ("[::1]:50051", True),
    ("127.8.9.10:1", True), ("unix:///run/kai-fractions/mirror.sock", True),
    ("0.0.0.0:50051", False), ("[::]:1", False)])
def test_local_addresses(listen, local):
    assert parse_listen(listen).is_local is local


def test_insecure_allows_plaintext_anywhere():
    make(listen="0.0.0.0:0", insecure=True)


@pytest.mark.parametrize(("options", "message"), [
    ({"listen": "50051"}, "--listen 50051: expected HOST:PORT (e.g. 127.0.0.1:50051, "
     "0.0.0.0:50051, [::1]:50051) or unix:///path.sock"),
    ({"listen": "unix://relative.sock"}, "--listen unix://relative.sock: a unix socket needs an "
     "absolute path, e.g. unix:///run/kai-fractions/mirror.sock"),
    ({"tls_cert": "/x.crt"}, "--tls-cert and --tls-key go together"),
    ({"tls_client_ca": "/ca.crt"}, "--tls-client-ca needs --tls-cert and --tls-key (mutual "
     "TLS is TLS plus client certificates)"),
    ({"tls_cert": "/nonexistent/x.crt", "tls_key": "/nonexistent/x.key"},
     "--tls-key /nonexistent/x.key: No such file or directory"),
    ({"token_file": "/nonexistent/token"}, "--token-file /nonexistent/token: No such file or "
     "directory"),
])
def test_bad_security_options(options, message):
    with pytest.raises(SecurityConfigError) as e:
        make(**options)
    assert str(e.value) == message


def test_empty_token_file_is_refused(tmp_path):
    (tmp_path / "token").write_text("\n")
    with pytest.raises(SecurityConfigError, match="the file is empty"):
        make(token_file=str(tmp_path / "token"))


def test_unix_listen_address_round_trip():
    assert parse_listen("unix:///run/m.sock") == ListenAddress("unix:///run/m.sock")
    assert parse_listen("unix:/run/m.sock").unix_path == "/run/m.sock"
