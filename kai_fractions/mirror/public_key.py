"""The mirror publishes the public half of its signing keys, for the node agents.

Only the mirror holds the Ed25519 private key (its Secret); node agents need the public key and
nothing more. The mirror writes it into one ConfigMap (`current`, and `previous` while a
rotation keeps an old key), which the agents mount as their `--signing-key-file` directory: a
rotated Secret reaches every node without anyone copying keys, and no node can sign.
"""

from __future__ import annotations

import logging
import threading

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from ..signing import CURRENT, PREVIOUS, V2, KeyringSource

log = logging.getLogger(__name__)


def public_data(source: KeyringSource) -> dict[str, str]:
    """ConfigMap data: the PEM public keys of the Ed25519 keys, signing key first. Empty when
    there is none (an HMAC key has no public half: nodes then need the HMAC key itself)."""
    keys = [key for key in source.current().keys if key.version == V2]
    return {name: key.public_pem().decode() for name, key in zip((CURRENT, PREVIOUS), keys,
                                                                   strict=False)}


class Publisher:
    def __init__(self, api_client: k8s.ApiClient, namespace: str, name: str,
                 source: KeyringSource, *, interval: float = 30.0) -> None:
        self.core = k8s.CoreV1Api(api_client)
        self.namespace, self.name = namespace, name
        self.source = source
        self.interval = interval
        self._published: dict[str, str] | None = None

    def publish(self) -> bool:
        """Writes the ConfigMap when what it should say changed; True when it wrote."""
        data = public_data(self.source)
        if not data:
            log.error("--publish-public-key: the signing key is not an Ed25519 key, so there "
                      "is no public key to publish (kai-fractions signing-keys generate)")
            return False
        if data == self._published:
            return False
        body = {"metadata": {"name": self.name, "namespace": self.namespace,
                             "labels": {"app.kubernetes.io/part-of": "kai-fractions"}},
                "data": data}
        try:
            self.core.patch_namespaced_config_map(self.name, self.namespace, body)
        except ApiException as e:
            if e.status != 404:
                raise
            self.core.create_namespaced_config_map(self.namespace, body)
        self._published = data
        log.info("published the signing public key(s) %s to ConfigMap %s/%s",
                 ", ".join(k.kid for k in self.source.current().keys if k.version == V2),
                 self.namespace, self.name)
        return True

    def try_publish(self) -> None:
        """`publish`, with a failure logged (it is tried again on the next round)."""
        try:
            self.publish()
        except (ApiException, OSError) as e:
            log.warning("could not publish the signing public key to %s/%s (%s); trying "
                        "again in %g s", self.namespace, self.name, e, self.interval)

    def run(self, stop: threading.Event) -> None:
        """Publishes now and after every change of the key files, until `stop`."""
        while True:
            self.try_publish()
            if stop.wait(self.interval):
                return
