"""NodeEnforcer's `pod.uid` must be a pod UID as the cgroup code names a pod's cgroup by it (a
UUID), in lower case as the API server writes it: one that is not is refused before anything is
stored or written. It used to be kept provisioned, with a marker directory, while no limit could
ever be set for it (the kubelet names the cgroup, and the gate its marker directory, by the
lower-case uid; an upper-case twin was also counted beside it)."""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import pytest

from kai_fractions.api.v1 import allocation_pb2, node_pb2
from tests.agent.builders import Rig, binder_annotations
from tests.agent.test_enforcer_requests import Aborted, Context, servicer

UUID = "0a1b2c3d-0000-4000-8000-000000000777"


def _calls(rig: Rig, uid: str):
    ref = allocation_pb2.PodRef(namespace="jobs", name="direct", uid=uid)
    s = servicer(rig)
    yield "Provision", lambda: s.Provision(node_pb2.ProvisionRequest(
        pod=ref, annotations=binder_annotations(devices=rig.gpu0), containers=["main"]),
        Context())
    yield "Release", lambda: s.Release(node_pb2.ReleaseRequest(pod=ref), Context())
    yield "Drain", lambda: s.Drain(node_pb2.DrainRequest(pod=ref), Context())


@pytest.mark.parametrize("uid", [
    "not-a-uuid",
    "0a1b2c3d00004000800000000000077700",  # the digits without the dashes
    UUID + "-0",
    UUID[:-1],
    UUID.upper(),
    UUID[:-1] + "A",  # one upper-case digit
])
def test_a_uid_that_is_not_a_uuid_is_refused_and_changes_nothing(short_tmp: Path,
                                                                 uid: str) -> None:
    rig = Rig(short_tmp)
    rig.step()
    markers = Path(rig.options.marker_dir)
    before = sorted(os.listdir(markers)) if markers.exists() else []
    for method, call in _calls(rig, uid):
        with pytest.raises(Aborted) as e:
            call()
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT, method
        assert e.value.details == (
            "pod.uid: must be the pod's metadata.uid, a lower-case UUID (8-4-4-4-12 hexadecimal "
            "digits, as the API server writes it), "
            f"got {uid!r}: it names the pod's cgroup and marker directory"), method
    assert rig.reconciler.pods.provisioned == {}
    assert not (markers / uid).exists()
    assert (sorted(os.listdir(markers)) if markers.exists() else []) == before
    assert all(k.pod_uid != uid for k in rig.reconciler.view.results)
    # the lower-case UUID goes through
    answers = {method: call() for method, call in _calls(rig, UUID)}
    assert [a.state for a in answers["Provision"].allocations] == [
        node_pb2.ALLOCATION_STATE_APPLIED]
    assert list(answers["Release"].released_containers) == ["main"]

