"""A node before r615 (no cgroup limits, an MPS daemon without namespaces): every sm-sharing
tenant reaches the daemon's control pipe, and the real 535 control client lets a non-root one
change the GPU's default pinned limit (`set_default_device_pinned_mem_limit` takes effect; only
`quit` is refused). The agent kept vouching for that limit: its marker said "memory mps-pinned"
for a container it alone capped, GetNodeState listed it as an applied limit, the node condition
called it a tier, and a watchdog gone blind left such a container's marker in place.

Now the limit is still set (and put back when someone changes it), but no tier there: with the
default report watchdog such a container is refused (the node, where nothing can be capped, is
not ready: DriverTooOld, saying why); with a kill watchdog it is applied on the watchdog, and
everything the agent shows says the pinned limit is one its tenants can change.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kai_fractions.gate.check import Outcome
from kai_fractions.marker import ContainerMarker
from kai_fractions.node.agent.grpc_service import node_state
from kai_fractions.node.agent.markers import entry_watchdog_only
from kai_fractions.node.config import WatchdogPolicy
from kai_fractions.node.plan_refusals import PINNED_NOT_A_TIER
from kai_fractions.sim.nvml import FakeNvml

from .builders import NODE, Rig, binder_annotations, marker_of, pod
from .builders import gate_outcome as gate
from .builders import result_of as result

OLD_DRIVER = "535.104.05"
DIGEST = "sha256:" + "0" * 64
APPLIED = ("limits in force: memory mps-pinned (tenants can change it),watchdog; "
           "compute mps-client-env")


def legacy_node(tmp: Path, **config) -> Rig:
    nvml = FakeNvml.simulated(2, model="H100-80GB", seed=NODE, driver_version=OLD_DRIVER)
    return Rig(tmp, nvml=nvml, mps_v3=False, **config)


def sm_pod(rig: Rig) -> str:
    return rig.add(pod("sm", notes=binder_annotations(devices=rig.gpu0, mode="sm-sharing"))
                   )["metadata"]["uid"]


def test_with_the_default_report_watchdog_the_container_is_refused_and_the_node_not_ready(
        short_tmp: Path) -> None:
    rig = legacy_node(short_tmp)
    uid = sm_pod(rig)
    rig.step()
    entry = marker_of(rig, uid)["containers"]["main"]
    assert (entry["state"], entry["reason"]) == ("refused", "MemoryLimitsUnsupported")
    assert PINNED_NOT_A_TIER in entry["message"]
    assert "set --watchdog-policy=kill" in entry["message"]
    assert gate(rig, uid) is Outcome.FAIL
    assert rig.mps.control.default_pinned_mib == {}
    cond = rig.agent.condition()
    assert (cond.ready, cond.reason) == (False, "DriverTooOld")
    assert PINNED_NOT_A_TIER in cond.message
    assert "no fractional container's GPU memory can be capped on this node" in cond.message


def test_with_a_kill_watchdog_it_is_applied_on_the_watchdog_and_says_so(short_tmp: Path
                                                                       ) -> None:
    rig = legacy_node(short_tmp, watchdog_policy=WatchdogPolicy.KILL)
    uid = sm_pod(rig)
    assert rig.step().converged
    assert marker_of(rig, uid)["containers"]["main"]["message"] == APPLIED
    assert gate(rig, uid) is Outcome.RELEASE
    control = rig.mps.control
    assert control.default_pinned_mib == {0: 20480}  # still set: it bounds a tenant who abides
    (a,) = node_state(rig.reconciler.view, NODE, None, "c").allocations
    assert [x.mechanism for x in a.applied_limits] == ["watchdog"]
    assert "every sm-sharing tenant of the node can change" in a.message
    cond = rig.agent.condition()
    assert cond.ready and "MPS pinned limit (sm-sharing; set, but no tier" in cond.message
    # a tenant lifts it: the next pass puts it back, and the marker never vouched for it
    control.default_pinned_mib[0] = 80 * 1024
    assert rig.step().converged
    assert control.default_pinned_mib == {0: 20480}
    assert marker_of(rig, uid)["containers"]["main"]["message"] == APPLIED
    assert rig.cluster.event_reasons(uid) == ["Applied"]


def test_a_blind_watchdog_sets_its_marker_aside(short_tmp: Path) -> None:
    """The watchdog is its only tier: where it cannot see the GPU, nothing caps the container
    (in a namespace of its own the pinned limit would: test_watchdog_only_tier_blind)."""
    rig = legacy_node(short_tmp, watchdog_policy=WatchdogPolicy.KILL)
    uid = sm_pod(rig)
    assert rig.step().converged
    rig.nvml.fail("running_processes", "NoPermission", times=None, device=rig.gpu0)
    rig.reconciler.check_usage()
    assert not rig.step().converged
    r = result(rig, uid)
    assert (r.state.value, r.reason, r.not_in_force) == ("pending", "WatchdogBlind", True)
    assert marker_of(rig, uid) is None and gate(rig, uid) is Outcome.WAIT
    assert rig.cluster.event_reasons(uid) == ["Applied", "WatchdogBlind"]


@pytest.mark.parametrize(("message", "only"), [
    # as this release writes it, and as earlier ones did on such a node
    (APPLIED, True),
    ("limits in force: memory mps-pinned,watchdog; compute mps-client-env", True),
    # in a namespace of its own the pinned limit caps it
    ("limits in force: memory mps-pinned,watchdog; compute mps-namespace", False),
    ("limits in force: memory cgroup,mps-pinned (tenants can change it),watchdog; "
     "compute mps-client-env", False),
])
def test_a_marker_entry_on_such_a_node_records_the_watchdog_as_its_only_tier(
        message: str, only: bool) -> None:
    """What a fresh agent with no plan reads (`entry_watchdog_only`): it sets aside such an
    entry while no watchdog watches it (an agent stop, passes that fail before they plan)."""
    assert entry_watchdog_only(ContainerMarker.applied(DIGEST, message)) is only


def test_a_daemon_that_cannot_say_its_protocol_is_not_taken_for_one_without_namespaces(
        short_tmp: Path) -> None:
    """`nvidia-cuda-mps-control --help` failing (a timeout) says nothing of the protocol: on an
    r615 node the plan keeps the namespaces (and mps-pinned its tier), and the container waits
    for the daemon rather than be refused for good as on a pre-r615 one."""
    from kai_fractions.node.mps.errors import MpsError

    rig = Rig(short_tmp, memory_enforcement="mps-pinned,watchdog")
    uid = sm_pod(rig)
    assert rig.step().converged
    written = rig.marker_path(uid).read_text()

    def cannot_say() -> bool:
        raise MpsError("CommandFailed", "nvidia-cuda-mps-control --help did not finish")

    rig.mps.control.supports_protocol_v3 = cannot_say  # type: ignore[method-assign]
    assert not rig.step().converged
    r = result(rig, uid)
    assert (r.state.value, r.reason) == ("pending", "CommandFailed")
    assert rig.marker_path(uid).read_text() == written
