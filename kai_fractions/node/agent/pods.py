"""The pods a pass plans for, and what the agent remembers of them between passes.

Live pods come from the watch and from Provision calls (integrations that drive the agent
directly); a watched pod wins over a provisioned one, and finished pods are left out. A pod or
container given to Release stays out of the desired state until the pod goes away (or is
provisioned again). A running container keeps the plan it was applied with, read back from
durable facts only (its derived annotations and this node's marker), so an edit of its pod's
annotations is refused with an event instead of lifting its limits; with signing on, a pod whose
allocation does not verify keeps the limits the kernel holds. `known` is what the last pass saw
of each pod: a pod that goes away is released by it, and Release names its containers from it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ...contract import ContainerPlan, Keys
from ...kube.objects import meta
from ..applied import applied_plans, has_recorded_plans
from ..config import Mechanism, NodeConfig
from ..desired import ContainerKey, DesiredState, NodePod, RefusalReason, plan_node
from ..engine import Engine, Issue
from ..inventory import Inventory
from . import events as ev
from .events import EventRecorder, PodRef
from .markers import MarkerStore
from .signatures import SignatureCheck, kept_limits, with_kept_limits
from .watch import PodCache

log = logging.getLogger(__name__)

API = "api"
PROVISIONED = "provisioned"


@dataclass(frozen=True, slots=True)
class KnownPod:
    namespace: str
    name: str
    source: str
    containers: tuple[str, ...]
    """Its fractional containers (planned or refused)."""


class ContainerNotFound(LookupError):
    """Release named a container that is not one of the known pod's fractional containers."""

    def __init__(self, uid: str, known: KnownPod, container: str) -> None:
        names = ", ".join(known.containers[:10]) or "none"
        if len(known.containers) > 10:
            names += f", ... ({len(known.containers)} in all)"
        super().__init__(f"container: pod {known.namespace}/{known.name} ({uid}) has no "
                         f"fractional container {container!r} on this node (its fractional "
                         f"containers: {names})")


def _terminal(manifest: Mapping[str, Any]) -> bool:
    return str((manifest.get("status") or {}).get("phase") or "") in ("Succeeded", "Failed")


def without_released(desired: DesiredState,
                     released: set[tuple[str, str | None]]) -> DesiredState:
    """The desired state minus released pods and containers (until the pod goes away).

    A pod-level cgroup limit (the pod's slice) stays while any of the pod's cgroup-limited
    containers does (KAI allows one fractional container per pod, so it is that one's)."""
    if not released:
        return desired

    def gone(key: ContainerKey) -> bool:
        return (key.pod_uid, None) in released or (key.pod_uid, key.container) in released

    containers = tuple(c for c in desired.containers if not gone(c.key))
    limited = {c.key.pod_uid for c in containers if Mechanism.CGROUP in c.mechanisms}
    limits = tuple(t for t in desired.limits
                   if (t.pod_uid in limited if t.container is None
                       else not gone(ContainerKey(t.pod_uid, t.container))))
    gpus = tuple(dataclasses.replace(g, containers=tuple(k for k in g.containers if not gone(k)))
                 for g in desired.gpus)
    return dataclasses.replace(
        desired, containers=containers, limits=limits, gpus=gpus,
        refusals=tuple(r for r in desired.refusals if not gone(r.key)))


class NodePods:
    def __init__(self, cache: PodCache, *, config: NodeConfig, engine: Engine,
                 markers: MarkerStore, events: EventRecorder,
                 signatures: SignatureCheck | None, clock: Callable[[], float]):
        self.cache = cache
        self.config = config
        self.engine = engine
        self.markers = markers
        self.events = events
        self.signatures = signatures
        self.clock = clock
        self.provisioned: dict[str, dict[str, Any]] = {}
        self._qos_unknown: set[str] = set()
        """Provisioned pods whose cgroup did not exist yet: their QoS class is a guess (the
        kubelet's QoS parent is where their cgroup will be), looked for again every pass."""
        self.released: set[tuple[str, str | None]] = set()
        self.known: dict[str, KnownPod] = {}

    def live(self) -> dict[str, tuple[Mapping[str, Any], str]]:
        """Live pods by uid with their source; releases of pods that went away are dropped."""
        self._find_qos()
        out: dict[str, tuple[Mapping[str, Any], str]] = {
            uid: (m, PROVISIONED) for uid, m in self.provisioned.items()}
        out.update({uid: (m, API) for uid, m in self.cache.snapshot().items()})
        live = {uid: v for uid, v in out.items() if not _terminal(v[0])}
        self.released = {r for r in self.released if r[0] in live}
        return live

    # -- planning ---------------------------------------------------------------------------

    def plan(self, live: Mapping[str, tuple[Mapping[str, Any], str]], inventory: Inventory,
             errors: set[str]) -> DesiredState:
        pods = []
        for uid, (manifest, _source) in live.items():
            try:
                pods.append(NodePod.from_manifest(manifest))
            except ValueError as e:  # a malformed object the API server should have refused
                log.error("pod %s cannot be read (%s); skipped", uid, e)
                errors.add("PodUnreadable")
        screened = None
        if self.signatures is not None:
            screened = self.signatures.screen(pods, unchecked={
                uid for uid, (_m, source) in live.items() if source == PROVISIONED})
        applied = self._applied(pods, live)
        whole = plan_node(pods, inventory, self.config, applied=applied,
                          vetoes=screened.refusals if screened is not None else (),
                          marked=self.markers.marked())
        desired = without_released(whole, self.released)
        # A refusal never turns into "no limit" for a container that may be running: a pod
        # refused for its signature, or a running container whose applied plan a node rule
        # now refuses (an agent restarted with sm-sharing off, a GPU gone), keeps the limits
        # the kernel holds, unless it (or its fractional container) was released.
        planned = {c.key.pod_uid for c in desired.containers}
        fractional = {*applied, *(c.key for c in whole.containers),
                      *(r.key for r in whole.refusals)}
        released = {uid for uid, container in self.released
                    if container is None or ContainerKey(uid, container) in fractional}
        may_run = {key.pod_uid for key in applied}
        if screened is not None:
            may_run |= screened.refused_pods
        keep = may_run - planned - released
        if keep:
            desired = with_kept_limits(desired, kept_limits(self.engine, inventory, keep))
        return desired

    def _applied(self, pods: Sequence[NodePod], live: Mapping[str, tuple[Any, str]]
                 ) -> dict[ContainerKey, ContainerPlan]:
        """The plan each running container was applied with (`kai_fractions.node.applied`).
        Provisioned pods are not held: whoever provisions them may change them."""
        keys: Keys = self.config.keys
        out: dict[ContainerKey, ContainerPlan] = {}
        for pod in pods:
            if live.get(pod.uid, (None, PROVISIONED))[1] != API \
                    or not has_recorded_plans(pod.view, keys):
                continue
            marker = self.markers.read(pod.uid) or self.markers.set_aside_marker(pod.uid)
            for name, plan in applied_plans(pod.view, marker, keys).items():
                out[ContainerKey(pod.uid, name)] = plan
        return out

    def plan_change_events(self, desired: DesiredState) -> None:
        """One Warning per refused change; a change undone and made again is reported again."""
        now = set()
        for r in desired.refusals:
            if r.reason == RefusalReason.PLAN_CHANGE_REFUSED:
                key = (ev.PLAN_CHANGE_REFUSED, r.key, r.message)
                now.add(key)
                self.events.emit(PodRef(r.pod_namespace, r.pod_name, r.key.pod_uid), ev.WARNING,
                                 ev.PLAN_CHANGE_REFUSED, f"container {r.key.container}: "
                                 f"{r.message}", key=key)
        self.events.forget_matching(lambda k: isinstance(k, tuple) and len(k) == 3
                                    and k[0] == ev.PLAN_CHANGE_REFUSED and k not in now)

    def settled(self, live: Mapping[str, tuple[Mapping[str, Any], str]],
                fractional: Mapping[str, Mapping[str, Any]]) -> None:
        """Remembers the live pods and their fractional containers (`fractional`: by pod)."""
        self.known = {uid: KnownPod(
            namespace=str(meta(m).get("namespace") or ""), name=str(meta(m).get("name") or ""),
            source=source, containers=tuple(sorted(fractional.get(uid, {}))))
            for uid, (m, source) in live.items()}

    # -- pods that go ------------------------------------------------------------------------

    def drop_gone(self, live: Mapping[str, Any], errors: set[str], *, release: bool) -> None:
        """Pods that went away: their marker directory, events and metrics go first; then,
        with `release`, what is enforced for them (a marker never outlives its limits)."""
        for uid in [uid for uid in self.known if uid not in live]:
            if self.markers.remove_pod(uid):
                log.info("removed the marker directory of gone pod %s", uid)
            self.events.forget_pod(uid)
            self.provisioned.pop(uid, None)
            if release:
                self._release_gone(uid, errors)
            del self.known[uid]

    def _release_gone(self, uid: str, errors: set[str]) -> None:
        known = self.known[uid]
        report = self.engine.release(uid, container_names=known.containers)
        for issue in report.issues:
            errors.add(issue.reason)
            log.warning("releasing pod %s: %s: %s", uid, issue.reason, issue.message)
        if report.cleared or report.namespaces_deleted:
            log.info("released pod %s (%s/%s): %d limit(s) cleared, MPS namespaces deleted: %s",
                     uid, known.namespace, known.name, len(report.cleared),
                     ", ".join(report.namespaces_deleted) or "none")

    # -- direct driving (gRPC) -----------------------------------------------------------------

    def _scan_qos(self, uids: set[str]) -> dict[str, str]:
        """The QoS class of those of `uids` whose pod cgroup exists, from its QoS parent."""
        return {pc.uid: pc.qos.value for pc in self.engine.layout.scan(self.engine.cgroup_fs)
                if pc.uid in uids}

    def _find_qos(self) -> None:
        self._qos_unknown &= self.provisioned.keys()
        if not self._qos_unknown:
            return
        for uid, qos in self._scan_qos(self._qos_unknown).items():
            manifest = self.provisioned[uid]
            self.provisioned[uid] = {**manifest, "status": {**manifest["status"],
                                                            "qosClass": qos}}
            self._qos_unknown.discard(uid)

    def provision(self, namespace: str, name: str, uid: str, annotations: Mapping[str, str],
                  containers: Sequence[str], init_containers: Sequence[str] = ()) -> None:
        """A pod given by an integration (not read from the API), as the API would show it. Its
        QoS class is read from where its cgroup is; until the kubelet has made it, Burstable is
        guessed (its cgroup is not found, so it is pending) and every pass looks again."""
        qos = self._scan_qos({uid}).get(uid)
        if qos is None:
            self._qos_unknown.add(uid)
        else:
            self._qos_unknown.discard(uid)
        self.provisioned[uid] = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "uid": uid,
                         "annotations": dict(annotations),
                         "creationTimestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                            time.gmtime(self.clock()))},
            "spec": {"nodeName": self.config.node_name,
                     "containers": [{"name": c} for c in containers],
                     "initContainers": [{"name": c} for c in init_containers]},
            "status": {"phase": "Running", "qosClass": qos or "Burstable"},
        }
        self.released = {r for r in self.released if r[0] != uid}

    def release(self, uid: str, container: str | None = None
                ) -> tuple[list[str], tuple[Issue, ...]]:
        """Removes what is enforced for a pod (or one container) and keeps it out of the desired
        state until the pod goes away (or is provisioned again); returns the containers and what
        could not be removed (the passes after sweep it). Raises ContainerNotFound, changing
        nothing, for a `container` that is not one of a known pod's fractional containers (a
        pod the agent does not know, one gone from the node, is released by whatever name)."""
        known = self.known.get(uid)
        if container and known is not None and container not in known.containers:
            raise ContainerNotFound(uid, known, container)
        names = list(known.containers) if known else []
        if container:
            names = [n for n in names if n == container]
        if not container and uid in self.provisioned and uid not in self.cache:
            del self.provisioned[uid]  # provisioned only: nothing plans it again
            self.markers.remove_pod(uid)
        else:
            if not container:
                self.provisioned.pop(uid, None)  # the integration gave it up
            # A watched pod (provisioned too, maybe) is planned again from the watch: it stays
            # out of the desired state until it goes, and its directory stays (the gate's bind
            # mount holds it; a new one would be invisible to it).
            self.released.add((uid, container or None))
            self.markers.unlink(uid)
        report = self.engine.release(uid, container or None, container_names=names)
        for issue in report.issues:
            log.warning("release of pod %s: %s: %s", uid, issue.reason, issue.message)
        return names, report.issues
