"""kube.client.Kube against kmock (the requests as the server receives them, its refusals),
FaultyApi (resets, silence) and the scripted stand-in (a path prefix, Retry-After, an answer
that is not JSON, TLS, a proxy, a watch written piece by piece)."""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s
from kubernetes.config import ConfigException

from kai_fractions.kube import (
    MERGE_PATCH,
    BadAnswer,
    ConfigError,
    Conflict,
    Forbidden,
    Gone,
    Invalid,
    Kube,
    KubeError,
    NotFound,
    Transient,
    objects,
)
from tests.mirror.certs import CertificateAuthority
from tests.support.faults_api import Fault, FaultyApi
from tests.support.kube import KubeServer, pod_manifest

from .standin import TIMEOUT, Answer, StandIn, Stream, events, status

pytestmark = pytest.mark.integration

NS, NAME = "team-a", "train-0"
POD_PATH = objects.pod_path(NS, NAME)
POD = {"apiVersion": "v1", "kind": "Pod",
       "metadata": {"name": NAME, "namespace": NS, "uid": "u-1", "resourceVersion": "7"}}


def configured(host: str, **settings: Any) -> k8s.Configuration:
    configuration = k8s.Configuration(host=host)
    for name, value in settings.items():
        setattr(configuration, name, value)
    return configuration


def with_token(configuration: k8s.Configuration, token: str = "tok") -> k8s.Configuration:
    configuration.api_key = {"authorization": token}
    configuration.api_key_prefix = {"authorization": "Bearer"}
    return configuration


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
async def open_kube() -> AsyncIterator[Callable[..., Kube]]:
    """Kubes over an ApiClient, a configuration or a server URL; closed after the test."""
    made: list[Kube] = []

    def open_(target: k8s.ApiClient | k8s.Configuration | str, **options: Any) -> Kube:
        if isinstance(target, str):
            target = configured(target)
        api_client = target if isinstance(target, k8s.ApiClient) else k8s.ApiClient(target)
        made.append(Kube(api_client, **options))
        return made[-1]

    yield open_
    for kube in made:
        await kube.close()
        kube.api_client.close()


def seed(kube: KubeServer, annotations: dict[str, str] | None = None) -> k8s.V1Pod:
    return kube.core.create_namespaced_pod(NS, pod_manifest(NAME, NS,
                                                            annotations=annotations or {}))


# -- the requests ------------------------------------------------------------------------------

async def test_a_request_reaches_the_server_with_its_method_path_query_body_and_content_type(
        kube, open_kube):
    seed(kube)
    client = open_kube(kube.api_client)
    patch = objects.annotation_patch({"a": "1"})
    written = await client.request("PATCH", POD_PATH, what="patch pod", body=patch,
                                   content_type=MERGE_PATCH, query={"fieldManager": "kai"})
    await client.request("POST", objects.events_path(NS), what="create event",
                         body={"metadata": {"name": "e"}, "reason": "R"})
    listed = await client.request("GET", objects.pods_path(NS), what="list pods",
                                  query={"labelSelector": "app in (a, b)"})
    (sent,) = kube.requests("PATCH", POD_PATH)
    assert (dict(sent.params), sent.headers["Content-Type"], sent.data) == (
        {"fieldManager": "kai"}, MERGE_PATCH, {"metadata": {"annotations": {"a": "1"}}})
    (event,) = kube.requests("POST", objects.events_path(NS))
    assert event.headers["Content-Type"] == "application/json"
    assert event.data["reason"] == "R"
    (listing,) = kube.requests("GET", objects.pods_path(NS))
    assert dict(listing.params) == {"labelSelector": "app in (a, b)"}
    assert "Content-Type" not in listing.headers  # no body, no type
    assert written["metadata"]["annotations"] == {"a": "1"}
    assert [pod["metadata"]["name"] for pod in listed["items"]] == [NAME]


async def test_a_body_given_as_json_is_sent_compact_and_bytes_as_they_are(open_kube):
    async with StandIn(Answer(200, {})) as api:
        client = open_kube(api.url)
        await client.request("POST", "/x", what="x", body={"a": [1, 2]})
        await client.request("POST", "/x", what="x", body=b'{ "raw" : true }')
    assert [seen.body for seen in api.seen] == [b'{"a":[1,2]}', b'{ "raw" : true }']


async def test_each_request_carries_the_official_clients_headers_and_credentials(
        kube, open_kube):
    seed(kube)
    api_client = k8s.ApiClient(with_token(kube.configuration()))
    api_client.cookie = "session=abc"
    api_client.set_default_header("X-Tenant", "team-a")
    await open_kube(api_client).request("GET", POD_PATH, what="read pod")
    (ours,) = kube.requests("GET", POD_PATH)
    k8s.CoreV1Api(api_client).read_namespaced_pod(NAME, NS)
    _, theirs = kube.requests("GET", POD_PATH)
    for name in ("Authorization", "Accept", "User-Agent", "Cookie", "X-Tenant"):
        assert ours.headers[name] == theirs.headers[name], name
    assert (ours.headers["Authorization"], ours.headers["User-Agent"]) == (
        "Bearer tok", api_client.user_agent)


async def test_a_token_refreshed_by_the_configurations_hook_is_sent_on_the_next_request(
        kube, open_kube):
    seed(kube)
    configuration = with_token(kube.configuration(), "expired")
    current = {"token": "first"}
    configuration.refresh_api_key_hook = lambda c: c.api_key.update(
        authorization=current["token"])
    client = open_kube(configuration)
    await client.request("GET", POD_PATH, what="read pod")
    current["token"] = "second"
    await client.request("PATCH", POD_PATH, what="patch pod", content_type=MERGE_PATCH,
                         body=objects.annotation_patch({"a": "1"}))
    current["token"] = "third"
    async with client.stream(POD_PATH.rsplit("/", 1)[0], what="watch",
                             query={"watch": "true"}) as lines:
        await anext(lines)
    assert [r.headers["Authorization"] for r in kube.requests()[1:]] == [
        "Bearer first", "Bearer second", "Bearer third"]


@pytest.mark.parametrize("failure", [
    FileNotFoundError(2, "No such file or directory", "/var/run/secrets/token"),
    ConfigException("Token file exists but empty."),
], ids=["token-file-missing", "token-file-empty"])
async def test_a_token_refresh_that_fails_is_transient_and_sends_nothing(open_kube, failure):
    # It escaped as the hook's own exception: a list + watch loop ended with it.
    def refresh(configuration: k8s.Configuration) -> None:
        raise failure

    expected = ("read pod: cannot get credentials from the configuration's "
                f"refresh_api_key_hook: {type(failure).__name__}: {failure}")
    async with StandIn(Answer(200, POD), Stream(events(("ADDED", POD)))) as api:
        configuration = with_token(configured(api.url))
        configuration.refresh_api_key_hook = refresh
        client = open_kube(configuration)
        for call in (client.request, client.read):
            with pytest.raises(Transient) as raised:
                await call("GET", POD_PATH, what="read pod")
            assert str(raised.value) == expected
        with pytest.raises(Transient) as raised:
            async with client.stream(POD_PATH, what="read pod"):
                pytest.fail("a stream opened without credentials")
        assert str(raised.value) == expected
    assert api.seen == []


@pytest.mark.parametrize("prefix", ["/prefix", "/prefix/"])
async def test_a_server_url_with_a_path_prefix_is_reached_under_it(open_kube, prefix):
    async with StandIn(Answer(200, POD), Stream(events(("ADDED", POD)))) as api:
        client = open_kube(api.url + prefix)
        await client.request("GET", POD_PATH, what="read pod", query={"a": "1"})
        async with client.stream(objects.pods_path(), what="watch") as lines:
            assert len([line async for line in lines]) == 1
    assert [seen.target for seen in api.seen] == [f"/prefix{POD_PATH}?a=1", "/prefix/api/v1/pods"]
    assert api.seen[0].headers["host"] == f"127.0.0.1:{api.port}"


async def test_sequential_requests_share_one_kept_connection(open_kube):
    async with StandIn(Answer(200, POD)) as api:
        client = open_kube(api.url)
        for _ in range(5):
            await client.request("GET", POD_PATH, what="read pod")
    assert (len(api.seen), api.connections) == (5, 1)


async def test_an_empty_2xx_answer_is_none(open_kube):
    async with StandIn(Answer(200, b"")) as api:
        assert await open_kube(api.url).request("DELETE", POD_PATH, what="delete pod") is None


# -- refusals ----------------------------------------------------------------------------------

RBAC = "RBAC"
CREDENTIALS = "credentials"
REFUSALS = [
    (404, NotFound, "NotFound", ""),
    (409, Conflict, "Conflict", ""),
    (410, Gone, "Expired", ""),
    (422, Invalid, "Invalid", ""),
    (401, Forbidden, "Unauthorized", CREDENTIALS),
    (403, Forbidden, "Forbidden", RBAC),
    (408, Transient, "Timeout", ""),
    (429, Transient, "TooManyRequests", ""),
    (500, Transient, "InternalError", ""),
    (503, Transient, "ServiceUnavailable", ""),
    (400, KubeError, "BadRequest", ""),
    (405, KubeError, "MethodNotAllowed", ""),
]


@pytest.mark.parametrize(("code", "error", "reason", "tail"), REFUSALS,
                         ids=[str(code) for code, *_ in REFUSALS])
async def test_each_status_is_its_error_with_the_servers_message_and_is_sent_once(
        kube, open_kube, code, error, reason, tail):
    seed(kube)
    kube.fail("PATCH", POD_PATH, code, times=None, reason=reason, message="why not")
    with pytest.raises(KubeError) as raised:
        await open_kube(kube.api_client).request(
            "PATCH", POD_PATH, what=f"patch pod {NS}/{NAME}", content_type=MERGE_PATCH,
            body=objects.annotation_patch({"a": "1"}))
    assert type(raised.value) is error
    message = str(raised.value)
    assert message.startswith(f"patch pod {NS}/{NAME}: ")
    assert f"{code} {reason}: why not" in message
    assert tail in message  # a refused identity says where to look
    assert (raised.value.status, raised.value.retry_after) == (code, None)
    assert kube.count("PATCH", POD_PATH) == 1  # a Kube tries once; `retrying` tries again


async def test_a_stale_resource_version_is_a_conflict_and_changes_nothing(kube, open_kube):
    created = seed(kube).metadata
    kube.core.patch_namespaced_pod(NAME, NS, {"metadata": {"labels": {"touched": "yes"}}})
    with pytest.raises(Conflict) as raised:
        await open_kube(kube.api_client).request(
            "PATCH", POD_PATH, what="patch pod", content_type=MERGE_PATCH,
            body=objects.annotation_patch({"a": "1"}, uid=created.uid,
                                          resource_version=created.resource_version))
    assert str(raised.value) == (
        'patch pod: 409 Conflict: Operation cannot be fulfilled on pods "train-0": the object '
        "has been modified; please apply your changes to the latest version and try again")
    assert not kube.core.read_namespaced_pod(NAME, NS).metadata.annotations


async def test_another_uid_is_a_conflict_and_changes_nothing(kube, open_kube):
    seed(kube)
    with pytest.raises(Conflict, match="Precondition failed: UID"):
        await open_kube(kube.api_client).request(
            "PATCH", POD_PATH, what="patch pod", content_type=MERGE_PATCH,
            body=objects.annotation_patch({"a": "1"}, uid="someone-else"))
    assert not kube.core.read_namespaced_pod(NAME, NS).metadata.annotations


@pytest.mark.parametrize(("header", "hint"), [("2", 2.0), ("0.5", 0.5), ("soon", None)],
                         ids=["seconds", "fraction", "not-a-number"])
async def test_the_retry_after_of_a_throttled_answer_is_parsed(open_kube, header, hint):
    throttled = Answer(429, status(429, "TooManyRequests", "slow down"), {"Retry-After": header})
    async with StandIn(throttled) as api:
        with pytest.raises(Transient) as raised:
            await open_kube(api.url).request("GET", POD_PATH, what="read pod")
    assert raised.value.retry_after == hint
    assert str(raised.value) == "read pod: 429 TooManyRequests: slow down"


async def test_a_gateways_answer_that_is_not_a_status_is_its_code_and_reason(open_kube):
    async with StandIn(Answer(502, b"<html>bad gateway</html>")) as api:
        with pytest.raises(Transient) as raised:
            await open_kube(api.url).request("GET", POD_PATH, what="read pod")
    assert (str(raised.value), raised.value.status) == ("read pod: 502 Bad Gateway", 502)


async def test_a_2xx_answer_that_is_not_json_is_a_bad_answer_naming_the_request(open_kube):
    async with StandIn(Answer(200, b"<html>gateway</html>")) as api:
        with pytest.raises(BadAnswer) as raised:
            await open_kube(api.url).request("GET", POD_PATH, what="read pod team-a/train-0")
    assert str(raised.value) == ("read pod team-a/train-0: the API server's answer is not JSON "
                                 "(b'<html>gateway</html>')")
    assert raised.value.status == 200  # a server answered: not "unreachable" (inspect)
    assert len(api.seen) == 1


# -- transport failures -------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["GET", "PATCH"])
async def test_a_reset_request_is_transient(faulty_api: FaultyApi, open_kube, method):
    faulty_api.add_pod(NAME, {}, namespace=NS)
    faulty_api.fail(method, POD_PATH, Fault.RESET, times=None)
    with pytest.raises(Transient, match=r"^read pod: \w+"):
        await open_kube(faulty_api.url).request(method, POD_PATH, what="read pod",
                                                body=b"{}" if method == "PATCH" else None)


async def test_a_refused_connection_is_transient(open_kube):
    with pytest.raises(Transient, match=r"^read pod: ClientConnectorError"):
        await open_kube(f"http://127.0.0.1:{closed_port()}").request("GET", POD_PATH,
                                                                     what="read pod")


@pytest.mark.parametrize("method", ["GET", "PATCH"])
async def test_the_timeout_bounds_the_wait_for_an_unanswered_request(faulty_api, open_kube,
                                                                     method):
    faulty_api.add_pod(NAME, {}, namespace=NS)
    faulty_api.fail(method, POD_PATH, Fault.TIMEOUT, times=None)  # held for 1 s
    client = open_kube(faulty_api.url, request_timeout=5.0)
    started = time.monotonic()
    with pytest.raises(Transient) as raised:
        await client.request(method, POD_PATH, what="read pod", timeout=0.1,
                             body=b"{}" if method == "PATCH" else None)
    assert 0.09 <= time.monotonic() - started < 0.9
    assert str(raised.value) == "read pod: no answer in time"


async def test_the_clients_own_request_timeout_bounds_a_request_given_none(faulty_api,
                                                                          open_kube):
    faulty_api.add_pod(NAME, {}, namespace=NS)
    faulty_api.fail("GET", POD_PATH, Fault.TIMEOUT, times=None)
    started = time.monotonic()
    with pytest.raises(Transient, match="no answer in time"):
        await open_kube(faulty_api.url, request_timeout=0.1).request("GET", POD_PATH,
                                                                     what="read pod")
    assert time.monotonic() - started < 0.9


async def test_after_a_reset_the_next_request_succeeds_on_a_new_connection(faulty_api,
                                                                          open_kube):
    faulty_api.add_pod(NAME, {}, namespace=NS)
    faulty_api.fail("PATCH", POD_PATH, Fault.RESET)
    client = open_kube(faulty_api.url)
    with pytest.raises(Transient):
        await client.request("PATCH", POD_PATH, what="patch pod", content_type=MERGE_PATCH,
                             body=objects.annotation_patch({"a": "1"}))
    written = await client.request("PATCH", POD_PATH, what="patch pod",
                                   content_type=MERGE_PATCH,
                                   body=objects.annotation_patch({"a": "2"}))
    assert written["metadata"]["annotations"] == {"a": "2"}
    stats = faulty_api.stats(NS, NAME)
    assert (stats.patch_requests, stats.writes) == (2, 1)


# -- configuration -------------------------------------------------------------------------------

@pytest.mark.parametrize("host", [
    "ftp://127.0.0.1:21",
    "127.0.0.1:6443",
    "https://",
    "http://127.0.0.1:99999",
    "https://127.0.0.1:port",
], ids=["ftp", "no-scheme", "no-host", "port-out-of-range", "port-not-a-number"])
def test_a_server_url_that_is_not_http_s_host_port_path_is_a_config_error(host):
    with pytest.raises(ConfigError, match=r"is not http\(s\)://host\[:port\]\[/path\]$"):
        Kube(k8s.ApiClient(configured(host)))


@pytest.mark.parametrize("settings", [
    {"ssl_ca_cert": "missing-ca.crt"},
    {"ssl_ca_cert": "garbage.crt"},
    {"cert_file": "missing.crt", "key_file": "missing.key"},
    {"cert_file": "garbage.crt", "key_file": "garbage.crt"},
], ids=["missing-ca", "ca-that-is-not-a-certificate", "missing-client-certificate",
        "client-certificate-that-is-not-one"])
def test_tls_files_that_cannot_load_are_a_config_error_naming_tls(tmp_path, settings):
    (tmp_path / "garbage.crt").write_text("not a certificate\n")
    configuration = configured("https://127.0.0.1:6443", **{
        name: str(tmp_path / file) for name, file in settings.items()})
    with pytest.raises(ConfigError, match=r"^cannot load the TLS settings for the Kubernetes "
                                          r"API server: "):
        Kube(k8s.ApiClient(configuration))


def test_ca_data_that_is_not_a_certificate_is_a_config_error():
    with pytest.raises(ConfigError, match="cannot load the TLS settings"):
        Kube(k8s.ApiClient(configured("https://127.0.0.1:6443", ca_cert_data="garbage")))


def test_a_plain_http_server_needs_no_tls():
    assert Kube(k8s.ApiClient(configured("http://127.0.0.1:6443",
                                         ssl_ca_cert="missing.crt"))).endpoint.tls is None


# -- TLS -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def authorities() -> tuple[CertificateAuthority, CertificateAuthority]:
    return CertificateAuthority(), CertificateAuthority("someone else's CA")


@pytest.fixture
def pki(tmp_path: Path, authorities) -> dict[str, Any]:
    """A server for localhost and 127.0.0.1 that asks for (but does not need) a client
    certificate; the CA's file, another CA's, and a client certificate's pair."""
    ca, rogue = authorities
    (tmp_path / "ca.crt").write_bytes(ca.pem)
    (tmp_path / "rogue.crt").write_bytes(rogue.pem)
    server = ca.issue("localhost", server=True).write(tmp_path, "server")
    client = ca.issue("kai-component", server=False).write(tmp_path, "client")
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cadata=ca.pem.decode())
    tls.load_cert_chain(*server)
    tls.verify_mode = ssl.CERT_OPTIONAL
    return {"server_tls": tls, "ca": str(tmp_path / "ca.crt"), "ca_pem": ca.pem.decode(),
            "rogue": str(tmp_path / "rogue.crt"), "client": tuple(map(str, client))}


@pytest.mark.parametrize("given_as", ["ssl_ca_cert", "ca_cert_data"])
async def test_over_tls_the_configured_ca_is_trusted_and_the_client_certificate_shown(
        open_kube, pki, given_as):
    cert_file, key_file = pki["client"]
    ca = {"ssl_ca_cert": pki["ca"], "ca_cert_data": pki["ca_pem"]}[given_as]
    async with StandIn(Answer(200, POD), tls=pki["server_tls"]) as api:
        client = open_kube(configured(api.url, cert_file=cert_file, key_file=key_file,
                                      **{given_as: ca}))
        assert await client.request("GET", POD_PATH, what="read pod") == POD
        await client.request("GET", POD_PATH, what="read pod")
    assert [seen.client_cert for seen in api.seen] == ["kai-component"] * 2
    assert api.connections == 1
    assert api.seen[0].server_name is None  # an address is not sent as a name


async def test_over_tls_a_server_certificate_from_another_ca_is_refused(open_kube, pki):
    async with StandIn(Answer(200, POD), tls=pki["server_tls"]) as api:
        with pytest.raises(Transient, match="certificate verify failed"):
            await open_kube(configured(api.url, ssl_ca_cert=pki["rogue"])).request(
                "GET", POD_PATH, what="read pod")
    assert api.seen == []


async def test_with_verify_ssl_false_a_server_certificate_is_not_checked(open_kube, pki):
    async with StandIn(Answer(200, POD), tls=pki["server_tls"]) as api:
        client = open_kube(configured(api.url, ssl_ca_cert=pki["rogue"], verify_ssl=False,
                                      tls_server_name="not-its-name.invalid"))
        assert await client.request("GET", POD_PATH, what="read pod") == POD


@pytest.mark.parametrize("setting", ["tls_server_name", "assert_hostname"])
async def test_the_tls_server_name_is_the_name_checked_and_sent(open_kube, pki, setting):
    async with StandIn(Answer(200, POD), tls=pki["server_tls"]) as api:
        named = open_kube(configured(api.url, ssl_ca_cert=pki["ca"], **{setting: "localhost"}))
        assert await named.request("GET", POD_PATH, what="read pod") == POD
        wrong = open_kube(configured(api.url, ssl_ca_cert=pki["ca"],
                                     **{setting: "kubernetes.default.svc"}))
        with pytest.raises(Transient, match="certificate verify failed"):
            await wrong.request("GET", POD_PATH, what="read pod")
    assert [seen.server_name for seen in api.seen] == ["localhost"]


async def test_with_assert_hostname_false_only_the_certificate_is_checked(open_kube, pki):
    async with StandIn(Answer(200, POD), tls=pki["server_tls"]) as api:
        client = open_kube(configured(api.url.replace("127.0.0.1", "localhost"),
                                      ssl_ca_cert=pki["ca"], assert_hostname=False,
                                      tls_server_name=None))
        assert await client.request("GET", POD_PATH, what="read pod") == POD
        rogue = open_kube(configured(api.url, ssl_ca_cert=pki["rogue"],
                                     assert_hostname=False))
        with pytest.raises(Transient, match="certificate verify failed"):
            await rogue.request("GET", POD_PATH, what="read pod")


# -- proxies -------------------------------------------------------------------------------------

async def test_a_configured_proxy_carries_the_requests_and_the_streams(open_kube):
    """The stand-in plays the proxy: it sees the absolute target of a name that does not
    resolve, which only a proxy could reach."""
    async with StandIn(Answer(200, POD), Stream(events(("ADDED", POD)))) as proxy:
        client = open_kube(configured("http://api.invalid:6443/prefix", proxy=proxy.url))
        assert await client.request("GET", POD_PATH, what="read pod", query={"a": "1"}) == POD
        async with client.stream(objects.pods_path(), what="watch") as lines:
            assert len([line async for line in lines]) == 1
    assert [seen.target for seen in proxy.seen] == [
        f"http://api.invalid:6443/prefix{POD_PATH}?a=1",
        "http://api.invalid:6443/prefix/api/v1/pods"]
    assert proxy.seen[0].headers["host"] == "api.invalid:6443"


async def test_the_configured_proxy_headers_reach_the_proxy_of_a_plain_http_server(open_kube):
    """As the official client's ProxyManager sends them with each request (aiohttp sends
    `proxy_headers` only on a CONNECT, i.e. for an https server)."""
    async with StandIn(Answer(200, POD)) as proxy:
        client = open_kube(configured("http://api.invalid:6443", proxy=proxy.url,
                                      proxy_headers={"Proxy-Authorization": "Basic a2FpOnB3"}))
        assert await client.request("GET", POD_PATH, what="read pod") == POD
    assert proxy.seen[0].headers.get("proxy-authorization") == "Basic a2FpOnB3"


@pytest.mark.parametrize("no_proxy", ["127.0.0.1", "10.0.0.0/8,127.0.0.0/8", "*"],
                         ids=["host", "network", "all"])
async def test_a_server_named_in_no_proxy_is_reached_directly(open_kube, no_proxy):
    async with StandIn(Answer(200, POD)) as api:
        client = open_kube(configured(api.url, proxy=f"http://127.0.0.1:{closed_port()}",
                                      no_proxy=no_proxy))
        assert client.endpoint.proxy is None
        assert await client.request("GET", POD_PATH, what="read pod") == POD
    assert [seen.target for seen in api.seen] == [POD_PATH]


# -- streams -------------------------------------------------------------------------------------

LONG = {"metadata": {"name": "big", "annotations": {"blob": "x" * 300_000}}}


async def test_lines_cut_anywhere_by_the_chunks_arrive_whole(open_kube):
    body = b'{"a":1}\n{"b":2}\n\n{"c":3}\n{"d":4}'
    pieces = [body[:3], body[3:20], body[20:26], body[26:]]
    async with StandIn(Stream(pieces)) as api, \
            open_kube(api.url).stream("/w", what="watch") as lines:
        assert [line async for line in lines] == [
            b'{"a":1}', b'{"b":2}', b"", b'{"c":3}', b'{"d":4}']


async def test_a_long_line_across_many_chunks_arrives_whole(open_kube):
    (line,) = events(("MODIFIED", LONG))
    pieces = [line[i:i + 1000] for i in range(0, len(line), 1000)]
    async with StandIn(Stream([b'{"first":1}\n' + pieces[0], *pieces[1:], b'{"last":1}\n'])
                       ) as api, open_kube(api.url).stream("/w", what="watch") as lines:
        got = [got async for got in lines]
    assert got == [b'{"first":1}', line[:-1], b'{"last":1}']
    assert json.loads(got[1])["object"] == LONG


async def test_each_line_comes_as_soon_as_it_is_complete(open_kube):
    async with StandIn(Stream([b'{"a"', b':1}\n{"b":2}\n', b"tail"], then="silent", pause=0.02)
                       ) as api, \
            open_kube(api.url).stream("/w", what="watch", idle_timeout=TIMEOUT) as lines:
        assert [await anext(lines), await anext(lines)] == [b'{"a":1}', b'{"b":2}']


async def test_a_stream_is_a_get_with_the_query_and_the_official_clients_headers(open_kube):
    async with StandIn(Stream(events(("ADDED", POD)))) as api:
        client = open_kube(with_token(configured(api.url)))
        async with client.stream("/api/v1/pods", what="watch",
                                 query={"watch": "true", "resourceVersion": "7"}) as lines:
            assert [json.loads(line)["type"] async for line in lines] == ["ADDED"]
    (seen,) = api.seen
    assert (seen.method, seen.path, seen.query, seen.body) == (
        "GET", "/api/v1/pods", {"watch": "true", "resourceVersion": "7"}, b"")
    assert (seen.headers["authorization"], seen.headers["accept"]) == (
        "Bearer tok", "application/json")
    assert "content-type" not in seen.headers


@pytest.mark.parametrize(("code", "error"), [(410, Gone), (403, Forbidden), (503, Transient)])
async def test_a_refused_stream_is_the_statuss_error(open_kube, code, error):
    async with StandIn(Answer(code, status(code, "Nope", "not this watch"),
                              {"Retry-After": "3"})) as api:
        with pytest.raises(error) as raised:
            async with open_kube(api.url).stream("/api/v1/pods", what="watch pods"):
                pytest.fail("a refused stream opened")
    assert str(raised.value).startswith("watch pods: ")
    assert f"{code} Nope: not this watch" in str(raised.value)
    assert raised.value.retry_after == 3.0


async def test_a_stream_silent_longer_than_the_idle_timeout_is_transient(open_kube):
    async with StandIn(Stream([b'{"a":1}\n'], then="silent")) as api, \
            open_kube(api.url).stream("/w", what="watch", idle_timeout=0.1) as lines:
        assert await anext(lines) == b'{"a":1}'
        started = time.monotonic()
        with pytest.raises(Transient, match=r"^watch: "):
            await anext(lines)
    assert 0.09 <= time.monotonic() - started < 1


async def test_the_timeout_bounds_the_wait_for_the_head_not_for_the_body(open_kube):
    async with StandIn(Stream([b"1\n", b"2\n"], pause=0.15)) as api, \
            open_kube(api.url).stream("/w", what="watch", timeout=0.05,
                                      idle_timeout=TIMEOUT) as lines:
        assert [line async for line in lines] == [b"1", b"2"]


@pytest.mark.parametrize("idle_timeout", [None, 30.0], ids=["no-idle-timeout", "idle-timeout"])
async def test_an_unanswered_stream_is_transient_within_its_timeout(faulty_api, open_kube,
                                                                   idle_timeout):
    """`timeout` bounds the wait for the answer's head (FaultyApi holds it for 1 s)."""
    faulty_api.fail("GET", "/api/v1/pods", Fault.TIMEOUT, times=None)
    started = time.monotonic()
    with pytest.raises(Transient):
        async with open_kube(faulty_api.url).stream("/api/v1/pods", what="watch",
                                                    timeout=0.1, idle_timeout=idle_timeout):
            pytest.fail("the stream opened without an answer")
    assert time.monotonic() - started < 0.9


async def test_a_stream_reset_mid_body_is_transient(open_kube):
    async with StandIn(Stream([b'{"a":1}\n{"b"'], then="reset")) as api, \
            open_kube(api.url).stream("/w", what="watch") as lines:
        assert await anext(lines) == b'{"a":1}'
        with pytest.raises(Transient, match=r"^watch: "):
            await anext(lines)


async def test_a_streams_connection_is_not_reused_when_its_block_ends_early(open_kube):
    async with StandIn(Stream([b"1\n", b"2\n"], then="silent"), Answer(200, POD)) as api:
        client = open_kube(api.url)
        async with client.stream("/w", what="watch") as lines:
            assert await anext(lines) == b"1"
        assert await client.request("GET", POD_PATH, what="read pod") == POD
    assert api.connections == 2


async def test_close_ends_the_session_and_a_later_request_opens_a_new_one(open_kube):
    async with StandIn(Answer(200, POD)) as api:
        client = open_kube(api.url)
        await client.request("GET", POD_PATH, what="read pod")
        await client.close()
        await client.close()
        assert await client.request("GET", POD_PATH, what="read pod") == POD
    assert api.connections == 2
    await asyncio.sleep(0)


# -- what it tells its observer (the mirror's API request metric) --------------------------------

async def test_every_request_and_stream_is_told_with_its_verb_and_how_it_ended(open_kube):
    seen: list[tuple[str, str]] = []

    def told(target: str) -> Kube:
        return open_kube(target, observe=lambda verb, code: seen.append((verb, code)))

    async with StandIn(Answer(200, {})) as ok:
        await told(ok.url).request("PATCH", "/x", what="x", body={})
        await told(ok.url).read("GET", "/x", what="x")
    async with StandIn(Answer(404, status(404, "NotFound", "no such pod"))) as missing:
        with pytest.raises(NotFound):
            await told(missing.url).request("GET", "/x", what="x")
    async with StandIn(Stream(events(("ADDED", POD)))) as api, \
            told(api.url).stream("/w", what="watch") as lines:
        assert [line async for line in lines]
    async with StandIn(Answer(410, status(410, "Expired", "too old"))) as gone:
        with pytest.raises(Gone):
            async with told(gone.url).stream("/w", what="watch"):
                pytest.fail("a refused stream opened")
    closed = f"http://127.0.0.1:{closed_port()}"
    with pytest.raises(Transient):
        await told(closed).request("DELETE", "/x", what="x")
    with pytest.raises(Transient):
        async with told(closed).stream("/w", what="watch"):
            pytest.fail("a stream opened to a closed port")
    assert seen == [("PATCH", "200"), ("GET", "200"), ("GET", "404"), ("WATCH", "200"),
                    ("WATCH", "410"), ("DELETE", "unreachable"), ("WATCH", "unreachable")]
