"""kube.config.load_api_client's credentials as a request reads them: a kubeconfig user's
tokenFile read again every minute, and a token refresh that fails (in-cluster) named in the
request's error. Time is moved by replacing the clocks the loaders read, never waited out."""

from __future__ import annotations

import datetime
import logging
import socket
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from kubernetes.config import incluster_config, kube_config

from kai_fractions.kube import ConfigError, Kube, Transient, credentials, load_api_client
from kai_fractions.kube.config import auth_headers
from kai_fractions.kube.credentials import TOKEN_FILE_SECONDS
from tests.mirror.certs import CertificateAuthority


def kubeconfig(directory: Path, user: str) -> Path:
    path = directory / "kubeconfig"
    path.write_text(f"""apiVersion: v1
kind: Config
clusters: [{{name: c, cluster: {{server: "http://127.0.0.1:1"}}}}]
users: [{{name: u, user: {user}}}]
contexts: [{{name: x, context: {{cluster: c, user: u}}}}]
current-context: x
""")
    return path


@pytest.fixture
def clock(monkeypatch) -> SimpleNamespace:
    """The monotonic clock kube.credentials reads, moved by hand."""
    now = SimpleNamespace(seconds=1000.0)
    monkeypatch.setattr(credentials, "time", SimpleNamespace(monotonic=lambda: now.seconds))
    return now


def sent_token(api_client) -> str:
    return auth_headers(api_client, "GET", "/api", None)["authorization"]


def test_a_kubeconfig_token_file_is_read_again_every_minute(tmp_path, monkeypatch, clock):
    # The official client reads a tokenFile once: a token rotated in the file was never sent.
    (tmp_path / "secrets").mkdir()
    token = tmp_path / "secrets" / "token"
    token.write_text("first\n")
    path = kubeconfig(tmp_path, "{tokenFile: secrets/token}")  # relative to the kubeconfig
    monkeypatch.chdir("/")
    api_client = load_api_client(str(path))
    assert sent_token(api_client) == "Bearer first"
    token.write_text("rotated\n")
    clock.seconds += TOKEN_FILE_SECONDS - 1
    assert sent_token(api_client) == "Bearer first"  # read at most once a minute
    clock.seconds += 1
    assert sent_token(api_client) == "Bearer rotated"


def test_a_token_file_that_cannot_be_read_again_keeps_the_last_token(tmp_path, clock, caplog):
    token = tmp_path / "token"
    token.write_text("first")
    api_client = load_api_client(str(kubeconfig(tmp_path, f"{{tokenFile: {token}}}")))
    token.unlink()
    clock.seconds += TOKEN_FILE_SECONDS
    with caplog.at_level(logging.WARNING, logger=credentials.__name__):
        assert [sent_token(api_client) for _ in range(3)] == ["Bearer first"] * 3
        token.write_text("")  # being rewritten
        assert sent_token(api_client) == "Bearer first"
    (warning,) = caplog.messages  # once, not at every request
    assert warning.startswith(f"cannot read the kubeconfig's tokenFile {token} again "
                              "([Errno 2] No such file or directory")
    token.write_text("second")
    assert sent_token(api_client) == "Bearer second"  # tried again at the next request


def test_a_kubeconfig_token_is_sent_as_written(tmp_path):
    assert sent_token(load_api_client(str(kubeconfig(tmp_path, "{token: abc}")))) == \
        "Bearer abc"


def test_an_empty_token_file_is_a_config_error_at_load(tmp_path):
    (tmp_path / "token").write_text("\n")
    with pytest.raises(ConfigError, match=r"^cannot load a Kubernetes configuration: the "
                                          r"kubeconfig's tokenFile .*/token is empty$"):
        load_api_client(str(kubeconfig(tmp_path, f"{{tokenFile: {tmp_path / 'token'}}}")))


def test_without_any_configuration_it_says_where_it_looked_and_what_to_pass(tmp_path,
                                                                            monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    missing = tmp_path / "no-such-config"
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(missing))
    with pytest.raises(ConfigError) as e:
        load_api_client()
    assert str(e.value).startswith("cannot load a Kubernetes configuration: ")
    assert str(e.value).endswith(
        f"(looked for the in-cluster service account, then {missing}); pass --kubeconfig "
        "FILE or set $KUBECONFIG")


@pytest.fixture
def in_cluster(tmp_path, monkeypatch) -> Iterator[SimpleNamespace]:
    """load_api_client() finds itself in a cluster whose service account token is a file of
    the test's; `later()` moves the in-cluster loader's clock past its token's minute."""
    token, ca = tmp_path / "token", tmp_path / "ca.crt"
    token.write_text("first")
    ca.write_bytes(CertificateAuthority().pem)
    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(token))
    monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(ca))
    with socket.socket() as s:  # nothing listens: no request may get that far
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(port))
    shift = SimpleNamespace(by=datetime.timedelta())

    class Shifted(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return datetime.datetime.now(tz) + shift.by

    monkeypatch.setattr(incluster_config, "datetime",
                        SimpleNamespace(datetime=Shifted, timedelta=datetime.timedelta))

    def later() -> None:
        shift.by += datetime.timedelta(minutes=2)

    yield SimpleNamespace(token=token, later=later)


@pytest.mark.parametrize(("spoil", "error"), [
    (lambda token: token.write_text(""), "ConfigException: Token file exists but empty."),
    (Path.unlink, "FileNotFoundError: [Errno 2] No such file or directory"),
], ids=["emptied", "removed"])
async def test_an_in_cluster_token_that_cannot_be_read_again_is_transient_naming_it(
        in_cluster, spoil, error):
    # It escaped as a ConfigException or an OSError: the list + watch loop of the mirror's
    # follower ended with it.
    kube = Kube(load_api_client())
    assert sent_token(kube.api_client) == "bearer first"
    spoil(in_cluster.token)
    in_cluster.later()
    expected = (f"read pod: cannot get credentials from the in-cluster service account token "
                f"{in_cluster.token}: {error}")
    try:
        for call in (kube.request, kube.read):
            with pytest.raises(Transient) as raised:
                await call("GET", "/api/v1/namespaces/ns/pods/p", what="read pod")
            assert str(raised.value).startswith(expected)
        with pytest.raises(Transient) as raised:
            async with kube.stream("/api/v1/pods", what="read pod"):
                pytest.fail("a stream opened without credentials")
        assert str(raised.value).startswith(expected)
    finally:
        await kube.close()


def test_an_in_cluster_token_is_sent_without_the_whitespace_around_it(in_cluster):
    # The official loader sent the file as it is: a token ending in a newline (a Secret
    # written with `echo`) made aiohttp refuse every request.
    in_cluster.token.write_text("first\n")
    api_client = load_api_client()
    assert sent_token(api_client) == "bearer first"
    in_cluster.token.write_text(" \n")  # being rewritten: as an empty file, till it is
    in_cluster.later()
    with pytest.raises(credentials.CredentialError, match="Token file exists but empty"):
        sent_token(api_client)
    in_cluster.token.write_text("second\n")
    assert sent_token(api_client) == "bearer second"
