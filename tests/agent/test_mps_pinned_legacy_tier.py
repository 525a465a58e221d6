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


def test_a_pinned_limit_not_put_back_holds_no_container_back(short_tmp: Path) -> None:
    """No tier here, so losing the limit is no container's: a tenant lifts it and the put-back
    is answered busy once. It used to set the marker aside (MpsPinnedLimitLost, a Warning, a
    gate that waits) for a limit the marker never vouched for; now the container stays applied
    on its watchdog, the pass reports the limit as a node issue, and the next one sets it."""
    from kai_fractions.node.mps import errors as e
    from kai_fractions.node.mps.errors import MpsError

    rig = legacy_node(short_tmp, watchdog_policy=WatchdogPolicy.KILL)
    uid = sm_pod(rig)
    assert rig.step().converged
    written = rig.marker_path(uid).read_text()
    control = rig.mps.control
    control.default_pinned_mib[0] = 80 * 1024  # a tenant lifts it
    control.inject("set_default_pinned_mem_limit", MpsError(e.MPS_DAEMON_BUSY, "busy"))
    report = rig.step()
    assert not report.converged and "MpsPinnedLimitLost" in report.errors  # retried
    r = result(rig, uid)
    assert (r.state.value, r.not_in_force) == ("applied", False)
    assert rig.marker_path(uid).read_text() == written and gate(rig, uid) is Outcome.RELEASE
    assert rig.cluster.event_reasons(uid) == ["Applied"]
    (a,) = node_state(rig.reconciler.view, NODE, None, "c").allocations
    assert [x.mechanism for x in a.applied_limits] == ["watchdog"]  # still in force
    assert rig.step().converged
    assert control.default_pinned_mib == {0: 20480}


def test_a_daemon_not_running_still_sets_the_marker_aside(short_tmp: Path) -> None:
    """The pinned limit is no tier, but the container's share of the SMs is the MPS server's:
    without a daemon it is not in force, and that is what the result says (not the limit)."""
    rig = legacy_node(short_tmp, watchdog_policy=WatchdogPolicy.KILL)
    uid = sm_pod(rig)
    assert rig.step().converged
    rig.mps.control.kill()
    rig.mps.can_start = False
    assert not rig.step().converged
    r = result(rig, uid)
    assert (r.state.value, r.reason, r.not_in_force) == ("pending", "NamespaceCapNotSet", True)
    assert "the MPS server its clients reach" in r.message
    assert "pinned" not in r.message
    assert marker_of(rig, uid) is None and gate(rig, uid) is Outcome.WAIT


def test_a_pod_applied_while_mps_pinned_was_its_tier_is_told_so_after_the_upgrade(
        short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An earlier release applied it on mps-pinned (then a tier here) beside the default report
    watchdog; the upgraded agent refuses it, and says why it runs: not "started before such a
    watchdog was refused" (it was refused then too), but while mps-pinned counted as a tier."""
    import kai_fractions.node.agent.marker_rules as marker_rules
    import kai_fractions.node.plan_refusals as plan_refusals
    from kai_fractions.node.config import HARD_TIERS, Mechanism

    def earlier_rule(mechanisms, compute):  # mps-pinned a tier whatever the daemon
        return frozenset(Mechanism(m) for m in mechanisms if m in {t.value for t in HARD_TIERS})

    monkeypatch.setattr(plan_refusals, "hard_tiers_of", earlier_rule)
    monkeypatch.setattr(marker_rules, "hard_tiers_of", earlier_rule)
    rig = legacy_node(short_tmp)
    uid = sm_pod(rig)
    assert rig.step().converged
    assert marker_of(rig, uid)["containers"]["main"]["state"] == "applied"
    monkeypatch.undo()
    upgraded = rig.restarted()
    upgraded.step()
    entry = marker_of(upgraded, uid)["containers"]["main"]
    assert (entry["state"], entry["reason"]) == ("refused", "MemoryLimitsUnsupported")
    assert ("this container was started while mps-pinned still counted as a tier on this "
            "daemon (an earlier release of the agent): until its pod's sandbox restarts (a "
            "node reboot restarts it) it runs without a cap") \
        in entry["message"]
    assert "before such a watchdog was refused" not in entry["message"]


def test_a_pinned_limit_no_daemon_answered_holds_the_container_back(short_tmp: Path) -> None:
    """The limit's command found no daemon (it died in the pass, after the supervisor's check):
    not the limit's loss but the MPS server's, which the container's share of the SMs needs.
    It is pending with that error, its marker kept (a busy or slow daemon may hold it all)
    until the supervisor's next check says whether it runs."""
    from kai_fractions.node.mps import errors as e
    from kai_fractions.node.mps.errors import MpsError

    rig = legacy_node(short_tmp, watchdog_policy=WatchdogPolicy.KILL)
    uid = sm_pod(rig)
    assert rig.step().converged
    written = rig.marker_path(uid).read_text()
    control = rig.mps.control
    control.default_pinned_mib[0] = 80 * 1024
    control.inject("set_default_pinned_mem_limit",
                   MpsError(e.MPS_DAEMON_UNREACHABLE, "no MPS control daemon answers"))
    assert not rig.step().converged
    r = result(rig, uid)
    assert (r.state.value, r.reason, r.not_in_force) == ("pending", e.MPS_DAEMON_UNREACHABLE,
                                                         False)
    assert rig.marker_path(uid).read_text() == written
    assert rig.step().converged
    assert result(rig, uid).state.value == "applied"
