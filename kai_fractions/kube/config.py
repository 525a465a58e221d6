"""Where the API server is and who we are to it: the official client's `Configuration`,
loaded the same way for every component (a kubeconfig file, else in-cluster, else
$KUBECONFIG / ~/.kube/config), and what an HTTP session needs from it (TLS, proxy, headers).

The official client keeps supplying the credentials: a token refreshed by in-cluster rotation or
an exec plugin is read through it on every request (`auth_headers`).
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.rest import should_bypass_proxies


class ConfigError(Exception):
    """No usable cluster configuration (the commands print it and exit 2)."""


def load_api_client(kubeconfig: str | None = None) -> k8s.ApiClient:
    """`kubeconfig` when given, else in-cluster, else $KUBECONFIG / ~/.kube/config."""
    configuration = k8s.Configuration()
    try:
        if kubeconfig:
            if not Path(kubeconfig).is_file():
                raise ConfigError(f"--kubeconfig {kubeconfig}: no such file")
            k8s_config.load_kube_config(config_file=kubeconfig,
                                        client_configuration=configuration)
        else:
            try:
                k8s_config.load_incluster_config(client_configuration=configuration)
            except k8s_config.ConfigException:
                k8s_config.load_kube_config(client_configuration=configuration)
    except (k8s_config.ConfigException, OSError, ValueError) as e:
        raise ConfigError(f"cannot load a Kubernetes configuration: {e}") from None
    return k8s.ApiClient(configuration)


@dataclass(frozen=True, slots=True)
class Endpoint:
    """The server as an HTTP session reaches it."""

    base_url: str
    """Scheme, host, port and the path the API is served under (an API gateway's prefix)."""
    tls: ssl.SSLContext | None
    server_hostname: str | None
    """The name the server's certificate is checked against, when it is not the URL's host."""
    proxy: str | None
    proxy_headers: dict[str, str] | None


def endpoint(configuration: k8s.Configuration) -> Endpoint:
    """Raises ConfigError for a server URL or TLS settings that cannot work."""
    url = urlsplit(configuration.host)
    try:
        port = url.port  # raises ValueError for a port that is not one
    except ValueError:
        port = -1
    if url.scheme not in ("http", "https") or not url.hostname or port == -1:
        raise ConfigError(f"the Kubernetes API server URL {configuration.host!r} is not "
                          "http(s)://host[:port][/path]")
    tls = None
    if url.scheme == "https":
        try:
            tls = tls_context(configuration)
        except (OSError, ValueError) as e:  # ssl.SSLError is an OSError
            raise ConfigError(f"cannot load the TLS settings for the Kubernetes API "
                              f"server: {e}") from None
    assert_name = configuration.assert_hostname
    server_hostname = configuration.tls_server_name or (
        assert_name if isinstance(assert_name, str) else None)
    proxy = None
    if configuration.proxy and not should_bypass_proxies(configuration.host,
                                                         configuration.no_proxy or ""):
        proxy = configuration.proxy
    return Endpoint(configuration.host.rstrip("/"), tls, server_hostname or None, proxy,
                    dict(configuration.proxy_headers or {}) or None)


def tls_context(configuration: k8s.Configuration) -> ssl.SSLContext:
    """The TLS the official client would use: its CA (file or data), client certificate,
    `verify_ssl` and `assert_hostname`."""
    context = ssl.create_default_context(cafile=configuration.ssl_ca_cert,
                                         cadata=configuration.ca_cert_data)
    if configuration.cert_file:
        context.load_cert_chain(configuration.cert_file, configuration.key_file)
    if not configuration.verify_ssl:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    elif configuration.assert_hostname is False:
        context.check_hostname = False
    return context


def auth_headers(client: k8s.ApiClient, method: str, path: str, body: bytes | None
                 ) -> dict[str, str]:
    """What the official client sends with such a request: its default headers (User-Agent),
    its cookie, and its credentials as of now (a refreshed token included)."""
    headers = {**client.default_headers, "Accept": "application/json"}
    if client.cookie:
        headers["Cookie"] = client.cookie
    client.update_params_for_auth(headers, [], ["BearerToken"], path, method, body)
    return headers
