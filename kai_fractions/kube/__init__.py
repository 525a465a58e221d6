"""The one way to the Kubernetes API, for every component.

- `config`: the official client's configuration (kubeconfig, in-cluster, exec plugins, proxy)
  and what an HTTP session needs from it;
- `errors`: one error tree, and the one mapping from an answer to an error;
- `client.Kube`: requests and watch streams over aiohttp, on an event loop;
- `retry`: bounded, jittered retries within a caller's deadline;
- `listwatch`: the one list + watch loop (resourceVersion, 410 Gone, bookmarks, backoff);
- `objects`: paths, the guarded annotation patch, pod events;
- `blocking.BlockingKube`: the same, for threaded components.
"""

from .client import MERGE_PATCH, STRATEGIC_MERGE_PATCH, Kube
from .config import ConfigError, load_api_client
from .errors import (
    BadAnswer,
    Conflict,
    DeadlineExceeded,
    Forbidden,
    Gone,
    Invalid,
    KubeError,
    NotFound,
    Transient,
    Unavailable,
)

__all__ = [
    "MERGE_PATCH", "STRATEGIC_MERGE_PATCH", "BadAnswer", "ConfigError", "Conflict",
    "DeadlineExceeded", "Forbidden", "Gone", "Invalid", "Kube", "KubeError", "NotFound",
    "Transient", "Unavailable", "load_api_client",
]
