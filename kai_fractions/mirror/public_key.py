"""The mirror publishes the public half of its signing keys, for the node agents.

Only the mirror holds the Ed25519 private key (its Secret); node agents need the public key and
nothing more. The mirror writes it into one ConfigMap (`current`, and `previous` while a
rotation keeps an old key), which the agents mount as their `--signing-key-file` directory: a
rotated Secret reaches every node without anyone copying keys, and no node can sign.
"""

from __future__ import annotations

import asyncio
import logging
from typing import NoReturn

from ..kube.client import STRATEGIC_MERGE_PATCH, Kube
from ..kube.errors import KubeError, NotFound
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
    def __init__(self, kube: Kube, namespace: str, name: str, source: KeyringSource, *,
                 interval: float = 30.0, request_timeout: float = 10.0) -> None:
        self.kube = kube
        self.namespace, self.name = namespace, name
        self.source = source
        self.interval = interval
        self.request_timeout = request_timeout
        self._published: dict[str, str] | None = None

    async def publish(self) -> bool:
        """Writes the ConfigMap when what it should say changed; True when it wrote."""
        data = public_data(self.source)
        if not data:
            log.error("--publish-public-key: the signing key is not an Ed25519 key, so there "
                      "is no public key to publish (kai-fractions signing-keys generate)")
            return False
        if data == self._published:
            return False
        metadata = {"name": self.name, "namespace": self.namespace,
                    "labels": {"app.kubernetes.io/part-of": "kai-fractions"}}
        # A merge patch keeps the keys it does not name: a key the Secret no longer holds is
        # removed by name (null), or a retired key, leaked perhaps, would stay trusted on every
        # node for good.
        gone = {name: None for name in (CURRENT, PREVIOUS) if name not in data}
        ref = f"ConfigMap {self.namespace}/{self.name}"
        try:
            await self.kube.request("PATCH", configmap_path(self.namespace, self.name),
                                    what=f"patch {ref}",
                                    body={"metadata": metadata, "data": {**data, **gone}},
                                    content_type=STRATEGIC_MERGE_PATCH,
                                    timeout=self.request_timeout)
        except NotFound:
            await self.kube.request("POST", configmaps_path(self.namespace),
                                    what=f"create {ref}",
                                    body={"metadata": metadata, "data": data},
                                    timeout=self.request_timeout)
        self._published = data
        log.info("published the signing public key(s) %s to ConfigMap %s/%s",
                 ", ".join(k.kid for k in self.source.current().keys if k.version == V2),
                 self.namespace, self.name)
        return True

    async def try_publish(self) -> None:
        """`publish`, with a failure logged (it is tried again on the next round)."""
        try:
            await self.publish()
        except (KubeError, OSError) as e:
            log.warning("could not publish the signing public key to %s/%s (%s); trying "
                        "again in %g s", self.namespace, self.name, e, self.interval)

    async def run(self) -> NoReturn:
        """Publishes now and after every change of the key files, until cancelled."""
        while True:
            await self.try_publish()
            await asyncio.sleep(self.interval)
