"""Where the API server is and who we are to it: the official client's `Configuration`,
loaded the same way for every component (a kubeconfig file, else in-cluster, else
$KUBECONFIG / ~/.kube/config), and what an HTTP session needs from it (TLS, proxy, headers).

The official client keeps supplying the credentials: a token refreshed by in-cluster rotation is
read through it on every request (`auth_headers`). A kubeconfig user's `tokenFile`, which it
reads only once, is read again every minute, and an exec plugin is run off the event loop,
under a timeout and again after a 401 (`credentials`: `TokenFile`, `ExecCredential`).
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import yaml
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.rest import should_bypass_proxies
from kubernetes.config import incluster_config, kube_config
from kubernetes.config.exec_provider import ExecProvider

from .credentials import (  # re-exported: importers take them from here
    CredentialError,
    ExecCredential,
    TokenFile,
    _InClusterLoader,
    _name_refresh,
)

NAMESPACE_ATTRIBUTE = "kai_fractions_namespace"
"""The Configuration attribute load_api_client sets to the namespace its source names (see
`default_namespace`)."""


class ConfigError(Exception):
    """No usable cluster configuration (the commands print it and exit 2)."""


def load_api_client(kubeconfig: str | None = None) -> k8s.ApiClient:
    """`kubeconfig` when given, else in-cluster, else $KUBECONFIG / ~/.kube/config."""
    configuration = k8s.Configuration()
    try:
        if kubeconfig:
            if not Path(kubeconfig).is_file():
                raise ConfigError(f"--kubeconfig {kubeconfig}: no such file")
            _load_kube_config(configuration, kubeconfig)
        else:
            try:
                _InClusterLoader(incluster_config.SERVICE_TOKEN_FILENAME,
                                 incluster_config.SERVICE_CERT_FILENAME
                                 ).load_and_set(configuration)
                _name_refresh(configuration, "the in-cluster service account token "
                              f"{incluster_config.SERVICE_TOKEN_FILENAME}")
                setattr(configuration, NAMESPACE_ATTRIBUTE, _in_cluster_namespace())
            except k8s_config.ConfigException:
                _load_kube_config(configuration, kube_config.KUBE_CONFIG_DEFAULT_LOCATION)
    except (k8s_config.ConfigException, OSError, ValueError) as e:
        # Without --kubeconfig, say where it looked and how to point it elsewhere.
        where = "" if kubeconfig else (
            " (looked for the in-cluster service account, then "
            f"{kube_config.KUBE_CONFIG_DEFAULT_LOCATION}); pass --kubeconfig FILE or set "
            "$KUBECONFIG")
        raise ConfigError(f"cannot load a Kubernetes configuration: {e}{where}") from None
    return k8s.ApiClient(configuration)


def default_namespace(api_client: k8s.ApiClient) -> str | None:
    """The namespace the configuration load_api_client loaded names, kubectl's default for
    -n: the kubeconfig's current context's `namespace`, or in a pod the service account's
    `namespace` file (beside its token); None when it names none (kubectl then says
    `default`)."""
    namespace = getattr(api_client.configuration, NAMESPACE_ATTRIBUTE, None)
    return namespace if isinstance(namespace, str) and namespace else None


def _in_cluster_namespace() -> str | None:
    path = Path(incluster_config.SERVICE_TOKEN_FILENAME).with_name("namespace")
    try:
        return path.read_text().strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def _load_kube_config(configuration: k8s.Configuration, paths: str) -> None:
    """`load_kube_config`'s own two steps, keeping its loader: a token from the user's
    tokenFile is then read again every TOKEN_FILE_SECONDS, as client-go does, and one from an
    exec plugin is had again by `ExecCredential`."""
    for path in filter(None, paths.split(os.pathsep)):
        check_kubeconfig_file(os.path.expanduser(path))
    try:
        loader = kube_config._get_kube_config_loader(filename=paths, persist_config=True)
        loader.load_and_set(configuration)
    except (TypeError, AttributeError, KeyError) as e:
        # The loader's own crash on a field of the wrong shape (`context: 7`, say).
        raise ConfigError(f"kubeconfig {paths}: not a valid kubeconfig: {type(e).__name__}: "
                          f"{e}") from None
    # The context's namespace, from the loader's own parse (current_context: the context's
    # mapping, with `name` and `context`).
    context = loader.current_context.get("context") or {}
    setattr(configuration, NAMESPACE_ATTRIBUTE,
            context.get("namespace") if isinstance(context, dict) else None)
    user = loader._user  # the current context's user; the loader has no public accessor
    # The loader's order: an auth-provider first, then `token`, then `tokenFile`.
    if user and "tokenFile" in user and "token" not in user and "auth-provider" not in user:
        base = os.path.dirname(os.path.abspath(user.path)) if user.path else ""
        token_file = TokenFile(os.path.normpath(os.path.join(base, user["tokenFile"])))
        configuration.api_key["BearerToken"] = token_file.token
        configuration.refresh_api_key_hook = token_file
        return
    name = (loader.current_context.get("context") or {}).get("user")
    token = loader.__dict__.get("token")
    if user and "exec" in user and not any(
            key in user for key in ("auth-provider", "token", "tokenFile")) and (
            token or not loader.__dict__.get("cert_file")):
        # The token the loader's own run of the plugin gave, stripped as every later run's is
        # (the loader sends it as the plugin wrote it: a newline in it made every request
        # fail); or none, when that run failed: the plugin then runs before the first request
        # (a plugin that gave a client certificate leaves no token: that is read once, at the
        # start).
        plugin = ExecProvider(user["exec"], loader._get_base_path(loader._cluster.path),
                              loader._cluster)
        token = token.removeprefix("Bearer ").strip() if isinstance(token, str) else ""
        hook = ExecCredential(
            plugin, f"Bearer {token}" if token else "", loader.__dict__.get("expiry"),
            f"the exec plugin {plugin.args[0]} of the kubeconfig's user {name!r}")
        # Set even when empty: the official client asks the hook only for a key it holds.
        configuration.api_key["BearerToken"] = hook.token
        configuration.refresh_api_key_hook = hook
    else:
        _name_refresh(configuration, f"the kubeconfig's user {name!r}")


def check_kubeconfig_file(path: str) -> None:
    """ConfigError naming `path` and the problem when the file is not YAML, or not a mapping
    whose clusters, contexts and users are lists of mappings (the official loader raises a
    YAML error or a TypeError then, a traceback to a user). A missing file is left to the
    loader, which skips one in $KUBECONFIG's list."""
    if not os.path.exists(path):
        return
    try:
        data = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}:{mark.column + 1}" if mark is not None else ""
        problem = " ".join(str(getattr(e, "problem", None) or e).split())
        raise ConfigError(f"kubeconfig {path}: not valid YAML{where}: {problem}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"kubeconfig {path}: cannot be read: {e}") from None
    if data is None:
        return  # the loader says an empty file is empty
    if not isinstance(data, dict):
        raise ConfigError(f"kubeconfig {path}: not a mapping (a kubeconfig's top level is one: "
                          f"apiVersion, clusters, contexts, users...), got a "
                          f"{type(data).__name__}")
    for field in ("clusters", "contexts", "users"):
        value = data.get(field)
        if value is not None and not (isinstance(value, list) and all(
                isinstance(item, dict) and "name" in item for item in value)):
            raise ConfigError(f"kubeconfig {path}: {field} must be a list of mappings, each "
                              "with a name")


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
    its cookie, and its credentials as of now (a refreshed token included). CredentialError
    when they cannot be had."""
    headers = {**client.default_headers, "Accept": "application/json"}
    if client.cookie:
        headers["Cookie"] = client.cookie
    try:
        client.update_params_for_auth(headers, [], ["BearerToken"], path, method, body)
    except Exception as e:  # the refresh hook's: a token file unread, a plugin that failed
        source = getattr(client.configuration.refresh_api_key_hook, "source",
                         "the configuration's refresh_api_key_hook")
        raise CredentialError(f"cannot get credentials from {source}: "
                              f"{type(e).__name__}: {e}") from e
    return headers
