"""The mirror's TLS pre-check refuses what gRPC would refuse as it starts to listen, and only
that, naming the right fault.

Python's OpenSSL applies its security level (2 by default) as it loads a pair, so an RSA-1024
pair was refused at start as "no private key (PEM) in it (ee key too small)" though gRPC's
BoringSSL serves it (the reviewer's probe p4_tls_check.py). The check now tests the pair at
security level 0, and says "no private key" only for a key file that does not parse.
"""

from __future__ import annotations

import datetime
import ssl
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID

from kai_fractions.mirror.grpc import server as mirror_server
from kai_fractions.mirror.grpc.server import check_tls_files

from .test_cli_start_checks import refusal


@pytest.fixture(scope="module")
def rsa_1024(tmp_path_factory) -> tuple[Path, Path]:
    """A self-signed RSA-1024 server pair for the name `mirror`."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "mirror")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("mirror")]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    directory = tmp_path_factory.mktemp("rsa1024")
    cert_path, key_path = directory / "tls.crt", directory / "tls.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def test_a_pair_under_openssls_default_security_level_passes_the_check(rsa_1024):
    cert, key = rsa_1024
    check_tls_files(str(cert), str(key), None)


def test_the_mirror_starts_past_the_check_with_it(rsa_1024, capsys):
    """The kubeconfig is the next thing read: its error shows the pair was accepted."""
    cert, key = rsa_1024
    assert refusal(capsys, "--tls-cert", str(cert), "--tls-key", str(key)) == \
        "--kubeconfig /nonexistent/kubeconfig: no such file"


@pytest.mark.integration
def test_grpc_serves_that_pair(rsa_1024):
    """What the check must not refuse: gRPC listens with it and completes a TLS handshake."""
    cert, key = rsa_1024
    server = grpc.server(futures.ThreadPoolExecutor(1))
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials(
        [(key.read_bytes(), cert.read_bytes())]))
    server.start()
    try:
        with grpc.secure_channel(f"127.0.0.1:{port}",
                                 grpc.ssl_channel_credentials(cert.read_bytes()),
                                 options=[("grpc.ssl_target_name_override", "mirror")]
                                 ) as channel:
            grpc.channel_ready_future(channel).result(timeout=30)
    finally:
        server.stop(0)


def test_a_refusal_of_a_key_that_parses_quotes_openssl_not_no_pem(rsa_1024):
    """A pair refused for any reason but a mismatch or a file without PEM: OpenSSL's reason,
    naming both files, never "no private key" for a key file that holds one."""
    cert, key = rsa_1024
    error = ssl.SSLError(1, "[SSL: EE_KEY_TOO_SMALL] ee key too small")
    error.reason = "EE_KEY_TOO_SMALL"
    assert mirror_server._pair_problem(str(cert), str(key), error) == (
        f"--tls-cert {cert} with --tls-key {key}: refused by OpenSSL (ee key too small)")


def test_a_key_file_without_a_private_key_is_still_named(rsa_1024, tmp_path: Path, capsys):
    cert, _ = rsa_1024
    public = tmp_path / "public.pem"
    public.write_bytes(x509.load_pem_x509_certificate(cert.read_bytes()).public_key()
                       .public_bytes(serialization.Encoding.PEM,
                                     serialization.PublicFormat.SubjectPublicKeyInfo))
    message = refusal(capsys, "--tls-cert", str(cert), "--tls-key", str(public))
    assert message.startswith(f"--tls-key {public}: no private key (PEM) in it")
