"""The gate's decision, a pure function of what it can see: the pod's annotations (downward API)
and the node agent's readiness marker.

Release only when every fractional container's plan, computed from the annotations exactly as
the node agent computes it, was applied with the same digest in this boot of the host (a reboot
clears the kernel's limits, not the marker on disk), and the derived annotations the workload's
env reads say what that plan says. A refusal of this boot is final. Anything else is "not yet":
the kubelet refreshes the downward-API file on its own sync period, so annotations written just
before the marker (the node agent does that when it follows an unmodified KAI) may show up a
little later; the caller keeps polling and reports the last reason when its time runs out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType

from ..contract import (
    ContainerView,
    ContractViolation,
    Keys,
    PodView,
    derived_annotations,
    parse_pod,
    plan_pod,
)
from ..contract.keys import NODE_CONDITION
from ..marker import Marker, MarkerState


class Outcome(Enum):
    RELEASE = "release"
    WAIT = "wait"
    FAIL = "fail"


@dataclass(frozen=True, slots=True)
class Verdict:
    outcome: Outcome
    message: str
    """One line: why the gate releases, waits or fails."""
    set_aside: bool = False
    """It waits because the node agent set this pod's marker aside in this boot: the agent
    runs, and holds the pod back on purpose."""
    reason_named: bool = False
    """The message says where the node agent's reason is (`reason_where`): the timeout's
    message adds no second pointer."""


def reason_where(condition: str = NODE_CONDITION) -> str:
    """Where an operator reads why the gate still waits. The agent sends a new pod it holds
    pending no event (only a pod that had a marker in this boot gets one), so these are where
    its reason is. The gate knows neither its pod's name nor its node's (only the UID reaches
    it): NS/NAME and "the pod's node" stand for them. `condition`: the node condition the agent
    publishes (the gate's `--condition-name`, the chart's `nodeCondition.name`)."""
    return ("the node agent's reason: `kai-fractions inspect pod NS/NAME`, and the condition "
            f"{condition} of the pod's node (`kubectl describe node`), which is missing or "
            "Unknown where no node agent runs")


def not_written_reason(condition: str = NODE_CONDITION) -> str:
    """Why the gate waits while there is no marker: the agent may run and know why."""
    return ("the node agent has not written this pod's readiness marker yet; it writes none "
            "while it holds the pod pending (the pod's node not ready for it, its limits not in "
            f"force yet) or does not run ({reason_where(condition)})")


def not_written_yet(detail: str = "", condition: str = NODE_CONDITION) -> Verdict:
    """The wait while the agent has written no marker for this pod; `detail` adds what the
    gate saw (a directory it cannot read yet, say)."""
    return Verdict(Outcome.WAIT, not_written_reason(condition)
                   + (f"; {detail}" if detail else ""), reason_named=True)


def _release(message: str) -> Verdict:
    return Verdict(Outcome.RELEASE, message)


def _wait(message: str) -> Verdict:
    return Verdict(Outcome.WAIT, message)


def _fail(message: str) -> Verdict:
    return Verdict(Outcome.FAIL, message)


def _named_containers(annotations: Mapping[str, str], keys: Keys) -> tuple[str, ...]:
    """Containers named by the annotations, for when the gate was not told the pod's list: by
    KAI's keys and the portion limit, which hold the container's name. The derived keys name a
    container by an id that may be shortened (`Keys.container_id`), and only a fractional one,
    which KAI's `.gpus.devices` names once the pod is bound: the gate reads them by `derived`
    of the names found here, never as names."""
    names: list[str] = []
    for key in sorted(annotations):
        parts = keys.split(key)
        name = parts[0] if parts else keys.split_portion_limit(key)
        if name and name not in names:
            names.append(name)
    return tuple(names)


def pod_view(
    annotations: Mapping[str, str],
    pod_uid: str,
    keys: Keys,
    containers: Sequence[str] = (),
    init_containers: Sequence[str] = (),
) -> PodView:
    """The slice of the pod the contract reads, rebuilt from what the gate can see.

    The webhook passes the pod's container names (`--containers`, `--init-containers`); the gate
    cannot see the spec. The pod UID makes the plan (MPS namespace, digest) the node agent's.
    """
    regular = tuple(containers) or _named_containers(annotations, keys)
    return PodView(
        name="", namespace="", uid=pod_uid,
        annotations=MappingProxyType(dict(annotations)),
        containers=tuple(ContainerView(name=n) for n in regular),
        init_containers=tuple(ContainerView(name=n, init=True) for n in init_containers),
    )


def _refusal(marker: Marker) -> Verdict | None:
    for name, entry in sorted(marker.containers.items()):
        if entry.state is MarkerState.REFUSED:
            return _fail(f"container {name!r} refused by the node agent: {entry.reason}: "
                         f"{entry.message}")
    return None


def _earlier_boot(marker: Marker, boot_id: str) -> str:
    written = (f"in boot {marker.boot_id}" if marker.boot_id else
               "by a node agent that does not record boots (an older release)")
    return (f"the node agent's marker was written {written}, not in this boot of the node "
            f"({boot_id}): the limits it vouched for are gone with a restart; waiting for the "
            "agent to apply them again")


SET_ASIDE_REASON = (
    "the node agent set this pod's readiness marker aside: a limit it had vouched for is not in "
    "force now (such as an MPS cap after an MPS daemon restart); it writes the marker again "
    "once the limit is back (the reason: `kai-fractions inspect pod NS/NAME` or the pod's "
    "events)")
"""Why the gate waits while the agent holds the pod's marker back (`set_aside` in `judge`)."""


def _held_back(set_aside: Marker | None, pod_uid: str, boot_id: str) -> bool:
    """The agent set this pod's marker aside in this boot. One of an earlier boot was set
    aside because of the reboot (nothing is known to be out of force now), another pod's is
    not this gate's to read."""
    return (set_aside is not None and set_aside.pod_uid == pod_uid
            and set_aside.boot_id == boot_id)


def judge(
    annotations: Mapping[str, str] | None,
    marker: Marker | None,
    *,
    pod_uid: str,
    keys: Keys,
    boot_id: str,
    containers: Sequence[str] = (),
    init_containers: Sequence[str] = (),
    set_aside: Marker | None = None,
    condition: str = NODE_CONDITION,
) -> Verdict:
    """`boot_id`: the host's, now (`kai_fractions.marker.read_boot_id`). `set_aside`: the
    marker the agent moved out of the gate's sight (`kai_fractions.marker.SET_ASIDE_FILE`),
    when there is one; it vouches for nothing and only words the wait while `marker` is
    None. `condition`: the node condition the agent publishes, named in the wait for a first
    marker."""
    earlier = None
    if marker is not None and marker.boot_id != boot_id:
        earlier, marker = _earlier_boot(marker, boot_id), None
    if marker is not None:
        refused = _refusal(marker)
        if refused is not None:
            return refused
    if annotations is None:
        return _wait("the pod's annotations are not visible yet (downward-API file missing)")
    request = parse_pod(pod_view(annotations, pod_uid, keys, containers, init_containers), keys)
    if request.errors:
        return _fail("the pod's annotations break the NvFractions contract: "
                     + "; ".join(str(e) for e in request.errors))
    if not request.shares:
        return _fail("the pod's annotations request no GPU fraction, yet the pod carries the "
                     "kai-fractions gate: its GPU env would be empty")
    if marker is None:
        if earlier is None and _held_back(set_aside, pod_uid, boot_id):
            return Verdict(Outcome.WAIT, SET_ASIDE_REASON, set_aside=True)
        return _wait(earlier) if earlier is not None else not_written_yet(condition=condition)
    try:
        plans = plan_pod(request, keys=keys)
    except ContractViolation as e:
        return _wait("the pod's annotations do not make a complete plan yet: " + "; ".join(
            str(err) for err in e.errors))
    for plan in plans:
        for key, want in derived_annotations(plan, keys).items():
            have = annotations.get(key)
            if have is None:
                return _wait(f"container {plan.container!r}: annotation {key} is missing "
                             "(the workload's env reads it)")
            if have != want:
                return _wait(f"container {plan.container!r}: annotation {key} is {have!r} but "
                             f"the plan says {want!r}")
    planned = {p.container for p in plans}
    for plan in plans:
        entry = marker.containers.get(plan.container)
        if entry is None:
            return _wait(f"container {plan.container!r}: the node agent's marker has no "
                         "entry for it")
        if entry.plan_digest != plan.digest:
            return _wait(f"container {plan.container!r}: the node agent applied plan "
                         f"{entry.plan_digest} but the pod's annotations give {plan.digest}")
    extra = sorted(set(marker.containers) - planned)
    if extra:
        return _wait(f"the node agent's marker names container(s) {', '.join(extra)} that "
                     "request no GPU fraction")
    return _release("limits applied: " + ", ".join(
        f"{p.container} {p.digest}" for p in plans))
