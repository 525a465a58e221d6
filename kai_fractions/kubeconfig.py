"""The Kubernetes client, configured and reporting errors the same way for every component."""

from __future__ import annotations

import json
from pathlib import Path

from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException


class ConfigError(Exception):
    """No usable cluster configuration (the commands print it and exit 2)."""


def load_api_client(kubeconfig: str | None = None, *, pool_size: int = 0) -> k8s.ApiClient:
    """`kubeconfig` when given, else in-cluster, else $KUBECONFIG / ~/.kube/config.

    urllib3's own retries are off: every caller runs bounded retries of its own, and hidden
    retries would break their deadlines and failure reports. `pool_size` raises the number of
    kept connections (the client's default is one per CPU, too few for concurrent callers).
    """
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
    configuration.retries = False
    configuration.connection_pool_maxsize = max(configuration.connection_pool_maxsize or 0,
                                                pool_size)
    return k8s.ApiClient(configuration)


def api_error_message(e: ApiException) -> str:
    """`409 Conflict: <the API server's message>` from the Status body, else status + reason."""
    return status_message(e.status, e.reason, e.body)


def status_message(status: int | None, reason: str | None, body: str | bytes | None) -> str:
    """`api_error_message` from the parts of an answer (a client that is not the official one)."""
    try:
        parsed = json.loads(body or "")
        if isinstance(parsed, dict) and parsed.get("message"):
            return f"{status} {parsed.get('reason') or reason}: {parsed['message']}"
    except ValueError:
        pass
    return f"{status} {reason or ''}".strip()
