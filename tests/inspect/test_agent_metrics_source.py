"""`kai-fractions inspect --agent-metrics`: what the node agent's Prometheus text says of each
container, read from text the agent's own metrics code writes."""

from __future__ import annotations

from prometheus_client import generate_latest

from kai_fractions.inspect import agent_metrics, sources
from kai_fractions.node.agent.metrics import AgentMetrics
from kai_fractions.node.desired import ContainerKey
from kai_fractions.node.engine import ContainerResult, ContainerState
from kai_fractions.node.engine_reports import NOT_IN_FORCE_REASONS

UID_A = "aaaaaaaa-0000-4000-8000-000000000001"
UID_B = "bbbbbbbb-0000-4000-8000-000000000002"


def _result(uid: str, pod: str, state: ContainerState, reason: str | None = None,
            missing: bool = False) -> ContainerResult:
    return ContainerResult(key=ContainerKey(uid, "main"), ref=f"team-a/{pod}/main", state=state,
                           reason=reason, mps_cap_missing=missing)


def test_a_container_whose_mps_cap_is_not_in_force_is_read_with_its_uid_and_reason() -> None:
    metrics = AgentMetrics("node-a")
    metrics.count_caps([
        _result(UID_A, "a", ContainerState.PENDING, "MpsPinnedLimitLost", missing=True),
        _result(UID_B, "b", ContainerState.PENDING, "MpsDaemonBusy")])  # keeps its marker
    state = sources.from_metrics_text(generate_latest(metrics.registry).decode(), "metrics http://x")
    (a,) = state.allocations
    assert (a.namespace, a.pod, a.container, a.uid, a.state, a.reason, a.cap_not_in_force) == (
        "team-a", "a", "main", UID_A, "", "MpsPinnedLimitLost", True)
    assert a.message.startswith("the node agent's metrics say an MPS cap this container relies "
                                "on is not in force: its readiness marker is set aside")
    assert a.used_bytes is None  # no usage series read: not known
    assert not state.knows_limits
    # applied again: the series went, and nothing is said of it
    metrics.count_caps([_result(UID_A, "a", ContainerState.APPLIED)])
    assert sources.from_metrics_text(generate_latest(metrics.registry).decode(),
                             "metrics http://x").allocations == ()


def test_a_container_whose_memory_limit_is_not_in_force_is_read_and_said_so() -> None:
    """The pod cgroup's GPU memory limit known lost sets the marker aside as an MPS cap does
    (6b6a0a4): the metric counts it too, and inspect says which cap it is."""
    metrics = AgentMetrics("node-a")
    lost = ContainerResult(key=ContainerKey(UID_A, "main"), ref="team-a/a/main",
                           state=ContainerState.PENDING, reason="MemoryLimitNotInForce",
                           limit_missing=True)
    metrics.count_caps([lost])
    (a,) = sources.from_metrics_text(generate_latest(metrics.registry).decode(),
                                     "metrics http://x").allocations
    assert (a.uid, a.reason, a.cap_not_in_force) == (UID_A, "MemoryLimitNotInForce", True)
    assert a.message.startswith("the node agent's metrics say the GPU memory limit on this "
                                "container's pod cgroup is not in force")
    assert "MemoryLimitNotInForce event" in a.message


def test_a_container_whose_gpus_compute_mode_is_not_in_force_is_told_to_set_it() -> None:
    """ComputeModeNotInForce got the MPS cap's generic message, which names neither the
    compute mode nor what sets it."""
    metrics = AgentMetrics("node-a")
    metrics.count_caps([ContainerResult(
        key=ContainerKey(UID_A, "main"), ref="team-a/a/main", state=ContainerState.PENDING,
        reason="ComputeModeNotInForce", mps_cap_missing=True)])
    (a,) = sources.from_metrics_text(generate_latest(metrics.registry).decode(),
                                     "metrics http://x").allocations
    assert (a.uid, a.reason, a.cap_not_in_force) == (UID_A, "ComputeModeNotInForce", True)
    assert a.message.startswith("the node agent's metrics say a GPU of this sm-sharing "
                                "container is not in compute mode EXCLUSIVE_PROCESS and the "
                                "agent could not set it")
    assert "nvidia-smi -i <uuid of its GPU> -c EXCLUSIVE_PROCESS" in a.message


def test_every_reason_a_cap_is_not_in_force_for_has_a_message() -> None:
    """A reason the node adds to NOT_IN_FORCE_REASONS needs a message of its own here (the
    fallback is the MPS cap's)."""
    assert set(agent_metrics.CAP_MESSAGES) == NOT_IN_FORCE_REASONS


def test_whose_agent_the_metrics_are_is_read_from_its_node_ready_series() -> None:
    """Only this node's agent is taken for it: the mirror's metrics, or another node's agent,
    are an agent not read, and why (kai_fractions_node_ready, its `node` label)."""
    from types import SimpleNamespace

    ready = SimpleNamespace(ready=True, reason="Reconciling")
    metrics = AgentMetrics("node-a", condition=lambda: ready)
    text = generate_latest(metrics.registry).decode()
    assert sources.from_metrics_text(text, "metrics http://x", node="node-a").reachable
    other = sources.from_metrics_text(text, "metrics http://x", node="node-b")
    assert (other.reachable, other.error) == (False, (
        "these are the metrics of node node-a's agent, not node-b's: give those of the node "
        "agent's pod on node-b"))
    before_first_pass = AgentMetrics("node-a", condition=lambda: None)
    assert not sources.from_metrics_text(generate_latest(before_first_pass.registry).decode(),
                                         "metrics http://x", node="node-a").reachable


def test_a_refused_container_is_read_with_its_reason() -> None:
    """The series' name and labels as the agent's own registry has them."""
    from kai_fractions.inspect.agent_metrics import REFUSED_METRIC

    text = generate_latest(AgentMetrics("node-a").registry).decode()
    assert f"# TYPE {REFUSED_METRIC} gauge" in text
    refused = (f'{REFUSED_METRIC}{{container="main",namespace="team-a",node="node-a",pod="a",'
               f'pod_uuid="{UID_A}",reason="SmSharingDisabled"}} 1.0\n')
    (a,) = sources.from_metrics_text(text + refused, "metrics http://x").allocations
    assert (a.pod, a.uid, a.state, a.reason, a.cap_not_in_force) == (
        "a", UID_A, "refused", "SmSharingDisabled", False)
