"""The node agent's Prometheus text as an `AgentState` (`inspect --agent-metrics`): each
container's used memory per GPU (not known on a GPU whose usage the agent cannot read:
`kai_fractions_agent_gpu_usage_unknown`), the containers it refuses (with the reason) and those
with a cap known not in force; and whose agent it is (`kai_fractions_node_ready{node}`), so that
another endpoint (the mirror's, another node's agent) is not taken for this node's agent."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from .agent_state import AgentAllocation, AgentState, unreachable

MEMORY_USED_METRIC = "kai_fractions_container_gpu_memory_used_bytes"
CAP_NOT_IN_FORCE_METRIC = "kai_fractions_container_cap_not_in_force"
REFUSED_METRIC = "kai_fractions_container_refused"
USAGE_UNKNOWN_METRIC = "kai_fractions_agent_gpu_usage_unknown"
"""1 per GPU whose usage the agent's last watchdog check could not read, by reason."""
NODE_READY_METRIC = "kai_fractions_node_ready"
"""The agent's own series, one per agent, labelled with its node (absent before its first
pass)."""

Key = tuple[str, str, str]
"""(namespace, pod, container) of a container's series."""


def _samples(text: str) -> list[Any]:
    """Every sample of the text (raises ValueError for text that is not Prometheus's)."""
    from prometheus_client.parser import text_string_to_metric_families

    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def _key(sample: Any) -> Key:
    return (sample.labels.get("namespace", ""), sample.labels.get("pod", ""),
            sample.labels.get("container", ""))


def parse_usage(samples: list[Any]) -> dict[Key, dict[str, int]]:
    """(namespace, pod, container) -> {gpu uuid: bytes}."""
    out: dict[Key, dict[str, int]] = {}
    for s in samples:
        if s.name == MEMORY_USED_METRIC:
            out.setdefault(_key(s), {})[s.labels.get("gpu_uuid", "")] = int(s.value)
    return out


def parse_reasons(samples: list[Any], metric: str) -> dict[Key, tuple[str, str]]:
    """(namespace, pod, container) -> (pod uid, reason) of each container that `metric` (a
    series by reason: refused, cap not in force) marks at 1."""
    out: dict[Key, tuple[str, str]] = {}
    for s in samples:
        if s.name == metric and s.value >= 1:
            found = (s.labels.get("pod_uuid", ""), s.labels.get("reason", ""))
            key = _key(s)
            out[key] = min(out.get(key, found), found)  # one series per container: stable
    return out


def parse_caps(samples: list[Any]) -> dict[Key, tuple[str, str]]:
    return parse_reasons(samples, CAP_NOT_IN_FORCE_METRIC)


def parse_unknown(samples: list[Any]) -> dict[str, str]:
    """GPU uuid -> reason of each GPU whose usage the agent cannot read now."""
    out: dict[str, str] = {}
    for s in samples:
        if s.name == USAGE_UNKNOWN_METRIC and s.value >= 1:
            uuid, reason = s.labels.get("gpu_uuid", ""), s.labels.get("reason", "")
            out[uuid] = min(out.get(uuid, reason), reason)
    return out


CAP_MESSAGE = (
    "the node agent's metrics say an MPS cap this container relies on is not in force: its "
    "readiness marker is set aside (a gate of the pod waits), and a client of it that attached "
    "meanwhile may run uncapped, whatever its gate did before. The pod's MpsCapNotInForce "
    "event says why and what to do (on the node, --agent-socket gives the agent's own "
    "message)")
LIMIT_MESSAGE = (
    "the node agent's metrics say the GPU memory limit on this container's pod cgroup is not in "
    "force and could not be set: a gate of the pod waits (a running pod's readiness marker is "
    "set aside, and what of it runs meanwhile runs without the cap). A running pod's "
    "MemoryLimitNotInForce event says why; on the node, --agent-socket gives the agent's own "
    "message with NVML's error")
WATCHDOG_MESSAGE = (
    "the node agent's metrics say its watchdog, this container's only GPU memory tier, cannot "
    "see the container's GPU usage, so its cap is not in force: a gate of the pod waits (a "
    "running pod's readiness marker is set aside, and what of it runs meanwhile runs without "
    "the cap). kai_fractions_agent_gpu_usage_unknown names the GPU and why; a running pod's "
    "WatchdogBlind event and the agent's log say what to do (on the node, --agent-socket "
    "gives the agent's own message)")
COMPUTE_MODE_MESSAGE = (
    "the node agent's metrics say a GPU of this sm-sharing container is not in compute mode "
    "EXCLUSIVE_PROCESS and the agent could not set it: there a process that leaves MPS runs "
    "outside the container's MPS caps, so its readiness marker is set aside (a gate of the pod "
    "waits) until the mode is in force. Let the agent set it (it retries every pass), or run "
    "nvidia-smi -i <uuid of its GPU> -c EXCLUSIVE_PROCESS on the node. The pod's "
    "MpsCapNotInForce event names the GPU, the mode read back and NVML's error (on the node, "
    "--agent-socket gives the agent's own message)")
REFUSED_MESSAGE = (
    "the node agent's metrics say it refuses this container, for the reason shown: the pod's "
    "Refused event gives its message (on the node, --agent-socket gives the agent's own)")
MEMORY_LIMIT_NOT_IN_FORCE = "MemoryLimitNotInForce"
"""kai_fractions.node.memory_limits' reason of that series (read from the metrics, as text)."""
WATCHDOG_BLIND = "WatchdogBlind"
"""kai_fractions.node.engine_reports' reason of that series (read from the metrics, as text)."""
COMPUTE_MODE_NOT_IN_FORCE = "ComputeModeNotInForce"
"""kai_fractions.node.engine_reports' reason of that series (read from the metrics, as text)."""
MPS_CAP_REASONS = ("NamespaceCapUnverified", "NamespaceCapNotSet", "MpsPinnedLimitLost")
"""kai_fractions.node.mps_caps' reasons of an MPS cap not in force (as text)."""
CAP_MESSAGES = {**dict.fromkeys(MPS_CAP_REASONS, CAP_MESSAGE),
                COMPUTE_MODE_NOT_IN_FORCE: COMPUTE_MODE_MESSAGE,
                MEMORY_LIMIT_NOT_IN_FORCE: LIMIT_MESSAGE, WATCHDOG_BLIND: WATCHDOG_MESSAGE}
"""The message of each reason of kai_fractions_container_cap_not_in_force: every one of the
node's NOT_IN_FORCE_REASONS (a test holds them equal). A reason of a newer agent gets
CAP_MESSAGE."""


def not_this_agent(samples: list[Any], node: str) -> str:
    """Why these are not the metrics of `node`'s agent; "" when they are."""
    nodes = sorted({s.labels.get("node", "") for s in samples if s.name == NODE_READY_METRIC})
    if not nodes:
        return (f"not a node agent's metrics: no {NODE_READY_METRIC} series (the agent serves "
                "it on port 9400 of its pod, from its first pass on)")
    if node not in nodes:
        return (f"these are the metrics of node {', '.join(nodes)}'s agent, not {node}'s: give "
                f"those of the node agent's pod on {node}")
    return ""


def _allocation(key: Key, by_gpu: dict[str, int] | None, refused: tuple[str, str] | None,
                cap: tuple[str, str] | None, blind: dict[str, str]) -> AgentAllocation:
    namespace, pod, container = key
    uid, reason = refused or cap or ("", "")
    message = ""
    if refused is not None:
        message = REFUSED_MESSAGE
    elif cap is not None:
        message = CAP_MESSAGES.get(reason, CAP_MESSAGE)
    unknown = {u: blind[u] for u in by_gpu or {} if u in blind}
    return AgentAllocation(
        namespace=namespace, pod=pod, container=container, uid=uid,
        state="refused" if refused is not None else "", reason=reason, message=message,
        cap_not_in_force=refused is None and cap is not None,
        used_bytes=sum(by_gpu.values()) if by_gpu is not None and not unknown else None,
        used_by_gpu=MappingProxyType(dict(by_gpu or {})),
        usage_unknown=MappingProxyType(unknown))


def from_metrics_text(text: str, source: str, node: str = "") -> AgentState:
    """AgentState from the agent's Prometheus text: each container's usage per GPU (not known
    where the agent cannot read it: `AgentAllocation.usage_unknown`), its refusal (`state`
    refused, with the series' reason), a cap known not in force
    (`AgentAllocation.cap_not_in_force`: an MPS cap, the pod cgroup's GPU memory limit, a blind
    watchdog that is its only memory tier).
    Given `node`, text that is not that node's agent's is an unreachable agent, and why.
    Raises ValueError for text that is not Prometheus's."""
    samples = _samples(text)
    if node:
        problem = not_this_agent(samples, node)
        if problem:
            return unreachable(source, problem)
    usage, caps = parse_usage(samples), parse_caps(samples)
    refused = parse_reasons(samples, REFUSED_METRIC)
    blind = parse_unknown(samples)
    return AgentState(source=source, allocations=tuple(
        _allocation(key, usage.get(key), refused.get(key), caps.get(key), blind)
        for key in sorted(usage.keys() | caps.keys() | refused.keys())))
