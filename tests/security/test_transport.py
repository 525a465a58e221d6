"""Transport security of the mirror, counted at the API server: every refused caller (no client
certificate, a stranger's, an expired one, no or a wrong bearer token, a client that does not
trust the server) gets a gRPC status and the Kubernetes API sees NO request for the pod.

What a refused certificate looks like to the caller: grpcio's server API can require client
certificates (the handshake fails: the caller sees UNAVAILABLE) or not request them at all; it
has no "request, but let the call through unverified" mode, so an interceptor never sees a
client certificate it could refuse with UNAUTHENTICATED. `test_grpcio_cannot_request_without_
requiring_a_client_certificate` pins that fact; if a grpcio release changes it, the test fails
and the interceptor becomes possible. A bad bearer token IS refused with UNAUTHENTICATED.
"""

from __future__ import annotations

import datetime
from concurrent import futures

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kai_fractions.api.v1 import allocation_pb2 as pb
from kai_fractions.api.v1 import allocation_pb2_grpc as pb_grpc
from tests.mirror.certs import CertificateAuthority, Pem, _pem
from tests.mirror.messages import allocation, mirror_request
from tests.support.mirror_kube import pod_path

pytestmark = pytest.mark.integration

NS, NAME = "team-a", "train-0"
TOKEN = "transport-test-token"


def expired(ca: CertificateAuthority, common_name: str) -> Pem:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(ca.cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=2))
            .not_valid_after(now - datetime.timedelta(days=1))
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca.key, hashes.SHA256()))
    return _pem(cert, key)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    directory = tmp_path_factory.mktemp("pki")
    ca, rogue = CertificateAuthority(), CertificateAuthority("someone else's CA")
    (directory / "ca.crt").write_bytes(ca.pem)
    cert, key = ca.issue("kai-fractions-mirror", server=True).write(directory, "server")
    return {"ca": ca.pem, "ca_file": str(directory / "ca.crt"), "cert": str(cert),
            "key": str(key), "rogue_ca": rogue.pem,
            "client": ca.issue("kai-scheduler-binder", server=False),
            "rogue_client": rogue.issue("kai-scheduler-binder", server=False),
            "expired_client": expired(ca, "kai-scheduler-binder")}


def channel(address: str, root: bytes, client: Pem | None) -> grpc.Channel:
    credentials = grpc.ssl_channel_credentials(
        root_certificates=root, private_key=client.key if client else None,
        certificate_chain=client.cert if client else None)
    return grpc.secure_channel(address, credentials,
                               options=(("grpc.ssl_target_name_override", "localhost"),))


def calls(stub: pb_grpc.AllocationMirrorStub, pod: dict):
    """Every AllocationMirror method, each with a request that would write if let through."""
    return {
        "MirrorAllocation": lambda md: stub.MirrorAllocation(
            mirror_request(allocation(pod)), timeout=5, metadata=md),
        "PreviewAllocation": lambda md: stub.PreviewAllocation(
            pb.PreviewAllocationRequest(allocation=allocation(pod)), timeout=5, metadata=md),
        "ReleaseAllocation": lambda md: stub.ReleaseAllocation(
            pb.ReleaseAllocationRequest(pod=pb.PodRef(namespace=NS, name=NAME)), timeout=5,
            metadata=md),
    }


def api_requests(mirror) -> int:
    return mirror.kube.count(None, pod_path(NS, NAME))


@pytest.fixture
def mtls_with_token(mirror_factory, pki, tmp_path):
    (tmp_path / "token").write_text(TOKEN)
    mirror = mirror_factory(tls_cert=pki["cert"], tls_key=pki["key"],
                            tls_client_ca=pki["ca_file"], token_file=str(tmp_path / "token"))
    pod = mirror.create_pod(NAME, {"gpu-fraction": "0.5"})
    return mirror, pod


@pytest.mark.parametrize("who", ["none", "rogue_client", "expired_client"])
def test_a_bad_client_certificate_fails_the_handshake_and_nothing_is_read_or_written(
        mtls_with_token, pki, who):
    mirror, pod = mtls_with_token
    before = api_requests(mirror)
    client = None if who == "none" else pki[who]
    with channel(mirror.server.address, pki["ca"], client) as ch:
        for method, call in calls(pb_grpc.AllocationMirrorStub(ch), pod).items():
            with pytest.raises(grpc.RpcError) as e:
                call((("authorization", f"Bearer {TOKEN}"),))  # even with the right token
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE, method
    assert api_requests(mirror) == before  # the pod was never read, never patched
    assert mirror.patches(NS, NAME) == 0


@pytest.mark.parametrize(("metadata", "message"), [
    ((), "missing `authorization: Bearer <token>` metadata"),
    ((("authorization", "Bearer not-the-token"),), "invalid bearer token"),
    ((("authorization", f"Bearer {TOKEN}x"),), "invalid bearer token"),
    ((("authorization", f"Bearer {TOKEN[:-1]}"),), "invalid bearer token"),
    ((("authorization", f"Basic {TOKEN}"),), "invalid bearer token"),
])
def test_a_good_certificate_with_a_bad_token_is_unauthenticated_and_nothing_is_read_or_written(
        mtls_with_token, pki, metadata, message):
    mirror, pod = mtls_with_token
    before = api_requests(mirror)
    with channel(mirror.server.address, pki["ca"], pki["client"]) as ch:
        for method, call in calls(pb_grpc.AllocationMirrorStub(ch), pod).items():
            with pytest.raises(grpc.RpcError) as e:
                call(metadata)
            assert (e.value.code(), e.value.details()) == (
                grpc.StatusCode.UNAUTHENTICATED, message), method
    assert api_requests(mirror) == before
    assert mirror.patches(NS, NAME) == 0


def test_the_right_certificate_and_token_write_exactly_once(mtls_with_token, pki):
    mirror, pod = mtls_with_token
    with channel(mirror.server.address, pki["ca"], pki["client"]) as ch:
        stub = pb_grpc.AllocationMirrorStub(ch)
        good = (("authorization", f"Bearer {TOKEN}"),)
        assert stub.MirrorAllocation(mirror_request(allocation(pod)), timeout=5,
                                     metadata=good).changed
        assert not stub.MirrorAllocation(mirror_request(allocation(pod)), timeout=5,
                                         metadata=good).changed
    assert mirror.patches(NS, NAME) == 1


def test_a_client_that_does_not_trust_the_server_sends_nothing(mtls_with_token, pki):
    mirror, pod = mtls_with_token
    before = api_requests(mirror)
    with channel(mirror.server.address, pki["rogue_ca"], pki["client"]) as ch:
        with pytest.raises(grpc.RpcError) as e:
            pb_grpc.AllocationMirrorStub(ch).MirrorAllocation(
                mirror_request(allocation(pod)), timeout=5,
                metadata=(("authorization", f"Bearer {TOKEN}"),))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert api_requests(mirror) == before and mirror.patches(NS, NAME) == 0


def test_plaintext_to_a_tls_mirror_is_refused(mtls_with_token):
    mirror, pod = mtls_with_token
    with grpc.insecure_channel(mirror.server.address) as ch, pytest.raises(grpc.RpcError) as e:
        pb_grpc.AllocationMirrorStub(ch).MirrorAllocation(
            mirror_request(allocation(pod)), timeout=5,
            metadata=(("authorization", f"Bearer {TOKEN}"),))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert mirror.patches(NS, NAME) == 0


def test_grpcio_cannot_request_without_requiring_a_client_certificate(pki):
    """Why a bad client certificate is UNAVAILABLE, not UNAVAILABLE-then-UNAUTHENTICATED: with
    `require_client_auth=False` grpcio does not even ask for a certificate, so the auth context
    of a client that has a valid one carries no x509 field an interceptor could check."""
    seen: list[dict] = []

    class Health(health_pb2_grpc.HealthServicer):
        def Check(self, request, context):
            seen.append(dict(context.auth_context()))
            return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)

    with open(pki["cert"], "rb") as c, open(pki["key"], "rb") as k:
        pair = (k.read(), c.read())
    for require in (False, True):
        server = grpc.server(futures.ThreadPoolExecutor(2))
        health_pb2_grpc.add_HealthServicer_to_server(Health(), server)
        port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials(
            [pair], root_certificates=pki["ca"], require_client_auth=require))
        server.start()
        try:
            with channel(f"127.0.0.1:{port}", pki["ca"], pki["client"]) as ch:
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        finally:
            server.stop(0)
    not_required, required = seen
    assert not_required["transport_security_type"] == [b"ssl"]
    assert "x509_common_name" not in not_required and "x509_pem_cert" not in not_required
    assert required["x509_common_name"] == [b"kai-scheduler-binder"]
