"""The mirror publishes the public half of its signing keys, for the node agents.

Only the mirror holds the Ed25519 private key (its Secret); node agents need the public key and
nothing more. The mirror writes it into one ConfigMap (`current`, and `previous` while a
rotation keeps an old key), which the agents mount as their `--signing-key-file` directory: a
rotated Secret reaches every node without anyone copying keys, and no node can sign.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import NoReturn

from ..kube.client import STRATEGIC_MERGE_PATCH, Kube
from ..kube.errors import Conflict, KubeError, NotFound
from ..kube.objects import configmap_path, configmaps_path
from ..signing import CURRENT, PREVIOUS, V2, KeyringSource

log = logging.getLogger(__name__)


def public_data(source: KeyringSource) -> dict[str, str]:
    """ConfigMap data: the PEM public keys of the Ed25519 keys, signing key first. Empty when
    there is none (an HMAC key has no public half: nodes then need the HMAC key itself)."""
    keys = [key for key in source.current().keys if key.version == V2]
    return {name: key.public_pem().decode() for name, key in zip((CURRENT, PREVIOUS), keys,
                                                                   strict=False)}


class Publisher:
    """Keeps the ConfigMap saying what the key files say, level-triggered: every round reads it
    and writes it again when it is missing or its keys differ, so a deleted ConfigMap (which
    every node agent mounts, as a required volume) or an edited key is put back within a round,
    not at the mirror's next restart.

    With leader election (`in_term`), only the Lease's holder patches an existing ConfigMap:
    replicas whose mounted Secrets differ during a rotation would otherwise overwrite each other
    every round. Any replica creates a missing one (a create never overwrites: the API refuses
    it when the ConfigMap exists), so that the agents can start before a leader is elected and
    while none is."""

    def __init__(self, kube: Kube, namespace: str, name: str, source: KeyringSource, *,
                 interval: float = 30.0, request_timeout: float = 10.0,
                 in_term: Callable[[], bool] | None = None) -> None:
        self.kube = kube
        self.namespace, self.name = namespace, name
        self.source = source
        self.interval = interval
        self.request_timeout = request_timeout
        self.in_term = in_term
        self._published: dict[str, str] | None = None  # what this replica last wrote
        self.ref = f"ConfigMap {namespace}/{name}"

    async def publish(self) -> bool:
        """Reads the ConfigMap and writes it when it is missing or says other keys than the key
        files; True when it wrote."""
        data = public_data(self.source)
        if not data:
            log.error("--publish-public-key: the signing key is not an Ed25519 key, so there "
                      "is no public key to publish (kai-fractions signing-keys generate)")
            return False
        path = configmap_path(self.namespace, self.name)
        try:
            stored = await self.kube.request("GET", path, what=f"read {self.ref}",
                                             timeout=self.request_timeout)
        except NotFound:
            stored = None
        metadata = {"name": self.name, "namespace": self.namespace,
                    "labels": {"app.kubernetes.io/part-of": "kai-fractions"}}
        if stored is None:
            try:
                await self.kube.request("POST", configmaps_path(self.namespace),
                                        what=f"create {self.ref}",
                                        body={"metadata": metadata, "data": data},
                                        timeout=self.request_timeout)
            except Conflict:  # another replica created it meanwhile: the next round compares
                return False
            self._written(data, "was deleted: published again" if self._published else "")
            return True
        # The agents read only these two files of the mounted ConfigMap.
        held = {k: v for k, v in (stored.get("data") or {}).items() if k in (CURRENT, PREVIOUS)}
        if held == data:
            self._published = data
            return False
        if self.in_term is not None and not self.in_term():
            log.debug("%s differs from this replica's key files; the Lease's holder "
                      "publishes", self.ref)
            return False
        # A merge patch keeps the keys it does not name: a key the Secret no longer holds is
        # removed by name (null), or a retired key, leaked perhaps, would stay trusted on every
        # node for good.
        gone = {name: None for name in (CURRENT, PREVIOUS) if name not in data}
        await self.kube.request("PATCH", path, what=f"patch {self.ref}",
                                body={"metadata": metadata, "data": {**data, **gone}},
                                content_type=STRATEGIC_MERGE_PATCH,
                                timeout=self.request_timeout)
        self._written(data, "was edited: published again" if self._published == data else "")
        return True

    def _written(self, data: dict[str, str], repaired: str) -> None:
        self._published = data
        kids = ", ".join(k.kid for k in self.source.current().keys if k.version == V2)
        if repaired:
            log.warning("%s %s (key(s) %s)", self.ref, repaired, kids)
        else:
            log.info("published the signing public key(s) %s to %s", kids, self.ref)

    async def try_publish(self) -> None:
        """`publish`, with a failure logged (it is tried again on the next round)."""
        try:
            await self.publish()
        except (KubeError, OSError) as e:
            log.warning("could not publish the signing public key to %s/%s (%s); trying "
                        "again in %g s", self.namespace, self.name, e, self.interval)

    async def run(self) -> NoReturn:
        """A publishing round every `interval` seconds, until cancelled."""
        while True:
            await self.try_publish()
            await asyncio.sleep(self.interval)
