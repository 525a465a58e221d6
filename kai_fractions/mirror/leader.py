"""One BindRequest follower among the mirror's replicas: leader election on a
coordination.k8s.io/v1 Lease, the way client-go's leaderelection does it.

Every replica serves MirrorAllocation (stateless, every write guarded); only the Lease's holder
follows BindRequests, so each check, event and signature happens once instead of once per
replica. The holder renews the Lease every `retry_seconds`; a replica that sees the same
record (holder, renewTime, ...) unchanged for `lease_seconds` by its own clock takes the Lease
over (no clock of another machine is trusted), and a holder that could not renew for
`renew_deadline_seconds` stops leading first, so two leaders never overlap while clocks run at
the same rate and renew_deadline < lease duration. Every write carries the resourceVersion
read just before (a merge patch the API server refuses with 409 when another replica wrote
first); a holder that stops releases the Lease (empty holder, duration 1 s) so a successor
need not wait out the lease.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

log = logging.getLogger(__name__)

MERGE_PATCH = "application/merge-patch+json"
LEASE_SECONDS = 15.0
RENEW_DEADLINE_SECONDS = 10.0
RETRY_SECONDS = 2.0
"""client-go's defaults (a lease of 15 s, renewed every 2 s, given up after 10 s without a
renewal)."""


class LeaseConflict(Exception):
    """Another replica wrote the Lease first (409): read it again."""


@dataclass(frozen=True, slots=True)
class ElectionConfig:
    namespace: str
    name: str
    identity: str
    lease_seconds: float = LEASE_SECONDS
    renew_deadline_seconds: float = RENEW_DEADLINE_SECONDS
    retry_seconds: float = RETRY_SECONDS

    def problems(self) -> list[str]:
        """What is wrong with these settings, one line each, naming the flag's field."""
        out = []
        for field, value in (("namespace", self.namespace), ("name", self.name),
                             ("identity", self.identity)):
            if not value:
                out.append(f"lease {field} is empty")
        if self.lease_seconds != int(self.lease_seconds) or self.lease_seconds < 1:
            out.append(f"lease duration must be a whole number of seconds >= 1 (the Lease's "
                       f"leaseDurationSeconds), got {self.lease_seconds}")
        if not self.retry_seconds > 0:
            out.append(f"retry period must be positive, got {self.retry_seconds}")
        if not self.retry_seconds < self.renew_deadline_seconds < self.lease_seconds:
            out.append(f"the durations must satisfy retry period ({self.retry_seconds}) < renew "
                       f"deadline ({self.renew_deadline_seconds}) < lease duration "
                       f"({self.lease_seconds}): a leader gives up before another takes over")
        return out


def micro_time(now: datetime.datetime | None = None) -> str:
    """A MicroTime as the API server writes one: RFC 3339 with microseconds, in UTC."""
    now = now or datetime.datetime.now(datetime.UTC)
    return now.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class KubeLease:
    """Read, create and guarded-patch one Lease through the official client (dicts in, dicts
    out: the generated models add nothing here)."""

    def __init__(self, api_client: k8s.ApiClient, namespace: str, name: str,
                 request_timeout: float = 5.0) -> None:
        self.api = k8s.CoordinationV1Api(api_client)
        self.namespace, self.name = namespace, name
        self.timeout = request_timeout

    def get(self) -> Mapping[str, Any] | None:
        try:
            response = self.api.read_namespaced_lease(self.name, self.namespace,
                                                      _preload_content=False,
                                                      _request_timeout=self.timeout)
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        return json.loads(response.data)

    def create(self, spec: Mapping[str, Any]) -> Mapping[str, Any]:
        body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": self.name, "namespace": self.namespace}, "spec": dict(spec)}
        try:
            response = self.api.create_namespaced_lease(self.namespace, body,
                                                        _preload_content=False,
                                                        _request_timeout=self.timeout)
        except ApiException as e:
            if e.status == 409:  # created by another replica meanwhile
                raise LeaseConflict(str(e.reason)) from None
            raise
        return json.loads(response.data)

    def update(self, spec: Mapping[str, Any], resource_version: str) -> Mapping[str, Any]:
        body = {"metadata": {"resourceVersion": resource_version}, "spec": dict(spec)}
        try:
            response = self.api.patch_namespaced_lease(
                self.name, self.namespace, body, _content_type=MERGE_PATCH,
                _preload_content=False, _request_timeout=self.timeout)
        except ApiException as e:
            if e.status == 409:
                raise LeaseConflict(str(e.reason)) from None
            raise
        return json.loads(response.data)


class LeaderElector:
    """Acquire, renew and release one Lease for `config.identity`. `lease` is KubeLease or a
    stand-in with the same three methods; `monotonic` judges expiry, `wall` writes times."""

    def __init__(self, lease: KubeLease, config: ElectionConfig, *,
                 monotonic: Callable[[], float] = time.monotonic,
                 wall: Callable[[], datetime.datetime] = lambda: datetime.datetime.now(
                     datetime.UTC)) -> None:
        self.lease, self.config = lease, config
        self._monotonic, self._wall = monotonic, wall
        self._observed: Mapping[str, Any] | None = None  # the last spec read or written
        self._observed_at = 0.0  # when it last changed, by this replica's clock
        self.leading = False

    def try_acquire_or_renew(self) -> bool:
        """One attempt: True when this replica holds the Lease afterwards."""
        identity, now = self.config.identity, micro_time(self._wall())
        current = self.lease.get()
        if current is None:
            spec = self._spec(acquire_time=now, renew_time=now, transitions=0)
            return self._written(self.lease.create, spec)
        observed = dict(current.get("spec") or {})
        if observed != self._observed:
            self._observed, self._observed_at = observed, self._monotonic()
        holder = str(observed.get("holderIdentity") or "")
        duration = float(observed.get("leaseDurationSeconds") or self.config.lease_seconds)
        if holder and holder != identity and \
                self._monotonic() < self._observed_at + duration:
            return False  # held by another, and renewed within its duration
        transitions = int(observed.get("leaseTransitions") or 0)
        if holder == identity:
            spec = self._spec(acquire_time=str(observed.get("acquireTime") or now),
                              renew_time=now, transitions=transitions)
        else:
            spec = self._spec(acquire_time=now, renew_time=now, transitions=transitions + 1)
        version = str((current.get("metadata") or {}).get("resourceVersion") or "")
        return self._written(lambda s: self.lease.update(s, version), spec)

    def release(self) -> None:
        """Hands the Lease back when this replica holds it: an empty holder and a duration of
        1 s, so the next replica takes over at its next attempt."""
        try:
            current = self.lease.get()
            if current is None:
                return
            spec = dict(current.get("spec") or {})
            if spec.get("holderIdentity") != self.config.identity:
                return
            now = micro_time(self._wall())
            spec.update(holderIdentity="", leaseDurationSeconds=1, renewTime=now,
                        acquireTime=now)
            version = str((current.get("metadata") or {}).get("resourceVersion") or "")
            self.lease.update(spec, version)
            log.info("released lease %s/%s", self.config.namespace, self.config.name)
        except (LeaseConflict, ApiException, OSError, ValueError) as e:
            log.warning("could not release lease %s/%s: %s (it expires on its own)",
                        self.config.namespace, self.config.name, e)

    def run(self, lead: Callable[[threading.Event], object], stop: threading.Event) -> None:
        """Until `stop`: wait to acquire the Lease, then run `lead(lost)` in a thread while
        renewing it; `lost` is set, and the thread joined, when a renewal has failed for
        `renew_deadline_seconds`, when another replica is found holding the Lease, or on
        `stop` (then the Lease is released)."""
        cfg = self.config
        while not stop.is_set():
            if not self._attempt():
                stop.wait(cfg.retry_seconds)
                continue
            log.info("leading: lease %s/%s acquired by %s", cfg.namespace, cfg.name,
                     cfg.identity)
            lost = threading.Event()
            worker = threading.Thread(target=lead, args=(lost,), name="leader-work",
                                      daemon=True)
            worker.start()
            renewed = self._monotonic()
            why = f"no renewal for {cfg.renew_deadline_seconds:.0f} s"
            while not stop.wait(cfg.retry_seconds):
                if self._attempt():
                    renewed = self._monotonic()
                elif self.holder() not in ("", cfg.identity):
                    why = f"{self.holder()} holds it"  # it judged the Lease expired: step down
                    break
                elif self._monotonic() - renewed >= cfg.renew_deadline_seconds:
                    break
            lost.set()
            worker.join()
            self.leading = False
            if stop.is_set():
                self.release()
                return
            log.warning("lost lease %s/%s: %s; following stopped", cfg.namespace, cfg.name, why)

    def holder(self) -> str:
        """The holder the Lease named when last read or written ("" when none, or not read)."""
        return str((self._observed or {}).get("holderIdentity") or "")

    def _attempt(self) -> bool:
        try:
            self.leading = self.try_acquire_or_renew()
        except Exception as e:  # the API away, a refusal, the client's transport errors
            log.warning("lease %s/%s: %r", self.config.namespace, self.config.name, e)
            self.leading = False
        return self.leading

    def _spec(self, *, acquire_time: str, renew_time: str, transitions: int) -> dict[str, Any]:
        return {"holderIdentity": self.config.identity,
                "leaseDurationSeconds": round(self.config.lease_seconds),
                "acquireTime": acquire_time, "renewTime": renew_time,
                "leaseTransitions": transitions}

    def _written(self, write: Callable[[dict[str, Any]], Mapping[str, Any]],
                 spec: dict[str, Any]) -> bool:
        try:
            written = write(spec)
        except LeaseConflict:
            return False
        self._observed = dict(written.get("spec") or spec)
        self._observed_at = self._monotonic()
        return True


SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def election_config(args: Any, env: Mapping[str, str],
                    namespace_file: str = SERVICE_ACCOUNT_NAMESPACE) -> ElectionConfig:
    """The `kai-fractions mirror --leader-elect-*` flags, with the defaults they name: the
    namespace from $POD_NAMESPACE or the service account's, the identity from $POD_NAME (the
    chart sets both from the downward API) or the host name and process id."""
    namespace = args.leader_elect_lease_namespace or env.get("POD_NAMESPACE", "")
    if not namespace:
        try:
            with open(namespace_file) as f:
                namespace = f.read().strip()
        except OSError:
            namespace = "default"
    identity = args.leader_elect_identity or env.get("POD_NAME", "") or \
        f"{socket.gethostname()}_{os.getpid()}"
    return ElectionConfig(namespace=namespace, name=args.leader_elect_lease_name,
                          identity=identity, lease_seconds=args.leader_elect_lease_duration,
                          renew_deadline_seconds=args.leader_elect_renew_deadline,
                          retry_seconds=args.leader_elect_retry_period)


def while_leading(new_source: Callable[[], Any], follow: Callable[[Any, threading.Event], object]
                  ) -> Callable[[threading.Event], None]:
    """LeaderElector.run's `lead` for a list + watch loop: `follow(source, lost)` with a
    source of its own per term, whose open watch is closed the moment the term ends (a watch
    can wait minutes for its next event; the loop must not outlive the Lease)."""

    def lead(lost: threading.Event) -> None:
        source = new_source()
        closer = threading.Thread(target=lambda: (lost.wait(), source.close()),
                                  name="leader-term-end", daemon=True)
        closer.start()
        try:
            follow(source, lost)
        finally:
            lost.set()  # should the loop end first, the closer ends too
            closer.join()

    return lead
