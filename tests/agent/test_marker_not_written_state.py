"""What a container is reported as while its pod's readiness marker, or the derived annotations
the marker waits for, cannot be written.

Before: the pass counted `MarkerNotWritten` / `AnnotationsNotWritten` among its errors, but the
container's own result stayed `applied` with no reason, so GetNodeState said APPLIED, the
`kai_fractions_containers` gauge counted it applied and `kai-fractions inspect` showed the row
`enforced`, while its gate waited for a marker that never came.

Now such a container is pending under that reason, its message naming the error and what the
gate does, on every surface, until a pass writes the marker; then it is applied again. It is
no cap "not in force" (the limits may well be), a refused sibling stays refused, and the failing
passes send no event of their own."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from kai_fractions.admission.config import GATE_CONTAINER
from kai_fractions.api.v1 import node_pb2
from kai_fractions.inspect.model import pod_report
from kai_fractions.inspect.sources import from_node_state
from kai_fractions.node.agent.grpc_service import node_state
from kai_fractions.node.engine import ContainerState

from .builders import Rig, binder_annotations, marker_of, pod, result_of
from .test_marker_dir_probe import unwritable, writable_again

NOT_HERE = "GPU-deadbeef-0000-0000-0000-000000000000"


def _uid(rig: Rig, name: str, devices: str) -> str:
    return rig.add(pod(name, notes=binder_annotations(devices=devices)))["metadata"]["uid"]


def _states(rig: Rig) -> dict[str, float | None]:
    reg = rig.agent.metrics.registry
    return {s: reg.get_sample_value("kai_fractions_containers", {"node": "node-a", "state": s})
            for s in ("applied", "pending", "refused")}


def _cap_series(rig: Rig) -> list[Any]:
    return [s for m in rig.agent.metrics.registry.collect()
            if m.name == "kai_fractions_container_cap_not_in_force" for s in m.samples]


def _allocation(rig: Rig, uid: str) -> Any:
    reply = node_state(rig.reconciler.view, "node-a", rig.agent.condition(), "Ready")
    [a] = [a for a in reply.allocations if a.pod.uid == uid]
    return a


def _inspected(rig: Rig, uid: str) -> Any:
    """The row `kai-fractions inspect pod` shows, the agent's socket read, its gate waiting."""
    manifest = copy.deepcopy(rig.cluster.pods[uid])
    manifest["spec"]["initContainers"] = [{"name": GATE_CONTAINER, "image": "x"}]
    manifest["status"]["phase"] = "Pending"
    manifest["status"]["initContainerStatuses"] = [{"name": GATE_CONTAINER, "state": {
        "running": {"startedAt": "2024-01-01T00:00:00Z"}}}]
    reply = node_state(rig.reconciler.view, "node-a", rig.agent.condition(), "Ready")
    [row] = pod_report(manifest, None, from_node_state(reply, "socket")).rows
    return row


def _pending_everywhere(rig: Rig, uid: str, reason: str) -> str:
    """The container is pending under `reason` in the pass's result, GetNodeState, the state
    gauge and inspect, and is no cap not in force; returns its message."""
    result = result_of(rig, uid)
    assert (result.state, result.reason) == (ContainerState.PENDING, reason)
    assert not result.not_in_force
    assert result.plan_digest  # the plan stays what it is
    a = _allocation(rig, uid)
    assert (a.state, a.reason, a.message) == (
        node_pb2.ALLOCATION_STATE_PENDING, reason, result.message)
    row = _inspected(rig, uid)
    assert (row.state, row.reason) == ("pending", reason)
    assert _cap_series(rig) == []
    return str(result.message)


def test_a_pod_whose_marker_cannot_be_written_is_pending_until_it_is(short_tmp: Path) -> None:
    rig = Rig(short_tmp, sm_sharing=False)
    root = Path(rig.options.marker_dir)
    root.mkdir(parents=True, exist_ok=True)
    aside = unwritable(rig)
    uid = _uid(rig, "new", rig.gpu0)
    refused = _uid(rig, "bad", NOT_HERE)
    for _ in range(3):
        report = rig.step()
        assert "MarkerNotWritten" in report.errors and not report.converged
        message = _pending_everywhere(rig, uid, "MarkerNotWritten")
    assert message.startswith("its pod's readiness marker could not be written under "
                              f"{root} (")
    assert str(root) in message.split("(", 1)[1]  # the error itself names the path
    assert "so a gate of the pod waits for it" in message
    assert "MarkerDirectoryNotWritable" in message
    # a refusal whose marker could not be written is still a refusal
    bad = result_of(rig, refused)
    assert (bad.state, bad.reason) == (ContainerState.REFUSED, "DeviceNotOnNode")
    assert _states(rig) == {"applied": 0, "pending": 1, "refused": 1}
    # nothing is sent per failing pass (Applied and Refused go with the marker)
    assert rig.cluster.event_reasons(uid) == [] and rig.cluster.event_reasons(refused) == []

    writable_again(rig, aside)
    assert rig.step().converged
    assert result_of(rig, uid).state is ContainerState.APPLIED
    assert result_of(rig, uid).reason is None
    assert marker_of(rig, uid)["containers"]["main"]["state"] == "applied"
    assert _allocation(rig, uid).state == node_pb2.ALLOCATION_STATE_APPLIED
    assert _inspected(rig, uid).state == "enforced"
    assert _states(rig) == {"applied": 1, "pending": 0, "refused": 1}
    rig.step()
    assert rig.cluster.event_reasons(uid) == ["Applied"]
    assert rig.cluster.event_reasons(refused) == ["Refused"]


def test_a_pod_whose_marker_was_written_is_pending_once_the_directory_is_lost(
        short_tmp: Path) -> None:
    """A running pod's marker goes with its directory: the new one cannot be written, so a
    restarted sandbox's gate would wait; no second Applied once it is back."""
    rig = Rig(short_tmp, sm_sharing=False)
    uid = _uid(rig, "running", rig.gpu0)
    assert rig.step().converged
    assert result_of(rig, uid).state is ContainerState.APPLIED
    aside = unwritable(rig)
    rig.step()
    _pending_everywhere(rig, uid, "MarkerNotWritten")
    assert _states(rig) == {"applied": 0, "pending": 1, "refused": 0}
    writable_again(rig, aside)
    rig.step()  # the set-aside directory came back with its marker: nothing to write
    assert result_of(rig, uid).state is ContainerState.APPLIED
    assert rig.cluster.event_reasons(uid) == ["Applied"]


def test_a_pod_whose_derived_annotations_cannot_be_written_is_pending_until_they_are(
        short_tmp: Path) -> None:
    rig = Rig(short_tmp, sm_sharing=False)
    uid = _uid(rig, "new", rig.gpu0)
    rig.cluster.fail("patch_pod_annotations", times=3)
    for _ in range(3):
        report = rig.step()
        assert "AnnotationsNotWritten" in report.errors and not report.converged
        message = _pending_everywhere(rig, uid, "AnnotationsNotWritten")
        assert marker_of(rig, uid) is None
    assert message.startswith("its pod's derived annotations could not be written (injected "
                              "failure of patch_pod_annotations)")
    assert "so a gate of the pod waits" in message
    assert _states(rig) == {"applied": 0, "pending": 1, "refused": 0}
    assert rig.cluster.event_reasons(uid) == []

    rig.step()
    assert result_of(rig, uid).state is ContainerState.APPLIED
    assert marker_of(rig, uid)["containers"]["main"]["state"] == "applied"
    assert _allocation(rig, uid).state == node_pb2.ALLOCATION_STATE_APPLIED
    assert _inspected(rig, uid).state == "enforced"
    assert _states(rig) == {"applied": 1, "pending": 0, "refused": 0}
    rig.step()
    assert rig.cluster.event_reasons(uid) == ["Applied"]
