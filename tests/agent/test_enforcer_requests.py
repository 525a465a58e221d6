"""NodeEnforcer calls with bad, ambiguous or early input, on the servicer in-process: each gets
the status that says what happened, naming the field, and changes nothing it should not."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from kai_fractions.api.v1 import allocation_pb2, node_pb2
from kai_fractions.node.agent.grpc_service import NodeEnforcerServicer
from kai_fractions.node.agent.pods import ContainerNotFound

from .builders import Rig, binder_annotations, limits_of, marker_of, pod

UID = "0a1b2c3d-0000-4000-8000-000000000777"


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


class Context:
    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)


class InlineWorker:
    """Runs each call on the caller's thread (the servicer's worker seam)."""

    def call(self, fn, timeout=None):
        return fn()


def servicer(rig: Rig) -> NodeEnforcerServicer:
    return NodeEnforcerServicer(rig.reconciler, InlineWorker(), "node-a", rig.agent.condition,
                                "gpu-fractioning.nvidia.com/Ready")


def provision(rig: Rig, **ref: str) -> node_pb2.ProvisionResponse:
    request = node_pb2.ProvisionRequest(
        pod=allocation_pb2.PodRef(**{"namespace": "jobs", "name": "direct", "uid": UID, **ref}),
        annotations=binder_annotations(devices=rig.gpu0), containers=["main"])
    return servicer(rig).Provision(request, Context())


def test_a_provision_no_pass_could_apply_is_unavailable_not_an_empty_success(
        short_tmp: Path) -> None:
    """Before the agent's first list, or with NVML down, the pass applies nothing: an OK with
    no allocations reads as "no fractional container" (the proto's meaning), and a caller
    could start the pod without its limits."""
    (short_tmp / "a").mkdir()
    (short_tmp / "b").mkdir()
    rig = Rig(short_tmp / "a")  # not listed yet
    with pytest.raises(Aborted) as e:
        provision(rig)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    assert e.value.details == (
        "NotListed: pod jobs/direct is provisioned, but no limit of it is in force yet: the "
        "agent's pass could not apply (NotListed); call again, or watch GetNodeState")
    assert rig.nvml.limits == {}
    rig = Rig(short_tmp / "b")
    rig.step()
    rig.nvml.fail("devices", "Unknown", times=None)
    with pytest.raises(Aborted) as e:
        provision(rig)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    assert e.value.details.startswith("NVMLError: pod jobs/direct is provisioned, but no limit")
    assert rig.nvml.limits == {}
    rig.nvml.clear_failures()
    (alloc,) = provision(rig).allocations  # once a pass can apply, the same call answers
    assert alloc.state == node_pb2.ALLOCATION_STATE_APPLIED


@pytest.mark.parametrize(("ref", "field"), [
    ({"namespace": "x" * 20_000}, "pod.namespace"),
    ({"name": "Direct\nERROR forged log line"}, "pod.name"),
    ({"uid": "u" * 20_000}, "pod.uid"),
])
def test_names_that_no_pod_has_are_refused_and_echoed_cut(short_tmp: Path, ref: dict,
                                                          field: str) -> None:
    """Echoed in full they made the status exceed gRPC's 16 KiB (the caller got
    RESOURCE_EXHAUSTED) and forged lines in the agent's log."""
    rig = Rig(short_tmp)
    rig.step()
    calls = [lambda: provision(rig, **ref)]
    pod_ref = allocation_pb2.PodRef(**{"namespace": "jobs", "name": "direct", **ref})
    calls += [lambda: servicer(rig).Release(node_pb2.ReleaseRequest(pod=pod_ref), Context()),
              lambda: servicer(rig).Drain(node_pb2.DrainRequest(pod=pod_ref), Context())]
    for call in calls:
        with pytest.raises(Aborted) as e:
            call()
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details.startswith(f"{field}: must be")
        assert len(e.value.details) < 400 and "\n" not in e.value.details
    assert rig.reconciler.pods.provisioned == {}


def test_release_by_name_needs_a_name_and_refuses_to_guess(short_tmp: Path) -> None:
    rig = Rig(short_tmp)
    first = rig.add(pod("twin", notes=binder_annotations(devices=rig.gpu0)))["metadata"]["uid"]
    rig.step()
    release = servicer(rig).Release
    with pytest.raises(Aborted) as e:
        release(node_pb2.ReleaseRequest(pod=allocation_pb2.PodRef()), Context())
    assert (e.value.code, e.value.details) == (
        grpc.StatusCode.INVALID_ARGUMENT, "pod: give pod.uid, or pod.namespace and pod.name")
    with pytest.raises(Aborted) as e:  # a uid of another pod than the name's
        release(node_pb2.ReleaseRequest(pod=allocation_pb2.PodRef(
            namespace="default", name="twin", uid=UID)), Context())
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details.startswith(f"pod: uid {UID} is not the uid of pod default/twin")
    # the pod deleted and made again under its name while the first one's cgroup lingers
    second = rig.add(pod("twin", notes=binder_annotations(devices=rig.gpu1)))["metadata"]["uid"]
    rig.step()
    with pytest.raises(Aborted) as e:
        release(node_pb2.ReleaseRequest(pod=allocation_pb2.PodRef(
            namespace="default", name="twin")), Context())
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert e.value.details == (f"2 pods named default/twin on this node (uids "
                               f"{', '.join(sorted((first, second)))}); give pod.uid")
    assert {k.pod_uid for k in rig.reconciler.view.results} == {first, second}  # none released


@pytest.mark.parametrize(("containers", "init", "message"), [
    (["main", "main"], [], "containers[1]: 'main' is named twice"),
    (["main"], ["main"], "init_containers[0]: 'main' is named twice"),
    (["main", ""], [], "containers[1]: must be a container name"),
    (["Main"], [], "containers[0]: must be a container name"),
])
def test_container_names_a_pod_could_not_have_are_refused(short_tmp: Path, containers, init,
                                                           message: str) -> None:
    rig = Rig(short_tmp)
    rig.step()
    request = node_pb2.ProvisionRequest(
        pod=allocation_pb2.PodRef(namespace="jobs", name="direct", uid=UID),
        annotations=binder_annotations(devices=rig.gpu0), containers=containers,
        init_containers=init)
    with pytest.raises(Aborted) as e:
        servicer(rig).Provision(request, Context())
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details.startswith(message)
    assert rig.reconciler.pods.provisioned == {}


@pytest.mark.parametrize("name", ["MAIN", "../../etc", "a\0b", "x" * 100_000])
def test_release_and_drain_of_a_container_name_no_pod_has_are_refused(short_tmp: Path,
                                                                      name: str) -> None:
    """They were answered OK: the name was kept among the released (a 100 kB one for as long
    as the pod lived) and the pod's marker deleted, though the name matched nothing."""
    rig = Rig(short_tmp)
    uid = rig.add(pod("w", notes=binder_annotations(devices=rig.gpu0)))["metadata"]["uid"]
    rig.step()
    limits, marker = limits_of(rig, uid), marker_of(rig, uid)
    assert limits and marker is not None
    ref = allocation_pb2.PodRef(uid=uid)
    for call in (lambda: servicer(rig).Release(node_pb2.ReleaseRequest(pod=ref, container=name),
                                               Context()),
                 lambda: servicer(rig).Drain(node_pb2.DrainRequest(pod=ref, container=name),
                                             Context())):
        with pytest.raises(Aborted) as e:
            call()
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details.startswith("container: must be a container name (a DNS label")
        assert len(e.value.details) < 400 and "\0" not in e.value.details
    rig.step()
    assert (limits_of(rig, uid), marker_of(rig, uid)) == (limits, marker)
    assert rig.reconciler.pods.released == set()


def test_release_and_drain_of_a_container_the_pod_has_not_are_not_found(short_tmp: Path
                                                                        ) -> None:
    rig = Rig(short_tmp)
    uid = rig.add(pod("w", notes=binder_annotations(devices=rig.gpu0)))["metadata"]["uid"]
    rig.step()
    limits, marker = limits_of(rig, uid), marker_of(rig, uid)
    ref = allocation_pb2.PodRef(namespace="default", name="w")
    for call in (lambda: servicer(rig).Release(node_pb2.ReleaseRequest(pod=ref, container="nope"),
                                               Context()),
                 lambda: servicer(rig).Drain(node_pb2.DrainRequest(pod=ref, container="nope"),
                                             Context())):
        with pytest.raises(Aborted) as e:
            call()
        assert (e.value.code, e.value.details) == (
            grpc.StatusCode.NOT_FOUND,
            f"container: pod default/w ({uid}) has no fractional container 'nope' on this node "
            "(its fractional containers: main)")
    rig.step()
    assert (limits_of(rig, uid), marker_of(rig, uid)) == (limits, marker)
    assert rig.reconciler.pods.released == set()
    # Checked again where the release is made (the pod's containers may change in between).
    with pytest.raises(ContainerNotFound):
        rig.reconciler.release(uid, "nope")
    assert rig.reconciler.pods.released == set() and marker_of(rig, uid) == marker
    # Its fractional container is released as before; a pod not on the node, by any name.
    released = servicer(rig).Release(node_pb2.ReleaseRequest(pod=ref, container="main"),
                                     Context())
    assert list(released.released_containers) == ["main"]
    assert limits_of(rig, uid) == {} and marker_of(rig, uid) is None
    gone = allocation_pb2.PodRef(uid=UID)
    assert list(servicer(rig).Release(node_pb2.ReleaseRequest(pod=gone, container="main"),
                                      Context()).released_containers) == []
