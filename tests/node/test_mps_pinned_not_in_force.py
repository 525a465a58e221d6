"""An mps-pinned container whose GPU's default pinned device memory limit the MPS daemon has lost
(a restarted daemon forgets it) and that cannot be set again is never vouched for: its pod's
readiness marker is set aside and its MPS namespace is not made again until the limit is back,
so no gate (a restarted sandbox's) lets a client in, and no client starts an MPS server, without
it. A read of the limit that merely fails says nothing of what is in force: the marker stays.
On a daemon without namespaces, where the limit is set but no tier, its loss holds no container
back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kai_fractions.gate.check import Outcome
from kai_fractions.node.engine import ContainerState
from kai_fractions.node.mps import MpsError
from kai_fractions.sim.nvml import FakeNvml
from tests.agent.builders import NODE, Rig, binder_annotations, marker_of, pod

from .nodepods import GPU0
from .test_engine import UID_A, Node, sm_pod
from .test_mps_cap_not_in_force import _gate, _not_vouched_for, _result

BUSY = MpsError("MpsDaemonBusy", "busy")

SETUPS: dict[str, Any] = {
    # every tier: the cgroup limit holds too, but the marker names mps-pinned in force
    "v3-every-tier": dict,
    # mps-pinned is the only hard memory tier (the watchdog only reports)
    "v3-pinned-only": lambda: dict(memory_enforcement="mps-pinned,watchdog"),
}
"""Where the pinned limit is a tier. Without namespaces (a 535 driver) it is set but no tier:
test_on_a_daemon_without_namespaces_a_lost_limit_holds_no_container_back."""


def _legacy(short_tmp: Path) -> Rig:
    """A 535 driver (an MPS daemon without namespaces) with a kill watchdog."""
    return Rig(short_tmp, nvml=FakeNvml.simulated(2, model="H100-80GB", seed=NODE,
                                                  driver_version="535.104.05"),
               mps_v3=False, watchdog_policy="kill")


def _applied_sm_pod(short_tmp: Path, setup: str = "v3-every-tier") -> tuple[Rig, str]:
    """A rig of `setup` with one sm-sharing pod applied: (the rig, the pod's uid)."""
    rig = Rig(short_tmp, **SETUPS[setup]())
    uid = rig.add(pod("sm", notes=binder_annotations(devices=rig.gpu0, mode="sm-sharing"))
                  )["metadata"]["uid"]
    assert rig.step().converged
    return rig, uid


def _pinned_lost(r, gpu: str, cause: str) -> None:
    """`r` is pending for its GPU's lost pinned limit, its marker set aside, for `cause`."""
    assert (r.state, r.reason, r.mps_cap_missing) == (ContainerState.PENDING,
                                                      "MpsPinnedLimitLost", True)
    assert r.message is not None and r.message.startswith(
        f"the MPS daemon's default pinned device memory limit of GPU 0 ({gpu}) is not the "
        f"plan's 20480 MiB (20G): {cause}")


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_a_pinned_limit_a_restarted_daemon_lost_is_not_vouched_for_until_set_again(
        short_tmp: Path, setup: str) -> None:
    rig, uid = _applied_sm_pod(short_tmp, setup)
    control = rig.mps.control
    names = set(control.namespaces)
    assert control.default_pinned_mib == {0: 20480} and _gate(rig, uid) is Outcome.RELEASE
    # a read that fails says nothing of what is in force: the running pod's marker stays
    written = rig.marker_path(uid).read_text()
    control.inject("get_default_pinned_mem_limit", BUSY)
    assert not rig.step().converged
    r = _result(rig, uid)
    assert (r.state, r.reason, r.mps_cap_missing) == (ContainerState.PENDING, "MpsDaemonBusy",
                                                      False)
    assert rig.marker_path(uid).read_text() == written
    control.kill()  # the agent restarts it: the pinned limit and every namespace are gone
    control.inject("set_default_pinned_mem_limit", BUSY, times=2)
    for _ in range(2):
        assert not rig.step().converged
        r = _result(rig, uid)
        # its own reason (a busy daemon's keeps the marker), naming the GPU and the limit
        _pinned_lost(r, rig.gpu0, "it reads back no limit (a restarted daemon forgets it), "
                     "and it could not be set again (MpsDaemonBusy: busy)")
        assert control.default_pinned_mib == {}
        assert control.namespaces == {}  # nothing to attach to (and start a server) unpinned
        _not_vouched_for(rig, uid)
    assert rig.step().converged
    assert _result(rig, uid).state is ContainerState.APPLIED
    assert control.default_pinned_mib == {0: 20480}
    assert set(control.namespaces) == names
    assert all(ns.active_thread_percentage == 50 for ns in control.namespaces.values())
    assert marker_of(rig, uid)["containers"]["main"]["state"] == "applied"
    assert _gate(rig, uid) is Outcome.RELEASE


def test_a_pinned_limit_the_set_reads_back_wrong_is_not_in_force(tmp_path: Path) -> None:
    """The read before the set showed the plan's GiB, yet the set's own readback another value
    (NotApplied): what the daemon holds is not the plan's."""
    node = Node(tmp_path / "cgroup")
    assert node.apply(sm_pod()).converged
    node.engine.forget()  # a resync writes the exact MiB again
    node.mps.inject("set_default_pinned_mem_limit", MpsError("NotApplied", "reads back 19G"))
    r = node.apply(sm_pod()).containers[(UID_A, "main")]
    _pinned_lost(r, GPU0, "a set of it read back another value (NotApplied: reads back "
                 "19G). An MPS server started for a client now would run without it")
    # known lost until a set succeeds: a set that fails for another reason keeps it so
    node.engine.forget()
    node.mps.inject("set_default_pinned_mem_limit", BUSY)
    r = node.apply(sm_pod()).containers[(UID_A, "main")]
    assert (r.state, r.reason, r.mps_cap_missing) == (ContainerState.PENDING,
                                                      "MpsPinnedLimitLost", True)
    assert r.message is not None and "it is not known set since (MpsDaemonBusy: busy)" in r.message
    assert node.apply(sm_pod()).containers[(UID_A, "main")].state is ContainerState.APPLIED
    # once set, any other failure of that set says nothing of what the daemon holds (it read
    # back right)
    node.engine.forget()
    node.mps.inject("set_default_pinned_mem_limit", BUSY)
    r = node.apply(sm_pod()).containers[(UID_A, "main")]
    assert (r.state, r.reason, r.mps_cap_missing) == (ContainerState.PENDING, "MpsDaemonBusy",
                                                      False)


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_a_pinned_limit_known_lost_stays_lost_while_its_read_fails(
        short_tmp: Path, setup: str) -> None:
    """Found lost, then unreadable (a busy daemon): nothing says it was set since, so its
    containers stay pending with the loss and no namespace of theirs is made (a client attaching
    would start an MPS server without it). Only a set that succeeds ends it."""
    rig, uid = _applied_sm_pod(short_tmp, setup)
    control = rig.mps.control
    names = set(control.namespaces)
    control.kill()
    control.inject("set_default_pinned_mem_limit", BUSY)
    assert not rig.step().converged
    assert _result(rig, uid).reason == "MpsPinnedLimitLost"
    control.inject("get_default_pinned_mem_limit", MpsError("MpsDaemonBusy", "read busy"))
    assert not rig.step().converged
    r = _result(rig, uid)
    _pinned_lost(r, rig.gpu0, "it reads back no limit (a restarted daemon forgets it), and "
                 "it could not be set again (MpsDaemonBusy: busy); it is not known set since "
                 "(MpsDaemonBusy: read busy)")
    assert control.namespaces == {}  # nothing to attach to, and start a server, unpinned
    _not_vouched_for(rig, uid)
    assert rig.step().converged  # set, then the namespaces made
    assert control.default_pinned_mib == {0: 20480}
    assert set(control.namespaces) == names
    assert marker_of(rig, uid)["containers"]["main"]["state"] == "applied"


def test_no_namespace_is_made_while_the_pinned_limit_is_not_read(short_tmp: Path) -> None:
    """A restarted daemon whose pinned limit the first pass cannot read: a daemon the agent
    started since holds none (its container pending, MpsPinnedLimitLost, its marker set
    aside), and the namespaces wait for a pass that sets it."""
    rig, uid = _applied_sm_pod(short_tmp)
    control = rig.mps.control
    control.kill()
    control.inject("get_default_pinned_mem_limit", BUSY)
    assert not rig.step().converged
    assert (_result(rig, uid).reason, _result(rig, uid).mps_cap_missing) == (
        "MpsPinnedLimitLost", True)
    _not_vouched_for(rig, uid)
    assert control.namespaces == {}
    assert rig.step().converged
    assert control.default_pinned_mib == {0: 20480} and len(control.namespaces) == 1


@pytest.mark.parametrize("attached", [False, True], ids=["nobody-attached", "client-attached"])
def test_a_namespace_there_while_the_pinned_limit_was_lost_is_made_again(
        short_tmp: Path, attached: bool) -> None:
    """The daemon lost its default pinned limit while the namespace was there (not through a
    restart, which takes the namespaces too): an MPS server started in it meanwhile runs without
    the limit, and nothing tells such a server apart. Once the limit is set again the namespace
    is made again before it is vouched for, when nobody is attached; a client attached may be on
    such a server, so the container stays pending until it exits."""
    rig, uid = _applied_sm_pod(short_tmp)
    control = rig.mps.control
    (name,) = control.namespaces
    if attached:
        control.attach_client(4242, name)
    control.default_pinned_mib.clear()  # lost, the namespace still there
    rig.step()
    assert control.default_pinned_mib == {0: 20480}
    r = _result(rig, uid)
    if attached:
        assert (r.state, r.reason, r.mps_cap_missing) == (ContainerState.PENDING,
                                                          "MpsPinnedLimitLost", True)
        assert r.message is not None and r.message.startswith(
            f"MPS namespace {name} was there while the default pinned device memory limit of "
            "its GPU was lost")
        assert "clients (pids 4242) are attached" in r.message
        assert control.namespaces[name].clients == {4242}  # the running pod is left alone
        _not_vouched_for(rig, uid)
        assert not rig.step().converged  # still attached: still pending
        control.detach_client(4242)
        rig.step()
    assert _result(rig, uid).state is ContainerState.APPLIED
    created = [args[0] for m, args in control.calls if m == "namespace_create"]
    assert created.count(name) == 2  # made, then made again once the limit was back
    assert control.namespaces[name].active_thread_percentage == 50
    assert marker_of(rig, uid)["containers"]["main"]["state"] == "applied"
    assert _gate(rig, uid) is Outcome.RELEASE


def test_a_namespace_made_after_a_restart_behind_the_pinned_set_is_made_again(
        short_tmp: Path) -> None:
    """Someone else restarts the daemon between the agent's pinned set and its namespace
    create: the namespace is made in a daemon without the limit. The limit read back after the
    create shows it, so the pass vouches for nothing, and the next makes the namespace again
    once the limit is set."""
    rig, uid = _applied_sm_pod(short_tmp)
    control = rig.mps.control
    (name,) = control.namespaces
    listed = control.namespace_list

    def restarted_then_listed(timeout=None) -> list[str]:  # once
        control.namespace_list = listed  # type: ignore[method-assign]
        control.kill()
        control.start()
        return listed(timeout)

    control.namespace_list = restarted_then_listed  # type: ignore[method-assign]
    assert not rig.step().converged
    r = _result(rig, uid)
    assert (r.state, r.reason, r.mps_cap_missing) == (ContainerState.PENDING,
                                                      "MpsPinnedLimitLost", True)
    assert r.message is not None and r.message.startswith(
        f"MPS namespace {name} was there while the default pinned device memory limit")
    _not_vouched_for(rig, uid)
    n = len(control.calls)
    assert rig.step().converged
    assert [m for m, _ in control.calls[n:]].count("namespace_delete") == 1
    assert control.namespaces[name].active_thread_percentage == 50
    assert marker_of(rig, uid)["containers"]["main"]["state"] == "applied"


@pytest.mark.parametrize("when", ["new-pod", "daemon-restarted"])
def test_a_namespace_not_there_is_not_taken_for_one_without_the_pinned_limit(
        short_tmp: Path, when: str) -> None:
    """The daemon reads back no pinned limit (a new GPU's first pod, a restarted daemon): the
    limit is set, then the namespace list is busy. The namespaces of that GPU were not there
    (nothing to hold a server without the limit): not MpsPinnedLimitLost "was there". A new
    pod's is a busy daemon; a restarted daemon's is known not on it (NamespaceCapNotSet, its
    marker set aside: the daemon the agent started since holds none)."""
    rig = Rig(short_tmp)
    notes = binder_annotations(devices=rig.gpu0, mode="sm-sharing")
    control = rig.mps.control
    if when == "daemon-restarted":
        uid = rig.add(pod("sm", notes=notes))["metadata"]["uid"]
        assert rig.step().converged
        control.kill()
    control.inject("namespace_list", BUSY)
    if when == "new-pod":
        uid = rig.add(pod("sm", notes=notes))["metadata"]["uid"]
    assert not rig.step().converged
    r = _result(rig, uid)
    expected = ("MpsDaemonBusy", False) if when == "new-pod" else ("NamespaceCapNotSet", True)
    assert (r.state, r.reason, r.mps_cap_missing) == (ContainerState.PENDING, *expected)
    assert "was there while" not in (r.message or "")
    assert control.default_pinned_mib == {0: 20480}
    n = len(control.calls)
    assert rig.step().converged
    assert "namespace_delete" not in [m for m, _ in control.calls[n:]]  # made once, as usual


def test_on_a_daemon_without_namespaces_a_lost_limit_holds_no_container_back(short_tmp: Path
                                                                            ) -> None:
    """A 535 driver: the limit is set but no tier (its tenants can change it), so the container
    is applied on a kill watchdog. A restarted daemon that forgot the limit and a set answered
    busy leave it applied, its marker as it was (no Warning, a gate releases): the pass reports
    the limit as the node's issue and the next one sets it. It used to set the marker aside
    (MpsPinnedLimitLost) for a limit the marker never vouched for."""
    rig = _legacy(short_tmp)
    uid = rig.add(pod("sm", notes=binder_annotations(devices=rig.gpu0, mode="sm-sharing"))
                  )["metadata"]["uid"]
    assert rig.step().converged
    written = rig.marker_path(uid).read_text()
    control = rig.mps.control
    control.kill()  # the agent restarts it: the pinned limit is gone
    control.inject("set_default_pinned_mem_limit", BUSY, times=2)
    for _ in range(2):
        report = rig.step()
        assert not report.converged and "MpsPinnedLimitLost" in report.errors
        r = _result(rig, uid)
        assert (r.state, r.mps_cap_missing) == (ContainerState.APPLIED, False)
        assert control.default_pinned_mib == {}
        assert rig.marker_path(uid).read_text() == written
        assert _gate(rig, uid) is Outcome.RELEASE
    assert rig.step().converged
    assert control.default_pinned_mib == {0: 20480}
    assert rig.cluster.event_reasons(uid) == ["Applied"]
