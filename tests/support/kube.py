"""An in-memory Kubernetes API (kmock) for the official synchronous ``kubernetes`` client.

``KubeServer`` runs kmock's ``KubernetesEmulator`` (subclassed, see below) with kmock's
``Server`` on 127.0.0.1 in a background thread with its own event loop, and gives a configured
``kubernetes.client.ApiClient`` / ``CoreV1Api``. Fixture: ``kube``.

The emulator and the threaded server live in the package (``kai_fractions.sim.apiserver``:
the demo runs the same embedded API); this module adds the test client, request recording
helpers and fault injection on top, with the same public API as before.

What plain kmock 0.8 lacks, and what this module does about it:

* ``metadata.uid``, ``metadata.resourceVersion``, ``metadata.creationTimestamp``: kmock stores
  objects exactly as sent. :class:`VersionedKubernetesEmulator` adds them: every create stamps a
  fresh ``uid`` (uuid4), ``creationTimestamp`` and the next ``resourceVersion``; every successful
  write (create, patch of the object or of its status, delete) takes the next value of ONE
  server-wide counter, the way etcd revisions do. A list's ``metadata.resourceVersion`` is the
  current counter. ``generateName`` is honoured; a missing ``metadata.namespace`` is filled from
  the URL (a different one is a 400, as in Kubernetes).
* Optimistic concurrency (kmock has none): a merge/strategic patch whose ``metadata``
  carries a ``resourceVersion`` (or ``uid``) different from the stored one is refused with
  **409 Conflict** and changes nothing; a JSON patch whose ``test`` op fails is **422**, and one
  that would write a different ``resourceVersion`` is 409; ``DeleteOptions.preconditions``
  (``resourceVersion``/``uid``) are checked too (409). A create whose body carries a
  ``resourceVersion`` fails (500, "resourceVersion should not be set on objects to be created",
  like the real apiserver). Objects put straight into ``emulator.objects`` by a test have no
  ``resourceVersion``/``uid``; for them the precondition checks are skipped.
* Annotation keys (kmock checks none): a create or patch that would store a key Kubernetes
  refuses (a name part over 63 characters, a bad character) is **422 Invalid** with the API
  server's wording, changing nothing (``kai_fractions.sim.annotation_keys``).
* PUT (replace/update) is not served by kmock (404): code that needs optimistic concurrency must
  use patches carrying ``metadata.resourceVersion`` (or a JSON patch with a ``test`` op).
* Label and field selectors are IGNORED by kmock: list/watch return every object of the
  resource (in the namespace). Tests must not rely on server-side filtering.
* ``watch`` ignores ``resourceVersion``/``allowWatchBookmarks``/``timeoutSeconds``: it replays
  the current objects as ADDED, then streams changes and never ends by itself (a client with
  ``_request_timeout`` gets urllib3's ``ReadTimeoutError``). The DELETED event that follows the
  removal of the last finalizer carries the resourceVersion of that patch (no extra bump).
* Strategic merge patches are applied as JSON merge patches (lists are replaced, no
  ``$patch`` directives); server-side apply is not supported.
* Discovery of custom resources, the dynamic client and kubectl do not work against kmock.
* Cost grows with the number of stored objects (~5 ms/request at 20 pods, ~0.1 s at 500).
* kmock's own reactions (``emulator[...] << 409``) answer AFTER kmock has already applied the
  create/patch/delete to its store: a raw "409" reaction on a PATCH still changes the object.
  Use :meth:`KubeServer.fail` for faults that must leave the state untouched (checked before
  anything else, the request is still recorded).
* kmock patches aiohttp's resolver while a server runs; several servers must stop in LIFO order
  (the fixture does).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import kmock
import pytest
from kubernetes import client as k8s_client

from kai_fractions.sim.apiserver import (
    EmbeddedApiServer,
    Fault,
    PathMatch,
    VersionedKubernetesEmulator,
    _method_matches,
    _path_matches,
)


@dataclass
class KubeServer(EmbeddedApiServer):
    """kmock + the official sync client, in a background thread. Use as a context manager or
    call :meth:`start`/:meth:`stop`."""

    api_client: k8s_client.ApiClient = field(init=False)
    core: k8s_client.CoreV1Api = field(init=False)

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self, timeout: float = 10.0) -> KubeServer:
        super().start(timeout)
        self.api_client = k8s_client.ApiClient(self.configuration())
        self.core = k8s_client.CoreV1Api(self.api_client)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        if not self.running:
            return
        try:
            self.api_client.close()
        finally:
            super().stop(timeout)

    def __enter__(self) -> KubeServer:
        return self.start()

    # -- observing ----------------------------------------------------------------------------
    def requests(self, method: str | None = None, path: PathMatch = None) -> list[kmock.Request]:
        """Requests received so far (all of them, faults included), oldest first. ``path`` is
        the URL path without the query (exact string or a regex that must match fully)."""
        return [
            r
            for r in list(self.emulator)
            if _method_matches(method, r.method.value) and _path_matches(path, r.url.path)
        ]

    def count(self, method: str | None = None, path: PathMatch = None) -> int:
        return len(self.requests(method, path))

    # -- faults and reactions -----------------------------------------------------------------
    def fail(
        self,
        method: str | None,
        path: PathMatch,
        status: int,
        *,
        times: int | None = 1,
        reason: str | None = None,
        message: str | None = None,
    ) -> Fault:
        """The next ``times`` matching requests (None: all) get a Kubernetes ``Status`` error
        with ``status``, before the store is touched (state unchanged)."""
        return self.emulator.add_fault(Fault(method, path, status, times, reason, message))

    def next_requests(self, method: str, path: str, count: int = 1) -> Any:
        """A kmock view of the next ``count`` requests matching ``method`` and ``path``, for raw
        kmock reactions: ``kube.next_requests("PATCH", p) << 409``. kmock slices count ALL
        requests ever seen, hence the offset. NB: such reactions answer after the store changed.
        """
        view = self.emulator[method.lower(), path]
        seen = len(self.requests(method, path))
        return view[seen : seen + count]


def pod_manifest(name: str, namespace: str = "default", **metadata: Any) -> dict[str, Any]:
    """A minimal valid pod body (one container)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, **metadata},
        "spec": {"containers": [{"name": "main", "image": "registry.invalid/app:1"}]},
    }


@pytest.fixture
def kube() -> Iterator[KubeServer]:
    """A fresh kmock Kubernetes API with a configured sync client (``.core``, ``.api_client``)."""
    server = KubeServer().start()
    try:
        yield server
    finally:
        server.stop()


__all__ = [
    "Fault",
    "KubeServer",
    "VersionedKubernetesEmulator",
    "kube",
    "pod_manifest",
]
