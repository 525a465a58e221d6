"""The API's paths and the few object shapes every component sends: quoted paths of pods,
nodes, leases and custom resources, a guarded annotation merge patch, a pod event, and the name
of a node agent's heartbeat Lease."""

from __future__ import annotations

import datetime
import json
import time
import uuid
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

from ..contract.names import is_dns_label


def _q(part: str) -> str:
    return quote(part, safe="")


def epoch_seconds(timestamp: Any) -> float | None:
    """An RFC 3339 time of the API server (UTC when it names no zone) as seconds since the
    epoch; None when it is not one."""
    try:
        then = datetime.datetime.fromisoformat(timestamp)
    except (TypeError, ValueError):
        return None
    if then.tzinfo is None:
        then = then.replace(tzinfo=datetime.UTC)
    return then.timestamp()


def seconds_since(timestamp: Any, now: float | None = None) -> float | None:
    """Seconds from an RFC 3339 time (a creationTimestamp, a condition's lastHeartbeatTime) to
    `now` (at least 0: the API server's clock and ours differ a little); None when it is not
    one."""
    then = epoch_seconds(timestamp)
    return None if then is None else max(0.0, (time.time() if now is None else now) - then)


def condition_time(now: float) -> str:
    """A condition's time (lastHeartbeatTime, lastTransitionTime) as the API server writes
    one: whole seconds, UTC."""
    return datetime.datetime.fromtimestamp(int(now), datetime.UTC).strftime(
        "%Y-%m-%dT%H:%M:%SZ")


def pods_path(namespace: str | None = None) -> str:
    """Every namespace's pods when `namespace` is None."""
    return f"/api/v1/namespaces/{_q(namespace)}/pods" if namespace else "/api/v1/pods"


def pod_path(namespace: str, name: str) -> str:
    return f"{pods_path(namespace)}/{_q(name)}"


def node_path(node: str) -> str:
    return f"/api/v1/nodes/{_q(node)}"


def configmaps_path(namespace: str) -> str:
    return f"/api/v1/namespaces/{_q(namespace)}/configmaps"


def configmap_path(namespace: str, name: str) -> str:
    return f"{configmaps_path(namespace)}/{_q(name)}"


def events_path(namespace: str) -> str:
    return f"/api/v1/namespaces/{_q(namespace)}/events"


def namespaced_path(group: str, version: str, plural: str, namespace: str | None,
                    name: str | None = None) -> str:
    """A resource of an API group (`apps`, `coordination.k8s.io`, a custom resource's);
    cluster-wide when `namespace` is None."""
    base = f"/apis/{group}/{version}"
    if namespace:
        base += f"/namespaces/{_q(namespace)}"
    base += f"/{plural}"
    return f"{base}/{_q(name)}" if name else base


LEASES = ("coordination.k8s.io", "v1", "leases")


def lease_path(namespace: str, name: str | None = None) -> str:
    return namespaced_path(*LEASES, namespace, name)


def lease_body(namespace: str, name: str, spec: Mapping[str, Any],
               labels: Mapping[str, str] | None = None) -> dict[str, Any]:
    """A Lease to create (the follower's election, a node agent's heartbeat)."""
    metadata: dict[str, Any] = {"name": name, "namespace": namespace}
    if labels:
        metadata["labels"] = dict(labels)
    return {"apiVersion": f"{LEASES[0]}/{LEASES[1]}", "kind": "Lease", "metadata": metadata,
            "spec": dict(spec)}


def namespace_flag_problem(flag: str, value: str) -> str | None:
    """Why `value` cannot be the namespace a flag names (None: it can), as the CLIs say it."""
    if is_dns_label(value):
        return None
    return (f"{flag} {value!r}: not a namespace name (lower-case letters, digits and '-', "
            "at most 63)")


def micro_time(now: float) -> str:
    """A Lease's MicroTime (acquireTime, renewTime) as the API server writes one: RFC 3339 with
    microseconds, in UTC."""
    return datetime.datetime.fromtimestamp(now, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


HEARTBEAT_LEASE_PREFIX = "kai-fractions-agent."
"""The chart's own-node policy names it too: an agent may write only its node's Lease."""


def heartbeat_lease_name(node: str) -> str | None:
    """The Lease a node's agent renews to say it is alive (in the release's namespace); None
    when the name would pass the 253 characters of an object name (the agent then beats on its
    Node's condition, as before Leases)."""
    name = HEARTBEAT_LEASE_PREFIX + node
    return name if node and len(name) <= 253 else None


def meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    """The object's metadata; {} when it has none, or none that is a mapping (an object no
    schema checked must not stop a list or a watch)."""
    value = obj.get("metadata")
    return value if isinstance(value, Mapping) else {}


def uid_of(obj: Mapping[str, Any]) -> str:
    return str(meta(obj).get("uid") or "")


def resource_version(obj: Mapping[str, Any]) -> str:
    return str(meta(obj).get("resourceVersion") or "")


def later_version(a: str, b: str) -> bool:
    """Whether resourceVersion `a` is later than `b`. resourceVersions are opaque in general
    but integers on every API server in practice; anything else counts as "not later"."""
    try:
        return int(a) > int(b)
    except ValueError:
        return False


def annotation_patch(changes: Mapping[str, str | None], *, uid: str = "",
                     resource_version: str = "") -> bytes:
    """A JSON merge patch of `metadata.annotations` (None deletes a key) that carries the
    object's uid and resourceVersion when given: the API server refuses it (409 or 422 for
    another uid, 409 for another version) instead of writing to a recreated or changed object."""
    metadata: dict[str, Any] = {"annotations": dict(changes)}
    if uid:
        metadata["uid"] = uid
    if resource_version:
        metadata["resourceVersion"] = resource_version
    return json.dumps({"metadata": metadata}, separators=(",", ":")).encode()


MAX_EVENT_MESSAGE = 1024


def pod_event(namespace: str, name: str, uid: str, *, event_type: str, reason: str,
              message: str, component: str, host: str = "", resource_version: str = "",
              now: datetime.datetime | None = None) -> dict[str, Any]:
    """A core/v1 Event about a pod (what `kubectl describe pod` lists)."""
    stamp = (now or datetime.datetime.now(datetime.UTC)).strftime("%Y-%m-%dT%H:%M:%SZ")
    involved = {"apiVersion": "v1", "kind": "Pod", "namespace": namespace, "name": name}
    if uid:
        involved["uid"] = uid
    if resource_version:
        involved["resourceVersion"] = resource_version
    source = {"component": component, **({"host": host} if host else {})}
    event = {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"name": f"{name}.{uuid.uuid4().hex[:16]}", "namespace": namespace},
        "involvedObject": involved, "reason": reason, "message": message[:MAX_EVENT_MESSAGE],
        "type": event_type, "source": source, "reportingComponent": component,
        "firstTimestamp": stamp, "lastTimestamp": stamp, "count": 1,
    }
    if host:
        event["reportingInstance"] = host
    return event
