"""On an MPS daemon without namespaces (drivers before r615) every sm-sharing container mounts
the daemon's own pipe directory, control pipe included, and any of its processes (root or not)
can change the GPU's default pinned limit there: the real 535 control client takes
`set_default_device_pinned_mem_limit` from uid 65534. So mps-pinned is no tier there, as a
client env is none: the agent still sets the limit (a well-behaved tenant stays under it), but a
container whose cap would rest on it alone is refused (MemoryLimitsUnsupported, saying why and
what to do) and one it is not alone on counts its other tier. In an MPS namespace of its own (a
v3 daemon) it stays a tier. One rule decides it: `plan_refusals.hard_tiers_of`.
"""

from __future__ import annotations

import pytest

from kai_fractions.contract import parse_pod, plan_pod
from kai_fractions.node.agent.blindness import watchdog_only
from kai_fractions.node.config import Mechanism, NodeConfig
from kai_fractions.node.desired import (
    ComputeEnforcement,
    ContainerKey,
    DesiredState,
    NodePod,
    RefusalReason,
    plan_node,
)
from kai_fractions.node.plan_refusals import PINNED_NOT_A_TIER, hard_tiers_of

from .nodepods import GIB, GPU0, UID_A, annotations, inventory, node_pod, watchdog_caps

OLD = "535.104.05"
REPORT = NodeConfig(node_name="node-a")  # cgroup,mps-pinned,watchdog; policy report
KILL = NodeConfig(node_name="node-a", watchdog_policy="kill")

C, P, W = Mechanism.CGROUP, Mechanism.MPS_PINNED, Mechanism.WATCHDOG
NS, ENV, TS = (ComputeEnforcement.MPS_NAMESPACE, ComputeEnforcement.MPS_CLIENT_ENV,
               ComputeEnforcement.TIME_SLICING)


def sm() -> NodePod:
    return node_pod(UID_A, notes=annotations(mode="sm-sharing", devices=(GPU0,)))


def legacy(*pods: NodePod, config: NodeConfig = REPORT, **kw) -> DesiredState:
    """A driver before r615: no cgroup limits, an MPS daemon without namespaces."""
    return plan_node(pods, inventory(memory_limits=False, driver=OLD), config, **kw)


@pytest.mark.parametrize(("mechanisms", "compute", "hard"), [
    ({P, W}, NS, {P}),
    ({P, W}, ENV, set()),
    ({C, P, W}, ENV, {C}),
    ({C, P, W}, NS, {C, P}),
    ({W}, TS, set()),
    ({C}, TS, {C}),
    # as a marker records them: names, the compute's name, and qualified names
    ({"mps-pinned", "watchdog"}, "mps-namespace", {P}),
    ({"mps-pinned", "watchdog"}, "mps-client-env", set()),
    ({"mps-pinned (tenants can change it)", "watchdog"}, "mps-client-env", set()),
    ({"cgroup", "watchdog (reports, stops nothing)"}, "time-slicing", {C}),
])
def test_the_one_rule(mechanisms, compute, hard) -> None:
    assert hard_tiers_of(mechanisms, compute) == hard


def test_sm_sharing_whose_cap_would_rest_on_the_pinned_limit_alone_is_refused() -> None:
    state = legacy(sm())
    (r,) = state.refusals
    assert (r.key, r.reason, r.final) == (ContainerKey(UID_A, "main"),
                                          RefusalReason.MEMORY_LIMITS_UNSUPPORTED, True)
    assert r.message == (
        f"cannot cap this container's GPU memory: NVIDIA driver {OLD} has no cgroup GPU memory "
        f"limits (they need r615 or newer), {PINNED_NOT_A_TIER}, and a watchdog with "
        "--watchdog-policy=report only reports use over the cap, it stops nothing (the "
        "container would run without a cap); set --watchdog-policy=kill (the chart's "
        "watchdog.policy: kill) so that the watchdog caps the memory by stopping what exceeds "
        "it, or upgrade the driver to r615 or newer")
    assert "any of its processes can change the GPU's default pinned limit" in r.message
    assert state.containers == () and state.gpu(GPU0).mps_pinned_mib is None
    # without a watchdog: what would cap it
    (r,) = legacy(sm(), config=NodeConfig(memory_enforcement="mps-pinned")).refusals
    assert r.message == (
        f"cannot cap this container's GPU memory: NVIDIA driver {OLD} has no cgroup GPU memory "
        "limits (they need r615 or newer) and --memory-enforcement=mps-pinned allows no "
        f"fallback ({PINNED_NOT_A_TIER}); upgrade the driver to r615 or newer and add cgroup "
        "to --memory-enforcement, or add watchdog to --memory-enforcement with "
        "--watchdog-policy=kill (a watchdog that only reports caps nothing)")
    # mps-pinned is not offered where it would cap nothing
    (r,) = legacy(sm(), config=NodeConfig(memory_enforcement="cgroup,watchdog")).refusals
    assert "mps-pinned" not in r.message


def test_with_a_kill_watchdog_the_pinned_limit_is_still_set_but_the_watchdog_is_the_tier(
        ) -> None:
    state = legacy(sm(), config=KILL)
    assert state.refusals == ()
    (c,) = state.containers
    assert (c.compute, c.mechanisms) == (ENV, {P, W})
    assert state.gpu(GPU0).mps_pinned_mib == 20 * 1024  # set for a well-behaved tenant
    assert hard_tiers_of(c.mechanisms, c.compute) == set()
    assert watchdog_only(c, True)  # the watchdog's blindness leaves it uncapped
    assert watchdog_caps(state) == {(UID_A, "main"): {GPU0: 20 * GIB}}


def test_a_running_container_the_pinned_limit_alone_capped_is_refused_and_still_watched(
        ) -> None:
    """Applied by an agent before this rule (its marker said mps-pinned): refused now, held to
    its plan, its usage still watched, and its message says it runs without a cap."""
    pod = sm()
    held = {ContainerKey(pod.uid, p.container): p for p in plan_pod(parse_pod(pod.view))}
    state = legacy(pod, applied=held)
    (r,) = state.refusals
    (plan,) = held.values()
    assert (r.reason, r.final, r.plan_digest) == (RefusalReason.MEMORY_LIMITS_UNSUPPORTED, True,
                                                  plan.digest)
    assert "it runs without a cap" in r.message and PINNED_NOT_A_TIER in r.message
    assert r.watched is not None and r.watched.mechanisms == {W}


def test_in_a_namespace_of_its_own_the_pinned_limit_stays_a_tier() -> None:
    """The same flags and driver, an MPS daemon with namespaces."""
    state = plan_node([sm()], inventory(memory_limits=False, mps_namespaces=True, driver=OLD),
                      REPORT)
    (c,) = state.containers
    assert (c.compute, c.mechanisms) == (NS, {P, W})
    assert hard_tiers_of(c.mechanisms, c.compute) == {P}
    assert not watchdog_only(c, True)
