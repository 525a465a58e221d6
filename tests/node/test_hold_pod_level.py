"""`plan_node` holding a running container's applied plan when its share is gone from the pod's
annotations: the change is refused as gone, unless the refusal is the whole pod's (annotations
that cannot be read, a veto); another container of the pod refused for its own sake (not bound
yet, a plan that cannot be made) is no reason of the running one's."""

from __future__ import annotations

from kai_fractions.contract import parse_pod, plan_pod
from kai_fractions.node.config import NodeConfig
from kai_fractions.node.desired import (
    ContainerKey,
    NodePod,
    Refusal,
    RefusalReason,
    plan_node,
)

from .nodepods import UID_A, annotations, inventory, manifest, node_pod

CONFIG = NodeConfig(node_name="node-a")
MAIN, SIDE = ContainerKey(UID_A, "main"), ContainerKey(UID_A, "side")
GONE = "the pod's GPU annotations no longer ask for a GPU share for this container"


def applied() -> dict:
    (plan,) = plan_pod(parse_pod(node_pod(UID_A, notes=annotations()).view))
    return {MAIN: plan}


def with_side(notes: dict[str, str]) -> NodePod:
    """The pod with `main` running, its annotations now `notes` (main's share gone)."""
    return NodePod.from_manifest(manifest(UID_A, containers=("main", "side"), notes=notes))


def test_a_gone_share_is_refused_for_the_pods_own_refusal_only() -> None:
    """The running container's PlanChangeRefused said "its plan is refused now (NotBound: no
    GPU assigned yet: nvidia.com/container.side.gpus.devices is missing ...)": the other
    container's wait, not its own change."""
    state = plan_node([with_side(annotations("side", devices=None))], inventory(), CONFIG,
                      applied=applied())
    assert state.refusal(SIDE).reason is RefusalReason.NOT_BOUND
    change = state.refusal(MAIN)
    assert change.reason is RefusalReason.PLAN_CHANGE_REFUSED
    assert change.message.startswith(GONE), change.message
    assert "side" not in change.message
    assert [c.key for c in state.containers] == [MAIN]  # held

    # annotations that cannot be read refuse the whole pod: its reason is the running
    # container's too
    state = plan_node([with_side(annotations("side", request="30Gi", limit="20Gi"))],
                      inventory(), CONFIG, applied=applied())
    assert state.refusal(MAIN).message.startswith(
        "its plan is refused now (ContractInvalid: the pod's GPU annotations are invalid: "
        "nvidia.com/container.side.gpu-memory.limit")

    # so does a veto (a signature that does not verify decides for the whole pod)
    veto = Refusal(key=SIDE, pod_namespace="default", pod_name="p",
                   reason=RefusalReason.CONTRACT_INVALID, message="bad signature")
    state = plan_node([with_side(annotations("side"))], inventory(), CONFIG,
                      applied=applied(), vetoes=[veto])
    assert state.refusal(MAIN).message.startswith(
        "its plan is refused now (ContractInvalid: bad signature)")
    assert [c.key for c in state.containers] == [MAIN]
