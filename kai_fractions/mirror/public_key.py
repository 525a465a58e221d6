"""The mirror publishes the public half of its signing keys, for the node agents.

Only the mirror holds the Ed25519 private key (its Secret); node agents need the public key and
nothing more. The mirror writes it into one ConfigMap (`current`, and `previous` while a
rotation keeps an old key), which the agents mount as their `--signing-key-file` directory: a
rotated Secret reaches every node without anyone copying keys, and no node can sign.

Every replica signs with its own mounted Secret, which the kubelet refreshes in each pod in its
own time: mid-rotation the replicas' key files differ by a step. The ConfigMap therefore only
moves forward: a replica whose key files are one step ahead of it (a rotation or a retirement)
writes them, Lease or not, and one whose files are a step behind leaves it while its mount may
still be catching up (see `Publisher`). An edit shaped as such a step looks the same, so leaving
one is a warning.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import NoReturn

from ..kube.client import STRATEGIC_MERGE_PATCH, Kube
from ..kube.errors import Conflict, Forbidden, KubeError, NotFound
from ..kube.objects import configmap_path, configmaps_path
from ..signing import CURRENT, PREVIOUS, V2, KeyringSource, SigningConfigError, load_ed25519

log = logging.getLogger(__name__)


def public_data(source: KeyringSource) -> dict[str, str]:
    """ConfigMap data: the PEM public keys of the Ed25519 keys, signing key first. Empty when
    there is none (an HMAC key has no public half: nodes then need the HMAC key itself)."""
    keys = [key for key in source.current().keys if key.version == V2]
    return {name: key.public_pem().decode() for name, key in zip((CURRENT, PREVIOUS), keys,
                                                                   strict=False)}


def ahead(newer: dict[str, str], older: dict[str, str]) -> bool:
    """Whether the keys `newer` are one step of a rotation past `older`: the next key, with
    `older`'s signing key kept as `previous`, or the same signing key with its `previous`
    retired. Mounts of one Secret refreshed at different times differ by such a step."""
    rotated = newer.get(PREVIOUS) is not None and newer.get(PREVIOUS) == older.get(CURRENT)
    retired = newer.get(CURRENT) == older.get(CURRENT) and PREVIOUS in older \
        and PREVIOUS not in newer
    return rotated or retired


def key_ids(pems: dict[str, str]) -> str:
    """`current <kid>, previous <kid>` of ConfigMap data, for a log line (an edit may have put
    anything there)."""
    named = []
    for name in (CURRENT, PREVIOUS):
        if name in pems:
            try:
                kid = load_ed25519(pems[name].encode(), what=name).kid
            except SigningConfigError:
                kid = "(not an Ed25519 public key)"
            named.append(f"{name} {kid}")
    return ", ".join(named) or "no keys"


class Publisher:
    """Keeps the ConfigMap saying what the key files say: every round reads it and creates it
    when it is missing, so a deleted ConfigMap (which every node agent mounts, as a required
    volume) is back within a round, not at the mirror's next restart.

    A ConfigMap one step ahead of this replica's key files (see `ahead`: the kubelet has not
    refreshed this pod's Secret yet) is left as it is, by any replica, the Lease's holder too,
    for up to `catch_up` seconds from when it first went ahead of these files (a new edit does
    not start them again); it is a difference like any other (below) past that, or at once
    when this replica last wrote or read those very keys and its own files went back: the
    Secret itself went back (a rotation undone, a retired `previous` put back), and a key
    withdrawn from it must not stay trusted on the nodes for good. Leaving it is a warning,
    once for each stored state: an edit shaped as a rotation (the editor's key as `current`,
    the real one as `previous`) looks the same, and nodes trust its key meanwhile.

    Any other difference is patched when this replica's own key files changed since it last
    wrote or read it, except, with leader election (`in_term`), by a replica that does not hold
    the Lease: that one writes only keys one step ahead of the stored ones (the rotation it saw
    first: it already signs with the new key, which the nodes need). The Lease's holder also
    puts back any other difference (an edit, or keys two rotations ahead of its mount: two
    rotations within a kubelet refresh are not supported); without election a replica never
    overwrites one merely because it differs. So replicas mid-rotation cannot take turns
    rewriting it: every write but an edit put back or a Secret gone back is a step forward. Any
    replica creates a missing one (a create never overwrites: the API refuses it when the
    ConfigMap exists), so that the agents can start before a leader is elected and while none
    is.

    Without `get` on the ConfigMap (a Role older than the chart's, or a custom one) it is
    written as before reads: patched (created when missing) when the key files change."""

    def __init__(self, kube: Kube, namespace: str, name: str, source: KeyringSource, *,
                 interval: float = 30.0, request_timeout: float = 10.0,
                 in_term: Callable[[], bool] | None = None, catch_up: float = 300.0,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.kube = kube
        self.namespace, self.name = namespace, name
        self.source = source
        self.interval = interval
        self.request_timeout = request_timeout
        self.in_term = in_term
        # Longer than a kubelet takes to refresh a pod's mounted Secret (its sync period plus
        # its cache's TTL, about a minute each by default).
        self.catch_up = catch_up
        self.monotonic = monotonic
        self._published: dict[str, str] | None = None  # what this replica last wrote or read
        self._told_no_get = False  # the missing `get` is logged once, not every round
        # (own keys, since when) while the stored ones are a step ahead of them
        self._behind: tuple[dict[str, str], float] | None = None
        self._told_ahead: dict[str, str] | None = None  # the stored keys last warned about
        self.ref = f"ConfigMap {namespace}/{name}"

    async def publish(self) -> bool:
        """Reads the ConfigMap and writes it when it is missing, or differs and this replica
        may overwrite it (see the class); True when it wrote."""
        data = public_data(self.source)
        if not data:
            log.error("--publish-public-key: the signing key is not an Ed25519 key, so there "
                      "is no public key to publish (kai-fractions signing-keys generate)")
            return False
        try:
            stored = await self.kube.request("GET", configmap_path(self.namespace, self.name),
                                             what=f"read {self.ref}",
                                             timeout=self.request_timeout)
        except NotFound:
            stored = None
        except Forbidden as e:
            if e.status != 403:  # credentials refused: every other request would be too
                raise
            return await self._write_unread(data, e)
        self._told_no_get = False
        if stored is None:
            if not await self._create(data):
                return False
            if self._published is not None:
                self._written(data, logging.WARNING,
                              "%s was deleted: created it again with the signing public key(s) %s")
            else:
                self._written(data, logging.INFO, "created %s with the signing public key(s) %s")
            return True
        # The agents read only these two files of the mounted ConfigMap.
        held = {k: v for k, v in (stored.get("data") or {}).items() if k in (CURRENT, PREVIOUS)}
        if held == data:
            self._published, self._behind, self._told_ahead = data, None, None
            return False
        if self._waits_for_mount(data, held):
            return False
        changed_here = data != self._published  # this replica's key files, since it last looked
        # This replica's files a step past the stored keys: it signs with a key the nodes need,
        # so it publishes it, whoever holds the Lease, and again should a replica whose mount
        # lags (past `catch_up`) have put the older keys back.
        forward = ahead(data, held)
        if self.in_term is None and not (changed_here or forward):
            log.debug("%s differs from this replica's key files, which did not change: without "
                      "--leader-elect it is overwritten only when they do", self.ref)
            return False
        if self.in_term is not None and not self.in_term() and not forward:
            log.debug("%s differs from this replica's key files; the Lease's holder "
                      "publishes", self.ref)
            return False
        await self._patch(data)
        if changed_here:
            self._written(data, logging.INFO,
                          "updated %s to the signing public key(s) %s (it held other keys)")
        elif forward:
            self._written(data, logging.WARNING, "%s was changed since this replica last "
                          "wrote or read it, to older keys than it signs with (an edit, or a "
                          "replica whose mount of the signing Secret lags by more than a "
                          "refresh put them back): published again the signing public key(s) "
                          "%s")
        elif self._behind is not None:
            self._written(data, logging.WARNING, "%s held keys one step ahead of this replica's "
                          "key files for longer than a mounted Secret takes to refresh (a "
                          "rotation undone in the Secret, or an edit): updated it to the signing "
                          "public key(s) %s")
        elif set(held.values()) - set(data.values()):
            kids = key_ids(held).replace("%", "%%")
            self._written(data, logging.WARNING, "%s holds keys this replica's key files do not "
                          f"hold ({kids}: its mount of the signing Secret behind by more than "
                          "one step, or an edit): updated it again to the signing public "
                          "key(s) %s")
        else:
            self._written(data, logging.WARNING, "%s was changed since this replica last wrote "
                          "or read it: updated it again to the signing public key(s) %s")
        return True

    def _waits_for_mount(self, data: dict[str, str], held: dict[str, str]) -> bool:
        """Whether the stored keys are a step ahead of this replica's and it leaves them, its
        mount of the Secret perhaps not refreshed yet (a warning, once for each stored state:
        an edit shaped as a rotation looks the same)."""
        if not ahead(held, data) or held == self._published:
            # A mount refreshed late only moves forward: keys this replica itself held before
            # its files went back are the Secret going back.
            self._behind = self._told_ahead = None
            return False
        now = self.monotonic()
        # The time counts from when the stored keys went ahead of these files: a mount's lag
        # does not start again when they change again (an edit after an edit).
        if self._behind is None or self._behind[0] != data:
            self._behind = (data, now)
        if held != self._told_ahead:
            self._told_ahead = held
            fate = (f"which the Lease's holder puts back after {self.catch_up:g} s"
                    if self.in_term is not None else
                    "which without --leader-elect stays until a replica's key files change or the "
                    "mirror restarts")
            log.warning("%s holds signing public keys (%s) one step ahead of this replica's "
                        "key files (%s): a rotation this replica's mount of the signing Secret "
                        "has not caught up with (the kubelet refreshes it within minutes, and "
                        "this goes away), or an edit, %s: left as it is", self.ref,
                        key_ids(held), key_ids(data), fate)
        return now - self._behind[1] < self.catch_up

    async def _write_unread(self, data: dict[str, str], e: Forbidden) -> bool:
        """The write without a read, for a Role without `get` on the ConfigMap: a patch (a
        create when it is missing) when the key files changed since this replica wrote them."""
        if not self._told_no_get:
            self._told_no_get = True
            log.warning("%s: the mirror may not get it (%s): it is written only when the key "
                        "files change, and not put back after a deletion or an edit until its "
                        "Role allows get on it (as the chart's does)", self.ref, e.answer)
        if data == self._published:
            return False
        try:
            await self._patch(data)
        except NotFound:
            if not await self._create(data):
                return False
            self._written(data, logging.INFO, "created %s with the signing public key(s) %s")
            return True
        self._written(data, logging.INFO, "updated %s to the signing public key(s) %s")
        return True

    def _metadata(self) -> dict:
        return {"name": self.name, "namespace": self.namespace,
                "labels": {"app.kubernetes.io/part-of": "kai-fractions"}}

    async def _create(self, data: dict[str, str]) -> bool:
        """Creates the ConfigMap; False when another replica created it meanwhile (the next
        round reads it)."""
        try:
            await self.kube.request("POST", configmaps_path(self.namespace),
                                    what=f"create {self.ref}",
                                    body={"metadata": self._metadata(), "data": data},
                                    timeout=self.request_timeout)
        except Conflict:
            return False
        return True

    async def _patch(self, data: dict[str, str]) -> None:
        # A merge patch keeps the keys it does not name: a key the Secret no longer holds is
        # removed by name (null), or a retired key, leaked perhaps, would stay trusted on every
        # node for good.
        gone = {name: None for name in (CURRENT, PREVIOUS) if name not in data}
        await self.kube.request("PATCH", configmap_path(self.namespace, self.name),
                                what=f"patch {self.ref}",
                                body={"metadata": self._metadata(), "data": {**data, **gone}},
                                content_type=STRATEGIC_MERGE_PATCH,
                                timeout=self.request_timeout)

    def _written(self, data: dict[str, str], level: int, message: str) -> None:
        """Remembers what this replica wrote and logs it: `message` takes the ConfigMap and the
        key ids."""
        self._published = data
        self._behind = self._told_ahead = None  # the stored keys are this replica's own now
        kids = ", ".join(k.kid for k in self.source.current().keys if k.version == V2)
        log.log(level, message, self.ref, kids)

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
